"""StepGuard: the pure decisions the training loop takes on every step."""

import json
import logging
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from kiln.trainer.guards import Action, GuardConfig, GuardHooks, StepGuard, robust_zscore
from kiln.trainer.loop import StepHooks


def _warm(guard: StepGuard, n: int = 20, start: int = 1) -> int:
    rng = random.Random(0)
    for s in range(start, start + n):
        assert guard.check(s, 3.0 - 0.01 * s + rng.uniform(-0.02, 0.02), 1.0).action is Action.OK
    return start + n


@pytest.mark.parametrize("loss,norm,what", [(math.nan, 1.0, "loss"), (math.inf, 1.0, "loss"),
                                            (2.0, math.nan, "grad norm"), (2.0, -math.inf, "grad norm")])
def test_nonfinite_is_skipped_and_counted(loss, norm, what):
    g = StepGuard()
    step = _warm(g)
    d = g.check(step, loss, norm)
    assert d.action is Action.SKIP and f"non-finite {what}" in d.reason
    assert g.metrics()["guard_skipped_nonfinite"] == 1
    assert len(g.history) == 20  # the bad value did not enter the baseline


def test_single_spike_is_skipped_but_normal_noise_is_not():
    g = StepGuard()
    step = _warm(g)
    assert g.check(step, 2.85, 1.0).action is Action.OK  # within noise
    d = g.check(step + 1, 9.0, 1.0)
    assert d.action is Action.SKIP and d.zscore > 6
    assert g.metrics()["guard_skipped_spike"] == 1
    # a big *drop* in loss is never a spike
    assert g.check(step + 2, 0.5, 1.0).action is Action.OK


def test_no_verdict_before_min_history():
    g = StepGuard(GuardConfig(min_history=8))
    for s in range(1, 8):
        assert g.check(s, 10.0 ** s, 1.0).action is Action.OK


def test_repeated_spikes_request_rollback_with_data_window():
    g = StepGuard(GuardConfig(spike_limit=3, spike_window=10))
    step = _warm(g)
    assert g.check(step, 50.0).action is Action.SKIP
    assert g.check(step + 1, 2.8).action is Action.OK
    assert g.check(step + 4, 60.0).action is Action.SKIP
    d = g.check(step + 6, 70.0)
    assert d.action is Action.ROLLBACK
    assert d.skip_data == (step, step + 6)
    m = g.metrics()
    assert m["guard_rollbacks"] == 1 and m["guard_skipped_spike"] == 2


def test_spikes_spread_out_do_not_roll_back():
    g = StepGuard(GuardConfig(spike_limit=3, spike_window=10))
    step = _warm(g)
    for k in range(5):
        assert g.check(step + 11 * k, 50.0).action is Action.SKIP
    assert g.metrics()["guard_rollbacks"] == 0


def test_state_roundtrip_keeps_baseline_and_counters():
    g = StepGuard()
    step = _warm(g)
    g.check(step, math.nan)
    g.check(step + 1, 40.0)
    h = StepGuard()
    h.load_state_dict(g.state_dict())
    keys = ("guard_skipped_nonfinite", "guard_skipped_spike", "guard_rollbacks")
    assert [h.metrics()[k] for k in keys] == [g.metrics()[k] for k in keys] == [1, 1, 0]
    assert h.check(step + 2, 40.0).action is Action.SKIP  # baseline restored: still a spike


def test_restored_guard_continues_spike_window_and_records_skipped_data():
    cfg = GuardConfig(spike_limit=3, spike_window=10)
    g = StepGuard(cfg)
    step = _warm(g)
    g.check(step, 50.0)
    g.check(step + 1, 60.0)
    h = StepGuard(cfg)  # the restarted process: two spikes already seen, in trainer.json (JSON round trip)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    d = h.check(step + 2, 70.0)
    assert d.action is Action.ROLLBACK and d.skip_data == (step, step + 2)
    assert h.skipped_data == [(step, step + 2)]
    k = StepGuard(cfg)
    k.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert k.skipped_data == [(step, step + 2)] and k.metrics()["guard_rollbacks"] == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(0.5, 5.0), st.floats(20.0, 100.0), st.just(math.nan)), min_size=2, max_size=60),
       st.data())
def test_save_and_restore_at_any_step_decides_like_the_uninterrupted_run(series, data):
    cfg = GuardConfig(min_history=3, spike_limit=2, spike_window=6)
    cut = data.draw(st.integers(1, len(series) - 1))
    whole, first = StepGuard(cfg), StepGuard(cfg)
    expected = [whole.check(i, v, 1.0) for i, v in enumerate(series, 1)]
    got = [first.check(i, v, 1.0) for i, v in enumerate(series[:cut], 1)]
    resumed = StepGuard(cfg)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.check(i, v, 1.0) for i, v in enumerate(series[cut:], cut + 1)]
    assert [(d.action, d.skip_data) for d in got] == [(d.action, d.skip_data) for d in expected]
    keys = ("guard_skipped_nonfinite", "guard_skipped_spike", "guard_rollbacks")
    assert [resumed.metrics()[k] for k in keys] == [whole.metrics()[k] for k in keys]


def test_guard_hooks_register_their_state_and_warn_on_a_checkpoint_without_it(caplog):
    hooks = StepHooks()
    guards = GuardHooks(GuardConfig(min_history=5))
    guards.install(hooks)
    assert hooks.state["guards"] is guards
    _warm(guards.guard)
    with caplog.at_level(logging.WARNING, logger="kiln.guards"):
        guards.load_state_dict(None)  # an old checkpoint: nothing saved under "guards"
    assert "no guard state" in caplog.text and "warms up again" in caplog.text and "5 accepted losses" in caplog.text
    fresh = GuardHooks()
    fresh.load_state_dict(json.loads(json.dumps(guards.state_dict())))
    assert list(fresh.guard.history) == list(guards.guard.history)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="min_history"):
        GuardConfig(window=4, min_history=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=3, max_size=64), st.floats(0.1, 10.0))
def test_zscore_is_monotone_in_value(hist, x):
    assert robust_zscore(x + 1.0, hist) > robust_zscore(x, hist)
    assert robust_zscore(max(hist) + 0.0, hist) >= 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.5, 5.0)), max_size=80))
def test_any_series_never_accepts_a_nonfinite_step(series):
    g = StepGuard(GuardConfig(spike_limit=2, spike_window=5))
    for i, v in enumerate(series, 1):
        d = g.check(i, v, 1.0)
        if not math.isfinite(v):
            assert d.action is Action.SKIP
        assert all(math.isfinite(h) for h in g.history)


def test_an_sdc_mismatch_outlives_the_trainer_it_ends(tmp_path):
    """One real process (a 1-rank gloo group): a bit flipped in the weights between the seal and the check
    ends the step with SilentDataCorruption, is kept in the run's checkpoint store, and the next trainer of
    the run counts it: its records and Prometheus gauge say 1 mismatch from its first step."""
    import torch
    import torch.distributed as dist
    from prometheus_client import CollectorRegistry

    from kiln.storage.store import FileStore
    from kiln.trainer.exporter import TrainerExporter
    from kiln.trainer.guards import SDC_INCIDENTS, SilentDataCorruption
    from kiln.trainer.loop import StepContext

    store = FileStore(tmp_path / "checkpoints")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = lambda step: StepContext(step=step, loss=1.0, grad_norm=1.0, model_parts=[model],  # noqa: E731
                                       optimizers=[opt], mesh=None, record={})

        first = GuardHooks(sdc_every=2, health_every=0)
        first.install(hooks := StepHooks())
        hooks.record_incidents(store)  # as the run hands every hook its checkpoint store (kiln.trainer.run)
        step1 = ctx(1)
        assert first.before_update(step1)
        first.after_update(step1)  # seals the weights for step 2's check
        assert step1.record["sdc_mismatches"] == 0
        with torch.no_grad():
            model.weight.view(torch.int32)[0, 0] ^= 1 << 3
        with pytest.raises(SilentDataCorruption, match="step 2"):
            first.before_update(ctx(2))
        (incident,) = store.list(SDC_INCIDENTS)
        assert json.loads(store.get_bytes(incident.key))["step"] == 2
        assert json.loads(store.get_bytes(incident.key))["ranks"] == [0]

        second = GuardHooks(sdc_every=2, health_every=0)  # the restarted trainer, resumed from the commit
        second.install(hooks := StepHooks())
        hooks.record_incidents(store)
        again = ctx(1)
        second.before_update(again)
        second.after_update(again)
        assert again.record["sdc_mismatches"] == 1
        exporter = TrainerExporter("flipped", registry=CollectorRegistry())
        exporter.observe(again.record)
        assert exporter.registry.get_sample_value("kiln_train_sdc_mismatches", {"run": "flipped"}) == 1
    finally:
        dist.destroy_process_group()
