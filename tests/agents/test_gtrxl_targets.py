"""Return-conditioned GTrXL (``rcbc``): target returns the float32 token embedding cannot take are
refused with an error naming the option (``agent.target_return`` at build, ``--targets`` at
eval/plot), as the Decision Transformer does (GTrXLPolicy.target_limit)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.agent import GTRXL_DEFAULTS, GTrXLAgent, GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

runner = CliRunner()
TINY = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)


def _policy(rtg_scale: float = 10.0) -> GTrXLPolicy:
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, rtg_input=True, backbone=TINY))
    return GTrXLPolicy(
        model,
        obs_mean=np.zeros(3),
        obs_std=np.ones(3),
        action_low=-np.ones(2),
        action_high=np.ones(2),
        rtg_scale=rtg_scale,
    )


def _finite_actions(pol: GTrXLPolicy, target: float) -> bool:
    state = pol.initial_state(2, target)
    ok = True
    for t in range(4):
        a, state = pol.act(np.full((2, 3), 0.5, np.float32), state, np.array([t == 0, t == 0]), np.ones(2))
        ok = ok and bool(np.isfinite(a).all())
    return ok


def test_target_limit_is_where_the_float32_token_embedding_still_holds(monkeypatch) -> None:
    pol = _policy(rtg_scale=10.0)
    emb = pol.model.encoder.embed
    w = emb.weight.detach()[:, 3]  # (d,): the return-to-go column (after the 3 observation inputs)
    half = math.sqrt(torch.finfo(torch.float32).max / 16) / 8  # M / 2, d = 16
    expected = (half - float(emb.bias.detach().abs().max())) / float(w.abs().max()) * 10.0
    limit = pol.target_limit()
    assert limit == expected and 1e17 < limit < 1e21
    assert _policy(rtg_scale=1000.0).target_limit() == pytest.approx(
        100 * limit, rel=1e-12
    )  # scales with rtg_scale
    assert _finite_actions(pol, limit) and _finite_actions(pol, -limit)  # the largest accepted targets act
    with pytest.raises(
        ValueError,
        match=r"^target return: 1e\+30 is beyond what this model takes: \|target\| "
        r"must be at most .*reward scale 10.*NaN actions",
    ):
        pol.initial_state(2, 1e30)
    pol.check_targets([10.0, -limit, None])
    with pytest.raises(ValueError, match=r"^--targets: .* must be at most"):
        pol.check_targets([10.0, 2 * limit], option="--targets")
    with pytest.raises(ValueError, match=r"^--targets: inf is not a finite number"):
        pol.check_targets([math.inf], option="--targets")
    # what the limit prevents: without it, a target far above it turns every action into NaN
    monkeypatch.setattr(GTrXLPolicy, "target_limit", lambda self: math.inf)
    assert not _finite_actions(pol, 1e30)


def test_unconditioned_policy_has_no_target_limit() -> None:
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=TINY))
    pol = GTrXLPolicy(
        model, obs_mean=np.zeros(3), obs_std=np.ones(3), action_low=-np.ones(2), action_high=np.ones(2)
    )
    assert pol.target_limit() == math.inf
    pol.initial_state(2)  # no target needed, nothing checked


def _agent_cfg(**agent):
    return OmegaConf.create(
        {
            "seed": 0,
            "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 8, "burn_in": 4, **agent},
            "backbone": TINY,
            "dataset": {"scripted": {"task": "recall", "episodes": 20, "delay": 2}},
            "train": {"batch_size": 8, "steps": 4},
            "eval": {"episodes": 2, "n_envs": 2},
        }
    )


@pytest.mark.parametrize(
    "target, says",
    [
        (1e30, r"^agent\.target_return: 1e\+30 is beyond what this model takes: \|target\| must be at most "),
        (-1e30, r"^agent\.target_return: -1e\+30 is beyond what this model takes"),
        (".inf", r"^agent\.target_return must be a finite number or null, got inf \(float\)$"),
        ("many", r"^agent\.target_return must be a finite number or null, got 'many' \(str\)$"),
    ],
)
def test_agent_refuses_a_target_return_beyond_the_embedding_when_built(target, says) -> None:
    value = float("inf") if target == ".inf" else target
    with pytest.raises(ValueError, match=says):
        GTrXLAgent(_agent_cfg(objective="rcbc", target_return=value), None, torch.device("cpu"))


def test_agent_accepts_a_reachable_target_return_and_stays_in_training_mode() -> None:
    agent = GTrXLAgent(_agent_cfg(objective="rcbc", target_return=32.0), None, torch.device("cpu"))
    assert agent.model.training and agent.default_targets() == [32.0]
    # a bc agent has no return input: agent.target_return is not used, so not checked
    GTrXLAgent(_agent_cfg(objective="bc", target_return=1e30), None, torch.device("cpu"))


@pytest.fixture(scope="module")
def rcbc_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rcbc")
    data = root / "recall-d2.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), data)
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl",
            "agent.objective=rcbc",
            "agent.seq_len=4",
            "agent.burn_in=4",
            f"dataset.path={data}",
            "train.steps=2",
            "train.batch_size=4",
            "train.progress=false",
            "eval.at_end=false",
            "eval.every=0",
            "device=cpu",
            "backbone.d_model=16",
            "backbone.n_layers=1",
            "backbone.n_heads=2",
            "backbone.memory.mem_len=4",
        ]
    )
    train(cfg, root / "run")
    return root / "run"


def _tripwire(*args, **kwargs):
    raise AssertionError("evaluate must not run for a refused target")


@pytest.mark.parametrize("command", ["eval", "plot"])
def test_eval_and_plot_refuse_a_target_beyond_the_embedding_up_front(
    rcbc_run: Path, tmp_path: Path, monkeypatch, command: str
) -> None:
    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    extra = ["--json"] if command == "eval" else ["--out", str(tmp_path / "p.png"), "--no-tensorboard"]
    r = runner.invoke(
        app, [command, str(rcbc_run), "--targets", "20,1e30", "--episodes", "1", "--envs", "1", *extra]
    )
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(
        "error: --targets: 1e+30 is beyond what this model takes: |target| must be at most "
    ), r.stderr
    assert "NaN" in r.stderr and r.stdout == ""
    assert not (tmp_path / "p.png").exists()


def test_eval_names_agent_target_return_when_the_runs_default_target_is_refused(
    rcbc_run: Path, monkeypatch
) -> None:
    """A run's own default target (``agent.target_return``, e.g. from a run made before the limit
    existed) beyond the embedding: the error names GTrXL's option, not the DT's ``agent.targets``."""
    from rl_tformers.agents.gtrxl.agent import GTrXLAgent

    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", _tripwire)
    monkeypatch.setattr(GTrXLAgent, "default_targets", lambda self: [1e30])
    r = runner.invoke(app, ["eval", str(rcbc_run), "--episodes", "1", "--envs", "1"])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(
        "error: agent.target_return (the run's default targets; give --targets): 1e+30 is beyond"
    ), r.stderr
