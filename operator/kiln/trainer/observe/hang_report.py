"""Where a run hung: every rank's Python stacks in the run's store, and the rank the others wait for named.

Each rank's hang watch (kiln.trainer.membership.hang_watch: the operator's rule, no verdict before 5 step times,
then no progress for max(10 × p99 step time, floor)) calls `report` on its verdict, from its own thread while the
main thread is stuck. `report` writes this rank's stacks — every thread's, through `faulthandler`, which needs no
help from the stuck thread — to `incidents/hang/<attempt>/rank-<N>.txt` in the checkpoint store, where
`<attempt>` is the same for every rank of one torchrun attempt (TORCHELASTIC_RUN_ID and _RESTART_COUNT).

Rank 0 then waits (at most `GATHER_S`) for the other ranks' files and names the suspects: the ranks whose main
thread is not inside a torch.distributed call while others are. A collective hangs when one rank never reaches
it, so the ranks waiting in one are the victims and the ones elsewhere (a data read, a deadlock, a wedged kernel
launch) are whom they wait for. Rank 0 prints one line and writes `status.hang` (the trainer's field: when, the
step, the stacks' URI, the suspects).

Before its stacks, each rank also writes PyTorch's flight recorder (the last collectives c10d saw this process
enter, with their sequence numbers and state) to `flight-recorder/rank-<N>` beside them: NCCL's on GPUs (its
buffer is sized by TORCH_NCCL_TRACE_BUFFER_SIZE, which the operator sets in GPU pods), gloo's on CPU. The files
are torch's own pickle format, for `python -m torch.distributed.flight_recorder.fr_trace <folder> --prefix
rank-` (kiln never loads them). The NCCL dump runs only on GPUs, which this project's CI has not.

A replica group's rank that its own hang watch takes out (kiln.trainer.membership.hang_watch) writes the same
two files first (`write_own`, bounded in time: the group leaves the quorum right after), with no gathering:
the other groups step on and the operator restarts nothing.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

HANG_FLOOR_ENV = "KILN_HANG_FLOOR_SECONDS"  # the rule's floor for a run's watch; default the rule's own (60 s)
INCIDENTS = "incidents/hang/"
GATHER_S = 60.0  # rank 0 waits this long for the other ranks' stacks before it names suspects from what came
POLL_S = 1.0
MAIN_MARK = "kiln-main-thread: "
FLIGHT_RECORDER = "flight-recorder/"  # rank-<N>: the rank's flight recorder dump (fr_trace's --prefix rank-)
_IN_COLLECTIVE = re.compile(r"torch/distributed/")  # c10d, FSDP's and DTensor's collectives, pipelining's p2p


def floor_s() -> float:
    """Seconds without progress before a run's hang is reported at the least (the rule's floor)."""
    from kiln.trainer.membership.hang_watch import floor_s as rule_floor

    return rule_floor(HANG_FLOOR_ENV, "a hang is reported")


def attempt() -> str:
    """The same name on every rank of one torchrun attempt (its run id and restart count)."""
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", os.environ.get("TORCHELASTIC_RUN_ID", "local"))[:64]
    return f"{run_id}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it, after a line naming the main thread."""
    with tempfile.TemporaryFile(mode="w+") as f:
        f.write(f"{MAIN_MARK}0x{threading.main_thread().ident:016x}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def flight_record(device_type: str) -> bytes | None:
    """This process's flight recorder dump (torch's pickle): NCCL's on CUDA, gloo's otherwise; None when this
    torch has none to give."""
    import torch._C._distributed_c10d as c10d

    try:
        data = c10d._dump_nccl_trace() if device_type == "cuda" else c10d._dump_fr_trace(backend="gloo")
    except (AttributeError, RuntimeError, TypeError):
        return None
    return bytes(data) or None


def main_stack(text: str) -> str:
    """The main thread's part of a `stacks()` dump."""
    mark = next((line for line in text.splitlines() if line.startswith(MAIN_MARK)), None)
    if mark is None:
        return ""
    ident = mark[len(MAIN_MARK):].strip()
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    return next((b for b in blocks if re.match(rf"(?:Current thread|Thread) {ident}\b", b)), "")


def suspects(dumps: dict[int, str]) -> list[int]:
    """The ranks the others wait for: not inside a torch.distributed call while some rank is. None found when
    every rank waits in one (the culprit is outside the job, e.g. a dead peer or the network) or none does."""
    waiting = {rank for rank, text in dumps.items() if _IN_COLLECTIVE.search(main_stack(text))}
    if not waiting or len(waiting) == len(dumps):
        return []
    return sorted(set(dumps) - waiting)


def write_own(store, *, rank: int, step: int, why: str, device_type: str = "cpu", group: int | None = None) -> str:
    """This rank's flight recorder and stacks, in that order (when rank 0 sees a rank's stacks, its record is
    there too); returns the folder. A replica group's ranks write under `<attempt>-group-<g>/` (each group is its
    own torchrun job, with ranks from 0)."""
    folder = f"{INCIDENTS}{attempt()}{'' if group is None else f'-group-{group}'}/"
    record = flight_record(device_type)
    if record is not None:
        store.put_bytes(f"{folder}{FLIGHT_RECORDER}rank-{rank}", record)
    store.put_bytes(f"{folder}rank-{rank}.txt", f"step {step}: {why}\n{stacks()}".encode())
    return folder


def report(store, *, rank: int, world: int, step: int, why: str, status=None, device_type: str = "cpu",
           gather_s: float = GATHER_S, clock=time.monotonic, sleep=time.sleep) -> dict | None:
    """Write this rank's flight recorder and stacks; on rank 0 gather the others' stacks, name the suspects, say
    it and write status.hang. Returns rank 0's report (None on the other ranks)."""
    folder = write_own(store, rank=rank, step=step, why=why, device_type=device_type)
    if rank != 0:
        return None
    deadline = clock() + gather_s
    names = {f"{folder}rank-{r}.txt" for r in range(world)}
    while True:
        present = {o.key for o in store.list(folder)} & names
        if len(present) == len(names) or clock() >= deadline:
            break
        sleep(POLL_S)
    dumps = {int(Path(key).stem.split("-")[1]): store.get_bytes(key).decode(errors="replace") for key in present}
    found = suspects(dumps)
    hang = {"detectedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": step,
            "stacksUri": store.url(folder), "ranksReported": len(dumps), "waitingFor": found}
    missing = sorted(set(range(world)) - set(dumps))
    who = (f"rank(s) {found} are not in a collective while the others wait in one" if found
           else "no rank stands out (all wait in a collective, or none does)")
    print(f"kiln: hang: {why.partition('; ')[0]}; the stacks of {len(dumps)}/{world} ranks are in "
          f"{hang['stacksUri']}; {who}" + (f"; no stacks from rank(s) {missing}" if missing else ""),
          file=sys.stderr, flush=True)
    if status is not None:
        status.hang(hang)
    return hang
