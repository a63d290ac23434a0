#!/usr/bin/env bash
# GPU check (issue 9): on a machine with one CUDA GPU, in under 8 minutes,
#   1. the CUDA tests (pytest -m cuda),
#   2. the training-throughput benchmark (rl-tformers bench train --device cuda: ours = the
#      shipped DT config, the peers' exact model; + bf16 autocast; + torch.compile; with dropout
#      also on the FFN hidden layer; d3rlpy / Hugging Face too when a peer environment exists:
#      $PEER_PYTHON or .bench-venvs/peers),
#   3. the attention-scaling benchmark (rl-tformers bench attention --device cuda),
# each under its own time limit, writing JSON, logs and a summary into OUT_DIR.
#
# Usage: scripts/gpu_check.sh OUT_DIR          (PYTHON=... to choose the interpreter)
# Exit code: 0 when every step succeeded, 1 otherwise (see OUT_DIR/summary.txt).
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
: > "$OUT/summary.txt"
status=0

run_step() {  # run_step NAME LIMIT_S COMMAND...: output in OUT/NAME.log, exit code in summary.txt
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || { status=1; tail -n 20 "$OUT/$name.log"; }
}

"$PY" - > "$OUT/environment.json" <<'EOF'
import json, os, platform
import torch
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "python": platform.python_version(), "cpu_count": os.cpu_count(),
}, indent=2))
EOF
cat "$OUT/environment.json"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: nothing to check" | tee -a "$OUT/summary.txt"
  exit 1
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# 1. CUDA tests (the addopts' "-m 'not slow'" is replaced by "-m cuda")
run_step cuda-tests 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml "$OUT/cuda-tests.xml"

# 2. training throughput: the Hopper dataset of the data layer if it is here, else a synthetic
#    Hopper-shaped D4RL file (throughput does not depend on the data's values)
DATA=data/minari/rlt/hopper-v5/medium-v0
if [ -d "$DATA" ]; then
  DATASET=rlt/hopper-v5/medium-v0
else
  DATASET="$OUT/hopper-synthetic.hdf5"
  "$PY" -c "from pathlib import Path; from rl_tformers.bench.data import write_synthetic_d4rl; \
write_synthetic_d4rl(Path('$DATASET'), 200_000)"
fi
PEER_ARGS=(--peers "")
PEER=${PEER_PYTHON:-}
[ -z "$PEER" ] && [ -x .bench-venvs/peers/bin/python ] && PEER=.bench-venvs/peers/bin/python
[ -n "$PEER" ] && PEER_ARGS=(--peers d3rlpy,hf --peer-python "$PEER")
run_step bench-train 200 "$PY" -m rl_tformers.cli bench train --device cuda --dataset "$DATASET" \
  "${PEER_ARGS[@]}" --bf16 --compile --ffn-dropout-row --repeats 5 --steps 50 --warmup 20 --matmul-sizes 2048,4096,8192 \
  --out "$OUT/bench_train.json"

# 3. attention scaling (issue 7's benchmark): dense SDPA against the efficient kernels
run_step bench-attention 150 "$PY" -m rl_tformers.cli bench attention --device cuda \
  --kinds sdpa,local,sliding_window,longformer,bigbird,performer,linformer,lsh,rfa \
  --lengths 1024,4096,16384 --repeats 3 --time-budget-s 5 --memory-budget-gb 60 --threads 0 \
  --out "$OUT/bench_attention.json" --plot "$OUT/bench_attention.png"

echo "results in $OUT (summary.txt, *.json, *.log)"
exit $status
