"""Learning-rate schedules are pure functions of the step: warm-up, then cosine / linear / constant / wsd."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kiln.api.spec import TrainingConfig
from kiln.trainer.optim import lr_at


def cfg(**kw) -> TrainingConfig:
    base = {"steps": 100, "lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, "schedule": "cosine"}
    return TrainingConfig(**{**base, **kw})


def test_warmup_is_linear_from_zero_to_peak():
    c = cfg()
    assert lr_at(1, c) == pytest.approx(1e-4)
    assert lr_at(5, c) == pytest.approx(5e-4)
    assert lr_at(10, c) == pytest.approx(1e-3)


def test_cosine_ends_at_the_floor_and_passes_the_midpoint_halfway():
    c = cfg()
    assert lr_at(55, c) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(100, c) == pytest.approx(1e-4)
    values = [lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_linear_decays_in_a_straight_line():
    c = cfg(schedule="linear")
    assert lr_at(55, c) == pytest.approx(5.5e-4)
    assert lr_at(100, c) == pytest.approx(1e-4)
    assert lr_at(32.5, c) - lr_at(55, c) == pytest.approx(lr_at(55, c) - lr_at(77.5, c))


def test_constant_holds_the_peak_after_warmup():
    c = cfg(schedule="constant")
    assert [lr_at(s, c) for s in (10, 50, 100)] == [1e-3] * 3


def test_wsd_is_stable_then_decays_over_the_last_fraction():
    c = cfg(schedule="wsd", decay_fraction=0.2)  # decay over steps 81..100
    assert lr_at(11, c) == lr_at(80, c) == pytest.approx(1e-3)
    assert lr_at(90, c) == pytest.approx(1e-3 - 0.5 * 9e-4)
    assert lr_at(100, c) == pytest.approx(1e-4)


@given(
    schedule=st.sampled_from(["cosine", "linear", "constant", "wsd"]),
    steps=st.integers(1, 5000),
    warmup=st.integers(0, 500),
    ratio=st.floats(0, 1),
    data=st.data(),
)
def test_every_schedule_stays_between_zero_and_the_peak(schedule, steps, warmup, ratio, data):
    c = cfg(schedule=schedule, steps=steps, warmup_steps=warmup, min_lr_ratio=ratio)
    step = data.draw(st.integers(1, steps))
    lr = lr_at(step, c)
    assert math.isfinite(lr)
    assert 0 <= lr <= c.lr * (1 + 1e-12)
    if step <= warmup:
        assert lr > 0  # warm-up starts above zero at step 1
    else:
        assert lr >= c.lr * ratio - 1e-12 * c.lr  # never below the floor (up to rounding)
