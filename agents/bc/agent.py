"""Behaviour cloning and filtered behaviour cloning (%BC) for the shared trainer (``agent.kind=bc``).

BC fits an MLP from the current observation to the dataset action (:mod:`.model`, :mod:`.loss`).
``agent.top_fraction=0.1`` trains on the best 10% of episodes by return only: the "%BC"
baseline of the Decision Transformer paper (Chen et al. 2021, section 5.2), which asks whether
DT's gains come from return conditioning or merely from imitating the good episodes.

Batches come from the data layer's :class:`~rl_tformers.envs.samplers.WindowSampler` with
``K = 1`` (uniform over the steps of the kept episodes), drawn per step from
``default_rng([seed, s])`` like every agent's, so BC, %BC and DT see comparable data streams.
Evaluation, checkpoint state and inference loading mirror the Decision Transformer agent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.bc.config import BCAgentConfig
from rl_tformers.agents.bc.loss import bc_loss
from rl_tformers.agents.bc.model import BCConfig, BCModel
from rl_tformers.agents.common.encoders import check_observations, observation_layout
from rl_tformers.agents.common.offline import (
    DatasetInfo,
    flattens_observations,
    load_offline_dataset,
    plain,
)
from rl_tformers.agents.decision_transformer.model import from_env_action, to_env_action
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.envs.trajectory import ObsStats, top_fraction
from torch import Tensor

from rl_tformers.registry import SLOTS
from rl_tformers.runtime.agent_registry import register_agent
from rl_tformers.runtime.eval_profile import span
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.loading import register_inference_loader

#: Registered defaults of ``agent.kind=bc`` (its ``agent`` section: :class:`BCAgentConfig`'s)
BC_DEFAULTS: dict[str, Any] = {
    "agent": BCAgentConfig().to_dict(),
    "train": {
        "batch_size": 64, "lr": 1.0e-4, "weight_decay": 1.0e-4, "grad_clip": 0.25,
        "schedule": "linear_warmup", "warmup_steps": 10000, "steps": 100000,
    },
    "eval": {"episodes": 10, "n_envs": 10},
}


class BCPolicy:
    """Stateless :class:`~rl_tformers.agents.common.policy.Policy` of a :class:`BCModel` (N envs, one forward)."""

    def __init__(self, model: BCModel, info: DatasetInfo) -> None:
        self.model = model.eval()
        self.info = info
        dev = next(model.parameters()).device
        self.mean = torch.as_tensor(info.obs_mean, device=dev)
        self.std = torch.as_tensor(info.obs_std, device=dev)
        if not info.discrete:
            self.low = torch.as_tensor(info.action_low, device=dev)
            self.high = torch.as_tensor(info.action_high, device=dev)
        self.device = dev

    def initial_state(self, n_envs: int, target_return: float | None = None) -> None:
        """``None``: the policy is memoryless and ignores ``target_return``."""
        return None

    @torch.no_grad()
    def act(self, obs: np.ndarray, state: None, episode_start: np.ndarray,
            last_reward: np.ndarray | None = None) -> tuple[np.ndarray, None]:
        """obs (N, *obs_shape) raw -> actions (N, *action_shape) in the box (the model's flat
        (N, A) in the environment's shape, :attr:`DatasetInfo.action_shape`), or (N,) int64 in
        ``[action_start, action_start + n)``."""
        n = len(episode_start)
        with span("context"):
            x = torch.as_tensor(np.asarray(obs, np.float32), device=self.device).reshape(n, -1)
            x = (x - self.mean) / self.std
        with span("forward"):
            y = self.model(x)  # (N, A) or (N, n_actions)
        with span("decode"):
            if self.info.discrete:  # class index -> environment action
                return y.argmax(-1).cpu().numpy().astype(np.int64) + self.info.action_start, None
            env_a = to_env_action(y, self.low, self.high).cpu().numpy().astype(np.float32)  # (N, A)
        return env_a.reshape(n, *self.info.action_shape), None


class BCAgent:
    """BC / %BC as a :class:`~rl_tformers.runtime.agent_registry.Trainable` (see the module docstring).

    Args:
        cfg: resolved run config. dataset: preloaded dataset (tests). info: checkpoint statistics
            for inference-only construction.

    Raises:
        ValueError: a bad ``agent.*`` option (a ``ConfigFieldError`` naming it); backbone
            components set; unbounded actions.
    """

    def __init__(self, cfg: Any, run_dir: Path | None, device: torch.device | str,
                 dataset: EpisodeDataset | None = None, info: DatasetInfo | None = None) -> None:

        a = BCAgentConfig.from_dict({k: v for k, v in plain(cfg.agent).items() if k != "kind"}, where="agent")
        self.options = a
        self.cfg = cfg
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.dataset = dataset

        # an MLP: a backbone component (memory, depth kind...) would be silently ignored; sizes
        # (backbone.d_model...) shared by the overrides of several agents are let through
        slots = sorted(k for k in (plain(cfg.get("backbone")) or {}) if k in SLOTS)
        if slots:
            raise ValueError(
                f"agent.kind=bc is an MLP on the current observation and has no backbone, but the config sets "
                f"backbone.{', backbone.'.join(slots)}; drop them (GTrXL, agent.kind=gtrxl, or the DT, "
                f"agent.kind=dt, take backbone components)")
        frac = float(a.top_fraction)
        if info is None:
            if self.dataset is None:
                self.dataset = load_offline_dataset(plain(cfg.dataset))
            check_observations(a.encoder, *observation_layout(self.dataset),
                               f"the dataset {plain(cfg.dataset).get('path') or self.dataset.metadata.location}")
            if frac != 1.0:
                full = self.dataset
                self.dataset = top_fraction(full, frac)
                logging.getLogger(__name__).info(
                    "agent.top_fraction=%g: training on %d of %d episodes (%d of %d steps), returns >= %.1f",
                    frac, self.dataset.num_episodes, full.num_episodes, self.dataset.num_steps, full.num_steps,
                    float(np.min(self.dataset.episode_returns)))
            info = DatasetInfo.from_dataset(
                self.dataset, normalize_obs=a.normalize_obs, env_id=a.env_id, env_kwargs=a.env_kwargs,
                spec=plain(cfg.dataset).get("path"), flatten_observations=flattens_observations(plain(cfg.dataset)),
            )
        self.info = info
        self.model_cfg = BCConfig(obs_dim=info.obs_dim, act_dim=info.act_dim, discrete=info.discrete,
                                  hidden=a.hidden, dropout=float(a.dropout), obs_shape=info.obs_shape,
                                  encoder=a.encoder)
        self.model = BCModel(self.model_cfg).to(self.device)

    def batches(self, start_step: int):
        """Step-indexed dataset of single steps (WindowSampler, K = 1)."""

        if self.dataset is None:
            raise RuntimeError("this BC agent was loaded for inference only (no dataset)")
        shape = self.dataset.observation_shape
        stats = None if self.info.image_obs else ObsStats(  # images: scaled in the encoder, not standardised
            self.info.obs_mean.reshape(shape), self.info.obs_std.reshape(shape))
        sampler = WindowSampler(self.dataset, 1, obs_stats=stats)
        return StepBatchDataset(sampler, int(self.cfg.train.batch_size), seed=self.seed, num_steps=int(self.cfg.train.steps))

    def loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """:func:`bc_loss` on one sampler batch (windows of one step)."""
        obs = batch["observations"][:, 0]  # (B, *obs_shape): images go to the encoder as they come (uint8)
        if not self.info.image_obs:
            obs = obs.reshape(obs.shape[0], -1).float()  # (B, obs_dim)
        act = batch["actions"][:, 0]  # (B, *action_shape) or (B,)
        if self.info.discrete:  # class indices in [0, n)
            act = torch.where(batch["mask"][:, 0].bool(), act.long() - self.info.action_start, 0)
        else:
            low = torch.as_tensor(self.info.action_low, device=act.device)
            high = torch.as_tensor(self.info.action_high, device=act.device)
            act = from_env_action(act.reshape(act.shape[0], self.info.act_dim).float(), low, high)  # (B, A)
        return bc_loss(self.model, {"obs": obs, "actions": act, "mask": batch["mask"][:, 0]})

    def policy(self) -> BCPolicy:
        """A :class:`BCPolicy` of the current weights (puts the model in eval mode)."""
        return BCPolicy(self.model, self.info)

    def make_env(self):
        """Zero-argument factory of one evaluation environment (:meth:`DatasetInfo.make_env`)."""
        return self.info.make_env()

    def default_targets(self) -> list[None]:
        """BC is not return-conditioned: one unconditioned evaluation."""
        return [None]

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean/std return (and D4RL-normalised score when references exist) over ``eval.episodes``."""
        was_training = self.model.training
        report = evaluate(
            self.policy(), self.make_env(), [None], episodes=int(self.cfg.eval.episodes),
            n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step),
            normalize=self.info.normalizer(), env_id=self.info.env_id,
        )
        self.model.train(was_training)
        return report_logs(report)

    def extra_state(self) -> dict[str, Any]:
        """The dataset statistics saved with a checkpoint (:meth:`DatasetInfo.to_extra`)."""
        return self.info.to_extra()

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Take the checkpoint's dataset statistics (``--resume``).

        Raises:
            AgentBuildError: the dataset read now (``dataset.path``, filtered by
                ``agent.top_fraction``) is not the data the checkpoint was trained on: its
                statistics differ (:meth:`DatasetInfo.check_resumed_data`, as for the DT).
        """
        saved = DatasetInfo.from_extra(state)
        if self.dataset is not None:  # training (not an inference-only agent): the data must be the run's
            saved.check_resumed_data(self.info, plain(self.cfg.dataset).get("path"))
        self.info = saved


def load_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> BCAgent:
    """A :class:`BCAgent` rebuilt from a checkpoint dict without its dataset."""
    agent = BCAgent(cfg, None, device, info=DatasetInfo.from_extra(state["extra"]))
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


@register_agent("bc", description="Behaviour cloning MLP; agent.top_fraction=0.1 gives %BC (Chen et al. 2021)",
                defaults=BC_DEFAULTS, config_cls=BCAgentConfig)
def build_bc(cfg: Any, run_dir: Path, device: torch.device) -> BCAgent:
    """Builder of ``agent.kind=bc``."""
    return BCAgent(cfg, run_dir, device)


register_inference_loader("bc")(load_for_inference)
