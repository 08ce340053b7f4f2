"""Scaling efficiency per phase: tokens/s per worker at each node count the run has trained at, relative to the
first node count's (`status.scaling`).

Pure, no clock. The operator folds each new trainer report into the record on every status refresh:

- a report is trainer rank 0's `status.tokensPerSecond` (the job's tokens per second of step time, over its
  last logged step) at `status.step`; it is folded once, when `step` moved since the last one folded;
- per worker = tokensPerSecond / (nodes × workers per node: `resources.processesPerNode`, else the GPUs per node,
  else 1) — the run's GPUs on a GPU cluster, its processes on CPUs;
- per node count, `tokensPerSecondPerWorker` is an exponential moving average of the reports, weight `ALPHA`
  for the newest (about the last 1/ALPHA reports weigh most); the first report after the node count changed
  is skipped: it is the new world's first logged step, which carries its start-up (compile, warm caches);
- the reference is the first node count with a folded report; `efficiency` = a phase's rate / the reference's
  (1.0 for the reference itself). Phases are kept in the order they were first seen, at most `MAX_PHASES`.
"""

from __future__ import annotations

ALPHA = 0.2
MAX_PHASES = 64  # node counts a run can go through; the record stays small


def workers_per_node(resources: dict) -> int:
    """Processes per node as kiln.api.layout counts them, from the raw spec."""
    return int(resources.get("processesPerNode") or resources.get("gpusPerNode") or 1)


def fold(record: dict | None, *, nodes: int | None, per_node: int, step: int | None,
         tokens_per_second: float | None) -> dict | None:
    """status.scaling after the report (step, tokens_per_second) made at `nodes` nodes; unchanged without one."""
    record = record or {}
    if not nodes or step is None or not tokens_per_second or tokens_per_second <= 0:
        return record or None
    if step <= record.get("lastStep", -1):
        return record  # this report was folded already
    phases = [dict(p) for p in record.get("phases") or []]
    out = {**record, "lastStep": step}
    if record.get("lastNodes") != nodes:  # a new world's first report: its start-up, not its rate
        out["lastNodes"] = nodes
        return out
    rate = tokens_per_second / (nodes * per_node)
    phase = next((p for p in phases if p["nodes"] == nodes), None)
    if phase is None:
        if len(phases) >= MAX_PHASES:
            return out
        phase = {"nodes": nodes, "workers": nodes * per_node, "tokensPerSecondPerWorker": rate, "reports": 0}
        phases.append(phase)
    else:
        phase["tokensPerSecondPerWorker"] = ALPHA * rate + (1 - ALPHA) * phase["tokensPerSecondPerWorker"]
    phase["reports"] += 1
    reference = phases[0]["tokensPerSecondPerWorker"]
    for p in phases:
        p["tokensPerSecondPerWorker"] = round(p["tokensPerSecondPerWorker"], 3)
        p["efficiency"] = round(p["tokensPerSecondPerWorker"] / reference, 3) if reference > 0 else None
    out["phases"] = phases
    out["referenceNodes"] = phases[0]["nodes"]
    return out
