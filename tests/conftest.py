"""Shared test fixtures: deterministic seeds, ../shared/ discovery, CUDA skipping."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.datafiles import write_cartpole_h5
from tests.runs import cartpole_dt_run, no_evaluation, pendulum_dt_run, tiny_dt_run  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("RL_TFORMERS_SHARED", REPO.parent / "shared"))

# rl-tformers' cache folder (the cpu_matmul: auto measurements) is a temporary folder of the
# session, set before collection (test modules resolve auto when imported) and inherited by the
# processes the tests start: no test reads or writes the user's ~/.cache/rl-tformers.
_CACHE_DIR = tempfile.TemporaryDirectory(prefix="rlt-cache-")
os.environ["RL_TFORMERS_CACHE_DIR"] = _CACHE_DIR.name

# Tiny test tensors run fastest on one thread (no pool overhead, no contention on 2-core CI).
torch.set_num_threads(1)

# RL_TFORMERS_PLUGINS=my_attn[,other]: import these modules before collection, so the contract
# suite (tests/contracts) checks the kinds they register too (docs/backbone.md, "Your own kind").
if os.environ.get("RL_TFORMERS_PLUGINS"):
    from rl_tformers.runtime.plugins import load_plugins

    load_plugins(os.environ["RL_TFORMERS_PLUGINS"].split(","), "RL_TFORMERS_PLUGINS")


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _minari_root_per_test(tmp_path_factory, monkeypatch):
    """Minari's own root (where `rl-tformers collect` writes by default) is a fresh temporary
    folder in every test: no test reads or writes the user's ~/.minari/datasets."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path_factory.mktemp("minari_root")))
    yield


@pytest.fixture
def shared_dir() -> Path:
    """../shared/ (pretrained policies); tests using it skip with a reason when it is absent."""
    if not (SHARED / "policies").is_dir():
        pytest.skip(f"needs ../shared/policies (not found at {SHARED}); set RL_TFORMERS_SHARED to point at it")
    return SHARED


@pytest.fixture
def cartpole_h5():
    """``cartpole_h5(path, *, n=30, seed=0, reward=1.0) -> path``: a CartPole-shaped D4RL file."""
    return write_cartpole_h5


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
