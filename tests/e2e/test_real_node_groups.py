"""Replica groups for real on the rig's real node: kiln's images, the operator installed by Helm, a CPU run of
2 replica groups (one pod each, gloo) and torchft's lighthouse in their own containers. A group's pod is
deleted: the other group steps on alone, the training-operator brings the pod back, and its trainer heals from
the live group (no checkpoint exists: none is read). Faults follow what the run reports, never a clock.
"""

from __future__ import annotations

import re

import pytest

from tests.support.operator import get
from tests.support.real_node import (  # noqa: F401 - fixtures
    apply, cpu_run, diagnose, loaded_images, logged_steps, operator_release, pods, runs_ns, wait_status,
)

pytestmark = [pytest.mark.rig, pytest.mark.slow]


def log(rig, ns: str, pod: str) -> str:
    return rig.kubectl("logs", "-n", ns, pod, check=False).stdout


def test_a_deleted_group_restarts_alone_and_heals_from_the_live_group(rig, real_node, operator_release, runs_ns):
    name = "e2e-groups"
    body = cpu_run(rig, real_node, runs_ns, name, steps=100000, interval=100000)  # never ends, never commits
    body["spec"]["elastic"] = {"maxRestarts": 5, "faultTolerance": {"mode": "replicaGroups", "groups": 2}}
    apply(rig, body)
    g0, g1 = f"{name}-g0-worker-0", f"{name}-g1-worker-0"
    # the lighthouse runs, and the trainer of the replica-rank-0 group reports both groups in its quorum
    both = wait_status(rig, runs_ns, name, "both groups in the quorum, stepping",
                       lambda s: (s.get("quorum") or {}).get("liveGroups") == 2 and s.get("step", 0) >= 5)
    assert get(rig, runs_ns, "deployment", f"{name}-lighthouse")["status"].get("readyReplicas") == 1
    assert [g["phase"] for g in both["replicaGroups"]] == ["Running", "Running"]
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(rig, runs_ns, name)}

    # group 1's pod is deleted (as when its node is lost): the training-operator makes it again, and its
    # trainer heals from group 0, which stepped on meanwhile
    rig.kubectl("delete", "pod", "-n", runs_ns, g1, "--wait=false")
    wait_status(rig, runs_ns, name, "group 1 back, healed from group 0", lambda s: any(
        p["metadata"]["name"] == g1 and p["metadata"]["uid"] != uids[g1] for p in pods(rig, runs_ns, name))
        and "healed from a live peer" in log(rig, runs_ns, g1))
    heal_step = int(re.search(r"group 1 healed from a live peer at step (\d+)", log(rig, runs_ns, g1)).group(1))
    back = wait_status(rig, runs_ns, name, "both groups in the quorum again",
                       lambda s: (s.get("quorum") or {}).get("liveGroups") == 2 and s["step"] > heal_step)
    text0 = log(rig, runs_ns, g0)

    # group 0 never stopped: the same pod, every step once and in order, a quorum without group 1 on the way
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(rig, runs_ns, name)}[g0] == uids[g0]
    steps0 = logged_steps(text0)
    assert steps0 == list(range(1, steps0[-1] + 1)) and steps0[-1] >= heal_step, diagnose(rig, runs_ns, name)
    assert ": 1 of 2 group(s) live" in text0, text0[-3000:]
    assert heal_step > both["step"]  # group 1 rejoined where group 0 was, past the steps it missed
    # in status: group 1 restarted alone, the run did not restart and stayed Running
    assert back["replicaGroups"][1]["restarts"] >= 1 and back["replicaGroups"][0]["restarts"] == 0
    assert back.get("restarts", 0) == 0 and back["phase"] == "Running"
    # no checkpoint was read: none exists (intervalSteps is past the run's reach)
    prefix = f"e2e/{runs_ns}/{name}/"
    assert not [o.object_name for o in rig.minio_client().list_objects(rig.s3_bucket, prefix=prefix, recursive=True)
                if o.object_name.endswith("/COMMIT")]
    rig.kubectl("delete", "trainingspec", name, "-n", runs_ns, "--wait=false")
