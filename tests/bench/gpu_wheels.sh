#!/usr/bin/env bash
# The Python wheels tests/bench/gpu_checks.sh needs on the GPU machine, which has no network (its python3 3.12
# holds torch, triton, transformers, numpy, rich, pyyaml, jinja2, tensorboard... but not what is below).
# Run HERE, where PyPI is reachable, in the checkout the device call sends, just before the call: it downloads
# into .whl/ (git-ignored; name `.whl` in the call's carry) the cp312 manylinux x86_64 wheels of
#   .whl/site/               kiln's imports the machine lacks (pydantic and its parts, at this venv's versions),
#                            and liger-kernel (bench_kernels' comparison, never a kiln dependency)
#   .whl/torchtitan-<ver>/   each TorchTitan release bench_vs_torchtitan can run, with the packages its
#                            TORCHTITAN_PACKAGES lists, less those the machine has (DEVICE_HAS)
# and records the commit (and `git status` of tracked files) the run will measure, for the JSON's provenance.
# Prints the sizes: the wheels and the tree travel together, under 64 MiB.
# Usage: bash tests/bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}  # the kiln venv's: its versions are the ones carried
export PYTHONPATH=$PWD/operator:$PWD${PYTHONPATH:+:$PYTHONPATH}
LIGER=liger-kernel==0.8.5
DEVICE_HAS="pandas xxhash"  # in TORCHTITAN_PACKAGES' lists and in the machine's image: not carried

pip_download() {  # dir, requirements...
  local dir=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}

# kiln's imports the machine lacks, at the versions this venv tests with
site=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("pydantic", "pydantic_core", "annotated-types", "typing-inspection",
                                              "typing_extensions")))
EOF
)
rm -rf .whl/site && mkdir -p .whl/site
pip_download .whl/site $site $LIGER
# pydantic's whole closure is in .whl/site (pip resolves it there alone, for cp312, without installing)
"$PY" -m pip install -q --dry-run --ignore-installed --no-index --find-links .whl/site --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --target /tmp/gpu-wheels-check \
  $(echo "$site" | cut -d' ' -f1)

for ver in $("$PY" -c "from tests.bench.bench_vs_torchtitan import TORCHTITAN_PACKAGES as P; print(*P)"); do
  pkgs=$("$PY" -c "
from tests.bench.bench_vs_torchtitan import TORCHTITAN_PACKAGES as P
print(*[p for p in P['$ver'] if p.split('==')[0] not in '$DEVICE_HAS'.split()])")
  rm -rf ".whl/torchtitan-$ver" && mkdir -p ".whl/torchtitan-$ver"
  pip_download ".whl/torchtitan-$ver" $pkgs
done

git rev-parse HEAD > .whl/COMMIT
git status --porcelain --untracked-files=no > .whl/TREE_STATUS

ls -R .whl
wheels=$(du -sb .whl | cut -f1)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s + 0}')
echo "wheels $((wheels / 1024)) KiB + tree $((tree / 1024)) KiB = $(((wheels + tree) / 1048576)) MiB of the 64 MiB a device call carries"
[ $((wheels + tree)) -lt $((60 * 1048576)) ] || { echo "gpu_wheels.sh: over 60 MiB" >&2; exit 1; }
