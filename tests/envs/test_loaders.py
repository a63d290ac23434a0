"""Loading Minari datasets (id, folder), D4RL HDF5 files (eager, lazy), flattening, errors."""

from __future__ import annotations

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
    save_d4rl_hdf5,
)
from typer.testing import CliRunner

from rl_tformers.cli import app

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
        nxt = np.roll(f["observations"][()], -1, axis=0)  # since breaker pass 5); ones after each last step
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


# ------------------------------------------- 1. float64 observations outside float32's range
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


# ------------------------------------------- 3. negative integer actions: no episode, no step
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


# ------------------------------------------- 4. DT max_ep_len error without the episode
def test_dt_max_ep_len_error_names_the_episode(tmp_path: Path) -> None:
    """README: episodes longer than the model's ``max_ep_len`` are refused with an error naming
    the episode (``lengths: episode 2 has 1000 steps, more than the model's max_ep_len=500``);
    the DT says only ``agent.max_ep_len=5 but the dataset has an episode of 10 steps``."""
    h5 = _cartpole_file(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.max_ep_len=5",
                            "backbone.d_model=16", "backbone.n_layers=1", *TINY, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "episode 0" in r.stderr, r.stderr


# ------------------------------------------- 7. (N, 1) integer actions of a Discrete task
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


# ------------------------------------------- 4b. GTrXL's learned-position limit without the episode
def test_gtrxl_max_position_error_names_the_episode(tmp_path: Path) -> None:
    """The GTrXL equivalent of 4: ``backbone.max_position=10 but the dataset has an episode of 15
    steps`` did not say which episode (here episode 2: lengths 5, 5, 15, 15)."""
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


# ------------------------------------------- 7b. (N, 1) Discrete actions read lazily
def test_n_by_1_discrete_actions_load_lazily_as_one_action_per_step(tmp_path: Path) -> None:
    """``lazy=True`` gives the same (N,) actions (read into memory: N integers, like rewards)."""
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, (40, 1))
    ds = load_dataset(_cartpole_file(tmp_path / "cp_n1.hdf5", actions=actions), lazy=True)
    assert ds.discrete_actions and ds.actions.shape == (40,)
    np.testing.assert_array_equal(ds.actions, actions[:, 0])


# ------------------------------------------- 1b. actions and final observations beyond float32
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
