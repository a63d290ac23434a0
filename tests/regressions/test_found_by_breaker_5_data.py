"""Defects found by the breaker (fifth pass, the data layer): D4RL files that crashed the loader
with raw tracebacks (uint8 observations, scalar datasets, unreadable attributes), data accepted at
load time that failed or misled later (one scalar observation per step, zero-width steps,
next_observations inconsistent with observations or NaN away from episode ends, rewards whose
sum overflows, reference scores with ref_max <= ref_min), damaged Minari folders and Minari
episodes with mixed per-step shapes or non-numeric rewards, observation statistics that lost
precision on lazy or filtered data, NaN/inf reward scales, RTG of multi-column rewards,
out-of-range DataLoader resume steps, `rl-tformers collect` tracebacks (not-a-zip policy,
unknown env, --hdf5 a directory found only after collecting, --episodes 0), and an empty
$TMPDIR/SB3-* folder left by every on-the-spot SB3 training.

Every test uses datasets of a few steps and runs in well under a second, except the collect
CLI test (a few CartPole episodes, about a second) and the SB3 one (10 A2C steps, ~2 s).
"""

from __future__ import annotations

import json

import gymnasium as gym
import h5py
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import make_dataloader
from rl_tformers.envs.trajectory import observation_stats, returns_to_go, top_fraction
from typer.testing import CliRunner

from rl_tformers.cli import app

BOX2 = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


def _h5(path, n=6, terminals=(0, 1, 0, 0, 0, 1), **override):
    """A D4RL-layout file: obs (n, 3) = row index, actions (n, 2) zeros, rewards 1..n."""
    arrays = {
        "observations": np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1),
        "actions": np.zeros((n, 2), np.float32),
        "rewards": np.arange(1, n + 1, dtype=np.float32),
        "terminals": np.asarray(terminals, bool),
        "timeouts": np.zeros(n, bool),
    }
    arrays.update(override)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            if v is not None:
                f[k] = v
    return path


# ------------------------------------------------- 1: integer observations get their dtype's range
@pytest.mark.parametrize("lazy", [False, True])
def test_uint8_observations_in_a_d4rl_file_load(tmp_path, lazy):
    # was: ValueError "Box unsigned int dtype don't support `-np.inf`" from gymnasium
    obs = np.arange(18, dtype=np.uint8).reshape(6, 3)
    ds = load_dataset(_h5(tmp_path / "u8.hdf5", observations=obs), lazy=lazy)
    assert ds.observation_space == gym.spaces.Box(0, 255, (3,), np.uint8)
    np.testing.assert_array_equal(ds.episode(1).observations, obs[2:])


# ------------------------------------------------- 2: scalar HDF5 datasets are refused by name
@pytest.mark.parametrize("key", ["observations", "actions", "next_observations"])
def test_a_scalar_dataset_in_a_d4rl_file_is_refused_naming_the_key(tmp_path, key):
    # was: IndexError "tuple index out of range" for observations, actions and next_observations
    path = _h5(tmp_path / "s.hdf5", **{key: np.float32(1.0)})
    with pytest.raises(DatasetError, match=f"{key}: a scalar") as err:
        load_dataset(path)
    assert err.value.field == key


# ------------------------------------------------- 3: steps without a vector observation / action
def test_one_scalar_observation_per_step_is_refused_at_load(tmp_path):
    # was: loaded (observation space Box((),)), then GTrXL training failed in a Linear layer
    path = _h5(tmp_path / "o1.hdf5", observations=np.arange(6, dtype=np.float32))
    with pytest.raises(DatasetError, match=r"one scalar per step .*\(N, 1\)") as err:
        load_dataset(path)
    assert err.value.field == "observations"
    load_dataset(_h5(tmp_path / "o2.hdf5", observations=np.arange(6, dtype=np.float32)[:, None]))  # (N, 1) is fine


@pytest.mark.parametrize("key", ["observations", "actions"])
def test_zero_width_observations_or_actions_are_refused(tmp_path, key):
    # was: loaded; the models refused obs_dim/act_dim 0 only when built
    path = _h5(tmp_path / "w0.hdf5", **{key: np.zeros((6, 0), np.float32)})
    with pytest.raises(DatasetError, match="holds no value per step") as err:
        load_dataset(path)
    assert err.value.field == key


# ------------------------------------------------- 4: next_observations are validated, not ignored
@pytest.mark.parametrize("lazy", [False, True])
def test_next_observations_must_match_the_next_observation_inside_episodes(tmp_path, lazy):
    obs = np.repeat(np.arange(6, dtype=np.float32)[:, None], 3, axis=1)
    nxt = np.roll(obs, -1, axis=0)
    nxt[[1, 5]] = 100.0  # after each episode's last action: free
    ds = load_dataset(_h5(tmp_path / "ok.hdf5", next_observations=nxt), lazy=lazy)
    np.testing.assert_array_equal(ds.final_observations, np.full((2, 3), 100.0, np.float32))
    # an episode boundary the flags do not mark (old D4RL files without timeouts): was loaded as one episode
    bad = nxt.copy()
    bad[3] = 7.0  # episode 1 = rows 2..5; row 3 is its step 1
    with pytest.raises(DatasetError, match=r"next_observations: episode 1, step 1 \(dataset row 3\)") as err:
        load_dataset(_h5(tmp_path / "gap.hdf5", next_observations=bad), lazy=lazy)
    assert (err.value.field, err.value.episode, err.value.step) == ("next_observations", 1, 1)
    # NaN anywhere, not only at episode ends: was loaded (rows other than the ends were never read)
    nan = nxt.copy()
    nan[0, 2] = np.nan
    with pytest.raises(DatasetError, match="value nan is not finite") as err:
        load_dataset(_h5(tmp_path / "nan.hdf5", next_observations=nan), lazy=lazy)
    assert (err.value.field, err.value.episode, err.value.step) == ("next_observations", 0, 0)


def test_from_flags_checks_next_observations_and_validate_false_skips_it():
    obs = np.arange(8, dtype=np.float64).reshape(4, 2)
    kw = {"action_space": BOX2}
    act, rew = np.zeros((4, 2), np.float32), np.ones(4)
    with pytest.raises(DatasetError, match="next_observations"):
        EpisodeDataset.from_flags(obs, act, rew, [0, 0, 0, 1], next_observations=obs + 1, **kw)
    nxt32 = np.roll(obs, -1, axis=0).astype(np.float32)  # float32 copy of float64 observations: compared in float32
    EpisodeDataset.from_flags(obs, act, rew, [0, 0, 0, 1], next_observations=nxt32, **kw)
    EpisodeDataset.from_flags(obs, act, rew, [0, 0, 0, 1], next_observations=obs + 1, validate=False, **kw)


# ------------------------------------------------- 5: unreadable attributes are DatasetErrors
@pytest.mark.parametrize("attr, value, field", [
    ("rl_tformers_metadata", "{not json", "rl_tformers_metadata"),   # was: JSONDecodeError
    ("rl_tformers_metadata", "[1, 2]", "rl_tformers_metadata"),      # was: AttributeError 'list' ... 'get'
    ("rl_tformers_metadata", '{"ref_min_score": "abc"}', "ref_min_score"),  # was: bare float() ValueError
    ("rl_tformers_metadata", '{"ref_min_score": 5, "ref_max_score": 5}', "ref_max_score"),  # was: inf/NaN scores
    ("action_space", "garbage", "action_space"),                     # was: JSONDecodeError
    ("observation_space", '{"type": "NoSuchSpace"}', "observation_space"),
])
def test_unreadable_file_attributes_raise_dataset_errors_naming_them(tmp_path, attr, value, field):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs[attr] = value
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert err.value.field == field and (attr in str(err.value) or field in str(err.value))


def test_dataset_info_prints_an_attribute_error_without_a_traceback(tmp_path):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs["rl_tformers_metadata"] = "{not json"
    r = CliRunner().invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 1 and "rl_tformers_metadata is not valid JSON" in r.output
    assert not isinstance(r.exception, json.JSONDecodeError)


# ------------------------------------------------- 6: Minari-style episodes
def _episode(n, obs_dim=3, act_dim=2, rewards=None):
    return {"observations": np.zeros((n + 1, obs_dim)), "actions": np.zeros((n, act_dim), np.float32),
            "rewards": np.ones(n) if rewards is None else rewards, "terminations": [False] * (n - 1) + [True],
            "truncations": [False] * n}


@pytest.mark.parametrize("bad, field", [
    (_episode(2, act_dim=3), "actions"),        # was: numpy concatenate ValueError
    (_episode(2, obs_dim=4), "observations"),   # was: numpy concatenate ValueError
    (_episode(1, rewards=np.array([b"x"])), "rewards"),  # was: "could not convert string to float"
])
def test_minari_episodes_name_the_episode_with_another_shape_or_non_numeric_data(bad, field):
    with pytest.raises(DatasetError) as err:
        EpisodeDataset.from_episodes([_episode(3), _episode(2), bad], action_space=BOX2)
    assert (err.value.field, err.value.episode) == (field, 2)
    assert "episode 2" in str(err.value)


def _minari(root, dataset_id="test/tiny-v0"):
    import warnings

    import minari
    from minari.data_collector import EpisodeBuffer
    from rl_tformers.envs.loaders import minari_root

    bufs = [EpisodeBuffer(id=i, observations=np.zeros((3, 2), np.float32), actions=np.zeros((2, 2), np.float32),
                          rewards=[1.0, 1.0], terminations=[False, True], truncations=[False, False]) for i in range(2)]
    with minari_root(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        md = minari.create_dataset_from_buffers(dataset_id, bufs, observation_space=BOX2, action_space=BOX2,
                                                algorithm_name="t", author="t", author_email="t",
                                                code_permalink="t", description="t")
    return md.spec.data_path


@pytest.mark.parametrize("damage, match", [
    ("no_main_data", "not a readable Minari dataset"),   # was: ValueError "No data found in data path"
    ("bad_metadata", "not a readable Minari dataset"),   # was: JSONDecodeError
    ("no_rewards", "cannot read the episodes"),          # was: KeyError "object 'rewards' doesn't exist"
    ("no_episode", "cannot read the episodes"),          # was: KeyError "object 'episode_1' doesn't exist"
])
def test_a_damaged_minari_folder_raises_a_dataset_error(tmp_path, damage, match):
    from pathlib import Path

    data = Path(_minari(tmp_path))
    if damage == "no_main_data":
        (data / "main_data.hdf5").unlink()
    elif damage == "bad_metadata":
        (data / "metadata.json").write_text("{bad")
    else:
        with h5py.File(data / "main_data.hdf5", "a") as f:
            del f["episode_1/rewards" if damage == "no_rewards" else "episode_1"]
    with pytest.raises(DatasetError, match=match):
        load_dataset(str(data))
    r = CliRunner().invoke(app, ["dataset", "info", str(data), "--json"])
    assert r.exit_code == 1 and match in r.output


# ------------------------------------------------- 7: observation statistics, lazy or filtered
@pytest.mark.parametrize("lazy", [False, True])
def test_observation_stats_of_filtered_or_lazy_data_match_the_in_memory_numbers(tmp_path, lazy):
    # was: E[x^2] - E[x]^2 on the chunked path: std 1.27 instead of 0.0102 for a feature at 3e7
    n = 1000
    rng = np.random.default_rng(0)
    obs = np.array([1e4, 1e6, 3e7]) + rng.normal(0, 0.01, (n, 3))
    term = np.zeros(n, bool)
    term[[499, 999]] = True
    path = _h5(tmp_path / "big.hdf5", n=n, terminals=term, observations=obs, actions=np.zeros((n, 2), np.float32),
               rewards=np.arange(n, dtype=np.float32))
    ds = load_dataset(path, lazy=lazy)
    st = observation_stats(top_fraction(ds, 0.5))  # the second episode (higher return), a filtered view
    np.testing.assert_allclose(st.mean, obs[500:].mean(axis=0), rtol=1e-7)
    np.testing.assert_allclose(st.std, obs[500:].std(axis=0), rtol=1e-5)
    np.testing.assert_allclose(observation_stats(ds.select([1, 0])).std, obs.std(axis=0), rtol=1e-5)


# ------------------------------------------------- 8: reward scale and RTG inputs
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
@pytest.mark.parametrize("sampler", [WindowSampler, SegmentSampler])
def test_nan_or_inf_reward_scale_is_refused(tmp_path, scale, sampler):
    # was: accepted; every reward and RTG of every batch was NaN (or 0)
    ds = load_dataset(_h5(tmp_path / "r.hdf5"))
    with pytest.raises(ValueError, match="reward_scale must be a finite number > 0"):
        sampler(ds, 2, reward_scale=scale)


def test_returns_to_go_refuses_rewards_that_are_not_one_episode_column():
    # was: [[1, 2], [3, 4]] silently flattened into a 4-step episode
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(L, 1\)"):
        returns_to_go([[1.0, 2.0], [3.0, 4.0]])
    assert returns_to_go([[1.0], [2.0]]).tolist() == [3.0, 2.0]


def test_an_episode_whose_reward_sum_overflows_is_refused_at_load(tmp_path):
    # was: loaded; then episode_returns raised OverflowError ("intermediate overflow in fsum") and RTGs were inf
    rew = np.array([1.0, 1.0, 1e308, 1e308, 1.0, 1.0])
    with pytest.raises(DatasetError, match="episode 1: the sum of \\|rewards\\|") as err:
        load_dataset(_h5(tmp_path / "o.hdf5", rewards=rew, terminals=(0, 1, 0, 1, 0, 1)))
    assert (err.value.field, err.value.episode) == ("rewards", 1)


# ------------------------------------------------- 9: DataLoader resume step
@pytest.mark.parametrize("start", [-1, 11])
def test_make_dataloader_refuses_a_start_step_outside_the_run(tmp_path, start):
    # was: 11 -> an empty loader (a resume past the end trained on nothing); -1 -> IndexError at the first batch
    sampler = WindowSampler(load_dataset(_h5(tmp_path / "d.hdf5")), 2)
    with pytest.raises(ValueError, match=r"start_step must be in \[0, num_steps=10\]"):
        make_dataloader(sampler, 4, seed=0, num_steps=10, start_step=start)
    assert len(list(make_dataloader(sampler, 4, seed=0, num_steps=10, start_step=10))) == 0  # resume at the end


# ------------------------------------------------- 10: rl-tformers collect
def test_collect_refuses_bad_arguments_before_collecting_and_without_tracebacks(tmp_path):
    runner = CliRunner()
    root = tmp_path / "root"
    base = ["collect", "--root", str(root), "--no-progress"]
    not_zip = tmp_path / "model.zip"
    not_zip.write_text("not a zip")
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--policy", str(not_zip), "--episodes", "1"])
    assert r.exit_code == 1 and "not a Stable-Baselines3 save file" in r.output  # was: BadZipFile traceback
    r = runner.invoke(app, [*base, "--env", "NoSuchEnv-v0", "--episodes", "1"])
    assert r.exit_code == 2 and "NoSuchEnv" in r.output and "--env" in r.output  # was: NameNotFound traceback
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "0"])
    assert r.exit_code == 2 and "collects nothing" in r.output  # was: exit 0, nothing written, nothing said
    # was: the episodes were collected and the Minari dataset written, then IsADirectoryError; a rerun
    # was refused as "already exists"
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "1", "--hdf5", str(tmp_path)])
    assert r.exit_code == 1 and "is a directory" in r.output
    assert not (root / "rlt").exists()
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "1", "--hdf5", str(tmp_path / "cp.hdf5")])
    assert r.exit_code == 0, r.output
    assert load_dataset(tmp_path / "cp.hdf5").num_episodes == 1  # its next_observations pass the new check


def test_train_sb3_leaves_no_sb3_folder_in_the_temp_dir(tmp_path, monkeypatch):
    # was: every call (collect --train, train_and_record) left an empty $TMPDIR/SB3-<date> folder behind
    import tempfile

    from rl_tformers.envs.policies import train_sb3

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    model = train_sb3("a2c", gym.make("CartPole-v1"), 10, seed=0)
    assert model.num_timesteps >= 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("SB3-")] == []  # (torch may add its own)
