"""Decision Transformer agent (Chen et al. 2021): optimiser glue, training batches, acting,
evaluation and checkpoint state, for the shared trainer (``agent.kind=dt``).

Read top to bottom, a training run is::

    dataset  = load_offline_dataset(cfg.dataset)              # Minari id / folder / D4RL .hdf5
    info     = DatasetInfo.from_dataset(dataset)              # obs mean/std, reward scale, bounds
    sampler  = WindowSampler(dataset, K, align=agent.align)   # "start" (paper) or "end"
    batch s  = sampler.sample(B, default_rng([seed, s]))      # windows of K steps, RTG / scale
    loss     = dt_loss(model, to_model_batch(batch))          # MSE / CE over unpadded steps
    AdamW(lr 1e-4, wd 1e-4), linear warmup 10k, grad clip 0.25, batch 64  (the paper's table 8)

and ``evaluate(step)`` rolls the policy out at ``agent.targets`` in gymnasium vector envs
(:func:`rl_tformers.agents.common.evaluation.evaluate`), logging per-target returns, normalised
scores and the return-conditioning figure.

What goes into a checkpoint besides the weights (``extra_state``): observation mean/std, reward
scale, action bounds, dataset return statistics, evaluation environment and the model config,
so :func:`load_for_inference` rebuilds the policy without the dataset.

Which mode a backbone needs (``agent.mode``):

- attention kinds registered with ``Capabilities(causal=True)`` (``rl-tformers backbones``):
  ``causal`` (the paper; every action of the window is a training target).
- kinds with ``causal=False`` (no causal form: global-token, low-rank projections over the
  whole sequence...): ``agent.mode=last_action backbone.causal=false``; the window ends with
  the current state token and only the last action is predicted and trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from rl_tformers.agents.common.evaluation import evaluate
from rl_tformers.agents.common.loading import register_inference_loader
from rl_tformers.agents.common.offline import DatasetInfo, eval_seed, load_offline_dataset, plain
from rl_tformers.agents.decision_transformer.loss import dt_loss
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig, from_env_action
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.envs.dataset import EpisodeDataset
from torch import Tensor

from rl_tformers.runtime.agents import register_agent

#: Registered defaults of ``agent.kind=dt``: the paper's hyper-parameters for MuJoCo (table 8).
DT_DEFAULTS: dict[str, Any] = {
    "agent": {
        "context_len": 20,  # K, steps per window
        "max_ep_len": 1000,  # timestep embedding size; episodes must not be longer
        "mode": "causal",  # causal | last_action (kernels without a causal form)
        "align": "auto",  # training windows / eval context: auto (start if causal, else end) | start | end
        "head": "deterministic",  # deterministic (tanh, MSE) | gaussian (Online DT)
        "embed_dropout": 0.1,  # dropout after the embedding LayerNorm
        "log_std_min": -5.0,  # gaussian head bounds
        "log_std_max": 2.0,
        "init_temperature": 0.1,  # gaussian head: initial entropy temperature
        "target_entropy": None,  # gaussian head: null = -act_dim
        "reward_scale": "auto",  # divisor of returns-to-go: auto = power of ten below max |return|
        "normalize_obs": True,  # standardise observations with dataset mean/std
        "targets": None,  # evaluation target returns, raw units; null = [dataset best]
        "timestep_overflow": "error",  # error | clamp: episode steps >= max_ep_len at evaluation
        "env_id": None,  # evaluation env; null = the dataset's
        "env_kwargs": None,  # gym.make keyword arguments of the evaluation env (a mapping)
        "eval_figure": True,  # log the return-conditioning figure at each evaluation
    },
    "backbone": {
        # GPT-2's dropout placement, as in the paper's code: residual, attention and embedding
        # dropout 0.1, none on the feed-forward hidden layer (ffn_dropout=0; also ~20% faster
        # per update on CPU, docs/performance.md).
        "d_model": 128, "n_layers": 3, "n_heads": 1, "dropout": 0.1, "attn_dropout": 0.1,
        "ffn_dropout": 0.0,
        "activation": "relu", "block": {"kind": "pre_norm"}, "position": {"kind": "none"},
    },
    "train": {
        "batch_size": 64, "lr": 1.0e-4, "weight_decay": 1.0e-4, "grad_clip": 0.25,
        "schedule": "linear_warmup", "warmup_steps": 10000, "steps": 100000,
    },
    "eval": {"episodes": 10, "n_envs": 10},
}


def to_model_batch(batch: Mapping[str, Tensor], info: DatasetInfo) -> dict[str, Tensor]:
    """Sampler batch (:class:`rl_tformers.envs.samplers.WindowSampler` keys) -> :func:`dt_loss` inputs.

    Observations and returns-to-go arrive normalised / divided by the reward scale; continuous
    actions are mapped to [-1, 1] with the action bounds. Shapes: (B, K, ...) throughout.
    """
    actions = batch["actions"]
    if not info.discrete:
        low = torch.as_tensor(info.action_low, device=actions.device)
        high = torch.as_tensor(info.action_high, device=actions.device)
        actions = from_env_action(actions.float(), low, high)
    obs = batch["observations"]
    return {
        "obs": obs.reshape(obs.shape[0], obs.shape[1], -1).float(),  # (B, K, obs_dim)
        "actions": actions,
        "rtg": batch["returns_to_go"].float(),
        "timesteps": batch["timesteps"].long(),
        "mask": batch["mask"].bool(),
    }


class DTAgent:
    """The Decision Transformer as a :class:`~rl_tformers.runtime.agents.Trainable`.

    Args:
        cfg: resolved run config (``agent``, ``backbone``, ``dataset``, ``train``, ``eval``, ``seed``).
        run_dir: the run directory (unused; kept for the builder signature).
        device: device of the model.
        dataset: an already loaded dataset (tests, demo); default: ``cfg.dataset``.
        info: :class:`DatasetInfo` of a checkpoint; builds the model without any dataset
            (inference only: :meth:`batches` then raises).

    Raises:
        ValueError: bad agent options (named), unbounded actions, episodes longer than
            ``agent.max_ep_len``.
    """

    def __init__(
        self, cfg: Any, run_dir: Path | None, device: torch.device | str,
        dataset: EpisodeDataset | None = None, info: DatasetInfo | None = None,
    ) -> None:
        a = cfg.agent
        self.cfg = cfg
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.dataset = dataset
        if info is None:
            if self.dataset is None:
                self.dataset = load_offline_dataset(plain(cfg.dataset))
            info = DatasetInfo.from_dataset(
                self.dataset, reward_scale=a.reward_scale, normalize_obs=bool(a.normalize_obs),
                env_id=a.env_id, env_kwargs=plain(a.env_kwargs), spec=plain(cfg.dataset).get("path"),
            )
            if info.longest_episode > int(a.max_ep_len):
                raise ValueError(
                    f"agent.max_ep_len={a.max_ep_len} but the dataset has an episode of {info.longest_episode} "
                    f"steps; raise agent.max_ep_len"
                )
        self.info = info
        self.model_cfg = DTConfig(
            obs_dim=info.obs_dim, act_dim=info.act_dim, discrete=info.discrete,
            context_len=int(a.context_len), max_ep_len=int(a.max_ep_len), mode=str(a.mode), head=str(a.head),
            embed_dropout=float(a.embed_dropout), log_std_min=float(a.log_std_min), log_std_max=float(a.log_std_max),
            init_temperature=float(a.init_temperature),
            target_entropy=None if a.target_entropy is None else float(a.target_entropy),
            backbone=plain(cfg.backbone),
        )
        self.model = DecisionTransformer(self.model_cfg).to(self.device)
        align = str(a.get("align", "auto"))  # runs saved before the option existed: auto
        self.align = ("start" if self.model_cfg.mode == "causal" else "end") if align == "auto" else align
        if self.align not in ("start", "end") or (self.align == "start" and self.model_cfg.mode != "causal"):
            raise ValueError(f"agent.align={align!r}: use auto, start (causal mode only) or end")

    # -- Trainable ---------------------------------------------------------------------------
    def batches(self, start_step: int):
        """Step-indexed dataset: batch ``s`` = ``WindowSampler.sample(B, default_rng([seed, s]))``.

        ``agent.align``: ``start`` (the paper's sampler, the default in ``causal`` mode) or
        ``end`` (every window ends at a uniformly drawn real step; required by ``last_action``
        mode, whose target is that step's action; in causal mode it covers the first K steps of
        each episode far more often, see docs/dt.md).
        """
        from rl_tformers.envs.samplers import WindowSampler
        from rl_tformers.envs.torch_data import StepBatchDataset
        from rl_tformers.envs.trajectory import ObsStats

        if self.dataset is None:
            raise RuntimeError("this DT agent was loaded for inference only (no dataset)")
        stats = ObsStats(self.info.obs_mean.reshape(self.dataset.observation_shape),
                         self.info.obs_std.reshape(self.dataset.observation_shape))
        sampler = WindowSampler(
            self.dataset, self.model_cfg.context_len, align=self.align,
            reward_scale=self.info.reward_scale, obs_stats=stats, max_ep_len=self.model_cfg.max_ep_len,
        )
        return StepBatchDataset(sampler, int(self.cfg.train.batch_size), seed=self.seed, num_steps=int(self.cfg.train.steps))

    def loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """:func:`dt_loss` on one sampler batch (already on the device)."""
        return dt_loss(self.model, to_model_batch(batch, self.info))

    # -- acting and evaluation -------------------------------------------------------------------
    def policy(self, timestep_overflow: str | None = None) -> DTPolicy:
        """The :class:`DTPolicy` of the current weights (shares the model; puts it in eval mode)."""
        i = self.info
        return DTPolicy(
            self.model, i.obs_mean, i.obs_std, i.reward_scale, i.action_low, i.action_high,
            default_target=self.default_targets()[0],
            timestep_overflow=timestep_overflow or str(self.cfg.agent.timestep_overflow), align=self.align,
        )

    def make_env(self):
        """Zero-argument factory of the evaluation environment (the dataset's, or ``agent.env_id``)."""
        return self.info.make_env()

    def default_targets(self) -> list[float]:
        """``agent.targets`` or ``[best dataset return]`` (raw units)."""
        t = plain(self.cfg.agent.targets)
        if t is None:
            return [self.info.return_max]
        return [float(x) for x in (t if isinstance(t, (list, tuple)) else [t])]

    def evaluate(self, step: int) -> dict[str, Any]:
        """Returns at each default target over ``eval.episodes`` episodes (+ normalised score, figure)."""
        was_training = self.model.training
        report = evaluate(
            self.policy(), self.make_env(), self.default_targets(), episodes=int(self.cfg.eval.episodes),
            n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step), record_rewards=True,
            normalize=self.info.normalizer(), env_id=self.info.env_id,
        )
        self.model.train(was_training)
        out: dict[str, Any] = {}
        for k, r in enumerate(report.results):
            suffix = "" if k == 0 else f"_target{k}"
            out[f"eval/return_mean{suffix}"] = r.return_mean
            out[f"eval/return_std{suffix}"] = r.return_std
            out[f"eval/target{suffix}"] = float(r.target_return)
            if r.normalized_score is not None:
                out[f"eval/normalized_score{suffix}"] = r.normalized_score
        if bool(self.cfg.agent.eval_figure):
            from rl_tformers.agents.common.plots import plot_return_conditioning

            out["eval/return_conditioning"] = plot_return_conditioning(
                report.results, dataset_max=self.info.return_max, dataset_mean=self.info.return_mean,
                title=f"Decision Transformer, step {step}",
            )
        return out

    # -- checkpoint state ------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Dataset statistics: obs mean/std, reward scale, action bounds, returns, env (checkpoint-safe)."""
        return self.info.to_extra()

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.info = DatasetInfo.from_extra(state)


def load_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> DTAgent:
    """A :class:`DTAgent` rebuilt from a checkpoint (``state``: the checkpoint dict), no dataset needed."""
    agent = DTAgent(cfg, None, device, info=DatasetInfo.from_extra(state["extra"]))
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


@register_agent("dt", description="Decision Transformer (Chen et al. 2021) on any backbone", defaults=DT_DEFAULTS)
def build_dt(cfg: Any, run_dir: Path, device: torch.device) -> DTAgent:
    """Builder of ``agent.kind=dt``."""
    return DTAgent(cfg, run_dir, device)



register_inference_loader("dt")(load_for_inference)
