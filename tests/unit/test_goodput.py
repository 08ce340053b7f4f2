"""Goodput ledger: productive step time over wall time, and where the rest went."""

import pytest
from hypothesis import given, settings, strategies as st

from kiln.control.goodput import CAUSES, Ledger, Report, observe


def test_a_run_with_pending_stall_restart_and_redone_steps():
    g = observe(Ledger(), 0, "Pending")
    g = observe(g, 30, "Pending")                                     # 30 s waiting for pods
    g = observe(g, 40, "Running", Report(step=0, productive_s=0.0))   # 10 s start-up → other
    g = observe(g, 140, "Running", Report(step=100, productive_s=90.0, checkpoint_stall_s=5.0))
    assert g.productive_s == pytest.approx(90) and g.lost_s["checkpoint_stall"] == pytest.approx(5)
    assert g.mean_step_s == pytest.approx(0.9)
    g = observe(g, 160, "Restarting")                                 # node lost: 20 s restarting
    # the new process resumed from the commit at step 80: steps 81..100 are done again
    g = observe(g, 200, "Running", Report(step=110, productive_s=27.0, start_step=80))
    assert g.lost_s["restart"] == pytest.approx(20 + 20 * 0.9)
    assert g.productive_s == pytest.approx(90 + 27 - 18)
    assert g.lost_s["pending"] == pytest.approx(30)
    assert g.wall_s == pytest.approx(200)
    assert g.goodput == pytest.approx(99 / 200)


def test_rollback_in_process_is_attributed_to_rollback():
    g = observe(Ledger(), 0, "Running", Report(step=0, productive_s=0))
    g = observe(g, 100, "Running", Report(step=100, productive_s=100))
    g = observe(g, 130, "Running", Report(step=90, productive_s=120, rollbacks=1))  # back to the commit at 90
    assert g.lost_s["rollback"] == pytest.approx(10) and g.lost_s["restart"] == 0
    assert g.productive_s == pytest.approx(110)


def test_suspended_time_counts_neither_way():
    g = observe(Ledger(), 0, "Running", Report(step=0, productive_s=0))
    g = observe(g, 50, "Running", Report(step=50, productive_s=50))
    g = observe(g, 5000, "Suspended")
    assert g.wall_s == pytest.approx(50) and g.goodput == pytest.approx(1.0)


def test_status_roundtrip():
    g = observe(Ledger(), 0, "Running", Report(step=0, productive_s=0))
    g = observe(g, 100, "Running", Report(step=10, productive_s=80, checkpoint_stall_s=3))
    st_ = g.as_status()
    assert st_["goodput"] == 0.8
    h = Ledger.from_status(st_)
    assert (h.productive_s, h.lost_s, h.last, h.max_step) == (g.productive_s, g.lost_s, g.last, g.max_step)
    assert Ledger.from_status({}) == Ledger()


reports = st.lists(st.tuples(st.floats(0, 100), st.sampled_from(["Pending", "Running", "Restarting", "Scaling"]),
                             st.integers(0, 500), st.floats(0, 200), st.floats(0, 50), st.integers(0, 3),
                             st.integers(0, 400)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(reports)
def test_accounting_never_invents_time(events):
    g, now = observe(Ledger(), 0, "Pending"), 0.0
    for dt, phase, step, prod, stall, rb, start in events:
        now += dt
        g = observe(g, now, phase, Report(step, prod, stall, rb, min(start, step)) if phase == "Running" else None)
        assert g.wall_s == pytest.approx(now, abs=1e-6)  # every second is productive or lost by one cause
        assert all(g.lost_s[c] >= -1e-9 for c in CAUSES) and g.productive_s >= -1e-9
        assert 0.0 <= g.goodput <= 1.0 + 1e-9
