"""S3 without keys in the environment: the credentials the pod already has (EKS Pod Identity, ECS, IRSA, the
node's instance role), through the minio client's own providers, against the rig's real S3 server.

AWS itself cannot be reached from here, so the credentials endpoint is a fake of the EKS Pod Identity agent
(`FakePodIdentityAgent`): it speaks the agent's protocol (GET with the projected token as Authorization,
JSON AccessKeyId/SecretAccessKey/Token/Expiration) and hands out the rig's S3 keys. Everything after it —
the provider chain, signing, the S3 server — is real.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.errors import KilnError
from kiln.storage import open_store

pytestmark = pytest.mark.rig

AMBIENT_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_ROLE_ARN", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")


class FakePodIdentityAgent:
    """The EKS Pod Identity agent's credentials endpoint, on 127.0.0.1, answering only the expected token."""

    def __init__(self, access: str, secret: str, token: str):
        agent = self
        self.requests: list[str | None] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                agent.requests.append(self.headers.get("Authorization"))
                if self.headers.get("Authorization") != token:
                    self.send_response(403)
                    self.end_headers()
                    return
                expires = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
                body = json.dumps({"AccessKeyId": access, "SecretAccessKey": secret, "Token": "",
                                   "Expiration": expires}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/credentials"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_keys(monkeypatch):
    for var in AMBIENT_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_pod_identity_gives_the_store_its_keys_and_nothing_else_is_needed(rig, no_keys, tmp_path):
    token = f"projected-sa-token-{uuid.uuid4().hex}"
    (tmp_path / "token").write_text(token)
    agent = FakePodIdentityAgent(rig.s3_access_key, rig.s3_secret_key, token)
    try:
        no_keys.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", agent.url)
        no_keys.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp_path / "token"))
        uri = f"s3://{rig.s3_bucket}/ambient/{uuid.uuid4().hex}/"
        store = open_store(uri, endpoint=rig.s3_endpoint)
        store.put_bytes("hello", b"from the pod's own identity")
        assert open_store(uri, endpoint=rig.s3_endpoint).get_bytes("hello") == b"from the pod's own identity"
        assert agent.requests and all(r == token for r in agent.requests)  # the projected token was presented
        store.delete_prefix("")
    finally:
        agent.close()


def test_a_wrong_identity_and_no_identity_fail_at_open_naming_what_was_tried(rig, no_keys, tmp_path):
    (tmp_path / "token").write_text("someone-elses-token")
    agent = FakePodIdentityAgent(rig.s3_access_key, rig.s3_secret_key, "the-right-token")
    try:
        no_keys.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", agent.url)
        no_keys.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(tmp_path / "token"))
        with pytest.raises(KilnError) as err:
            open_store(f"s3://{rig.s3_bucket}/x/", endpoint=rig.s3_endpoint)
    finally:
        agent.close()
    message = str(err.value)
    assert "no S3 credentials" in message and rig.s3_endpoint in message and "credentialsSecret" in message

    # nothing at all (no keys, no token, no container endpoint; this machine has no instance metadata)
    no_keys.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    no_keys.delenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
    with pytest.raises(KilnError, match=r"no S3 credentials .*instance metadata"):
        open_store(f"s3://{rig.s3_bucket}/x/", endpoint=rig.s3_endpoint)
