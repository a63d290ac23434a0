"""RecurrentPPO (sb3-contrib, an LSTM policy) as PPO-GTrXL's recurrent peer, from the same run config.

Given a ``gtrxl_ppo`` run config (e.g. ``configs/gtrxl/popgym_ppo.yaml`` with its overrides), this
trains sb3-contrib's ``RecurrentPPO`` (``MlpLstmPolicy``) on the same task with the same
environment steps and PPO settings, and evaluates it the way PPO-GTrXL is evaluated:

* environments: ``make_task(agent.env_id, **agent.env_kwargs)`` (POPGym ids, one-hot observations),
  ``agent.n_envs`` of them, rewards multiplied by ``agent.reward_scale`` for learning, observations
  normalised and clipped to +-10 by SB3's ``VecNormalize`` when ``agent.obs_norm``;
* budget: as many rollouts of ``agent.n_envs x agent.n_steps`` steps as PPO-GTrXL collects in
  ``train.steps`` updates (one rollout per ``agent.n_epochs x agent.n_minibatches`` updates, rounded
  up), each learnt from in ``agent.n_epochs`` passes of ``agent.n_minibatches`` minibatches, with
  ``agent.gamma``, ``agent.gae_lambda``, ``agent.clip_coef``, ``agent.ent_coef``, ``agent.vf_coef``,
  ``agent.norm_adv``, ``train.lr`` and ``train.grad_clip``;
* evaluation: :func:`~rl_tformers.runtime.evaluation.evaluate` of the policy (the mode when
  ``agent.deterministic``) every ``eval.every`` PPO-GTrXL-equivalent updates with reset seeds
  ``eval_seed(seed, step)``, logged to ``metrics.jsonl`` with PPO-GTrXL's keys (``step``,
  ``train/env_steps``, ``train/episodic_return``, ``eval/return_mean``, ...), then
  ``eval.episodes`` episodes with reset seeds 0, 1, ... (what ``rl-tformers eval RUN --episodes E``
  uses), written as ``eval.json`` in the shape of ``rl-tformers eval --json``.

The run directory holds ``config.yaml``, ``model.zip`` (an SB3 save file), ``obs_norm.npz`` (with
``agent.obs_norm``: the ``VecNormalize`` statistics in the layout
:func:`~rl_tformers.envs.policies.load_obs_norm` reads), ``metrics.jsonl`` and ``eval.json``.

Command: ``python -m rl_tformers.agents.gtrxl.recurrent_peer -c gtrxl/popgym_ppo run_dir=DIR [key=value ...]``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import typer
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.config import PPOAgentConfig
from rl_tformers.envs.environments import make_task
from sb3_contrib import RecurrentPPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from rl_tformers.runtime.evaluation import EvalReport, eval_seed, evaluate, report_logs, strict_json
from rl_tformers.runtime.run_config import ConfigError, compose, default_run_dir

KIND = "sb3_recurrent_ppo"
OBS_CLIP = 10.0  # as PPO-GTrXL's normalised inputs


@dataclass(frozen=True)
class PeerPlan:
    """What the peer trains on and how, read from a ``gtrxl_ppo`` run config (:meth:`from_config`)."""

    env_id: str
    env_kwargs: dict[str, Any]
    seed: int
    n_envs: int
    n_steps: int
    n_epochs: int
    n_minibatches: int
    rollouts: int
    algo: dict[str, Any]  # RecurrentPPO keyword arguments of the PPO settings
    reward_scale: float
    obs_norm: bool
    deterministic: bool
    eval_every: int  # PPO-GTrXL updates (0: no evaluation while training)
    eval_at_end: bool
    eval_episodes: int
    eval_n_envs: int

    @property
    def updates_per_rollout(self) -> int:
        """PPO-GTrXL updates per rollout (``n_epochs x n_minibatches``)."""
        return self.n_epochs * self.n_minibatches

    @property
    def env_steps(self) -> int:
        """Environment steps of the whole run (``rollouts x n_envs x n_steps``)."""
        return self.rollouts * self.n_envs * self.n_steps

    @classmethod
    def from_config(cls, cfg: Any) -> PeerPlan:
        """The plan of a composed run config.

        Raises:
            ConfigError: ``agent.kind`` is not ``gtrxl_ppo``, or ``agent.init_checkpoint`` is set
                (the peer trains from scratch only).
        """
        if str(cfg.agent.kind) != "gtrxl_ppo":
            raise ConfigError(f"agent.kind={cfg.agent.kind}: the recurrent peer reads a gtrxl_ppo config "
                              f"(e.g. -c gtrxl/popgym_ppo)")
        a = PPOAgentConfig.from_dict({k: v for k, v in OmegaConf.to_container(cfg.agent).items() if k != "kind"},
                                     where="agent")
        if a.init_checkpoint:
            raise ConfigError(f"agent.init_checkpoint={a.init_checkpoint}: the recurrent peer trains from scratch; "
                              f"drop agent.init_checkpoint")
        upr = int(a.n_epochs) * int(a.n_minibatches)
        rows = int(a.n_envs) * int(a.n_steps)
        algo = dict(n_steps=int(a.n_steps), batch_size=max(1, rows // int(a.n_minibatches)), n_epochs=int(a.n_epochs),
                    gamma=float(a.gamma), gae_lambda=float(a.gae_lambda), clip_range=float(a.clip_coef),
                    ent_coef=float(a.ent_coef), vf_coef=float(a.vf_coef), normalize_advantage=bool(a.norm_adv),
                    learning_rate=float(cfg.train.lr), max_grad_norm=float(cfg.train.grad_clip or 1e9))
        return cls(env_id=str(a.env_id), env_kwargs=dict(a.env_kwargs or {}), seed=int(cfg.seed), n_envs=int(a.n_envs),
                   n_steps=int(a.n_steps), n_epochs=int(a.n_epochs), n_minibatches=int(a.n_minibatches),
                   rollouts=math.ceil(int(cfg.train.steps) / upr), algo=algo, reward_scale=float(a.reward_scale),
                   obs_norm=bool(a.obs_norm), deterministic=bool(a.deterministic), eval_every=int(cfg.eval.every),
                   eval_at_end=bool(cfg.eval.at_end), eval_episodes=int(cfg.eval.episodes),
                   eval_n_envs=int(cfg.eval.n_envs))

    def make_env(self) -> gym.Env:
        """One evaluation environment: ``make_task(env_id, **env_kwargs)``."""
        return make_task(self.env_id, **self.env_kwargs)

    def training_env(self) -> DummyVecEnv | VecNormalize:
        """The ``n_envs`` training environments: Monitor (raw episode returns) under the reward
        scale, in SB3's ``VecNormalize`` (observations only, clipped to +-10) when ``obs_norm``."""
        def one() -> gym.Env:
            env = Monitor(self.make_env())
            scale = self.reward_scale
            return env if scale == 1.0 else gym.wrappers.TransformReward(env, lambda r: scale * r)

        venv = DummyVecEnv([one] * self.n_envs)
        if self.obs_norm:
            return VecNormalize(venv, norm_obs=True, norm_reward=False, clip_obs=OBS_CLIP, gamma=self.algo["gamma"])
        return venv


class RecurrentPPOPolicy:
    """A trained ``RecurrentPPO`` as a :class:`~rl_tformers.runtime.protocol.Policy`: the LSTM
    state (h, c) is the caller's; observations normalised with frozen ``VecNormalize`` statistics
    (``obs_norm``: ``mean``, ``var``, ``clip_obs``, ``epsilon``) when given."""

    def __init__(self, model: RecurrentPPO, obs_norm: dict[str, Any] | None, deterministic: bool = True) -> None:
        self.model, self.obs_norm, self.deterministic = model, obs_norm, deterministic

    def initial_state(self, n_envs: int, target_return: float | None = None) -> Any:
        """None: ``predict`` starts every row's LSTM state at zero (``target_return`` is ignored)."""
        return None

    def act(self, obs: np.ndarray, state: Any, episode_start: np.ndarray,
            last_reward: np.ndarray | None = None) -> tuple[np.ndarray, Any]:
        """(N, O) observations -> (N, *act_shape) actions and the next LSTM state; rows with
        ``episode_start`` start from a zero state."""
        o = np.asarray(obs, np.float32)
        if self.obs_norm is not None:
            n = self.obs_norm
            o = np.clip((o - n["mean"]) / np.sqrt(n["var"] + n["epsilon"]), -n["clip_obs"], n["clip_obs"])
        return self.model.predict(o, state=state, episode_start=np.asarray(episode_start, bool),
                                  deterministic=self.deterministic)


def _obs_norm(venv: Any) -> dict[str, Any] | None:
    """The frozen ``VecNormalize`` statistics of ``venv`` (None without one)."""
    if not isinstance(venv, VecNormalize):
        return None
    return {"mean": np.asarray(venv.obs_rms.mean, np.float64), "var": np.asarray(venv.obs_rms.var, np.float64),
            "clip_obs": float(venv.clip_obs), "epsilon": float(venv.epsilon)}


class _Curve(BaseCallback):
    """Evaluates every ``plan.eval_every`` PPO-GTrXL-equivalent updates and appends one
    ``metrics.jsonl`` line per evaluation (PPO-GTrXL's keys and reset seeds).

    The peer learns whole rollouts (``updates_per_rollout`` updates each), so it evaluates at the
    first rollout end at or after each multiple of ``eval_every``: where PPO-GTrXL evaluates
    inside a rollout's updates (``eval_every`` not a multiple of ``updates_per_rollout``), both
    have collected the same rollouts and the peer has learnt the rest of the last one."""

    def __init__(self, plan: PeerPlan, path: Path) -> None:
        super().__init__()
        self.plan, self.path, self.collected = plan, path, 0
        self.last_step: int | None = None

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        self.collected += 1  # SB3 calls this before it learns from the rollout: collected - 1 are learnt
        u, every = self.plan.updates_per_rollout, self.plan.eval_every
        step = (self.collected - 1) * u
        if every > 0 and step > 0 and step // every > (step - u) // every:  # passed a multiple of eval_every
            self.log_eval(step)

    def log_eval(self, step: int) -> None:
        """Evaluate the policy after ``step`` PPO-GTrXL-equivalent updates and append the line."""
        p = self.plan
        policy = RecurrentPPOPolicy(self.model, _obs_norm(self.model.get_env()), p.deterministic)
        report = evaluate(policy, p.make_env, [None], episodes=p.eval_episodes, n_envs=p.eval_n_envs,
                          seed=eval_seed(p.seed, step), env_id=p.env_id)
        returns = [float(e["r"]) for e in self.model.ep_info_buffer][-20:]  # PPO-GTrXL's window: 20 episodes
        line = {"step": step, "train/env_steps": float(step // p.updates_per_rollout * p.n_envs * p.n_steps),
                **({"train/episodic_return": float(np.mean(returns))} if returns else {}), **report_logs(report)}
        with self.path.open("a") as f:
            f.write(strict_json(line) + "\n")
        self.last_step = step


def train_peer(cfg: Any, run_dir: Path, *, lstm_hidden: int = 256, device: str = "cpu") -> EvalReport:
    """Train the peer of ``cfg`` (a composed ``gtrxl_ppo`` config) in ``run_dir`` and evaluate it.

    Returns:
        The final evaluation (``eval.episodes`` episodes, reset seeds 0, 1, ...), also written to
        ``run_dir/eval.json`` with ``extra`` = run_dir, checkpoint, step, kind, env_steps,
        train_seconds.

    Raises:
        ConfigError: see :meth:`PeerPlan.from_config`; MissingExtraError (a ValueError): a POPGym
            id without the popgym extra.
    """
    plan = PeerPlan.from_config(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    venv = plan.training_env()
    model = RecurrentPPO("MlpLstmPolicy", venv, seed=plan.seed, device=device, verbose=0,
                         policy_kwargs={"lstm_hidden_size": int(lstm_hidden)}, **plan.algo)
    curve = _Curve(plan, run_dir / "metrics.jsonl")
    t0 = time.perf_counter()
    model.learn(total_timesteps=plan.env_steps, callback=curve)
    seconds = time.perf_counter() - t0
    final = plan.rollouts * plan.updates_per_rollout
    if plan.eval_at_end and curve.last_step != final:
        curve.model = model
        curve.log_eval(final)
    model.save(run_dir / "model.zip")
    norm = _obs_norm(venv)
    if norm is not None:
        np.savez(run_dir / "obs_norm.npz", **norm)
    report = evaluate(RecurrentPPOPolicy(model, norm, plan.deterministic), plan.make_env, [None],
                      episodes=plan.eval_episodes, n_envs=plan.eval_n_envs, seed=0, env_id=plan.env_id)
    report.extra.update({"run_dir": str(run_dir), "checkpoint": str(run_dir / "model.zip"), "step": final,
                         "kind": KIND, "env_steps": int(model.num_timesteps), "train_seconds": seconds})
    (run_dir / "eval.json").write_text(strict_json(report.to_dict(), indent=2))
    return report


def main(
    overrides: list[str] = typer.Argument(None, help="Dotted key=value overrides of the config (run_dir=DIR names the "
                                                     "run directory)."),
    config: str = typer.Option("gtrxl/popgym_ppo", "--config", "-c", help="A gtrxl_ppo config: the task, budget, "
                                                                          "PPO settings and evaluation."),
    lstm_hidden: int = typer.Option(256, min=1, help="LSTM hidden size of the actor and of the critic."),
    device: str = typer.Option("cpu", help="Torch device of RecurrentPPO."),
) -> None:
    """Train RecurrentPPO on a gtrxl_ppo config's task and budget; print the final evaluation as JSON."""
    try:
        cfg = compose(config, list(overrides or []))
        run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg, f"{config}-{KIND}")
        if (run_dir / "model.zip").exists():
            raise ConfigError(f"run_dir={run_dir} already holds a trained peer (model.zip); name another run_dir")
        report = train_peer(cfg, run_dir, lstm_hidden=lstm_hidden, device=device)
    except ValueError as exc:  # ConfigError, MissingExtraError, an environment that cannot be encoded
        typer.echo("error: " + " ".join(str(exc).split()), err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(report.to_dict(), indent=2))


if __name__ == "__main__":
    typer.run(main)
