"""kiln.trainer.membership.hang_watch.HangWatch: what counts as a replica group's progress, on a clock the test moves (the rule
itself, kiln.api.hang, is the operator's, tested in tests/unit/test_elastic.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.errors import KilnError
from kiln.api.hang import HANG_MIN_SAMPLES as MIN_SAMPLES
from kiln.trainer.membership.hang_watch import HANG_FLOOR_ENV, HangWatch, floor_s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stepping(steps: int, step_s: float = 0.1, floor: float = 5.0) -> tuple[HangWatch, Clock]:
    clock = Clock()
    watch = HangWatch(floor=floor, clock=clock)
    for _ in range(steps):
        clock.now += step_s
        watch.stepped()
    return watch, clock


def test_no_verdict_before_enough_step_times_and_the_first_step_is_none_of_them():
    watch, clock = stepping(MIN_SAMPLES)  # the first step (start-up, compile) gives no step time
    clock.now += 1e6
    assert watch.verdict() is None
    watch, clock = stepping(MIN_SAMPLES + 1)
    clock.now += 5.1
    assert "no training step completed for 5s" in watch.verdict()


def test_a_hang_is_no_progress_for_the_floor_or_ten_times_the_p99_step():
    watch, clock = stepping(10)
    clock.now += 4.9
    assert watch.verdict() is None
    clock.now += 0.2
    assert watch.verdict() is not None
    slow, clock = stepping(10, step_s=2.0)  # limit 10 x 2 s
    clock.now += 19.0
    assert slow.verdict() is None
    clock.now += 1.1
    assert "limit 20s" in slow.verdict()


def test_waiting_on_peers_is_no_hang_and_leaving_it_is_progress():
    watch, clock = stepping(10)
    with watch.waiting():  # a quorum waiting for a hung peer, a save, the evaluation
        clock.now += 1000
        assert watch.verdict() is None
        with watch.waiting():  # nested: still paused after the inner one ends
            clock.now += 1
        clock.now += 1000
        assert watch.verdict() is None
    clock.now += 4.9  # the clock starts again where the wait ended
    assert watch.verdict() is None
    clock.now += 0.2
    assert watch.verdict() is not None


def test_step_times_leave_the_waits_out():
    watch, clock = stepping(10)
    clock.now += 0.05
    with watch.waiting():  # a 100 s save inside one step must not raise the limit for the next 20
        clock.now += 100
    clock.now += 0.05
    watch.stepped()
    assert list(watch.recent)[-1] == pytest.approx(0.1)
    clock.now += 5.1
    assert "limit 5s" in watch.verdict()


def test_time_the_process_was_stopped_is_not_the_loops():
    watch, clock = stepping(10)
    clock.now += 1
    clock.now += 600  # SIGSTOP (a test freezing a group, a paused VM): the watch thread did not run either
    assert watch.check(slept_s=601, period=1) is None  # its wake 601 s after the last, for a 1 s period
    for slept in (1.1, 1.5):  # wakes on time (within 2 periods): counted
        clock.now += slept
        assert watch.check(slept_s=slept, period=1) is None
    clock.now += 1.5  # 1 s before the stop, 4.1 s after it
    assert "for 5s" in watch.check(slept_s=1.5, period=1)
    clock.now += 3.0  # a late wake again: 2 s of it left out
    assert "for 6s" in watch.check(slept_s=3.0, period=1)


def test_the_floor_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv(HANG_FLOOR_ENV, raising=False)
    assert floor_s() == 60.0  # the operator's floor (kiln.api.hang's default)
    monkeypatch.setenv(HANG_FLOOR_ENV, "2.5")
    assert floor_s() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(HANG_FLOOR_ENV, bad)
        with pytest.raises(KilnError, match=HANG_FLOOR_ENV):
            floor_s()


def test_the_watch_imports_no_kubernetes_and_no_torch():
    """The rule is the operator's (kiln.control.elastic): importing it in the trainer must stay cheap."""
    code = ("import sys, kiln.trainer.membership.hang_watch; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'kopf', 'kubernetes', 'kubeflow', 'torch', 'aiohttp'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
