"""The commit protocol's pure core: step names, COMMIT files, retention, the Young/Daly interval."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.storage import ObjectInfo
from kiln.storage.commit import (
    Commit,
    FileEntry,
    parse_step,
    retention_plan,
    step_dir,
    steps_from_listing,
)
from kiln.trainer.checkpoint.interval import young_daly_interval


def test_step_names_round_trip():
    assert step_dir(1000) == "step-00001000"
    assert parse_step("step-00001000") == 1000
    assert parse_step("step-00001000\n") == 1000
    assert parse_step(step_dir(123456789)) == 123456789
    assert parse_step("step-12") is None and parse_step("latest") is None


def test_commit_round_trip_and_bad_commit():
    commit = Commit(step=7, files={"__0_0.distcp": FileEntry(10, "ab" * 32), ".metadata": FileEntry(3, "cd" * 32)})
    back = Commit.from_bytes(commit.to_bytes(), where="x")
    assert back.step == 7 and back.files == commit.files
    with pytest.raises(KilnError, match="s3://b/step-00000007/COMMIT is not a valid COMMIT"):
        Commit.from_bytes(b'{"step": 7}', where="s3://b/step-00000007/COMMIT")
    with pytest.raises(KilnError, match="^x is not valid JSON"):
        Commit.from_bytes(b"\x00garbage", where="x")


def test_only_steps_with_a_commit_count_as_committed():
    listing = [
        ObjectInfo("step-00000010/__0_0.distcp", 5),
        ObjectInfo("step-00000010/COMMIT", 5),
        ObjectInfo("step-00000020/__0_0.distcp", 5),  # crashed before COMMIT
        ObjectInfo("step-00000020/COMMIT.partial", 5),
        ObjectInfo("notastep/COMMIT", 1),
    ]
    seen, committed = steps_from_listing(listing)
    assert seen == {10, 20} and committed == {10}


@pytest.mark.parametrize(
    ("seen", "committed", "keep", "doomed"),
    [
        ({10, 20, 30, 40}, {10, 20, 30, 40}, 2, [10, 20]),
        ({10, 20, 30}, {10, 20, 30}, 5, []),
        # uncommitted leftovers older than the newest commit go; one newer may be in flight and stays
        ({10, 15, 20, 25}, {10, 20}, 2, [15]),
        ({10, 15, 20, 25}, {10, 20}, 1, [10, 15]),
        # nothing committed: nothing is deleted (never lose the only copy of anything)
        ({10, 20}, set(), 1, []),
        # keep < 1 still keeps the newest commit
        ({10, 20}, {10, 20}, 0, [10]),
    ],
)
def test_retention_plan(seen, committed, keep, doomed):
    plan = retention_plan(seen, committed, keep)
    assert plan == doomed
    assert max(committed, default=None) not in plan


def test_retention_after_a_commit_drops_the_abandoned_timeline():
    """Resumed from step 20 because step 30 was damaged, the run commits 25: 30 (and a crashed 35) must go,
    or a later resume would jump back into the abandoned future."""
    assert retention_plan({10, 20, 25, 30, 35}, {10, 20, 25, 30}, keep=2, current=25) == [10, 30, 35]
    # the step just committed is kept even if the listing has not caught up with it
    assert retention_plan({10, 20}, {10, 20}, keep=1, current=21) == [10, 20]
    assert retention_plan({10, 20, 30}, {10, 20, 30}, keep=3, current=30) == []


def test_young_daly():
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)  # sqrt(2 * 2 * 3600)
    # cheaper saves or more failures → save more often
    assert young_daly_interval(0.5, 3600.0) < young_daly_interval(2.0, 3600.0)
    assert young_daly_interval(2.0, 600.0) < young_daly_interval(2.0, 3600.0)
    assert young_daly_interval(0.0, 3600.0) == 0.0
