"""Reading a policy folder: what it refuses (each naming the file and field), its backends, and
the return-conditioned target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rl_tformers.agents.export import Policy, PolicyFolderError, export_run


@pytest.fixture(scope="module")
def dt_folder(export_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("folder") / "dt"
    export_run(export_runs["dt_discrete"], "torchscript", out)
    return out


def _copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    spec = json.loads((dst / "policy.json").read_text())
    spec.update(changes)
    (dst / "policy.json").write_text(json.dumps(spec))
    return dst


def test_a_folder_without_policy_json_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(PolicyFolderError, match=r"no policy.json \(expected a folder written by rl-tformers export\)"):
        Policy.load(tmp_path)


@pytest.mark.parametrize("changes, message", [
    ({"format": "other"}, "format is 'other', not 'rl-tformers-policy'"),
    ({"format_version": 2}, "format_version 2 is newer than this rl-tformers reads"),
    ({"family": "ppo"}, "family 'ppo' is not one of bc, dt, gtrxl"),
])
def test_another_format_version_or_family_is_refused(dt_folder: Path, tmp_path: Path, changes, message) -> None:
    with pytest.raises(PolicyFolderError, match=message):
        Policy.load(_copy(dt_folder, tmp_path / "f", **changes))


def test_weights_that_do_not_fit_the_model_are_refused_naming_the_files(dt_folder: Path, tmp_path: Path) -> None:
    spec = json.loads((dt_folder / "policy.json").read_text())
    model = dict(spec["model"], backbone=dict(spec["model"]["backbone"], d_model=32))
    with pytest.raises(PolicyFolderError, match="cannot be rebuilt from policy.json and model.safetensors"):
        Policy.load(_copy(dt_folder, tmp_path / "f", model=model))


def test_a_backend_whose_graph_is_missing_is_refused(dt_folder: Path) -> None:
    with pytest.raises(PolicyFolderError, match=r"no policy.onnx \(export it with rl-tformers export --format onnx\)"):
        Policy.load(dt_folder, "onnx")
    with pytest.raises(PolicyFolderError, match="backend='jit'; use one of eager, torchscript, onnx"):
        Policy.load(dt_folder, "jit")


def test_the_dt_conditions_on_the_given_target_and_refuses_steps_past_max_ep_len(dt_folder: Path) -> None:
    policy = Policy.load(dt_folder)
    state = policy.initial_state(2, 7.5)
    _, state = policy.act(np.zeros((2, 4)), state)
    _, state = policy.act(np.zeros((2, 4)), state, np.array([False, True]), np.array([2.0, 5.0]))
    np.testing.assert_array_equal(state.rtg, [5.5, 7.5])  # R_1 = R_0 - r_0; a new episode starts at its target
    np.testing.assert_array_equal(state.returns_to_go[:, :2], [[7.5, 5.5], [7.5, 0.0]])
    state.t[:] = policy.acting["max_ep_len"] - 1
    with pytest.raises(ValueError, match="episode step 1000 >= max_ep_len=1000"):
        policy.act(np.zeros((2, 4)), state, np.zeros(2, bool), np.zeros(2))


def test_episode_start_of_the_wrong_length_is_refused(dt_folder: Path) -> None:
    policy = Policy.load(dt_folder)
    with pytest.raises(ValueError, match="episode_start has 3 rows but obs has 2"):
        policy.act(np.zeros((2, 4)), policy.initial_state(2), np.ones(3, bool))
