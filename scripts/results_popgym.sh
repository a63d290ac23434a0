#!/usr/bin/env bash
# PPO-GTrXL against its recurrent peer (sb3-contrib's RecurrentPPO, LSTM 256) on POPGym tasks
# (docs/results.md, "POPGym"; needs the popgym extra: pip install 'rl-tformers[popgym]'):
# configs/gtrxl/popgym_ppo.yaml on each task, 3 seeds per agent, the same environment steps,
# PPO settings and evaluations (every eval.every PPO-GTrXL-equivalent updates, reset seeds
# eval_seed(seed, step); then EPISODES episodes with reset seeds 0, 1, ...), one thread per run.
#
#   scripts/results_popgym.sh                             # every task, 999,424 env steps per run
#   scripts/results_popgym.sh RepeatPreviousEasy          # one task
#   OUT=/tmp/r DOC=/tmp/d SEEDS=0 EPISODES=2 BUDGET="train.steps=32 eval.every=16 eval.n_envs=2" \
#     scripts/results_popgym.sh RepeatPreviousEasy        # a dry run (8,192 env steps)
#
# Tasks (POPGym's families): RepeatPreviousEasy and AutoencodeEasy (diagnostic), CountRecallEasy
# (game), PositionOnlyCartPoleEasy (control); any popgym-<Task>-v0 id's <Task> works.
# Resuming: PPO-GTrXL runs through `rl-tformers sweep`, so running the script again skips
# finished runs and resumes interrupted ones from their last checkpoint (train.checkpoint_every).
# RecurrentPPO has no checkpoints: a peer run is finished when its eval.json exists and is then
# skipped; an unfinished one (interrupted: no eval.json) is deleted and trained again from zero,
# so its metrics.jsonl never holds two runs.
# Results: $OUT/gtrxl-<task>/ (a sweep: base/seed<N>/ with eval.json) and $OUT/lstm-<task>/seed<N>/;
# scripts/popgym_table.py writes $DOC/<task>.json (every run's curve, MMER, final return, wall
# time), $DOC/<task>.png (learning curves) and $DOC/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
OUT=${OUT:-runs/results-popgym}
DOC=${DOC:-docs/results/popgym}
SEEDS=${SEEDS:-0,1,2}
EPISODES=${EPISODES:-20}
B=${BUDGET:-"train.steps=7808 eval.every=976"}
# $EXTRA: more overrides for every run of both agents (backbone.d_model=..., agent.n_envs=...)
if [ $# -eq 0 ]; then set -- RepeatPreviousEasy CountRecallEasy PositionOnlyCartPoleEasy AutoencodeEasy; fi
mkdir -p "$DOC"
for task in "$@"; do
  env_id=popgym-$task-v0
  common="agent.env_id=$env_id eval.episodes=$EPISODES $B ${EXTRA:-}"
  d=$OUT/gtrxl-$task
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 "$RLT" sweep -c gtrxl/popgym_ppo --seeds "$SEEDS" --jobs 1 --threads 1 --out "$d" \
      device=cpu train.progress=false $common
  for s in ${SEEDS//,/ }; do
    run=$d/base/seed$s
    [ -f "$run/eval.json" ] || OMP_NUM_THREADS=1 "$RLT" eval "$run" --episodes "$EPISODES" --json --out "$run/eval.json" > /dev/null
  done
  for s in ${SEEDS//,/ }; do
    run=$OUT/lstm-$task/seed$s
    if [ -f "$run/eval.json" ]; then echo "$run: finished, skipped"; continue; fi
    if [ -e "$run" ]; then echo "$run: unfinished (no eval.json), trained again from zero"; rm -rf "$run"; fi
    start=$(date +%s)
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$PY" -m rl_tformers.agents.gtrxl.recurrent_peer -c gtrxl/popgym_ppo seed="$s" run_dir="$run" \
        $common > /dev/null
    echo $(( $(date +%s) - start )) > "$run/wall_seconds"
  done
  "$PY" scripts/popgym_table.py "$task" --out-root "$OUT" --doc "$DOC"
done
