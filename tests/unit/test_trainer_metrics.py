"""What the run says it measures: MFU only against a known peak, and which kernels run and why."""

from __future__ import annotations

import pytest
import torch

from kiln.api.presets import Arch
from kiln.trainer.model import kernels

from kiln.trainer.observe import metrics
from kiln.trainer.observe.status_report import status_patch

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu_named(monkeypatch):
    """Pretend device 0 is a GPU of the given name (only its name is read)."""
    return lambda name: monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_cpu_has_no_peak_so_no_mfu_and_the_run_says_why():
    cpu = torch.device("cpu")
    assert metrics.peak_flops(cpu, "fp32") is None and metrics.peak_flops(cpu, "bf16") is None
    assert metrics.mfu_note(cpu, "fp32") == "mfu: not reported on CPU (no known peak; tokens/s is the measure)"


def test_an_unknown_gpu_gets_no_peak_not_the_h100s(gpu_named):
    gpu_named("NVIDIA GeForce RTX 4090")
    assert metrics.peak_flops(CUDA, "bf16") is None
    assert "no bf16 peak known for 'NVIDIA GeForce RTX 4090'" in metrics.mfu_note(CUDA, "bf16")


# Names as the drivers report them (nvidia-smi --query-gpu=name; rocm-smi's marketing name).
REPORTED = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
            "NVIDIA H200": "h200-sxm", "NVIDIA H200 NVL": "h200-nvl", "NVIDIA A100-SXM4-40GB": "a100-40gb-sxm",
            "NVIDIA A100-SXM4-80GB": "a100-80gb-sxm", "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie",
            "NVIDIA A100 80GB PCIe": "a100-80gb-pcie", "NVIDIA L40S": "l40s", "NVIDIA B200": "b200",
            "AMD Instinct MI300X": "mi300x"}


def test_each_reported_name_is_one_product_with_both_peaks_and_the_run_names_it(gpu_named):
    assert sorted(REPORTED.values()) == sorted({kind for kind, _ in metrics.PEAK_FLOPS})  # every product is reachable
    for name, kind in REPORTED.items():
        gpu_named(name)
        assert metrics.device_kind(CUDA) == kind, name
        bf16, fp32 = metrics.peak_flops(CUDA, "bf16"), metrics.peak_flops(CUDA, "fp32")
        assert bf16 is not None and fp32 is not None and bf16 > fp32, name  # tensor cores beat plain fp32
        assert f"against the {kind.upper()} bf16 datasheet peak" in metrics.mfu_note(CUDA, "bf16")


def test_the_pcie_and_nvl_parts_are_not_measured_against_the_sxm_peak(gpu_named):
    peaks = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL"):
        gpu_named(name)
        peaks[name] = metrics.peak_flops(CUDA, "bf16")
    # The same work on a PCIe card is a larger share of its (lower-clocked) peak than of the SXM part's.
    assert peaks["NVIDIA H100 PCIe"] < peaks["NVIDIA H100 NVL"] < peaks["NVIDIA H100 80GB HBM3"]
    assert peaks["NVIDIA H200 NVL"] < peaks["NVIDIA H200"]


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA GB200", "NVIDIA L40", "NVIDIA H800",
                                  "NVIDIA H100", "NVIDIA A100 PCIe", "AMD Instinct MI300A", "NVIDIA H20"])
def test_a_name_that_does_not_identify_one_product_gets_no_mfu(gpu_named, name):
    """Lookalikes (GH200 holds an H200-class GPU, GB200 two B200 dies) and names without the form factor or
    memory size that set the peak: no MFU rather than a neighbour's peak."""
    gpu_named(name)
    assert metrics.peak_flops(CUDA, "bf16") is None
    assert f"no bf16 peak known for {name!r}" in metrics.mfu_note(CUDA, "bf16")


def test_a_record_without_mfu_is_shown_and_reported_without_it(capsys):
    record = {"step": 3, "loss": 2.0, "lr": 1e-3, "tokens_per_second": 1234.0, "mfu": None}
    console = metrics._Console(10, 0)
    console.update(record)
    line = capsys.readouterr().out
    assert "1,234 tok/s" in line and "mfu" not in line
    assert "mfu" not in status_patch(record, None, 10)["status"]


@pytest.fixture
def kernel_state(monkeypatch):
    """Set the switch's mode and what Triton import gave, as on another machine."""
    def set_state(mode="fused", ops=None, why=""):
        monkeypatch.setattr(kernels, "_MODE", mode)
        monkeypatch.setattr(kernels, "_TRITON_OPS", ops)
        monkeypatch.setattr(kernels, "_NO_TRITON_WHY", why)
    return set_state


class _Ops:
    MAX_FUSED_COLS = 65536


@pytest.mark.parametrize("state,device,kw,expected", [
    ({}, torch.device("cpu"), {"compiled": True},
     "kernels: the PyTorch reference under torch.compile, because the run is on CPU"),
    ({"mode": "reference", "ops": _Ops}, CUDA, {},
     "kernels: the PyTorch reference (eager), because parallelism.kernels is reference"),
    ({"why": "Triton does not import (No module named 'triton')"}, CUDA, {"compiled": True},
     "kernels: the PyTorch reference under torch.compile, because Triton does not import (No module named 'triton')"),
    ({"ops": _Ops}, CUDA, {"tensor_parallel": 2},
     "kernels: Triton for swiglu and apply_rope (each rank's local shard); rms_norm: the PyTorch reference (eager), "
     "because tensor parallel (2) passes it sequence-sharded DTensors; the loss from the logits"),
    ({"ops": _Ops}, CUDA, {"dim": 70000},
     "kernels: Triton, except rms_norm: the PyTorch reference (eager) (dim 70000 > 65536 columns)"),
    ({"ops": _Ops}, CUDA, {"dim": 4096}, "kernels: Triton (rms_norm, swiglu, apply_rope, fused_linear_cross_entropy)"),
    ({"ops": _Ops}, CUDA, {"arch": Arch(activation="gelu_tanh", attn_softcap=50.0, final_softcap=30.0)},
     "kernels: Triton (rms_norm, apply_rope); the PyTorch reference (eager) for geglu (no Triton kernel), "
     "soft-capped attention (SDPA cannot cap scores), the loss from soft-capped logits"),
], ids=["cpu", "mode", "no-triton", "tp", "wide", "triton", "gemma2"])
def test_the_run_says_which_kernels_run_and_why(kernel_state, state, device, kw, expected):
    kernel_state(**state)
    assert kernels.describe(device, **kw) == expected


def test_the_switch_sends_only_plain_tensors_on_the_kernel_device_to_triton(kernel_state, monkeypatch):
    """The routing of kernels._fused: plain tensors on the kernel device (CUDA; the CPU under Triton's interpreter)
    take Triton, a tensor elsewhere or a tensor subclass (a DTensor) the reference."""
    calls = []

    class Ops(_Ops):
        @staticmethod
        def rms_norm(x, weight, eps):
            calls.append(type(x).__name__)
            return x

    class Wrapped(torch.Tensor):  # stands for any subclass: DTensor is checked in tests/distributed/test_kernels_in_step.py
        pass

    kernel_state(ops=Ops)
    x, w = torch.randn(2, 8), torch.ones(8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels._kernel_device() == "cuda" == kernels._KERNEL_DEVICE  # as on every training machine
    kernels.rms_norm(x, w)  # a CPU tensor with Triton loaded: the reference
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels._kernel_device() == "cpu"
    monkeypatch.setattr(kernels, "_KERNEL_DEVICE", "cpu")  # what import sets under the interpreter
    kernels.rms_norm(x, w)
    kernels.rms_norm(x.as_subclass(Wrapped), w)
    kernels.rms_norm(x, w.as_subclass(Wrapped))
    assert calls == ["Tensor"]  # only the plain pair took Triton
