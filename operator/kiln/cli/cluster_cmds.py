"""`kiln submit`, `kiln status`, `kiln wait`, `kiln logs`, `kiln operator`: working with a cluster."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime, timezone

from kiln.errors import KilnError
from kiln.text import duration

WAIT_SUCCEEDED, WAIT_FAILED, WAIT_TIMEOUT = 0, 1, 2
TERMINAL = {"Succeeded", "Failed"}
OUTPUTS = ["table", "wide", "json", "yaml"]
PHASE_COLOUR = {"Running": "green", "Succeeded": "green", "Failed": "red", "Restarting": "yellow",
                "Suspended": "blue", "Scaling": "cyan"}


def register(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else 'default')")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context")

    p = sub.add_parser("submit", parents=[common], help="validate a TrainingSpec file and create/update it")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=submit)

    p = sub.add_parser("status", parents=[common], help="show runs as a table (one run: with its conditions)",
                       description="Show runs as a table (one run: with its conditions). Without a terminal (a pipe, "
                       "a CI log) every value is printed in full, as kubectl does.")
    p.add_argument("name", nargs="?", metavar="NAME")
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p.add_argument("-o", "--output", choices=OUTPUTS, default="table",
                   help="table (default); wide: more columns; json, yaml: the TrainingSpec objects as data "
                   "(one NAME: the object; else a List of them)")
    p.set_defaults(func=status)

    p = sub.add_parser("wait", parents=[common], help="wait for a run's phase (exit 0 reached, 1 failed, 2 timeout)",
                       description="Wait until run NAME reaches a phase. Exit codes for CI: 0 the phase was "
                       "reached, 1 the run failed (or finished otherwise), 2 timed out.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--for", dest="phase", default="succeeded",
                   choices=["succeeded", "running", "suspended", "failed"], help="phase to wait for")
    p.add_argument("--timeout", default="2h", help="e.g. 90s, 30m, 2h, 1h30m (default 2h)")
    p.add_argument("--interval", type=float, default=2.0, help=argparse.SUPPRESS)
    p.set_defaults(func=wait)

    p = sub.add_parser("logs", parents=[common], help="print the trainer logs of a run's worker pod")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--worker", type=int, default=None,
                   help="worker index (default: the worker holding global rank 0, which logs the steps; after a "
                   "restart that can be any worker, since the rendezvous deals the ranks anew)")
    p.add_argument("--group", type=int, default=None,
                   help="elastic.faultTolerance replicaGroups: the replica group whose pods to read (default 0)")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("--tail", type=int, default=None, help="last N lines")
    p.set_defaults(func=logs)

    p = sub.add_parser("operator", help="run the kiln operator (out of cluster: with your kubeconfig)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("-n", "--namespace", action="append", dest="namespaces",
                   help="watch only this namespace (repeatable; default: all)")
    p.add_argument("--health-port", type=int, default=None,
                   help="serve GET /healthz on this port (default: $KILN_HEALTH_PORT or 8080; 0 disables)")
    p.add_argument("--image", help="default trainer image (default: $KILN_TRAINER_IMAGE or kiln's release image)")
    p.add_argument("--leader-lease", metavar="[NAMESPACE/]NAME",
                   help="the Lease that decides which operator acts (default: $KILN_LEADER_LEASE, else "
                        "kiln-operator in the pod's namespace, the first --namespace, or kiln-system)")
    p.set_defaults(func=operator)


def parse_duration(text: str) -> float:
    """'2h', '30m', '90s', '1h30m' or plain seconds → seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise KilnError(f"--timeout {text!r}: use a duration like 90s, 30m, 2h or 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def _kube(args):
    from kiln.control.kube import Kube, api_client

    return Kube(api_client(args.kubeconfig, args.context))


def _namespace(args) -> str:
    from kiln.client import default_namespace

    return args.namespace or default_namespace(args.kubeconfig)


def _client(args):
    from kiln.client import KilnClient

    return KilnClient(args.namespace, kubeconfig=args.kubeconfig, context=args.context, kube=_kube(args))


def submit(args) -> int:
    client = _client(args)
    for doc in client.load(args.file):
        name = client.submit(doc)
        print(f"submitted {doc.metadata.namespace or client.namespace}/{name}; "
              f"follow it with: kiln status {name} -n {doc.metadata.namespace or client.namespace}")
    return 0


def _age(ts: str | None) -> str:
    if not ts:
        return ""
    seconds = (datetime.now(timezone.utc) - datetime.fromisoformat(ts.replace("Z", "+00:00"))).total_seconds()
    return duration(seconds)


def _cost(cost: dict | None) -> tuple[str, str]:
    """GPU-HOURS (with the productive share) and COST columns of `kiln status -o wide`."""
    if not cost:
        return "", ""
    total, productive = cost.get("gpuHours", 0.0), (cost.get("gpuHoursByCause") or {}).get("productive", 0.0)
    hours = f"{total:.4g} ({productive / total:.0%} productive)" if total else "0"
    money = f"{cost['amount']:.2f} {cost.get('currency', '')}".strip() if cost.get("amount") is not None else ""
    return hours, money


def status_table(items: list[dict], all_namespaces: bool, wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """The header and rows of `kiln status` (full values, no markup) for TrainingSpec objects."""
    header = (["NAMESPACE"] if all_namespaces else []) + ["NAME", "PHASE", "NODES", "STEP", "PROGRESS", "TOKENS/S",
                                                          "MFU", "LAST CHECKPOINT", "RESTARTS", "AGE"]
    if wide:
        header += ["ETA", "GOODPUT", "GPU-HOURS", "COST", "CHECKPOINT URI", "GENERATION", "MESSAGE"]
    rows = []
    for item in items:
        st, meta = item.get("status") or {}, item["metadata"]
        ckpt = st.get("lastCheckpoint") or {}
        row = ([meta.get("namespace", "")] if all_namespaces else []) + [
            meta["name"], st.get("phase") or "Pending", str(st.get("nodes", "")), str(st.get("step", "")),
            st.get("progress", ""),
            f"{st['tokensPerSecond']:.3g}" if st.get("tokensPerSecond") is not None else "",
            f"{st['mfu']:.1%}" if st.get("mfu") is not None else "",
            f"step {ckpt['step']}" if ckpt else "", str(st.get("restarts", "")), _age(meta.get("creationTimestamp")),
        ]
        if wide:
            observed = st.get("observedGeneration")
            row += [duration(st["etaSeconds"]) if st.get("etaSeconds") is not None else "",
                    f"{st['goodput']:.1%}" if st.get("goodput") is not None else "", *_cost(st.get("cost")),
                    ckpt.get("uri", ""),
                    f"{observed if observed is not None else '-'}/{meta.get('generation', '-')}", waiting(item) or ""]
        rows.append(row)
    return header, rows


def waiting(item: dict) -> str | None:
    """Why a run does not train: the spec refused (SpecAccepted=False), or the queue's reason and message
    while it is Queued (Kueue's words, e.g. which resource its ClusterQueue lacks); None otherwise."""
    st = item.get("status") or {}
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    for ctype, status in (("SpecAccepted", "False"), ("Queued", "True")):
        c = conds.get(ctype) or {}
        if c.get("status") == status and (ctype != "Queued" or st.get("phase") == "Queued"):
            return f"{ctype} {c.get('reason', '')}: {c.get('message', '')}"
    return None


def condition_table(item: dict) -> tuple[list[str], list[list[str]]]:
    conditions = (item.get("status") or {}).get("conditions") or []
    return ["CONDITION", "STATUS", "REASON", "MESSAGE"], [
        [c["type"], c["status"], c.get("reason", ""), c.get("message", "")] for c in conditions]


def queue_table(item: dict) -> tuple[list[str], list[list[str]]] | None:
    """scheduling.queue: the LocalQueue and, once Kueue admitted the run, its ClusterQueue, flavors, when,
    and the topology domains it placed it in; None for a run without a queue (why it waits: condition Queued)."""
    queue = (item.get("status") or {}).get("queue")
    if not queue:
        return None
    topology = queue.get("topology") or {}
    where = f"{', '.join(topology.get('levels') or [])}: {', '.join(topology['domains'])}" if topology.get(
        "domains") else ""
    return ["QUEUE", "CLUSTERQUEUE", "FLAVORS", "ADMITTED", "TOPOLOGY"], [
        [queue["name"], queue.get("clusterQueue", ""), ", ".join(queue.get("flavors") or []),
         queue.get("admittedAt") or "not yet", where]]


def tracking_line(item: dict) -> str | None:
    """status.tracking (trainer): the records dropped and each failing tracker's first failure; None while the
    trackers take every record."""
    tracking = (item.get("status") or {}).get("tracking")
    if not tracking:
        return None
    return f"tracking: {tracking.get('dropped', 0)} record(s) dropped" + \
        (f"; {tracking['error']}" if tracking.get("error") else "")


def group_table(item: dict) -> tuple[list[str], list[list[str]]] | None:
    """elastic.faultTolerance replicaGroups: each group's job, phase, pods and restarts (operator), and the
    last quorum (trainer) in the header; None for a run without replica groups."""
    st = item.get("status") or {}
    groups = st.get("replicaGroups")
    if not groups:
        return None
    quorum = st.get("quorum") or {}
    live = (f"QUORUM {quorum['id']}: {quorum['liveGroups']} OF {quorum['groups']} LIVE, {quorum.get('changes', 0)} "
            f"CHANGE(S), {quorum.get('heals', 0)} HEAL(S)") if quorum else "QUORUM (no trainer report yet)"
    return ["GROUP", "JOB", "PHASE", "PODS", "RESTARTS", live], [
        [str(g["group"]), g.get("job") or "", g["phase"], str(g.get("pods", 0)), str(g.get("restarts", 0)), ""]
        for g in groups]


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest value, 3 spaces apart, nothing cut (as kubectl prints)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows])


def as_data(items: list[dict], name: str | None) -> dict:
    """-o json|yaml: the objects as the apiserver has them (less metadata.managedFields); one NAME: the object."""
    objects = [{**item, "metadata": {k: v for k, v in item["metadata"].items() if k != "managedFields"}}
               for item in items]
    return objects[0] if name else {"apiVersion": "v1", "kind": "List", "items": objects}


def _print_table(console, header: list[str], rows: list[list[str]], phase_column: int | None = None) -> None:
    """Every value whole, as kubectl prints (a long line wraps in the terminal, never "llama-8…"); in a
    terminal the phase in colour."""
    if not console.is_terminal:  # a pipe or a CI log: plain text
        print(plain_table(header, rows))
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in header:
        table.add_column(col, no_wrap=True)
    for row in rows:
        if phase_column is not None:
            phase = row[phase_column]
            row = [*row[:phase_column], f"[{PHASE_COLOUR.get(phase, 'white')}]{phase}[/]", *row[phase_column + 1:]]
        table.add_row(*row)
    natural = sum(max(len(r[i]) for r in [header, *rows]) + 2 for i in range(len(header)))
    terminal = console.width
    console.width = max(terminal, natural)  # wider than the terminal: the terminal wraps it, nothing is cut
    console.print(table, crop=False)
    console.width = terminal


def status(args) -> int:
    from rich.console import Console

    kube = _kube(args)
    ns = None if args.all_namespaces else _namespace(args)
    if args.name:
        body = kube.trainingspec(ns or "default", args.name)
        if body is None:
            raise KilnError(f"no TrainingSpec {args.name!r} in namespace {ns}; `kiln status` lists them")
        items = [body]
    else:
        items = kube.trainingspecs(ns)
    if args.output in ("json", "yaml"):
        data = as_data(items, args.name)
        if args.output == "json":
            import json

            print(json.dumps(data, indent=2))
        else:
            import yaml

            print(yaml.safe_dump(data, sort_keys=False), end="")
        return 0
    console = Console()
    if not items:
        print(f"no TrainingSpecs in {'any namespace' if ns is None else 'namespace ' + ns}")
        return 0
    header, rows = status_table(items, all_namespaces=ns is None, wide=args.output == "wide")
    _print_table(console, header, rows, phase_column=header.index("PHASE"))
    if args.output != "wide" and not args.name:  # why each waiting run waits (-o wide: the MESSAGE column)
        for item in items:
            if why := waiting(item):
                print(f"{item['metadata']['name']}: {why}")
    if args.name:
        if (groups := group_table(items[0])) is not None:
            _print_table(console, *groups, phase_column=2)
        if (queue := queue_table(items[0])) is not None:
            _print_table(console, *queue)
        _print_table(console, *condition_table(items[0]))
        if (line := tracking_line(items[0])) is not None:
            print(line)
    return 0


def wait(args) -> int:
    from kiln.client import RunFailed

    client = _client(args)
    want = args.phase.capitalize()
    try:
        status = client.wait(args.name, want, timeout=parse_duration(args.timeout), interval=args.interval)
    except RunFailed as failed:
        print(str(failed), file=sys.stderr)
        return WAIT_FAILED
    except TimeoutError:
        print(f"{client.namespace}/{args.name}: still {client.status(args.name).phase or 'Pending'} after "
              f"{args.timeout} (waited for {want})", file=sys.stderr)
        return WAIT_TIMEOUT
    print(f"{client.namespace}/{args.name}: {status.phase}")
    return WAIT_SUCCEEDED


def logs(args) -> int:
    from kubernetes.client.exceptions import ApiException

    from kiln.client import api_message, job_of, worker_logging_steps

    kube = _kube(args)
    ns = _namespace(args)
    job = job_of(kube, ns, args.name, args.group)
    worker = args.worker if args.worker is not None else worker_logging_steps(kube, ns, args.name, job)
    pod = f"{job}-worker-{worker}"
    try:
        out = kube.logs(ns, pod, follow=args.follow, tail=args.tail)
    except ApiException as err:
        if err.status == 404:
            raise KilnError(f"pod {ns}/{pod} does not exist (yet); `kiln status {args.name}` shows the phase") from None
        raise KilnError(f"cannot read logs of {ns}/{pod}: {api_message(err)}") from None
    if args.follow:
        for chunk in out.stream():
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
    else:
        sys.stdout.write(out)
    return 0


def operator(args) -> int:
    from kiln.control.config import OperatorConfig
    from kiln.control.serve import run

    config = OperatorConfig.from_env()
    if args.image:
        config = OperatorConfig(**{**config.__dict__, "image": args.image})
    port = config.health_port if args.health_port is None else args.health_port
    health = f"http://0.0.0.0:{port}/healthz" if port else None
    print(f"kiln operator: watching {', '.join(args.namespaces) if args.namespaces else 'all namespaces'}"
          + (f"; health on :{port}/healthz" if health else ""), file=sys.stderr)
    run(namespaces=args.namespaces, kubeconfig=args.kubeconfig, config=config, health=health, lease=args.leader_lease)
    return 0
