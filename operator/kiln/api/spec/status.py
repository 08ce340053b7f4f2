"""status: written by the operator (phase, conditions, nodes, restarts, goodput, cost, queue, replica groups)
and trainer rank 0 (step, metrics, trainer time, GPU health, pre-flight, stragglers, hang, quorum)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from kiln.api.base import ApiModel
from kiln.api.contract import CONDITION_TYPES
from kiln.api.spec.limits import INT32_MAX, JSON_INT_MAX, MAX_REPLICA_GROUPS


Phase = Literal["Pending", "Queued", "Running", "Scaling", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]


class Condition(ApiModel):
    """A standard metav1.Condition."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    type: str = Field(..., max_length=316, description="Condition type, e.g. SpecAccepted, Running, Suspended.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(..., max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field("", max_length=32768, description="Human-readable details.")
    last_transition_time: str = Field(..., description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The spec generation this condition is about.")


class CheckpointRef(ApiModel):
    """The newest committed checkpoint."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="Training step the checkpoint holds.")
    uri: str = Field(..., description="Folder of the checkpoint, e.g. s3://bucket/run/step-00001000/.")
    time: str | None = Field(None, description="When it was committed (RFC 3339).")


class TrainerTime(ApiModel):
    """Cumulative seconds trainer rank 0 counted since the run started (carried in the checkpoint)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    productive_seconds: float = Field(0.0, ge=0, description="Completed, accepted optimizer steps.")
    checkpoint_stall_seconds: float = Field(0.0, ge=0, description="Training blocked on checkpoint staging/saving.")
    rollback_seconds: float = Field(0.0, ge=0, description="Steps undone or redone after a guard rollback.")
    degraded_seconds: float = Field(
        0.0, ge=0, description="Replica groups: of productiveSeconds, the steps taken with fewer than all groups live."
    )
    preflight_seconds: float = Field(0.0, ge=0, description="The pre-flight checks before step 1 of each start.")


GpuHealthState = Literal["Healthy", "Degrading", "Failing", "Unknown", "NotApplicable"]  # contract.GPU_HEALTH_STATES


class GpuState(ApiModel):
    """One GPU's health as NVML shows it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    index: int = Field(..., ge=0, le=INT32_MAX, description="NVML device index on the node.")
    state: GpuHealthState = Field(..., description="Healthy | Degrading | Failing | Unknown (NVML not readable).")


class NodeGpuHealth(ApiModel):
    """The GPUs of one node the run uses, as its trainer last read them through NVML."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    node: str = Field(..., max_length=253, description="The node (the pod's spec.nodeName).")
    state: GpuHealthState = Field(
        ..., description="The worst of its GPUs: Healthy, Degrading (near thermal slowdown, a warning XID, many "
        "corrected ECC errors), Failing (uncorrected ECC, a fatal XID, a pending row remap; the operator moves "
        "the run off the node at its next commit, as for Degrading), Unknown (a GPU node whose NVML cannot be "
        "read; never taken for Healthy) or NotApplicable (the run uses no GPU there).",
    )
    message: str = Field("", max_length=1024, description="Why, naming each GPU that is not Healthy.")
    gpus: list[GpuState] = Field(default_factory=list, max_length=64, description="Each GPU's state.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The training step it was read at.")


class LostSeconds(ApiModel):
    """Wall seconds lost, by cause."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    pending: float = Field(0.0, ge=0, description="Waiting for pods, capacity or a queue (Pending, Queued, Scaling).")
    restart: float = Field(0.0, ge=0, description="Restarting, plus steps redone after resuming from a commit.")
    gpu_failover: float = Field(0.0, ge=0, description="Moving the run off a node whose GPU health is Degrading or "
                                "Failing: from the commit request until the trainer reports from the new nodes.")
    checkpoint_stall: float = Field(0.0, ge=0, description="Training blocked on checkpoints.")
    rollback: float = Field(0.0, ge=0, description="Steps undone or redone after a guard rollback.")
    suspended: float = Field(0.0, ge=0, description="spec.suspend was true.")
    preempted: float = Field(0.0, ge=0, description="Queued after Kueue preempted the run, until it is admitted again.")
    preflight: float = Field(0.0, ge=0, description="The pre-flight check before step 1 of each start "
                             "(trainerTime.preflightSeconds).")


class SlowRank(ApiModel):
    """One rank below the others (pre-flight) or persistently slower than them (stragglers)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    rank: int = Field(..., ge=0, le=INT32_MAX, description="The trainer rank.")
    node: str = Field(..., max_length=253, description="Its node (the pod's spec.nodeName).")
    relative: float = Field(..., ge=0, description="Pre-flight: its matmul rate / the median's; stragglers: its own "
                            "step time / the median's.")
    value: float = Field(..., ge=0, description="Pre-flight: its matmul GFLOP/s; stragglers: its own seconds per step.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Stragglers: the step of the report that named it.")


class PreflightStatus(ApiModel):
    """The last pre-flight check (kiln.trainer.observe.preflight), trainer rank 0."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    checked_at: str = Field(..., max_length=64, description="When it ended (RFC 3339).")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="The step training started from after it.")
    seconds: float = Field(..., ge=0, description="How long it took on rank 0.")
    ranks: int = Field(..., ge=1, le=INT32_MAX, description="Ranks measured.")
    median_gflops: float = Field(..., ge=0, description="The ranks' median matmul GFLOP/s.")
    bandwidth_gbps: float | None = Field(None, ge=0, description="All-reduce bus bandwidth of the job's world "
                                         "group, GB/s (none in a world of one).")
    slow: list[SlowRank] = Field(default_factory=list, max_length=4096, description="Ranks below "
                                 "resources.preflight.minRelativeSpeed x the median.")


class HangStatus(ApiModel):
    """The last hang the trainer caught (kiln.trainer.observe.hang_report): where every rank's stacks are, and the
    ranks the others wait for."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    detected_at: str = Field(..., max_length=64, description="When rank 0 reported it (RFC 3339).")
    step: int = Field(..., ge=0, le=JSON_INT_MAX, description="The last step rank 0 completed.")
    stacks_uri: str = Field(..., max_length=2048, description="The folder of rank-N.txt stack dumps in the store.")
    ranks_reported: int = Field(..., ge=0, le=INT32_MAX, description="Ranks whose stacks reached the store.")
    waiting_for: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=list, max_length=4096,
        description="Ranks not inside a torch.distributed call while the others wait in one: whom they wait for.")


class TrackingStatus(ApiModel):
    """Trainer rank 0's experiment trackers (spec.tracking, kiln.trainer.observe.tracking) once one failed or
    records were dropped; absent while every tracker takes every record."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    dropped: int = Field(0, ge=0, le=JSON_INT_MAX, description="Records dropped because the queue in front of the "
                         "trackers (tracking.buffer) was full: a tracker that is down or slower than the steps.")
    error: str | None = Field(None, max_length=1024, description="Each failing tracker's first failure, "
                              "'<tracker>: <message>' (said once; training went on).")


class GpuHours(ApiModel):
    """GPU-hours (or their price) by cause: what the run's GPUs were held for. The causes add up to the total."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    productive: float = Field(0.0, ge=0, description="Held while stepping (trainerTime.productiveSeconds).")
    pending: float = Field(0.0, ge=0, description="Always 0: a Pending or Queued run's pods hold no GPU.")
    restart: float = Field(0.0, ge=0, description="Held while restarting, plus the steps redone after a resume.")
    checkpoint_stall: float = Field(0.0, ge=0, description="Held while training blocked on checkpoints.")
    rollback: float = Field(0.0, ge=0, description="Held while steps were undone or redone after a guard rollback.")
    suspended: float = Field(0.0, ge=0, description="Always 0: a Suspended run holds no GPU.")
    preempted: float = Field(0.0, ge=0, description="Always 0: a preempted run waits Queued, holding no GPU.")
    gpu_failover: float = Field(0.0, ge=0, description="Held while moving off a node whose GPUs degrade or fail.")
    preflight: float = Field(0.0, ge=0, description="Held while the pre-flight check ran before step 1.")
    other: float = Field(0.0, ge=0, description="Held while running but not stepping: start-up, restore, data waits.")


class CostStatus(ApiModel):
    """What the run's GPUs cost (the operator's view: nodes × gpusPerNode while its pods hold them × time)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    gpu_hours: float = Field(0.0, ge=0, description="GPU-hours the run held since it was created.")
    gpu_hours_by_cause: GpuHours = Field(default_factory=GpuHours, description="gpuHours by cause.")
    price_per_gpu_hour: float | None = Field(
        None, ge=0, description="The platform's price of a GPU-hour of the run's gpuType (operator setting "
        "KILN_GPU_PRICES, chart values cost.pricePerGpuHour); unset: no amount.")
    currency: str | None = Field(None, max_length=16, description="The price's currency (chart values cost.currency).")
    amount: float | None = Field(None, ge=0, description="gpuHours × pricePerGpuHour.")
    amount_by_cause: GpuHours | None = Field(None, description="amount by cause (the same causes as gpuHoursByCause).")


class ScalingPhase(ApiModel):
    """Throughput at one node count the run trained at (kiln.control.scaling)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    nodes: int = Field(..., ge=0, le=INT32_MAX, description="The node count.")
    workers: int = Field(..., ge=0, le=INT32_MAX, description="nodes × processes per node.")
    tokens_per_second_per_worker: float = Field(
        ..., ge=0, description="Moving average (weight 0.2 for the newest) of the trainer's reported tokens/s "
        "divided by workers; the first report at a node count (its start-up) is skipped.")
    reports: int = Field(..., ge=0, le=INT32_MAX, description="Trainer reports averaged.")
    efficiency: float | None = Field(
        None, ge=0, description="tokensPerSecondPerWorker / the reference phase's (referenceNodes): 1.0 is "
        "perfect scaling.")


class ScalingStatus(ApiModel):
    """Scaling efficiency per phase: is the larger world worth its GPUs?"""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    reference_nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="The first node count measured.")
    phases: list[ScalingPhase] = Field(default_factory=list, max_length=64, description="One entry per node count.")
    last_step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="The step of the last report folded in.")
    last_nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="The node count of the last report.")


class GoodputDetail(ApiModel):
    """The operator's goodput ledger; the rest of wallSeconds is start-up, restore and data waits."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    observed_at: str = Field(..., description="Time accounted up to (RFC 3339).")
    wall_seconds: float = Field(0.0, ge=0, description="Seconds since the run was created, up to observedAt.")
    productive_seconds: float = Field(0.0, ge=0, description="Productive step seconds credited.")
    degraded_seconds: float = Field(
        0.0, ge=0, description="Replica groups: of productiveSeconds, the seconds the run stepped with fewer than "
        "all groups live (degraded, still training; the time nothing stepped is in lostSeconds)."
    )
    lost_seconds: LostSeconds = Field(default_factory=LostSeconds, description="Lost seconds by cause.")
    gpu_seconds: dict[str, float] = Field(
        default_factory=dict, description="GPU-seconds held by cause (status.cost is this in hours and money)."
    )
    credited: dict[str, float] = Field(
        default_factory=dict, description="The trainerTime counters already accounted (the operator's baseline)."
    )


GROUP_QUEUE_MESSAGE_MAX = 1024  # status.replicaGroups[].queueMessage keeps this much of Kueue's message


class ReplicaGroupStatus(ApiModel):
    """One replica group's PyTorchJob, as the operator sees it (elastic.faultTolerance replicaGroups)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    group: int = Field(..., ge=0, le=INT32_MAX, description="The group's number (KILN_FT_GROUP).")
    job: str | None = Field(None, max_length=253, description="Its PyTorchJob, <run>-g<group>.")
    phase: Literal["Pending", "Running", "Restarting", "Succeeded", "Failed"] = Field(
        ..., description="Running: every pod of the group runs; Restarting: the group lost a pod and restarts "
        "alone while the others train on; Pending: not started (or held by a queue).")
    pods: int = Field(0, ge=0, le=INT32_MAX, description="Its pods running.")
    restarts: int = Field(0, ge=0, le=JSON_INT_MAX, description="Times the group left Running (a restart of it alone).")
    queued: bool | None = Field(
        None, description="scheduling.queue only: true while Kueue holds the group's PyTorchJob (not admitted yet, or "
        "evicted and waiting again); each group's job has a Workload of its own and is admitted alone.")
    queue_reason: str | None = Field(
        None, max_length=1024, description="Why it waits: Kueue's reason (Pending, Preempted, PodsReadyTimeout, ...) "
        "or kiln's own (NoWorkload, WaitingForKueue); Admitted once admitted.")
    queue_message: str | None = Field(
        None, max_length=GROUP_QUEUE_MESSAGE_MAX, description="Kueue's message for the group's Workload (e.g. which "
        f"quota is short), its first {GROUP_QUEUE_MESSAGE_MAX} characters.")
    admitted_at: str | None = Field(None, description="When Kueue last admitted the group (RFC 3339).")


class QuorumStatus(ApiModel):
    """The replica groups' last quorum, as trainer rank 0 of the group at replica rank 0 reports it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    id: int = Field(..., ge=-1, le=JSON_INT_MAX, description="The lighthouse's quorum id (it grows on each change).")
    live_groups: int = Field(..., ge=0, le=INT32_MAX, description="Groups that took part in the last step.")
    groups: int = Field(..., ge=1, le=INT32_MAX, description="elastic.faultTolerance.groups.")
    changes: int = Field(0, ge=0, le=JSON_INT_MAX, description="Quorum changes the reporting trainer has seen.")
    heals: int = Field(0, ge=0, le=JSON_INT_MAX, description="Times the reporting group healed from a live peer.")


TOPOLOGY_DOMAINS_MAX = 256  # status.queue.topology.domains lists at most this many (the first ones)


class QueueTopology(ApiModel):
    """Where Kueue's topology-aware scheduling placed the run."""

    levels: list[str] = Field(default_factory=list, max_length=16,
                              description="The Topology levels (node label keys) the domains are given in.")
    domains: list[str] = Field(
        default_factory=list, max_length=TOPOLOGY_DOMAINS_MAX,
        description="The domains the pods were placed in, each its values at the levels joined by '/' (with "
        f"kubernetes.io/hostname as the only level: the nodes); the first {TOPOLOGY_DOMAINS_MAX}.",
    )


class QueueStatus(ApiModel):
    """Where Kueue has the run (operator-written, only for a run with scheduling.queue)."""

    name: str = Field(..., max_length=63, description="The LocalQueue.")
    admitted_at: str | None = Field(None, description="When Kueue last admitted the run (RFC 3339).")
    cluster_queue: str | None = Field(None, max_length=253, description="The ClusterQueue that admitted it.")
    flavors: list[str] = Field(default_factory=list, max_length=64, description="The ResourceFlavors it was given.")
    topology: QueueTopology | None = Field(
        None, description="The topology domains Kueue placed it in (a flavor with a Kueue Topology only).")
    waiting_groups: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        None, max_length=MAX_REPLICA_GROUPS, description="elastic.faultTolerance replicaGroups: the groups Kueue has not admitted "
        "(each group is admitted alone; the run runs once one is, and admittedAt, clusterQueue and flavors are the "
        "lowest-numbered admitted group's). Empty once every group is admitted.")


class TrainingSpecStatus(ApiModel):
    """What the run is doing: the operator writes phase, conditions, nodes and goodput; trainer rank 0 writes
    progress and trainerTime."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    phase: Phase | None = Field(
        None, description="Pending | Queued | Running | Scaling | Restarting | Suspended | Succeeded | Failed."
    )
    nodes: int | None = Field(None, ge=0, le=INT32_MAX, description="Worker pods currently running.")
    step: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Last completed optimizer step.")
    progress: str | None = Field(None, description="step / training.steps as a percentage, e.g. '12.3%'.")
    eta_seconds: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Estimated seconds to the last step at the current rate.")
    tokens_per_second: float | None = Field(None, ge=0, description="Training throughput, all ranks together.")
    mfu: float | None = Field(None, ge=0, description="Model FLOPs utilisation (0..1).")
    last_checkpoint: CheckpointRef | None = Field(None, description="The newest committed checkpoint.")
    trainer_time: TrainerTime | None = Field(None, description="Trainer rank 0's cumulative time counters.")
    gpu_health: list[NodeGpuHealth] | None = Field(
        None, max_length=1024, description="Trainer rank 0: each node's GPU health, read through NVML at the "
        "trainer's first step, then every resources.gpuHealthIntervalSeconds (at the end of the step in which "
        "the interval passes).",
    )
    goodput: float | None = Field(
        None, ge=0, le=1, description="Productive step seconds / wall seconds since the run was created (operator)."
    )
    goodput_detail: GoodputDetail | None = Field(None, description="Wall, productive and lost seconds by cause.")
    cost: CostStatus | None = Field(None, description="GPU-hours held by cause, and their price where the platform "
                                    "set one for the run's gpuType.")
    preflight: PreflightStatus | None = Field(None, description="The last pre-flight check: each rank's matmul "
                                              "rate against the median, the world's bandwidth, the slow ranks.")
    stragglers: list[SlowRank] | None = Field(
        None, max_length=4096, description="Ranks whose own step time stayed above resources.stragglers.factor x the "
        "median for resources.stragglers.window reports (trainer); empty when none is.")
    tracking: TrackingStatus | None = Field(None, description="Set when an experiment tracker failed or records "
                                            "were dropped (trainer); absent while tracking is well.")
    hang: HangStatus | None = Field(None, description="The last hang the trainer caught: its stacks and the "
                                    "rank the others waited for.")
    scaling: ScalingStatus | None = Field(None, description="Tokens/s per worker at each node count, relative to the "
                                          "first (scaling efficiency per phase).")
    restarts: int | None = Field(None, ge=0, le=JSON_INT_MAX, description="Times the PyTorchJob entered Restarting.")
    queue: QueueStatus | None = Field(None, description="Kueue: the queue, and when and where it admitted the run.")
    replica_groups: list[ReplicaGroupStatus] | None = Field(
        None, max_length=MAX_REPLICA_GROUPS, description="elastic.faultTolerance replicaGroups: each group's PyTorchJob (operator)."
    )
    quorum: QuorumStatus | None = Field(
        None, description="elastic.faultTolerance replicaGroups: the last quorum of live groups (trainer)."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description=f"metav1.Conditions: {', '.join(CONDITION_TYPES)}."
    )
    observed_generation: int | None = Field(
        None, ge=0, le=JSON_INT_MAX, description="The metadata.generation the operator acted on last."
    )
