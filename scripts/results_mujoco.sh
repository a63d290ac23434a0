#!/usr/bin/env bash
# The converged MuJoCo results (docs/results.md, "Converged Hopper"): the paper's DT (128 dims,
# 3 layers, 1 head, K = 20, its optimiser and warmup), BC and %BC, 3 seeds each, 20k updates,
# evaluated every 2k updates (10 episodes, 10 vector environments) so every run's learning
# curve is in its metrics.jsonl; bf16 autocast on the CPU (train.amp=bf16), one thread per run.
# TASK picks the task: hopper (the default), walker2d or halfcheetah.
#
#   scripts/results_mujoco.sh                       # every Hopper row, most telling first
#   scripts/results_mujoco.sh medium-expert         # one dataset
#   TASK=walker2d scripts/results_mujoco.sh         # the Walker2d rows
#   ALGOS="bc bc10" PEERS=0 scripts/results_mujoco.sh   # some of the algorithms (dt, bc, bc10), no peers
#   OUT=/tmp/r DOC=/tmp/d SEEDS=0 BUDGET="train.steps=40 eval.every=20" scripts/results_mujoco.sh medium   # a dry run
#
# Each row is one `rl-tformers sweep` over seeds 0-2 (JOBS=2: two seeds at a time): running the script again skips finished
# runs and resumes interrupted ones from their last checkpoint (every 2k updates), so it can be
# stopped and restarted at will. The datasets are the version 1 recipes (docs/data.md):
#   rl-tformers collect --recipe hopper-medium --recipe hopper-expert --recipe hopper-medium-expert --recipe hopper-medium-replay
# (walker2d-... and halfcheetah-... for the other tasks).
# Then d3rlpy's IQL and CQL on the same data (the peers' environment, PEERS=0 to leave them out).
# Results: runs/results-v1/<algo>-<task>-<dataset>/ (results.json, curves.json, curves.png);
# the per-run JSON and the curves are copied to docs/results/<task>-v1/, and the figure of
# every row's curves is docs/results/<task>-v1/curves.png.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
OUT=${OUT:-runs/results-v1}
TASK=${TASK:-hopper}
case $TASK in hopper|walker2d|halfcheetah) ;; *) echo "error: TASK=$TASK: one of hopper, walker2d, halfcheetah" >&2; exit 2 ;; esac
DOC=${DOC:-docs/results/$TASK-v1}
SEEDS=${SEEDS:-0,1,2}
B=${BUDGET:-"train.steps=20000 eval.every=2000 eval.episodes=10 eval.n_envs=10 train.checkpoint_every=2000 train.amp=bf16 device=cpu"}
# $EXTRA: more overrides for every run (dataset.root=DIR when the datasets are elsewhere)
if [ $# -eq 0 ]; then set -- medium-expert medium-replay medium; fi
mkdir -p "$DOC"
for l in "$@"; do
  L=${l//-/_}
  for a in ${ALGOS:-dt bc bc10}; do
    case $a in
      dt) cfg=dt/${TASK}_$L ;;
      bc) cfg=bc/${TASK}_$L ;;
      bc10) cfg=bc/${TASK}_${L}_top10 ;;
    esac
    d=$OUT/$a-$TASK-$l
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$RLT" sweep -c "$cfg" --seeds "$SEEDS" --jobs "${JOBS:-1}" --threads 1 --out "$d" $B ${EXTRA:-}
    cp "$d/results.json" "$DOC/$a-$TASK-$l.json"
    [ -f "$d/curves.json" ] && cp "$d/curves.json" "$DOC/$a-$TASK-$l.curves.json"
  done
  # the peers' offline-RL baselines on the same data, budget and evaluation episodes: d3rlpy's
  # IQL and CQL with its reproduction settings (CQL's conservative weight: 10 on medium, else 5)
  if [ "${PEERS:-1}" = 1 ]; then
    if [ -x .bench-venvs/peers/bin/python ]; then
      w=5; [ "$l" = medium ] && w=10
      steps=$(sed -n 's/.*train.steps=\([0-9]*\).*/\1/p' <<< "$B")
      OMP_NUM_THREADS=1 "$PY" -m rl_tformers.bench.crosscheck --dataset "rlt/$TASK-v5/$l-v1" --algos iql,cql \
          --seeds "$SEEDS" \
          --steps "$steps" --episodes 10 --conservative-weight "$w" --work "$OUT/peers-$TASK-$l" \
          --out "$DOC/peers-$TASK-$l.json" ${PEER_ARGS:-}
    else
      echo "peers: no .bench-venvs/peers (rl-tformers bench train --build-peers); IQL and CQL not run" >&2
    fi
  fi
done
"$PY" scripts/results_curves.py "$DOC" --out "$DOC/curves.png"
