"""Rig benchmark: how long a cached build, a start, a reuse and a stop take.

    python -m tests.bench.bench_rig [--out runs/bench/rig.json]

Runs a private rig beside any running one (own run directory, ports shifted by
KILN_RIG_PORT_OFFSET) on the binaries already built, through the real CLI
(`python -m tests.rig ...`). The reference in the same run is the start itself:
`reuse_over_start` says how much a second `up` costs relative to a first one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.rig import build
from tests.bench.report import write_report

REPO = Path(__file__).resolve().parents[2]


def timed(args: list[str], env: dict) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "tests.rig", *args], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench/rig.json")
    parser.add_argument("--port-offset", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    build.build()  # make sure the binaries exist; the build itself is not timed here
    with tempfile.TemporaryDirectory(prefix="kiln-bench-rig-") as tmp:
        # A private cache dir whose rig/ is the real one: same binaries, own run directory.
        (Path(tmp) / "rig").symlink_to(build.cache_dir() / "rig")
        env = {**os.environ, "KILN_CACHE_DIR": tmp, "KILN_RIG_PORT_OFFSET": str(args.port_offset)}
        runs = []
        try:
            for _ in range(args.repeat):
                runs.append({
                    "build_cached_s": timed(["build"], env),
                    "up_start_s": timed(["up"], env),
                    "up_reuse_s": timed(["up"], env),
                    "down_s": timed(["down"], env),
                })
        finally:
            subprocess.run([sys.executable, "-m", "tests.rig", "down"], cwd=REPO, env=env, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    result = {
        "bench": "rig",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m": os.getloadavg()[0]},
        "runs": runs,
        "best": best,
        "reuse_over_start": best["up_reuse_s"] / best["up_start_s"],
        "recorded_cold_build": json.loads((build.rig_dir() / "build-times.json").read_text())
        if (build.rig_dir() / "build-times.json").exists() else None,
    }
    write_report(result, args.out, summary=result["best"] | {"reuse_over_start": result["reuse_over_start"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
