"""Collecting datasets: round trip from a shared policy, determinism, POMDP masks, noise, training replay."""

from __future__ import annotations

import json
import sys
import zlib

import gymnasium as gym
import h5py
import minari
import numpy as np
import pytest
from rl_tformers.envs.collect import Behaviour, collect, train_and_record
from rl_tformers.envs.loaders import load_d4rl_hdf5, load_dataset, load_minari
from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, detect_algorithm, load_sb3_policy
from rl_tformers.envs.pomdp import ObservationMaskWrapper, make_env, pomdp_record, position_indices
from typer.testing import CliRunner

from rl_tformers.cli import app


class Recorder:
    """Wraps a policy and keeps every observation it saw and action it returned."""

    def __init__(self, policy):
        self.policy, self.obs, self.actions = policy, [], []

    def reset(self):
        self.policy.reset()

    def __call__(self, obs):
        a = self.policy(obs)
        self.obs.append(np.array(obs))
        self.actions.append(np.array(a))
        return a


def test_two_episodes_of_a_shared_policy_round_trip_exactly(shared_dir, tmp_path):
    env = gym.make("Hopper-v5")
    rec = Recorder(load_sb3_policy(shared_dir / "policies/sac/Hopper-v3/model.zip", env))
    res = collect("Hopper-v5", [Behaviour(rec, episodes=2)], dataset_id="t/hopper/sac-v0", root=tmp_path, seed=3,
                  hdf5=tmp_path / "sac.hdf5", progress=False)
    assert res.num_episodes == 2 and res.episode_returns.min() > 900  # the SAC agent scores ~1100
    for ds in (load_minari("t/hopper/sac-v0", root=tmp_path), load_d4rl_hdf5(tmp_path / "sac.hdf5")):
        assert ds.lengths.tolist() == res.episode_lengths.tolist()
        np.testing.assert_array_equal(ds.observations, np.stack(rec.obs))
        np.testing.assert_array_equal(ds.actions, np.stack(rec.actions))
        assert ds.episode_returns.tolist() == res.episode_returns.tolist()
        assert ds.metadata.env_id == "Hopper-v5"
        assert (ds.metadata.ref_min_score, ds.metadata.ref_max_score) == (-20.272305, 3234.3)
        ends = ds.starts + ds.lengths - 1
        assert (ds.terminations[ends] | ds.truncations[ends]).all()


def test_detect_algorithm_of_shared_policies(shared_dir):
    got = {a: detect_algorithm(shared_dir / f"policies/{a}/Hopper-v3/model.zip") for a in ("sac", "ars", "ppo", "a2c")}
    assert got == {"sac": "sac", "ars": "ars", "ppo": "ppo", "a2c": "a2c"}


def random_run(root, dataset_id, seed, pomdp=None, episodes=3):
    env = gym.make("Hopper-v5")
    return collect("Hopper-v5", [Behaviour(RandomPolicy(env.action_space, seed=seed), episodes=episodes)],
                   dataset_id=dataset_id, root=root, seed=seed, pomdp=pomdp, progress=False)


def test_collection_is_deterministic_for_a_seed(tmp_path):
    random_run(tmp_path, "t/a/r-v0", seed=5)
    random_run(tmp_path, "t/b/r-v0", seed=5)
    random_run(tmp_path, "t/c/r-v0", seed=6)
    a, b, c = (load_minari(f"t/{x}/r-v0", root=tmp_path) for x in "abc")
    np.testing.assert_array_equal(a.observations, b.observations)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    assert a.observations.shape != c.observations.shape or not np.array_equal(a.observations, c.observations)


def test_existing_dataset_needs_overwrite(tmp_path):
    random_run(tmp_path, "t/x/r-v0", seed=0, episodes=1)
    with pytest.raises(FileExistsError, match="overwrite"):
        random_run(tmp_path, "t/x/r-v0", seed=0, episodes=1)


def test_position_only_dataset_has_the_same_episodes_without_velocities(tmp_path):
    assert position_indices("Hopper-v5") == [0, 1, 2, 3, 4]
    assert position_indices("Walker2d-v5") == list(range(8))
    assert position_indices("HalfCheetah-v5") == list(range(8))
    env = gym.make("Hopper-v5")
    record = pomdp_record(env, "positions")
    full = random_run(tmp_path, "t/full/r-v0", seed=2)
    part = random_run(tmp_path, "t/pos/r-v0", seed=2, pomdp=record)
    assert full.episode_returns.tolist() == part.episode_returns.tolist()
    f, p = load_minari("t/full/r-v0", root=tmp_path), load_minari("t/pos/r-v0", root=tmp_path)
    assert p.observation_shape == (5,) and p.metadata.pomdp == {"kind": "positions", "indices": [0, 1, 2, 3, 4],
                                                                "source_shape": [11]}
    np.testing.assert_array_equal(p.observations, f.observations[:, :5])
    np.testing.assert_array_equal(p.final_observations, f.final_observations[:, :5])
    ev = make_env("Hopper-v5", p.metadata.pomdp)
    assert ev.observation_space.shape == (5,)
    import minari

    recovered = minari.MinariDataset(tmp_path / "t/pos/r-v0/data").recover_environment(eval_env=True)
    assert isinstance(recovered, ObservationMaskWrapper) and recovered.observation_space.shape == (5,)


def test_generic_observation_mask():
    env = ObservationMaskWrapper(gym.make("Hopper-v5"), [0, 10])
    obs, _ = env.reset(seed=0)
    full, _ = gym.make("Hopper-v5").reset(seed=0)
    np.testing.assert_array_equal(obs, full[[0, 10]])
    with pytest.raises(ValueError, match="outside"):
        ObservationMaskWrapper(gym.make("Hopper-v5"), [11])
    with pytest.raises(ValueError, match="not a MuJoCo environment"):
        position_indices("CartPole-v1")


def test_noise_is_clipped_and_epsilon_one_is_random():
    space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)

    class Const:
        def reset(self):
            pass

        def __call__(self, obs):
            return np.full(3, 0.9, np.float32)

    noisy = NoisyPolicy(Const(), space, noise_std=1.0, seed=0)
    acts = np.stack([noisy(None) for _ in range(500)])
    assert acts.max() == 1.0 and acts.min() >= -1.0 and (acts == 1.0).mean() > 0.3
    eps = NoisyPolicy(Const(), space, epsilon=1.0, seed=0)
    acts = np.stack([eps(None) for _ in range(200)])
    assert not np.isclose(acts, 0.9).any() and acts.min() < -0.5
    with pytest.raises(ValueError, match="--noise needs a Box"):
        NoisyPolicy(Const(), gym.spaces.Discrete(2), noise_std=0.1)


def test_training_replay_dataset_is_the_sac_replay_buffer(tmp_path):
    policy, replay = train_and_record("sac", "Hopper-v5", 110, seed=0, replay_dataset_id="t/hopper/replay-v0",
                                      root=tmp_path, progress=False)
    rb = policy.model.replay_buffer
    ds = load_minari("t/hopper/replay-v0", root=tmp_path)
    assert ds.num_steps == rb.pos == 110
    np.testing.assert_array_equal(ds.actions, rb.actions[:110, 0])
    np.testing.assert_allclose(ds.observations, rb.observations[:110, 0], rtol=0, atol=0)
    np.testing.assert_array_equal(ds.rewards.astype(np.float32), rb.rewards[:110, 0])
    ends = ds.starts + ds.lengths - 1
    np.testing.assert_array_equal(ds.terminations[ends], rb.dones[:110, 0][ends].astype(bool) & ~rb.timeouts[:110, 0][ends].astype(bool))
    assert replay.num_steps == 110


ENV_MODULE = '''
import gymnasium as gym
import numpy as np
from gymnasium import spaces


class ToyEnv(gym.Env):
    def __init__(self):
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, 0.05 * self.t, np.float32), float(action[0]), self.t >= 10, False, {}


gym.register("ENV", entry_point="MODULE:ToyEnv")
'''


@pytest.fixture
def user_env(tmp_path, monkeypatch, request):
    """A module ``<name>`` on sys.path that registers ``Toy<N>-v0``; yields ``"<name>:Toy<N>-v0"``."""
    n = zlib.crc32(request.node.name.encode()) % 10**8
    module, env = f"rlt_user_env_{n}", f"Toy{n}-v0"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{module}.py").write_text(ENV_MODULE.replace("ENV", env).replace("MODULE", module))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    yield f"{module}:{env}"
    gym.registry.pop(env, None)
    sys.modules.pop(module, None)


# ------------------------------------------------- 1: a user's "module:EnvId" environment
def test_collect_records_a_module_prefixed_user_env_that_loads_back(tmp_path, user_env):
    # was: "Malformed dataset ID: rlt/<module>:toy...-v0/random-v0"
    r = CliRunner().invoke(app, ["collect", "--env", user_env, "--policy", "random", "--steps", "30", "--root",
                                 str(tmp_path / "data"), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout.strip().splitlines()[-1])
    env_name = user_env.rpartition(":")[2]
    assert made["dataset_id"] == f"rlt/{env_name.lower()}/random-v0" and made["steps"] == 30
    ds = load_dataset(made["dataset_id"], root=tmp_path / "data")
    assert ds.metadata.env_id == user_env  # gym.make of it imports the module that registers the env
    assert gym.make(ds.metadata.env_id).spec.id == env_name
    md = minari.MinariDataset(tmp_path / "data" / made["dataset_id"] / "data")
    for eval_env in (False, True):
        assert md.recover_environment(eval_env=eval_env).spec.id == env_name


def test_collect_with_dataset_id_and_module_env_leaves_no_partial_folder(tmp_path, user_env):
    # was: NameNotFound traceback from minari's create_dataset after the rollout; the folder stayed
    root = tmp_path / "data"
    r = CliRunner().invoke(app, ["collect", "--env", user_env, "--steps", "20", "--root", str(root),
                                 "--dataset-id", "me/toy-v0", "--no-progress", "--hdf5", str(tmp_path / "t.hdf5")])
    assert r.exit_code == 0, r.output
    assert load_dataset(str(tmp_path / "t.hdf5")).metadata.env_id == user_env
    assert load_dataset("me/toy-v0", root=root).num_steps == 20


def test_a_failed_build_removes_its_partial_dataset_folder(tmp_path, monkeypatch):
    # create_dataset makes the namespace and dataset folders, then fails (as NameNotFound did)
    import minari.data_collector.data_collector as dc

    def boom(*args, **kwargs):
        raise RuntimeError("create_dataset failed")

    monkeypatch.setattr(dc, "_generate_dataset_metadata", boom)
    env = gym.make("CartPole-v1")
    with pytest.raises(RuntimeError, match="create_dataset failed"):
        collect("CartPole-v1", [Behaviour(RandomPolicy(env.action_space, seed=0), episodes=1)],
                dataset_id="fresh/ns/cp-v0", root=tmp_path, progress=False)
    assert not (tmp_path / "fresh").exists()  # nor the namespace folders made for it
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        collect("CartPole-v1", [Behaviour(RandomPolicy(env.action_space, seed=0), episodes=1)],
                dataset_id="kept/cp-v0", root=tmp_path, progress=False)
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "cp-v0").exists()


def test_an_env_minari_cannot_record_is_refused_before_collecting(tmp_path):
    class Unserialisable(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            return np.zeros(2, np.float32), 0.0, True, False, {}

    gym.register("RltCallableEntry-v0", entry_point=Unserialisable)  # a class, not "module:Class"
    try:
        r = CliRunner().invoke(app, ["collect", "--env", "RltCallableEntry-v0", "--steps", "5", "--root",
                                     str(tmp_path), "--no-progress"])
    finally:
        gym.registry.pop("RltCallableEntry-v0", None)
    assert r.exit_code != 0
    assert "--env" in r.output and "entry_point='module:Class'" in r.output.replace("\n", "")
    assert "Traceback" not in r.output and not any(tmp_path.iterdir())


# ------------------------------------------------- 2: existing output files are not replaced silently
def test_collect_refuses_an_existing_hdf5_file_before_collecting(tmp_path):
    out = tmp_path / "keep.hdf5"
    out.write_bytes(b"precious")
    args = ["collect", "--env", "CartPole-v1", "--episodes", "1", "--root", str(tmp_path / "data"), "--no-progress",
            "--hdf5", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    assert "--hdf5" in r.output and "--overwrite" in r.output and "already exists" in r.output
    assert out.read_bytes() == b"precious" and not (tmp_path / "data").exists()  # nothing collected
    r = CliRunner().invoke(app, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert load_dataset(str(out)).num_episodes == 1


def test_recipe_build_refuses_existing_hdf5_files_before_building(tmp_path):
    from rl_tformers.envs.recipes import all_recipes

    name = next(iter(all_recipes(10)))
    (tmp_path / "h5").mkdir()
    (tmp_path / "h5" / f"{name}.hdf5").write_bytes(b"precious")
    r = CliRunner().invoke(app, ["collect", "--recipe", name, "--recipe-steps", "10", "--root", str(tmp_path / "data"),
                                 "--hdf5", str(tmp_path / "h5"), "--no-progress"])
    assert r.exit_code == 1, r.output
    assert "--hdf5" in r.output and "--overwrite" in r.output and "nothing was built" in r.output
    assert (tmp_path / "h5" / f"{name}.hdf5").read_bytes() == b"precious" and not (tmp_path / "data").exists()


def test_dataset_export_refuses_an_existing_out_file(tmp_path):
    src = tmp_path / "src.hdf5"
    with h5py.File(src, "w") as f:
        f["observations"] = np.zeros((4, 2), np.float32)
        f["actions"] = np.zeros((4, 1), np.float32)
        f["rewards"] = np.ones(4, np.float32)
        f["terminals"] = np.array([0, 1, 0, 1], bool)
        f["timeouts"] = np.zeros(4, bool)
    out = tmp_path / "out.hdf5"
    out.write_bytes(b"precious")
    r = CliRunner().invoke(app, ["dataset", "export", str(src), str(out)])
    assert r.exit_code == 1, r.output
    assert "OUT" in r.output and "--overwrite" in r.output and out.read_bytes() == b"precious"
    r = CliRunner().invoke(app, ["dataset", "export", str(src), str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert load_dataset(str(out)).num_episodes == 2


# ------------------------------------------------- 3: an empty DATASET argument is named
@pytest.mark.parametrize("command", [["dataset", "info", ""], ["dataset", "export", " ", "x.hdf5"]])
def test_empty_dataset_argument_is_named(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, command)
    assert r.exit_code == 1
    assert "error: DATASET is empty" in r.output and "not a Minari dataset folder" not in r.output
    assert not (tmp_path / "x.hdf5").exists()


def test_load_dataset_of_an_empty_spec_says_so():
    from rl_tformers.envs.dataset import DatasetError

    with pytest.raises(DatasetError, match="spec is empty"):
        load_dataset("")
