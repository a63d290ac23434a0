"""Step-indexed torch pipeline: batches are a pure function of (seed, step), for any num_workers."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import load_d4rl_hdf5, save_d4rl_hdf5
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset, make_dataloader


def small_dataset(n=400, seed=0):
    rng = np.random.default_rng(seed)
    term = np.zeros(n)
    term[np.sort(rng.choice(n - 1, size=12, replace=False))] = 1
    term[-1] = 1
    return EpisodeDataset.from_flags(rng.normal(size=(n, 5)).astype(np.float32),
                                     rng.uniform(-1, 1, size=(n, 2)).astype(np.float32), rng.normal(size=n), term,
                                     action_space=gym.spaces.Box(-1, 1, (2,), np.float32))


def collect(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_item_is_the_sampler_batch_of_rng_seed_step():
    sampler = WindowSampler(small_dataset(), 8)
    ds = StepBatchDataset(sampler, 4, seed=3, num_steps=10)
    want = sampler.sample(4, np.random.default_rng([3, 7]))
    got = ds[7]
    for k, v in want.items():
        np.testing.assert_array_equal(got[k].numpy(), v)
    assert got["observations"].dtype == torch.float32 and got["mask"].dtype == torch.bool
    with pytest.raises(IndexError):
        ds[10]


def test_two_workers_give_the_same_batches_as_none():
    sampler = WindowSampler(small_dataset(), 8)
    serial = collect(make_dataloader(sampler, 4, seed=1, num_steps=6))
    parallel = collect(make_dataloader(sampler, 4, seed=1, num_steps=6, num_workers=2))
    assert_same(serial, parallel)
    assert not torch.equal(serial[0]["observations"], serial[1]["observations"])


def test_resume_from_step_gives_the_tail_of_an_uninterrupted_run():
    sampler = SegmentSampler(small_dataset(), 6, burn_in=2)
    full = collect(make_dataloader(sampler, 3, seed=9, num_steps=8))
    tail = collect(make_dataloader(sampler, 3, seed=9, num_steps=8, start_step=5))
    assert_same(full[5:], tail)


def test_lazy_hdf5_dataset_with_two_workers_matches_in_memory(tmp_path):
    mem = small_dataset()
    path = save_d4rl_hdf5(mem, tmp_path / "d.hdf5")
    lazy = load_d4rl_hdf5(path, lazy=True)
    assert lazy.is_lazy
    mem_batches = collect(make_dataloader(WindowSampler(mem, 8), 4, seed=2, num_steps=5))
    lazy_batches = collect(make_dataloader(WindowSampler(lazy, 8), 4, seed=2, num_steps=5, num_workers=2))
    assert_same(mem_batches, lazy_batches)
