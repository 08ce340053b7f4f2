"""The pre-flight check before step 1: is every rank as fast as the others, and how fast is the world's network?

Every rank times a square matmul (the best of a few repetitions after a warm-up: a loaded machine only ever
slows a repetition down, so the best one is the rank's own speed), the ranks gather their rates and nodes, and
the world group times an all-reduce (bus bandwidth, as nccl-tests defines it). A rank whose rate is below
`resources.preflight.minRelativeSpeed` x the median of the *other* ranks' is slow (the median of the others, so
a slow rank does not lower its own yardstick; with two ranks the other's rate). Rank 0 prints one line, puts
the result in the first step's record (metrics.jsonl: `preflight`) and in status.preflight with its seconds in
trainerTime.preflightSeconds (the goodput ledger's `preflight`); the operator takes it from there
(kiln.control.failover), moving the run off a slow rank's node when it can start without it. When the spec's
elastic bounds cannot do without that node, the check fails the run instead (`cannot_leave`), on GPUs: CPU ranks
that share a machine with other work give noisy rates, so there a slow rank is only named. The matmul itself is a parameter: a test gives one rank more work per repetition.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kiln.api import layout

# A matmul of ~0.3 GFLOP on CPU (milliseconds) and ~0.5 TFLOP on a GPU; bf16 where the GPU has tensor cores.
CPU_N, GPU_N = 512, 8192
REPS = 5
BANDWIDTH_BYTES = 8 << 20  # one all-reduce of 8 MiB: long enough to be bandwidth, not latency
BANDWIDTH_REPS = 3

if TYPE_CHECKING:
    from kiln.api.spec import TrainingSpecSpec

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def matmul_rate(device: torch.device, *, matmul: Matmul = torch.matmul, n: int | None = None,
                reps: int = REPS) -> float:
    """GFLOP/s of an n x n matmul on `device`: the best of `reps` after one warm-up."""
    n = n or (GPU_N if device.type == "cuda" else CPU_N)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    _sync(device, matmul(a, b))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _sync(device, matmul(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def allreduce_bandwidth(device: torch.device, *, nbytes: int = BANDWIDTH_BYTES, reps: int = BANDWIDTH_REPS) -> float | None:
    """The world group's all-reduce bus bandwidth in GB/s (best of `reps`); None in a world of one."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return None
    x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dist.all_reduce(x)
    best = float("inf")
    for _ in range(reps):
        _sync(device, x)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        _sync(device, x)
        best = min(best, time.perf_counter() - t0)
    return 2 * (world - 1) / world * nbytes / best / 1e9


def judge(rates: list[float], nodes: list[str], min_relative: float) -> tuple[float, list[dict]]:
    """The ranks' median rate and the slow ranks ({rank, node, relative, value}): below `min_relative` x the
    median of the other ranks' rates. Pure."""
    from kiln.trainer.observe.stragglers import relative_to_others

    slow = [{"rank": rank, "node": nodes[rank], "relative": round(rel, 3), "value": round(rates[rank], 2)}
            for rank, rel in enumerate(relative_to_others(rates)) if rel is not None and rel < min_relative]
    return statistics.median(rates), slow


def check(device: torch.device, *, min_relative: float, node: str, matmul: Matmul | None = None) -> dict:
    """Every rank's matmul rate and the world's bandwidth; a collective (every rank calls it). The same result
    on every rank: {seconds, gflops (per rank), nodes, median_gflops, bandwidth_gbps, slow}."""
    t0 = time.perf_counter()
    rate = matmul_rate(device, matmul=matmul or torch.matmul)
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, (rate, node))
    else:
        gathered = [(rate, node)]
    bandwidth = allreduce_bandwidth(device)
    rates, nodes = [float(r) for r, _ in gathered], [str(n) for _, n in gathered]
    median, slow = judge(rates, nodes, min_relative)
    return {"seconds": round(time.perf_counter() - t0, 4), "gflops": [round(r, 2) for r in rates], "nodes": nodes,
            "median_gflops": round(median, 2), "bandwidth_gbps": None if bandwidth is None else round(bandwidth, 3),
            "min_relative_speed": min_relative, "slow": slow}


def say(result: dict) -> None:
    """Rank 0's one line about a check."""
    bw = "" if result["bandwidth_gbps"] is None else f", all-reduce {result['bandwidth_gbps']} GB/s"
    slow = "; ".join(f"rank {s['rank']} on node {s['node']} at {s['relative']} of the others' median "
                     f"(below {result['min_relative_speed']})" for s in result["slow"])
    print(f"kiln: preflight: {len(result['gflops'])} rank(s), median matmul {result['median_gflops']} GFLOP/s{bw}, "
          f"{result['seconds']} s; " + (f"slow: {slow}" if slow else "no slow rank"),
          file=sys.stderr if slow else sys.stdout, flush=True)


def cannot_leave(result: dict, spec: "TrainingSpecSpec") -> str | None:
    """Why the run cannot go on: a slow rank's node holds pods (ranks // processes per node, as torchrun numbers
    them) that the run cannot start without, by its elastic bounds (resources.nodes, elastic.minNodes and the
    layout's rules). None when no rank is slow or the run can start on the other nodes (the operator then moves
    it; kiln.control.failover). Replica groups' jobs are of a fixed size and not moved: None. Pure."""
    if not result["slow"] or layout.replica_groups_on(spec):
        return None
    ppn, nodes = layout.processes_per_node(spec), result["nodes"]
    slow_nodes = sorted({s["node"] for s in result["slow"]})
    pods = len(nodes) // ppn
    left = pods - len({rank // ppn for rank, node in enumerate(nodes) if node in slow_nodes})
    counts = layout.runnable_node_counts(spec)
    if counts and left >= counts[0]:
        return None
    slow = "; ".join(f"rank {s['rank']} on node {s['node']} at {s['relative']} of the others' median"
                     for s in result["slow"])
    fewest = f"at least {counts[0]}" if counts else "a node count its layout allows"
    return (f"resources.preflight: {slow} (below minRelativeSpeed {result['min_relative_speed']}); without "
            f"node(s) {', '.join(slow_nodes)}, {left} of the run's {pods} node(s) remain and it needs {fewest} "
            "(resources.nodes, elastic.minNodes): replace the node, lower elastic.minNodes, or set "
            "resources.preflight.enabled false")


def status_entry(result: dict, *, step: int, checked_at: str) -> dict:
    """status.preflight (camelCase, as in the CRD)."""
    return {"checkedAt": checked_at, "step": step, "seconds": result["seconds"], "ranks": len(result["gflops"]),
            "medianGflops": result["median_gflops"], "bandwidthGbps": result["bandwidth_gbps"],
            "slow": result["slow"]}


def _sync(device: torch.device, _out: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
