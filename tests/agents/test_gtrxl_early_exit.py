"""Early exit in GTrXL when acting (CALM): steps exit per environment, the memory of the skipped
layers holds the exited state, the full model is unchanged without exits; training on every
exit, calibration on held-out episodes, and the evaluation options."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from rl_tformers.agents.gtrxl.agent import GTrXLAgent, GTrXLPolicy
from rl_tformers.agents.gtrxl.early_exit import EarlyExitPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import train
from tests.threads import one_thread

_one_thread = one_thread  # autouse, module scope: one torch thread

N_LAYERS = 3
FAST = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=2", "train.progress=false", "train.log_every=2",
        "train.checkpoint_every=4", "device=cpu", "eval.every=0", "eval.at_end=false"]
TINY = ["backbone.d_model=16", f"backbone.n_layers={N_LAYERS}", "backbone.n_heads=2", "agent.seq_len=8",
        "agent.burn_in=4", "backbone.memory={kind: xl, mem_len: 4}", "dataset.path=null",
        "dataset.scripted={task: recall, episodes: 40, delay: 2}", "eval.episodes=2", "eval.n_envs=2"]
EARLY = ["backbone.depth={kind: early_exit, confidence: classifier}", "agent.early_exit.windows=60"]


def _policy(discrete: bool = True, seed: int = 0) -> GTrXLPolicy:
    torch.manual_seed(seed)
    bb = {**gtrxl_backbone(d_model=16, n_layers=N_LAYERS, n_heads=2, mem_len=4),
          "depth": {"kind": "early_exit", "confidence": "classifier"}}
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, discrete=discrete, backbone=bb))
    kw = {} if discrete else {"action_low": -np.ones(2), "action_high": np.ones(2)}
    return GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3), **kw)


def _run(policy, steps: int = 6, n: int = 2, seed: int = 1):
    rng = np.random.default_rng(seed)
    state = policy.initial_state(n)
    actions, states = [], []
    for i in range(steps):
        a, state = policy.act(rng.normal(size=(n, 3)).astype(np.float32), state, np.full(n, i == 0))
        actions.append(a)
        states.append(state)
    return np.stack(actions), states


def _newest(state, layer: int) -> torch.Tensor:
    return state.memory.layers[layer].memory[:, -1]  # (N, D): the input of `layer` stored for the newest step


def test_threshold_zero_exits_every_step_after_layer_one():
    pol = EarlyExitPolicy(_policy(), 0.0)
    _run(pol)
    assert pol.stats() == {"exit_layers_run": 1.0, "exit_mean_layer": 1.0, "exit_early_frac": 1.0}


@pytest.mark.parametrize("threshold", [None, 1.5, math.inf])
def test_without_exits_the_actions_and_memory_are_the_full_models(threshold):
    plain = _policy(discrete=False)
    ee = EarlyExitPolicy(_policy(discrete=False), threshold)
    a_plain, s_plain = _run(plain)
    a_ee, s_ee = _run(ee)
    assert np.array_equal(a_plain, a_ee)
    for sp, se in zip(s_plain, s_ee):
        for lp, le in zip(sp.memory.layers, se.memory.layers):
            assert torch.equal(lp.memory, le.memory)
    assert ee.stats() == {"exit_layers_run": float(N_LAYERS), "exit_mean_layer": float(N_LAYERS), "exit_early_frac": 0.0}


def test_the_skipped_layers_memory_holds_the_exited_state():
    # first step (empty memory): layer 1's output does not depend on the threshold, so the full
    # model's input of layer 2 is the exited state; every skipped layer stores exactly it
    _, (full,) = _run(_policy(), steps=1)
    pol = EarlyExitPolicy(_policy(), 0.0)
    _, (early,) = _run(pol, steps=1)
    assert torch.equal(_newest(early, 0), _newest(full, 0))  # layer 1 ran as in the full model
    h1 = _newest(full, 1)  # (N, D) layer 1's output
    for layer in range(1, N_LAYERS):
        assert torch.equal(_newest(early, layer), h1)
    # the features the actor read are the exited state through the final norm
    model = pol.base.model
    x = model.encoder.inputs(torch.as_tensor(np.random.default_rng(1).normal(size=(2, 1, 3)), dtype=torch.float32))
    out = model.encoder(x, torch.zeros(2, 1, dtype=torch.long), state=model.encoder.initial_state(2),
                        exit_threshold=0.0)
    assert torch.equal(out.features[:, 0], model.encoder.backbone.final_norm(h1))


def test_rows_that_do_not_decide_stop_with_the_exited_ones():
    # row 1 is a finished environment (count_rows): it does not decide, so the loop stops once
    # row 0 exited, and row 1's (discarded) step is copied upward as well
    _, (full,) = _run(_policy(), steps=1)
    pol = EarlyExitPolicy(_policy(), 0.0)
    pol.count_rows(np.array([True, False]))
    _, (early,) = _run(pol, steps=1)
    for layer in range(1, N_LAYERS):
        assert torch.equal(_newest(early, layer), _newest(full, 1))
    assert pol.stats() == {"exit_layers_run": 1.0, "exit_mean_layer": 1.0, "exit_early_frac": 1.0}


def test_a_row_that_exits_next_to_one_that_does_not_fills_only_its_own_memory():
    pol = _policy()
    enc = pol.model.encoder.eval()
    x = enc.inputs(torch.as_tensor(np.random.default_rng(1).normal(size=(2, 1, 3)), dtype=torch.float32))
    pos = torch.zeros(2, 1, dtype=torch.long)
    full = enc(x, pos, state=enc.initial_state(2))
    mixed = enc(x, pos, state=enc.initial_state(2), exit_layers=torch.tensor([[0], [N_LAYERS - 1]]))
    assert mixed.metrics["exit/layers_run"] == N_LAYERS
    h1 = full.state.layers[1].memory[:, -1]  # (2, D) layer 1's output
    for layer in range(1, N_LAYERS):
        assert torch.equal(mixed.state.layers[layer].memory[0, -1], h1[0])  # row 0: the exited state
        assert torch.equal(mixed.state.layers[layer].memory[1, -1], full.state.layers[layer].memory[1, -1])
    assert torch.equal(mixed.features[1], full.features[1])
    assert torch.equal(mixed.features[0, 0], enc.backbone.final_norm(h1[0]))


def test_the_wrapper_refuses_a_model_without_the_depth_kind_and_another_wrapper():
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, discrete=True,
                                   backbone=gtrxl_backbone(d_model=16, n_layers=2, n_heads=2, mem_len=4)))
    plain = GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3))
    with pytest.raises(ValueError, match="backbone.depth.kind=early_exit"):
        EarlyExitPolicy(plain)
    with pytest.raises(TypeError, match="wraps the plain GTrXL policy"):
        EarlyExitPolicy(EarlyExitPolicy(_policy()))


@pytest.fixture(scope="module")
def early_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "gtrxl_ee"
    train(compose("gtrxl/recall_bc", [*TINY, *FAST, *EARLY]), run_dir)
    return run_dir


def _eval(run_dir, *args, code: int = 0):
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--episodes", "2", "--envs", "2", "--json", *args])
    assert res.exit_code == code, res.output
    return json.loads(res.output) if code == 0 else res.output


def test_training_fits_the_actor_on_every_layer_and_the_exit_classifier(early_run):
    rec = [json.loads(line) for line in (early_run / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in rec if "train/loss" in r]
    assert {f"exit/loss_layer{n}" for n in range(1, N_LAYERS + 1)} <= set(rec[-1])
    assert all(r[f"exit/agree_layer{N_LAYERS}"] == 1.0 for r in rec)  # the last layer agrees with itself
    assert all(r["exit/classifier_loss"] > 0 for r in rec)


def test_the_classifier_gets_gradients_and_the_held_out_episodes_are_not_trained_on():
    cfg = compose("gtrxl/recall_bc", [*TINY, *FAST, *EARLY])
    agent = GTrXLAgent(cfg, None, "cpu")
    loss, _ = agent.loss(next(iter(agent.batches(0))))
    loss.backward()
    assert agent.model.encoder.backbone.depth.exit_classifier.weight.grad.abs().sum() > 0
    held = agent.inference.heldout_mask(agent.dataset.num_episodes)
    assert held.sum() == 2 and held[19] and held[39]  # every 20th of 40 episodes
    trained = agent.batches(0).sampler.dataset
    assert trained.num_episodes == 38


def test_eval_exits_at_layer_one_at_threshold_zero_and_equals_the_full_model_above_one(early_run):
    full = _eval(early_run)
    assert full["extra"]["exit_mean_layer"] == N_LAYERS and full["extra"]["exit_layers_run"] == N_LAYERS
    zero = _eval(early_run, "--early-exit", "0")
    assert zero["extra"]["exit_mean_layer"] == 1.0 and zero["extra"]["exit_layers_run"] == 1.0
    assert zero["extra"]["early_exit"] == {"threshold": 0.0}
    never = _eval(early_run, "--early-exit", "1.5")
    assert never["extra"]["exit_layers_run"] == N_LAYERS
    assert [r["returns"] for r in never["results"]] == [r["returns"] for r in full["results"]]


def test_calibration_meets_delta_on_the_held_out_episodes(early_run):
    out = _eval(early_run, "--early-exit", "calibrate")
    cal = out["extra"]["early_exit"]
    assert cal["n"] == 60 and cal["heldout_episodes"] == 2 and cal["delta"] == 0.1
    risks = {float(t): r for t, r in cal["risks"].items()}
    if cal["threshold"] is not None:
        assert all(r < cal["delta"] for t, r in risks.items() if t >= cal["threshold"])
    # the calibration replays acting: at threshold 0 its decisions are those of the wrapper
    run = load_run(early_run)
    run.agent.inference.set_exit_threshold(0.0)
    assert isinstance(run.agent.policy(), EarlyExitPolicy)


def test_early_exit_is_refused_without_the_depth_kind_and_with_iql(tmp_path):
    train(compose("gtrxl/recall_bc", [*TINY, *FAST]), tmp_path / "plain")
    out = _eval(tmp_path / "plain", "--early-exit", "0.5", code=2)
    assert "backbone.depth.kind=early_exit" in out
    with pytest.raises(ConfigError, match=r"^agent\.early_exit\.threshold=0\.5: early exit needs an actor trained"):
        compose("gtrxl/recall_bc", [*TINY, "agent.objective=iql", "agent.early_exit.threshold=0.5"])
