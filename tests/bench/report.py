"""One way every benchmark writes its result: JSON at --out (folders made), a summary on stdout, and where the
numbers come from (`provenance`): the commit (and whether the tree had changes), the date, and the machine (cores,
load average when the benchmark started and when it wrote its result). The reference each benchmark measures
in the same run stays in its own result.

The figures quoted in docs/ are kept in the repository under docs/bench/<name>.json (KEPT_DIR);
tests/unit/test_bench_figures.py checks that every benchmark figure table in docs/ names a kept file or says
that its JSON was not kept.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEPT_DIR = ROOT / "docs" / "bench"
def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> tuple[str | None, str | None]:
    """(HEAD, `git status --porcelain` of the tracked files); where the tree is a copy without git (the GPU
    machine: tests/bench/gpu_checks.sh), what KILN_COMMIT and KILN_TREE_STATUS say (gpu_wheels.sh records them)."""
    commit = _git("rev-parse", "HEAD")
    if commit is not None:
        return commit, _git("status", "--porcelain", "--untracked-files=no")
    return os.environ.get("KILN_COMMIT") or None, os.environ.get("KILN_TREE_STATUS")


# When this module is imported, i.e. when the benchmark starts (each imports it at the top): the code it runs
# is the tree at this moment, whatever is checked out by the time it writes its result.
_STARTED = (datetime.datetime.now(datetime.timezone.utc), os.getloadavg(), *_commit())


def provenance() -> dict:
    """Commit, date and machine of this run (load average 1/5/15 min at the start and now)."""
    started, load_before, commit, status = _STARTED
    return {
        "commit": commit, "tree_changed": None if status is None else bool(status),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "load_average_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())}},
    }


def write_report(result: dict, out: str | Path, *, summary: dict | None = None) -> Path:
    """Write `result` with its provenance as JSON to `out`; print `summary` (default: the result itself)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=2) + "\n")
    print(json.dumps(result if summary is None else summary, indent=2))
    return path
