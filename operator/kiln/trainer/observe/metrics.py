"""Training metrics: FLOPs and MFU, step-time breakdown, memory; written as JSON lines, TensorBoard, console.

Only rank 0 writes. `DIR/metrics.jsonl` holds one JSON object per logged step with at least: step, loss,
lr, grad_norm, tokens_per_second, mfu (null where no peak is known, see PEAK_FLOPS), world_size,
global_batch_tokens, tokens_seen, and the step-time breakdown (data_s, fwd_bwd_s, optim_s, step_s) and peak_memory_gib.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from pathlib import Path

import torch

from kiln.api import ModelDims
from kiln.trainer.model.transformer import count_params

# Dense peak throughput of one device, FLOP/s, by (product, compute dtype): vendor datasheet values without
# sparsity (the datasheets print bf16 with 2:4 sparsity; dense is half of it). Each form factor is its own
# product, because the same chip runs at other clocks and power in a PCIe card or an NVL pair:
#   H100 SXM / PCIe / NVL  bf16 1,979 / 1,513 / 1,671 sparse; fp32 67 / 51 / 60     NVIDIA H100 Tensor Core GPU datasheet
#   H200 SXM / NVL         bf16 1,979 / 1,671 sparse;        fp32 67 / 60          NVIDIA H200 Tensor Core GPU datasheet
#   A100 40/80 GB SXM/PCIe bf16 312 dense (624 sparse), fp32 19.5, all four         NVIDIA A100 Tensor Core GPU datasheet
#   L40S                   bf16 733 sparse (362.05 dense); fp32 91.6                NVIDIA L40S datasheet
#   B200 (HGX, 1,000 W)    bf16 4.5 PFLOP/s sparse per GPU; fp32 75                 NVIDIA HGX B200 / DGX B200 datasheet
#   MI300X                 bf16 1,307.4 dense (2,614.9 sparse); fp32 163.4          AMD Instinct MI300X datasheet
# No CPU entry: a CPU has no datasheet peak kiln could know, and a matmul timed at start would measure the load of
# whatever else shares the cores (on a shared 2-core machine the same benchmark's median moved 38x between runs,
# docs/trainer.md), so MFU on CPU would be noise presented as a number. A device whose name does not identify
# one product here (an H800, a GH200, an L40 without the S, an H100 whose form factor the name does not say)
# gets no MFU (None), never another device's peak.
PEAK_FLOPS = {
    ("h100-sxm", "bf16"): 989.5e12, ("h100-sxm", "fp32"): 67e12,
    ("h100-pcie", "bf16"): 756.5e12, ("h100-pcie", "fp32"): 51e12,
    ("h100-nvl", "bf16"): 835.5e12, ("h100-nvl", "fp32"): 60e12,
    ("h200-sxm", "bf16"): 989.5e12, ("h200-sxm", "fp32"): 67e12,
    ("h200-nvl", "bf16"): 835.5e12, ("h200-nvl", "fp32"): 60e12,
    ("a100-40gb-sxm", "bf16"): 312e12, ("a100-40gb-sxm", "fp32"): 19.5e12,
    ("a100-80gb-sxm", "bf16"): 312e12, ("a100-80gb-sxm", "fp32"): 19.5e12,
    ("a100-40gb-pcie", "bf16"): 312e12, ("a100-40gb-pcie", "fp32"): 19.5e12,
    ("a100-80gb-pcie", "bf16"): 312e12, ("a100-80gb-pcie", "fp32"): 19.5e12,
    ("l40s", "bf16"): 362.05e12, ("l40s", "fp32"): 91.6e12,
    ("b200", "bf16"): 2250e12, ("b200", "fp32"): 75e12,
    ("mi300x", "bf16"): 1307.4e12, ("mi300x", "fp32"): 163.4e12,
}

# The device name (torch.cuda.get_device_name: nvidia-smi's name, ROCm's marketing name) → product. Every
# pattern must match and the product must be the only one matched; whole words only, so "GH200" is not an H200,
# "GB200" not a B200 and "L40" not an L40S.
_PRODUCTS = (
    ("h100-pcie", (r"\bH100\b", r"\bPCIe\b")),
    ("h100-nvl", (r"\bH100\b", r"\bNVL\b")),
    ("h100-sxm", (r"\bH100\b", r"\b(SXM5?|80GB HBM3)\b")),  # the SXM5 part reports "NVIDIA H100 80GB HBM3"
    ("h200-nvl", (r"\bH200\b", r"\bNVL\b")),
    ("h200-sxm", (r"^NVIDIA H200( SXM\w*)?( 141GB)?$",)),  # the SXM part reports plain "NVIDIA H200"
    ("a100-40gb-sxm", (r"\bA100\b", r"\bSXM4?\b", r"\b40GB\b")),
    ("a100-80gb-sxm", (r"\bA100\b", r"\bSXM4?\b", r"\b80GB\b")),
    ("a100-40gb-pcie", (r"\bA100\b", r"\bPCIe\b", r"\b40GB\b")),
    ("a100-80gb-pcie", (r"\bA100\b", r"\bPCIe\b", r"\b80GB\b")),
    ("l40s", (r"\bL40S\b",)),
    ("b200", (r"^NVIDIA B200$",)),
    ("mi300x", (r"\bMI300X\b",)),
)


def product(name: str) -> str | None:
    """The one product of PEAK_FLOPS a device name identifies, or None (unknown, or more than one fits)."""
    # "A100-SXM4-80GB": hyphens separate words in some names.
    words = name.replace("-", " ")
    found = [p for p, patterns in _PRODUCTS if all(re.search(pat, words, re.IGNORECASE) for pat in patterns)]
    return found[0] if len(found) == 1 else None


def device_kind(device: torch.device) -> str:
    """'h100-pcie', 'a100-80gb-sxm', ... from the CUDA device name; 'cpu' off-GPU; the full name when unknown."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return product(name) or name


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The datasheet peak of one device at `precision`, or None when kiln does not know it (CPU, other GPUs)."""
    return PEAK_FLOPS.get((device_kind(device), precision))


def mfu_note(device: torch.device, precision: str) -> str:
    """One line for the start of a run: what MFU is measured against, or why there is none."""
    kind = device_kind(device)
    peak = PEAK_FLOPS.get((kind, precision))
    if peak is not None:
        return f"mfu: against the {kind.upper()} {precision} datasheet peak, {peak / 1e12:g} TFLOP/s per device"
    if kind == "cpu":
        return "mfu: not reported on CPU (no known peak; tokens/s is the measure)"
    return f"mfu: not reported: no {precision} peak known for {torch.cuda.get_device_name(device)!r}"


def flops_per_token(dims: ModelDims) -> float:
    """Training FLOPs per token: 6N + 12 * layers * dim * seq_len (PaLM, appendix B).

    N counts the parameters that take part in matmuls (all but the input embedding lookup); each does a
    multiply-add forward (2 FLOPs) and twice that backward (4), hence 6N. Attention scores and the weighted
    sum add 2 * 2 * seq_len * dim per layer forward, times 3 with backward: 12 * L * dim * seq_len. The
    causal mask is not subtracted (the usual convention, as in the MFU figures published for Llama/PaLM).
    Where a family's attention is not `dim` wide (heads x head_dim: Qwen3, Gemma) that width counts, and a
    sliding-window layer's query sees at most `sliding_window` keys instead of seq_len. A mixture of experts
    counts the parameters a token uses (its top-k experts, the router, any shared expert).
    """
    n = count_params(dims, embedding=False, active=True)
    width, arch = dims.heads * dims.head_dim, dims.arch
    keys = sum(min(arch.sliding_window, dims.seq_len) if i in arch.sliding_layers else dims.seq_len
               for i in range(dims.layers))
    return 6 * n + 12 * width * keys


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepTimer:
    """Wall-clock phases of one step; synchronises CUDA so the phases are real, not launch times."""

    def __init__(self, device: torch.device):
        self.device, self.times, self._t = device, {}, 0.0

    def start(self) -> None:
        self.times = {}
        self._t = self._now()

    def mark(self, phase: str) -> None:
        now = self._now()
        self.times[phase] = self.times.get(phase, 0.0) + now - self._t
        self._t = now

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def preload(out_dir: Path | None, *, rank: int) -> None:
    """Import what MetricsLogger(out_dir, rank=rank) will need (TensorBoard ~0.5 s, rich's progress bar ~0.3 s
    on a loaded machine) now, for a caller whose time after some point is others' time: a replica group
    joining live ones (kiln.trainer.run). With the imports done, building the logger takes milliseconds."""
    if rank == 0 and out_dir is not None:
        import rich.console  # noqa: F401
        import rich.progress  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401


class MetricsLogger:
    """JSON lines + TensorBoard + a console display; a no-op on ranks other than 0."""

    def __init__(self, out_dir: Path | None, *, rank: int, total_steps: int, start_step: int, tensorboard: bool = True,
                 console: bool = True, exporter=None):
        self.enabled = rank == 0 and out_dir is not None
        self.total_steps = total_steps
        self._jsonl = self._tb = self._progress = None
        self._exporter = exporter  # kiln.trainer.observe.exporter.TrainerExporter (Prometheus), rank 0 only
        if not self.enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        _truncate_after(path, start_step)  # a resumed run rewrites the steps after its checkpoint
        self._jsonl = path.open("a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=start_step + 1)
        if console:
            self._progress = _Console(total_steps, start_step)

    def log(self, record: dict) -> None:
        if self._exporter is not None:
            self._exporter.observe(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
        if self._progress is not None:
            self._progress.update(record)

    def export(self, record: dict) -> None:
        """Only to Prometheus: a record that is not logged but carries news (a GPU health reading)."""
        if self._exporter is not None:
            self._exporter.observe(record)

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._progress is not None:
            self._progress.close()


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


class _Console:
    """A rich progress bar with the latest loss and throughput when attached to a terminal, else plain lines."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.total = total
        self.console = Console(file=sys.stdout)
        self.live = self.console.is_terminal
        if self.live:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console)
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def update(self, r: dict) -> None:
        info = f"loss {r['loss']:.4f}  lr {r['lr']:.2e}  {r['tokens_per_second']:,.0f} tok/s"
        if r.get("mfu") is not None:
            info += f"  mfu {100 * r['mfu']:.2f}%"
        if "val_loss" in r:
            info += f"  validation loss {r['val_loss']:.4f}"
        if self.live:
            self.progress.update(self.task, completed=r["step"], info=info)
        else:
            print(f"step {r['step']}/{self.total}  {info}", flush=True)

    def close(self) -> None:
        if self.live:
            self.progress.stop()
