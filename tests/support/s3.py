"""A versitygw of a test's own (posix backend in a temp dir, its own keys) that the test may stop and start
again: an S3 endpoint that goes away under a checkpoint; and `s3_prefix`, a fresh prefix in the rig's S3."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
import uuid

import pytest

from kiln.storage import open_store

from tests.support.ranks import free_port, wait_until


ACCESS = "kiln-ckpt-test"
SECRET = "kiln-ckpt-test-secret"


class PrivateS3:
    """A versitygw of our own (posix backend in a temp dir) that a test may stop and start again."""

    def __init__(self, data_dir):
        from tests.rig import build

        if not build.is_built("versitygw"):
            build.build(["versitygw"])
        self.exe = str(build.bin_dir() / "versitygw")
        self.data_dir = data_dir
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / "versitygw.log"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    self.exe,
                    "--access",
                    ACCESS,
                    "--secret",
                    SECRET,
                    "--port",
                    f"127.0.0.1:{self.port}",
                    "posix",
                    str(self.data_dir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_until("the private versitygw answering", self.answers, alive=lambda: self.proc.poll() is None,
                   context=lambda: self.log.read_text()[-2000:])

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2)
        except urllib.error.HTTPError:
            pass  # it answers (anonymous requests are refused)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def s3_prefix(rig, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rig.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rig.s3_secret_key)
    uri = f"s3://{rig.s3_bucket}/test-hf/{uuid.uuid4().hex}/"
    yield uri
    open_store(uri, endpoint=rig.s3_endpoint).delete_prefix("")
