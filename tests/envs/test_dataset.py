"""EpisodeDataset: episode splitting, validation errors (field, episode, step), views, lazy arrays."""

from __future__ import annotations

import pickle

import gymnasium as gym
import h5py
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset, LazyH5Array

BOX3 = gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)


def flat(n: int, obs_dim: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, obs_dim)).astype(np.float32), rng.uniform(-1, 1, size=(n, 3)).astype(np.float32),
            rng.normal(size=n))


def test_terminals_split_into_lengths_2_1_3():
    obs, act, rew = flat(6)
    ds = EpisodeDataset.from_flags(obs, act, rew, terminals=[0, 1, 1, 0, 0, 1], action_space=BOX3)
    assert ds.num_episodes == 3
    assert ds.lengths.tolist() == [2, 1, 3]
    assert ds.starts.tolist() == [0, 2, 3]
    assert ds.num_steps == 6
    assert ds.terminations[[1, 2, 5]].all() and not ds.truncations.any()
    np.testing.assert_array_equal(ds.episode(2).observations, obs[3:6])
    np.testing.assert_allclose(ds.episode_returns, [rew[:2].sum(), rew[2], rew[3:].sum()])


def test_timeouts_every_1000_steps_give_three_episodes_of_1000():
    obs, act, rew = flat(3000)
    timeouts = np.zeros(3000, bool)
    timeouts[[999, 1999, 2999]] = True
    ds = EpisodeDataset.from_flags(obs, act, rew, terminals=np.zeros(3000), timeouts=timeouts, action_space=BOX3)
    assert ds.lengths.tolist() == [1000, 1000, 1000]
    assert ds.truncations.sum() == 3 and not ds.terminations.any()
    assert "unfinished_last_episode" not in ds.metadata.extra


def test_unfinished_last_episode_is_kept_and_marked_truncated():
    obs, act, rew = flat(5)
    ds = EpisodeDataset.from_flags(obs, act, rew, terminals=[0, 1, 0, 0, 0], action_space=BOX3)
    assert ds.lengths.tolist() == [2, 3]
    assert ds.truncations.tolist() == [False, False, False, False, True]
    assert ds.metadata.extra["unfinished_last_episode"] is True


def test_next_observations_give_final_observations():
    obs, act, rew = flat(6)
    nxt = np.roll(obs, -1, axis=0)  # observations[t + 1] inside episodes (checked)
    nxt[[1, 2, 5]] = obs[[1, 2, 5]] + 100  # the observations after each episode's last action
    ds = EpisodeDataset.from_flags(obs, act, rew, [0, 1, 1, 0, 0, 1], next_observations=nxt, action_space=BOX3)
    np.testing.assert_array_equal(ds.final_observations, nxt[[1, 2, 5]])


def test_nan_reward_at_step_1_names_rewards_and_step_1():
    obs, act, rew = flat(4)
    rew[1] = np.nan
    with pytest.raises(DatasetError) as err:
        EpisodeDataset.from_flags(obs, act, rew, terminals=[0, 0, 0, 1], action_space=BOX3)
    assert err.value.field == "rewards" and err.value.episode == 0 and err.value.step == 1
    assert "rewards" in str(err.value) and "step 1" in str(err.value) and "episode 0" in str(err.value)


def test_inf_observation_in_second_episode_names_episode_and_step():
    obs, act, rew = flat(6)
    obs[4, 2] = np.inf
    with pytest.raises(DatasetError, match=r"observations: episode 2, step 1 .*inf"):
        EpisodeDataset.from_flags(obs, act, rew, [0, 1, 1, 0, 0, 1], action_space=BOX3)


def test_minari_episode_with_equal_observation_and_action_counts_is_refused():
    eps = [{"observations": np.zeros((11, 4)), "actions": np.zeros((10, 3), np.float32), "rewards": np.zeros(10),
            "terminations": [False] * 9 + [True], "truncations": [False] * 10},
           {"observations": np.zeros((10, 4)), "actions": np.zeros((10, 3), np.float32), "rewards": np.zeros(10),
            "terminations": [False] * 9 + [True], "truncations": [False] * 10}]
    with pytest.raises(DatasetError) as err:
        EpisodeDataset.from_episodes(eps, action_space=BOX3)
    msg = str(err.value)
    assert err.value.episode == 1
    assert "episode 1" in msg and "observations has 10" in msg and "actions has 10" in msg


def test_empty_episode_is_refused():
    obs, act, rew = flat(3)
    with pytest.raises(DatasetError, match="episode 1: empty episode"):
        EpisodeDataset(obs, act, rew, [0, 0, 1], [0, 0, 1], starts=[0, 2, 2], lengths=[2, 0, 1], action_space=BOX3)


def test_dataset_without_episodes_is_refused():
    with pytest.raises(DatasetError, match="no episodes"):
        EpisodeDataset.from_flags(np.zeros((0, 2), np.float32), np.zeros((0, 3), np.float32), np.zeros(0), np.zeros(0),
                                  action_space=BOX3)


def test_action_outside_box_is_refused_with_component_and_bound():
    obs, act, rew = flat(4)
    act[2, 1] = 1.5
    with pytest.raises(DatasetError, match=r"actions: episode 1, step 0 .*component 1 = 1.5 .*\[-1.0, 1.0\]") as err:
        EpisodeDataset.from_flags(obs, act, rew, [0, 1, 0, 1], action_space=BOX3)
    assert (err.value.field, err.value.episode, err.value.step) == ("actions", 1, 0)


def test_discrete_actions_checked_against_space():
    obs = np.zeros((4, 2), np.float32)
    ok = EpisodeDataset.from_flags(obs, np.array([0, 1, 2, 1]), np.ones(4), [0, 1, 0, 1],
                                   action_space=gym.spaces.Discrete(3))
    assert ok.discrete_actions and ok.action_shape == ()
    with pytest.raises(DatasetError, match=r"actions: episode 1, step 1 .*action 3 outside Discrete\(3\)"):
        EpisodeDataset.from_flags(obs, np.array([0, 1, 2, 3]), np.ones(4), [0, 1, 0, 1],
                                  action_space=gym.spaces.Discrete(3))


def test_inferred_action_spaces():
    obs = np.zeros((3, 2), np.float32)
    d = EpisodeDataset.from_flags(obs, np.array([0, 4, 1]), np.ones(3), [0, 0, 1])
    assert d.action_space == gym.spaces.Discrete(5)
    b = EpisodeDataset.from_flags(obs, np.zeros((3, 2), np.float32), np.ones(3), [0, 0, 1])
    assert isinstance(b.action_space, gym.spaces.Box) and np.isinf(b.action_space.high).all()


def test_flag_before_last_step_is_refused():
    obs, act, rew = flat(4)
    with pytest.raises(DatasetError, match=r"truncations: episode 0, step 1 .*before the episode's last step"):
        EpisodeDataset(obs, act, rew, [0, 0, 0, 1], [0, 1, 0, 0], starts=[0], lengths=[4], action_space=BOX3)


def test_unflagged_last_step_is_refused():
    obs, act, rew = flat(4)
    with pytest.raises(DatasetError, match=r"episode 0, step 3 \(its last step\) is neither terminated nor truncated"):
        EpisodeDataset(obs, act, rew, np.zeros(4), np.zeros(4), starts=[0], lengths=[4], action_space=BOX3)


def test_max_ep_len_names_episode_and_length():
    obs, act, rew = flat(6)
    ds = EpisodeDataset.from_flags(obs, act, rew, [0, 1, 1, 0, 0, 1], action_space=BOX3)
    ds.validate(max_ep_len=3)
    with pytest.raises(DatasetError, match=r"episode 2 has 3 steps, more than the model's max_ep_len=2") as err:
        ds.validate(max_ep_len=2)
    assert err.value.episode == 2


def test_select_shares_arrays_and_locate_maps_virtual_steps():
    obs, act, rew = flat(6)
    ds = EpisodeDataset.from_flags(obs, act, rew, [0, 1, 1, 0, 0, 1], action_space=BOX3)
    sub = ds.select(np.array([2, 0]))
    assert sub.observations is ds.observations
    assert sub.lengths.tolist() == [3, 2] and sub.num_steps == 5 and not sub.is_contiguous()
    ep, t = sub.locate(np.arange(5))
    assert ep.tolist() == [0, 0, 0, 1, 1] and t.tolist() == [0, 1, 2, 0, 1]
    assert sub.flat_indices().tolist() == [3, 4, 5, 0, 1]
    np.testing.assert_allclose(sub.episode_returns, [rew[3:].sum(), rew[:2].sum()])
    mat = sub.materialize()
    assert mat.is_contiguous()
    np.testing.assert_array_equal(mat.observations, obs[[3, 4, 5, 0, 1]])


def test_summary_fields():
    obs, act, rew = flat(6)
    timeouts = np.array([0, 0, 0, 0, 0, 1])
    ds = EpisodeDataset.from_flags(obs, act, np.arange(6.0), [0, 1, 1, 0, 0, 0], timeouts, action_space=BOX3)
    s = ds.summary()
    assert (s["episodes"], s["steps"], s["length_min"], s["length_max"]) == (3, 6, 1, 3)
    assert (s["return_min"], s["return_max"], s["return_mean"]) == (1.0, 12.0, 5.0)
    assert (s["terminations"], s["truncations"]) == (2, 1)
    assert s["observation_shape"] == [4] and s["normalized_return_mean"] is None
    assert s["unfinished_last_episode"] is False
    cut = EpisodeDataset.from_flags(obs, act, np.arange(6.0), [0, 1, 1, 0, 0, 0], action_space=BOX3).summary()
    assert cut["unfinished_last_episode"] is True and cut["truncations"] == 1


def test_lazy_h5_array_gathers_like_numpy_and_pickles_without_handle(tmp_path):
    data = np.arange(200, dtype=np.float32).reshape(50, 4)
    path = tmp_path / "a.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data)
    lazy = LazyH5Array(path, "x")
    idx = np.array([[3, 4, 5], [40, 41, 42], [4, 4, 0]])
    np.testing.assert_array_equal(lazy[idx], data[idx])
    np.testing.assert_array_equal(lazy[7], data[7])
    np.testing.assert_array_equal(lazy[2:9], data[2:9])
    assert lazy._h5 is not None
    clone = pickle.loads(pickle.dumps(lazy))
    assert clone._h5 is None
    np.testing.assert_array_equal(clone[idx], data[idx])
    with pytest.raises(IndexError):
        lazy[np.array([50])]


# ------------------------------------------------- in-memory datasets of integer observations
@pytest.mark.parametrize("build", ["from_flags", "from_episodes"])
def test_in_memory_uint8_observations_get_their_dtype_range(build) -> None:
    """``EpisodeDataset.from_flags(uint8 images, ...)`` without an observation space (the docs'
    recipe for concatenating datasets) gets the loaders' Box over the dtype's range (an unbounded
    Box raises gymnasium's "Box unsigned int dtype don't support `-np.inf`")."""
    from rl_tformers.envs.dataset import EpisodeDataset

    n = 6
    obs = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)
    act, rew, term = np.arange(n) % 2, np.ones(n), np.eye(1, n, n - 1, dtype=bool)[0]
    if build == "from_flags":
        ds = EpisodeDataset.from_flags(obs, act, rew, term)
    else:
        ds = EpisodeDataset.from_episodes([{"observations": np.concatenate([obs, obs[:1]]), "actions": act,
                                            "rewards": rew, "terminations": term, "truncations": np.zeros(n, bool)}])
    assert ds.observation_space == gym.spaces.Box(0, 255, (2, 2), np.uint8)
    assert ds.action_space == gym.spaces.Discrete(2)


@pytest.mark.parametrize("field", ["observations", "actions", "rewards"])
def test_in_memory_boolean_columns_are_refused_naming_the_field(field) -> None:
    """Boolean observations and boolean rewards are refused naming the field, as the HDF5 and
    Minari loaders refuse them as not numeric."""
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    n = 6
    cols = {"observations": np.zeros((n, 2), np.float32), "actions": np.zeros((n, 1), np.float32),
            "rewards": np.ones(n)}
    cols[field] = cols[field].astype(bool)
    with pytest.raises(DatasetError, match=rf"^{field}: dtype bool is not numeric \(integer or floating point\)$") as e:
        EpisodeDataset.from_flags(cols["observations"], cols["actions"], cols["rewards"], np.eye(1, n, n - 1)[0],
                                  action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
    assert e.value.field == field


def test_the_lazy_reader_names_a_chunk_damaged_after_loading(tmp_path):
    """A compressed chunk damaged once the file was loaded: reading it (directly, or in a
    DataLoader worker, whose error the main process re-raises) is one DatasetError line naming
    the file and the field; the other chunks are read as before."""
    import torch
    from rl_tformers.envs.loaders import load_d4rl_hdf5

    from tests.datafiles import corrupt_chunk, write_compressed_copy, write_d4rl_h5

    path = write_compressed_copy(write_d4rl_h5(tmp_path / "plain.hdf5", n=3000), tmp_path / "gz.hdf5")
    ds = load_d4rl_hdf5(path, lazy=True)
    corrupt_chunk(path, "observations", 1)  # rows 500..999
    expected = (f"{path}: cannot read 'observations': the file is damaged (OSError: Can't synchronously read data "
                f"(filter returned failure during read)); re-create or re-download it")
    assert ds.observations[np.arange(10, 20)].shape == (10, 4)
    for idx in (600, slice(490, 510), np.array([[3, 700], [701, 4]])):
        with pytest.raises(DatasetError) as err:
            ds.observations[idx]
        assert str(err.value) == expected and err.value.field == "observations"

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int):
            return ds.observations[np.arange(600, 610)]

    with pytest.raises(DatasetError) as err:
        next(iter(torch.utils.data.DataLoader(Rows(), batch_size=None, num_workers=1)))
    assert str(err.value) == expected
