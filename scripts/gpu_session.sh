#!/usr/bin/env bash
# A lent GPU session's proof, as named device calls, each capped so that a slow or hung part leaves time for the
# rest and for a rerun, everything printed and written copied to $OUT. Run from the project root on the GPU
# machine. A call carries at most 64 MiB, and its checkout holds only the ignored paths that call carried
# (seen on an H200, 2026-11-27: part-aa was gone in the next call): every call carries .gpu-carry, and this
# script keeps each vLLM part outside the checkout ($VPARTS) until both have come. What lies outside it
# (/tmp/site, /tmp/vsite, the parts) stays while the machine is warm (given back after 30 s idle), so the
# calls of one sequence are issued one right after the other:
#
#   1. bash scripts/gpu_session.sh vllm [CAP_S]
#        carry: .gpu-carry  .vllm-carry/part-aa  .vllm-carry/unpack.sh       (../shared/gpu/prepare_carry.sh,
#        ../shared/gpu/vllm_carry.sh): sets up, keeps the part, reads scripts/gpu_probe.py (seconds); with
#        CAP_S, also the HF-generate run of the GRPO race (it needs no vLLM; about 150 s on an H100), within it.
#   2. bash scripts/gpu_session.sh vllm [CAP_S] [K]
#        carry: .gpu-carry  .vllm-carry/part-ab: unpacks vLLM and, within CAP_S in all: where call 1 ran the
#        race's HF run, the race's vLLM run first (the step, sync and mismatch figures); then tests/gpu's vLLM
#        tests matching -k K (default "vllm": in the trainer's process beside a ZeRO-2 actor; GRPO, PPO on
#        ZeRO-3 and LoRA with rollout.engine vllm; the plan with the engine), .gpu-carry/vllm_smoke.py if they
#        failed (the engine alone, on a tiny model), then, where call 1 ran no HF run and RACE_MIN_S are
#        left, the whole race: the GRPO step with vLLM against HF generate.
#      With vllm_carry.sh's HOPPER_ONLY=1 (one part of ~43 MiB, its library pruned to sm_90; unverified on a
#        GPU), call 1 carries that part and unpack.sh and runs as call 2 does. Its fallback, the unpruned
#        library (fullC.xz, 53 MiB), does not fit a call beside .gpu-carry: if the pruned one fails, the
#        two-part carry is the way, in a later session.
#   3. bash scripts/gpu_session.sh vllm-bench [CAP_S]      carry: .gpu-carry. The GRPO step with vLLM against
#        the same step with HF generate alone (vLLM unpacked by call 2 on the same machine), in CAP_S: the
#        device time left (about 240 s after calls 1 and 2 of a 15-minute session).
#   4. bash scripts/gpu_session.sh trl [CAP_S] [RUNS]
#        carry: .gpu-carry  .trl-carry (scripts/gpu_trl_carry.sh), vLLM unpacked: the GRPO step
#        with vLLM against TRL's colocated vLLM, with and without Liger (RUNS: others, comma-separated, e.g.
#        fastrlhf_vllm,fastrlhf_vllm_shared,trl_vllm; fastrlhf_vllm[_shared][_liger][_compile][_fp32]), within CAP_S;
#        then, where 200 s are left, the HF-engine race against TRL.
#   bash scripts/gpu_session.sh tests [CAP_S] [K]  carry: .gpu-carry. tests/gpu without vLLM: kernels at
#        V=151,936, the update's host reads, every command through the launcher, the plan against the peak,
#        model.compile (-k K: some of them, e.g. "update_syncs or compile or at_scale").
#   bash scripts/gpu_session.sh bench [CAP_S] [K]: the benchmarks that need neither vLLM nor TRL (-k K: some).
#        Like `tests`, it keeps a vLLM part it carries (.vllm-carry/part-aa and unpack.sh beside .gpu-carry: 53 MiB),
#        so that it can be a session's first call and the `vllm` call after it carries part-ab only.
#        Issue #43's before and after in one call: K="lm_head or rl_update" (the fused loss with and without
#        the row kernel and the GEMM's fp32 sum, each profiled; the 1.5B update with and without checkpointing,
#        with Liger's layer kernels and with the layers torch.compiled: model.compile).
#
# 15 minutes of device time hold the machine's start (about 30 s on an H200) and about two of these calls:
# take them in the order of the lowest-numbered open issue that needs them.
# The default caps (seconds) fit one 600 s device call each. A call's cap counts from the script's start: the set-up
# (on_device.sh's installs, vLLM's unpacking, TRL's, the probe) takes its share of it, not time beyond it.
set -u
MODE=${1:-}
OUT=${OUT:-/tmp/gpu-out}
VSITE=${VSITE:-/tmp/vsite}
VPARTS=${VPARTS:-/tmp/vparts}
case "$MODE" in vllm-bench|trl|bench) CAP=${2:-570} ;; *) CAP=${2:-560} ;; esac
DEADLINE=$(( $(date +%s) + CAP ))
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session-$MODE.log") 2>&1
LOG_PID=$!  # the tee of this log: never one of the leftovers to kill
# gone PID: it has exited (a zombie, not yet reaped by its parent, holds no memory and writes nothing).
gone() { [[ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" =~ ^(Z|X|)$ ]]; }
# The tee writes the log's last lines after this shell's own: a call that ended at once left $OUT a log without
# them (1 call in 40 on a 2-core CPU machine, 4 in 40 beside a busy loop). At exit, its input closed, it is waited
# for (10 s at most: a leftover that inherited the pipe would keep it open).
finish_log() {
  exec >&- 2>&-
  for _ in $(seq 100); do gone "$LOG_PID" && return 0; sleep 0.1; done
}
trap finish_log EXIT
# The races' profiled steps' timelines (benchmarks/gpu/grpo_ours.py), kept outside $OUT and brought back as one archive
# at the end: a device call brings back 8 files at most.
export FASTRLHF_RACE_TRACES=${FASTRLHF_RACE_TRACES:-/tmp/gpu-traces-$MODE}
case "$MODE" in tests|vllm|vllm-bench|trl|bench) ;; *) echo "usage: $0 tests|vllm|vllm-bench|trl|bench [caps...]"; exit 2 ;; esac
# shellcheck disable=SC1091
source .gpu-carry/on_device.sh || { echo "on_device.sh failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp . | tail -n +2

# run_capped CAP NAME CMD...: CMD with a time cap, its output in $OUT/NAME.log, its exit code and time said.
run_capped() {
  local cap=$1 name=$2 start rc
  shift 2
  echo "== $name (cap ${cap}s) $(date -u +%T)"
  start=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name exit $rc after $(( $(date +%s) - start ))s"
  grep -E "passed|failed|error|skipped" "$OUT/$name.log" | tail -3
  (( rc == 124 || rc == 137 )) && kill_gpu_leftovers
  return $rc
}

# kill_gpu_leftovers: the processes a cut command left on the GPU. timeout kills pytest, not the launcher's ranks
# in their own sessions: on an H100 (2026-11-28) a cut vLLM test left 13 GiB held into the next call. Never this
# shell, its parents or its log's tee, nor a PID this machine's /proc does not show: in a container nvidia-smi may
# name PIDs of the host's namespace, which here are other processes or none.
kill_gpu_leftovers() {
  local pids="" pid mine=" $LOG_PID " p=$$
  while [ -n "$p" ] && (( p > 1 )); do
    mine="$mine$p "
    p=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$p/status" 2>/dev/null)
  done
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -dc '0-9\n'); do
    [ -d "/proc/$pid" ] && [[ "$mine" != *" $pid "* ]] && pids="$pids $pid"
  done
  pids=${pids# }
  [ -n "$pids" ] || return 0
  echo "the cut command left processes on the GPU: killing $pids"
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null
  # Until they have exited (their GPU memory freed with them), 30 s at most; a fixed 2 s assumed a quick exit.
  local alive
  for _ in $(seq 300); do
    alive=""
    for pid in $pids; do gone "$pid" || alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
}

# gpu_tests CAP NAME K: `make test-gpu` on the tests matching -k K (-s: the plan tests print their comparison;
# -rA: every test's outcome in the log's summary).
gpu_tests() {
  run_capped "$1" "$2" env TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -s -rA -k "$3" \
    --timeout=300
}

# gpu_bench CAP NAME K: `make bench-gpu` on the benchmarks matching -k K; the tables of a partial run go to
# benchmarks/results/gpu/partial/ (conftest.py), copied to $OUT (a call brings back 8 files at most).
gpu_bench() {
  mkdir -p benchmarks/results/gpu/partial
  run_capped "$1" "$2" env TRITON_INTERPRET=0 python3 -m pytest benchmarks/gpu -p no:cacheprovider -k "$3" \
    --benchmark-json="benchmarks/results/gpu/partial/$2.json"
  cp -r benchmarks/results/gpu/partial "$OUT/results-gpu" 2>/dev/null
}

# race CAP [NAME] [RUNS]: the GRPO step with vLLM against HF generate (RUNS: some of its runs, e.g. fastrlhf_hf);
# the race skips a run that would start late and gives each the time left (benchmarks/gpu/grpo.py), so that a
# cut run still leaves the other's figures.
RACE_MIN_S=${RACE_MIN_S:-240}
race() {  # without RUNS (empty), the benchmark's own (test_bench_gpu.py): both
  FASTRLHF_RACE_BUDGET_S=$1 FASTRLHF_RACE_RUNS=${3:-} gpu_bench "$1" "${2:-bench-vllm-vs-hf}" "vllm_vs_hf"
}
# Where the race's HF run came back with its figures on this machine (call 1), so that call 2 runs the vLLM one.
HF_RACED=$VPARTS/hf-raced

# The call's deadline (DEADLINE, epoch seconds: CAP after the start) shared by its parts: left prints the seconds
# before it, at most $1.
left() {
  local s=$(( DEADLINE - $(date +%s) ))
  (( s > $1 )) && s=$1
  (( s < 1 )) && s=1
  echo "$s"
}

# keep_vllm_parts: whatever part of vLLM this call carried, kept outside the checkout for a later call (any call may
# deliver one: a `bench` call carrying part-aa leaves the `vllm` call after it only part-ab to carry).
keep_vllm_parts() {
  mkdir -p "$VPARTS"
  cp .vllm-carry/part-* .vllm-carry/unpack.sh "$VPARTS"/ 2>/dev/null
  ls .vllm-carry/part-* >/dev/null 2>&1 && echo "vLLM parts kept for the next call: $(ls "$VPARTS" | tr '\n' ' ')"
  return 0
}
# vLLM 0.26.0 and the packages the image lacks, once every part is here: unpack.sh knows its parts (two, or one
# with vllm_carry.sh's HOPPER_ONLY=1) and exits 3 while one is missing; its env.sh puts them first on PYTHONPATH.
with_vllm() {
  if [ ! -f "$VSITE/env.sh" ]; then
    keep_vllm_parts
    [ -f "$VPARTS/unpack.sh" ] || { echo "vLLM: no unpack.sh yet: carry .vllm-carry/unpack.sh with a part"; return 1; }
    VSITE=$VSITE bash "$VPARTS/unpack.sh"
    case $? in
      0) ;;
      3) echo "vLLM: $VPARTS has $(ls "$VPARTS" | tr '\n' ' '); carry the other part next"; return 1 ;;
      *) echo "vLLM unpack failed"; return 1 ;;
    esac
  fi
  # shellcheck disable=SC1091
  source "$VSITE/env.sh"
  python3 -c "import vllm; print('vllm', vllm.__version__)"
}

# TRL and its imports (scripts/gpu_trl_carry.sh). The folder's name must contain "site-packages": dill, which
# `datasets` hashes with, pickles a module by value (and fails on pyarrow's) unless its file is under sys.prefix
# or a site-packages folder.
with_trl() {
  local site=${TRL_SITE:-/tmp/trl/site-packages}
  [ -d "$site/trl" ] || [ -f .trl-carry/trl-site.tar.xz ] \
    || { echo "no .trl-carry/trl-site.tar.xz: TRL's races are skipped"; return 0; }
  [ -d "$site/trl" ] || { mkdir -p "$site" && tar -xJf .trl-carry/trl-site.tar.xz -C "$site"; }
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site  # unset where on_device.sh sets none (set -u)
  python3 -c "import trl, datasets, pyarrow; print('trl', trl.__version__, '| datasets', datasets.__version__)"
}

case "$MODE" in
  tests)
    keep_vllm_parts
    gpu_tests "$(left "$CAP")" test-gpu "not vllm${3:+ and ($3)}"
    ;;
  vllm)
    if ! with_vllm; then
      timeout 60 python3 scripts/gpu_probe.py
      if [ -n "${2:-}" ]; then
        race "$(left "$CAP")" bench-hf fastrlhf_hf
        grep -q '"fastrlhf_hf_step_s"' benchmarks/results/gpu/partial/bench-hf.json 2>/dev/null && touch "$HF_RACED"
      fi
      exit 1
    fi
    if [ -f "$HF_RACED" ]; then
      race "$(left 240)" bench-vllm fastrlhf_vllm
    fi
    # Four runs through the launcher, about 100 s each on an H200 (2026-11-27).
    if ! gpu_tests "$(left 450)" test-gpu-vllm "${3:-vllm}"; then
      run_capped "$(left 100)" vllm-smoke python3 .gpu-carry/vllm_smoke.py --eager
    fi
    # The race (its vLLM and HF runs, about 100 s each, and the model's save) only where it fits; else the
    # next call, vllm-bench, runs it.
    if [ ! -f "$HF_RACED" ]; then
      if (( $(left 600) >= RACE_MIN_S )); then
        race "$(left "$CAP")"
      else
        echo "the vLLM-vs-HF race needs ${RACE_MIN_S}s, $(left 600)s left: next call, vllm-bench"
      fi
    fi
    ;;
  vllm-bench)
    with_vllm || exit 1
    race "$(left "$CAP")"
    ;;
  trl)
    with_vllm || exit 1
    with_trl
    # The race's budget is the cap's, so that its runs (each given the time left) end before the cap: a call cut
    # by its cap writes no figures at all.
    FASTRLHF_RACE_BUDGET_S=$(left 600) FASTRLHF_RACE_RUNS=${3:-} gpu_bench "$(left 600)" bench-vllm-vs-trl \
      "vllm_vs_trl"
    if (( $(left 600) >= 200 )); then  # then the HF-engine race against TRL, where it fits
      gpu_bench "$(left 600)" bench-hf-vs-trl "grpo_step_vs_trl"
    fi
    ;;
  bench)
    keep_vllm_parts
    gpu_bench "$(left "$CAP")" bench-gpu "${3:-not vllm and not trl}"
    ;;
esac
if [ -n "$(ls -A "$FASTRLHF_RACE_TRACES" 2>/dev/null)" ]; then
  tar czf "$OUT/traces-$MODE.tgz" -C "$FASTRLHF_RACE_TRACES" . && echo "timelines: traces-$MODE.tgz"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== done $(date -u +%T)"
