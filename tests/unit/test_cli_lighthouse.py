"""`kiln-lighthouse` (kiln.cli.lighthouse): torchft's lighthouse server without torch in the process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

LIGHTHOUSE = str(Path(sys.executable).with_name("kiln-lighthouse"))  # this environment's console script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_lighthouse_listens_on_the_given_port_without_loading_torch():
    port = free_port()
    proc = subprocess.Popen([LIGHTHOUSE, "--min_replicas", "1",
                             "--join_timeout_ms", "1000", "--bind", f"[::]:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a safety net: the loop ends when the server listens
        while True:
            assert proc.poll() is None, f"the lighthouse exited: {proc.stderr.read()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the lighthouse never listened"
                time.sleep(0.05)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "torch was loaded into the lighthouse process"
        assert "_torchft" in maps
    finally:
        proc.kill()
        proc.wait()


def test_a_flag_the_server_does_not_know_is_refused_by_its_own_parser():
    proc = subprocess.run([LIGHTHOUSE, "--no-such-flag"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--no-such-flag" in proc.stderr and "USAGE" in proc.stderr
