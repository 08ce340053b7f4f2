"""Gradient compression on the replicated data-parallel dimension (`parallelism.gradientCompression`).

- `bf16`: gradients are reduced in bf16 (half the bytes). The trainer does this through FSDP2's
  MixedPrecisionPolicy `reduce_dtype` (it covers the reduce-scatter and, under HSDP, the replicate
  all-reduce) in every layout: `fsdp: false` is FSDP2 with a shard size of 1. `register_comm_hook`'s bf16
  (torch's `bf16_compress_hook`) serves DDP modules outside the trainer (tests, bench_compression).
- `powersgd`: rank-r PowerSGD with error feedback (Vogels et al. 2019), torch's own `powerSGD_hook`. It
  compresses an all-reduce of whole gradient matrices, so it applies to plain replication (`fsdp: false`)
  through the composable `replicate` (DDP) API; FSDP2 reduce-scatters sharded gradients, which PowerSGD
  cannot compress, so that combination is rejected with a KilnError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError

MODES = ("none", "bf16", "powersgd")


@dataclass(frozen=True)
class PowerSGDConfig:
    rank: int = 2  # matrix approximation rank: bytes ~ rank x (rows + cols) instead of rows x cols
    start_iter: int = 10  # plain all-reduce for the first steps (PowerSGD paper: warm start helps)
    min_compression_rate: float = 2.0  # matrices that would not shrink this much are sent uncompressed


def check_supported(mode: str, *, fsdp: bool, tensor: int, field: str = "parallelism.gradientCompression") -> None:
    """KilnError naming the field when `mode` cannot run with this layout."""
    if mode not in MODES:
        raise KilnError(f"{field} {mode!r} is unknown; choose one of {', '.join(MODES)}")
    if mode == "powersgd" and fsdp:
        raise KilnError(f"{field} powersgd needs parallelism.fsdp: false (FSDP2 reduce-scatters sharded "
                        "gradients, PowerSGD compresses a replicated all-reduce); use bf16 with fsdp: true")
    if mode == "powersgd" and tensor > 1:
        raise KilnError(f"{field} powersgd needs parallelism.tensor: 1 (tensor-parallel parameters are DTensors, "
                        "which the DDP comm hook does not handle); use bf16")


def fsdp_reduce_dtype(mode: str, precision: str) -> torch.dtype | None:
    """The `reduce_dtype` for FSDP2's MixedPrecisionPolicy: bf16 when compressing, else fp32 (or the default)."""
    if mode == "bf16":
        return torch.bfloat16
    return torch.float32 if precision == "bf16" else None


def register_comm_hook(module: Any, mode: str, process_group=None,
                       powersgd: PowerSGDConfig | None = None) -> Any:
    """Register torch's compression hook on a DDP module (or a module passed to composable `replicate`).

    Returns the hook state (a PowerSGDState for powersgd: its error-feedback buffers are per rank and
    restart from zero after a resume, which PowerSGD tolerates), or None.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if mode == "none":
        return None
    if mode == "bf16":
        module.register_comm_hook(process_group, default_hooks.bf16_compress_hook)
        return None
    if mode == "powersgd":
        cfg = powersgd or PowerSGDConfig()
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=cfg.rank, start_powerSGD_iter=cfg.start_iter,
            min_compression_rate=cfg.min_compression_rate, use_error_feedback=True, warm_start=True)
        module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    raise KilnError(f"parallelism.gradientCompression {mode!r} is unknown; choose one of {', '.join(MODES)}")


def apply_replicate(model: nn.Module, dp_mesh, mode: str, powersgd: PowerSGDConfig | None = None) -> Any:
    """Plain data-parallel replication (composable DDP, module kept in place) with the compression hook."""
    from torch.distributed._composable.replicate import replicate

    import torch.distributed as dist

    kwargs = {}
    if mode == "powersgd" and dist.get_backend(dp_mesh.get_group()) == "gloo":
        # PowerSGD issues a bucket's second all-reduce from a future callback; with several buckets gloo
        # can then see the ranks' collectives in different orders. One bucket keeps the order fixed.
        kwargs["bucket_cap_mb"] = 1 << 20
    replicate(model, device_mesh=dp_mesh, **kwargs)
    return register_comm_hook(model, mode, dp_mesh.get_group(), powersgd)
