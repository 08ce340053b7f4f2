"""GPU health: the pure assessment rule, and a clean report on a machine without NVML (never "healthy")."""

import importlib.util

import pytest

from kiln.trainer.observe.gpu_health import GpuSample, HealthReport, assess, expected_gpus, probe


def test_healthy_gpus():
    r = assess([GpuSample(0, "H200", temperature_c=55, slowdown_temperature_c=90),
                GpuSample(1, "H200", temperature_c=60, slowdown_temperature_c=90, ecc_corrected=3)])
    assert r.state == "Healthy" and r.gpus == {0: "Healthy", 1: "Healthy"} and r.reasons == []
    m = r.metrics()
    assert m["gpu_count"] == 2 and m["gpu_temperature_max_c"] == 60 and m["gpu_ecc_corrected"] == 3


@pytest.mark.parametrize("sample,text", [
    (GpuSample(3, "H200", ecc_uncorrected=2), "GPU 3 (H200): 2 uncorrected ECC"),
    (GpuSample(1, xids=(79,)), "GPU 1: XID 79"),
    (GpuSample(0, remap_pending=True), "row remap pending"),
])
def test_a_failing_gpu_is_named(sample, text):
    r = assess([GpuSample(7), sample])
    assert r.state == "Failing" and r.gpus[sample.index] == "Failing" and r.gpus[7] == "Healthy"
    assert text in r.entry("n")["message"]


def test_degrading_when_hot_or_warning_xid():
    hot = assess([GpuSample(0, temperature_c=86, slowdown_temperature_c=90)])
    assert hot.state == "Degrading" and "86°C" in hot.reasons[0]
    assert assess([GpuSample(0, temperature_c=84, slowdown_temperature_c=90)]).state == "Healthy"
    assert assess([GpuSample(0, temperature_c=91)]).state == "Degrading"  # no threshold known: 90 °C default
    x = assess([GpuSample(2, xids=(13,))])
    assert x.state == "Degrading" and x.metrics()["gpu_xid_events"] == 1
    # failing outranks degrading, and both reasons are kept
    both = assess([GpuSample(0, temperature_c=95, xids=(48,))])
    assert both.state == "Failing" and len(both.reasons) == 2


def test_probe_on_this_machine_is_read_or_says_why_never_healthy_unread():
    r = probe()
    if r.samples:  # a GPU machine: every device sampled, the rule applied
        assert [s.index for s in r.samples] == list(range(len(r.samples)))
        assert r.state in ("Healthy", "Degrading", "Failing")
        return
    assert isinstance(r, HealthReport) and r.state == ("Unknown" if expected_gpus() else "NotApplicable")
    if importlib.util.find_spec("pynvml") is None:
        assert "nvidia-ml-py is not installed" in r.reasons[0]
    else:
        assert "NVML" in r.reasons[0]
    assert r.metrics()["gpu_count"] == len(r.gpus)
