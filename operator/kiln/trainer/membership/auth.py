"""Who may talk to a run's lighthouse (issue 28, authenticated healing): a byte tunnel that opens only after both
ends proved they hold the run's secret. torchft's lighthouse has no authentication of its own, and the quorum it
forms decides whom a joining group heals from; a process that cannot reach it cannot join a quorum, so it is
never named as a peer to heal from.

    manager ──► client tunnel (127.0.0.1, in the group) ══ proof of the secret ══► server tunnel ──► lighthouse
                                                                                    (the public port)   (127.0.0.1)

The handshake is HMAC-SHA256 challenge-response in both directions over fresh 32-byte nonces (the secret never
crosses the wire, a recorded handshake replays nothing); after it the bytes (torchft's gRPC) pass unchanged.
A peer that sends a wrong proof, or none within HANDSHAKE_S, is disconnected before any byte reaches the
lighthouse. It authenticates, it does not encrypt: the NetworkPolicy and the cluster network keep the bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("kiln.ft")

NONCE = 32
HANDSHAKE_S = 10.0
CHUNK = 1 << 16


Secret = Callable[[], bytes]  # the run's secret, asked for at each handshake (a mounted Secret's file may change)


def proof(secret: bytes, who: bytes, mine: bytes, theirs: bytes) -> bytes:
    return hmac.new(secret, b"kiln-ft " + who + mine + theirs, hashlib.sha256).digest()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _splice(a: tuple, b: tuple) -> None:
    await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))


class Tunnel:
    """One end of the tunnel, serving on 127.0.0.1 or `host`:`port` (0: any free port) in a thread of its own.

    role "server": accepts peers that prove the secret, then connects each to `upstream` (the lighthouse).
    role "client": accepts local connections (the manager's), proves the secret to `upstream` (the server end)
    and checks its proof back, then passes the bytes."""

    def __init__(self, role: str, secret: bytes | Secret, upstream: tuple[str, int], host: str | None = "127.0.0.1",
                 port: int = 0):
        """host None: every interface (IPv4 and IPv6)."""
        self._secret = secret if callable(secret) else (lambda: secret)
        if role not in ("server", "client"):
            raise ValueError("role is server or client")
        self.secret()  # a missing or short secret fails here, not at the first peer
        self.role, self.upstream = role, upstream
        self.refused = 0  # peers disconnected for a wrong or missing proof
        self.probes = 0  # connections closed before sending a byte (a TCP readiness probe): not counted as refused
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._server: asyncio.base_events.Server | None = None

        async def serve() -> None:
            self._server = await asyncio.start_server(self._accept, host, port)
            started.set()

        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kiln-ft-tunnel-{role}", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(timeout=30)
        started.wait()
        self.port = self._server.sockets[0].getsockname()[1]
        self.host = host

    def secret(self) -> bytes:
        value = self._secret()
        if len(value) < 16:
            raise ValueError("the run's secret has at least 16 bytes")
        return value

    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.role == "server":
                await asyncio.wait_for(self._prove_server(reader, writer), HANDSHAKE_S)
                up = await asyncio.open_connection(*self.upstream)
            else:
                up = await asyncio.open_connection(*self.upstream)
                await asyncio.wait_for(self._prove_client(*up), HANDSHAKE_S)
        except (PermissionError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError,
                ValueError) as err:
            probe = isinstance(err, asyncio.IncompleteReadError) and not err.partial
            self.probes += probe
            if isinstance(err, (PermissionError, asyncio.TimeoutError, asyncio.IncompleteReadError)) and not probe:
                self.refused += 1
                log.warning("replica groups: %s tunnel refused a peer (%s)", self.role, type(err).__name__)
            elif isinstance(err, ValueError):  # this end's own secret file: unreadable
                log.warning("replica groups: %s tunnel: %s", self.role, err)
            writer.close()
            return
        await _splice((reader, writer), up)

    async def _prove_server(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine = secrets.token_bytes(NONCE)
        try:
            writer.write(mine)
            await writer.drain()
            theirs = await reader.readexactly(NONCE)
        except ConnectionError:  # reset before sending a byte (a probe that closed while our nonce was in flight)
            raise asyncio.IncompleteReadError(b"", NONCE) from None
        if not hmac.compare_digest(await reader.readexactly(32), proof(self.secret(), b"client", theirs, mine)):
            raise PermissionError("wrong proof")
        writer.write(proof(self.secret(), b"server", mine, theirs))
        await writer.drain()

    async def _prove_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        theirs = await reader.readexactly(NONCE)
        mine = secrets.token_bytes(NONCE)
        writer.write(mine + proof(self.secret(), b"client", mine, theirs))
        await writer.drain()
        if not hmac.compare_digest(await reader.readexactly(32), proof(self.secret(), b"server", theirs, mine)):
            raise PermissionError("the lighthouse's end does not hold the run's secret")

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            open_ = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]  # connections spliced
            for task in open_:
                task.cancel()
            await asyncio.gather(*open_, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def host_port(address: str) -> tuple[str, int]:
    """('host', port) of torchft's 'http://host:port' (or host:port; [v6] brackets dropped)."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def secret_from_env(value_env: str, file_env: str) -> Secret | None:
    """The run's secret: hex in the variable `value_env` (`kiln run`), or hex in the file that `file_env` names
    (the operator's pods: its Secret, mounted), read at each call. None: neither is set."""
    if value := os.environ.get(value_env):
        secret = bytes.fromhex(value)
        return lambda: secret
    if path := os.environ.get(file_env):
        return secret_file(path, file_env)
    return None


def secret_file(path: str, what: str = "--secret_file") -> Secret:
    """The run's secret in a file (hex), read at each call: a mounted Secret's file follows the Secret."""
    def read() -> bytes:
        try:
            return bytes.fromhex(Path(path).read_text()[:1024].strip())
        except (OSError, ValueError) as err:
            raise ValueError(f"{what}={path}: the run's secret is not readable as hex ({err})") from None
    return read
