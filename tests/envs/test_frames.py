"""Pixel datasets: frames stored once as uint8, stacked when a sample is drawn, never across an
episode start; the validator's refusals of other image layouts."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetError, DatasetMetadata, EpisodeDataset
from rl_tformers.envs.frames import stack_frames
from rl_tformers.envs.loaders import load_dataset, save_d4rl_hdf5
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.envs.trajectory import ObsStats, observation_stats
from typer.testing import CliRunner

from rl_tformers.cli import app

K = 4  # frames per observation (Atari)


def frames_dataset(lengths=(3, 6), side: int = 2) -> EpisodeDataset:
    """Episodes of the given lengths whose frame at dataset row i is filled with i + 1 (so a zero
    pixel can only be padding), stored as (N, 1, side, side) uint8 with frame_stack 4."""
    n = sum(lengths)
    obs = (np.arange(n, dtype=np.uint8) + 1)[:, None, None, None] * np.ones((1, 1, side, side), np.uint8)
    term = np.zeros(n, bool)
    term[np.cumsum(lengths) - 1] = True
    return EpisodeDataset.from_flags(obs, np.zeros(n, np.int64), np.ones(n), term,
                                     metadata=DatasetMetadata(extra={"frame_stack": K}))


def stack_ids(stacks: np.ndarray) -> np.ndarray:
    """(..., K, side, side) frames -> (..., K) the row + 1 each frame holds (0: padding)."""
    return stacks[..., 0, 0]


def test_the_first_steps_of_an_episode_stack_zeros_then_its_own_frames() -> None:
    ds = frames_dataset()
    assert ds.observation_space.shape == (4, 2, 2) and ds.frame_shape == (1, 2, 2) and ds.observations.dtype == np.uint8
    flat = np.arange(9)[None, :]  # every row, (1, 9)
    steps = np.array([[0, 1, 2, 0, 1, 2, 3, 4, 5]])
    got = stack_ids(stack_frames(ds.observations, flat, steps, K))[0]  # (9, K), oldest first
    assert got.tolist() == [
        [0, 0, 0, 1], [0, 0, 1, 2], [0, 1, 2, 3],  # episode 0 (rows 0-2)
        [0, 0, 0, 4], [0, 0, 4, 5], [0, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9],  # episode 1 (rows 3-8)
    ]


def test_window_samples_stack_the_frames_of_their_own_episode_only() -> None:
    ds = frames_dataset()
    batch = WindowSampler(ds, 3).sample(64, np.random.default_rng(0))
    obs = batch["observations"]
    assert obs.shape == (64, 3, 4, 2, 2) and obs.dtype == np.uint8
    for b in range(64):
        first = int(ds.starts[batch["episode"][b]])
        for j in range(3):
            if not batch["mask"][b, j]:
                assert not obs[b, j].any()
                continue
            t = int(batch["timesteps"][b, j])
            want = [first + s + 1 if s >= 0 else 0 for s in range(t - 3, t + 1)]
            assert stack_ids(obs[b, j]).tolist() == want


def test_a_segment_across_an_episode_start_restarts_its_stacks_from_zeros() -> None:
    ds = frames_dataset()
    sampler = SegmentSampler(ds, 5)
    batch = sampler.sample(32, np.random.default_rng(1))
    crossing = np.flatnonzero(batch["episode_start"][:, 1:].any(axis=1))
    assert crossing.size  # some segment runs from episode 0 into episode 1
    for b in crossing:
        j = int(np.flatnonzero(batch["episode_start"][b])[-1])
        assert stack_ids(batch["observations"][b, j]).tolist() == [0, 0, 0, 4]  # row 3: episode 1's first frame
        if j + 1 < 5:
            assert stack_ids(batch["observations"][b, j + 1]).tolist() == [0, 0, 4, 5]


def test_pixel_batches_and_storage_stay_uint8_through_the_d4rl_file(tmp_path) -> None:
    ds = frames_dataset()
    path = save_d4rl_hdf5(ds, tmp_path / "frames.hdf5")
    with h5py.File(path) as f:
        assert f["observations"].dtype == np.uint8 and f["observations"].shape == (9, 1, 2, 2)
        assert "next_observations" not in f  # each frame once
        assert json.loads(f.attrs["rl_tformers_metadata"])["frame_stack"] == K
    for lazy in (False, True):
        back = load_dataset(path, lazy=lazy)
        assert back.frame_stack == K and back.observation_space.shape == (4, 2, 2)
        assert back.observations.dtype == np.uint8 and back.observations.shape == (9, 1, 2, 2)
        batch = StepBatchDataset(WindowSampler(back, 3), 8, seed=0, num_steps=1)[0]
        assert str(batch["observations"].dtype) == "torch.uint8" and tuple(batch["observations"].shape) == (8, 3, 4, 2, 2)
    eager = load_dataset(path)
    assert eager.observations.nbytes == 9 * 4  # 9 frames of 2x2 bytes: no stacked or float copy
    assert eager.summary()["observation_bytes"] == 36 and eager.summary()["frame_stack"] == K


def test_frame_statistics_are_never_computed_nor_applied() -> None:
    ds = frames_dataset()
    st = observation_stats(ds)
    assert st.mean.shape == (4, 2, 2) and not st.mean.any() and (st.std == 1).all()
    WindowSampler(ds, 3, obs_stats=st)  # mean 0, std 1: the frames as they are
    with pytest.raises(ValueError, match="^obs_stats: observation statistics are not applied to pixel frames"):
        WindowSampler(ds, 3, obs_stats=ObsStats(np.full((4, 2, 2), 100, np.float32), np.ones((4, 2, 2), np.float32)))


def _one_episode(obs: np.ndarray, extra: dict | None = None) -> EpisodeDataset:
    n = obs.shape[0]
    return EpisodeDataset.from_flags(obs, np.zeros(n, np.int64), np.ones(n), np.eye(1, n, n - 1, dtype=bool)[0],
                                     metadata=DatasetMetadata(extra=extra or {}))


@pytest.mark.parametrize("obs, extra, message", [
    (np.zeros((3, 1, 4, 4), np.float32), None,
     "observations: episode 0, step 0 (dataset row 0): float32 images of shape (1, 4, 4); image observations are "
     "stored as uint8 frames (0..255), not converted (a float copy is 4x the memory)"),
    (np.zeros((3, 4, 1, 4, 4), np.uint8), None,
     "observations: episode 0, step 0 (dataset row 0): rank 4 per step (4, 1, 4, 4); image observations are stored "
     "as one (C, H, W) uint8 frame per step (stack frames with frame_stack, channels first)"),
    (np.zeros((3, 4, 4), np.uint8), {"frame_stack": 4},
     "observations: episode 0, step 0 (dataset row 0): frame_stack=4 needs uint8 (C, H, W) frames, got uint8 of "
     "shape (4, 4) per step (rank 2)"),
    (np.zeros((3, 1, 4, 4), np.uint8), {"frame_stack": 0},
     "frame_stack: 0 in the metadata is not an integer in [1, 64] (frames per observation)"),
], ids=["float-images", "rank-4", "frame-stack-on-rank-2", "frame-stack-0"])
def test_other_image_layouts_are_refused_in_one_line(obs, extra, message) -> None:
    with pytest.raises(DatasetError) as exc:
        _one_episode(obs, extra)
    assert str(exc.value) == message and "\n" not in str(exc.value)
    assert exc.value.field in ("observations", "frame_stack")


@pytest.mark.parametrize("k", [65, 10**9])
def test_dataset_info_refuses_a_frame_stack_above_the_limit_before_stacking_anything(tmp_path, k) -> None:
    path = save_d4rl_hdf5(frames_dataset(), tmp_path / "frames.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs["rl_tformers_metadata"] = json.dumps({"frame_stack": k})
    r = CliRunner().invoke(app, ["dataset", "info", str(path)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: {path}: frame_stack: {k} in the metadata is not an integer in [1, 64] (frames per observation)"]


def test_dataset_info_refuses_a_file_of_float_frames_naming_field_and_episode(tmp_path) -> None:
    path = tmp_path / "float-frames.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((4, 1, 8, 8), np.float32)
        f["actions"] = np.zeros(4, np.int64)
        f["rewards"] = np.ones(4, np.float32)
        f["terminals"] = np.array([0, 0, 0, 1], bool)
        f["timeouts"] = np.zeros(4, bool)
    r = CliRunner().invoke(app, ["dataset", "info", str(path)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: {path}: observations: episode 0, step 0 (dataset row 0): float32 images of shape (1, 8, 8); image "
        "observations are stored as uint8 frames (0..255), not converted (a float copy is 4x the memory)"]
