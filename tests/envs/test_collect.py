"""Collecting datasets: round trip from a shared policy, determinism, POMDP masks, noise, training replay."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import gymnasium as gym
import h5py
import minari
import numpy as np
import pytest
from rl_tformers.envs.collect import Behaviour, collect, train_and_record
from rl_tformers.envs.loaders import (
    load_d4rl_hdf5,
    load_dataset,
    load_minari,
)
from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, detect_algorithm, load_sb3_policy
from rl_tformers.envs.pomdp import ObservationMaskWrapper, make_env, pomdp_record, position_indices
from rl_tformers.envs.recipes import policies_dir
from typer.testing import CliRunner

from rl_tformers.cli import app
from tests.runs import tripwire


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


# ------------------------------------------------- a user's "module:EnvId" environment
def test_collect_records_a_module_prefixed_user_env_that_loads_back(tmp_path, user_env):
    # not "Malformed dataset ID: rlt/<module>:toy...-v0/random-v0"
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
    # not NameNotFound traceback from minari's create_dataset after the rollout; the folder stayed
    root = tmp_path / "data"
    r = CliRunner().invoke(app, ["collect", "--env", user_env, "--steps", "20", "--root", str(root),
                                 "--dataset-id", "me/toy-v0", "--no-progress", "--hdf5", str(tmp_path / "t.hdf5")])
    assert r.exit_code == 0, r.output
    assert load_dataset(str(tmp_path / "t.hdf5")).metadata.env_id == user_env
    assert load_dataset("me/toy-v0", root=root).num_steps == 20


def test_a_failed_build_removes_its_partial_dataset_folder(tmp_path, monkeypatch):
    # create_dataset makes the namespace and dataset folders, then fails (as NameNotFound did)
    import minari.utils

    def boom(*args, **kwargs):
        raise RuntimeError("create_dataset failed")

    monkeypatch.setattr(minari.utils, "_generate_dataset_metadata", boom)
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


# ------------------------------------------------- existing output files are not replaced silently
def test_collect_refuses_an_existing_hdf5_file_before_collecting(tmp_path):
    out = tmp_path / "keep.hdf5"
    out.write_bytes(b"precious")
    args = ["collect", "--env", "CartPole-v1", "--episodes", "1", "--root", str(tmp_path / "data"), "--no-progress",
            "--hdf5", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
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
    assert r.exit_code == 2, r.output
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
    assert r.exit_code == 2, r.output
    assert "OUT" in r.output and "--overwrite" in r.output and out.read_bytes() == b"precious"
    r = CliRunner().invoke(app, ["dataset", "export", str(src), str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert load_dataset(str(out)).num_episodes == 2


runner = CliRunner()


# ------------------------------------------------------------------- RL_TFORMERS_SHARED
def test_policies_are_found_through_rl_tformers_shared(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "shared" / "policies").mkdir(parents=True)
    monkeypatch.delenv("RL_TFORMERS_POLICIES", raising=False)
    monkeypatch.setenv("RL_TFORMERS_SHARED", str(tmp_path / "shared"))
    assert policies_dir() == tmp_path / "shared" / "policies"
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "elsewhere"))  # the more specific one wins
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        policies_dir()


def test_policies_not_found_lists_each_place_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RL_TFORMERS_POLICIES", raising=False)
    monkeypatch.delenv("RL_TFORMERS_SHARED", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        policies_dir()
    except FileNotFoundError as exc:
        listed = str(exc).split("looked in ", 1)[1].split(")", 1)[0].split(", ")
        assert len(listed) == len(set(listed))
        assert "RL_TFORMERS_SHARED" in str(exc)


# ------------------------------------------------------------------- suites with existing datasets
def _fake_existing(root: Path, dataset_id: str) -> Path:
    d = root / dataset_id
    d.mkdir(parents=True)
    (d / "keep.txt").write_text("not touched")
    return d


def test_recipe_suite_with_an_existing_dataset_stops_before_building_anything(tmp_path: Path) -> None:
    _fake_existing(tmp_path, "rlt/hopper-v5/medium-v1")
    r = runner.invoke(app, ["collect", "--recipe", "hopper-random", "--recipe", "hopper-medium", "--root",
                            str(tmp_path), "--recipe-steps", "100", "--no-progress"])
    assert r.exit_code == 2
    assert "rlt/hopper-v5/medium-v1" in r.output and "--skip-existing" in r.output and "--overwrite" in r.output
    assert "nothing was built" in r.output
    assert not (tmp_path / "rlt/hopper-v5/random-v1").exists()


def test_skip_existing_builds_only_the_missing_recipes(tmp_path: Path) -> None:
    kept = _fake_existing(tmp_path, "rlt/hopper-v5/medium-v1")
    r = runner.invoke(app, ["collect", "--recipe", "hopper-random", "--recipe", "hopper-medium", "--root",
                            str(tmp_path), "--recipe-steps", "100", "--no-progress", "--json", "--skip-existing"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.strip().splitlines() if x.startswith("{")]
    by_id = {x["dataset_id"]: x for x in lines}
    assert by_id["rlt/hopper-v5/medium-v1"]["skipped"] == "exists"
    assert by_id["rlt/hopper-v5/random-v1"]["steps"] >= 100
    assert (kept / "keep.txt").read_text() == "not touched"


@pytest.mark.parametrize("args, msg", [
    (["--recipe", "hopper-random", "--overwrite", "--skip-existing"], "exclude each other"),
    (["--env", "Hopper-v5", "--steps", "10", "--skip-existing"], "--recipe only"),
])
def test_skip_existing_misuse(tmp_path: Path, args, msg) -> None:
    r = runner.invoke(app, ["collect", *args, "--root", str(tmp_path), "--no-progress"])
    assert r.exit_code == 2 and msg in r.output


def _tiny_cartpole_run(tmp_path: Path, *overrides: str):
    """Train a tiny DT on a crafted CartPole file into ``tmp_path/run``; returns (run, CLI output)."""
    from tests.datafiles import write_d4rl_h5

    h5 = write_d4rl_h5(tmp_path / "cp.hdf5")
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "train.batch_size=4",
                            "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4", "eval.every=0",
                            "train.progress=false", *overrides, "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    return run, r.output


# ------------------------------------------------------------------- final evaluation vs `eval`
def test_the_printed_eval_command_repeats_the_final_evaluation_exactly(tmp_path: Path) -> None:
    import re

    run, output = _tiny_cartpole_run(tmp_path, "train.steps=3", "agent.targets=[20]", "eval.at_end=true",
                                     "eval.episodes=3", "eval.n_envs=2")
    m = re.search(r"repeat it exactly: rl-tformers eval (\S+) --seed (\d+) --episodes 3 --envs 2;", output)
    assert m and Path(m.group(1)) == run, output
    final = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final = [x for x in final if "eval/return_mean" in x][-1]
    e = runner.invoke(app, ["eval", str(run), "--seed", m.group(2), "--episodes", "3", "--envs", "2", "--json"])
    assert e.exit_code == 0, e.output
    res = json.loads(e.stdout[e.stdout.index("{"):])["results"]
    assert [x["target_return"] for x in res] == [20]
    assert res[0]["return_mean"] == pytest.approx(final["eval/return_mean"], abs=1e-9)


# ------------------------------------------------------------------- our warnings as one line
def test_package_warnings_print_as_one_line_without_source(tmp_path: Path) -> None:
    import subprocess
    import sys

    run, _ = _tiny_cartpole_run(tmp_path, "train.steps=2", "eval.at_end=false", "train.checkpoint_every=1")
    newest = sorted((run / "checkpoints").glob("step_*.pt"))[-1]
    data = bytearray(newest.read_bytes())
    data[200:204] = b"\x00\x01\x02\x03"
    newest.write_bytes(bytes(data))
    cli = Path(sys.executable).parent / "rl-tformers"
    e = subprocess.run([str(cli), "eval", str(run), "--episodes", "1", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert e.returncode == 0, e.stderr
    lines = [x for x in e.stderr.splitlines() if "skipping unusable checkpoint" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: skipping unusable checkpoint"), e.stderr
    assert "UserWarning" not in e.stderr and "find_latest_valid" not in e.stderr


# -- collect: a signal ends the process with its cleanup: nothing half-written in the data root --
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_collect_stopped_by_a_signal_leaves_nothing_in_the_data_root(tmp_path, sig):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "rl_tformers.cli", "collect", "--env", "CartPole-v1", "--policy", "random",
           "--steps", "100000000", "--root", str(root), "--dataset-id", "rlt/cartpole-v1/random-v0", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not root.is_dir() and time.monotonic() < deadline:  # made as the rollout starts
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert root.is_dir(), "collection never started"
        time.sleep(1.0)  # inside the rollout loop
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    signum = int(getattr(signal, sig))
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == (
        f"interrupted ({sig}): no half-written dataset is left; datasets reported above are complete")
    assert [p for p in root.rglob("*") if not p.is_dir() and p.name != "namespace_metadata.json"] == []


# ------------------------------------------------- rl-tformers collect
def test_collect_refuses_bad_arguments_before_collecting_and_without_tracebacks(tmp_path):
    runner = CliRunner()
    root = tmp_path / "root"
    base = ["collect", "--root", str(root), "--no-progress"]
    not_zip = tmp_path / "model.zip"
    not_zip.write_text("not a zip")
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--policy", str(not_zip), "--episodes", "1"])
    assert r.exit_code == 2 and "not a Stable-Baselines3 save file" in r.output  # not BadZipFile traceback
    r = runner.invoke(app, [*base, "--env", "NoSuchEnv-v0", "--episodes", "1"])
    assert r.exit_code == 2 and "NoSuchEnv" in r.output and "--env" in r.output  # not NameNotFound traceback
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "0"])
    assert r.exit_code == 2 and "collects nothing" in r.output  # not exit 0, nothing written, nothing said
    # not the episodes were collected and the Minari dataset written, then IsADirectoryError; a rerun
    # not refused as "already exists"
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "1", "--hdf5", str(tmp_path)])
    assert r.exit_code == 2 and "is a directory" in r.output
    assert not (root / "rlt").exists()
    r = runner.invoke(app, [*base, "--env", "CartPole-v1", "--episodes", "1", "--hdf5", str(tmp_path / "cp.hdf5")])
    assert r.exit_code == 0, r.output
    assert load_dataset(tmp_path / "cp.hdf5").num_episodes == 1  # its next_observations pass the new check


def test_train_sb3_leaves_no_sb3_folder_in_the_temp_dir(tmp_path, monkeypatch):
    # not every call (collect --train, train_and_record) left an empty $TMPDIR/SB3-<date> folder behind
    import tempfile

    from rl_tformers.envs.policies import train_sb3

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SB3_LOGDIR", raising=False)
    model = train_sb3("a2c", gym.make("CartPole-v1"), 10, seed=0)
    assert model.num_timesteps >= 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("SB3-")] == []  # (torch may add its own)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (a folder where no file can be created)")
def test_an_hdf5_target_in_a_folder_that_takes_no_file_is_refused_before_collecting(monkeypatch):
    from rl_tformers.envs import memory_tasks

    monkeypatch.setattr(memory_tasks, "scripted_dataset", tripwire)
    r = CliRunner().invoke(app, ["collect", "--memory-task", "recall", "--delay", "1", "--episodes", "2",
                                 "--hdf5", "/proc/rlt-target/m.hdf5"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: --hdf5 /proc/rlt-target/m.hdf5: cannot write in /proc (")
    assert r.stderr.count("\n") == 1


def test_training_until_a_return_stops_at_the_first_evaluation_that_reaches_it(tmp_path, monkeypatch) -> None:
    """D4RL's medium-replay: the replay of training up to a return. With a threshold every
    evaluation reaches, training stops at the first one, and the metadata records where."""
    from rl_tformers.envs import recipes as R
    from rl_tformers.envs.recipes import build_record

    monkeypatch.setattr(R, "REPLAY_EVAL_EVERY", 150)
    monkeypatch.setattr(R, "REPLAY_EVAL_EPISODES", 1)
    policy, replay = train_and_record("sac", "Pendulum-v1", 10_000, seed=0, replay_dataset_id="t/pend/replay-v0",
                                      root=tmp_path, progress=False, until_return=-1e9)
    assert policy.model.num_timesteps == 150 and replay.num_steps == 150
    stopped = build_record(replay.path)["stopped"]
    assert stopped["step"] == 150 and stopped["until_return"] == -1e9 and stopped["eval_return"] < 0
