"""Stragglers: a rank whose own share of the step (data and compute) stays longer than the others'.

In a synchronous step every rank's wall time is the same: the slowest rank's delay shows up as the others'
waiting inside the collectives (FSDP's all-gathers and reduce-scatters, the gradient clip's all-reduce). So the
signal is a rank's *own* time, not its step time. On CPU ranks it is the main thread's CPU time over the step
(`time.thread_time`): the data read, Python and the compute (the main thread is one of the OpenMP workers), and
not the time it slept in a gloo collective; it is also blind to the OS running other processes on the core,
which slows wall time without meaning the rank has more to do. The rest of the step's wall time is its wait:
in collectives, and on an oversubscribed machine also the time it was not scheduled.
GPU ranks: the host returns before a kernel ends, so the split comes from CUDA events instead (`GpuSplit`): the
step's GPU time between two events on the current stream, less the time NCCL spent in this process's collectives
as c10d measures each one with its own CUDA events (a completion hook on every NCCL process group, which turns
c10d's collective timing on). A slow GPU's rank spends little time in collectives (the others are there first)
and the others a lot. This path runs only on CUDA devices and has not run in this project's CI (no GPU there).

Every `everySteps` steps (a process's first step, with its one-off costs, not counted) the ranks all-gather their mean own and wait seconds (one tensor of 2 floats per
rank) and rank 0 judges: a rank whose own time is above `factor` x the median of the other ranks' is slow in
that report; slow in `window` consecutive reports, it is a straggler, named with its node in the record
(`stragglers`), status.stragglers and the gauge kiln_train_straggler{rank,node}; one report not slow and it is
no longer named.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist


def relative_to_others(values: list[float]) -> list[float | None]:
    """Each rank's value / the median of the other ranks' (the yardstick a slow rank cannot lower; with two
    ranks, the other's value); None where there is none (a world of one, a median of 0). Pure."""
    out: list[float | None] = []
    for rank, mine in enumerate(values):
        others = values[:rank] + values[rank + 1:]
        ref = statistics.median(others) if others else 0.0
        out.append(mine / ref if ref > 0 else None)
    return out


def slow_ranks(own: list[float], factor: float) -> dict[int, float]:
    """rank → own / the median of the other ranks' own time, for each rank above `factor`. Pure."""
    return {rank: rel for rank, rel in enumerate(relative_to_others(own)) if rel is not None and rel > factor}


class Streaks:
    """Consecutive slow reports per rank (rank 0's state); `named` are the ranks at `window` or more. Pure."""

    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self.count: dict[int, int] = {}

    def report(self, own: list[float]) -> dict[int, float]:
        """Fold one report in; the stragglers now (rank → relative own time)."""
        slow = slow_ranks(own, self.factor)
        self.count = {rank: self.count.get(rank, 0) + 1 for rank in slow}
        return {rank: rel for rank, rel in slow.items() if self.count[rank] >= self.window}


class GpuSplit:
    """A CUDA rank's own and waiting time per step, from CUDA events: `begin`/`end` record an event each on the
    current stream; `take` (at a report: it waits for the last step's end event) returns the steps' mean GPU time
    and the seconds c10d timed in collectives since the last `take`. c10d fires the completion hook on its
    watchdog thread when it sees a collective end, so a collective that ends just before a report may count in
    the next one."""

    def __init__(self):
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._collective_s = 0.0
        self._lock = threading.Lock()
        self._hooked: set[int] = set()

    def hook_groups(self) -> bool:
        """Time every NCCL process group that exists now (the world's and the mesh's); whether any is timed."""
        from torch.distributed import distributed_c10d as c10d

        for group in list(c10d._world.pg_map):
            if id(group) in self._hooked:
                continue
            try:
                group._enable_collectives_timing()
                group._register_on_completion_hook(self._done)
            except (RuntimeError, AttributeError, ValueError):  # a gloo-only group: nothing of the GPU to time
                continue
            self._hooked.add(id(group))
        return bool(self._hooked)

    def _done(self, info) -> None:
        with self._lock:
            self._collective_s += info.active_duration.total_seconds()

    def begin(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._events.append((start, start))

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._events[-1] = (self._events[-1][0], stop)

    def take(self) -> tuple[float, float]:
        """(mean GPU seconds per step since the last take, collective seconds since then)."""
        events, self._events = self._events, []
        if not events:
            return 0.0, 0.0
        events[-1][1].synchronize()
        gpu = sum(a.elapsed_time(b) for a, b in events) / 1e3 / len(events)
        with self._lock:
            collective, self._collective_s = self._collective_s, 0.0
        return gpu, collective


class StragglerWatch:
    """Per step: `begin()` at its start, `end(record)` after the optimizer step; every `every` steps `end` runs
    one all-gather and adds the split to the record (rank 0 also the stragglers). Every rank calls both."""

    def __init__(self, *, every: int, factor: float, window: int, node: str, device: torch.device):
        self.every, self.node, self.device = every, node, device
        self.streaks = Streaks(factor, window)
        self._nodes: list[str] | None = None
        self._own = self._wall = 0.0
        self._steps = 0
        self._t = self._cpu = 0.0
        self._first = True  # a process's first step carries one-off costs (allocation, lazy init): not counted
        self.gpu = GpuSplit() if device.type == "cuda" else None  # CUDA: the split from CUDA events

    def begin(self) -> None:
        self._t, self._cpu = time.perf_counter(), time.thread_time()
        if self.gpu is not None:
            self.gpu.begin()

    def end(self, step: int, record: dict) -> None:
        wall, own = time.perf_counter() - self._t, time.thread_time() - self._cpu
        if self.gpu is not None:
            self.gpu.end()
        if self._first:
            self._first = False
            if self.gpu is not None:  # every group exists by now; the first step's time is not counted
                if not self.gpu.hook_groups():
                    print("kiln: stragglers: no NCCL process group can be timed; the host-side split is used",
                          file=sys.stderr, flush=True)
                    self.gpu = None
                else:
                    self.gpu.take()
            return
        self._wall += wall
        self._own += min(own, wall)
        self._steps += 1
        if self._steps < self.every:
            return
        if self.gpu is not None:  # own: the GPU's step time less its collectives' (per step, at most the wall)
            gpu_s, collective_s = self.gpu.take()
            self._own = min(max(0.0, gpu_s - collective_s / self._steps), self._wall / self._steps) * self._steps
        mine = torch.tensor([self._own / self._steps, (self._wall - self._own) / self._steps], dtype=torch.float64)
        self._own = self._wall = 0.0
        self._steps = 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return
        if self._nodes is None:  # once: which node each rank is on
            self._nodes = [""] * world
            dist.all_gather_object(self._nodes, self.node)
        backend_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        table = [torch.empty(2, dtype=torch.float64, device=backend_device) for _ in range(world)]
        dist.all_gather(table, mine.to(backend_device))
        split = torch.stack(table).cpu().tolist()
        own = [row[0] for row in split]
        named = self.streaks.report(own)
        record["rank_own_s"] = [round(x, 5) for x in own]
        record["rank_wait_s"] = [round(row[1], 5) for row in split]
        record["rank_nodes"] = list(self._nodes)
        record["stragglers"] = [{"rank": r, "node": self._nodes[r], "relative": round(rel, 3),
                                 "value": round(own[r], 5), "step": step} for r, rel in sorted(named.items())]
