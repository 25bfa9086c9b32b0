#!/usr/bin/env bash
# One lent GPU session's proof, in one device call: `make test-gpu`, then `make bench-gpu`, each capped so
# that a slow or hung part leaves time for the rest, everything they print and write copied to $OUT.
# Run from the project root on the GPU machine, with .gpu-carry carried (../shared/gpu/prepare_carry.sh):
#   bash scripts/gpu_session.sh [TEST_CAP_S] [BENCH_CAP_S] [BENCH_K]
# BENCH_K is a pytest -k expression for a part of the benchmarks (their tables then go to
# benchmarks/results/gpu/partial/), empty for all of them. The default caps (430 + 150 s) fit one device call
# (600 s): on an H100 the tests took about 7 minutes and the benchmarks without TRL 112 s.
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

echo "== make test-gpu (cap ${TEST_CAP}s) $(date -u +%T)"
start=$(date +%s)
# -s: the plan tests print their component-by-component comparison.
timeout -k 10 "$TEST_CAP" env TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -s \
    --timeout=240 -o junit_family=xunit2 --junitxml="$OUT/test-gpu.xml" > "$OUT/test-gpu.log" 2>&1
echo "test-gpu exit $? after $(( $(date +%s) - start ))s"
grep -E "passed|failed|error" "$OUT/test-gpu.log" | tail -3

echo "== make bench-gpu (cap ${BENCH_CAP}s${BENCH_K:+, -k $BENCH_K}) $(date -u +%T)"
start=$(date +%s)
mkdir -p benchmarks/results/gpu
timeout -k 10 "$BENCH_CAP" env TRITON_INTERPRET=0 python3 -m pytest benchmarks/gpu -p no:cacheprovider \
    ${BENCH_K:+-k "$BENCH_K"} --benchmark-json=benchmarks/results/gpu/bench-gpu.json > "$OUT/bench-gpu.log" 2>&1
echo "bench-gpu exit $? after $(( $(date +%s) - start ))s"
cp -r benchmarks/results/gpu "$OUT/results-gpu" 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== done $(date -u +%T)"
