"""Warm starts: a rank that torchrun (re)starts is forked from a process that has already imported torch and kiln.

    torchrun ... -m kiln.cli.warm train --config spec.yaml     # instead of -m kiln.cli.main train ...

A restart of the worker group costs about what a cold start does, and most of it is starting Python and
importing torch (torch._dynamo included: DeviceMesh slicing and the optimizer's step import it) before any
training code runs (docs/resilience.md, "Where a restart's seconds go"). Here the rank torchrun starts is a
small launcher (no torch). The first one on a node starts a server that imports what `kiln train` needs
once, then waits; every launcher, the first generation's and each restarted one's, asks it to fork a
rank, hands it its stdin/stdout/stderr, environment, arguments and working directory, forwards the
signals torchrun sends, and exits with the rank's exit code. The server lives as long as the torchrun agent
that started its first launcher (one server per agent) and holds no rank state: a restarted rank is a fresh
fork of the imported modules, never a survivor of the dead generation.

The launcher falls back to a cold start in this process (exec of `python -m kiln.cli.main`) when the server
cannot be started or reached, so the worst case is today's cost. The launcher stays the process torchrun
watches: killing it (SIGKILL) kills its rank (the rank watches the launcher's socket), and a rank that dies
of a signal makes its launcher die of SIGKILL.

The server imports torch with the environment of the first launcher on its node; what torch reads from the
environment at import time (TORCH_*/TORCHINDUCTOR_* settings) is the job's, which torchrun does not change
between generations. What changes per generation (RANK, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...) is
read at run time from the rank's own environment, which is the launcher's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

from kiln.trainer.observe.startup import PROCESS_START_ENV, process_start_time  # no torch: the launcher stays small

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# What a cold rank spends its start on, imported once by the server: torch._dynamo is imported on first use by
# DeviceMesh slicing and by the optimizer's step, so a cold rank pays for it while building the model.
PRELOAD = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "kiln.cli.main",
           "kiln.cli.train_cmds", "kiln.trainer.checkpoint.checkpointer", "kiln.trainer.loop")
SERVER_START_TIMEOUT_S = 600.0  # a safety net: the server reports ready (or dies) long before on any machine


def socket_path(agent_pid: int) -> str:
    """One server per torchrun agent (the launchers' parent), in TMPDIR (the pod's writable /tmp)."""
    return os.path.join(tempfile.gettempdir(), f"kiln-warm-{os.getuid()}-{agent_pid}.sock")


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def _server(path: str, agent_pid: int) -> socket.socket | None:
    """A connection to this agent's server, starting it first if no launcher on this node has."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's launchers start at once: one of them starts the server
        conn = _connect(path)
        if conn is not None:
            return conn
        if os.path.exists(path + ".cold"):  # a server refused (why is in the file): the later ranks go cold
            with open(path + ".cold") as f:
                raise OSError(f.read().strip())
        ready_r, ready_w = os.pipe()
        with open(path + ".log", "ab") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "kiln.cli.warm", "--serve", path, str(agent_pid), str(ready_w)],
                pass_fds=(ready_w,), start_new_session=True,  # torchrun's killpg of a generation must not reach it
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        os.close(ready_w)
        # the server writes "1" once it listens, or "0" and why it will not serve, or dies (EOF)
        ready, _, _ = select.select([ready_r], [], [], SERVER_START_TIMEOUT_S)
        answer = os.read(ready_r, 4096) if ready else b""
        os.close(ready_r)
        if answer != b"1":
            server.kill()
            reason = answer[1:].decode(errors="replace") or "the warm server did not start (see " + path + ".log)"
            with open(path + ".cold", "w") as f:
                f.write(reason + "\n")
            raise OSError(reason)
        return _connect(path)


def _send(conn: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], list(fds))
    else:
        conn.sendall(data)


def _recv_line(conn: socket.socket, buf: bytearray) -> dict | None:
    while b"\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def launch(argv: list[str]) -> int:
    """The launcher: run `kiln <argv>` as a rank forked from the warm server, or cold in this process."""
    conn = None
    try:
        conn = _server(socket_path(os.getppid()), os.getppid())
    except OSError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"kiln: warm start unavailable ({err}); starting cold", file=sys.stderr, flush=True)
    if conn is None:
        os.execv(sys.executable, [sys.executable, "-m", "kiln.cli.main", *argv])
    _send(conn, {"argv": argv, "env": {**os.environ, PROCESS_START_ENV: str(process_start_time())}, "cwd": os.getcwd()},
          fds=[0, 1, 2])
    buf = bytearray()
    hello = _recv_line(conn, buf)
    if hello is None:  # the server could not fork
        os.execv(sys.executable, [sys.executable, "-m", "kiln.cli.main", *argv])
    rank_pid = hello["pid"]
    if os.environ.get("RANK", "0") == "0":
        print(f"kiln: warm start: rank 0 forked from the process holding the imports (pid {hello['server']})",
              file=sys.stderr, flush=True)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(rank_pid, signum))
    done = _recv_line(conn, buf)
    if done is None:  # the rank died without reporting: killed by a signal, as a cold rank would be
        os.kill(os.getpid(), signal.SIGKILL)
    return int(done["rc"])


def _run_rank(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the launcher's rank, run `kiln <argv>`, report the exit code, exit."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for stream in (sys.stdout, sys.stderr):  # as torchrun's `python -u` ranks: nothing held back in a buffer
        stream.reconfigure(line_buffering=True, write_through=True)
    for sig in FORWARDED + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def launcher_gone() -> None:  # torchrun killed the launcher (SIGKILL): the rank goes with it
        while conn.recv(1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=launcher_gone, daemon=True, name="kiln-warm-launcher").start()
    _send(conn, {"pid": os.getpid(), "server": os.getppid()})
    from kiln.cli import rank_cmds
    from kiln.cli.main import main

    # a finished `kiln train` ends its process itself (rank_cmds.leave): the exit code reaches the launcher first
    rank_cmds.before_leaving.append(lambda code: _send(conn, {"rc": code}))
    sys.argv = ["kiln", *request["argv"]]
    try:
        rc = main(request["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as an uncaught exception in a cold rank: the traceback, exit 1
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    _send(conn, {"rc": rc})
    os._exit(rc)


def serve(path: str, agent_pid: int, ready_fd: int) -> None:
    """Import what a rank needs, listen on `path`, fork a rank per request; exit once the agent is gone."""
    import importlib

    import torch

    for name in PRELOAD:
        importlib.import_module(name)
    with open("/proc/self/maps") as maps:  # CUDA is not fork-safe once its driver is loaded: then stay cold
        cuda = torch.cuda.is_initialized() or any("libcuda.so" in line for line in maps)
    if cuda:
        os.write(ready_fd, b"0the CUDA driver was loaded while importing torch and kiln, and CUDA cannot be forked")
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the ranks are reaped at once (their launchers hold the rc)
    tmp = f"{path}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is this user's only: a request runs kiln with its arguments
    try:
        listener.bind(tmp)
    finally:
        os.umask(old_umask)
    os.replace(tmp, path)  # a launcher connects to a listening server or to nothing
    mine = os.stat(path).st_ino
    listener.listen(64)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    try:
        try:
            agent = os.pidfd_open(agent_pid)  # readable once torchrun has ended: nothing will ask again
        except ProcessLookupError:
            return
        except OSError:  # no pidfd (an old kernel, a seccomp filter): look every second instead
            agent = None
        while True:
            readable, _, _ = select.select([listener] + ([agent] if agent is not None else []), [], [],
                                           None if agent is not None else 1.0)
            if agent in readable or (agent is None and not _alive(agent_pid)):
                return
            if listener not in readable:
                continue
            conn, _ = listener.accept()
            if not _same_user(conn):  # the socket's mode keeps others out; this checks it again
                conn.close()
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(msg.decode().partition("\n")[0])
            except (OSError, ValueError):
                conn.close()
                continue
            if os.fork() == 0:
                listener.close()
                if agent is not None:
                    os.close(agent)
                _run_rank(conn, request, fds)
            conn.close()
            for fd in fds:
                os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == mine:  # not a newer server's socket
                for leftover in (path, path + ".lock"):
                    os.unlink(leftover)
                if os.path.getsize(path + ".log") == 0:  # kept when it says why the server failed
                    os.unlink(path + ".log")


def _same_user(conn: socket.socket) -> bool:
    """The connecting process runs as this user (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(launch(sys.argv[1:]))
