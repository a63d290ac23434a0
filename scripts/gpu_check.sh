#!/usr/bin/env bash
# GPU check: on a machine with one CUDA GPU, in under 8 minutes (per-step limits: 445 s in all),
#   1. the CUDA tests (pytest -m cuda),
#   2. the training-throughput benchmark (rl-tformers bench train --device cuda): updates/s of
#      ours (the shipped DT config, the peers' exact model), + bf16 autocast, + torch.compile,
#      + dropout also on the FFN hidden layer, against d3rlpy's DecisionTransformer on the same
#      GPU when a peer interpreter imports it (and Hugging Face's when it imports transformers),
#   3. sampling with the dataset on the GPU (rl-tformers bench data --device-sampling cuda):
#      DT windows and GTrXL segments of a synthetic 1M-step Hopper-shaped file gathered on the
#      GPU against the host samplers plus the batch copy, batches compared,
#   4. short trainings of the shipped DT config with the trainer's GPU options
#      (scripts/gpu_train_options.py): fp32 with host batches, train.data_on_device=true,
#      + train.amp=bf16, + train.compile=true, + train.cuda_graphs=true (the last two need Triton),
#   5. the attention-scaling benchmark (rl-tformers bench attention --device cuda),
# each under its own time limit.
#
# Runs from the source checkout: the repository root is put first on PYTHONPATH (rl_tformers
# maps its agents/, envs/ and configs/ itself), so nothing needs installing when the interpreter
# has the dependencies. On an offline machine whose Python lacks them, carry the wheels made by
# scripts/device_wheels.sh in .whl/: they are installed (no index, no dependency resolution)
# into $SITE (default /tmp/rlt-site) and .whl/peer/ into $PEER_SITE (default /tmp/rlt-peer-site);
# the d3rlpy peer is then this same interpreter, through a small wrapper that puts $PEER_SITE
# (gymnasium 1.0.0, d3rlpy's pin) before $SITE on its PYTHONPATH. PEER_PYTHON=... or an existing
# .bench-venvs/peers take precedence. On the device, from the repository root, .whl carried:
#
#   scripts/gpu_check.sh "$OUT"
#
# Usage: scripts/gpu_check.sh OUT_DIR     (PYTHON=... to choose the interpreter, WHEELS=... the
#        wheel folder, default .whl). Exit code: 0 when every step succeeded, 1 otherwise.
# OUT_DIR gets at most seven files: summary.txt (environment, each step's exit code and time, the
# benchmark tables), bench_train.json, bench_data_device.json, train_options.json,
# bench_attention.json, bench_attention.png, and gpu_check.tar.gz with every log (pip, pytest +
# its JUnit XML, every step's stdout/stderr, nvidia-smi, environment.json), rewritten after every
# step so a run cut short still has them.
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$PWD
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
SITE=${SITE:-/tmp/rlt-site}
PEER_SITE=${PEER_SITE:-/tmp/rlt-peer-site}
WHEELS=${WHEELS:-.whl}

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PY=$(command -v "$PY") || { echo "no interpreter $PY"; exit 1; }
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # absolute: the peer wrapper runs it from another folder
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

pack() {  # every log so far into OUT/gpu_check.tar.gz
  tar -czf "$OUT/gpu_check.tar.gz.part" -C "$LOGS" . && mv "$OUT/gpu_check.tar.gz.part" "$OUT/gpu_check.tar.gz"
}

run_step() {  # run_step NAME LIMIT_S COMMAND...: output in LOGS/NAME.log, exit code in summary.txt
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || { status=1; tail -n 20 "$LOGS/$name.log"; }
  pack
  return $rc
}

install_wheels() {  # install_wheels SITE WHEEL...: no index, no dependency resolution; unzipped without pip
  local site=$1
  shift
  if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"
  else
    mkdir -p "$site" && for w in "$@"; do "$PY" -m zipfile -e "$w" "$site" || return 1; done
  fi
}

# 0. dependencies: the carried wheels when this interpreter lacks them
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
EXTRA_SITE=""  # the site of the carried run-time wheels, when they were installed
DEPS="import gymnasium, mujoco, minari, omegaconf, stable_baselines3, sb3_contrib"
if ! "$PY" -c "$DEPS" > /dev/null 2>&1 && compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "installing $WHEELS/*.whl into $SITE"
  install_wheels "$SITE" "$WHEELS"/*.whl > "$LOGS/pip.log" 2>&1 \
    || { echo "installing the wheels failed" | tee -a "$SUMMARY"; cat "$LOGS/pip.log"; }
  EXTRA_SITE=$SITE
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
fi
if ! "$PY" -c "$DEPS" >> "$LOGS/pip.log" 2>&1; then
  echo "missing dependencies: $DEPS fails with $PY (see pip.log)" | tee -a "$SUMMARY"
  status=1
fi

PEER=${PEER_PYTHON:-}
[ -z "$PEER" ] && [ -x .bench-venvs/peers/bin/python ] && PEER=.bench-venvs/peers/bin/python
if [ -z "$PEER" ] && compgen -G "$WHEELS/peer/*.whl" > /dev/null; then
  echo "installing $WHEELS/peer/*.whl into $PEER_SITE"
  install_wheels "$PEER_SITE" "$WHEELS"/peer/*.whl >> "$LOGS/pip.log" 2>&1 \
    || echo "installing the peer wheels failed" | tee -a "$SUMMARY"
  # the bench starts its peers without our PYTHONPATH: the wrapper sets the peer's own
  PEER="$LOGS/peer-python"
  printf '#!/bin/sh\nPYTHONPATH=%q exec %q "$@"\n' "$PEER_SITE${EXTRA_SITE:+:$EXTRA_SITE}" "$PY" > "$PEER"
  chmod +x "$PEER"
fi
PEERS=()
if [ -n "$PEER" ]; then
  for peer in d3rlpy:d3rlpy hf:transformers; do
    if env -u PYTHONPATH "$PEER" -c "import ${peer#*:}" >> "$LOGS/pip.log" 2>&1; then PEERS+=("${peer%%:*}"); fi
  done
fi
PEER_LIST=$(IFS=,; echo "${PEERS[*]}")
PEER_ARGS=(--peers "$PEER_LIST")
[ -n "$PEER_LIST" ] && PEER_ARGS+=(--peer-python "$PEER")

"$PY" - > "$LOGS/environment.json" 2>> "$LOGS/pip.log" <<EOF
import importlib.metadata as md, json, os, platform
import torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({
    "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "python": platform.python_version(), "executable": "$PY", "cpu_count": os.cpu_count(),
    "pythonpath": os.environ.get("PYTHONPATH"), "peer_python": "$PEER" or None, "peers": "$PEER_LIST",
    "packages": {n: version(n) for n in ("numpy", "gymnasium", "mujoco", "minari", "stable-baselines3", "omegaconf")},
}, indent=2))
EOF
cat "$LOGS/environment.json" | tee -a "$SUMMARY"
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1 || true
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: nothing to check" | tee -a "$SUMMARY"
  pack
  exit 1
fi

# 1. CUDA tests (the addopts' "-m 'not slow'" is replaced by "-m cuda"; a module that fails to
#    collect fails the step but does not stop the others' CUDA tests)
run_step cuda-tests 90 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors \
  --junitxml "$LOGS/cuda-tests.xml"
tail -n 3 "$LOGS/cuda-tests.log" >> "$SUMMARY"

# 2. training throughput: the Hopper dataset of the data layer if it is here, else a synthetic
#    Hopper-shaped D4RL file (throughput does not depend on the data's values), outside OUT_DIR
DATA=$("$PY" -c "from rl_tformers.envs.loaders import data_root; print(data_root() / 'rlt/hopper-v5/medium-v0')")
if [ -d "$DATA" ]; then
  DATASET=rlt/hopper-v5/medium-v0
else
  DATASET=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-data.XXXXXX")/hopper-synthetic.hdf5  # hopper*: Hopper-v5's bounds
  "$PY" -c "from pathlib import Path; from rl_tformers.bench.data import write_synthetic_d4rl; \
write_synthetic_d4rl(Path('$DATASET'), 200_000)"
fi
COMPILE=(--compile)  # torch.compile on CUDA needs Triton (installed with CUDA torch, too big to carry)
NO_COMPILE=()
if ! "$PY" -c "import triton" > /dev/null 2>&1; then
  COMPILE=()
  NO_COMPILE=(--no-compile)
  echo "bench-train, train-options: no compile / CUDA-graph rows (triton does not import)" | tee -a "$SUMMARY"
fi
run_step bench-train 150 "$PY" -m rl_tformers.cli bench train --device cuda --dataset "$DATASET" \
  "${PEER_ARGS[@]}" --bf16 "${COMPILE[@]}" --ffn-dropout-row --repeats 3 --steps 50 --warmup 20 \
  --matmul-sizes 2048,4096,8192 --out "$OUT/bench_train.json"
{ echo "-- bench train (peers: ${PEER_LIST:-none})"; tail -n 40 "$LOGS/bench-train.log"; } >> "$SUMMARY"

# 3. the dataset on the GPU: host vs on-device sampling of a 1M-step file (written, not timed)
run_step bench-data-device 40 "$PY" -m rl_tformers.cli bench data --device-sampling cuda --steps 1000000 \
  --out "$OUT/bench_data_device.json"
{ echo "-- bench data --device-sampling cuda"; tail -n 6 "$LOGS/bench-data-device.log"; } >> "$SUMMARY"

# 4. the trainer's GPU options, 300 updates each (variants past 70 s are skipped and listed)
run_step train-options 90 "$PY" scripts/gpu_train_options.py --dataset "$DATASET" --device cuda --steps 300 \
  --log-every 50 --budget-s 70 "${NO_COMPILE[@]}" --out "$OUT/train_options.json"
{ echo "-- train options (updates/s)"; grep -v "^warning" "$LOGS/train-options.log" | tail -n 8; } >> "$SUMMARY"

# 5. attention scaling: dense SDPA against the efficient kernels
run_step bench-attention 75 "$PY" -m rl_tformers.cli bench attention --device cuda \
  --kinds sdpa,local,sliding_window,longformer,bigbird,performer,linformer,lsh,rfa \
  --lengths 1024,4096,16384 --repeats 2 --time-budget-s 2 --memory-budget-gb 60 --threads 0 \
  --out "$OUT/bench_attention.json" --plot "$OUT/bench_attention.png"
{ echo "-- bench attention"; tail -n 40 "$LOGS/bench-attention.log"; } >> "$SUMMARY"

pack
echo "results in $OUT (summary.txt, bench_*.json, bench_attention.png, gpu_check.tar.gz with the logs)"
exit $status
