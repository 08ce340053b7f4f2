"""`kiln torchrun`, what trainer pods run: a pod that is stopped (deleted, evicted, preempted, its node
drained) gets SIGTERM; the ranks save, and the launcher must exit 128+15, a code the PyTorchJob's ExitCode
restart policy retries. Plain torchrun exits 1 there, which that policy treats as a permanent failure: on the
rig's real node one deleted worker pod failed the whole run (tests/e2e/test_real_node.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.ranks import SAFETY_TIMEOUT_S, wait_for_step
from tests.support.runs import env, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("rank_command", [["--no-python", "kiln", "train"], ["-m", "kiln.cli.warm", "train"]],
                         ids=["cold", "warm"])  # warm: what the operator's pods run (kiln.control.plan)


def test_a_stopped_launcher_saves_and_exits_with_a_retryable_code(tmp_path, rank_command):
    ckpt = tmp_path / "ckpt"
    spec = write_spec(tmp_path / "spec.yaml", nproc=2, training={"steps": 100000, "globalBatchSize": 4},
                      checkpoint={"uri": f"file://{ckpt}/"})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli.main", "torchrun", "--standalone", "--nproc-per-node=2", *rank_command,
         "--config", str(spec), "--output", str(out)],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(out / "metrics.jsonl", 3, proc)
        proc.send_signal(signal.SIGTERM)  # the kubelet, when the pod is deleted
        log, _ = proc.communicate(timeout=SAFETY_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "exiting 143 (retryable)" in log
    saved = (ckpt / "latest").read_text().strip()  # the ranks committed before the launcher ended
    assert saved.startswith("step-") and int(saved.split("-")[1]) >= 3, log[-3000:]


def test_a_rank_stopped_by_a_peers_signal_does_not_report_the_run_done(tmp_path):
    """Only rank 1's process is stopped (its pod deleted): both ranks save the same step; rank 1 exits 0 (its
    launcher reports the signal), rank 0 exits 143 so that its torchrun restarts the group instead of ending
    the PyTorchJob as Succeeded (an elastic job succeeds when one worker does)."""
    from tests.support.ranks import free_port

    ckpt = tmp_path / "ckpt"
    spec = write_spec(tmp_path / "spec.yaml", nproc=2, training={"steps": 100000, "globalBatchSize": 4},
                      checkpoint={"uri": f"file://{ckpt}/"})
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        rank_env = env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "train", "--config", str(spec), "--output", str(tmp_path / "out")],
            env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        wait_for_step(tmp_path / "out" / "metrics.jsonl", 3, ranks[0])
        ranks[1].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=SAFETY_TIMEOUT_S)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert ranks[1].returncode == 0, logs[1][-3000:]
    assert ranks[0].returncode == 128 + signal.SIGTERM, logs[0][-3000:]
    assert (ckpt / "latest").read_text().strip().startswith("step-"), logs[0][-3000:]
