"""What the faults of a fault benchmark cost, in kiln's own terms (issue 31, item 2).

A benchmark's timeline — what held when (Running, or Restarting from a kill until the new workers' first step)
and the trainer's time counters as it reported them then (status.trainerTime) — goes through the operator's
goodput ledger (`kiln.control.goodput.observe`) at the devices the job held, and is priced by its
`kiln.control.goodput.cost`: the GPU-hours by cause that `status.cost` would show, and their amount at
`--price-per-gpu-hour`. On the CPU a device is a process (a rank): device-hours stand for GPU-hours.

What a fault cost is the faulty job's GPU-hours by cause less the reference's (no faults, the same steps, in
the same invocation), over the number of faults: restart (kill → first step, and the steps redone after the
resume), other (held, not stepping: the survivors' wait in replica-group mode, start-up), and productive and
checkpointStall (the load's noise between the two runs, signed, not hidden).
"""

from __future__ import annotations

import argparse

from kiln.control.goodput import COUNTERS, GPU_CAUSES, Ledger, cost, observe

DEFAULT_PRICE = 3.5  # per GPU-hour: docs/operator.md's example price of an NVIDIA-H200 (a parameter, not a fact)
Interval = tuple[float, str, dict]  # (seconds since launch it ends at, what held during it, trainerTime then)


def add_price_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--price-per-gpu-hour", type=float, default=DEFAULT_PRICE,
                    help="the price of a GPU-hour (on the CPU: of a device-hour, a rank's) for the cost of a fault")
    ap.add_argument("--currency", default="USD")


def ledger(intervals: list[Interval], devices: int) -> Ledger:
    """The operator's ledger over the timeline (from the launch at 0), `devices` held throughout."""
    out = Ledger(observed_at=0.0)
    for until_s, held, trainer_time in intervals:
        out = observe(out, until_s, held, {**dict.fromkeys(COUNTERS, 0.0), **trainer_time}, devices)
    return out


def priced(intervals: list[Interval], devices: int, price: float, currency: str) -> dict:
    """status.cost of the timeline, with the ledger's goodput and device-seconds by cause."""
    held = ledger(intervals, devices)
    return {"devices": devices, "goodput": round(held.goodput, 4), "wall_s": round(held.wall_s, 3),
            "device_seconds": {c: round(v, 3) for c, v in held.gpu_s.items()}, **cost(held, price, currency)}


def per_fault(faulty: dict, reference: dict, faults: int, price: float, currency: str) -> dict | None:
    """The faulty job's device-seconds by cause less the reference's, per fault, priced by kiln's cost."""
    if not faults:
        return None
    extra = {c: (faulty["device_seconds"][c] - reference["device_seconds"][c]) / faults for c in GPU_CAUSES}
    lost = Ledger(observed_at=0.0, gpu_s=extra)  # only its GPU-seconds are priced
    return {"faults": faults, "device_seconds": {c: round(v, 3) for c, v in extra.items()},
            **cost(lost, price, currency)}


def timeline(run: dict) -> list[Interval]:
    """A torchrun run of tests.support.ranks.torchrun_train_with_kills as the operator sees it: Running, then
    Restarting from each kill until the new workers' first step, then Running to the end."""
    out: list[Interval] = []
    for kill in run["kills"]:
        out.append((kill["at_s"], "Running", kill["trainer_time_at_kill"]))
        if "kill_to_step_s" in kill:
            out.append((kill["at_s"] + kill["kill_to_step_s"], "Restarting", kill["trainer_time_at_step"]))
    return [*out, (run["wall_s"], "Running", run["trainer_time"])]
