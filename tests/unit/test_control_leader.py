"""Leader election's decisions (kiln.control.leader.claim, pure), the reconcile backoff, and the per-run
state's one forget(). The Lease on a real apiserver: tests/integration/test_operator_ha.py."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kiln.control import leader
from kiln.control.runs import Runs
from kiln.control.sync import backoff_s

T = leader.Timing(duration_s=15)
WALL = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


def held(by: str | None, transitions: int = 0, rv: str = "7") -> dict:
    return {"metadata": {"name": "kiln-operator", "namespace": "ops", "resourceVersion": rv},
            "spec": {"holderIdentity": by, "leaseDurationSeconds": 15, "acquireTime": "2026-12-01T11:00:00.000000Z",
                     "renewTime": "2026-12-01T11:59:59.000000Z", "leaseTransitions": transitions}}


def test_no_lease_is_created_for_me():
    body = leader.claim(None, "ops", "kiln-operator", "a", 0.0, WALL, T)
    assert body["metadata"] == {"name": "kiln-operator", "namespace": "ops"}
    assert body["spec"]["holderIdentity"] == "a" and body["spec"]["leaseTransitions"] == 0
    assert body["spec"]["renewTime"] == "2026-12-01T12:00:00.000000Z"


def test_a_lease_someone_renews_is_left_alone_until_it_stays_unchanged_past_its_duration():
    assert leader.claim(held("b"), "ops", "kiln-operator", "a", 0.0, WALL, T) is None
    assert leader.claim(held("b"), "ops", "kiln-operator", "a", 15.0, WALL, T) is None
    taken = leader.claim(held("b", transitions=3), "ops", "kiln-operator", "a", 15.1, WALL, T)
    # replaced at the version read: if b renewed meanwhile the apiserver answers 409 and a stays a standby
    assert taken["metadata"]["resourceVersion"] == "7"
    assert taken["spec"]["holderIdentity"] == "a" and taken["spec"]["leaseTransitions"] == 4
    assert taken["spec"]["acquireTime"] == taken["spec"]["renewTime"]


def test_the_holder_renews_keeping_its_acquire_time_and_a_released_lease_is_free_at_once():
    renewed = leader.claim(held("a", transitions=2), "ops", "kiln-operator", "a", 0.0, WALL, T)
    assert renewed["spec"]["acquireTime"] == "2026-12-01T11:00:00.000000Z"
    assert renewed["spec"]["leaseTransitions"] == 2
    free = leader.released(held("a"), "a")
    assert free["spec"]["holderIdentity"] is None
    assert leader.released(held("b"), "a") is None  # never release someone else's
    assert leader.claim(free, "ops", "kiln-operator", "c", 0.0, WALL, T)["spec"]["holderIdentity"] == "c"


@pytest.mark.parametrize("value, env, sa, namespaces, where", [
    ("team/lease", {}, None, None, ("team", "lease")),
    ("lease", {"POD_NAMESPACE": "kiln"}, "other", None, ("kiln", "lease")),
    (None, {}, "kiln", ["a"], ("kiln", "kiln-operator")),  # in cluster: the ServiceAccount's namespace
    ("", {}, None, ["a", "b"], ("a", "kiln-operator")),  # out of cluster, namespaced
    (None, {}, None, None, ("kiln-system", "kiln-operator")),
])
def test_lease_location(value, env, sa, namespaces, where):
    assert leader.location(value, env, sa, namespaces) == where


def test_backoff_grows_from_seconds_to_a_cap():
    delays = [backoff_s(n) for n in range(10)]
    assert delays[:4] == [5, 10, 20, 40]
    assert all(a <= b for a, b in zip(delays, delays[1:])) and max(delays) == 300
    assert backoff_s(10_000) == 300


def test_forget_drops_everything_remembered_of_a_run():
    runs = Runs()
    run = runs[("ns", "a")]
    run.spec, run.derived_from, run.due = {"x": 1}, "12", 5.0
    run.applied["/api/v1/namespaces/ns/configmaps/a-spec"] = ("d", 1.0)
    assert runs[("ns", "a")] is run
    runs.forget(("ns", "a"))
    fresh = runs[("ns", "a")]
    assert fresh is not run and fresh.spec is None and not fresh.applied and fresh.due is None
