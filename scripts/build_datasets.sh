#!/usr/bin/env bash
# Build D4RL-style dataset suites from the pretrained policies in ../shared/policies.
#
#   scripts/build_datasets.sh                    # the Hopper suite (10 datasets, ~1.2M steps)
#   scripts/build_datasets.sh 'walker2d-*' 'halfcheetah-medium'
#
# Datasets land in the data root of `rl-tformers collect` ($RL_TFORMERS_DATA, else Minari's own
# root: $MINARI_DATASETS_PATH or ~/.minari/datasets); one JSON line per dataset (episodes,
# steps, return mean/std) is appended to <root>/recipes.jsonl.
# Extra options for `rl-tformers collect` go in $COLLECT_ARGS (e.g. "--overwrite --seed 1").
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
ROOT=$("$PY" -c 'from rl_tformers.envs.loaders import data_root; print(data_root())')
if [ $# -eq 0 ]; then set -- 'hopper-*'; fi
args=()
for pattern in "$@"; do args+=(--recipe "$pattern"); done
mkdir -p "$ROOT"
# shellcheck disable=SC2086
"$RLT" collect "${args[@]}" --root "$ROOT" --json --no-progress ${COLLECT_ARGS:-} | tee -a "$ROOT/recipes.jsonl"
