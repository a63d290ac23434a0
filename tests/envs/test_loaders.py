"""Loading Minari datasets (id, folder), D4RL HDF5 files (eager, lazy), flattening, errors."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import gymnasium as gym
import h5py
import minari
import numpy as np
import pytest
from minari.data_collector import EpisodeBuffer
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.loaders import (
    flatten_batch,
    load_d4rl_hdf5,
    load_dataset,
    load_minari,
    minari_root,
    open_minari,
    save_d4rl_hdf5,
)
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import make_dataloader
from rl_tformers.envs.trajectory import observation_stats, returns_to_go, top_fraction
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from tests.datafiles import corrupt_chunk, flip_object_header, write_compressed_copy, write_d4rl_h5
from tests.runs import assert_clean_exit, train_dt

OBS = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)
ACT = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


def buffers(lengths, seed=0, obs_extra=1):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        out.append(EpisodeBuffer(
            id=i, observations=rng.normal(size=(n + obs_extra, 3)), actions=rng.uniform(-1, 1, (n, 2)).astype(np.float32),
            rewards=list(rng.normal(size=n)), terminations=[False] * (n - 1) + [i % 2 == 0],
            truncations=[False] * (n - 1) + [i % 2 == 1]))
    return out


def make_minari(root, dataset_id, bufs, obs_space=OBS, act_space=ACT):
    with minari_root(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no env / eval env: fine for these tests
        return minari.create_dataset_from_buffers(dataset_id, bufs, observation_space=obs_space, action_space=act_space,
                                                  algorithm_name="test", author="t", author_email="t",
                                                  code_permalink="t", description="t")


def test_minari_by_id_and_by_folder_keeps_every_array(tmp_path):
    bufs = buffers([4, 2, 5])
    md = make_minari(tmp_path, "test/tiny-v0", bufs)
    for spec in ("test/tiny-v0", tmp_path / "test/tiny-v0", md.spec.data_path):
        ds = load_dataset(spec, root=tmp_path)
        assert ds.lengths.tolist() == [4, 2, 5]
        assert ds.metadata.dataset_id == "test/tiny-v0"
        for i, b in enumerate(bufs):
            ep = ds.episode(i)
            np.testing.assert_array_equal(ep.observations, b.observations[:-1])
            np.testing.assert_array_equal(ep.final_observation, b.observations[-1])
            np.testing.assert_array_equal(ep.actions, b.actions)
            np.testing.assert_array_equal(ep.rewards, b.rewards)
        assert ds.terminations[ds.starts + ds.lengths - 1].tolist() == [True, False, True]
        assert ds.truncations[ds.starts + ds.lengths - 1].tolist() == [False, True, False]
    assert load_dataset("test/tiny-v0", root=tmp_path).metadata.source == "minari"


def test_minari_reference_scores_are_read(tmp_path):
    md = make_minari(tmp_path, "test/refs-v0", buffers([3]))
    md.storage.update_metadata({"ref_min_score": -1.0, "ref_max_score": 9.0})
    ds = load_minari("test/refs-v0", root=tmp_path)
    assert (ds.metadata.ref_min_score, ds.metadata.ref_max_score) == (-1.0, 9.0)


def test_minari_episode_with_as_many_observations_as_actions_is_refused(tmp_path):
    bufs = buffers([5])
    bufs += [EpisodeBuffer(id=1, **{k: getattr(b, k) for k in ("actions", "rewards", "terminations", "truncations")},
                           observations=b.observations[:-1]) for b in buffers([10], seed=1)]
    make_minari(tmp_path, "test/bad-v0", bufs)
    with pytest.raises(DatasetError) as err:
        load_minari("test/bad-v0", root=tmp_path)
    assert err.value.episode == 1 and err.value.field == "observations"
    assert "episode 1" in str(err.value) and "observations has 10" in str(err.value) and "actions has 10" in str(err.value)


def test_unknown_minari_id_is_not_downloaded_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    called = []
    monkeypatch.setattr(minari, "load_dataset", lambda *a, **k: called.append(a) or (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(FileNotFoundError, match=r"not found .* dataset\.download=true in a run config \(train\), --download"):
        load_dataset("nobody/nothing-v0", root=tmp_path)
    assert called == []
    with pytest.raises(RuntimeError, match="could not download Minari dataset 'nobody/nothing-v0': offline"):
        load_dataset("nobody/nothing-v0", root=tmp_path, download=True)
    assert called == [("nobody/nothing-v0",)]


def dict_space():
    return gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32), "flag": gym.spaces.Discrete(3),
                            "pair": gym.spaces.Tuple((gym.spaces.MultiBinary(2), gym.spaces.MultiDiscrete([2, 3])))})


def test_flatten_batch_equals_gymnasium_flatten_per_step():
    space = dict_space()
    space.seed(0)
    steps = [space.sample() for _ in range(6)]
    batch = {"pos": np.stack([s["pos"] for s in steps]), "flag": np.array([s["flag"] for s in steps]),
             "pair": (np.stack([s["pair"][0] for s in steps]), np.stack([s["pair"][1] for s in steps]))}
    want = np.stack([gym.spaces.flatten(space, s) for s in steps])
    got = flatten_batch(space, batch)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_dict_observations_are_refused_by_name_or_flattened_on_request(tmp_path):
    space = gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,), np.float32), "b": gym.spaces.Discrete(4)})
    n = 3
    buf = EpisodeBuffer(id=0, observations={"a": np.zeros((n + 1, 2), np.float32), "b": np.array([0, 1, 2, 3])},
                        actions=np.zeros((n, 2), np.float32), rewards=[1.0] * n, terminations=[False, False, True],
                        truncations=[False] * n)
    make_minari(tmp_path, "test/dict-v0", [buf], obs_space=space)
    with pytest.raises(DatasetError, match=r"observation space Dict\(.*\) is not a Box; .*dataset\.flatten_observations=true"):
        load_minari("test/dict-v0", root=tmp_path)
    ds = load_minari("test/dict-v0", root=tmp_path, flatten_observations=True)
    assert ds.observation_shape == (6,)
    np.testing.assert_array_equal(ds.observations[:, 2:], np.eye(4)[:3])
    np.testing.assert_array_equal(ds.final_observations[0], [0, 0, 0, 0, 0, 1])


def test_discrete_actions_from_minari(tmp_path):
    buf = EpisodeBuffer(id=0, observations=np.zeros((4, 3)), actions=np.array([0, 2, 1]), rewards=[1.0, 1.0, 1.0],
                        terminations=[False, False, True], truncations=[False] * 3)
    make_minari(tmp_path, "test/disc-v0", [buf], act_space=gym.spaces.Discrete(3))
    ds = load_minari("test/disc-v0", root=tmp_path)
    assert ds.discrete_actions and ds.actions.tolist() == [0, 2, 1]


def write_d4rl(path, n=3000, **extra):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["observations"] = rng.normal(size=(n, 11)).astype(np.float32)
        f["actions"] = rng.uniform(-1, 1, size=(n, 3)).astype(np.float32)
        f["rewards"] = rng.normal(size=n).astype(np.float32)
        for k, v in extra.items():
            f[k] = v
    return path


def test_d4rl_hdf5_timeouts_and_inferred_env(tmp_path):
    timeouts = np.zeros(3000, bool)
    timeouts[[999, 1999, 2999]] = True
    path = write_d4rl(tmp_path / "hopper-medium-v2.hdf5", terminals=np.zeros(3000, bool), timeouts=timeouts)
    ds = load_dataset(path)
    assert ds.lengths.tolist() == [1000, 1000, 1000]
    assert ds.metadata.env_id == "Hopper-v5" and ds.metadata.source == "d4rl-hdf5"
    assert ds.action_space == gym.make("Hopper-v5").action_space
    assert ds.final_observations is None


def test_d4rl_hdf5_unfinished_last_episode_and_next_observations(tmp_path):
    term = np.zeros(3000, bool)
    term[[9, 19]] = True
    path = write_d4rl(tmp_path / "x.hdf5", terminals=term, timeouts=np.zeros(3000, bool))
    with h5py.File(path, "a") as f:  # next_observations[t] == observations[t + 1] inside episodes (checked
        nxt = np.roll(f["observations"][()], -1, axis=0)  # by the loader); ones after each last step
        nxt[[9, 19, 2999]] = 1.0
        f["next_observations"] = nxt
    ds = load_d4rl_hdf5(path, action_space=ACT.__class__(-1, 1, (3,), np.float32))
    assert ds.lengths.tolist() == [10, 10, 2980]
    assert ds.truncations[-1] and ds.metadata.extra["unfinished_last_episode"]
    assert ds.final_observations.shape == (3, 11)
    np.testing.assert_array_equal(ds.final_observations, np.ones((3, 11), np.float32))


def test_d4rl_missing_key_and_nan_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="missing dataset 'terminals'"):
        load_d4rl_hdf5(write_d4rl(tmp_path / "a.hdf5"))
    rew = np.zeros(3000, np.float32)
    rew[1] = np.nan
    path = tmp_path / "b.hdf5"
    write_d4rl(path, terminals=np.r_[np.zeros(2999), 1])
    with h5py.File(path, "a") as f:
        f["rewards"][...] = rew
    with pytest.raises(DatasetError, match=r"rewards: episode 0, step 1 "):
        load_d4rl_hdf5(path)


def test_hdf5_round_trip_eager_and_lazy(tmp_path):
    md = make_minari(tmp_path, "test/rt-v0", buffers([4, 2, 5]))
    src = load_minari(md.spec.data_path)
    path = save_d4rl_hdf5(src, tmp_path / "rt.hdf5")
    for lazy in (False, True):
        ds = load_d4rl_hdf5(path, lazy=lazy)
        assert ds.is_lazy == lazy
        assert ds.lengths.tolist() == src.lengths.tolist()
        np.testing.assert_array_equal(np.asarray(ds.observations[0:11]), src.observations)
        np.testing.assert_array_equal(np.asarray(ds.actions[0:11]), src.actions)
        np.testing.assert_array_equal(ds.rewards, src.rewards)
        np.testing.assert_array_equal(ds.final_observations, src.final_observations)
        assert ds.observation_space == src.observation_space and ds.action_space == src.action_space
        assert ds.metadata.dataset_id == "test/rt-v0"
    bad = tmp_path / "bad.hdf5"
    save_d4rl_hdf5(src, bad)
    with h5py.File(bad, "a") as f:
        f["actions"][3, 0] = 2.0
    with pytest.raises(DatasetError, match=r"actions: episode 0, step 3 .*component 0 = 2.0"):
        load_d4rl_hdf5(bad, lazy=True)


def test_episode_dataset_round_trip_from_flags_to_hdf5(tmp_path):
    obs = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = EpisodeDataset.from_flags(obs, np.zeros((6, 1), np.float32), np.ones(6), [0, 1, 1, 0, 0, 1],
                                   action_space=gym.spaces.Box(-1, 1, (1,), np.float32))
    back = load_d4rl_hdf5(save_d4rl_hdf5(ds, tmp_path / "f.hdf5"))
    assert back.lengths.tolist() == [2, 1, 3] and back.final_observations is None


runner = CliRunner()


TINY = ["train.batch_size=4", "train.steps=3", "eval.every=0", "eval.at_end=false", "train.progress=false",
        "train.warmup_steps=1", "train.log_every=1", "--device", "cpu"]


def _cartpole_file(path: Path, *, obs=None, actions=None, env_id: str | None = "CartPole-v1", n: int = 40) -> Path:
    """A CartPole-shaped D4RL file of 4 episodes of 10 steps."""
    rng = np.random.default_rng(0)
    term = np.zeros(n, bool)
    term[np.arange(9, n, 10)] = True
    with h5py.File(path, "w") as f:
        f["observations"] = rng.normal(size=(n, 4)).astype(np.float32) if obs is None else obs
        f["actions"] = rng.integers(0, 2, n) if actions is None else actions
        f["rewards"] = np.ones(n)
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
        if env_id:
            f.attrs["env_id"] = env_id
    return path


# ------------------------------------------- float64 observations outside float32's range
@pytest.mark.parametrize("agent", [["agent.kind=bc"],
                                   ["-c", "dt/cartpole_demo", "backbone.d_model=16", "backbone.n_layers=1"]],
                         ids=["bc", "dt"])
def test_observations_beyond_float32_are_refused_by_name_not_trained_into_nan(tmp_path: Path, agent) -> None:
    """A float64 observation of 1e300 is finite, so validation passes; the agents cast
    observations to float32 (inf), normalise them (NaN) and the run dies at the first update with
    ``NonFiniteLossError: ... try a lower train.lr``, which points at the wrong cause. The data
    cannot be trained on: it must be refused before training, naming observations, the episode
    and the step (like rewards whose returns-to-go are not finite in float32)."""
    obs = np.random.default_rng(1).normal(size=(40, 4))
    obs[17, 2] = 1e300  # episode 1, step 7
    h5 = _cartpole_file(tmp_path / "big.hdf5", obs=obs)
    r = runner.invoke(app, ["train", *agent, f"dataset.path={h5}", *TINY, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, (r.exception, r.output)
    assert "observations" in r.stderr and "episode 1, step 7" in r.stderr, r.stderr


# ------------------------------------------- negative integer actions: no episode, no step
def test_negative_integer_action_error_names_the_episode_and_the_step(tmp_path: Path) -> None:
    """``actions: negative integer action -1; pass action_space explicitly``: no episode, no
    step, ``.episode``/``.step`` None, although docs/data.md promises both for every error."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, 40)
    actions[13] = -1  # episode 1, step 3
    h5 = _cartpole_file(tmp_path / "neg.hdf5", actions=actions, env_id=None)
    with pytest.raises(DatasetError) as info:
        load_dataset(h5)
    assert (info.value.field, info.value.episode, info.value.step) == ("actions", 1, 3), str(info.value)
    assert "episode 1, step 3" in str(info.value)


# ------------------------------------------- DT max_ep_len error without the episode
def test_dt_max_ep_len_error_names_the_episode(tmp_path: Path) -> None:
    """README: episodes longer than the model's ``max_ep_len`` are refused with an error naming
    the episode (``lengths: episode 2 has 1000 steps, more than the model's max_ep_len=500``);
    the DT says only ``agent.max_ep_len=5 but the dataset has an episode of 10 steps``."""
    h5 = _cartpole_file(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.max_ep_len=5",
                            "backbone.d_model=16", "backbone.n_layers=1", *TINY, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "episode 0" in r.stderr, r.stderr


# ------------------------------------------- (N, 1) integer actions of a Discrete task
def test_n_by_1_integer_actions_of_a_discrete_env_are_not_called_multi_dimensional(tmp_path: Path) -> None:
    """A CartPole-v1 file (env_id attribute) with actions stored as (N, 1) integers, as rewards
    (N, 1) are accepted, is refused with "integer actions of shape (40, 1) and no action space
    ... (1,) integers per step are multi-dimensional discrete actions": the file names a task
    with a Discrete(2) space and one integer per step is not multi-dimensional. Either accept
    them as (N,) (like rewards) or say what is wrong with them."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, (40, 1))
    h5 = _cartpole_file(tmp_path / "cp_n1.hdf5", actions=actions)
    try:
        ds = load_dataset(h5)
    except DatasetError as exc:
        msg = str(exc)
        assert "multi-dimensional" not in msg and "no action space" not in msg, msg
    else:
        assert ds.discrete_actions and ds.actions.shape == (40,)
        np.testing.assert_array_equal(ds.actions, actions[:, 0])


# ------------------------------------------- GTrXL's learned-position limit without the episode
def test_gtrxl_max_position_error_names_the_episode(tmp_path: Path) -> None:
    """As for the DT's max_ep_len: ``backbone.max_position=10 but the dataset has an episode of 15
    steps`` says which episode (here episode 2: lengths 5, 5, 15, 15)."""
    h5 = _cartpole_file(tmp_path / "cp.hdf5")
    with h5py.File(h5, "r+") as f:
        term = np.zeros(40, bool)
        term[[4, 9, 24, 39]] = True
        f["terminals"][...] = term
    r = runner.invoke(app, ["train", "agent.kind=gtrxl", f"dataset.path={h5}", "backbone.d_model=16",
                            "backbone.n_layers=1", "backbone.n_heads=1", "agent.seq_len=3", "agent.burn_in=1",
                            "backbone.position.kind=learned", "backbone.max_position=10", *TINY,
                            "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "backbone.max_position=10 but the dataset has an episode of 15 steps (lengths: episode 2)" in r.stderr, \
        r.stderr


# ------------------------------------------- (N, 1) Discrete actions read lazily
def test_n_by_1_discrete_actions_load_lazily_as_one_action_per_step(tmp_path: Path) -> None:
    """``lazy=True`` gives the same (N,) actions (read into memory: N integers, like rewards)."""
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, (40, 1))
    ds = load_dataset(_cartpole_file(tmp_path / "cp_n1.hdf5", actions=actions), lazy=True)
    assert ds.discrete_actions and ds.actions.shape == (40,)
    np.testing.assert_array_equal(ds.actions, actions[:, 0])


# ------------------------------------------- actions and final observations beyond float32
def test_float64_actions_and_final_observations_beyond_float32_are_refused_by_name() -> None:
    """The same as 1 for Box actions without bounds (an inferred unbounded float64 Box) and for
    final observations (``next_observations`` at an episode's end)."""
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    obs, act = np.zeros((6, 2)), np.zeros((6, 1))
    term = np.array([0, 0, 1, 0, 0, 1])
    act[4, 0] = -1e39  # episode 1, step 1
    with pytest.raises(DatasetError) as info:
        EpisodeDataset.from_flags(obs, act, np.ones(6), term)
    assert (info.value.field, info.value.episode, info.value.step) == ("actions", 1, 1), str(info.value)
    assert "outside float32's range" in str(info.value)
    nxt = np.zeros((6, 2))
    nxt[5, 1] = 1e300  # the final observation of episode 1
    with pytest.raises(DatasetError) as info:
        EpisodeDataset.from_flags(obs, np.zeros((6, 1)), np.ones(6), term, next_observations=nxt)
    assert (info.value.field, info.value.episode) == ("final_observations", 1), str(info.value)
    ok = EpisodeDataset.from_flags(np.full((6, 2), 3e38), np.zeros((6, 1)), np.ones(6), term)  # float32 holds 3e38
    assert ok.num_steps == 6


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


# ------------------------------------------------- integer observations get their dtype's range
@pytest.mark.parametrize("lazy", [False, True])
def test_uint8_observations_in_a_d4rl_file_load(tmp_path, lazy):
    # not ValueError "Box unsigned int dtype don't support `-np.inf`" from gymnasium
    obs = np.arange(18, dtype=np.uint8).reshape(6, 3)
    ds = load_dataset(_h5(tmp_path / "u8.hdf5", observations=obs), lazy=lazy)
    assert ds.observation_space == gym.spaces.Box(0, 255, (3,), np.uint8)
    np.testing.assert_array_equal(ds.episode(1).observations, obs[2:])


# ------------------------------------------------- scalar HDF5 datasets are refused by name
@pytest.mark.parametrize("key", ["observations", "actions", "next_observations"])
def test_a_scalar_dataset_in_a_d4rl_file_is_refused_naming_the_key(tmp_path, key):
    # not IndexError "tuple index out of range" for observations, actions and next_observations
    path = _h5(tmp_path / "s.hdf5", **{key: np.float32(1.0)})
    with pytest.raises(DatasetError, match=f"{key}: a scalar") as err:
        load_dataset(path)
    assert err.value.field == key


# ------------------------------------------------- steps without a vector observation / action
def test_one_scalar_observation_per_step_is_refused_at_load(tmp_path):
    # not loaded (observation space Box((),)), then GTrXL training failed in a Linear layer
    path = _h5(tmp_path / "o1.hdf5", observations=np.arange(6, dtype=np.float32))
    with pytest.raises(DatasetError, match=r"one scalar per step .*\(N, 1\)") as err:
        load_dataset(path)
    assert err.value.field == "observations"
    load_dataset(_h5(tmp_path / "o2.hdf5", observations=np.arange(6, dtype=np.float32)[:, None]))  # (N, 1) is fine


@pytest.mark.parametrize("key", ["observations", "actions"])
def test_zero_width_observations_or_actions_are_refused(tmp_path, key):
    # not loaded; the models refused obs_dim/act_dim 0 only when built
    path = _h5(tmp_path / "w0.hdf5", **{key: np.zeros((6, 0), np.float32)})
    with pytest.raises(DatasetError, match="holds no value per step") as err:
        load_dataset(path)
    assert err.value.field == key


# ------------------------------------------------- next_observations are validated, not ignored
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


# ------------------------------------------------- unreadable attributes are DatasetErrors
@pytest.mark.parametrize("attr, value, field", [
    ("rl_tformers_metadata", "{not json", "rl_tformers_metadata"),   # not JSONDecodeError
    ("rl_tformers_metadata", "[1, 2]", "rl_tformers_metadata"),      # not AttributeError 'list' ... 'get'
    ("rl_tformers_metadata", '{"ref_min_score": "abc"}', "ref_min_score"),  # not bare float() ValueError
    ("rl_tformers_metadata", '{"ref_min_score": 5, "ref_max_score": 5}', "ref_max_score"),  # not inf/NaN scores
    ("action_space", "garbage", "action_space"),                     # not JSONDecodeError
    ("observation_space", '{"type": "NoSuchSpace"}', "observation_space"),
])
def test_unreadable_file_attributes_raise_dataset_errors_naming_them(tmp_path, attr, value, field):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs[attr] = value
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert err.value.field == field and (attr in str(err.value) or field in str(err.value))



@pytest.mark.parametrize(("attr", "value", "said"), [
    ("env_id", 5, "attribute env_id is a int64 (np.int64(5)), expected a string"),
    ("env_id", np.array(["Hopper-v5", "Walker2d-v5"], dtype=h5py.string_dtype()),
     "attribute env_id is a ndarray of shape (2,)"),
    ("env_id", np.void(b"\x00\xff"), "attribute env_id is a void"),
    ("env_id", np.bytes_(b"\xff\xfe"), "attribute env_id is bytes that are not UTF-8 text"),
    ("rl_tformers_metadata", 7, "attribute rl_tformers_metadata is a int64"),
    ("action_space", np.arange(3), "attribute action_space is a ndarray of shape (3,)"),
])
def test_file_attributes_that_are_not_text_are_refused_naming_them(tmp_path, attr, value, said):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs[attr] = value
    with pytest.raises(DatasetError, match=re.escape(f"{path}: {said}")) as err:
        load_dataset(path)
    assert err.value.field == attr


def _external_link(f, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g["secret"] = np.arange(6, dtype=np.float32)
    f["rewards"] = h5py.ExternalLink(str(other), "secret")
    return f"an external link to {other}:secret"


def _virtual(f, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g["secret"] = np.arange(6, dtype=np.float32)
    layout = h5py.VirtualLayout(shape=(6,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(other), "secret", shape=(6,))
    f.create_virtual_dataset("rewards", layout)
    return "a virtual dataset (its data is read from other files)"


def _external_raw(f, tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(6, dtype=np.float32).tobytes())
    f.create_dataset("rewards", shape=(6,), dtype=np.float32, external=[(str(raw), 0, 24)])
    return f"stored in external raw files ({raw})"


@pytest.mark.parametrize("store", [_external_link, _virtual, _external_raw])
def test_a_file_whose_arrays_are_read_from_other_files_is_refused(tmp_path, store):
    path = _h5(tmp_path / "a.hdf5", rewards=None)
    with h5py.File(path, "a") as f:
        said = store(f, tmp_path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: 'rewards' is {said}; a dataset file must hold its "
                                                     f"own arrays")) as err:
        load_dataset(path)
    assert err.value.field == "rewards"

@pytest.mark.parametrize("text", ["{not json", "[" * 100_000], ids=["garbage", "deeply-nested"])
def test_dataset_info_prints_an_attribute_error_without_a_traceback(tmp_path, text):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        f.attrs["rl_tformers_metadata"] = text
    r = CliRunner().invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: attribute rl_tformers_metadata is not valid JSON")
    assert not isinstance(r.exception, json.JSONDecodeError)


# ------------------------------------------------- Minari-style episodes
def _episode(n, obs_dim=3, act_dim=2, rewards=None):
    return {"observations": np.zeros((n + 1, obs_dim)), "actions": np.zeros((n, act_dim), np.float32),
            "rewards": np.ones(n) if rewards is None else rewards, "terminations": [False] * (n - 1) + [True],
            "truncations": [False] * n}


@pytest.mark.parametrize("bad, field", [
    (_episode(2, act_dim=3), "actions"),        # not numpy concatenate ValueError
    (_episode(2, obs_dim=4), "observations"),   # not numpy concatenate ValueError
    (_episode(1, rewards=np.array([b"x"])), "rewards"),  # not "could not convert string to float"
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
    ("no_main_data", "not a readable Minari dataset"),   # not ValueError "No data found in data path"
    ("bad_metadata", "not a readable Minari dataset"),   # not JSONDecodeError
    ("no_rewards", "episode 1: no array 'rewards' in its group"),  # not KeyError "object 'rewards' doesn't exist"
    ("no_episode", "episode 1: no group 'episode_1'"),   # not KeyError "object 'episode_1' doesn't exist"
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
    assert r.exit_code == 2 and match in r.output


# ------------------------------------------------- observation statistics, lazy or filtered
@pytest.mark.parametrize("lazy", [False, True])
def test_observation_stats_of_filtered_or_lazy_data_match_the_in_memory_numbers(tmp_path, lazy):
    # not E[x^2] - E[x]^2 on the chunked path: std 1.27 instead of 0.0102 for a feature at 3e7
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


# ------------------------------------------------- reward scale and RTG inputs
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
@pytest.mark.parametrize("sampler", [WindowSampler, SegmentSampler])
def test_nan_or_inf_reward_scale_is_refused(tmp_path, scale, sampler):
    # not accepted; every reward and RTG of every batch was NaN (or 0)
    ds = load_dataset(_h5(tmp_path / "r.hdf5"))
    with pytest.raises(ValueError, match="reward_scale must be a finite number > 0"):
        sampler(ds, 2, reward_scale=scale)


def test_returns_to_go_refuses_rewards_that_are_not_one_episode_column():
    # not [[1, 2], [3, 4]] silently flattened into a 4-step episode
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(L, 1\)"):
        returns_to_go([[1.0, 2.0], [3.0, 4.0]])
    assert returns_to_go([[1.0], [2.0]]).tolist() == [3.0, 2.0]


def test_an_episode_whose_reward_sum_overflows_is_refused_at_load(tmp_path):
    # not loaded; then episode_returns raised OverflowError ("intermediate overflow in fsum") and RTGs were inf
    rew = np.array([1.0, 1.0, 1e308, 1e308, 1.0, 1.0])
    with pytest.raises(DatasetError, match="episode 1: the sum of \\|rewards\\|") as err:
        load_dataset(_h5(tmp_path / "o.hdf5", rewards=rew, terminals=(0, 1, 0, 1, 0, 1)))
    assert (err.value.field, err.value.episode) == ("rewards", 1)


# ------------------------------------------------- DataLoader resume step
@pytest.mark.parametrize("start", [-1, 11])
def test_make_dataloader_refuses_a_start_step_outside_the_run(tmp_path, start):
    # not 11 -> an empty loader (a resume past the end trained on nothing); -1 -> IndexError at the first batch
    sampler = WindowSampler(load_dataset(_h5(tmp_path / "d.hdf5")), 2)
    with pytest.raises(ValueError, match=r"start_step must be in \[0, num_steps=10\]"):
        make_dataloader(sampler, 4, seed=0, num_steps=10, start_step=start)
    assert len(list(make_dataloader(sampler, 4, seed=0, num_steps=10, start_step=10))) == 0  # resume at the end


# ------------------------------------------------- dataset info: an episode both terminated and truncated
def test_dataset_info_counts_a_terminal_timeout_step_once_as_a_termination(tmp_path: Path) -> None:
    """A last step flagged both ``terminals`` and ``timeouts`` (a terminal state on the time limit's
    last step) is counted once, as a termination, not under both terminations and truncations
    (3 episodes: ``terminations 2, truncations 1``, not 2 and 2). It is a termination (gymnasium: terminated decides; the
    loader keeps both flags and the agents read the terminal one), counted once."""
    path = tmp_path / "both.hdf5"
    n = 12
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.arange(n * 3, dtype=np.float32).reshape(n, 3))
        f.create_dataset("actions", data=np.zeros((n, 1), np.float32))
        f.create_dataset("rewards", data=np.ones(n, np.float32))
        f.create_dataset("terminals", data=np.array([0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0], bool))
        f.create_dataset("timeouts", data=np.array([0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1], bool))
    from rl_tformers.envs.loaders import load_dataset

    ds = load_dataset(str(path))
    last = ds.starts + ds.lengths - 1
    assert ds.terminations[last].tolist() == [True, True, False]  # the data keeps both flags
    assert ds.truncations[last].tolist() == [False, True, True]
    r = runner.invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert (info["episodes"], info["terminations"], info["truncations"]) == (3, 2, 1)  # not (3, 2, 2)
    assert info["terminated_and_truncated"] == 1


# ------------------------------------------------- reward scales that break the scaled returns-to-go
TINY_DT = ["train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
           "eval.every=0", "eval.at_end=false", "train.progress=false", "train.warmup_steps=1", "train.steps=1",
           "--device", "cpu"]


def test_a_reward_scale_that_overflows_the_scaled_returns_to_go_is_refused_by_name(tmp_path: Path, cartpole_h5) -> None:
    """``agent.reward_scale=1e-40`` on returns of 10: the returns-to-go divided by it (1e41) are inf
    in float32, and the run started and only failed later on a non-finite loss, without naming the
    option. Refused before training, naming agent.reward_scale and the dataset's returns."""
    h5 = cartpole_h5(tmp_path / "d.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.reward_scale=1e-40",
                            *TINY_DT, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line == (
        f"error: agent.reward_scale=1e-40 is too small for the dataset {h5}: returns-to-go and rewards are divided "
        "by it, and its largest |episode return| is 10 (largest |return-to-go| 10, |reward| 1): 10 / 1e-40 = 1e+41 "
        "is not finite in float32 (max 3.40282e+38), so training would see inf/NaN; use agent.reward_scale >= "
        "2.93874e-38 ('auto' picks the power of ten at or below the largest |episode return|, at most 1000)"), line
    assert "Traceback" not in r.output
    # finite in float32 (1e31) but beyond what the return embedding's LayerNorm takes: refused too
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.reward_scale=1e-30",
                            *TINY_DT, "--run-dir", str(tmp_path / "run2")])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: agent.reward_scale=1e-30 is too small for the dataset {h5}: its largest |return-to-go| 10 / 1e-30 = "
        "1e+31 would overflow float32 in this model's return embedding (its LayerNorm), which takes |return-to-go| "
        "up to "), line
    assert "the first loss would be NaN; use agent.reward_scale >= " in line
    # a small scale the model takes trains (the DT's agent.targets of the config are scaled the same way)
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.reward_scale=1e-6",
                            "agent.targets=[10]", *TINY_DT, "--run-dir", str(tmp_path / "run3")])
    assert r.exit_code == 0, r.output


def test_auto_reward_scale_of_returns_below_the_smallest_power_of_ten_names_the_returns(tmp_path: Path) -> None:
    """Every |episode return| below ~1e-323: ``reward_scale: auto`` (10 ** floor(log10 max|R|))
    underflows to 0.0; the error names the dataset's returns (not "reward_scale must be a finite
    number > 0, got 0.0", which the user did not set)."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.dataset import EpisodeDataset

    tiny = np.nextafter(0.0, 1.0)  # 5e-324, the smallest float64 > 0
    ds = EpisodeDataset.from_flags(np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32),
                                   np.array([tiny, 0.0, 0.0, tiny]), [0, 1, 0, 1],
                                   action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
    with pytest.raises(ValueError) as exc:
        DatasetInfo.from_dataset(ds, spec="tiny.hdf5")
    assert str(exc.value) == (
        "rewards: agent.reward_scale='auto' cannot scale the dataset tiny.hdf5: its largest |episode return| is "
        "4.94066e-324, so the power of ten at or below it underflows to 0 in float64; its rewards are too small "
        "to condition on: rescale them (multiply the dataset's rewards), or set agent.reward_scale to a number > 0 "
        "where the agent takes it (dt, gtrxl)")
    assert DatasetInfo.from_dataset(ds, reward_scale=1e-300).reward_scale == 1e-300  # explicit: accepted


# ------------------------------------------------- multi-dimensional discrete actions
FIXES = ("to train on them, either treat the actions as continuous values with a Box action space of their per-step "
         "shape (an HDF5 file: action_space=gym.spaces.Box(low, high, shape) for load_dataset, or dataset.env_id / "
         "the file's env_id attribute naming an environment whose action space is that Box; evaluation then needs "
         "such an environment, agent.env_id), or encode each action as one Discrete index (numpy.ravel_multi_index "
         "over the components' sizes) and store actions of shape (N,)")


def _integer_actions_h5(path: Path, n: int = 8) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.zeros((n, 2), np.float32))
        f.create_dataset("actions", data=np.random.default_rng(0).integers(0, 3, (n, 3)))
        f.create_dataset("rewards", data=np.ones(n, np.float32))
        f.create_dataset("terminals", data=np.eye(1, n, n - 1, dtype=bool)[0])
        f.create_dataset("timeouts", data=np.zeros(n, bool))
    return path


def test_integer_actions_of_shape_n_k_say_multi_dimensional_discrete_actions_are_not_supported(tmp_path: Path) -> None:
    """Integer actions of shape (N, 3) without an action space (MultiDiscrete-like) are refused
    saying that such actions are not supported and what to do (not only "integer actions must
    have shape (N,), got (8, 3)"); the way out the message gives (an explicit Box) loads them."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    path = _integer_actions_h5(tmp_path / "md.hdf5")
    with pytest.raises(DatasetError) as exc:
        load_dataset(str(path))
    assert exc.value.field == "actions"
    assert str(exc.value) == f"{path}: " + (
        "actions: integer actions of shape (8, 3) and no action space: one Discrete action per step is an integer "
        "array of shape (N,); (3,) integers per step are multi-dimensional discrete actions (MultiDiscrete/"
        f"MultiBinary), which are not supported; {FIXES}")
    ds = load_dataset(str(path), action_space=gym.spaces.Box(0.0, 2.0, (3,), np.float32))
    assert ds.action_shape == (3,) and not ds.discrete_actions


@pytest.mark.parametrize("space", [gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiBinary(3)],
                         ids=["MultiDiscrete", "MultiBinary"])
def test_minari_multi_discrete_action_space_is_refused_saying_what_to_do(tmp_path: Path, space) -> None:
    """A Minari dataset with a MultiDiscrete / MultiBinary action space is refused saying what to
    do with such data (a Minari dataset's own space cannot be replaced by an option), not only
    "unsupported action space ...; supported: Box, Discrete"."""
    import warnings

    import minari
    from minari.data_collector import EpisodeBuffer
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset, minari_root

    space.seed(0)
    buf = EpisodeBuffer(id=0, observations=np.zeros((5, 2)), actions=np.stack([space.sample() for _ in range(4)]),
                        rewards=[1.0] * 4, terminations=[False, False, False, True], truncations=[False] * 4)
    with minari_root(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no env: fine here
        minari.create_dataset_from_buffers("test/multi-v0", [buf], observation_space=gym.spaces.Box(-1, 1, (2,)),
                                           action_space=space, algorithm_name="t", author="t", author_email="t",
                                           code_permalink="t", description="t")
    with pytest.raises(DatasetError) as exc:
        load_dataset("test/multi-v0", root=tmp_path)
    assert exc.value.field == "actions"
    assert str(exc.value) == (
        f"actions: action space {space!r}: multi-dimensional discrete actions (MultiDiscrete/MultiBinary) are not "
        "supported (the agents take one Discrete action per step or a Box); a Minari dataset carries its own action "
        "space: write its episodes to a D4RL-layout .hdf5 file (observations, actions, rewards, terminals, timeouts) "
        f"and load that; {FIXES}")


# ------------------------------------------------------------------- download advice for the project's own ids
def test_a_missing_recipe_id_is_not_sent_to_the_minari_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`rl-tformers train -c gtrxl/hopper_positions_bc` without the dataset says: build it with
    `collect --recipe hopper-medium-positions`, "... or fetch it from the Minari server:
    dataset.download=true ... --download for `rl-tformers dataset info/export`". The `rlt/...`
    ids are this project's own recipes, built locally and published nowhere, so that advice
    cannot work; following it (`dataset info rlt/hopper-v5/expert-v0 --download`) ends in
    "huggingface_hub is not installed", which sends the user installing minari[hf] for a
    download that would then fail again."""
    from rl_tformers.envs.loaders import load_dataset

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("rlt/hopper-v5/expert-v0", root=tmp_path / "data")
    msg = str(err.value)
    assert "collect --recipe hopper-expert" in msg, msg
    assert "Minari server" not in msg and "download" not in msg, msg


def test_unknown_dataset_id_suggests_close_local_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped dataset id gets a "did you mean" with close local ids, as unknown config names,
    keys and kinds do."""
    from rl_tformers.envs.loaders import load_minari, local_dataset_ids

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    for ds_id in ("rlt/hopper-v5/medium-v0", "rlt/walker2d-v5/expert-v0"):
        (tmp_path / "root" / ds_id / "data").mkdir(parents=True)
        (tmp_path / "root" / ds_id / "data" / "metadata.json").write_text("{}")
    assert local_dataset_ids(tmp_path / "root") == ["rlt/hopper-v5/medium-v0", "rlt/walker2d-v5/expert-v0"]
    with pytest.raises(FileNotFoundError, match=r"\(did you mean 'rlt/hopper-v5/medium-v0'\?\)") as typo:
        load_minari("rlt/hopper-v5/medium-v9", root=tmp_path / "root")
    # the package's own namespace is built locally, never downloaded
    assert "Minari server" not in str(typo.value) and "--list-recipes" in str(typo.value), typo.value
    with pytest.raises(FileNotFoundError) as exc:
        load_minari("foo/bar-v0", root=tmp_path / "root")
    assert "did you mean" not in str(exc.value)


# -- save_d4rl_hdf5 wrote in place: an interrupted write left a truncated file under the name --
def test_a_failed_hdf5_write_leaves_neither_a_partial_file_nor_a_changed_old_one(tmp_path, monkeypatch):
    from rl_tformers.envs import loaders
    from rl_tformers.envs.loaders import load_d4rl_hdf5, save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    ds = scripted_dataset("recall", 6, delay=2, seed=0)
    target = tmp_path / "data.hdf5"
    save_d4rl_hdf5(ds, target)
    before = target.read_bytes()
    real = loaders._write_d4rl

    def interrupted(path, *args):
        real(path, *args)  # the temporary file is complete, the rename has not happened yet
        raise KeyboardInterrupt

    monkeypatch.setattr(loaders, "_write_d4rl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_d4rl_hdf5(scripted_dataset("recall", 9, delay=2, seed=1), target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.hdf5"]
    with pytest.raises(KeyboardInterrupt):
        save_d4rl_hdf5(ds, tmp_path / "new.hdf5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.hdf5"]
    monkeypatch.setattr(loaders, "_write_d4rl", real)
    assert load_d4rl_hdf5(save_d4rl_hdf5(ds, tmp_path / "new.hdf5")).num_steps == ds.num_steps


def test_a_missing_recipe_dataset_names_its_recipe(tmp_path, monkeypatch):
    from rl_tformers.envs.loaders import load_minari

    (tmp_path / "policies").mkdir()  # found: the hint needs no --policies (a clean clone has no ../shared)
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "policies"))

    with pytest.raises(FileNotFoundError, match=r"`rl-tformers collect --recipe walker2d-medium`"):
        load_minari("rlt/walker2d-v5/medium-v1", root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"`rl-tformers collect --recipe walker2d-medium --recipe-version 0`"):
        load_minari("rlt/walker2d-v5/medium-v0", root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no recipe builds this id \(`rl-tformers collect --list-recipes`"):
        load_minari("rlt/none-v5/nothing-v0", root=tmp_path)


# ------------------------------------------------------------------- 3, 4, 5: HDF5 files that are not D4RL arrays
def _truncated(path: Path) -> Path:
    data = write_d4rl_h5(path.with_name("whole.hdf5")).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("make", ["garbage", "truncated"])
def test_an_unreadable_hdf5_file_is_a_dataset_error(tmp_path: Path, make: str) -> None:
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    path = tmp_path / f"{make}.hdf5"
    if make == "garbage":
        path.write_bytes(b"this is not an HDF5 file\n" * 10)
    else:
        _truncated(path)
    with pytest.raises(DatasetError, match=rf"^{path}: not a readable HDF5 file \(.+\)$"):
        load_dataset(path)
    r = runner.invoke(app, ["dataset", "info", str(path)])
    assert_clean_exit(r, 2)  # bad input, as in train
    assert f"error: {path}: not a readable HDF5 file (" in r.output
    r = train_dt(f"dataset.path={path}", "--run-dir", str(tmp_path / "run"))
    assert_clean_exit(r, 2)
    assert f"error: {path}: not a readable HDF5 file (" in r.output


def test_an_hdf5_group_where_a_dataset_belongs_is_named(tmp_path: Path) -> None:
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    path = write_d4rl_h5(tmp_path / "g.hdf5")
    with h5py.File(path, "a") as f:
        obs = f["observations"][()]
        del f["observations"]
        f.create_group("observations").create_dataset("a", data=obs)
    with pytest.raises(DatasetError, match=rf"^{path}: 'observations' is an HDF5 group, not a dataset;"):
        load_dataset(path)
    r = runner.invoke(app, ["dataset", "info", str(path)])
    assert_clean_exit(r, 2)
    assert "'observations' is an HDF5 group, not a dataset" in r.output


@pytest.mark.parametrize("key, values, dtype", [
    ("actions", np.array([b"abc"] * 30), "|S3"),
    ("actions", np.arange(30) % 2 == 0, "bool"),
    ("observations", np.array([[b"x"] * 4] * 30), "|S1"),
    ("rewards", np.array([b"r"] * 30), "|S1"),
])
def test_non_numeric_hdf5_arrays_are_named_up_front(tmp_path: Path, key: str, values, dtype: str) -> None:
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    path = write_d4rl_h5(tmp_path / "bad.hdf5", **{key: values})
    expected = f"{key}: dtype {dtype} is not numeric (integer or floating point) in {path}"
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    assert str(info.value) == expected
    r = runner.invoke(app, ["dataset", "info", str(path)])
    assert_clean_exit(r, 2)
    assert f"error: {expected}" in r.output
    r = train_dt(f"dataset.path={path}", "--run-dir", str(tmp_path / "run"))
    assert_clean_exit(r, 2)
    assert f"error: {expected}" in r.output


# ------------------------------------------------------------------------------------------ data
def test_nan_in_terminals_is_refused() -> None:
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    n = 10
    terminals = np.zeros(n, np.float32)
    terminals[3] = np.nan
    terminals[-1] = 1
    with pytest.raises(DatasetError) as info:
        EpisodeDataset.from_flags(np.zeros((n, 2), np.float32), np.zeros(n, np.int64), np.ones(n), terminals)
    assert info.value.field == "terminals" and "3" in str(info.value)


def test_non_binary_terminals_are_refused() -> None:
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    n = 10
    terminals = np.zeros(n, np.float32)
    terminals[4] = 0.5
    terminals[-1] = 1
    with pytest.raises(DatasetError, match="terminals"):
        EpisodeDataset.from_flags(np.zeros((n, 2), np.float32), np.zeros(n, np.int64), np.ones(n), terminals)


def test_next_observations_shape_mismatch_is_refused(tmp_path: Path) -> None:
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_d4rl_hdf5

    h5 = write_d4rl_h5(tmp_path / "next.hdf5", obs_dim=4, next_observations=np.zeros((30, 5), np.float32))
    with pytest.raises(DatasetError) as info:
        load_d4rl_hdf5(h5)
    assert info.value.field in ("next_observations", "final_observations")


def test_two_dimensional_rewards_blame_rewards(tmp_path: Path) -> None:
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_d4rl_hdf5

    h5 = write_d4rl_h5(tmp_path / "rew2d.hdf5", rewards=np.ones((30, 2), np.float32))
    with pytest.raises(DatasetError) as info:
        load_d4rl_hdf5(h5)
    assert info.value.field == "rewards"


# ------------------------------------------------------------------- dataset.env_id
def test_hdf5_without_a_task_name_says_how_to_set_it(tmp_path: Path) -> None:
    from rl_tformers.agents.common.offline import load_offline_dataset

    h5 = write_d4rl_h5(tmp_path / "data.hdf5", obs_dim=3, env_id=None, discrete=False)
    r = train_dt(f"dataset.path={h5}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2
    assert "continuous actions need a bounded Box action space" in r.output
    assert "guessed from the file name" in r.output and "dataset.env_id=" in r.output and "env_id attribute" in r.output
    ds = load_offline_dataset({"path": str(h5), "env_id": "Pendulum-v1"})
    assert ds.metadata.env_id == "Pendulum-v1" and ds.action_space.high.tolist() == [2.0]
    with pytest.raises(ValueError, match="dataset.env_id='Pendulum-v1' applies to HDF5 files only"):
        load_offline_dataset({"path": "rlt/pendulum-v1/x-v0", "env_id": "Pendulum-v1"})
    assert compose("dt/cartpole_demo", ["dataset.env_id=Pendulum-v1"]).dataset.env_id == "Pendulum-v1"


# ------------------------------------------------- an empty DATASET argument is named
@pytest.mark.parametrize("command", [["dataset", "info", ""], ["dataset", "export", " ", "x.hdf5"]])
def test_empty_dataset_argument_is_named(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, command)
    assert r.exit_code == 2
    assert "error: DATASET is empty" in r.output and "not a Minari dataset folder" not in r.output
    assert not (tmp_path / "x.hdf5").exists()


def test_load_dataset_of_an_empty_spec_says_so():
    from rl_tformers.envs.dataset import DatasetError

    with pytest.raises(DatasetError, match="spec is empty"):
        load_dataset("")


# -- damaged files: one DatasetError naming the file and the field --------------------------------------
HEADER_ERROR = "KeyError: Unable to synchronously open object (bad object header version number)"
CHUNK_ERROR = "OSError: Can't synchronously read data (filter returned failure during read)"


def _damaged(path: Path, field: str, reason: str) -> str:
    return f"{path}: cannot read {field!r}: the file is damaged ({reason}); re-create or re-download it"


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_flipped_object_header_byte_is_one_dataset_error_naming_file_and_field(tmp_path, lazy) -> None:
    for field in ("rewards", "observations"):
        path = flip_object_header(write_d4rl_h5(tmp_path / f"{field}.hdf5", n=300), field)
        with pytest.raises(DatasetError) as err:
            load_d4rl_hdf5(path, lazy=lazy)
        assert str(err.value) == _damaged(path, field, HEADER_ERROR) and err.value.field == field


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_corrupted_compressed_chunk_is_one_dataset_error_naming_file_and_field(tmp_path, lazy) -> None:
    path = write_compressed_copy(write_d4rl_h5(tmp_path / "plain.hdf5", n=3000), tmp_path / "gz.hdf5")
    assert load_d4rl_hdf5(path, lazy=lazy).num_steps == 3000  # readable before the damage
    corrupt_chunk(path, "observations", 2)
    with pytest.raises(DatasetError) as err:
        load_d4rl_hdf5(path, lazy=lazy)  # lazy: validation streams every chunk
    assert str(err.value) == _damaged(path, "observations", CHUNK_ERROR) and err.value.field == "observations"


def test_a_damaged_minari_episode_names_the_data_file_the_field_and_the_episode(tmp_path) -> None:
    md = make_minari(tmp_path, "test/damaged-v0", buffers([4, 2, 5]))
    data = Path(md.spec.data_path) / "main_data.hdf5"
    flip_object_header(data, "episode_1/rewards")
    expected = f"{_damaged(data, 'rewards', HEADER_ERROR)} (episode 1)"
    with pytest.raises(DatasetError) as err:
        load_minari("test/damaged-v0", root=tmp_path)
    assert str(err.value) == expected and (err.value.field, err.value.episode) == ("rewards", 1)
    opened = open_minari("test/damaged-v0", root=tmp_path)
    assert opened.episodes([0, 2]).num_episodes == 2  # the others are read as before
    with pytest.raises(DatasetError) as err:
        opened.episodes([2, 1])
    assert str(err.value) == expected



def test_reading_a_file_whose_env_id_names_a_module_imports_nothing(tmp_path, monkeypatch) -> None:
    """``env_id="module:EnvId"`` in a file: gym.make would import ``module`` (here a file next to
    the dataset, found through the current directory): reading the file makes no environment."""
    import sys

    path = write_d4rl_h5(tmp_path / "d.hdf5", env_id="payload_env_module_x:CartPole-v1")
    marker = tmp_path / "imported"
    (tmp_path / "payload_env_module_x.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    ds = load_d4rl_hdf5(path)
    assert ds.metadata.env_id == "payload_env_module_x:CartPole-v1" and not marker.exists()
    assert isinstance(ds.action_space, gym.spaces.Discrete)  # inferred from the data
    r = CliRunner().invoke(app, ["dataset", "info", str(path)])
    assert r.exit_code == 0, r.output
    assert not marker.exists()


@pytest.mark.parametrize(("variable", "under"), [("MINARI_DATASETS_PATH", ""), ("MINARI_DATASETS_PATH", "sub"),
                                                 ("RL_TFORMERS_DATA", ""), ("RL_TFORMERS_DATA", "sub")])
def test_a_data_root_that_is_a_file_or_under_one_is_refused_naming_its_variable(tmp_path, monkeypatch, variable,
                                                                                under):
    from rl_tformers.envs.loaders import data_root

    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    root = blocker / under if under else blocker
    monkeypatch.setenv(variable, str(root))
    said = "is a file" if not under else f"lies under {blocker}, which is a file"
    with pytest.raises(DatasetError, match=re.escape(f"${variable} {root}: a folder of datasets, but it {said}")):
        data_root()
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--episodes", "1", "--dataset-id", "test/cp-v0"])
    assert r.exit_code == 2 and r.stderr == f"error: ${variable} {root}: a folder of datasets, but it {said}\n"
    assert blocker.read_text() == ""


def test_an_empty_minari_datasets_path_is_refused_and_a_root_under_a_file_names_the_option(tmp_path, monkeypatch):
    from rl_tformers.envs.loaders import data_root

    monkeypatch.setenv("MINARI_DATASETS_PATH", "")
    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    with pytest.raises(DatasetError, match=r"^\$MINARI_DATASETS_PATH is set but empty; give a folder"):
        data_root()
    (tmp_path / "afile").write_text("")
    with pytest.raises(DatasetError, match=r"^data root \(--root, dataset.root\) .*afile/x: a folder of datasets, but "
                                           r"it lies under .*afile, which is a file"):
        data_root(tmp_path / "afile" / "x")


def test_a_malformed_d4rl_file_is_named_in_the_error(tmp_path):
    path = _h5(tmp_path / "a.hdf5")
    with h5py.File(path, "a") as f:
        del f["terminals"]
        f["terminals"] = np.full(6, 0.5)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: terminals: dataset row 0 (episode 0, step 0")):
        load_dataset(path)
    path = _h5(tmp_path / "b.hdf5", rewards=np.ones(3, np.float32))
    with pytest.raises(DatasetError, match=re.escape(f"{path}: observations: 6 rows but rewards has 3")):
        load_dataset(path)
