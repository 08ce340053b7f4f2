"""GPU health: the pure assessment rule, and a clean "no GPU" report on a machine without one."""

import importlib.util

import pytest

from kiln.trainer.health import GpuSample, HealthReport, assess, probe


def test_healthy_gpus():
    r = assess([GpuSample(0, "H200", temperature_c=55, slowdown_temperature_c=90),
                GpuSample(1, "H200", temperature_c=60, slowdown_temperature_c=90, ecc_corrected=3)])
    assert r.status == "ok"
    assert r.condition == {"type": "GPUHealthy", "status": "True", "reason": "GPUsHealthy",
                           "message": "2 GPU(s) healthy"}
    m = r.metrics()
    assert m["gpu_count"] == 2 and m["gpu_temperature_max_c"] == 60 and m["gpu_healthy"] == 1.0


@pytest.mark.parametrize("sample,text", [
    (GpuSample(3, "H200", ecc_uncorrected=2), "GPU 3 (H200): 2 uncorrected ECC"),
    (GpuSample(1, xids=(79,)), "GPU 1: XID 79"),
    (GpuSample(0, remap_pending=True), "row remap pending"),
])
def test_failed_gpu_gives_a_false_condition_naming_it(sample, text):
    r = assess([GpuSample(7), sample])
    assert r.status == "failed"
    cond = r.condition
    assert cond["status"] == "False" and cond["reason"] == "GPUFailed" and text in cond["message"]
    assert r.metrics()["gpu_healthy"] == 0.0


def test_degraded_when_hot_or_warning_xid():
    hot = assess([GpuSample(0, temperature_c=86, slowdown_temperature_c=90)])
    assert hot.status == "degraded" and "86°C" in hot.reasons[0]
    assert assess([GpuSample(0, temperature_c=84, slowdown_temperature_c=90)]).status == "ok"
    assert assess([GpuSample(0, temperature_c=91)]).status == "degraded"  # no threshold known: 90 °C default
    x = assess([GpuSample(2, xids=(13,))])
    assert x.status == "degraded" and x.metrics()["gpu_xid_events"] == 1
    # fatal outranks degraded, and both reasons are kept
    both = assess([GpuSample(0, temperature_c=95, xids=(48,))])
    assert both.status == "failed" and len(both.reasons) == 2


def test_probe_reports_no_gpu_cleanly_or_samples_every_gpu():
    r = probe()
    if r.status != "no-gpu":  # a GPU machine: every device sampled, the rule applied
        assert r.samples and [s.index for s in r.samples] == list(range(len(r.samples)))
        assert r.status in ("ok", "degraded", "failed")
        return
    assert isinstance(r, HealthReport) and r.samples == []
    assert r.reasons[0].startswith("no GPU:")
    if importlib.util.find_spec("pynvml") is None:
        assert "nvidia-ml-py is not installed" in r.reasons[0]
    else:
        assert "NVML" in r.reasons[0]
    assert r.condition["status"] == "True" and r.condition["reason"] == "NoGPU"
    assert r.metrics()["gpu_count"] == 0
