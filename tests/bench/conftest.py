"""Fixtures of the benchmark plumbing tests: a small Hopper-shaped dataset on disk, thread count restored."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_hdf5(tmp_path_factory):
    """3000 synthetic steps in D4RL layout named like a Hopper file (env Hopper-v5, 11-dim
    observations, 3-dim actions in [-1, 1], 200-step episodes with some early terminations)."""
    from rl_tformers.bench.data import write_synthetic_d4rl

    return write_synthetic_d4rl(tmp_path_factory.mktemp("data") / "hopper-synthetic.hdf5", 3000, ep_len=200)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # the benchmarks set their own thread count
