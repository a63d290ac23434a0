"""Step-indexed torch pipeline: batches are a pure function of (seed, step), for any num_workers."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import load_d4rl_hdf5, save_d4rl_hdf5
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import DeviceSampler, DeviceStepBatches, StepBatchDataset, make_dataloader


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


# ------------------------------------------------------- the dataset on the device
def _pixel_dataset(n=300, seed=1, frame_stack=1):
    """uint8 (N, 3, 4, 4) frames (``frame_stack`` of them per observation), Discrete(4) actions,
    episodes of varying length."""
    rng = np.random.default_rng(seed)
    term = np.zeros(n)
    term[np.sort(rng.choice(n - 1, size=9, replace=False))] = 1
    term[-1] = 1
    obs = rng.integers(0, 256, size=(n, 3, 4, 4), dtype=np.uint8)
    ds = EpisodeDataset.from_flags(obs, rng.integers(0, 4, size=n), rng.normal(size=n), term,
                                   action_space=gym.spaces.Discrete(4))
    ds.metadata.extra["frame_stack"] = frame_stack  # the samplers stack frames per drawn step
    return ds


def _assert_batches_equal(want: dict, got: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == torch.from_numpy(np.ascontiguousarray(v)).dtype, k
        assert got[k].shape == v.shape, k
        assert torch.equal(got[k], torch.from_numpy(np.ascontiguousarray(v))), k


@pytest.mark.parametrize("make_sampler", [
    lambda: WindowSampler(small_dataset(), 8, reward_scale=7.0),
    lambda: WindowSampler(small_dataset(), 40, align="end", gamma=0.9),  # longer than most episodes: padding
    lambda: WindowSampler(small_dataset(), 1),  # BC: single steps
    lambda: SegmentSampler(small_dataset(), 12, burn_in=5, reward_scale=3.0),
    lambda: WindowSampler(_pixel_dataset(), 30),
    lambda: SegmentSampler(_pixel_dataset(), 50, burn_in=2),  # runs past the end of the data: padding
    lambda: WindowSampler(_pixel_dataset(frame_stack=4), 12, align="end"),
    lambda: SegmentSampler(_pixel_dataset(frame_stack=4), 20, burn_in=3),
], ids=["window", "window-end-padded", "window-k1", "segment", "pixels-window", "pixels-segment-padded",
        "stacked-pixels-window", "stacked-pixels-segment"])
def test_device_sampler_batches_equal_the_numpy_batches_of_the_same_generator(make_sampler):
    from rl_tformers.envs.trajectory import observation_stats

    sampler = make_sampler()
    if sampler.dataset.observations.dtype != np.uint8:
        sampler.obs_stats = observation_stats(sampler.dataset)  # the agents' normalisation (not of frames)
    dev = DeviceSampler(sampler, "cpu")
    for seed in range(5):
        want = sampler.sample(16, np.random.default_rng([4, seed]))
        _assert_batches_equal(want, dev.sample(16, np.random.default_rng([4, seed])))


def test_device_step_batches_are_the_dataset_batches_from_any_start_step():
    sampler = SegmentSampler(small_dataset(), 6, burn_in=2)
    steps = StepBatchDataset(sampler, 3, seed=9, num_steps=8)
    on_device = steps.on_device("cpu")
    assert isinstance(on_device, DeviceStepBatches) and len(on_device) == 8
    full = collect(on_device.iter_from(0))
    assert_same([steps[s] for s in range(8)], full)
    assert_same(full[5:], collect(on_device.iter_from(5)))
    with pytest.raises(IndexError):
        on_device[8]


def test_pixel_observations_stay_uint8_on_the_device():
    dev = DeviceSampler(WindowSampler(_pixel_dataset(), 4), "cpu")
    assert dev.observations.dtype == torch.uint8 and dev.actions.dtype == torch.int64


def test_a_device_sampler_refuses_other_samplers():
    class Other:
        def sample(self, batch_size, rng):
            return {}

    with pytest.raises(TypeError, match="not batches of a Other"):
        DeviceSampler(Other(), "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("make_sampler", [
    lambda: WindowSampler(small_dataset(), 8, reward_scale=7.0),
    lambda: SegmentSampler(small_dataset(), 12, burn_in=5, reward_scale=3.0),
    lambda: SegmentSampler(_pixel_dataset(frame_stack=4), 20, burn_in=3),
], ids=["window", "segment", "stacked-pixels-segment"])
def test_device_sampler_on_cuda_equals_the_numpy_batches(make_sampler):
    from rl_tformers.envs.trajectory import observation_stats

    sampler = make_sampler()
    if sampler.dataset.observations.dtype != np.uint8:
        sampler.obs_stats = observation_stats(sampler.dataset)
    dev = DeviceSampler(sampler, "cuda")
    for seed in range(3):
        got = dev.sample(16, np.random.default_rng([4, seed]))
        assert all(v.device.type == "cuda" for v in got.values())
        _assert_batches_equal(sampler.sample(16, np.random.default_rng([4, seed])),
                              {k: v.cpu() for k, v in got.items()})
