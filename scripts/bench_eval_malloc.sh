#!/usr/bin/env bash
# Evaluation throughput with glibc's allocator defaults against the settings the rl-tformers
# command makes (rl_tformers.runtime.host.retain_freed_memory): the same `rl-tformers bench eval`
# in alternating processes, ROUNDS rounds (the setting is process-wide, so each process has one);
# part 1 only (--memory-kinds "").
#
#   scripts/bench_eval_malloc.sh OUT_DIR            # 2 rounds, 100 episodes, N = 10 and 50
#   ROUNDS=1 ARGS="--episodes 4 --n-envs 2 --max-episode-steps 20 --train-updates 0" scripts/bench_eval_malloc.sh /tmp/m
#
# Writes OUT_DIR/eval_<setting>_r<round>.json (setting: glibc, retained) and prints each run's table.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools.sh
source scripts/tools.sh
out=${1:?usage: scripts/bench_eval_malloc.sh OUT_DIR}
# glibc's own variables would keep its settings in both processes (retain_freed_memory)
unset MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_ MALLOC_TOP_PAD_ GLIBC_TUNABLES
mkdir -p "$out"
# shellcheck disable=SC2086
for r in $(seq 1 "${ROUNDS:-2}"); do
  for setting in glibc retained; do
    m=""; [ "$setting" = glibc ] && m=system
    echo "== round $r: $setting"
    RL_TFORMERS_MALLOC=$m "$RLT" bench eval ${ARGS:---episodes 100 --n-envs 10,50 --profile} \
        --memory-kinds "" --out "$out/eval_${setting}_r$r.json"
  done
done
