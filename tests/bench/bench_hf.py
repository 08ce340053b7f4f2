"""Import and export of a Hugging Face folder, against the `safetensors` library in the same run.

A random checkpoint of the preset's shape (default llama-1b = Llama 3.2 1B: tied embeddings, bf16, cut into
shards of --shard-size like transformers' save_pretrained) is written once, then:

- import: kiln loads it into the model split over --nproc FSDP2 ranks (torchrun, gloo, CPU), each rank reading
  only its slices; the reference is `safetensors.torch.load_file` of the same files into one process (the whole
  model in memory, converted to fp32 like kiln's master weights). Reported: wall seconds of each (kiln: the slowest rank's load_weights), and
  the peak RSS growth of each kiln rank during the load against that rank's share of the model (its fp32
  shard, which the load writes for the first time) and of the reference against the files' size;
- export: kiln's write_folder of the same tensors (shards, index, each file fsync'd) against
  `safetensors.torch.save_file` of them into one fsync'd file (seconds, bytes).

    python -m tests.bench.bench_hf                              # llama-1b shape, 2 ranks (~6 GB of memory)
    python -m tests.bench.bench_hf --preset small --nproc 2     # quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.bench.report import write_report


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Make VmHWM (peak RSS) start again from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def dims_of(preset: str):
    from kiln.api import PRESETS, ModelDims

    return ModelDims(**PRESETS[preset])


def make_folder(folder: Path, preset: str, shard_bytes: int) -> int:
    """A random bf16 checkpoint with tied embeddings; returns its bytes on disk."""
    from kiln.api.hf import config_for
    from kiln.storage import open_store
    from kiln.trainer.model.hf_export import write_folder
    from kiln.trainer.model.hf_names import hf_shapes

    dims = dims_of(preset)
    gen = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
             for name, shape in hf_shapes(dims).items() if name != "lm_head.weight"}
    store = open_store(f"file://{folder}")
    files = write_folder(state, store, config=config_for(dims, tie=True, dtype="bfloat16"), generation={},
                         tokenizer_files={}, max_shard_bytes=shard_bytes)
    return sum(store.size(k) for k in files)


def worker(folder: str, out: str) -> None:
    """One torchrun rank: build the FSDP2 model, then time and measure load_weights."""
    from kiln.api.spec import TrainingSpecSpec
    from kiln.trainer.model import hf_folder as hf
    from kiln.trainer.build import init_distributed
    from kiln.trainer.model.transformer import build_model
    from kiln.trainer.parallel.parallelize import build_mesh, parallelize, plan_layout

    rank, world, device = init_distributed()
    spec = TrainingSpecSpec.model_validate({
        "model": {"from": f"file://{folder}", "seqLen": 128},
        "training": {"globalBatchSize": world, "microBatchSize": 1, "precision": "fp32", "steps": 1},
        "parallelism": {"compile": False}, "resources": {"processesPerNode": world}})
    dims = hf.resolve_dims(spec)
    layout = plan_layout(spec, dims, world)
    model = parallelize(build_model(dims), build_mesh(layout, device.type), layout, spec)
    model.to_empty(device=device)
    model.init_buffers()
    share = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    torch.distributed.barrier()
    reset_peak()
    before = rss_bytes()
    t0 = time.perf_counter()
    read = hf.load_weights(model, spec.model.from_, dims)
    seconds = time.perf_counter() - t0
    peak = rss_bytes("VmHWM") - before
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "seconds": seconds, "read_bytes": read, "share_bytes": share, "peak_growth_bytes": peak}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--shard-size", type=int, default=1 << 30, help="bytes per safetensors file (default 1 GiB)")
    ap.add_argument("--out", default="runs/bench/hf.json")
    ap.add_argument("--worker", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from safetensors.torch import load_file, save_file

    from kiln.storage import open_store
    from kiln.trainer.model.hf_export import write_folder

    with tempfile.TemporaryDirectory(prefix="kiln-bench-hf-") as tmp:
        folder, ranks = Path(tmp) / "model", Path(tmp) / "ranks"
        ranks.mkdir()
        size = make_folder(folder, args.preset, args.shard_size)
        files = sorted(folder.glob("*.safetensors"))
        for f in files:  # warm the page cache for both readers alike
            f.read_bytes()

        reset_peak()
        before = rss_bytes()
        t0 = time.perf_counter()
        state, master = {}, {}
        for f in files:
            part = load_file(str(f))  # memory-mapped: the bytes are read when first touched, by float() here
            state.update(part)
            master.update({k: t.float() for k, t in part.items()})  # kiln's fp32 master copy, as kiln makes it
        ref_seconds = time.perf_counter() - t0
        ref_peak = rss_bytes("VmHWM") - before
        del master

        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "tests.bench.bench_hf", "--worker", str(folder), str(ranks)]
        subprocess.run(cmd, env=env, check=True)
        per_rank = [json.loads((ranks / f"rank{r}.json").read_text()) for r in range(args.nproc)]
        kiln_seconds = max(r["seconds"] for r in per_rank)

        t0 = time.perf_counter()
        ref_file = Path(tmp) / "ref.safetensors"
        save_file(state, str(ref_file))
        with open(ref_file, "rb") as f:  # on disk, as kiln's files are before they count as written
            os.fsync(f.fileno())
        ref_export = time.perf_counter() - t0
        out_store = open_store(f"file://{Path(tmp) / 'export'}")
        t0 = time.perf_counter()
        written = write_folder(state, out_store, config={}, generation={}, tokenizer_files={},
                               max_shard_bytes=args.shard_size)
        kiln_export = time.perf_counter() - t0
        export_bytes = sum(out_store.size(k) for k in written)

    result = {
        "benchmark": "hf", "preset": args.preset, "nproc": args.nproc, "host": platform.node(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "checkpoint_bytes": size,
        "import": {
            "kiln_seconds": kiln_seconds, "safetensors_load_file_seconds": ref_seconds,
            "ratio_kiln_over_safetensors": kiln_seconds / ref_seconds,
            "safetensors_peak_growth_over_fp32_model": ref_peak / sum(t.numel() * 4 for t in state.values()),
            "ranks": [{**r, "peak_over_share": r["peak_growth_bytes"] / r["share_bytes"],
                       "read_over_checkpoint": r["read_bytes"] / size} for r in per_rank],
        },
        "export": {"kiln_seconds": kiln_export, "safetensors_save_file_seconds": ref_export,
                   "ratio_kiln_over_safetensors": kiln_export / ref_export, "bytes": export_bytes,
                   "files": len(written)},
    }
    write_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
