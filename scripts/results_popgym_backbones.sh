#!/usr/bin/env bash
# Which backbone helps on memory (docs/results.md, "POPGym: which backbone helps"): the same
# PPO-GTrXL run (configs/gtrxl/popgym_ppo.yaml) on POPGym tasks with one backbone swap each,
# the same environment steps, evaluations and seeds; then each variant's score, environment
# steps per second and act() milliseconds per step (rl-tformers bench act) in one table.
#
#   scripts/results_popgym_backbones.sh PositionOnlyCartPoleEasy RepeatPreviousEasy
#   VARIANTS=xl,window SEEDS=0 BUDGET="train.steps=32 eval.every=16" OUT=/tmp/r DOC=/tmp/d \
#     scripts/results_popgym_backbones.sh RepeatPreviousEasy     # a dry run
#
# Variants ($VARIANTS, comma-separated; default all):
#   xl         XL memory of 32 steps, sdpa attention, xl_relative positions (the config as it is;
#              the same runs as scripts/results_popgym.sh's PPO-GTrXL under the same $OUT and budget)
#   window     no memory: a plain context window of the last 32 steps, re-encoded at every step
#              (agent.window=32 backbone.memory.kind=none)
#   compressive  Rae et al. 2019: a FIFO of 16 steps and 16 slots each the mean of 2 older steps
#              (about XL's 32 keys per layer, reaching 48 steps back; mean: PPO trains no compressor)
#   performer  XL memory with FAVOR+ attention (Choromanski et al. 2021), rotary positions
#              (xl_relative applies to dot-product attention only)
#   spalm      SPALM (Yogatama et al. 2021): the XL memory and a kNN long-term store behind a gate
# Speed, measured for every variant of $VARIANTS back to back once their runs are trained (so
# under the same load): act() latency (rl-tformers bench act on the first seed's run: act.json)
# and training throughput (a run of TIMING_STEPS updates without evaluation: timing/). Both are
# kept; delete act.json and timing/ to measure again. SPEED_ONLY=1 does only that (no sweep, no
# evaluation: the variants' runs must be trained), e.g.
#   SPEED_ONLY=1 SEEDS=0 VARIANTS=xl,window,compressive,performer scripts/results_popgym_backbones.sh TASK
# Results: $OUT/gtrxl-<task> (xl) and $OUT/gtrxl-<variant>-<task> (sweeps: base/seed<N>/ with
# eval.json, the first seed's act.json, timing/); scripts/popgym_table.py --variants writes
# $DOC/backbones-<task>.json and the rows of $DOC/backbones.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
OUT=${OUT:-runs/results-popgym}
DOC=${DOC:-docs/results/popgym}
SEEDS=${SEEDS:-0,1,2}
EPISODES=${EPISODES:-20}
TIMING_STEPS=${TIMING_STEPS:-64}
VARIANTS=${VARIANTS:-xl,window,compressive,performer,spalm}
B=${BUDGET:-"train.steps=1952 eval.every=244 train.checkpoint_every=244"}
if [ $# -eq 0 ]; then set -- PositionOnlyCartPoleEasy RepeatPreviousEasy; fi
overrides() {  # the backbone swap of variant $1
  case $1 in
    xl) echo "" ;;
    window) echo "agent.window=32 backbone.memory.kind=none" ;;
    compressive) echo "backbone.memory.kind=compressive backbone.memory.mem_len=16 backbone.memory.compressed_len=16" \
                      "backbone.memory.rate=2 backbone.memory.compression=mean" ;;
    performer) echo "backbone.attention.kind=performer backbone.position.kind=rotary" ;;
    spalm) echo "backbone.memory.kind=spalm backbone.memory.mem_len=32" ;;
    *) echo "error: VARIANTS: unknown variant '$1' (xl, window, compressive, performer, spalm)" >&2; return 2 ;;
  esac
}
for v in ${VARIANTS//,/ }; do overrides "$v" > /dev/null || exit 2; done
first=${SEEDS%%[,-]*}
mkdir -p "$DOC"
for task in "$@"; do
  for v in ${VARIANTS//,/ }; do
    [ -n "${SPEED_ONLY:-}" ] && break
    d=$OUT/gtrxl-$v-$task
    [ "$v" = xl ] && d=$OUT/gtrxl-$task
    # shellcheck disable=SC2046,SC2086
    OMP_NUM_THREADS=1 "$RLT" sweep -c gtrxl/popgym_ppo --seeds "$SEEDS" --jobs 1 --threads 1 --out "$d" \
        device=cpu train.progress=false agent.env_id="popgym-$task-v0" eval.episodes="$EPISODES" $B \
        $(overrides "$v") ${EXTRA:-}
    for s in ${SEEDS//,/ }; do
      run=$d/base/seed$s
      [ -f "$run/eval.json" ] || OMP_NUM_THREADS=1 "$RLT" eval "$run" --episodes "$EPISODES" --json \
          --out "$run/eval.json" > /dev/null
    done
  done
  for v in ${VARIANTS//,/ }; do  # speed, every variant back to back
    d=$OUT/gtrxl-$v-$task
    [ "$v" = xl ] && d=$OUT/gtrxl-$task
    run=$d/base/seed$first
    [ -f "$run/act.json" ] || OMP_NUM_THREADS=1 "$RLT" bench act --run "$run" --batches 1,16 --threads 1 \
        --json --out "$run/act.json" > /dev/null
    # shellcheck disable=SC2046,SC2086
    [ -f "$d/timing/metrics.jsonl" ] || OMP_NUM_THREADS=1 "$RLT" train -c gtrxl/popgym_ppo --run-dir "$d/timing" \
        device=cpu train.progress=false agent.env_id="popgym-$task-v0" seed="$first" train.steps="$TIMING_STEPS" \
        train.log_every=16 eval.every=0 eval.at_end=false $(overrides "$v") ${EXTRA:-} > /dev/null
  done
  "$PY" scripts/popgym_table.py "$task" --out-root "$OUT" --doc "$DOC" --variants "$VARIANTS"
done
