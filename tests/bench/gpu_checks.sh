#!/usr/bin/env bash
# Every GPU check of kiln in one command, for a session lent one GPU for a few minutes (docs/kernels.md, "All GPU
# checks in one call"): about 8 minutes at most on an H200. Each part has its own time limit (BUDGET_<part>
# seconds overrides it) and writes JSON into $OUT (else runs/bench); one that fails or runs out of time does not
# stop the next. The end prints each part's status and figures and writes gpu_checks.json (tests/bench/gpu_summary.py).
#   kernels_cases  the Triton kernels against the fp32 reference on CUDA (tests/kernels/cases.py) -> kernel_cases.json
#   kernels_bench  bench_kernels: eager, torch.compile, kiln's Triton, Liger at Llama-3-8B sizes    -> kernels.json
#   vs_torchtitan  bench_vs_torchtitan --device cuda --preset llama-1b (bf16): kiln's MFU and its ratio to
#                  TorchTitan 0.3.0; if that fails, TorchTitan 0.2.2; if that fails too, bench_trainer
#                  (kiln against a plain PyTorch loop, kiln's MFU)          -> vs_torchtitan.json (or trainer.json)
#   moe            bench_moe --device cuda --grouped both: tiny-moe with grouped GEMMs and with the loop, tiny dense,
#                  bf16                                                                            -> moe.json
#   packing        packed rows through compiled FlexAttention equal each document alone (tests/kernels/packing.py)
#                                                                                                  -> packing_cuda.json
# and gpu_checks.log (this output). Before the parts it installs the wheels tests/bench/gpu_wheels.sh put in
# .whl/ (the machine has no network): .whl/site to /tmp/site, each .whl/torchtitan-<ver> where
# bench_vs_torchtitan looks for that release ($KILN_CACHE_DIR/tools/torchtitan-<ver>).
#
#   bash tests/bench/gpu_checks.sh           # on the GPU machine
#   bash tests/bench/gpu_checks.sh --smoke   # anywhere: the same parts on the CPU at tiny sizes (the CUDA-only
#                                            # kernel parts skipped), with this environment's packages
#   PARTS="moe packing" bash tests/bench/gpu_checks.sh   # some parts only
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-python3}
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
PARTS=${PARTS:-kernels_cases kernels_bench vs_torchtitan moe packing}
DEST=${OUT:-runs/bench}
[ $SMOKE = 1 ] && DEST=${OUT:-runs/bench/smoke}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
STATUS=$WORK/parts.tsv
: > "$STATUS"
exec > >(tee "$DEST/gpu_checks.log") 2>&1
TEE=$!

export PYTHONPATH=$REPO/operator:$REPO PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
[ $SMOKE = 1 ] && export KILN_CACHE_DIR=$WORK/cache  # the carried TorchTitan wheels, not this machine's cache
if ! git rev-parse HEAD >/dev/null 2>&1 && [ -f .whl/COMMIT ]; then  # a copy without git: what gpu_wheels.sh saw
  KILN_COMMIT=$(cat .whl/COMMIT) KILN_TREE_STATUS=$(cat .whl/TREE_STATUS 2>/dev/null)
  export KILN_COMMIT KILN_TREE_STATUS
fi

install_wheels() {  # target, wheels...
  local target=$1; shift
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}
echo "== setup"
if [ $SMOKE = 1 ]; then
  echo "smoke: kiln's dependencies from this environment (.whl/site is for the GPU machine's Python 3.12)"
elif compgen -G ".whl/site/*.whl" >/dev/null; then
  install_wheels /tmp/site .whl/site/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH \
    || echo "setup: installing .whl/site failed; the parts run with what the machine has"
else
  echo "setup: no .whl/site (run tests/bench/gpu_wheels.sh here first); the parts run with what the machine has"
fi
for dir in .whl/torchtitan-*/; do
  [ -d "$dir" ] || continue
  ver=${dir#.whl/torchtitan-}; ver=${ver%/}
  install_wheels "$KILN_CACHE_DIR/tools/torchtitan-$ver" "$dir"*.whl || echo "setup: TorchTitan $ver's wheels failed to install"
done
"$PY" - <<'EOF'
import importlib.metadata, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      + (f"{torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})" if torch.cuda.is_available() else "no CUDA"))
for module, dist in (("triton", "triton"), ("pydantic", "pydantic"), ("liger_kernel", "liger-kernel"),
                     ("transformers", "transformers")):
    try:  # imported, so the version is the one the parts will import
        importlib.import_module(module)
        print(f"  {dist} {importlib.metadata.version(dist)}")
    except Exception as e:
        print(f"  {dist}: {type(e).__name__}: {e}")
EOF
if [ $SMOKE = 0 ] && command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi

record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" "${5:-}" >> "$STATUS"; }  # name status s file note
budget() { local var="BUDGET_$1"; echo "${!var:-$(($2 * (SMOKE ? 3 : 1)))}"; }  # the CPU is slower: 3x in --smoke
# run_limited SECONDS CMD...: the command under a time limit (SIGINT first: Python prints where it was); sets RC
run_limited() {
  local limit=$1; shift
  echo "\$ $* (limit ${limit}s)"
  timeout -k 5 -s INT "$limit" "$@"; RC=$?
}
status_of() { case $1 in 0) echo ok ;; 124) echo timeout ;; fallback) echo "fallback ok" ;; *) echo "failed (rc $1)" ;; esac; }
wanted() { [[ " $PARTS " == *" $1 "* ]]; }

part() {  # name default-budget file cmd...: one part writing $DEST/file (a stale one removed first), recorded
  local name=$1 limit file=$3; limit=$(budget "$1" "$2"); shift 3
  wanted "$name" || return 0
  echo "== $name"
  local start=$SECONDS
  rm -f "$DEST/$file"
  run_limited "$limit" "$@" --out "$DEST/$file"
  record "$name" "$(status_of $RC)" $((SECONDS - start)) "$file"
}

skip() {  # name why
  wanted "$1" || return 0
  echo "== $1: skipped: $2"
  record "$1" skipped 0 "" "$2"
}

if [ $SMOKE = 1 ]; then
  skip kernels_cases "CUDA only (on the CPU: tests/unit/test_kernels.py runs the cases under Triton's interpreter)"
  skip kernels_bench "CUDA only"
  TT_ARGS=(--device cpu --steps 2 --warmup 1 --no-compile)
  TRAINER_ARGS=(--device cpu --steps 2 --warmup 1 --no-compile)
  MOE_ARGS=(--device cpu --precision bf16 --grouped both --steps 2 --warmup 1 --reps 2 --batch 2)
  PACKING_ARGS=(--device cpu)
else
  part kernels_cases 70 kernel_cases.json "$PY" -m tests.kernels.cases --device cuda
  part kernels_bench 90 kernels.json "$PY" -m tests.bench.bench_kernels
  TT_ARGS=(--device cuda --preset llama-1b)
  TRAINER_ARGS=(--device cuda --preset llama-1b)
  MOE_ARGS=(--device cuda --grouped both --batch 32)
  PACKING_ARGS=(--device cuda)
fi

# kiln against TorchTitan; each fallback gets what is left of the part's time
if wanted vs_torchtitan; then
  echo "== vs_torchtitan"
  start=$SECONDS limit=$(budget vs_torchtitan 240) RC=1 note="" file=vs_torchtitan.json
  rm -f "$DEST/vs_torchtitan.json" "$DEST/trainer.json"
  for ver in 0.3.0 0.2.2; do
    left=$((limit - (SECONDS - start)))
    if [ ! -d "$KILN_CACHE_DIR/tools/torchtitan-$ver/torchtitan" ]; then
      note="$note no TorchTitan $ver wheels (tests/bench/gpu_wheels.sh);"
      continue
    fi
    [ $left -gt 30 ] || break
    run_limited $left "$PY" -m tests.bench.bench_vs_torchtitan "${TT_ARGS[@]}" --torchtitan $ver \
      --out "$DEST/vs_torchtitan.json"
    [ $RC = 0 ] && { note="$note TorchTitan $ver"; break; }
    note="$note TorchTitan $ver $(status_of $RC);"
    [ $RC = 124 ] && break  # out of time, not a release that fails to run
  done
  left=$((limit - (SECONDS - start)))
  if [ $RC != 0 ] && [ $RC != 124 ] && [ $left -gt 30 ]; then
    echo "-- no TorchTitan release ran: kiln against a plain PyTorch loop instead (bench_trainer)"
    run_limited $left "$PY" -m tests.bench.bench_trainer "${TRAINER_ARGS[@]}" --out "$DEST/trainer.json"
    note="$note bench_trainer $(status_of $RC)" file=trainer.json
    [ $RC = 0 ] && RC=fallback
  fi
  record vs_torchtitan "$(status_of $RC)" $((SECONDS - start)) "$file" "${note# }"
fi

part moe 40 moe.json "$PY" -m tests.bench.bench_moe "${MOE_ARGS[@]}"
part packing 50 packing_cuda.json "$PY" -m tests.kernels.packing "${PACKING_ARGS[@]}"

echo
"$PY" -m tests.bench.gpu_summary --parts "$STATUS" --dest "$DEST"  # exit status 1 unless every part was ok or skipped
rc=$?
exec >&- 2>&-
wait $TEE 2>/dev/null  # the log's last lines written before the call returns
exit $rc
