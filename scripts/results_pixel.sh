#!/usr/bin/env bash
# The pixel results row (docs/results.md, "From pixels"): the Decision Transformer, BC and %BC
# from MinAtar Breakout's frames (configs/dt/minatar_breakout.yaml, configs/bc/minatar_breakout.yaml),
# 3 seeds each, trained on the replay of a DQN learning the game here, evaluated every 1000
# updates (10 episodes, 10 vector environments); then the return-conditioning sweep of the DT's
# seed 0 and its figure. One thread per run; bf16 autocast (the configs).
#
#   scripts/results_pixel.sh                  # every run; resumable: run it again to go on
#   OUT=/tmp/r DOC=/tmp/d SEEDS=0 BUDGET="train.steps=40 eval.every=20" scripts/results_pixel.sh   # a dry run
#
# The dataset: rl-tformers collect --recipe minatar-breakout-dqn-replay (docs/data.md).
# Results: runs/results-pixel/<algo>-minatar-breakout/ (results.json, curves.json); the per-run
# JSON, the curves and the return-conditioning JSON and figure go to docs/results/pixel/.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
OUT=${OUT:-runs/results-pixel}
DOC=${DOC:-docs/results/pixel}
SEEDS=${SEEDS:-0,1,2}
TARGETS=${TARGETS:-0,2,4,6,8,10,15,20,30}
# the targets are checked here, before hours of training reach the evaluation that reads them
num='[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?'
if ! [[ $TARGETS =~ ^$num(,$num)*$ ]]; then
  echo "error: TARGETS='$TARGETS' is not a comma-separated list of numbers (target returns, e.g. 0,2,4)" >&2
  exit 2
fi
# MinAtar has no reference scores: the metric is the raw return
M=eval/return_mean
mkdir -p "$DOC"
for a in dt bc bc10; do
  case $a in
    dt) cfg=dt/minatar_breakout; extra="" ;;
    bc) cfg=bc/minatar_breakout; extra="" ;;
    bc10) cfg=bc/minatar_breakout; extra="agent.top_fraction=0.1" ;;
  esac
  d=$OUT/$a-minatar-breakout
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 "$RLT" sweep -c "$cfg" --seeds "$SEEDS" --jobs 1 --threads 1 --metric "$M" --out "$d" \
      $extra ${BUDGET:-} ${EXTRA:-}
  cp "$d/results.json" "$DOC/$a-minatar-breakout.json"
  [ -f "$d/curves.json" ] && cp "$d/curves.json" "$DOC/$a-minatar-breakout.curves.json"
done
# return conditioning of the DT's first seed: targets from no return to above the data's best (20)
s=${SEEDS%%[,-]*}  # SEEDS as sweep --seeds takes it: 0,1,2 or 0-2
R=$OUT/dt-minatar-breakout/base/seed$s
OMP_NUM_THREADS=1 "$RLT" eval "$R" --targets "$TARGETS" --episodes 10 --envs 10 --seed 0 \
    --out "$DOC/dt-minatar-breakout-s$s.rtg.json"
"$RLT" plot "$R" --from-json "$DOC/dt-minatar-breakout-s$s.rtg.json" --out "$DOC/rtg-minatar-breakout.png" --no-tensorboard
"$PY" scripts/results_curves.py "$DOC" --out "$DOC/curves.png"
