"""`kiln validate`, `kiln render`, `kiln crd`: offline work on TrainingSpec files."""

from __future__ import annotations

import argparse
import sys

import yaml

from kiln.api.crd import _str_presenter, crd_yaml
from kiln.api.load import load_file
from kiln.errors import KilnError


class _RenderDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """libyaml's emitter (a 10,000-node affinity renders in a fraction of a second, not seconds), with
    multi-line strings as blocks like `kiln crd`."""


_RenderDumper.add_representer(str, _str_presenter)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check TrainingSpec files (exit 0 valid, 1 invalid)",
                       description="Check TrainingSpec files with the same rules the apiserver enforces. "
                       "Exit 0 when every file is valid, 1 otherwise; each problem names the field.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--local", action="store_true",
                   help="only the rules for `kiln run` on this machine (skip those for Kubernetes)")
    p.set_defaults(func=validate)

    p = sub.add_parser("render", help="print the objects the operator would create (YAML, offline)",
                       description="Print what the operator creates for a TrainingSpec: the trainer's "
                       "ServiceAccount/Role/RoleBinding, the NetworkPolicy, the ConfigMap with the resolved spec and the PyTorchJob.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-n", "--namespace", help="namespace to render into (default: the file's, else 'default')")
    p.add_argument("--image", help="trainer image when spec.image is unset (default: the operator's)")
    p.set_defaults(func=render)

    p = sub.add_parser("crd", help="print the TrainingSpec CustomResourceDefinition (YAML)")
    p.set_defaults(func=crd)


def validate(args: argparse.Namespace) -> int:
    ok = True
    for path in args.files:
        try:
            docs = load_file(path, scope="local" if args.local else "all")
        except KilnError as err:
            ok = False
            print(str(err), file=sys.stderr)
            continue
        for doc in docs:
            print(f"{path}: {doc.metadata.name}: valid")
    return 0 if ok else 1


def render(args: argparse.Namespace) -> int:
    docs = load_file(args.file)
    # imported here: the Kubernetes client models take seconds to import; `kiln validate` and a file that
    # fails to load need not wait for them
    from kiln.control.config import OperatorConfig
    from kiln.control.plan import plan

    config = OperatorConfig.from_env()
    if args.image:
        config = OperatorConfig(**{**config.__dict__, "image": args.image})
    out = []
    for doc in docs:
        doc.metadata.namespace = args.namespace or doc.metadata.namespace or "default"
        desired = plan(doc, None, config)
        if desired.refused:  # the operator's policy (this shell's KILN_POLICY_*, else the defaults) forbids it
            raise KilnError(f"{args.file}: {doc.metadata.name}: {desired.refused}")
        out.extend(desired.objects)
    sys.stdout.write(yaml.dump_all(out, Dumper=_RenderDumper, sort_keys=False, width=120))
    return 0


def crd(args: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0
