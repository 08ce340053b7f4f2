"""What each trainer pod requests, and what of it the run's ClusterQueue lets through (Kueue never admits a
pod set with a request its ClusterQueue does not cover). Pure."""

from __future__ import annotations

from kiln.api.spec import TrainingSpecSpec
from kiln.control.config import OperatorConfig
from kiln.control.network import preset
from kiln.control.observed import Observed

GPU = "nvidia.com/gpu"

# What a request left out (queue_fit) costs the run, said in SpecAccepted's message.
LEFT_OUT_WHY = {"ephemeral-storage": "; the trainer still refuses data shards that do not fit the node's free disk",
                "memory": "; the pod has no memory limit and /dev/shm is bounded by the operator's default memory"}


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1e-3}


def quantity_bytes(quantity: str) -> int:
    """A byte quantity as the API takes it (kiln.api.spec.QUANTITY: 50Gi, 100G, 1000000) in bytes."""
    number = quantity.rstrip("kKMGTPEim")
    return int(float(number) * _SUFFIX[quantity[len(number):]])


def pod_resources(s: TrainingSpecSpec, config: OperatorConfig) -> dict[str, tuple[str, str | None]]:
    """What each trainer pod requests: resource → (quantity, the spec field that asks for it, or None for
    kiln's own default). Never a BestEffort pod (the first evicted): without spec cpu/memory the operator's
    defaults apply; local disk always (the kubelet evicts a pod past it; the trainer refuses data that
    cannot fit first, KILN_DATA_CACHE_BYTES)."""
    r = s.resources
    out: dict[str, tuple[str, str | None]] = {}
    if r.gpus_per_node:
        out[GPU] = (str(r.gpus_per_node), "resources.gpusPerNode")
    out["cpu"] = (r.cpu, "resources.cpu") if r.cpu else (config.default_cpu, None)
    out["memory"] = (r.memory, "resources.memory") if r.memory else (config.default_memory, None)
    out["ephemeral-storage"] = (r.ephemeral_storage, "resources.ephemeralStorage") if r.ephemeral_storage \
        else (config.default_ephemeral_storage, None)
    # extended resources (devices, huge pages): request = limit, as Kubernetes requires
    out |= {name: (quantity, "network.fabric") for name, quantity in preset(s.network).resources.items()}
    out |= {r.name: (r.quantity, f"pod.extraResources[{i}]") for i, r in enumerate(s.pod.extra_resources)}
    return out


def queue_fit(s: TrainingSpecSpec, config: OperatorConfig, observed: Observed) -> tuple[tuple[str, ...], list[str]]:
    """(requests to leave out, refusals) so that the run's ClusterQueue can admit it: Kueue never admits a
    pod set with a request its ClusterQueue does not cover, and says so only in the Workload. kiln's own
    defaults the queue does not cover are left out; a request the spec asks for is refused by field, with
    both fixes. A live job keeps what was left out when it was made (docs/scheduling.md)."""
    if observed.left_out is not None:
        return observed.left_out, []
    cov = observed.queue_coverage
    if cov is None:
        return (), []
    left_out, refusals = [], []
    for resource, (_, spec_field) in pod_resources(s, config).items():
        if cov.covers(resource):
            continue
        if spec_field is None:
            left_out.append(resource)
        else:
            refusals.append(
                f"spec.{spec_field}: the pods request {resource}, which ClusterQueue {cov.cluster_queue} (behind "
                f"LocalQueue {s.scheduling.queue}) does not cover, so Kueue would never admit the run; add "
                f"{resource} to the ClusterQueue's coveredResources with a quota, or leave spec.{spec_field} unset")
    return tuple(left_out), refusals
