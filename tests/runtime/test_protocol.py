"""A new agent defined in this file alone goes through ``train -> eval -> plot`` on the command line.

The agent knows only :mod:`rl_tformers.runtime.protocol`, the agent registry and the evaluation
module: a linear policy on CartPole-v1 trained to copy a scripted controller (push toward the
side the pole falls to) on observations drawn from a fixed normal distribution. Nothing of the
package is edited to add it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import agent_registry
from rl_tformers.runtime.agent_registry import get_agent, register_agent
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.protocol import EvaluableAgent, Policy, Trainable
from rl_tformers.typed_config import TypedConfig, option

KIND = "protocol_linear"
runner = CliRunner()


@dataclass(frozen=True)
class LinearConfig(TypedConfig):
    """``agent:`` of ``agent.kind=protocol_linear``."""

    obs_scale: float = option(0.5, "std of the training observations", gt=0)
    target: float = option(500.0, "the target return evaluated by default (the policy ignores it)")


class Batches(torch.utils.data.Dataset):
    """Batch ``s``: (64, 4) observations and the controller's actions, from ``rng([seed, s])``."""

    def __init__(self, seed: int, scale: float, steps: int) -> None:
        self.seed, self.scale, self.steps = seed, scale, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, s: int) -> dict[str, torch.Tensor]:
        obs = np.random.default_rng([self.seed, s]).normal(0.0, self.scale, (64, 4)).astype(np.float32)
        action = (obs[:, 2] + obs[:, 3] > 0).astype(np.int64)  # pole angle + angular velocity
        return {"obs": torch.from_numpy(obs), "action": torch.from_numpy(action)}


class LinearPolicy:
    """The :class:`Policy`: argmax of the linear logits; no state."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def initial_state(self, n_envs: int, target_return: float | None = None) -> None:
        return None

    def act(self, obs, state, episode_start, last_reward=None):
        with torch.no_grad():
            logits = self.model(torch.as_tensor(obs, dtype=torch.float32))  # (N, 2)
        return logits.argmax(-1).numpy(), state


class LinearAgent:
    """Both sides of the protocol: :class:`Trainable` and :class:`EvaluableAgent`."""

    def __init__(self, cfg: Any) -> None:
        self.options = get_agent(KIND).agent_options(dict(cfg.agent))
        self.seed, self.steps = int(cfg.seed), int(cfg.train.steps)
        self.episodes, self.n_envs = int(cfg.eval.episodes), int(cfg.eval.n_envs)
        self.model = torch.nn.Linear(4, 2)

    def batches(self, start_step: int) -> Batches:
        return Batches(self.seed, self.options.obs_scale, self.steps)

    def loss(self, batch):
        loss = torch.nn.functional.cross_entropy(self.model(batch["obs"]), batch["action"])
        return loss, {}

    def policy(self) -> LinearPolicy:
        return LinearPolicy(self.model)

    def make_env(self):
        return lambda: gym.make("CartPole-v1")

    def default_targets(self) -> list[float]:
        return [self.options.target]

    def evaluate(self, step: int) -> dict[str, float]:
        report = evaluate(self.policy(), self.make_env(), self.default_targets(), episodes=self.episodes,
                          n_envs=self.n_envs, seed=eval_seed(self.seed, step), env_id="CartPole-v1")
        return report_logs(report)

    def extra_state(self) -> dict[str, Any]:
        return {"env_id": "CartPole-v1"}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        assert state == {"env_id": "CartPole-v1"}


def build(cfg: Any, run_dir: Path, device: torch.device) -> LinearAgent:
    return LinearAgent(cfg)


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    """The kind is registered while this module's tests run, and only then: other tests see
    the package's own registry."""
    register_agent(KIND, description="linear CartPole policy (protocol test)", config_cls=LinearConfig)(build)
    yield
    agent_registry._AGENTS.pop(KIND, None)


def test_the_test_agent_implements_both_sides_of_the_protocol() -> None:
    cfg = OmegaConf.create({"seed": 0, "agent": {"kind": KIND}, "train": {"steps": 3},
                            "eval": {"episodes": 1, "n_envs": 1}})
    agent = build(cfg, Path("."), torch.device("cpu"))
    assert isinstance(agent, Trainable) and isinstance(agent, EvaluableAgent)
    assert isinstance(agent.policy(), Policy)
    assert get_agent(KIND).config_cls is LinearConfig


def test_a_new_agent_trains_evaluates_and_plots_through_the_cli(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", f"agent.kind={KIND}", "agent.obs_scale=0.3", "train.steps=40", "train.lr=0.05",
                            "train.log_every=20", "train.checkpoint_every=40", "train.progress=false",
                            "eval.episodes=2", "eval.n_envs=2", "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step_000000040.pt").is_file()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [rec for rec in logged if "eval/return_mean" in rec]
    assert len(final) == 1 and final[0]["step"] == 40 and final[0]["eval/target"] == 500.0

    out = tmp_path / "eval.json"
    r = runner.invoke(app, ["eval", str(run), "--episodes", "3", "--envs", "2", "--seed", "7", "--json",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert set(report) == {"env_id", "episodes", "n_envs", "seed", "seconds", "extra", "results"}
    assert (report["env_id"], report["episodes"], report["n_envs"], report["seed"]) == ("CartPole-v1", 3, 2, 7)
    assert report["extra"]["kind"] == KIND and report["extra"]["step"] == 40
    (res,) = report["results"]
    assert res["target_return"] == 500.0 and res["seeds"] == [7, 8, 9] and len(res["returns"]) == 3
    assert set(res) == {"target_return", "returns", "return_mean", "return_std", "normalized_score",
                        "normalized_score_std", "lengths", "seeds"}
    assert json.loads(out.read_text())["results"][0]["returns"] == res["returns"]

    r = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "plot.png"), "--targets", "100,500",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "plot.png").stat().st_size > 0 and f"wrote {tmp_path / 'plot.png'}" in r.output
