#!/usr/bin/env bash
# One lent GPU session's proof, in one device call: `make test-gpu`, then `make bench-gpu`, each capped so
# that a slow or hung part leaves time for the rest, everything they print and write copied to $OUT.
# Run from the project root on the GPU machine, with .gpu-carry carried (../shared/gpu/prepare_carry.sh, and
# scripts/gpu_trl_carry.sh for the race against TRL):
#   bash scripts/gpu_session.sh [TEST_CAP_S] [BENCH_CAP_S] [BENCH_K]
# TEST_CAP_S 0 skips the tests. BENCH_K is a pytest -k expression for a part of the benchmarks (their tables
# then go to benchmarks/results/gpu/partial/), empty for all of them. The default caps (430 + 150 s) fit one
# device call (600 s): on an H100 the tests took about 7 minutes and the benchmarks without TRL 112 s. The
# race against TRL needs a call of its own: `bash scripts/gpu_session.sh 0 580 trl`.
set -u
TEST_CAP=${1:-430}
BENCH_CAP=${2:-150}
BENCH_K=${3:-}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
# shellcheck disable=SC1091
source .gpu-carry/on_device.sh || { echo "on_device.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp . | tail -n +2

if [ "$TEST_CAP" -gt 0 ]; then
  echo "== make test-gpu (cap ${TEST_CAP}s) $(date -u +%T)"
  start=$(date +%s)
  # -s: the plan tests print their component-by-component comparison.
  timeout -k 10 "$TEST_CAP" env TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -s \
      --timeout=240 -o junit_family=xunit2 --junitxml="$OUT/test-gpu.xml" > "$OUT/test-gpu.log" 2>&1
  echo "test-gpu exit $? after $(( $(date +%s) - start ))s"
  grep -E "passed|failed|error" "$OUT/test-gpu.log" | tail -3
fi

# TRL and its imports (scripts/gpu_trl_carry.sh), for the benchmarks only. The folder's name must contain
# "site-packages": dill, which `datasets` hashes with, pickles a module by value (and fails on pyarrow's)
# unless its file is under sys.prefix or a site-packages folder.
bench_path=$PYTHONPATH
if [ -f .gpu-carry/trl-site.tar.xz ]; then
  TRL_SITE=/tmp/trl/site-packages
  [ -d "$TRL_SITE/trl" ] || { mkdir -p "$TRL_SITE" && tar -xJf .gpu-carry/trl-site.tar.xz -C "$TRL_SITE"; }
  bench_path=$PYTHONPATH:$TRL_SITE
  PYTHONPATH=$bench_path python3 -c "import trl, datasets, pyarrow; print('trl', trl.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__)"
fi

echo "== make bench-gpu (cap ${BENCH_CAP}s${BENCH_K:+, -k $BENCH_K}) $(date -u +%T)"
start=$(date +%s)
json_dir=benchmarks/results/gpu${BENCH_K:+/partial}  # where conftest.py puts the table of a partial run
mkdir -p "$json_dir"
timeout -k 10 "$BENCH_CAP" env TRITON_INTERPRET=0 PYTHONPATH="$bench_path" python3 -m pytest benchmarks/gpu -p no:cacheprovider \
    ${BENCH_K:+-k "$BENCH_K"} --benchmark-json="$json_dir/bench-gpu.json" > "$OUT/bench-gpu.log" 2>&1
echo "bench-gpu exit $? after $(( $(date +%s) - start ))s"
cp -r benchmarks/results/gpu "$OUT/results-gpu" 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== done $(date -u +%T)"
