#!/usr/bin/env bash
# The kernel checks that need a GPU, in one go (about 5 minutes on one H200, installs included):
#   1. correctness of the Triton kernels on CUDA against the fp32 reference (tests/kernels/cases.py),
#   2. the benchmark against eager PyTorch, torch.compile and Liger-Kernel -> runs/bench/kernels.json.
# Usage: bash tests/bench/gpu_kernels.sh [extra bench_kernels.py flags, e.g. --no-compile]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${KILN_BENCH_OUT:-runs/bench/kernels.json}

"$PY" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null \
  || { echo "gpu_kernels.sh: needs a CUDA GPU with torch and triton installed" >&2; exit 2; }
"$PY" -c "import kiln" 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
# Liger is a benchmark comparison only (never a kiln dependency); --no-deps keeps the installed torch/triton.
"$PY" -c "import liger_kernel" 2>/dev/null || "$PY" -m pip install -q --no-deps liger-kernel \
  || echo "gpu_kernels.sh: liger-kernel could not be installed; benchmarking without it" >&2

echo "== correctness on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
"$PY" -m tests.kernels.cases --device cuda
echo "== benchmark"
"$PY" -m tests.bench.bench_kernels --out "$OUT" "$@"
