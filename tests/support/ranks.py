"""The shared harness of the distributed tests and the fault benchmarks: real ranks, real faults, and waits
that end on what the run reports, never on a clock.

- `free_port()`: a TCP port for a rendezvous (or any server a test starts).
- `run_ranks(fn, world, out, *args)`: fork (or spawn) `world` gloo ranks running `fn(rank, world, *args)`,
  join them, assert they all finished, return each rank's result (`out/result-<rank>.json`).
- `wait_until(what, cond)`, `wait_for_step(metrics, step)`: wait for an event the test observes.
- `torchrun_train_with_kills(spec, out, kill_at_steps=...)`: `kiln train` under torchrun's elastic agent,
  SIGKILLing one worker each time the run *reports* one of the given steps.

Why progress and not time: a kill "after 3 s" or a wait "for 120 steps" is outrun by a fast idle machine (the
run ends first) and misses on a slow loaded one. A kill at a reported step k < the run's last step happens on
every machine, whatever its pace, because the run cannot end without reporting step k first. Timeouts here
are only a safety net against hangs, sized for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from kiln.control.plan import TORCHRUN_ENV

POLL_S = 0.02  # how often a watcher looks: a kill comes within a step or so of the step it is due at
SAFETY_TIMEOUT_S = 600  # a hung run fails after this long; nothing waits for it to pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(what: str, cond: Callable[[], object], timeout: float = SAFETY_TIMEOUT_S,
               alive: Callable[[], bool] | None = None, context: Callable[[], str] | None = None):
    """Poll `cond` until it returns something truthy and return that. `alive`: the process(es) that must produce
    the event; if they die first, fail at once. `timeout` only guards against a hang."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if alive is not None and not alive():
            got = cond()  # the event may have come just before the exit
            if got:
                return got
            problem = "the process exited first"
        elif time.monotonic() > deadline:
            problem = f"nothing after {timeout:.0f} s (safety timeout)"
        else:
            time.sleep(POLL_S)
            continue
        raise AssertionError(f"waiting for {what}: {problem}" + (f"\n{context()}" if context else ""))


# ---------------------------------------------------------------------------------------------- ranks


def _rank_entry(rank: int, world: int, port: int, out: str, init: bool, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        text = json.dumps(fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent as text
        text = json.dumps({"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"result-{rank}.json").write_text(text)
    # Skip interpreter finalization: gloo's worker threads can still hold tensors there, and freeing them then
    # aborts the process ("terminate called without an active exception", SIGABRT; pytorch#179291), failing
    # a test whose result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_ranks(fn: Callable, world: int, out: Path, *args, start: str = "fork", init: bool = True) -> list:
    """Start `world` ranks of `fn(rank, world, *args)` (see run_ranks) and return their processes at once: for
    a test that kills them itself."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context(start)
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, str(out), init, fn, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def run_ranks(fn: Callable, world: int, out: Path, *args, start: str = "fork", init: bool = True,
              expect_signal: int | None = None, timeout: float = SAFETY_TIMEOUT_S) -> list:
    """Run `fn(rank, world, *args)` in `world` processes of one gloo group; return their results in rank order.

    Each rank gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (for code that joins the group itself: init=False)
    and writes what `fn` returns (JSON) to out/result-<rank>.json. An exception in a rank fails the call with
    its traceback as soon as that rank exits (the others, stuck in a collective, are killed).
    start: "fork" reuses this process's imported torch; "spawn" for code that must not inherit its threads.
    expect_signal: every rank must die of this signal (a fault the ranks inject themselves); returns [].
    """
    out = Path(out)
    procs = start_ranks(fn, world, out, *args, start=start, init=init)

    def result(r: int):
        path = out / f"result-{r}.json"
        return json.loads(path.read_text()) if procs[r].exitcode is not None and path.exists() else None

    def failed() -> str | None:  # every failed rank's error: the first to fail may only see its peer go
        errors = []
        for r, p in enumerate(procs):
            res = result(r)
            if isinstance(res, dict) and "error" in res:
                errors.append(f"rank {r}:\n{res['error']}")
            elif p.exitcode not in (None, 0) and expect_signal is None:
                errors.append(f"rank {r} exited with {p.exitcode}")
        return "\n".join(errors) or None

    try:
        wait_until(f"{world} ranks of {getattr(fn, '__name__', fn)}",
                   lambda: failed() or all(p.exitcode is not None for p in procs), timeout=timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    error = failed()
    assert error is None, error
    codes = [p.exitcode for p in procs]
    if expect_signal is not None:
        assert codes == [-expect_signal] * world, f"exit codes {codes}, expected all {-expect_signal}"
        return []
    assert codes == [0] * world, f"exit codes {codes}"
    return [result(r) for r in range(world)]


def fsdp_per_layer(model, world: int):
    """`model` (an nn.Sequential) under FSDP2 on this rank's CPU mesh of `world`: each layer a unit, then the
    root, as the trainer wraps blocks; the small models of the checkpoint tests and benchmarks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# ------------------------------------------------------------------------------------- training progress


def complete_lines(path: Path) -> list[str]:
    """The whole lines of a JSON-lines file; a read that races the writer drops the unfinished last line."""
    try:
        return path.read_text().split("\n")[:-1]
    except OSError:
        return []


def trainer_time(lines: list[str]) -> dict[str, float]:
    """status.trainerTime as rank 0 had it when these metrics lines were the file: the records replayed through
    kiln's own StatusReporter (a step first done is productive, a save's stall is checkpointStall). A resume
    truncates the file to its commit, so the lines then carry what that commit carried."""
    from kiln.trainer.observe.status_report import TRAINER_TIME, StatusReporter

    reporter = StatusReporter(total_steps=0)  # no sender: it only counts
    for line in filter(str.strip, lines):
        record = json.loads(line)
        reporter.update(record, None)
        if "checkpoint_stall_s" in record:
            reporter.stalled(record["checkpoint_stall_s"])
    counted = reporter.state_dict()
    return {field: counted[key] for key, field in TRAINER_TIME}


def last_step(metrics: Path) -> int:
    """The newest step in metrics.jsonl (0: none yet)."""
    lines = [line for line in complete_lines(metrics) if line.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen | None = None,
                  timeout: float = SAFETY_TIMEOUT_S) -> int:
    """Until the run reports `step` (or later) in metrics.jsonl; returns the step seen. `proc`: the run, which
    must not exit first."""
    return wait_until(f"step {step} in {metrics}", lambda: (s := last_step(metrics)) >= step and s, timeout,
                      alive=None if proc is None else (lambda: proc.poll() is None))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)


def torchrun_train_with_kills(spec: Path, out: Path, *, log: Path, kill_at_steps: list[int] = (),
                              total_steps: int = 0, nproc: int = 2, max_restarts: int = 0,
                              torchrun_env: dict[str, str] = TORCHRUN_ENV, timeout_s: float = SAFETY_TIMEOUT_S,
                              entry: str = "kiln.cli.main") -> dict:
    """`kiln train --config spec` on `nproc` gloo workers under torchrun's elastic agent (--max-restarts); each
    time the run reports one of `kill_at_steps` in metrics.jsonl, SIGKILL one worker (ranks in turn: rank 0 also
    commits and logs), as on a lost GPU. The agent restarts the worker group, which resumes from the last commit.
    `entry` is the module torchrun runs (kiln.cli.warm: ranks forked from a process holding the imports).

    Every kill step must be below `total_steps` (the run's training.steps): the run cannot end before reporting
    it, so every kill happens whatever the machine's pace. The next kill is armed only once the restarted
    workers have logged a step. Returns rc (None: timed out, a hung restart), wall_s, final_step, final_loss,
    worker_group_failures (torchrun logs one per failed group) and per kill: at_s, at_step (the step reported
    when it struck), rank, kill_to_step_s (kill → first step of the new workers), resumed_from_step (the commit
    restored), steps_redone, at_epoch and startup (the new generation's rank 0's epoch marks from its first
    record, kiln.trainer.loop), trainer_time_at_kill and trainer_time_at_step (status.trainerTime then:
    `trainer_time`); `startup` at the top level is the first generation's, t0_epoch the launch, trainer_time
    the end's.

    Recovery is the first metrics line the *new* workers wrote: a resume rewrites metrics.jsonl (truncated to
    the restored commit, then appended), so a line count can drop and rise again mid-rewrite, and the killed
    generation's rank 0 may still log a step after the kill. Hence: the workers must all be new, and the line
    must differ from the file as it was at the kill (same position, other text, or past its end). Its position
    is the restored commit.
    """
    kills_due = sorted(kill_at_steps)
    assert not kills_due or 0 < kills_due[0] and kills_due[-1] < total_steps, \
        f"kill steps {kills_due} must lie in 1..{total_steps - 1} (training.steps - 1), or a kill may never come"
    # torchrun_env: what the operator sets in trainer pods (kiln.control.plan.TORCHRUN_ENV). torchrun shares
    # one TCPStore across restarts by default, and the workers' env:// rendezvous adds no per-attempt prefix:
    # a restarted generation can read the dead one's gloo addresses (connectFullMesh "Connection refused",
    # or a wait of up to the 30 min store timeout). Opting out gives every attempt a fresh store.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **torchrun_env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", entry, "train", "--config", str(spec),
           "--output", str(out)]
    metrics = out / "metrics.jsonl"
    t0, t0_epoch = time.monotonic(), time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    log_file = log.open("w")  # torchrun's and the workers' output: why a generation failed, if one did
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    kills: list[dict] = []
    pending: dict | None = None  # the kill not yet recovered from
    peak = 0  # the most steps the current generation had logged
    seen_stat = None
    lines: list[str] = []
    timed_out = False
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now - t0 > timeout_s:
                timed_out = True  # a hung restart: the finally below kills torchrun and its workers
                break
            try:
                st = metrics.stat()
                stat = (st.st_size, st.st_mtime_ns)
            except OSError:
                stat = None
            if stat != seen_stat:  # re-read only when the file changed
                seen_stat, lines = stat, complete_lines(metrics)
            if pending is None:
                peak = max(peak, len(lines))
                step = json.loads(lines[-1])["step"] if lines else 0
                # no kill once the last step is logged: a restart then only finds the final commit
                if kills_due and step >= kills_due[0] and step < total_steps:
                    workers = _children(proc.pid)
                    if workers:
                        kills_due.pop(0)
                        victim = workers[len(kills) % len(workers)]
                        rank = _rank_of(victim)
                        os.kill(victim, signal.SIGKILL)
                        pending = {"at_s": now - t0, "at_epoch": time.time(), "at_step": step, "rank": rank,
                                   "trainer_time_at_kill": trainer_time(lines), "old": set(workers),
                                   "lines": lines}
                        kills.append(pending)
                continue
            workers = set(_children(proc.pid))
            if not workers or workers & pending["old"]:
                # the killed generation's rank 0 may still log a step in flight: that is old, not recovery
                pending["lines"], peak = lines, max(peak, len(lines))
                continue  # the agent has not restarted the workers yet
            first_new = next((i for i, line in enumerate(lines)
                              if i >= len(pending["lines"]) or line != pending["lines"][i]), None)
            if first_new is None:
                continue  # restoring, or in the middle of rewriting the file
            pending.update(kill_to_step_s=now - t0 - pending["at_s"], resumed_from_step=first_new,
                           steps_redone=peak - first_new, trainer_time_at_step=trainer_time(lines[:first_new + 1]))
            # the new generation's own marks of where its start went (kiln.trainer.loop: `startup`)
            pending["startup"] = json.loads(lines[first_new]).get("startup")
            pending, peak = None, len(lines)
    finally:
        if proc.poll() is None:  # timed out, interrupted, or the watcher failed: leave no training behind
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker generation (its own session)
            proc.wait()
    wall = time.monotonic() - t0
    log_file.close()
    records = [json.loads(line) for line in complete_lines(metrics) if line.strip()]
    for k in kills:
        del k["old"], k["lines"]
    # torchrun's agent logs each failed worker group once: more failures than kills = failures of its own
    failures = log.read_text(errors="replace").count("failed (exitcode")
    return {"rc": None if timed_out else proc.returncode, "wall_s": wall, "t0_epoch": t0_epoch,
            "startup": records[0].get("startup") if records else None,  # the first generation's start
            "final_step": records[-1]["step"] if records else 0, "kills": kills,
            "worker_group_failures": failures, "final_loss": records[-1]["loss"] if records else None,
            "trainer_time": trainer_time(complete_lines(metrics))}
