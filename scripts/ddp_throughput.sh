#!/usr/bin/env bash
# DDP throughput (issue 9): the shipped DT config (dt/hopper_medium, global batch 64) trained for
# STEPS updates three ways on this machine, without evaluation or checkpoints:
#   p1t1  one process, 1 intra-op thread
#   p1t2  one process, 2 intra-op threads
#   p2t1  rl-tformers train --nproc 2 (DDP over gloo, 32 rows per process, 1 thread each)
# and prints the median of the trainer's own `perf/steps_per_s` (logged every 50 updates; the
# first two windows are dropped as warm-up) with the ratios to p1t1. Needs 2 free cores and
# the dataset rlt/hopper-v5/medium-v0 (rl-tformers collect --recipe hopper-medium).
#
# Usage: scripts/ddp_throughput.sh OUT_DIR [STEPS=600] [DATASET=rlt/hopper-v5/medium-v0] [KEY=VALUE ...]
# (extra KEY=VALUE overrides go to all three runs; RLT=... chooses the rl-tformers command)
set -euo pipefail

USAGE="usage: [RLT=rl-tformers] scripts/ddp_throughput.sh OUT_DIR [STEPS=600] [DATASET=rlt/hopper-v5/medium-v0] [KEY=VALUE ...]"
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") echo "$USAGE" >&2; exit 2 ;;
  -*) echo "unknown option $1; $USAGE" >&2; exit 2 ;;
esac
OUT=$1
STEPS=${2:-600}
DATASET=${3:-rlt/hopper-v5/medium-v0}
shift $(( $# < 3 ? $# : 3 ))
EXTRA=("$@")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
RLT=${RLT:-}
if [ -z "$RLT" ]; then
  if [ -x .venv/bin/rl-tformers ]; then RLT=.venv/bin/rl-tformers; else RLT=rl-tformers; fi
fi
PY=$(dirname "$(command -v "$RLT")")/python
[ -x "$PY" ] || PY=python3

COMMON=(dataset.path="$DATASET" train.steps="$STEPS" train.log_every=50 train.checkpoint_every=0
        eval.every=0 eval.at_end=false train.progress=false ${EXTRA[@]+"${EXTRA[@]}"})
run() {  # run NAME THREADS [extra args...]
  local name=$1 threads=$2
  shift 2
  echo "== $name" >&2
  OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads \
    "$RLT" train -c dt/hopper_medium "${COMMON[@]}" run_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
}
rm -rf "$OUT/p1t1" "$OUT/p1t2" "$OUT/p2t1"
run p1t1 1
run p1t2 2
run p2t1 1 --nproc 2

"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rates = {}
for name in ("p1t1", "p1t2", "p2t1"):
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    vals = [r["perf/steps_per_s"] for r in rows if "perf/steps_per_s" in r][2:]
    if not vals:
        sys.exit(f"{name}: no perf/steps_per_s after the warm-up windows (raise STEPS)")
    rates[name] = statistics.median(vals)
result = {"updates_per_s": rates, "ratio_to_p1t1": {k: v / rates["p1t1"] for k, v in rates.items()}}
(out / "ddp_throughput.json").write_text(json.dumps(result, indent=1))
for k, v in rates.items():
    print(f"{k}: {v:.2f} updates/s ({v / rates['p1t1']:.2f}x p1t1)")
EOF
