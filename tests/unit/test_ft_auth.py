"""Authenticated healing, the lighthouse's side (issue 28): a process without the run's secret cannot join a
quorum, so it is never named as a peer to heal from. torchft's own lighthouse and client are the oracle: the
quorum is what torchft's LighthouseServer forms."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torchft._torchft import LighthouseClient, LighthouseServer

from kiln.trainer.membership.auth import Tunnel, host_port

SECRET = bytes(range(32))


def join(address: str, replica: str, timeout_s: float = 10.0):
    client = LighthouseClient(address, timedelta(seconds=timeout_s))
    return client.quorum(replica_id=replica, timeout=timedelta(seconds=timeout_s), address=f"{replica}:1",
                         store_address=f"{replica}:2", step=0, world_size=1, shrink_only=False)


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
