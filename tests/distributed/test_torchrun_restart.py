"""Workers killed under torchrun's elastic agent, with the environment the operator gives trainer pods:
each kill costs exactly one restart of the worker group, and the run finishes where an uninterrupted one
would (the workers resume from the last commit each time).

The kills strike when the run reports steps 8 and 20 of 40 (ranks in turn), so both land before the end
on a machine of any pace. The same with the operator's entry, kiln.cli.warm: every generation's ranks
are forked from the one process that holds the imports, and it is gone once torchrun has ended."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from kiln.cli.warm import socket_path
from kiln.control.plan import TORCHRUN_ENV
from tests.support.ranks import torchrun_train_with_kills, wait_until
from tests.support.runs import write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, INTERVAL, KILLS = 40, 5, [8, 20]  # 20 steps after the last kill: far more than one 20 ms look


def _warm_servers() -> set[Path]:
    return set(map(Path, glob.glob(socket_path("*"))))  # every torchrun agent's warm socket (kiln.cli.warm)


@pytest.mark.parametrize("entry", ["kiln.cli.main", "kiln.cli.warm"])
def test_two_kills_cost_two_restarts_and_the_run_finishes(tmp_path, entry):
    log = tmp_path / "torchrun.log"
    spec = write_spec(tmp_path / "spec.yaml", nproc=2, training={"steps": STEPS, "logEvery": 1},
                      checkpoint={"intervalSteps": INTERVAL, "keep": 2})
    servers = _warm_servers()
    result = torchrun_train_with_kills(spec, tmp_path / "run", log=log, kill_at_steps=KILLS, total_steps=STEPS,
                                       max_restarts=4, torchrun_env=TORCHRUN_ENV, timeout_s=600, entry=entry)
    text = log.read_text(errors="replace")
    assert result["rc"] == 0, text[-3000:]  # None: a restarted generation hung (the 600 s safety net)
    kills = result["kills"]
    assert [k["at_step"] >= due for k, due in zip(kills, KILLS)] == [True, True], result
    assert sorted(k["rank"] for k in kills) == [0, 1], result  # ranks in turn
    for kill in kills:  # each recovered, from a commit no later than the step it was killed at
        assert "kill_to_step_s" in kill, result
        assert kill["resumed_from_step"] % INTERVAL == 0 and kill["resumed_from_step"] <= kill["at_step"], result
    assert kills[1]["resumed_from_step"] >= KILLS[0], result  # the second resume used a commit of the restarted run
    # one failed worker group per kill: no restart that failed on its own (stale gloo addresses)
    assert result["worker_group_failures"] == 2, text[-3000:]
    assert result["final_step"] == STEPS
    if entry == "kiln.cli.warm":  # three generations, each forked from the warm process, none cold
        assert text.count("kiln: warm start: rank 0 forked") == 3 and "starting cold" not in text, text[-3000:]
        wait_until("the warm process ends with torchrun", lambda: not _warm_servers() - servers, timeout=60)
