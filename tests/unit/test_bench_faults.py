"""tests/bench/bench_faults.py `compare`: the restart-cost ratios of code variants, round by round."""

from __future__ import annotations

import pytest

from tests.bench.bench_faults import PHASES, compare, summarize


def restarts(total: float) -> dict:
    """A variant's restart_breakdown over two kills, each phase an equal share of `total` seconds."""
    share = total / len(PHASES)
    return summarize([{**{name: share for name, _, _ in PHASES}, "total": total}] * 2)


def test_a_round_without_a_measured_restart_is_flagged_not_a_crash():
    rounds = [{"before": {"restart_breakdown": restarts(10.0)}, "after": {"restart_breakdown": restarts(5.0)}},
              {"before": {"restart_breakdown": restarts(12.0)}, "after": {"restart_breakdown": None}},  # no kill timed
              {"before": {"restart_breakdown": restarts(8.0)}, "after": {"restart_breakdown": restarts(6.0)}}]
    after = compare(rounds, "before")["after"]
    assert [r and r["total"] for r in after["ratio_to_before"]] == pytest.approx([0.5, None, 0.75])  # by round
    assert after["median_total_ratio"] == pytest.approx(0.625)  # of the two measured rounds
    assert after["unmeasured_rounds"] == [1]


def test_a_base_that_took_no_time_gives_no_ratio():
    zero = restarts(0.0)
    rounds = [{"before": {"restart_breakdown": zero}, "after": {"restart_breakdown": restarts(5.0)}}] * 2
    after = compare(rounds, "before")["after"]
    assert after["median_total_ratio"] is None and after["unmeasured_rounds"] == [0, 1]
