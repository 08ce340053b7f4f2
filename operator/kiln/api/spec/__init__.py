"""The TrainingSpec API (`kiln.dev/v1alpha1`): the contract between users, the operator and the trainer.

Field names are camelCase on the wire (YAML, the CRD) and snake_case in Python. Every field's
description is what `kubectl explain trainingspec.spec.<path>` shows, so write it for users.
Cross-field rules live in `kiln.api.rules` and are enforced by pydantic here and by CEL in the CRD.

One module per section of the spec (model, data, training, resources, elastic, checkpoint, scheduling,
tracking), the status, and the document that joins them; this package re-exports every name, so
`from kiln.api.spec import X` is the one import path.
"""

from kiln.api.spec.limits import (  # noqa: F401
    GROUP, VERSION, KIND, PLURAL, API_VERSION, INT32_MAX, JSON_INT_MAX, DEFAULT_DATA_URI, JSON_INT_MIN,
    MAX_REPLICA_GROUPS,
)
from kiln.api.spec.model import (  # noqa: F401
    PresetName, LORA_TARGETS, EXPERT_TARGETS, LoraTarget, AdapterSpec, MoESpec, ModelSpec,
)
from kiln.api.spec.data import (  # noqa: F401
    DataSource, DataSpec,
)
from kiln.api.spec.training import (  # noqa: F401
    TrainingConfig, ParallelismSpec,
)
from kiln.api.spec.resources import (  # noqa: F401
    Toleration, PreflightSpec, StragglerSpec, ResourcesSpec,
)
from kiln.api.spec.elastic import (  # noqa: F401
    PhasePlanEntry, FaultToleranceSpec, ElasticSpec,
)
from kiln.api.spec.checkpoint import (  # noqa: F401
    CheckpointSpec,
)
from kiln.api.spec.scheduling import (  # noqa: F401
    LABEL_KEY, LABEL_PREFIX_MAX, TopologySpec, SchedulingSpec,
)
from kiln.api.spec.tracking import (  # noqa: F401
    MlflowTracking, WandbTracking, TrackingSpec,
)
from kiln.api.spec.status import (  # noqa: F401
    Phase, PHASES, Condition, CheckpointRef, TrainerTime, GpuHealthState, GpuState, NodeGpuHealth,
    LostSeconds, SlowRank, PreflightStatus, HangStatus, TrackingStatus, GpuHours, CostStatus, ScalingPhase, ScalingStatus,
    GoodputDetail, GROUP_QUEUE_MESSAGE_MAX, ReplicaGroupStatus, QuorumStatus, TOPOLOGY_DOMAINS_MAX,
    QueueTopology, QueueStatus, TrainingSpecStatus,
)
from kiln.api.spec.document import (  # noqa: F401
    TrainingSpecSpec, ObjectMeta, TrainingSpec,
)
