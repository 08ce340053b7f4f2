"""GPU health through NVML (nvidia-ml-py): temperature, ECC errors, XID events, row remaps → a state per GPU.

`assess()` is the pure rule turning samples into a `HealthReport`: each GPU Healthy, Degrading or Failing
(kiln.api.contract.GPU_HEALTH_STATES), the node's state the worst of them. `GpuMonitor.probe()` reads this
node's GPUs; where NVML cannot be read (nvidia-ml-py missing, no driver, no device) the report says why and
is Unknown on a node that has GPUs for this process (`expected_gpus()`), NotApplicable on a CPU-only one:
never Healthy. `NodeHealth` is what every rank's node contributes: trainer rank 0 gathers them
(kiln.trainer.guards), reports them in status.gpuHealth (kiln.trainer.observe.status_report) and as the gauge
kiln_gpu_health{node,gpu} (kiln.trainer.observe.exporter); the operator moves the run off a Degrading or Failing
node at its next commit (kiln.control.failover).
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass, field

from kiln.api import contract
from kiln.api.contract import GPU_DEGRADING, GPU_FAILING, GPU_HEALTHY, GPU_NOT_APPLICABLE, GPU_UNKNOWN

# XIDs that mean the GPU or its memory can no longer be trusted (NVIDIA's XID catalogue):
# 48 double-bit ECC, 63/64 row-remapping events/failure, 74 NVLink error, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC error, 119/120 GSP errors.
FATAL_XIDS = frozenset({48, 64, 74, 79, 94, 95, 119, 120})
WARN_XIDS = frozenset({13, 31, 43, 45, 63, 92})
_RANK = {GPU_HEALTHY: 0, GPU_DEGRADING: 1, GPU_FAILING: 2}
MESSAGE_MAX = 1024  # of a status entry's message


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str = ""
    temperature_c: float | None = None
    slowdown_temperature_c: float | None = None  # the driver throttles above this
    ecc_uncorrected: int = 0  # volatile (since driver load) uncorrected ECC errors
    ecc_corrected: int = 0
    remap_pending: bool = False  # a row remap waits for a GPU reset
    xids: tuple[int, ...] = ()  # XID events seen since the last probe


@dataclass(frozen=True)
class HealthReport:
    state: str  # kiln.api.contract.GPU_HEALTH_STATES: the worst GPU's, or Unknown / NotApplicable
    reasons: list[str] = field(default_factory=list)
    samples: list[GpuSample] = field(default_factory=list)
    gpus: dict[int, str] = field(default_factory=dict)  # GPU index → its state (Unknown ones included)

    def metrics(self) -> dict[str, float]:
        """Numbers for the step's record (metrics.jsonl); none of them claims health where none was read."""
        temps = [s.temperature_c for s in self.samples if s.temperature_c is not None]
        out = {"gpu_count": len(self.gpus)}
        if self.samples:
            out.update(gpu_temperature_max_c=max(temps) if temps else None,
                       gpu_ecc_uncorrected=sum(s.ecc_uncorrected for s in self.samples),
                       gpu_ecc_corrected=sum(s.ecc_corrected for s in self.samples),
                       gpu_xid_events=sum(len(s.xids) for s in self.samples))
        return {k: v for k, v in out.items() if v is not None}

    def entry(self, node: str, step: int | None = None) -> dict:
        """This node's entry of status.gpuHealth (camelCase, as in the CRD)."""
        out: dict = {"node": node, "state": self.state,
                     "gpus": [{"index": i, "state": s} for i, s in sorted(self.gpus.items())]}
        if self.reasons:
            out["message"] = "; ".join(self.reasons)[:MESSAGE_MAX]
        if step is not None:
            out["step"] = step
        return out


def assess(samples: list[GpuSample], *, temp_margin_c: float = 5.0, max_temp_c: float = 90.0,
           corrected_ecc_warn: int = 1000) -> HealthReport:
    """Failing: uncorrected ECC, a fatal XID, a pending row remap. Degrading: near thermal slowdown, a
    warning XID, many corrected ECC errors. Pure, so the rule is tested without a GPU."""
    failed, degraded, gpus = [], [], {}
    for s in samples:
        gpu = f"GPU {s.index}" + (f" ({s.name})" if s.name else "")
        bad, warn = [], []
        if s.ecc_uncorrected:
            bad.append(f"{gpu}: {s.ecc_uncorrected} uncorrected ECC error(s)")
        if s.remap_pending:
            bad.append(f"{gpu}: row remap pending, needs a reset")
        fatal = sorted(set(s.xids) & FATAL_XIDS)
        if fatal:
            bad.append(f"{gpu}: XID {', '.join(map(str, fatal))}")
        warned = sorted(set(s.xids) & WARN_XIDS)
        if warned:
            warn.append(f"{gpu}: XID {', '.join(map(str, warned))}")
        if s.temperature_c is not None:
            limit = (s.slowdown_temperature_c - temp_margin_c) if s.slowdown_temperature_c else max_temp_c
            if s.temperature_c >= limit:
                warn.append(f"{gpu}: {s.temperature_c:.0f}°C, at or above {limit:.0f}°C (thermal slowdown near)")
        if s.ecc_corrected >= corrected_ecc_warn:
            warn.append(f"{gpu}: {s.ecc_corrected} corrected ECC errors")
        gpus[s.index] = GPU_FAILING if bad else GPU_DEGRADING if warn else GPU_HEALTHY
        failed += bad
        degraded += warn
    if not samples:
        return HealthReport(GPU_UNKNOWN, ["NVML lists no GPU"], samples, gpus)
    state = max(gpus.values(), key=_RANK.__getitem__)
    return HealthReport(state, failed + degraded, samples, gpus)


def unreadable(why: str, expected: int) -> HealthReport:
    """No NVML reading: Unknown on a node with `expected` GPUs for this process, NotApplicable without."""
    if expected > 0:
        return HealthReport(GPU_UNKNOWN, [f"GPU health unknown: {why}"], [], dict.fromkeys(range(expected),
                                                                                          GPU_UNKNOWN))
    return HealthReport(GPU_NOT_APPLICABLE, [f"no GPU in use: {why}"], [], {})


def expected_gpus() -> int:
    """How many GPUs this process was given: CUDA's device count, else the NVIDIA container runtime's
    NVIDIA_VISIBLE_DEVICES (the device plugin sets it on a GPU pod), else 0 (a CPU process)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if visible in ("", "void", "none"):
        return 0
    if visible == "all":
        return max(1, len(glob.glob("/dev/nvidia[0-9]*")))
    return len([d for d in visible.split(",") if d.strip()])


def node_name() -> str:
    """The node this process runs on: the pod's spec.nodeName (KILN_NODE_NAME), else the host name."""
    return os.environ.get(contract.NODE_NAME) or socket.gethostname()


class GpuMonitor:
    """Owns the NVML session and an XID event set; `probe()` samples every GPU of this node."""

    def __init__(self) -> None:
        self.nvml = None
        self.handles: list = []
        self.events = None
        self.unavailable: str | None = None
        try:
            import pynvml  # nvidia-ml-py: in the trainer image's `gpu` extra
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed (pip install 'kiln[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as err:
            self.unavailable = f"NVML unavailable ({err})"
            return
        if not self.handles:
            self.unavailable = "NVML sees no devices"
            pynvml.nvmlShutdown()
            return
        self.nvml = pynvml
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for h in self.handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
        except pynvml.NVMLError:
            self.events = None  # XID events need root on some drivers; the other signals still work

    def _read(self, call, *args, default=None):
        try:
            return call(*args)
        except self.nvml.NVMLError:
            return default

    def _drain_xids(self) -> dict[int, list[int]]:
        seen: dict[int, list[int]] = {}
        if self.events is None:
            return seen
        nv = self.nvml
        while True:
            try:
                data = nv.nvmlEventSetWait(self.events, 0)
            except nv.NVMLError:  # timeout: no more events
                return seen
            index = next((i for i, h in enumerate(self.handles)
                          if self._read(nv.nvmlDeviceGetIndex, h) == self._read(nv.nvmlDeviceGetIndex, data.device)),
                         -1)
            seen.setdefault(index, []).append(int(data.eventData))

    def probe(self, expected: int = 0) -> HealthReport:
        """This node's GPUs; where NVML cannot be read, Unknown if `expected` > 0 GPUs, else NotApplicable."""
        if self.nvml is None:
            return unreadable(self.unavailable or "NVML unavailable", expected)
        nv = self.nvml
        xids = self._drain_xids()
        samples = []
        for i, h in enumerate(self.handles):
            name = self._read(nv.nvmlDeviceGetName, h, default="")
            samples.append(GpuSample(
                index=i, name=name.decode() if isinstance(name, bytes) else name,
                temperature_c=self._read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                slowdown_temperature_c=self._read(nv.nvmlDeviceGetTemperatureThreshold, h,
                                                  nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                ecc_uncorrected=self._read(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                           nv.NVML_VOLATILE_ECC, default=0) or 0,
                ecc_corrected=self._read(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                         nv.NVML_VOLATILE_ECC, default=0) or 0,
                remap_pending=bool((self._read(nv.nvmlDeviceGetRemappedRows, h, default=(0, 0, 0, 0)) or (0,) * 4)[2]),
                xids=tuple(xids.get(i, ())),
            ))
        return assess(samples)

    def close(self) -> None:
        if self.nvml is not None:
            if self.events is not None:
                self._read(self.nvml.nvmlEventSetFree, self.events)
            self._read(self.nvml.nvmlShutdown)
            self.nvml = None


def probe(expected: int | None = None) -> HealthReport:
    """One-shot health report of this node's GPUs (expected: GPUs this process should see; default
    `expected_gpus()`)."""
    monitor = GpuMonitor()
    try:
        return monitor.probe(expected_gpus() if expected is None else expected)
    finally:
        monitor.close()


def gather(entry: dict | None) -> list[dict]:
    """Every node's status.gpuHealth entry, on every rank (each node's local rank 0 brings one, the other
    ranks None), sorted by node. A collective: every rank of the job calls it at the same step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [entry] if entry is not None else []
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    by_node = {e["node"]: e for e in entries if e is not None}
    return [by_node[n] for n in sorted(by_node)]
