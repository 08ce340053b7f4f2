"""`kiln train` (one rank, under torchrun), `kiln run` (the local launcher: torchrun on this machine),
`kiln eval` (the held-out loss of a run's newest committed checkpoint, in this process) and `kiln export`
(that checkpoint as a Hugging Face model folder, docs/models.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from kiln.api import TrainingSpec, contract
from kiln.api.layout import fit_local, replica_group_spec, replica_groups, replica_groups_on
from kiln.api.load import load_file, parse
from kiln.errors import KilnError


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run", help="train a TrainingSpec on this machine (torchrun with N local processes)",
        description="Train SPEC on this machine: N local processes under torchrun (CPU or GPU). Checkpoints go to "
        "file://OUTPUT/checkpoints unless the spec names a store; rerunning the same command resumes.",
    )
    run.add_argument("spec", help="TrainingSpec YAML file")
    run.add_argument("--nproc", type=int, default=None, help="local processes (default: resources.processesPerNode, "
                     "else the GPU count when gpusPerNode > 0, else 1)")
    run.add_argument("--steps", type=int, default=None, help="override training.steps")
    run.add_argument("--output", default=None, help="run folder: metrics.jsonl, tensorboard/, checkpoints/ "
                     "(default: runs/<metadata.name>)")
    debug_option(run)
    run.set_defaults(func=cmd_run)

    # Every argument belongs to torchrun ("+" is this parser's option prefix, so "--nproc-per-node" passes).
    launcher = subparsers.add_parser(
        "torchrun", prefix_chars="+", add_help=False,
        help="torchrun, exiting 128+N when stopped by signal N (what trainer pods run)",
        description="Run torchrun with these arguments. When the pod is stopped (deleted, evicted, preempted, "
        "its node drained) the ranks save and torchrun ends on the signal; this exits 128+signal instead of "
        "torchrun's 1, so the training-operator's ExitCode restart policy restarts the pod instead of failing "
        "the job.",
    )
    launcher.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    launcher.set_defaults(func=cmd_torchrun)

    train = subparsers.add_parser(
        "train", help="run one training rank (started by torchrun; reads RANK/WORLD_SIZE and the PET_* env)",
    )
    train.add_argument("--config", required=True, help="TrainingSpec YAML file (resolved spec)")
    train.add_argument("--output", default=None, help="run folder for metrics (default: runs/<metadata.name>)")
    train.add_argument("--steps", type=int, default=None, help="override training.steps")
    train.set_defaults(func=cmd_train)

    ev = subparsers.add_parser(
        "eval", help="held-out loss and perplexity of a run's newest committed checkpoint (one process, CPU or GPU)",
        description="Load the newest committed checkpoint of SPEC's run (saved by any number of processes) into "
        "this one process and score it on the validation split of the spec's data: the same batches as the "
        "val_loss the trainer logs at the end of a run. Prints the result; --json writes it.",
    )
    ev.add_argument("spec", help="TrainingSpec YAML file")
    where = ev.add_mutually_exclusive_group()
    where.add_argument("--output", default=None, help="the `kiln run` folder whose checkpoints/ to read (default: "
                       "runs/<metadata.name>; used only when the spec has no checkpoint.uri)")
    where.add_argument("--checkpoint", default=None, help="checkpoint URI (file:///path/ or s3://bucket/prefix/; "
                       "default: the spec's checkpoint.uri)")
    ev.add_argument("--batches", type=int, default=None, help="global batches of held-out data to score "
                    "(default: as many as the trainer's val_loss)")
    ev.add_argument("--data", default=None, help="held-out token shards (file:///path/ or s3://...), needed when "
                    "data.uri has no validation split of its own")
    ev.add_argument("--endpoint", default=None, help="S3 endpoint URL for the checkpoint and data (default: the "
                    "spec's checkpoint.endpoint); keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    ev.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda when available)")
    ev.add_argument("--json", default=None, metavar="FILE",
                    help='also write {"step", "loss", "perplexity", "tokens", "checkpoint"} to FILE')
    ev.add_argument("--max-loss", type=float, default=None, metavar="X",
                    help="a gate for CI: exit 1 (after printing and writing --json) when the loss is above X")
    debug_option(ev)
    ev.set_defaults(func=cmd_eval)

    ex = subparsers.add_parser(
        "export", help="write a run's newest committed checkpoint as a Hugging Face model folder",
        description="Load the newest committed checkpoint of SPEC's run (saved by any number of processes) into "
        "this one process and write it to OUTPUT as a Hugging Face folder: sharded safetensors with their index, "
        "config.json, generation_config.json and the tokenizer files, which transformers loads as the "
        "model.from folder's family (LlamaForCausalLM for a preset). A LoRA run (spec.model.adapter): --format "
        "peft writes its adapters as a peft adapter folder, --format hf --merge the base with them merged in.",
    )
    ex.add_argument("spec", help="TrainingSpec YAML file")
    ex.add_argument("--format", choices=["hf", "peft"], default="hf",
                    help="output format: hf (a Hugging Face model folder), peft (a LoRA run's adapter folder: "
                    "adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained)")
    ex.add_argument("--merge", action="store_true",
                    help="with --format hf, for a LoRA run: the base with the adapters merged into it")
    ex.add_argument("--output", required=True, help="folder to write: file:///path/ or s3://bucket/prefix/")
    where = ex.add_mutually_exclusive_group()
    where.add_argument("--run-output", default=None, help="the `kiln run` folder whose checkpoints/ to read "
                       "(default: runs/<metadata.name>; used only when the spec has no checkpoint.uri)")
    where.add_argument("--checkpoint", default=None, help="checkpoint URI (default: the spec's checkpoint.uri)")
    ex.add_argument("--endpoint", default=None, help="S3 endpoint URL for the checkpoint, model folder and output "
                    "(default: the spec's checkpoint.endpoint); keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    ex.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="dtype of the written weights (default: model.from's, else float32)")
    ex.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 500MB, 5GB (default 2GB)")
    debug_option(ex)
    ex.set_defaults(func=cmd_export)

    data = subparsers.add_parser("data", help="prepare training data (kiln data prepare)")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    pr = data_sub.add_parser(
        "prepare", help="tokenize .txt/.jsonl/.parquet files into token shards that data.uri reads",
        description="Read .txt (one document per file), .jsonl (one per line) and .parquet (one per row) files "
        "from files, folders, "
        "file:// or s3:// prefixes; normalise, filter, deduplicate exactly and tokenize them into "
        "tokens-NNNNN.npy shards and a manifest.json at OUTPUT (docs/models.md).",
    )
    pr.add_argument("--input", nargs="+", required=True, help="files, folders, file:// or s3:// prefixes")
    pr.add_argument("--tokenizer", required=True, help="a tokenizer.json or a model folder holding one")
    pr.add_argument("--output", required=True, help="folder for the shards: file:///path/ or s3://bucket/prefix/")
    pr.add_argument("--format", choices=["text", "chat"], default="text",
                    help="text: documents (default); chat: conversations ({\"messages\": [{\"role\", \"content\"}, ...]}) "
                    "rendered with the tokenizer's chat template, written with the assistant mask that data.format "
                    "chat trains on")
    pr.add_argument("--text-field", default=None,
                    help="the field of a .jsonl line (or .parquet column) holding the text (default text) or, with "
                    "--format chat, the messages (default messages)")
    pr.add_argument("--min-chars", type=int, default=1, help="drop documents shorter than this after normalising")
    pr.add_argument("--dedup", choices=["exact", "minhash", "none"], default="exact",
                    help="drop repeated documents: exact (default), minhash (exact and near-duplicates) or none")
    pr.add_argument("--minhash-threshold", type=float, default=0.8,
                    help="with --dedup minhash: estimated Jaccard similarity of word 5-grams that makes a "
                    "near-duplicate (default 0.8)")
    pr.add_argument("--eos", default=None, help="a token appended to every document, e.g. '<|end_of_text|>'")
    pr.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    pr.add_argument("--max-doc-bytes", type=int, default=None,
                    help="a .txt file or .jsonl line longer than this is skipped unread and counted as too_large "
                    "(default 32 MiB): what bounds a record's memory")
    pr.add_argument("--endpoint", default=None, help="S3 endpoint URL; keys from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    pr.set_defaults(func=cmd_data_prepare)


def debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected failure (by "
                        "default it goes to a file the error names)")


def load_one(path: str) -> TrainingSpec:
    docs = load_file(path)
    if len(docs) != 1:
        raise KilnError(f"{path}: holds {len(docs)} TrainingSpecs; give a file with exactly one")
    return docs[0]


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


def cmd_torchrun(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from kiln.cli.failure import cause, write_cause

    try:
        torchrun_main(args.torchrun_args)
    except ChildFailedError as err:  # the failed ranks' error files: the cause is the last line, not a traceback
        found = cause(err.failures)
        if write_cause(found):
            return 1
        raise KilnError(found.line) from None
    except SignalException as err:
        # torchrun forwarded the signal to the ranks, which saved; it then raises, and Python exits 1, which
        # PyTorchJob's ExitCode policy counts as a permanent failure: one deleted pod failed the whole run.
        signum = int(err.sigval)
        print(f"kiln: torchrun stopped by signal {signum}; exiting {128 + signum} (retryable)", file=sys.stderr,
              flush=True)
        return 128 + signum
    return 0


def cmd_train(args: argparse.Namespace, hooks=None) -> int:
    """One rank of `kiln train`; `hooks` (kiln.trainer.hooks.StepHooks, None: the guards) for callers in Python."""
    from kiln.trainer.checkpoint.checkpointer import sigterm_received
    from kiln.trainer.loop import train

    doc = load_one(args.config)
    if args.steps is not None:
        if args.steps < 1:
            raise KilnError(f"--steps must be at least 1, not {args.steps}")
        data = doc.model_dump(by_alias=True, exclude_none=True, mode="json")
        note = shorten(data["spec"]["training"], args.steps)
        doc = parse(data, args.config)
        if note and os.environ.get("RANK", "0") == "0":
            print(note, flush=True)
    output = Path(args.output or f"runs/{doc.metadata.name}")
    from kiln.cli.failure import record_rank_failure, tracebacks_to_file

    tracebacks_to_file(os.environ.get("RANK", "0"))
    try:
        result = train(doc, output_dir=output, hooks=hooks)
    except KeyboardInterrupt:
        return 130  # the launcher reports the interruption once
    except Exception as err:  # noqa: BLE001 - recorded for torchrun, which tells the launcher which rank failed why
        raise record_rank_failure(err, os.environ.get("RANK", "0")) from None
    return stop_exit_code(result.final_step, doc.spec.training.steps, signalled=sigterm_received())


def stop_exit_code(final_step: int, steps: int, *, signalled: bool) -> int:
    """A rank's exit code. 0: the run finished, or this process was stopped (SIGTERM) and saved: its
    launcher, stopped too, reports that. A rank that saved and stopped early because *another* rank was
    stopped (a peer pod deleted) exits 143 instead: 0 would tell torchrun, and so the PyTorchJob, that the run
    is done (an elastic job succeeds when one worker does), while it must restart its group and go on."""
    if final_step >= steps or signalled:
        return 0
    return 128 + signal.SIGTERM


def eval_checkpoint_uri(doc: TrainingSpec, *, output: str | None, checkpoint: str | None) -> str:
    """Where `kiln eval` reads: --checkpoint, else where `kiln run` saved: the spec's checkpoint.uri, else
    file://OUTPUT/checkpoints."""
    if checkpoint:
        return checkpoint
    if doc.spec.checkpoint.uri:
        return doc.spec.checkpoint.uri
    folder = Path(output or f"runs/{doc.metadata.name}")
    return f"file://{(folder / 'checkpoints').resolve()}"


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from kiln.trainer.evaluate import evaluate

    doc = load_one(args.spec)
    uri = eval_checkpoint_uri(doc, output=args.output, checkpoint=args.checkpoint)
    try:
        device = torch.device(args.device) if args.device else None
    except RuntimeError as err:
        raise KilnError(f"--device {args.device}: {err}; use cpu, cuda or cuda:N") from None
    result = evaluate(doc, checkpoint_uri=uri, batches=args.batches, device=device, data_uri=args.data,
                      endpoint=args.endpoint)
    print(f"kiln: step {result.step} of {uri}: held-out loss {result.loss:.4f}, perplexity "
          f"{result.perplexity:.2f} over {result.tokens:,} tokens", flush=True)
    if args.json:
        path = Path(args.json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
        except OSError as err:
            raise KilnError(f"--json {path}: cannot write ({err.strerror})") from None
    if args.max_loss is not None and not result.loss <= args.max_loss:
        raise KilnError(f"held-out loss {result.loss:.4f} of step {result.step} is above --max-loss {args.max_loss}")
    return 0


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1048576' -> bytes (decimal units, as transformers' max_shard_size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise KilnError(f"--max-shard-size {text!r}: use a size like 500MB or 2GB")


def cmd_export(args: argparse.Namespace) -> int:
    from kiln.trainer.model.hf_folder import export_hf

    doc = load_one(args.spec)
    max_bytes = parse_size(args.max_shard_size)
    if max_bytes < 1:
        raise KilnError(f"--max-shard-size must be positive, not {args.max_shard_size}")
    if not args.output.startswith(("file://", "s3://")):
        raise KilnError(f"--output {args.output}: use file:///path/ or s3://bucket/prefix/")
    uri = eval_checkpoint_uri(doc, output=args.run_output, checkpoint=args.checkpoint)
    if args.format == "peft":
        from kiln.trainer.model.peft_folder import export_peft

        if args.merge or args.dtype:
            raise KilnError("--merge and --dtype go with --format hf; --format peft writes the fp32 adapters")
        result = export_peft(doc, checkpoint_uri=uri, output_uri=args.output, endpoint=args.endpoint)
    else:
        result = export_hf(doc, checkpoint_uri=uri, output_uri=args.output, endpoint=args.endpoint,
                           dtype=args.dtype, max_shard_bytes=max_bytes, merge=args.merge)
    print(f"kiln: exported step {result.step} of {uri} to {result.output}: {len(result.files)} files, "
          f"{result.bytes / 1e6:,.1f} MB", flush=True)
    return 0


@contextlib.contextmanager
def prepare_progress(console):
    """A progress bar of `kiln data prepare` on `console` (input files done of all, documents kept, shards
    written, drawn after every tokenized batch); yields the callback prepare() takes. Off when the console
    is not a terminal: rich draws nothing there, and being transient it leaves nothing behind on one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("kiln data prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                  TextColumn("{task.fields[docs]:,} documents kept, {task.fields[shards]:,} shards"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("prepare", total=None, docs=0, shards=0)
        # drawn at each call, not only at rich's next tick: a batch is far apart from the next on a big input
        yield lambda done, total, docs, shards: bar.update(task, completed=done, total=total, docs=docs,
                                                           shards=shards, refresh=True)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from kiln.trainer.data.prepare import prepare

    if args.shard_tokens < 1 or args.min_chars < 0 or (args.max_doc_bytes is not None and args.max_doc_bytes < 1):
        raise KilnError("--shard-tokens and --max-doc-bytes must be at least 1 and --min-chars at least 0")
    if not args.output.startswith(("file://", "s3://")):
        raise KilnError(f"--output {args.output}: use file:///path/ or s3://bucket/prefix/")
    from rich.console import Console

    with prepare_progress(Console(stderr=True)) as progress:
        result = prepare(args.input, tokenizer_uri=args.tokenizer, output=args.output, text_field=args.text_field,
                         min_chars=args.min_chars, dedup=args.dedup, minhash_threshold=args.minhash_threshold,
                         eos=args.eos, shard_tokens=args.shard_tokens, endpoint=args.endpoint, format=args.format,
                         progress=progress,
                         **({} if args.max_doc_bytes is None else {"max_doc_bytes": args.max_doc_bytes}))
    if result is not None:
        removed = ", ".join(f"{k} {v}" for k, v in sorted(result.removed.items())) or "nothing"
        print(f"kiln: {result.documents_out:,} of {result.documents_in:,} documents, {result.tokens:,} tokens in "
              f"{len(result.shards)} shard(s) at {args.output}; removed: {removed}", flush=True)
    return 0
