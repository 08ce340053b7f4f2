"""Triton implementations of the fused ops, each a registered custom op with its own backward.

Import this module directly to run the kernels whatever the device switch would pick (the tests run them
on CPU tensors under TRITON_INTERPRET=1). Eagerly each op is a `torch.autograd.Function` (little Python
overhead per call); under `torch.compile` the same launchers run as registered `torch.library.custom_op`s
with fake implementations, which the compiler treats as opaque calls and traces around.
"""

from kiln.trainer.model.kernels.triton._common import MAX_FUSED_COLS
from kiln.trainer.model.kernels.triton.cross_entropy import fused_linear_cross_entropy
from kiln.trainer.model.kernels.triton.rms_norm import rms_norm
from kiln.trainer.model.kernels.triton.rope import apply_rope
from kiln.trainer.model.kernels.triton.swiglu import swiglu

__all__ = ["rms_norm", "swiglu", "apply_rope", "fused_linear_cross_entropy", "MAX_FUSED_COLS"]
