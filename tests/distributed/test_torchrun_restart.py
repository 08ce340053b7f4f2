"""Workers killed under torchrun's elastic agent, with the environment the operator gives trainer pods:
each kill costs exactly one restart of the worker group, and the run finishes where an uninterrupted one
would (the workers resume from the last commit each time)."""

from __future__ import annotations

import pytest

from kiln.control.plan import TORCHRUN_ENV
from tests.bench.bench_faults import _run, _spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 120  # long enough that the second kill lands before the end on an idle machine (~8 steps/s)


def test_two_kills_cost_two_restarts_and_the_run_finishes(tmp_path):
    spec = _spec(tmp_path / "spec.yaml", steps=STEPS, interval=5)
    result = _run(spec, tmp_path / "run", kill_every=3.0, max_restarts=4, log=tmp_path / "torchrun.log",
                  max_kills=2, last_step=STEPS, torchrun_env=TORCHRUN_ENV, timeout_s=240)
    log = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert result["rc"] == 0, log[-3000:]  # None: a restarted generation hung (240 s)
    assert len(result["kills"]) == 2, result
    assert all("kill_to_step_s" in kill for kill in result["kills"]), result  # both recovered
    # one failed worker group per kill: no restart that failed on its own (stale gloo addresses)
    assert result["worker_group_failures"] == 2, log[-3000:]
    assert result["final_step"] == STEPS
