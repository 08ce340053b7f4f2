"""Authenticated healing, the lighthouse's side (issue 28): a process without the run's secret cannot join a
quorum, so it is never named as a peer to heal from. torchft's own lighthouse and client are the oracle: the
quorum is what torchft's LighthouseServer forms."""

from __future__ import annotations

import socket
import subprocess
import threading
from datetime import timedelta

import pytest
from torchft._torchft import LighthouseClient, LighthouseServer

from kiln.api import contract
from kiln.control import ft_secret
from kiln.trainer.membership.auth import Tunnel, host_port, secret_from_env

from tests.support.groups import LIGHTHOUSE, listening, of, rendered
from tests.support.ranks import free_port, wait_until

SECRET = bytes(range(32))


HEARTBEAT_S = 0.1  # torchft's Manager heartbeats to the lighthouse every 100 ms while it lives


def join(address: str, replica: str, timeout_s: float = 10.0):
    """A group's quorum request, heartbeating until it returns, as a group's torchft ManagerServer does. The
    lighthouse's split-brain rule forms a quorum only from more than half of the heartbeating groups, and a quorum
    request is a single heartbeat: a group that stopped (an earlier join here) counts until its heartbeat times
    out, and a joiner that never heartbeats again times out with it, so its quorum would never form. Once the
    call returns the group goes silent, like a group that left: its heartbeat times out at the lighthouse."""
    stop = threading.Event()

    def heartbeat() -> None:
        client = None
        while not stop.is_set():
            try:  # through the same tunnel: refused like the quorum request while the secret does not match
                client = client or LighthouseClient(address, timedelta(seconds=1))
                client.heartbeat(replica, timedelta(seconds=1))
            except Exception:
                client = None
            stop.wait(HEARTBEAT_S)

    beating = threading.Thread(target=heartbeat, name=f"heartbeat-{replica}", daemon=True)
    beating.start()
    try:
        client = LighthouseClient(address, timedelta(seconds=timeout_s))
        return client.quorum(replica_id=replica, timeout=timedelta(seconds=timeout_s), address=f"{replica}:1",
                             store_address=f"{replica}:2", step=0, world_size=1, shrink_only=False)
    finally:
        stop.set()
        beating.join()


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20,
                              heartbeat_timeout_ms=1000)
    yield server
    server.shutdown()


def test_only_a_holder_of_the_secret_joins_the_quorum(lighthouse):
    public = Tunnel("server", SECRET, host_port(lighthouse.address()))  # what the lighthouse's Service exposes
    member = Tunnel("client", SECRET, ("127.0.0.1", public.port))
    wrong = Tunnel("client", b"another run's secret!", ("127.0.0.1", public.port))
    try:
        # the kubelet's readiness probe (connect, close): neither refused nor logged as an intruder
        socket.create_connection(("127.0.0.1", public.port), timeout=10).close()
        wait_until("the probe's connection handled", lambda: public.probes == 1)
        assert public.refused == 0
        quorum = join(member.address(), "kiln_group_0")
        assert [p.replica_id for p in quorum.participants] == ["kiln_group_0"]
        for intruder, address in (("no_secret", public.address()), ("wrong_secret", wrong.address())):
            with pytest.raises(Exception):  # torchft's client: the connection closes before any gRPC reply
                join(address, intruder, timeout_s=3)
        assert public.refused >= 2  # each intruder (torchft's client retries) was cut off at the public end
        # the quorums the lighthouse forms afterwards never name them: they never reached it
        assert [p.replica_id for p in join(member.address(), "kiln_group_0").participants] == ["kiln_group_0"]
    finally:
        for t in (public, member, wrong):
            t.close()


def test_the_operators_lighthouse_admits_only_holders_of_the_mounted_secret(tmp_path, monkeypatch):
    """The operator's path: the lighthouse Deployment's own command (`kiln-lighthouse ... --secret_file`), a
    group reaching it as the trainer does (KILN_FT_SECRET_FILE: the Secret mounted into its pod). Each end reads
    its file at every handshake, so a re-created Secret locks out holders of the old value from every connection
    opened after the files change (the kubelet updates a mounted Secret's files); one already open stays."""
    [deployment] = of(rendered(), "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    lighthouse_file, group_file, port = tmp_path / "lighthouse", tmp_path / "group", free_port()
    for f in (lighthouse_file, group_file):
        f.write_text(SECRET.hex() + "\n")
    here = {ft_secret.FILE: str(lighthouse_file), command[command.index("--bind") + 1]: f"[::]:{port}"}
    proc = subprocess.Popen([LIGHTHOUSE, *(here.get(arg, arg) for arg in command[1:])], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tunnels = []
    try:
        wait_until("the lighthouse's tunnel listens", lambda: listening(port), alive=lambda: proc.poll() is None,
                   context=lambda: proc.stdout.read() if proc.poll() is not None else "")
        monkeypatch.delenv(contract.FT_SECRET, raising=False)
        monkeypatch.setenv(contract.FT_SECRET_FILE, str(group_file))
        member = Tunnel("client", secret_from_env(contract.FT_SECRET, contract.FT_SECRET_FILE), ("127.0.0.1", port))
        wrong = Tunnel("client", b"another run's secret!", ("127.0.0.1", port))
        tunnels += [member, wrong]
        assert [p.replica_id for p in join(member.address(), "kiln_group_0").participants] == ["kiln_group_0"]
        for intruder, address in (("no_secret", f"http://127.0.0.1:{port}"), ("wrong_secret", wrong.address())):
            with pytest.raises(Exception):
                join(address, intruder, timeout_s=3)
        renewed = bytes(range(100, 132)).hex()
        lighthouse_file.write_text(renewed)  # the Secret re-created: the lighthouse's file has the new value
        with pytest.raises(Exception):
            join(member.address(), "kiln_group_1", timeout_s=3)
        group_file.write_text(renewed)  # ... and then the group's
        assert "kiln_group_1" in [p.replica_id for p in join(member.address(), "kiln_group_1").participants]
    finally:
        for t in tunnels:
            t.close()
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out  # SIGTERM: the tunnel and the lighthouse stop cleanly
