"""StepGuard: the pure decisions the training loop takes on every step."""

import json
import logging
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from kiln.trainer.guards.step import Action, GuardConfig, StepGuard, robust_zscore

from kiln.trainer.guards.hooks import GuardHooks
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
@given(st.lists(st.tuples(st.one_of(st.floats(0.5, 5.0), st.floats(20.0, 100.0), st.just(math.nan)),
                          st.sampled_from([1.0, 0.5, 0.25])), min_size=2, max_size=60),
       st.data())
def test_save_and_restore_at_any_step_decides_like_the_uninterrupted_run(series, data):
    """... with steps of any share of the batch (replica groups coming and going) in between."""
    cfg = GuardConfig(min_history=3, spike_limit=2, spike_window=6)
    cut = data.draw(st.integers(1, len(series) - 1))
    whole, first = StepGuard(cfg), StepGuard(cfg)
    expected = [whole.check(i, v, 1.0, share) for i, (v, share) in enumerate(series, 1)]
    got = [first.check(i, v, 1.0, share) for i, (v, share) in enumerate(series[:cut], 1)]
    resumed = StepGuard(cfg)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.check(i, v, 1.0, share) for i, (v, share) in enumerate(series[cut:], cut + 1)]
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


# Replica groups (kiln.trainer.membership.replica_groups): the global loss that replica group 1 logged in the 10-minute benchmark
# (docs/resilience.md, run C), steps 1215-1395. Up to step 1279 both groups were live (the whole batch of 4
# sequences); from 1280 group 1 was alone (2 sequences: half the batch), and the detector saw spikes at 1352,
# 1370 and 1395 and rolled the run back 395 steps.
RUN_C_BOTH = [1.4909, 1.9157, 2.3153, 2.2228, 2.0314, 1.643, 1.9567, 1.9667, 1.9172, 1.8822, 1.8748, 2.2496, 1.9785,
              2.0247, 2.277, 1.9616, 2.1137, 1.86, 2.0654, 2.524, 1.9554, 1.928, 2.0374, 2.3947, 1.4068, 2.1123, 1.7699,
              2.0279, 2.168, 1.558, 1.7681, 1.7097, 2.1162, 2.1905, 1.8162, 2.0065, 2.0643, 1.5663, 1.9675, 1.6849,
              1.9354, 1.793, 2.5548, 1.9286, 2.1764, 2.3099, 2.0328, 2.0256, 2.5956, 2.121, 2.0244, 1.4793, 2.2752,
              2.0352, 1.8544, 1.9366, 1.4999, 1.6395, 2.4362, 2.0225, 1.8109, 1.7165, 1.7474, 1.4977, 2.1616]
RUN_C_ALONE = [2.1625, 1.6651, 1.9849, 2.5351, 1.9017, 2.3002, 2.1056, 2.2924, 2.194, 1.8599, 2.5664, 2.0935, 1.9106,
               2.4172, 1.8138, 1.6019, 2.2429, 2.4173, 1.8922, 1.8263, 2.1928, 2.0369, 1.7684, 2.3328, 2.3638, 2.0212,
               1.6588, 1.9325, 2.1513, 2.361, 2.1422, 2.0785, 2.0374, 1.8881, 1.8794, 1.7363, 0.8656, 1.8206, 1.92,
               2.3008, 1.9445, 2.6184, 1.8208, 1.8236, 1.7323, 2.0556, 2.4033, 1.3284, 1.3681, 1.9287, 1.4819, 1.8284,
               1.9264, 2.8026, 2.0381, 1.7806, 2.6348, 1.8659, 1.9576, 1.9609, 1.9795, 2.3292, 2.0443, 1.605, 1.9961,
               2.7715, 2.3453, 2.1982, 1.8965, 0.5069, 2.0472, 1.9129, 4.7749, 1.9423, 2.4721, 2.2057, 1.8687, 2.065,
               2.0302, 2.0949, 1.7115, 1.7284, 1.9586, 1.8552, 2.3408, 1.9154, 1.9632, 2.0844, 1.6931, 2.9458, 3.4873,
               1.9397, 1.8269, 1.8173, 1.6894, 2.0737, 2.162, 2.1647, 1.8517, 2.0879, 1.9084, 1.5844, 2.0916, 2.4065,
               1.8083, 2.2126, 2.8441, 2.5851, 2.0023, 1.5906, 1.8718, 2.2663, 2.3236, 2.4396, 1.8361, 3.592]


def _replay(alone_share: float, alone=RUN_C_ALONE) -> list:
    """Run C's losses through a fresh guard; the steps alone at `alone_share`. The decisions that were not OK."""
    g = StepGuard()
    series = [(1.0, v) for v in RUN_C_BOTH] + [(alone_share, v) for v in alone]
    return [d for d in (g.check(s, v, 1.0, share) for s, (share, v) in enumerate(series, 1215))
            if d.action is not Action.OK]


def test_a_half_batch_step_is_judged_by_its_share_of_the_batch():
    """The loss of 2 sequences is heavy-tailed: one odd sequence moves it twice as far as it moves the mean of 4,
    while its spread grows only √2. Unweighted (every step a whole batch, as before), run C's steps alone roll
    the run back at step 1395; weighted by their share (1 of 2 groups), the one outlier (step 1352, 4.77 against
    a median of 1.96) is still skipped, and nothing is rolled back."""
    before = _replay(1.0)
    assert [(d.step, d.action) for d in before] == [(1352, Action.SKIP), (1370, Action.SKIP),
                                                    (1395, Action.ROLLBACK)]
    assert [(d.step, d.action) for d in _replay(0.5)] == [(1352, Action.SKIP)]


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_a_whole_batch_jump_is_still_rolled_back_at_any_share(share):
    """What a real spike looks like (every sequence's loss up: the weights went bad): three steps at 2.5× the
    median (1.96 → 4.9) roll back whether the steps average the whole batch or half of it."""
    alone = RUN_C_ALONE[:60] + [2.5 * 1.96] * 3
    decisions = _replay(share, alone)
    assert decisions[-1].action is Action.ROLLBACK and decisions[-1].step == 1215 + len(RUN_C_BOTH) + 62
    assert [d.step for d in decisions[-3:]] == [1215 + len(RUN_C_BOTH) + i for i in (60, 61, 62)]


def test_the_share_weighs_the_zscore_and_old_state_means_whole_batches():
    history = [2.0, 2.2, 1.8, 2.1, 1.9, 2.05, 1.95, 2.0]
    assert robust_zscore(3.0, history) == robust_zscore(3.0, history, shares=[1.0] * 8)
    # half the batch: the deviation counts half, against a full-batch spread (each half-batch loss's × √0.5)
    assert robust_zscore(3.0, history, share=0.5) == pytest.approx(robust_zscore(3.0, history) / 2)
    assert robust_zscore(3.0, history, shares=[0.5] * 8) == pytest.approx(robust_zscore(3.0, history) * 2 ** 0.5)
    g = StepGuard()
    _warm(g)
    saved = json.loads(json.dumps(g.state_dict()))
    assert saved["shares"] == [1.0] * 20
    del saved["shares"]  # a checkpoint from before kiln weighed shares
    old = StepGuard()
    old.load_state_dict(saved)
    assert list(old.shares) == [1.0] * 20 and list(old.history) == list(g.history)
    with pytest.raises(ValueError, match="20 losses but 3 batch shares"):
        old.load_state_dict({**saved, "shares": [1.0] * 3})
    with pytest.raises(ValueError, match="share of the global batch"):
        g.check(30, 2.0, share=0.0)


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
    from kiln.trainer.observe.exporter import TrainerExporter
    from kiln.trainer.guards.sdc import SDC_INCIDENTS, SilentDataCorruption
    from kiln.trainer.loop import StepContext

    store = FileStore(tmp_path / "checkpoints")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = lambda step: StepContext(step=step, loss=1.0, grad_norm=1.0, model_parts=[model],  # noqa: E731
                                       optimizers=[opt], mesh=None, record={})

        first = GuardHooks(sdc_every=2, health_interval_s=0)
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

        second = GuardHooks(sdc_every=2, health_interval_s=0)  # the restarted trainer, resumed from the commit
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


def test_gpu_health_probes_follow_a_clock_not_the_step_count(monkeypatch):
    """The probe (resources.gpuHealthIntervalSeconds) comes at the first step, then at the end of the first step
    after each interval on the hook's clock: many fast steps inside an interval probe nothing, one slow step
    that outlasts it probes at its end, whatever the step count. The clock is a FAKE set per step."""
    from types import SimpleNamespace

    from kiln.trainer.observe import gpu_health

    probes = []

    class FakeMonitor:  # stands in for NVML: only when the hook probes matters here
        def probe(self, expected):
            probes.append(step)
            return gpu_health.unreadable("FAKE", expected)

    monkeypatch.setattr(gpu_health, "GpuMonitor", FakeMonitor)
    monkeypatch.setattr(gpu_health, "gather", lambda entry: [entry])
    now = [0.0]
    hooks = GuardHooks(sdc_every=0, health_interval_s=30, clock=lambda: now[0])
    times = {1: 0.0, **{s: 0.05 * s for s in range(2, 500)}, 500: 29.9, 501: 30.0, 502: 30.5, 503: 1000.0,
             504: 1000.1}
    for step, t in times.items():
        now[0] = t
        ctx = SimpleNamespace(step=step, record={}, rollback=False)
        hooks.after_update(ctx)
        assert ("gpu_health" in ctx.record) == (step in probes)
    assert probes == [1, 501, 503]  # 499 fast steps: none; 30 s passed at 501; one slow step (502 → 503)
    off = GuardHooks(sdc_every=0, health_interval_s=0, clock=lambda: now[0])  # 0: never
    off.after_update(SimpleNamespace(step=1, record={}, rollback=False))
    assert probes == [1, 501, 503]
