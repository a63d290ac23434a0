"""Normalised scores: D4RL references by task family, dataset references first, None otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.scores import normalized_score, reference_scores, task_family


@pytest.mark.parametrize("name,family", [
    ("Hopper-v5", "hopper"), ("Hopper-v3", "hopper"), ("hopper-medium-replay-v2", "hopper"),
    ("mujoco/halfcheetah/expert-v0", "halfcheetah"), ("rlt/walker2d-v5/medium-positions-v0", "walker2d"),
    ("HalfCheetah-v5", "halfcheetah"), ("CartPole-v1", None), ("mujoco/ant/medium-v0", None), (None, None),
])
def test_task_family(name, family):
    assert task_family(name) == family


def test_d4rl_normalised_scores_in_percent():
    assert normalized_score("Hopper-v5", 3234.3) == pytest.approx(100.0)
    assert normalized_score("Hopper-v5", -20.272305) == pytest.approx(0.0)
    assert normalized_score("Walker2d-v5", 4592.3) == pytest.approx(100.0)
    assert normalized_score("HalfCheetah-v5", (12135.0 - 280.178953) / 2) == pytest.approx(50.0)
    out = normalized_score("hopper-medium-v2", np.array([-20.272305, 3234.3]))
    np.testing.assert_allclose(out, [0.0, 100.0])


def test_unknown_task_gives_none():
    assert reference_scores("CartPole-v1") is None
    assert normalized_score("CartPole-v1", 100.0) is None


def tiny(meta):
    return EpisodeDataset.from_flags(np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32), [1.0, 2.0], [0, 1],
                                     action_space=gym.spaces.Box(-1, 1, (1,), np.float32), metadata=meta)


def test_dataset_references_take_precedence_over_d4rl():
    own = tiny(DatasetMetadata(env_id="Hopper-v5", ref_min_score=0.0, ref_max_score=10.0))
    assert normalized_score(own, 5.0) == 50.0
    d4rl = tiny(DatasetMetadata(env_id="Hopper-v5"))
    assert reference_scores(d4rl) == (-20.272305, 3234.3)
    by_id = tiny(DatasetMetadata(dataset_id="mujoco/walker2d/medium-v0"))
    assert reference_scores(by_id) == (1.629008, 4592.3)
    assert normalized_score(tiny(DatasetMetadata(env_id="Pendulum-v1")), 1.0) is None
    assert tiny(DatasetMetadata(env_id="Pendulum-v1")).summary()["normalized_return_mean"] is None


# ------------------------------------------------- normalised scores from a parent folder's name
def test_a_parent_folder_named_like_a_d4rl_task_gives_no_reference_scores(tmp_path: Path) -> None:
    """A Pendulum-v1 file stored under ``hopper_experiments/`` gets no D4RL references (matching
    every component of the file's path against the task families would give it Hopper's, and
    a "normalised score" of a Pendulum agent on Hopper's scale)."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset
    from rl_tformers.envs.scores import reference_scores

    folder = tmp_path / "hopper_experiments"
    folder.mkdir()
    n = 12
    with h5py.File(folder / "pendulum.hdf5", "w") as f:
        f["observations"] = np.zeros((n, 3), np.float32)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = -np.ones(n)
        f["terminals"] = np.eye(1, n, n - 1, dtype=bool)[0]
        f.attrs["env_id"] = "Pendulum-v1"
    ds = load_dataset(folder / "pendulum.hdf5")
    assert reference_scores(ds) is None
    s = ds.summary()
    assert (s["ref_min_score"], s["ref_max_score"], s["normalized_return_mean"]) == (None, None, None)
    info = DatasetInfo.from_dataset(ds)
    assert (info.ref_min, info.ref_max) == (None, None)

    # the file's own name still names its task (no env_id: recognised from the name, as before)
    shutil.copy(folder / "pendulum.hdf5", folder / "hopper-medium-v2.hdf5")
    with h5py.File(folder / "hopper-medium-v2.hdf5", "a") as f:
        del f.attrs["env_id"]
    assert reference_scores(load_dataset(folder / "hopper-medium-v2.hdf5")) == (-20.272305, 3234.3)


# ------------------------------------------------- normalised scores of the evaluated task
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
