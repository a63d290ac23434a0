"""Seeding and random-number-generator state: seed, derive, capture, restore, isolate.

Exact resume needs every global generator that training touches to continue where it stopped:
Python's ``random``, NumPy's legacy global generator, torch's CPU generator and every CUDA (and
MPS) device generator. :func:`capture_rng_state` returns them as a dict of tensors, ints, floats
and tuples only, so it goes through ``torch.load(weights_only=True)`` unchanged;
:func:`restore_rng_state` puts them back.

Batches must *not* depend on these global streams: a batch for step ``s`` is drawn from its own
generator, e.g. ``np.random.default_rng([seed, s])`` (see ``rl_tformers.runtime.agent_registry``). The
global streams only drive what happens inside a step (dropout masks, stochastic layers).

Environments get their seeds from the config through :func:`derive_seed`, e.g.
``env.reset(seed=derive_seed(cfg.seed, "eval", step))``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

#: The largest run seed: ``torch.manual_seed`` takes integers up to 2**64 - 1 (and overflows above).
MAX_SEED = 2**64 - 1


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python ``random``, NumPy's global generator, torch CPU and all CUDA devices.

    Args:
        seed: an int in ``[0, MAX_SEED]`` (NumPy takes it modulo 2**32).
        deterministic: also ask torch for deterministic kernels
            (``torch.use_deterministic_algorithms(True, warn_only=True)``, cuDNN deterministic,
            ``CUBLAS_WORKSPACE_CONFIG``). Slower on GPU; CPU training is deterministic anyway.

    Raises:
        ValueError: if ``seed`` is negative or above :data:`MAX_SEED`.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if seed > MAX_SEED:
        raise ValueError(f"seed must be <= 2**64 - 1 (the largest seed torch.manual_seed takes), got {seed}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _key_to_int(key: int | str) -> int:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"derive_seed keys must be int or str, got {type(key).__name__}")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(f"derive_seed int keys must be >= 0, got {key}")
        return key
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 32-bit seed that is a pure function of ``seed`` and ``keys`` (via NumPy's SeedSequence).

    Use it to give each consumer its own independent stream, e.g.
    ``derive_seed(cfg.seed, "eval", step)`` for the evaluation environments at ``step``, or
    ``derive_seed(cfg.seed, "collect", worker)``. String keys are hashed with SHA-256.

    Returns:
        int in ``[0, 2**32)``, accepted by ``gymnasium.Env.reset(seed=...)``,
        ``np.random.default_rng`` and ``torch.Generator.manual_seed``.
    """
    entropy = [_key_to_int(seed), *(_key_to_int(k) for k in keys)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint32)[0])


def capture_rng_state() -> dict[str, Any]:
    """Snapshot of every global generator, in types that ``torch.load(weights_only=True)`` accepts.

    Returns:
        ``{"python": tuple, "numpy": dict, "torch": ByteTensor, "cuda": list[ByteTensor] | None,
        "mps": ByteTensor | None}``.
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": None,
        "mps": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`.

    CUDA states are restored when the saved run had CUDA and this process has the same number
    of devices; otherwise they are skipped (a CPU checkpoint resumed on a GPU machine is fine,
    the device generators then start from the seed).

    Raises:
        ValueError: if ``state`` lacks one of the keys written by :func:`capture_rng_state`.
    """
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"RNG state lacks {sorted(missing)}")
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
            "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
    mps = state.get("mps")
    if mps is not None and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(mps.cpu())


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block without disturbing the global generators (state restored on exit).

    The trainer wraps evaluation in it, so how often you evaluate never changes training.
    """
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
