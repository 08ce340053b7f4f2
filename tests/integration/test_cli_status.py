"""`kiln status` through a pipe (as in a CI log, no terminal) against the rig's real apiserver: long names,
URIs and messages come out whole, and -o json / -o yaml parse to the objects the apiserver holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import yaml

from tests.rig.install import install_crd
from tests.support.ranks import SAFETY_TIMEOUT_S
from tests.support.specs import small_run

pytestmark = pytest.mark.rig

NAME = "llama-8b-pretrain-long-experiment-name-abcdef"  # 45 characters: the longest name kiln accepts
URI = "s3://checkpoints-bucket/teams/research/llama-8b-pretrain-long-experiment-name-abcdef/step-00001200/"
MESSAGE = "worker pods are running on nodes " + ", ".join(f"kwok-gpu-node-{i}" for i in range(8))
STATUS = {"phase": "Running", "nodes": 2, "step": 1234, "progress": "12.3%", "tokensPerSecond": 98765.0,
          "mfu": 0.4321, "lastCheckpoint": {"step": 1200, "uri": URI}, "restarts": 3, "etaSeconds": 7300,
          "goodput": 0.912, "observedGeneration": 1,
          "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning", "message": MESSAGE,
                          "lastTransitionTime": "2026-01-01T00:00:00Z"}]}


@pytest.fixture(scope="module")
def runs(rig):
    install_crd(rig)
    ns = f"kiln-status-pipe-{uuid.uuid4().hex}{uuid.uuid4().hex}"[:63]  # as long as a namespace name can be
    rig.kubectl("create", "namespace", ns)
    try:
        for name in (NAME, "short"):
            rig.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(small_run(name)))
        rig.kubectl("patch", "trainingspec", NAME, "-n", ns, "--subresource=status", "--type", "merge",
                    "-p", json.dumps({"status": STATUS}))
        yield ns
    finally:
        rig.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def kiln_status(rig, *args: str) -> str:
    """`kiln status` with its stdout a pipe; COLUMNS=80 is what cut the table to 80 characters before."""
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "status", "--kubeconfig", str(rig.kubeconfig), *args],
                          capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S, check=False,
                          env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_table_in_a_pipe_prints_every_value_whole(rig, runs):
    out = kiln_status(rig, "-A")
    line = next(ln for ln in out.splitlines() if NAME in ln)
    assert line.split()[:11] == [runs, NAME, "Running", "2", "1234", "12.3%", "9.88e+04", "43.2%", "step", "1200",
                                 "3"]
    assert "…" not in out and "\x1b[" not in out  # no ellipsis, no colour codes in a log
    assert max(len(ln) for ln in out.splitlines()) > 80


def test_one_run_shows_its_conditions_whole_and_wide_adds_columns(rig, runs):
    out = kiln_status(rig, NAME, "-n", runs)
    assert MESSAGE in out and "PodsRunning" in out
    wide = kiln_status(rig, "-n", runs, "-o", "wide")
    header, *rows = wide.splitlines()
    assert header.split()[-8:] == ["ETA", "GOODPUT", "GPU-HOURS", "COST", "CHECKPOINT", "URI", "GENERATION",
                                   "MESSAGE"]
    row = next(r for r in rows if r.startswith(NAME))
    assert row.split()[-4:] == ["2h", "91.2%", URI, "1/1"]
    assert any(r.split()[:2] == ["short", "Pending"] for r in rows)


def test_json_and_yaml_are_the_objects(rig, runs):
    one = json.loads(kiln_status(rig, NAME, "-n", runs, "-o", "json"))
    assert one["kind"] == "TrainingSpec" and one["metadata"]["name"] == NAME
    assert one["status"] == STATUS and "managedFields" not in one["metadata"]
    listed = yaml.safe_load(kiln_status(rig, "-n", runs, "-o", "yaml"))
    assert listed["kind"] == "List"
    by_name = {i["metadata"]["name"]: i for i in listed["items"]}
    assert set(by_name) == {NAME, "short"} and by_name[NAME]["status"] == STATUS
    assert by_name["short"].get("status") in (None, {})
    empty = json.loads(kiln_status(rig, "-n", "default-no-runs-" + uuid.uuid4().hex[:6], "-o", "json"))
    assert empty == {"apiVersion": "v1", "kind": "List", "items": []}
