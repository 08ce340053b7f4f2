"""`python -m tests.bench [NAME ...]` (= `make bench`): run the CPU benchmarks one after another.

Each benchmark writes its own JSON to runs/bench/<name>.json, with the reference measured in the same run.
The GPU checks (bench_kernels and the CUDA forms of the others) run in one command on a GPU machine:
tests/bench/gpu_checks.sh (docs/kernels.md, "All GPU checks in one call").
"""

from __future__ import annotations

import subprocess
import sys

# In the order that shares the machine best: the rig-independent ones first.
CPU_BENCHMARKS = ["plan", "trainer", "moe", "ep", "vs_torchtitan", "compression", "stragglers", "tracking", "eval", "hf",
                  "prepare", "prepare_workers", "chat", "checkpoint", "restart", "faults", "rig", "operator"]


def main(argv: list[str]) -> int:
    names = argv or CPU_BENCHMARKS
    unknown = [n for n in names if n not in CPU_BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(CPU_BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"== bench_{name}", flush=True)
        if subprocess.call([sys.executable, "-m", f"tests.bench.bench_{name}"]) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
