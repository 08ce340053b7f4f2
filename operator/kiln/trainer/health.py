"""GPU health through NVML (nvidia-ml-py): temperature, ECC errors, XID events → metrics and a condition.

`probe()` reads this node's GPUs (NVML import and init guarded: on a machine without a GPU or driver it
returns a report with status "no-gpu" and says why); `assess()` is the pure rule turning samples into a
`HealthReport` whose `condition` (a metav1.Condition-shaped dict, type GPUHealthy) the trainer puts into
its status patch so the operator can act: a "failed" GPU marks its node as a failure (see
kiln.control.elastic.record_node_failures) and the job restarts without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# XIDs that mean the GPU or its memory can no longer be trusted (NVIDIA's XID catalogue):
# 48 double-bit ECC, 63/64 row-remapping events/failure, 74 NVLink error, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC error, 119/120 GSP errors.
FATAL_XIDS = frozenset({48, 64, 74, 79, 94, 95, 119, 120})
WARN_XIDS = frozenset({13, 31, 43, 45, 63, 92})


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
    status: str  # ok | degraded | failed | no-gpu
    reasons: list[str] = field(default_factory=list)
    samples: list[GpuSample] = field(default_factory=list)

    @property
    def condition(self) -> dict:
        healthy = self.status in ("ok", "no-gpu")
        reason = {"ok": "GPUsHealthy", "no-gpu": "NoGPU", "degraded": "GPUDegraded", "failed": "GPUFailed"}[self.status]
        return {"type": "GPUHealthy", "status": "True" if healthy else "False", "reason": reason,
                "message": "; ".join(self.reasons) or f"{len(self.samples)} GPU(s) healthy"}

    def metrics(self) -> dict[str, float]:
        temps = [s.temperature_c for s in self.samples if s.temperature_c is not None]
        return {"gpu_count": len(self.samples),
                "gpu_temperature_max_c": max(temps) if temps else 0.0,
                "gpu_ecc_uncorrected": sum(s.ecc_uncorrected for s in self.samples),
                "gpu_ecc_corrected": sum(s.ecc_corrected for s in self.samples),
                "gpu_xid_events": sum(len(s.xids) for s in self.samples),
                "gpu_healthy": 1.0 if self.status in ("ok", "no-gpu") else 0.0}


def assess(samples: list[GpuSample], *, temp_margin_c: float = 5.0, max_temp_c: float = 90.0,
           corrected_ecc_warn: int = 1000) -> HealthReport:
    """Failed: uncorrected ECC, a fatal XID, a pending row remap. Degraded: near thermal slowdown, a
    warning XID, many corrected ECC errors. Pure, so the rule is tested without a GPU."""
    failed, degraded = [], []
    for s in samples:
        gpu = f"GPU {s.index}" + (f" ({s.name})" if s.name else "")
        if s.ecc_uncorrected:
            failed.append(f"{gpu}: {s.ecc_uncorrected} uncorrected ECC error(s)")
        if s.remap_pending:
            failed.append(f"{gpu}: row remap pending, needs a reset")
        bad = sorted(set(s.xids) & FATAL_XIDS)
        if bad:
            failed.append(f"{gpu}: XID {', '.join(map(str, bad))}")
        warn = sorted(set(s.xids) & WARN_XIDS)
        if warn:
            degraded.append(f"{gpu}: XID {', '.join(map(str, warn))}")
        if s.temperature_c is not None:
            limit = (s.slowdown_temperature_c - temp_margin_c) if s.slowdown_temperature_c else max_temp_c
            if s.temperature_c >= limit:
                degraded.append(f"{gpu}: {s.temperature_c:.0f}°C, at or above {limit:.0f}°C (thermal slowdown near)")
        if s.ecc_corrected >= corrected_ecc_warn:
            degraded.append(f"{gpu}: {s.ecc_corrected} corrected ECC errors")
    if failed:
        return HealthReport("failed", failed + degraded, samples)
    if degraded:
        return HealthReport("degraded", degraded, samples)
    return HealthReport("ok", [], samples)


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
            self.unavailable = "no GPU: nvidia-ml-py is not installed (pip install 'kiln[gpu]')"
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as err:
            self.unavailable = f"no GPU: NVML unavailable ({err})"
            return
        self.nvml = pynvml
        if not self.handles:
            self.unavailable = "no GPU: NVML sees no devices"
            return
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

    def probe(self) -> HealthReport:
        if self.nvml is None:
            return HealthReport("no-gpu", [self.unavailable or "no GPU"], [])
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


def probe() -> HealthReport:
    """One-shot health report of this node's GPUs ("no-gpu" with the reason where there is none)."""
    monitor = GpuMonitor()
    try:
        return monitor.probe()
    finally:
        monitor.close()
