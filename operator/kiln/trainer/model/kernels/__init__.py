"""Fused kernels behind one switch: Triton on CUDA, the reference (under torch.compile) elsewhere.

Public ops: rms_norm, swiglu, geglu (reference only), apply_rope, fused_linear_cross_entropy. In mode "fused"
(the default) an op runs its Triton kernel when every tensor argument is a plain CUDA tensor (a plain CPU tensor
under Triton's interpreter, TRITON_INTERPRET=1: a test seam) and Triton imports; DTensors
(tensor parallel), CPU tensors and shapes the kernels do not cover take the plain PyTorch reference,
which the model's per-block `torch.compile` fuses. `set_mode("reference")` forces the reference
everywhere (the `parallelism.kernels` field of the spec).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kiln.api.presets import Arch
from kiln.errors import KilnError
from kiln.trainer.model.kernels import reference

MODES = ("fused", "reference")
_MODE = "fused"


def set_mode(mode: str) -> None:
    if mode not in MODES:
        raise KilnError(f"parallelism.kernels must be one of {', '.join(MODES)}, not {mode!r}")
    global _MODE
    _MODE = mode


def get_mode() -> str:
    return _MODE


def _kernel_device() -> str:
    """The device whose plain tensors the Triton kernels take: CUDA; the CPU when Triton's interpreter is on
    (TRITON_INTERPRET=1 from the process's start, as Triton requires): tests run the kernels inside real
    training steps that way (tests/distributed/test_kernels_in_step.py). Slow; never for training."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _load_triton_ops() -> tuple[ModuleType | None, str]:
    """The Triton ops, or None and why not."""
    if _KERNEL_DEVICE == "cuda" and not torch.cuda.is_available():  # never import triton: the reference serves
        return None, "no CUDA device"
    try:
        from kiln.trainer.model.kernels import triton as triton_ops
    except ImportError as err:  # no triton in this environment: the reference is the only implementation
        return None, f"Triton does not import ({err})"
    return triton_ops, ""


# Resolved once at import, not per call, so that the model's torch.compile traces a plain global read.
_KERNEL_DEVICE = _kernel_device()
_TRITON_OPS, _NO_TRITON_WHY = _load_triton_ops()


def reference_runs() -> bool:
    """True when no call can take the Triton kernels (mode reference, or no CUDA/Triton here)."""
    return _MODE != "fused" or _TRITON_OPS is None


def describe(device: torch.device, *, tensor_parallel: int = 1, dim: int = 0, compiled: bool = False,
             arch: Arch | None = None) -> str:
    """One line for the start of a run: which implementation the ops run with, and why when not Triton.
    Mirrors the per-call choice in `_fused` for a model of width `dim` and family `arch` on `device`."""
    reference_is = "the PyTorch reference" + (" under torch.compile" if compiled else " (eager)")
    if _MODE != "fused":
        why = "parallelism.kernels is reference"
    elif device.type != _KERNEL_DEVICE:
        why = f"the run is on {device.type.upper()}"
    elif _TRITON_OPS is None:
        why = _NO_TRITON_WHY
    elif tensor_parallel > 1:  # tests/distributed/test_kernels_in_step.py observes this split call by call
        gated = "swiglu and " if (arch or Arch()).activation == "silu" else ""
        return (f"kernels: Triton for {gated}apply_rope (each rank's local shard); rms_norm: {reference_is}, "
                f"because tensor parallel ({tensor_parallel}) passes it sequence-sharded DTensors; the loss from "
                "the logits")
    elif dim > _TRITON_OPS.MAX_FUSED_COLS:
        return (f"kernels: Triton, except rms_norm: {reference_is} (dim {dim} > {_TRITON_OPS.MAX_FUSED_COLS} "
                f"columns)")
    else:
        return _triton_line(arch or Arch(), reference_is)
    return f"kernels: {reference_is}, because {why}"


def _triton_line(arch: Arch, reference_is: str) -> str:
    """The ops a family takes through Triton, and those it takes through the reference (Gemma's, kiln.api.presets)."""
    gated = "swiglu" if arch.activation == "silu" else None
    loss = "fused_linear_cross_entropy" if arch.final_softcap is None else None
    triton = ", ".join(op for op in ("rms_norm", gated, "apply_rope", loss) if op)
    reference = [why for why in (
        "geglu (no Triton kernel)" if gated is None else None,
        "soft-capped attention (SDPA cannot cap scores)" if arch.attn_softcap is not None else None,
        "the loss from soft-capped logits" if loss is None else None) if why]
    return f"kernels: Triton ({triton})" + (f"; {reference_is} for {', '.join(reference)}" if reference else "")


def _fused(*tensors: torch.Tensor) -> ModuleType | None:
    """The Triton ops if this call should use them, else None."""
    if _MODE != "fused":
        return None
    # Exact types: tensor subclasses (DTensor, other wrappers) are handled only by the reference.
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == _KERNEL_DEVICE for t in tensors):
        return None
    return _TRITON_OPS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    ops = _fused(x, weight)
    if ops is not None and x.shape[-1] <= ops.MAX_FUSED_COLS:
        return ops.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    ops = _fused(gate, up)
    if ops is not None:
        return ops.swiglu(gate, up)
    return reference.swiglu(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: no Triton kernel, the reference always (fused by torch.compile where it runs)."""
    return reference.geglu(gate, up)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ops = _fused(q, k, cos, sin)
    if ops is not None:
        return ops.apply_rope(q, k, cos, sin)
    return reference.apply_rope(q, k, cos, sin)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
) -> torch.Tensor:
    ops = _fused(hidden, weight, targets)
    if ops is not None:
        return ops.fused_linear_cross_entropy(hidden, weight, targets, ignore_index, z_loss)
    return reference.fused_linear_cross_entropy(hidden, weight, targets, ignore_index, z_loss)


__all__ = ["rms_norm", "swiglu", "geglu", "apply_rope", "fused_linear_cross_entropy", "set_mode", "get_mode",
           "describe", "reference_runs", "reference", "MODES"]
