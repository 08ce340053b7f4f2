"""`kiln-lighthouse` (kiln.cli.lighthouse): torchft's lighthouse server without torch in the process."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.groups import LIGHTHOUSE, listening
from tests.support.ranks import free_port, wait_until



def test_the_lighthouse_listens_on_the_given_port_without_loading_torch():
    port = free_port()
    proc = subprocess.Popen([LIGHTHOUSE, "--min_replicas", "1", "--join_timeout_ms", "1000", "--bind", f"[::]:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until("the lighthouse listens", lambda: listening(port), alive=lambda: proc.poll() is None,
                   context=lambda: proc.stderr.read() if proc.poll() is not None else "")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "torch was loaded into the lighthouse process"
        assert "_torchft" in maps
    finally:
        proc.kill()
        proc.wait()


def test_a_flag_the_server_does_not_know_is_refused_by_its_own_parser():
    proc = subprocess.run([LIGHTHOUSE, "--no-such-flag"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--no-such-flag" in proc.stderr and "USAGE" in proc.stderr
