"""A real MLflow tracking server for the tests (`mlflow server` from PyPI): a SQLite backend store and, as its
artifact store, a folder or an S3 prefix (`S3Artifacts`: the rig's S3), on 127.0.0.1. The server proxies
artifacts (`--artifacts-destination`): clients upload and list through its REST API and never hold the S3 keys,
which only the server's environment has (MLflow's S3 store is boto3, in the dev extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.ranks import free_port, wait_until


@dataclass(frozen=True)
class S3Artifacts:
    """An S3 prefix as the server's artifact store: s3://bucket/prefix at `endpoint`, with these keys."""
    uri: str
    endpoint: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        return {"MLFLOW_S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key}


@dataclass
class MlflowServer:
    uri: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """Terminate a server this module's callers started; kill it when it does not exit."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start(root: Path, artifacts: S3Artifacts | None = None) -> MlflowServer:
    """A server with its SQLite store under `root`; its artifacts in `artifacts` (default: root/artifacts)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", artifacts.uri if artifacts else str(root / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(artifacts.env() if artifacts else {})}
    process = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    server = MlflowServer(uri, process, log)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        return healthy(uri)

    try:
        wait_until("the MLflow server's /health", ready, timeout=300)
    except BaseException:
        server.stop()
        raise
    return server
