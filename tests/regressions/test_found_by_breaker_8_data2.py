"""Defects found by the eighth breaker pass over the data layer and the offline agents (second part):

1. a BC run (``agent.kind=bc``) resumed on a dataset that changed since the checkpoint trained on
   with the checkpoint's stale statistics (the DT refused it already);
2. ``rl-tformers dataset info`` counting an episode whose last step is flagged both terminal and
   timeout under both ``terminations`` and ``truncations`` (counts above the number of episodes);
3. a tiny explicit ``agent.reward_scale`` making the scaled returns-to-go overflow float32 (a NaN
   loss later instead of an error naming the option), and ``reward_scale: auto`` on returns below
   ~1e-323 giving a scale of 0.0 that the sampler reported as the user's "reward_scale ... got 0.0";
4. integer actions of shape (N, k) (MultiDiscrete-like) refused as "must have shape (N,)" without
   saying that multi-dimensional discrete actions are not supported nor what to do;
5. ``agent.env_id`` naming an environment of another D4RL task family (Walker2d data evaluated in
   HalfCheetah-v5) scored with the dataset's reference returns instead of the evaluated task's.

Every test builds its own tiny data in ``tmp_path`` (never the repository's ``data/``) and trains for
at most a few updates of a small model.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()

# 1. BC resume on changed data: test_found_by_breaker_8_data.py::test_resume_refuses_a_dataset_that_changed_since_the_checkpoint[bc]


# ------------------------------------------------- 2. dataset info: an episode both terminated and truncated
def test_dataset_info_counts_a_terminal_timeout_step_once_as_a_termination(tmp_path: Path) -> None:
    """A last step flagged both ``terminals`` and ``timeouts`` (a terminal state on the time limit's
    last step) was counted under both terminations and truncations: 3 episodes gave
    ``terminations 2, truncations 2``. It is a termination (gymnasium: terminated decides; the
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
    assert (info["episodes"], info["terminations"], info["truncations"]) == (3, 2, 1)  # was (3, 2, 2)
    assert info["terminated_and_truncated"] == 1


# ------------------------------------------------- 3. reward scales that break the scaled returns-to-go
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
        "2.93874e-38 ('auto' picks the power of ten at or below the largest |episode return|)"), line
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
    underflowed to 0.0 and the sampler then said "reward_scale must be a finite number > 0, got 0.0"
    although the user had set "auto". The error now names the dataset's returns."""
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


# ------------------------------------------------- 4. multi-dimensional discrete actions
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
    """Integer actions of shape (N, 3) without an action space (MultiDiscrete-like) were refused
    as "integer actions must have shape (N,), got (8, 3)": neither that such actions are not
    supported nor what to do. The way out the message gives (an explicit Box) loads them."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    path = _integer_actions_h5(tmp_path / "md.hdf5")
    with pytest.raises(DatasetError) as exc:
        load_dataset(str(path))
    assert exc.value.field == "actions"
    assert str(exc.value) == (
        "actions: integer actions of shape (8, 3) and no action space: one Discrete action per step is an integer "
        "array of shape (N,); (3,) integers per step are multi-dimensional discrete actions (MultiDiscrete/"
        f"MultiBinary), which are not supported; {FIXES}")
    ds = load_dataset(str(path), action_space=gym.spaces.Box(0.0, 2.0, (3,), np.float32))
    assert ds.action_shape == (3,) and not ds.discrete_actions


@pytest.mark.parametrize("space", [gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiBinary(3)],
                         ids=["MultiDiscrete", "MultiBinary"])
def test_minari_multi_discrete_action_space_is_refused_saying_what_to_do(tmp_path: Path, space) -> None:
    """A Minari dataset with a MultiDiscrete / MultiBinary action space was refused as "unsupported
    action space ...; supported: Box, Discrete", without saying what to do with such data (a Minari
    dataset's own space cannot be replaced by an option)."""
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


# ------------------------------------------------- 5. normalised scores of the evaluated task
def _mujoco_h5(path: Path, env_id: str, n: int = 20) -> Path:
    """A (17,)-observation, (6,)-action file (Walker2d's and HalfCheetah's shapes) naming ``env_id``."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=rng.normal(size=(n, 17)))
        f.create_dataset("actions", data=rng.uniform(-1, 1, (n, 6)).astype(np.float32))
        f.create_dataset("rewards", data=np.ones(n, np.float32))
        f.create_dataset("terminals", data=np.zeros(n, bool))
        f.create_dataset("timeouts", data=np.arange(n) % 10 == 9)
        f.attrs["env_id"] = env_id
    return path


def test_another_d4rl_task_as_agent_env_id_is_scored_with_its_own_references(tmp_path: Path, caplog) -> None:
    """Walker2d data evaluated in HalfCheetah-v5 (``agent.env_id``, same shapes): the normalised
    score used Walker2d's reference returns (1.629008, 4592.3) for HalfCheetah returns. The score
    is a property of the evaluated task: HalfCheetah's references, with a warning saying so."""
    import logging

    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset
    from rl_tformers.envs.scores import D4RL_REF_SCORES

    ds = load_dataset(str(_mujoco_h5(tmp_path / "w.hdf5", "Walker2d-v5")))
    info = DatasetInfo.from_dataset(ds)
    assert (info.ref_min, info.ref_max) == D4RL_REF_SCORES["walker2d"]
    with caplog.at_level(logging.WARNING, logger="rl_tformers.agents.common.offline"):
        info = DatasetInfo.from_dataset(ds, env_id="HalfCheetah-v5")
    assert (info.ref_min, info.ref_max) == D4RL_REF_SCORES["halfcheetah"] == (-280.178953, 12135.0)
    assert info.normalizer()(np.array([12135.0]))[0] == 100.0
    assert [r.getMessage() for r in caplog.records] == [
        f"agent.env_id=HalfCheetah-v5 is another task than the dataset {tmp_path / 'w.hdf5'} (Walker2d-v5): "
        "normalised scores use the D4RL references of halfcheetah (-280.179, 12135), the evaluated task's, not the "
        "dataset's (1.62901, 4592.3)"]
    # the same task family (another version of the environment): the dataset's references, no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl_tformers.agents.common.offline"):
        info = DatasetInfo.from_dataset(ds, env_id="Walker2d-v4")
    assert (info.ref_min, info.ref_max) == D4RL_REF_SCORES["walker2d"]
    assert caplog.records == []
