"""Restart benchmark: kill -9 a dp=2 job (real gloo processes, FSDP2) and time kill → the next completed training
step of the restarted job, restoring from the ranks' host-memory copies (KILN_SHM_DIR) vs from the store.

    python -m tests.bench.bench_restart                          # file:// store in a temp dir
    python -m tests.bench.bench_restart --s3                     # the rig's S3 (or a private versitygw)

Writes JSON to --out (default runs/bench/restart.json): per-trial times, medians, and store/memory ratios, and
what a fault cost in each mode (`cost_per_fault`, tests/bench/fault_cost.py): the median kill → step held
Restarting at 2 devices (ranks), through the operator's goodput ledger and status.cost at --price-per-gpu-hour.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from tests.bench.fault_cost import add_price_args, priced
from tests.bench.report import write_report
from tests.support.ranks import complete_lines, fsdp_per_layer, start_ranks, wait_until

WORLD = 2


def _worker(rank: int, world: int, uri: str, env: dict, width: int, progress: str) -> None:
    os.environ.update(env)
    import logging

    import torch
    from kiln.api.spec import CheckpointSpec
    from kiln.trainer.checkpoint.checkpointer import Checkpointer
    from torch import nn

    logging.basicConfig(filename=f"{progress}.log", level=logging.INFO, force=True)
    model = fsdp_per_layer(nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(CheckpointSpec(uri=uri, interval_steps=5, keep=2), default_uri="", rank=rank, world_size=world)
    t0 = time.monotonic()
    state = ck.restore([model], [opt])
    restore_s = time.monotonic() - t0
    for step in range((state["step"] + 1) if state else 1, 1_000_000):  # until killed
        model(torch.randn(8, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(progress, "a") as f:  # one line per completed step
                f.write(json.dumps({"step": step, "t": time.time(), "restore_s": restore_s,
                                    "source": ck.last_restore_source}) + "\n")
        if ck.should_save(step):
            ck.save(step, [model], [opt], {"step": step})


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in complete_lines(path) if ln.strip()]


def _memory_copies(shm: str) -> list[int | None]:
    """The step each rank's copy in host memory holds (KILN_SHM_DIR/<run>/rank-<r>/SHM.json)."""
    steps = []
    for path in sorted(Path(shm).glob("*/rank-*/SHM.json")):
        try:
            steps.append(json.loads(path.read_text())["step"])
        except (OSError, ValueError, KeyError):
            steps.append(None)  # being written
    return steps


def _start(uri: str, env: dict, width: int, progress: Path) -> list:
    return start_ranks(_worker, WORLD, progress.parent, uri, env, width, str(progress))


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()


def _trial(uri: str, env: dict, width: int, work: Path, name: str) -> dict:
    """Run until a commit newer than any before it is in place (with its memory copies) and trained past,
    kill -9, restart; kill → first step completed."""
    from kiln.storage import open_store
    from kiln.storage.commit import committed_steps

    store = open_store(uri, env={**os.environ, **env})
    before = max(committed_steps(store), default=0)
    first = work / f"{name}-a.jsonl"
    procs = _start(uri, env, width, first)
    shm = env.get("KILN_SHM_DIR")

    def ready() -> int:
        """The newest commit, once the job trains on past it (as a crash mid-run finds it) and, restoring from
        memory, every rank's copy holds it (it is written after the COMMIT)."""
        newest = max(committed_steps(store), default=0)
        if newest <= before or (shm and _memory_copies(shm) != [newest] * WORLD):
            return 0
        return newest if any(ln["step"] > newest for ln in _lines(first)) else 0

    try:
        wait_until("a commit, its memory copies and a step after it", ready,
                   alive=lambda: all(p.is_alive() for p in procs))
    finally:
        t_kill = time.time()
        _kill(procs)
    second = work / f"{name}-b.jsonl"
    procs = _start(uri, env, width, second)
    try:
        wait_until("the first step after the restart", lambda: len(_lines(second)) >= 1,
                   alive=lambda: all(p.is_alive() for p in procs))
    finally:
        _kill(procs)
    line = _lines(second)[0]
    log = Path(f"{second}.log").read_text()
    m = re.search(r"restored step (\d+) from (\S+)", log)
    return {
        "kill_to_step_s": line["t"] - t_kill,
        "restore_s": line["restore_s"],
        "source": line["source"],
        "restored_step": int(m.group(1)) if m else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="4 Linear(width, width) layers + AdamW state")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="the rig's S3 (or a private versitygw) instead of file://")
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--out", default="runs/bench/restart.json")
    add_price_args(parser)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kiln-bench-restart-"))
    env: dict = {}
    server = None
    if args.s3:
        from tests.bench.bench_checkpoint import _server

        endpoint, env, server = _server(args)
        uri = f"s3://kiln/bench-restart-{uuid.uuid4().hex[:8]}/"
        env = {**env, "AWS_ENDPOINT_URL": endpoint}
    else:
        uri = f"file://{work}/store/"
    try:
        trials: dict[str, list[dict]] = {"memory": [], "store": []}
        for i in range(args.trials):
            for mode in ("memory", "store"):
                shm = str(work / "shm") if mode == "memory" else ""
                trials[mode].append(_trial(uri, {**env, "KILN_SHM_DIR": shm}, args.width, work, f"{mode}-{i}"))
    finally:
        if server is not None:
            server.stop()
    med = {m: {k: statistics.median(t[k] for t in ts) for k in ("kill_to_step_s", "restore_s")} for m, ts in trials.items()}
    results = {
        "bench": "restart",
        "host": platform.node(),
        "store": "s3" if args.s3 else "file",
        "world": WORLD,
        "state_mib": round(4 * (args.width * args.width + args.width) * 4 * 3 / 2**20, 1),  # params + 2 AdamW
        "median": med,
        "ratio_store_over_memory": {
            k: med["store"][k] / max(med["memory"][k], 1e-9) for k in ("kill_to_step_s", "restore_s")
        },
        "sources": {m: sorted({t["source"] for t in ts}) for m, ts in trials.items()},
        # the workers are not kiln's trainer (no time counters): kill → first step is all `restart`
        "cost_per_fault": {m: priced([(med[m]["kill_to_step_s"], "Restarting", {})], WORLD,
                                     args.price_per_gpu_hour, args.currency) for m in med},
        "raw": trials,
    }
    write_report(results, args.out, summary={k: v for k, v in results.items() if k != "raw"})


if __name__ == "__main__":
    main()
