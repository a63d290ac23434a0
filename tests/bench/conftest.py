"""Fixtures of the benchmark plumbing tests: a small Pendulum dataset on disk, one torch thread."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def pendulum_hdf5(tmp_path_factory):
    """6 Pendulum-v1 episodes of 200 steps (scripted delayed expert) as a D4RL-layout file."""
    from rl_tformers.agents.common.scripted import collect_delayed_expert
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    ds = collect_delayed_expert(6, seed=0, n_envs=6)
    return save_d4rl_hdf5(ds, tmp_path_factory.mktemp("data") / "pendulum.hdf5")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # the benchmarks set their own thread count
