#!/usr/bin/env bash
# Download into .whl/ the wheels that an offline GPU machine needs to run this package from the
# source checkout (scripts/gpu_check.sh), for CPython 3.12 on manylinux x86-64, one version each:
#   .whl/*.whl       the run-time dependencies missing from that machine's image (gymnasium and
#                    MuJoCo, Minari, Stable-Baselines3 + sb3-contrib, OmegaConf...); installed
#                    with `pip install --no-index --no-deps --target SITE .whl/*.whl`
#   .whl/peer/*.whl  the d3rlpy peer of `rl-tformers bench train` with what it needs beyond that
#                    (d3rlpy pins gymnasium 1.0.0, so these go to their own SITE, put before the
#                    first one on the peer's PYTHONPATH; scripts/gpu_check.sh does that)
# The image is assumed to have Python 3.12, its own CUDA torch and the packages of IMAGE below;
# every wheel's Requires-Dist (extras aside) is checked against them and the wheels, and the
# script fails on anything missing. Hugging Face transformers (the `hf` peer) is left out for
# size; jax (Minari's `create` extra) is not needed: datasets are written without it.
#
# Usage: scripts/device_wheels.sh          (needs the package index; PYTHON=... picks the pip)
# Then carry .whl to the device and run scripts/gpu_check.sh there (its header has the command).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl

RUNTIME=(
  gymnasium==1.4.0 farama-notifications==0.0.6 imageio==2.38.2
  mujoco==4.0.1 mujoco-core==4.0.1 mujoco-studio==4.0.1 mujoco-studio-wasm==4.0.1
  websockets==17.4 glfw==2.11.0 pyopengl==3.1.10
  minari==0.5.4 stable-baselines3==2.9.2 sb3-contrib==2.9.2 omegaconf==2.4.0
)
PEER=(
  d3rlpy==2.8.1 gymnasium==1.0.0 gym-notices==0.1.0 structlog==26.1.0
  dataclasses-json==0.6.7 marshmallow==3.26.2 typing-inspect==0.9.0 mypy-extensions==1.2.0
  scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 narwhals==2.29.0
)
GYM=gym==0.26.2  # d3rlpy imports gym; PyPI has only its source, built here into a pure-Python wheel
# Packages of the GPU image (not shipped).
IMAGE="torch absl-py attrs click cloudpickle contourpy cycler filelock fonttools fsspec h5py
huggingface-hub jinja2 kiwisolver markdown-it-py matplotlib numpy packaging pandas pillow pluggy
protobuf psutil pygments pyparsing pytest pytest-timeout pytest-xdist python-dateutil pyyaml rich
safetensors scipy setuptools shellingham six tensorboard tqdm typer typing-extensions wheel grpcio
werkzeug markdown tabulate pyarrow etils colorama requests onnx onnxruntime"

PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
download() {  # download DIR REQUIREMENT...
  local dir=$1
  shift
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dir" "$@"
}

rm -rf "$DEST"
mkdir -p "$DEST/peer"
download "$DEST" "${RUNTIME[@]}"
download "$DEST/peer" "${PEER[@]}"
"$PY" -m pip wheel --quiet --no-deps --no-binary=:all: -w "$DEST/peer" "$GYM"

# Every Requires-Dist (markers evaluated for CPython 3.12 on Linux x86-64, extras skipped) must be
# met by a wheel of the same set (the peer set also sees the run-time set) or the image.
IMAGE="$IMAGE" "$PY" - "$DEST" <<'EOF'
import os, re, sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "os_name": "posix", "platform_machine": "x86_64", "extra": ""}
image = {canonicalize_name(n) for n in os.environ["IMAGE"].split()}

def wheels(folder):
    out = {}
    for w in sorted(Path(folder).glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        name = canonicalize_name(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip())
        version = re.search(r"^Version: (.+)$", meta, re.M).group(1).strip()
        reqs = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
        if name in out:
            sys.exit(f"two versions of {name} in {folder}")
        out[name] = (w, version, [r for r in reqs if r.marker is None or r.marker.evaluate(env)])
    return out

runtime = wheels(sys.argv[1])
peer = wheels(Path(sys.argv[1]) / "peer")
bad = []
for label, own, visible in (("run-time", runtime, runtime), ("peer", peer, {**runtime, **peer})):
    for name, (w, _, reqs) in own.items():
        for r in reqs:
            dep = canonicalize_name(r.name)
            if dep in visible:
                version = visible[dep][1]
                if r.specifier and not r.specifier.contains(version, prereleases=True):
                    bad.append(f"{w.name}: {r} but the {label} set has {dep} {version}")
            elif dep not in image:
                bad.append(f"{w.name}: {r} is neither in the {label} wheels nor in the image")
if bad:
    sys.exit("unmet requirements:\n  " + "\n  ".join(bad))
print(f"requirements met: {len(runtime)} run-time wheels, {len(peer)} peer wheels")
EOF

du -b "$DEST"/*.whl "$DEST"/peer/*.whl | awk '{printf "%9.2f MiB  %s\n", $1 / 1048576, $2; t += $1}
  END {printf "%9.2f MiB  total\n", t / 1048576; if (t > 40 * 1048576) {print "over 40 MiB"; exit 1}}'
