"""The operator's own settings (not per run): defaults the plan fills in, read from the environment."""

from __future__ import annotations

import os
import json
from dataclasses import dataclass, field as dataclass_field

from kiln import __version__
from kiln.control.policy import AdminPolicy

DEFAULT_IMAGE = f"ghcr.io/kiln-dev/kiln-trainer:{__version__}"


@dataclass(frozen=True)
class Pricing:
    """What a GPU-hour costs, per resources.gpuType (the node label's value), for status.cost. A type without a
    price gets GPU-hours and no money."""

    per_gpu_hour: tuple[tuple[str, float], ...] = ()  # (gpuType, price) pairs: hashable, as the config is frozen
    currency: str = "USD"

    def of(self, gpu_type: str | None) -> float | None:
        return dict(self.per_gpu_hour).get(gpu_type) if gpu_type else None

    @classmethod
    def parse(cls, prices_json: str, currency: str = "USD") -> "Pricing":
        """KILN_GPU_PRICES: a JSON object {gpuType: price per GPU-hour}, e.g. {"NVIDIA-H200": 3.5}."""
        prices = json.loads(prices_json or "{}")
        if not isinstance(prices, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and v >= 0 for v in prices.values()):
            raise ValueError(f"KILN_GPU_PRICES must be a JSON object of non-negative numbers, got {prices_json!r}")
        return cls(tuple(sorted((str(k), float(v)) for k, v in prices.items())), currency)


@dataclass(frozen=True)
class OperatorConfig:
    image: str = DEFAULT_IMAGE  # trainer image when spec.image is unset
    image_pull_policy: str = "IfNotPresent"
    # PyTorchJob runPolicy.cleanPodPolicy: None | Running | All. None keeps a finished run's pods (Completed,
    # holding no resources) so `kiln logs` still reads them. Running would delete the pods still running
    # when the job ends, and an elastic job ends Succeeded as soon as ANY worker exits 0: rank 0's pod,
    # still writing its last status and log lines, would be deleted. A Failed run's pods are stopped by
    # the operator itself (kiln.control.status.pods_to_stop), so a failure holds no GPU either way.
    clean_pod_policy: str = "None"
    rdzv_port: int = 29400
    # SIGTERM → pod kill: the time a trainer gets to stage a checkpoint when its pod is deleted
    # (suspend, scale-down, preemption).
    termination_grace_seconds: int = 120
    # Where checkpoints go when spec.checkpoint.uri is unset: a pod-local emptyDir (lost with the pod).
    scratch_dir: str = "/var/lib/kiln"
    # Requests (and the memory limit) of a trainer pod whose spec sets no cpu/memory: never a BestEffort pod,
    # the first to be evicted, and /dev/shm (memory-backed) is bounded by the memory limit.
    default_cpu: str = "1"
    default_memory: str = "4Gi"
    # Local disk request = limit of a trainer pod whose spec sets no resources.ephemeralStorage: the node's disk
    # is shared, and every pod downloads its own copy of the data shards.
    default_ephemeral_storage: str = "50Gi"
    # Kueue's own resources.excludeResourcePrefixes (its Configuration): requests Kueue ignores, which kiln then
    # does not hold against a ClusterQueue's coveredResources (kiln.control.requests.queue_fit)
    kueue_excluded_resource_prefixes: tuple[str, ...] = ()
    field_manager: str = "kiln-operator"
    health_port: int = 8080
    metrics_port: int = 9090  # Prometheus /metrics (kiln.control.metrics); 0 disables
    # The trainer's rank 0 serves /metrics here in its pod (kiln.trainer.observe.exporter); 0: no trainer metrics.
    trainer_metrics_port: int = 9400
    # Pods of this namespace may reach the trainers' metrics port (the run's NetworkPolicy); empty: none outside
    # the run. Its metrics carry the run's data URIs.
    monitoring_namespace: str = "monitoring"
    # Every run's objects are applied again this often (periodic resync): what someone else deleted or
    # changed in the fields kiln sets comes back. A deleted PyTorchJob is re-created at once (its watch).
    resync_seconds: float = 300.0
    # `[NAMESPACE/]NAME` of the Lease that decides which operator acts (kiln.control.leader.location);
    # empty: kiln-operator in the operator's namespace.
    leader_lease: str = ""

    # Price per GPU-hour by gpuType for status.cost (chart values cost.*; env KILN_GPU_PRICES, KILN_CURRENCY)
    pricing: Pricing = dataclass_field(default_factory=Pricing)

    # What a namespace user may put into trainer pods (images, priority classes, nodes); kiln.control.policy
    policy: AdminPolicy = AdminPolicy()  # frozen: one shared default is safe

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "OperatorConfig":
        env = dict(os.environ if env is None else env)
        kwargs = {}
        for field, var, conv in (
            ("image", "KILN_TRAINER_IMAGE", str),
            ("image_pull_policy", "KILN_IMAGE_PULL_POLICY", str),
            ("clean_pod_policy", "KILN_CLEAN_POD_POLICY", str),
            ("termination_grace_seconds", "KILN_TERMINATION_GRACE_SECONDS", int),
            ("default_cpu", "KILN_DEFAULT_CPU", str),
            ("default_memory", "KILN_DEFAULT_MEMORY", str),
            ("default_ephemeral_storage", "KILN_DEFAULT_EPHEMERAL_STORAGE", str),
            ("health_port", "KILN_HEALTH_PORT", int),
            ("metrics_port", "KILN_METRICS_PORT", int),
            ("trainer_metrics_port", "KILN_TRAINER_METRICS_PORT", int),
            ("resync_seconds", "KILN_RESYNC_SECONDS", float),
            ("leader_lease", "KILN_LEADER_LEASE", str),
        ):
            if env.get(var):
                kwargs[field] = conv(env[var])
        if "KILN_MONITORING_NAMESPACE" in env:  # set empty: no namespace
            kwargs["monitoring_namespace"] = env["KILN_MONITORING_NAMESPACE"].strip()
        if prefixes := env.get("KILN_KUEUE_EXCLUDED_RESOURCE_PREFIXES"):
            kwargs["kueue_excluded_resource_prefixes"] = tuple(p.strip() for p in prefixes.split(",") if p.strip())
        pricing = Pricing.parse(env.get("KILN_GPU_PRICES", ""), env.get("KILN_CURRENCY") or "USD")
        return cls(**kwargs, pricing=pricing, policy=AdminPolicy.from_env(env))
