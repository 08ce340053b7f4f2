"""`make generate`: every checked-in file that is made from another, written in one go.

    manifests/crds/kiln.dev_trainingspecs.yaml    the CRD, from the models and rules (kiln.api.crd; `kiln crd`)
    helm/kiln/crds/kiln.dev_trainingspecs.yaml    its copy in the chart (Helm reads only files inside the chart)
    helm/kiln/files/operator-clusterrole.yaml     copies of manifests/rbac/*-clusterrole.yaml (written by hand:
    helm/kiln/files/trainer-clusterrole.yaml      the verbs the code uses), which the chart renders verbatim
    helm/kiln/files/kiln-alerts.yaml              copy of manifests/monitoring/kiln-alerts.yaml (the PrometheusRule)
    docs/api.md, between its markers              the field reference (kiln.api.reference)

`python -m kiln.api.generate [--root DIR] [--check]`: --check writes nothing and exits 1 naming what is
stale. The tests compare each file with `outputs()` and say to run `make generate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMMAND = "make generate"
CRD = "manifests/crds/kiln.dev_trainingspecs.yaml"
COPIES = {  # copy -> source, both relative to the repository root
    "helm/kiln/crds/kiln.dev_trainingspecs.yaml": CRD,
    "helm/kiln/files/operator-clusterrole.yaml": "manifests/rbac/operator-clusterrole.yaml",
    "helm/kiln/files/trainer-clusterrole.yaml": "manifests/rbac/trainer-clusterrole.yaml",
    "helm/kiln/files/kiln-alerts.yaml": "manifests/monitoring/kiln-alerts.yaml",
}
API_DOC = "docs/api.md"


def outputs(root: Path) -> dict[str, str]:
    """What each generated file must hold (path relative to root -> text), from the sources under root."""
    from kiln.api.crd import crd_yaml
    from kiln.api.reference import BEGIN, END, reference_markdown

    out = {CRD: crd_yaml()}
    for copy, source in COPIES.items():
        out[copy] = out[source] if source in out else (root / source).read_text()
    doc = (root / API_DOC).read_text()
    out[API_DOC] = doc[:doc.index(BEGIN)] + reference_markdown() + doc[doc.index(END) + len(END):]
    return out


def stale(root: Path) -> list[str]:
    return [path for path, text in outputs(root).items()
            if not (root / path).exists() or (root / path).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.api.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    root = Path(args.root)
    old = stale(root)
    if args.check:
        for path in old:
            print(f"{path}: stale; run `{COMMAND}`", file=sys.stderr)
        return 1 if old else 0
    for path, text in outputs(root).items():
        if path in old:
            (root / path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
