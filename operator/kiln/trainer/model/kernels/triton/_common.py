"""Launch settings shared by the kernels: block sizes, warps, and how many persistent programs to start."""

from __future__ import annotations

import functools

import torch
import triton

# One program holds a whole row in registers; beyond this the row no longer fits and we refuse rather
# than spill (the switch in kernels/__init__.py then uses the reference).
MAX_FUSED_COLS = 65536


def row_settings(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that keeps one row of n_cols elements in registers."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_FUSED_COLS:
        raise ValueError(f"hidden size {n_cols} is larger than the fused kernels support ({MAX_FUSED_COLS})")
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_count(device: torch.device, n_rows: int) -> int:
    """Persistent programs for reductions over rows: two per SM on a GPU (a second resident program hides
    memory latency; more would grow the partial sums to reduce), a few under the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n_rows, 2 * _sm_count(index)))
    return max(1, min(n_rows, 4))
