"""Minari datasets opened lazily: counts from the metadata, only the episodes asked for are read,
the same draws as Minari's own sampling, and the same training batches as the full read."""

from __future__ import annotations

import json
import re
import warnings

import h5py
import minari
import numpy as np
import pytest
from minari.data_collector import EpisodeBuffer
from minari.dataset._storages.hdf5_storage import HDF5Storage
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.loaders import load_minari, minari_root, open_minari
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset

from tests.envs.test_loaders import ACT, buffers, make_minari


@pytest.fixture
def read_counter(monkeypatch):
    """The episode ids Minari's HDF5 reader is asked for, in order."""
    asked: list[int] = []
    original = HDF5Storage.get_episodes

    def counting(self, episode_indices):
        for i in episode_indices:
            asked.append(int(i))
            yield from original(self, [i])

    monkeypatch.setattr(HDF5Storage, "get_episodes", counting)
    return asked


def test_open_minari_counts_come_from_the_metadata_and_no_episode_is_read(tmp_path, read_counter):
    make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5, 3, 6, 1]))
    eps = open_minari("test/many-v0", root=tmp_path)
    assert (eps.num_episodes, eps.num_steps, len(eps)) == (6, 21, 6)
    assert eps.metadata.dataset_id == "test/many-v0"
    assert read_counter == []


def test_sample_episodes_draws_as_minari_does_and_reads_only_those(tmp_path, read_counter):
    bufs = buffers([4, 2, 5, 3, 6, 1, 7, 2])
    md = make_minari(tmp_path, "test/many-v0", bufs)
    md.set_seed(11)
    theirs = list(md.sample_episodes(3))
    read_counter.clear()
    ours = open_minari("test/many-v0", root=tmp_path).sample_episodes(3, np.random.default_rng(11))
    ids = [int(e.id) for e in theirs]
    assert read_counter == ids
    assert ours.lengths.tolist() == [len(bufs[i].rewards) for i in ids]
    for j, (ep, i) in enumerate(zip(theirs, ids)):
        mine = ours.episode(j)
        np.testing.assert_array_equal(mine.observations, ep.observations[:-1])
        np.testing.assert_array_equal(mine.final_observation, ep.observations[-1])
        np.testing.assert_array_equal(mine.actions, bufs[i].actions)
        np.testing.assert_array_equal(mine.rewards, bufs[i].rewards)
        assert bool(mine.terminations[-1]) == (i % 2 == 0) and bool(mine.truncations[-1]) == (i % 2 == 1)


def test_episodes_reads_the_ids_given_in_their_order(tmp_path, read_counter):
    bufs = buffers([4, 2, 5, 3])
    make_minari(tmp_path, "test/many-v0", bufs)
    ds = open_minari("test/many-v0", root=tmp_path).episodes([3, 0])
    assert read_counter == [3, 0]
    assert ds.lengths.tolist() == [3, 4]
    np.testing.assert_array_equal(ds.episode(0).actions, bufs[3].actions)


@pytest.mark.parametrize("bad", [-1, 4])
def test_episodes_refuses_an_id_outside_the_dataset(tmp_path, bad):
    make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5, 3]))
    with pytest.raises(IndexError, match=f"episode {bad} out of range for 4 episodes"):
        open_minari("test/many-v0", root=tmp_path).episodes([0, bad])


def test_sample_episodes_refuses_more_episodes_than_the_dataset_holds(tmp_path):
    make_minari(tmp_path, "test/many-v0", buffers([4, 2]))
    with pytest.raises(ValueError, match="cannot sample 3 distinct episodes from 2"):
        open_minari("test/many-v0", root=tmp_path).sample_episodes(3, np.random.default_rng(0))


def test_a_malformed_episode_read_alone_is_named_by_its_minari_id(tmp_path):
    bufs = buffers([4, 2, 5, 3])
    bufs[2].rewards[1] = float("nan")
    make_minari(tmp_path, "test/many-v0", bufs)
    eps = open_minari("test/many-v0", root=tmp_path)
    assert eps.episodes([0, 1, 3]).num_episodes == 3  # the others read fine
    with pytest.raises(DatasetError) as info:
        eps.episodes([1, 2])
    assert (info.value.field, info.value.episode, info.value.step) == ("rewards", 2, 1)
    assert "rewards: episode 2, step 1" in str(info.value) and "many-v0" in str(info.value)


def test_load_refuses_a_total_steps_the_episodes_do_not_hold(tmp_path):
    md = make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5]))
    meta_path = md.storage.data_path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["total_steps"] = 12
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match="total_steps=12 but the 3 episodes hold 11 steps") as info:
        load_minari("test/many-v0", root=tmp_path)
    assert info.value.field == "total_steps"



@pytest.mark.parametrize(("key", "value"), [("total_episodes", 2.5), ("total_episodes", -1), ("total_episodes", "3"),
                                            ("total_episodes", None), ("total_steps", -4), ("total_steps", "x"),
                                            ("total_steps", 1e30), ("total_steps", True)])
def test_open_minari_refuses_metadata_counts_that_are_not_whole_numbers(tmp_path, key, value):
    md = make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5]))
    meta_path = md.storage.data_path / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta[key] = value
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DatasetError, match=re.escape(f"metadata.json {key}={value!r} is not a count")) as info:
        open_minari("test/many-v0", root=tmp_path)
    assert info.value.field == key


def test_a_main_data_file_that_is_a_directory_is_named_in_one_line(tmp_path):
    md = make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5]))
    data = md.storage.data_path / "main_data.hdf5"
    data.unlink()
    data.mkdir()
    episodes = open_minari("test/many-v0", root=tmp_path)
    with pytest.raises(DatasetError) as info:
        episodes.episodes([0])
    assert str(info.value) == f"{data}: a directory; a Minari dataset keeps its episodes in this HDF5 file"
    assert info.value.field == "main_data.hdf5"

def _minari_eager(path) -> EpisodeDataset:
    """Every episode through Minari's own ``iterate_episodes``, built as one dataset."""
    md = minari.MinariDataset(path)
    eps = [{"observations": e.observations, "actions": e.actions, "rewards": e.rewards,
            "terminations": e.terminations, "truncations": e.truncations} for e in md.iterate_episodes()]
    return EpisodeDataset.from_episodes(eps, observation_space=md.observation_space, action_space=md.action_space)


def test_training_batches_from_load_minari_are_those_of_minaris_own_reader(tmp_path):
    md = make_minari(tmp_path, "test/many-v0", buffers([9, 3, 12, 7, 5, 11, 2, 8], seed=4))
    ref = _minari_eager(md.storage.data_path)
    ds = load_minari("test/many-v0", root=tmp_path)
    for key in ("observations", "actions", "rewards", "terminations", "truncations", "starts", "lengths",
                "final_observations"):
        a, b = getattr(ds, key), getattr(ref, key)
        assert a.dtype == b.dtype and np.array_equal(a, b), key
    for make in (lambda d: WindowSampler(d, 4, reward_scale=10.0), lambda d: SegmentSampler(d, 5, burn_in=2)):
        theirs, mine = (StepBatchDataset(make(d), 6, seed=3, num_steps=4) for d in (ref, ds))
        for s in range(4):
            for key, value in theirs[s].items():
                assert np.array_equal(mine[s][key].numpy(), value.numpy()), (s, key)


def test_open_minari_flattens_dict_observations_of_the_episodes_it_reads(tmp_path):
    import gymnasium as gym

    space = gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,), np.float32), "b": gym.spaces.Discrete(3)})
    n = 3
    buf = EpisodeBuffer(id=0, observations={"a": np.zeros((n + 1, 2), np.float32), "b": np.array([0, 1, 2, 1])},
                        actions=np.zeros((n, 2), np.float32), rewards=[1.0] * n, terminations=[False, False, True],
                        truncations=[False] * n)
    with minari_root(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        minari.create_dataset_from_buffers("test/dict-v0", [buf], observation_space=space, action_space=ACT,
                                           algorithm_name="t", author="t", author_email="t", code_permalink="t",
                                           description="t")
    ds = open_minari("test/dict-v0", root=tmp_path, flatten_observations=True).episodes([0])
    assert ds.observations.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]
    assert ds.final_observations.tolist() == [[0, 0, 0, 1, 0]]


def test_load_names_the_dataset_folder_of_a_malformed_episode(tmp_path):
    md = make_minari(tmp_path, "test/many-v0", buffers([4, 2, 5]))
    with h5py.File(md.storage.data_path / "main_data.hdf5", "a") as f:
        rewards = f["episode_1/rewards"][()]
        rewards[1] = np.nan
        del f["episode_1/rewards"]
        f["episode_1/rewards"] = rewards
    with pytest.raises(DatasetError, match=re.escape(f"{md.storage.data_path}: ")) as info:
        load_minari("test/many-v0", root=tmp_path)
    assert info.value.episode == 1 and info.value.field == "rewards"
