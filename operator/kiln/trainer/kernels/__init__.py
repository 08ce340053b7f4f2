"""Fused kernels behind one switch: Triton on CUDA, the reference (under torch.compile) elsewhere.

Public ops: rms_norm, swiglu, apply_rope, fused_linear_cross_entropy. `set_mode("reference")` forces the
plain PyTorch ops everywhere (the `parallelism.kernels` field of the spec).
"""

from __future__ import annotations

from kiln.trainer.kernels import reference

_MODE = "fused"


def set_mode(mode: str) -> None:
    if mode not in ("fused", "reference"):
        raise ValueError(f"kernels must be 'fused' or 'reference', not {mode!r}")
    global _MODE
    _MODE = mode


def get_mode() -> str:
    return _MODE


# The dispatch to Triton on CUDA tensors is added by the kernels work (issue 8); until then every op is the
# reference implementation.
rms_norm = reference.rms_norm
swiglu = reference.swiglu
apply_rope = reference.apply_rope
fused_linear_cross_entropy = reference.fused_linear_cross_entropy

__all__ = ["rms_norm", "swiglu", "apply_rope", "fused_linear_cross_entropy", "set_mode", "get_mode", "reference"]
