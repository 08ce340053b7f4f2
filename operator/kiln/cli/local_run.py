"""`kiln run`: a TrainingSpec on this machine, as torchrun with N local processes; with replica groups, one
torchrun per group beside a torchft lighthouse. The spec is fitted to the local world first."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from kiln.api import TrainingSpec, contract
from kiln.api.layout import fit_local, replica_group_spec, replica_groups, replica_groups_on
from kiln.api.load import load_one, parse
from kiln.errors import KilnError


def default_nproc(doc: TrainingSpec) -> int:
    res = doc.spec.resources
    if res.processes_per_node:
        return res.processes_per_node
    if res.gpus_per_node > 0:
        try:
            import torch

            if torch.cuda.is_available():
                return min(res.gpus_per_node, torch.cuda.device_count())
        except ImportError:
            pass
    return 1


def shorten(training: dict, steps: int) -> str | None:
    """Apply a `--steps` override to a spec's `training` mapping (camelCase keys), in place.

    A command-line override shortens the run as asked: a warm-up longer than the new run is capped at its
    length (the spec file itself must keep warmupSteps <= steps). Returns the note to print when it capped.
    """
    training["steps"] = steps
    warmup = training.get("warmupSteps", 0)
    if warmup > steps:
        training["warmupSteps"] = steps
        return (f"kiln: note: --steps {steps} is shorter than training.warmupSteps {warmup}; "
                f"warming up over all {steps} steps instead")
    return None


def local_spec(doc: TrainingSpec, *, nproc: int, steps: int | None, output: Path) -> tuple[TrainingSpec, list[str]]:
    """The spec as this machine runs it: one node of nproc processes, checkpoints under OUTPUT by default;
    `steps` overrides training.steps (see `shorten`). Also the notes to print about what changed.

    A spec written for a cluster runs as it is wherever it can: the layout is fitted to this world, keeping
    the global batch (kiln.api.layout.fit_local); a KilnError naming --nproc when it cannot run here."""
    patch, fitted = fit_local(doc.spec, nproc)
    notes = [f"kiln: note: --nproc {nproc}: {note}" for note in fitted]
    data = doc.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec = data["spec"]
    for section, values in patch.items():
        spec[section] = {k: v for k, v in {**spec.get(section, {}), **values}.items() if v is not None}
    # elastic node counts are the operator's; replica groups (elastic.faultTolerance) run here too
    ft = data["spec"].get("elastic", {}).get("faultTolerance")
    spec["elastic"] = {"faultTolerance": ft} if replica_groups_on(doc.spec) else {}
    if steps is not None:
        note = shorten(spec["training"], steps)
        notes += [note] if note else []
    if not doc.spec.checkpoint.uri:
        spec["checkpoint"]["uri"] = f"file://{(output / 'checkpoints').resolve()}"
    return parse(data, "kiln run"), notes


def check_layout(doc: TrainingSpec, world: int) -> None:
    """Fail before starting any process when the model (a model folder's config.json against the spec's
    fields), the tokenizer or the layout cannot work for `world` processes on this one machine."""
    from kiln.trainer.model import hf_folder as hf
    from kiln.trainer.parallel.parallelize import plan_layout

    dims = hf.resolve_dims(doc.spec)
    hf.training_tokenizer(doc.spec, dims)
    if replica_groups_on(doc.spec):  # each replica group is its own world of world / groups processes
        groups = replica_groups(doc.spec)
        if world % groups:
            raise KilnError(f"--nproc {world}: elastic.faultTolerance.groups = {groups} must divide it (each replica "
                            f"group runs --nproc / groups processes)")
        plan_layout(replica_group_spec(doc.spec), dims, world // groups, processes_per_node=world // groups)
        return
    plan_layout(doc.spec, dims, world, processes_per_node=world)


def cmd_run(args: argparse.Namespace) -> int:
    doc = load_one(args.spec)
    nproc = args.nproc or default_nproc(doc)
    if nproc < 1:
        raise KilnError(f"--nproc must be at least 1, not {nproc}")
    if args.steps is not None and args.steps < 1:
        raise KilnError(f"--steps must be at least 1, not {args.steps}")
    output = Path(args.output or f"runs/{doc.metadata.name}")
    run_doc, notes = local_spec(doc, nproc=nproc, steps=args.steps, output=output)
    check_layout(run_doc, nproc)
    for note in notes:
        print(note, flush=True)
    output.mkdir(parents=True, exist_ok=True)
    spec_path = output / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(run_doc.model_dump(by_alias=True, exclude_none=True, mode="json"),
                                        sort_keys=False))
    if replica_groups_on(run_doc.spec):
        return run_replica_groups(run_doc, spec_path, nproc, output, args.debug)
    cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
           "-m", "kiln.cli.main", "train", "--config", str(spec_path), "--output", str(output)]
    failure = output / "logs" / "failure.json"
    env = failure_env(failure, output, args.debug)
    # Share the cores between the ranks instead of oversubscribing them (torchrun warns otherwise).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    print(f"kiln: training {doc.metadata.name} with {nproc} process(es); output in {output}", flush=True)
    # Its own session: Ctrl-C reaches only this launcher, which then stops the run in order (below).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        print(f"kiln: interrupted; rerun the same command to resume from the last checkpoint in {output}",
              file=sys.stderr)
        return 130
    if rc != 0:
        raise failed("training failed", rc, failure, output)
    print(f"kiln: done; metrics in {output / 'metrics.jsonl'}", flush=True)
    return 0


# `kiln torchrun`: torchrun, and the failing rank's own error as the cause (kiln.cli.failure)
TORCHRUN = [sys.executable, "-m", "kiln.cli.main", "torchrun"]


def failure_env(failure: Path, output: Path, debug: bool) -> dict[str, str]:
    """The environment of a `kiln torchrun` that `kiln run` starts: it writes the cause to `failure`, and the
    ranks' tracebacks go to OUTPUT/logs (to stderr with --debug)."""
    from kiln.cli.failure import FAILURE_FILE_ENV, TRACEBACKS_ENV

    failure.parent.mkdir(parents=True, exist_ok=True)
    failure.unlink(missing_ok=True)
    own = failure.with_suffix(".torchrun.json")  # torchrun copies the failed rank's error file here
    own.unlink(missing_ok=True)
    env = {**os.environ, FAILURE_FILE_ENV: str(failure), "TORCHELASTIC_ERROR_FILE": str(own)}
    env.pop(TRACEBACKS_ENV, None)
    if not debug:
        env[TRACEBACKS_ENV] = str(output / "logs")
    return env


def failed(what: str, rc: int, failure: Path, output: Path) -> KilnError:
    """The error `kiln run` ends with: the failing rank's cause, and a rerun advised only when it can help."""
    from kiln.cli.failure import read_cause

    found = read_cause(failure)
    if found is None:  # no rank failed: torchrun itself did (its messages are above)
        return KilnError(f"{what} (torchrun exit code {rc}); see the messages above")
    return KilnError(f"{what}: " + found.advice(f"rerunning resumes from the last checkpoint in {output}/checkpoints"))


def run_replica_groups(doc: TrainingSpec, spec_path: Path, nproc: int, output: Path, debug: bool = False) -> int:
    """elastic.faultTolerance replicaGroups on this machine: torchft's lighthouse in this process and one torchrun
    per group (nproc / groups processes each, metrics in OUTPUT/group-<i>/). A group that fails is started again
    at once (up to elastic.maxRestarts): it heals from a live group, or resumes from the newest commit when none
    is live; the other groups keep training meanwhile."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and vote at info: RUST_LOG=info shows them
    from torchft._torchft import LighthouseServer

    groups = replica_groups(doc.spec)
    per_group = nproc // groups
    restarts = doc.spec.elastic.max_restarts
    # processes on one machine: a group that stops heartbeating for 1 s is gone, and nobody waits longer for it
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000, quorum_tick_ms=contract.FT_QUORUM_TICK_MS)
    # the groups reach it through a tunnel that admits only holders of this run's secret (issue 28)
    from kiln.trainer.membership.auth import Tunnel, host_port

    secret = secrets.token_bytes(32)
    tunnel = Tunnel("server", secret, ("127.0.0.1", host_port(lighthouse.address())[1]))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    def start(group: int) -> subprocess.Popen:
        cmd = [*TORCHRUN, "--standalone", f"--nproc-per-node={per_group}",
               "-m", "kiln.cli.main", "train", "--config", str(spec_path), "--output", str(output / f"group-{group}")]
        group_env = failure_env(output / "logs" / f"group-{group}-failure.json", output, debug)
        return subprocess.Popen(cmd, env={**env, **group_env, contract.FT_LIGHTHOUSE: tunnel.address(),
                                          contract.FT_SECRET: secret.hex(), contract.FT_GROUP: str(group)},
                                start_new_session=True)

    print(f"kiln: training {doc.metadata.name} as {groups} replica groups of {per_group} process(es) (torchft "
          f"lighthouse {tunnel.address()}, admitting holders of the run's secret); output in {output}", flush=True)
    procs = {group: start(group) for group in range(groups)}
    finished: set[int] = set()
    try:
        while len(finished) < groups:
            pid, status = os.wait()  # the next group to exit
            group = next((g for g, p in procs.items() if p.pid == pid), None)
            if group is None:
                continue
            rc = procs[group].returncode = os.waitstatus_to_exitcode(status)
            if rc == 0:
                finished.add(group)
                continue
            if restarts == 0:
                for p in procs.values():
                    if p.poll() is None:
                        _stop(p)
                raise failed(f"replica group {group} failed and elastic.maxRestarts is spent", rc,
                             output / "logs" / f"group-{group}-failure.json", output)
            restarts -= 1
            print(f"kiln: replica group {group} failed (torchrun exit code {rc}); restarting it, the other groups "
                  f"keep training ({restarts} restart(s) left)", flush=True)
            procs[group] = start(group)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                _stop(p)
        print(f"kiln: interrupted; rerun the same command to resume from the last checkpoint in {output}",
              file=sys.stderr)
        return 130
    finally:
        tunnel.close()
        lighthouse.shutdown()
    print(f"kiln: done; metrics in {output}/group-*/metrics.jsonl", flush=True)
    return 0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the ranks: they agree on a step, save it and exit, and torchrun then ends on its own. A second
    Ctrl-C, or no exit within a minute, kills the whole process group."""
    try:
        ranks = _children(proc.pid)
        for pid in ranks or [proc.pid]:  # no /proc (not Linux): torchrun forwards SIGTERM itself
            os.kill(pid, signal.SIGTERM)
        proc.wait(timeout=60)
        return
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    except ProcessLookupError:
        proc.wait()
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _children(pid: int) -> list[int]:
    """Direct child processes of pid (torchrun's workers), from /proc on Linux; [] elsewhere."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return []
    return found
