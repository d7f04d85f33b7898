#!/usr/bin/env bash
# What only a GPU machine can run, as one command of under 8 minutes: tests/gpu/test_cuda.py (pinned staging, the
# frameworks' FSDP launches, each adapter under NCCL with a world of one, the memory tier from GPU state), then the
# `cuda` benchmark (saves from GPU memory against the device-to-host copy and DCP). From the repository root:
#
#     bash benchmarks/gpu_sitting.sh [OUT]      # OUT: where the results go (default $OUT, else /tmp/asyncckpt-gpu)
#
# For a lent machine whose Python already holds torch with CUDA and the frameworks (nothing can be installed
# there): asyncckpt is imported from this checkout through a folder of links (no pip), as the harness imports a
# revision. Where no CUDA device is visible it says so and exits 0. Budget (an H200, 2026-11-28: the tests then
# took 164 s, the benchmark 2.0 min): the tests at most 330 s, the benchmark at most 150 s.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-${OUT:-/tmp/asyncckpt-gpu}}"
python="${PYTHON:-python3}"
cd "$repo"
if ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "no CUDA device: nothing to run"
    exit 0
fi
mkdir -p "$out"
links="$(mktemp -d)"
"$python" - "$repo" "$links" <<'PY'
import os, sys, tomllib
repo, links = sys.argv[1:]
with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
    mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for package, directory in mapping.items():  # "asyncckpt.adapters.lightning" = "adapters/lightning"
    link = os.path.join(links, *package.split("."))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.join(repo, directory), link)
PY
export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
"$python" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
started=$SECONDS
timeout 330 "$python" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/gpu/test_cuda.py \
    --junitxml="$out/test_cuda.xml" 2>&1 | tee "$out/test_cuda.log" | tail -25
tests=${PIPESTATUS[0]}
echo "tests/gpu/test_cuda.py: exit $tests in $((SECONDS - started)) s"
started=$SECONDS
timeout 150 "$python" benchmarks/run.py cuda --reps 2 --out "$out/cuda" > "$out/cuda.log" 2>&1
bench=$?
tail -5 "$out/cuda.log"
echo "benchmark cuda: exit $bench in $((SECONDS - started)) s; results under $out"
rm -rf "$links"
exit $(( tests != 0 || bench != 0 ))
