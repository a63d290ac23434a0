"""Exported policies act as the in-package policy: TorchScript and ONNX (onnxruntime) graphs and the
eager policy folder, over 100+ steps of real episodes (DT: the window's fill-up and sliding
phases; GTrXL: memory resets at episode starts), and one full episode gives the same return."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from rl_tformers.agents.export import Policy, export_run

import rl_tformers
from rl_tformers.runtime.loading import load_run

BACKENDS = ("eager", "torchscript", "onnx")
ATOL = 1e-5  # float32 actions


@pytest.fixture(scope="module")
def folders(export_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each run exported to both formats into one policy folder."""
    root = tmp_path_factory.mktemp("policies")
    for name, run_dir in export_runs.items():
        for fmt in ("torchscript", "onnx"):
            export_run(run_dir, fmt, root / name)
    return {name: root / name for name in export_runs}


def _in_package(run_dir: Path):
    agent = load_run(run_dir).agent
    policy = agent.policy(deterministic=True) if agent.__class__.__name__.startswith("GTrXL") else agent.policy()
    return policy, agent.make_env(), agent.default_targets()[0]


def _lockstep(reference, deployed: dict[str, Policy], make_env, target, steps: int, n_envs: int = 2) -> dict:
    """Step ``n_envs`` environments with ``reference``'s actions for ``steps`` steps, asking every
    deployed policy for its action on the same observations; returns what was seen."""
    envs = [make_env() for _ in range(n_envs)]
    obs = np.stack([env.reset(seed=10 + i)[0] for i, env in enumerate(envs)])
    ref_state = reference.initial_state(n_envs, target)
    states = {k: p.initial_state(n_envs, target) for k, p in deployed.items()}
    start, reward, seen = np.ones(n_envs, bool), None, {"starts": 0, "max_diff": 0.0}
    for _ in range(steps):
        want, ref_state = reference.act(obs, ref_state, start, reward)
        for k, p in deployed.items():
            got, states[k] = p.act(obs, states[k], start, reward)
            assert got.dtype == want.dtype and got.shape == want.shape, k
            if want.dtype.kind == "i":
                assert np.array_equal(got, want), k
            else:
                np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=k)
                seen["max_diff"] = max(seen["max_diff"], float(np.abs(got - want).max()))
        start, reward = np.zeros(n_envs, bool), np.zeros(n_envs)
        for i, env in enumerate(envs):
            o, reward[i], term, trunc, _ = env.step(want[i])
            if term or trunc:
                o, _ = env.reset()
                start[i] = True
                seen["starts"] += 1
            obs[i] = o
    return seen


def _episode_return(policy, make_env, target, seed: int = 3) -> float:
    env = make_env()
    obs, _ = env.reset(seed=seed)
    state, start, reward, total = policy.initial_state(1, target), np.ones(1, bool), None, 0.0
    while True:
        a, state = policy.act(obs[None], state, start, reward)
        obs, r, term, trunc, _ = env.step(a[0])
        total += float(r)
        start, reward = np.zeros(1, bool), np.array([r])
        if term or trunc:
            return total


@pytest.mark.parametrize("name, steps", [("dt_discrete", 130), ("dt_pendulum", 210), ("bc_pendulum", 100),
                                         ("gtrxl_recall", 120), ("ppo_cartpole", 120)])
def test_exported_graphs_act_as_the_in_package_policy(export_runs, folders, name: str, steps: int) -> None:
    reference, make_env, target = _in_package(export_runs[name])
    deployed = {b: Policy.load(folders[name], b) for b in BACKENDS}
    seen = _lockstep(reference, deployed, make_env, target, steps)
    if name.startswith(("dt", "gtrxl")):
        assert seen["starts"] >= 1  # a new episode (DT: the window refills; GTrXL: a memory reset) was crossed


def test_the_dt_window_fills_up_and_slides_in_the_compared_steps(folders) -> None:
    """K = 4 and 60-step episodes: steps 0-3 fill the window, later steps slide it."""
    policy = Policy.load(folders["dt_discrete"])
    assert policy.acting["context_len"] == 4 and policy.acting["align"] == "start"
    state = policy.initial_state(1)
    fills = []
    for t in range(6):
        _, state = policy.act(np.full((1, 4), t, np.float32), state, np.array([t == 0]), np.zeros(1))
        fills.append(int(state.mask.sum()))
    assert fills == [1, 2, 3, 4, 4, 4]
    np.testing.assert_array_equal(state.timesteps[0], [2, 3, 4, 5])
    np.testing.assert_array_equal(state.observations[0, :, 0], [2, 3, 4, 5])


@pytest.mark.parametrize("name", ["dt_discrete", "dt_pendulum", "bc_pendulum", "gtrxl_recall", "ppo_cartpole"])
def test_one_episode_has_the_same_return_through_each_path(export_runs, folders, name: str) -> None:
    reference, make_env, target = _in_package(export_runs[name])
    want = _episode_return(reference, make_env, target)
    for b in BACKENDS:
        assert _episode_return(Policy.load(folders[name], b), make_env, target) == pytest.approx(want, rel=1e-4), b


def test_discrete_actions_keep_the_space_start(folders) -> None:
    policy = Policy.load(folders["dt_discrete"], "onnx")
    assert policy.acting["action_start"] == 1
    state = policy.initial_state(8)
    a, _ = policy.act(np.random.default_rng(0).normal(size=(8, 4)), state)
    assert a.dtype == np.int64 and set(a.tolist()) <= {1, 2, 3}


def test_pendulum_actions_are_scaled_to_the_box(folders) -> None:
    policy = Policy.load(folders["bc_pendulum"], "torchscript")
    assert (policy.acting["action_low"], policy.acting["action_high"]) == ([-2.0], [2.0])
    a, _ = policy.act(np.random.default_rng(0).normal(size=(64, 3)) * 50, None)
    assert a.shape == (64, 1) and a.dtype == np.float32 and np.abs(a).max() <= 2.0 and np.abs(a).max() > 1.0


def test_the_policy_loads_without_unpickling_and_without_the_run(export_runs, folders, tmp_path, monkeypatch) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ("policy.json", "model.safetensors", "initial_memory.safetensors"):
        (copy / f).write_bytes((folders["gtrxl_recall"] / f).read_bytes())

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    for mod, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, attr, refuse)
    policy = rl_tformers.Policy.load(copy)
    a, state = policy.act(np.zeros((2, policy.acting["obs_dim"]), np.float32), policy.initial_state(2))
    a, state = policy.act(np.ones((2, policy.acting["obs_dim"]), np.float32), state, None, np.ones(2))
    assert a.shape == (2,) and state.started.all()


def test_the_onnx_graph_is_a_valid_model_with_a_dynamic_batch(folders) -> None:
    model = onnx.load(str(folders["dt_pendulum"] / "policy.onnx"))
    onnx.checker.check_model(model)
    names = [i.name for i in model.graph.input]
    assert names == ["returns_to_go", "observations", "actions", "timesteps", "mask"]
    assert model.graph.input[1].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_gtrxl_memory_is_explicit_inputs_and_outputs(folders) -> None:
    policy = Policy.load(folders["ppo_cartpole"])
    spec = policy.spec
    n = len(spec["inputs"]) - 4
    assert spec["inputs"][:4] == ["observations", "episode_start", "last_reward", "target_return"]
    assert spec["outputs"] == ["action", *[f"new_memory_{i}" for i in range(n)]]
    state = policy.initial_state(3)
    _, state = policy.act(np.zeros((3, 4), np.float32), state)
    assert [x.shape[0] for x in state.tensors] == [3] * n
