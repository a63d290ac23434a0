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
(:func:`rl_tformers.runtime.evaluation.evaluate`), logging per-target returns, normalised
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

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from rl_tformers.agents.common.encoders import check_observations, observation_layout
from rl_tformers.agents.common.offline import (
    DatasetInfo,
    flattens_observations,
    largest_observation,
    largest_returns_to_go,
    load_offline_dataset,
    plain,
)
from rl_tformers.agents.common.policy import embedding_target_limit
from rl_tformers.agents.decision_transformer.config import DTAgentConfig
from rl_tformers.agents.decision_transformer.inference import DTInference
from rl_tformers.agents.decision_transformer.loss import dt_loss
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig, from_env_action
from rl_tformers.agents.decision_transformer.policy import DTPolicy, DTPolicyWrapper
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.envs.trajectory import ObsStats
from torch import Tensor

from rl_tformers.runtime.agent_registry import register_agent
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.loading import register_inference_loader

#: Registered defaults of ``agent.kind=dt`` (its ``agent`` section: :class:`DTAgentConfig`'s): the
#: paper's hyper-parameters for MuJoCo (table 8).
DT_DEFAULTS: dict[str, Any] = {
    "agent": DTAgentConfig().to_dict(),
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


def warn_time_limit(info: DatasetInfo, max_ep_len: int, offline_run: str | None = None) -> None:
    """Log a warning when the evaluation environment's time limit exceeds ``max_ep_len``.

    With ``agent.timestep_overflow=error`` an evaluation episode that reaches step
    ``max_ep_len`` stops the evaluation with an error (:class:`DTPolicy`), which would otherwise
    surface only at the first evaluation, after training. Nothing is logged when the
    environment has no time limit or cannot be made here (:meth:`DatasetInfo.check_env` decides
    about that).

    Args:
        info: the run's data statistics (the evaluation environment).
        max_ep_len: the model's timestep embedding size (steps).
        offline_run: Online DT (``agent.kind=odt``): the ``agent.init_from`` whose
            ``agent.max_ep_len`` the model keeps; the advice then says to raise it on that
            offline run (the odt config's value is not used), and that exploration episodes are
            cut there. None: the run's own ``agent.max_ep_len``.
    """

    limit = info.time_limit()
    if limit is None or limit <= max_ep_len:
        return
    if offline_run is None:
        logging.getLogger(__name__).warning(
            "the evaluation environment %s runs episodes of up to %d steps but agent.max_ep_len=%d: an evaluation "
            "episode that reaches step %d will stop the evaluation (agent.timestep_overflow=error); raise "
            "agent.max_ep_len to %d, or set agent.timestep_overflow=clamp", info.env_id, limit, max_ep_len,
            max_ep_len, limit)
    else:
        logging.getLogger(__name__).warning(
            "the evaluation environment %s runs episodes of up to %d steps but the offline run agent.init_from=%s "
            "has agent.max_ep_len=%d, which Online DT keeps (the odt config's agent.max_ep_len is not used): an "
            "evaluation episode that reaches step %d will stop the evaluation (agent.timestep_overflow=error) and "
            "exploration episodes are cut there; train the offline run with agent.max_ep_len >= %d, or set "
            "agent.timestep_overflow=clamp", info.env_id, limit, offline_run, max_ep_len, max_ep_len, limit)


def to_model_batch(batch: Mapping[str, Tensor], info: DatasetInfo) -> dict[str, Tensor]:
    """Sampler batch (:class:`rl_tformers.envs.samplers.WindowSampler` keys) -> :func:`dt_loss` inputs.

    Observations and returns-to-go arrive normalised / divided by the reward scale (image
    observations, :attr:`DatasetInfo.image_obs`, arrive as the sampler gives them, uint8
    ``(B, K, C, H, W)``, and go to the model so: its encoder scales them); continuous
    actions ``(B, K, *action_shape)`` are flattened to ``(B, K, A)`` (C order, like the bounds)
    and mapped to [-1, 1] with the action bounds, discrete ones ``(B, K)`` to class indices
    ``action - info.action_start`` in ``[0, n)`` (0 on padding). Outputs: ``obs (B, K, obs_dim)``,
    ``actions (B, K, A)`` float or ``(B, K)`` long, ``rtg``/``timesteps``/``mask`` ``(B, K)``.
    """
    actions = batch["actions"]
    if info.discrete:
        actions = torch.where(batch["mask"].bool(), actions.long() - info.action_start, 0)
    else:
        low = torch.as_tensor(info.action_low, device=actions.device)
        high = torch.as_tensor(info.action_high, device=actions.device)
        flat = actions.reshape(actions.shape[0], actions.shape[1], info.act_dim)  # a (2, 2) Box step -> 4 values
        actions = from_env_action(flat.float(), low, high)
    obs = batch["observations"]
    if not info.image_obs:
        obs = obs.reshape(obs.shape[0], obs.shape[1], -1).float()  # (B, K, obs_dim)
    return {
        "obs": obs,  # (B, K, obs_dim), or (B, K, C, H, W) pixels
        "actions": actions,
        "rtg": batch["returns_to_go"].float(),
        "timesteps": batch["timesteps"].long(),
        "mask": batch["mask"].bool(),
    }


class DTAgent:
    """The Decision Transformer as a :class:`~rl_tformers.runtime.agent_registry.Trainable`.

    Args:
        cfg: resolved run config (``agent``, ``backbone``, ``dataset``, ``train``, ``eval``, ``seed``).
        run_dir: the run directory (unused; kept for the builder signature).
        device: device of the model.
        dataset: an already loaded dataset (tests, demo); default: ``cfg.dataset``.
        info: :class:`DatasetInfo` of a checkpoint; builds the model without any dataset
            (inference only: :meth:`batches` then raises).
        options: the typed ``agent:`` section (default: :class:`DTAgentConfig` of ``cfg.agent``;
            Online DT passes its own, a subclass).

    Raises:
        ValueError: bad agent options (a ``ConfigFieldError`` naming ``agent.<key>``, before the
            dataset is read; targets beyond the new model's :meth:`DTPolicy.target_limit` after),
            unbounded actions, episodes longer than ``agent.max_ep_len``.
    """

    targets_option = "agent.targets"  # the config key of the default return targets (eval messages)

    def __init__(
        self, cfg: Any, run_dir: Path | None, device: torch.device | str,
        dataset: EpisodeDataset | None = None, info: DatasetInfo | None = None,
        options: DTAgentConfig | None = None,
    ) -> None:
        # every option is checked before the dataset is read and anything is trained
        a = options if options is not None else DTAgentConfig.from_dict(
            {k: v for k, v in plain(cfg.agent).items() if k != "kind"}, where="agent")
        self.options = a
        self.cfg = cfg
        self.eval_context_len = a.acting_context
        self.config_targets = None if a.targets is None else list(a.targets)
        self.early_exit_options = a.early_exit
        self.knn_options = a.knn
        #: early exit and the kNN-LM datastore at inference (inference_setup)
        self.inference = DTInference(self, to_model_batch)
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.dataset = dataset
        if info is None:
            if self.dataset is None:
                self.dataset = load_offline_dataset(plain(cfg.dataset))
            check_observations(a.encoder, *observation_layout(self.dataset),
                               f"the dataset {plain(cfg.dataset).get('path') or self.dataset.metadata.location}")
            info = DatasetInfo.from_dataset(
                self.dataset, reward_scale=a.reward_scale, normalize_obs=a.normalize_obs,
                env_id=a.env_id, env_kwargs=a.env_kwargs, spec=plain(cfg.dataset).get("path"),
                flatten_observations=flattens_observations(plain(cfg.dataset)),
            )
            self.dataset.check_max_ep_len(a.max_ep_len, "agent.max_ep_len")  # names the episode
            if a.timestep_overflow == "error":
                warn_time_limit(info, a.max_ep_len)
        self.info = info
        self.model_cfg = DTConfig(
            obs_dim=info.obs_dim, act_dim=info.act_dim, discrete=info.discrete,
            context_len=a.context_len, max_ep_len=a.max_ep_len, mode=a.mode, head=a.head,
            embed_dropout=float(a.embed_dropout), embed_init=a.embed_init,
            log_std_min=float(a.log_std_min), log_std_max=float(a.log_std_max),
            init_temperature=float(a.init_temperature),
            target_entropy=None if a.target_entropy is None else float(a.target_entropy),
            backbone=plain(cfg.backbone),
            exit_scheme=a.early_exit.scheme, exit_tol=float(a.early_exit.tol),
            obs_shape=info.obs_shape, encoder=a.encoder,
        )
        self.model = DecisionTransformer(self.model_cfg).to(self.device)
        self.align = ("start" if self.model_cfg.mode == "causal" else "end") if a.align == "auto" else a.align
        if self.dataset is not None:
            self._check_data_returns()
            if not a.normalize_obs and a.encoder.capabilities.passthrough:  # raw observations into embed_state
                self._check_raw_observations()
        if self.info is not None and self.config_targets is not None:
            # before training, not at the first evaluation: agent.targets the float32 return
            # embedding cannot take (DTPolicy.target_limit; rechecked at every evaluation)
            self.policy().check_targets(self.config_targets, "agent.targets")
            self.model.train()

    def resolved_options(self) -> dict[str, Any]:
        """The effective values of ``agent.reward_scale`` and ``agent.align`` (``auto`` resolved
        from the data and ``agent.mode``), recorded by the trainer (:mod:`rl_tformers.runtime.resolved`)."""
        out: dict[str, Any] = {"agent.align": self.align}
        if self.info is not None:
            out["agent.reward_scale"] = float(self.info.reward_scale)
        return out

    def _check_raw_observations(self) -> None:
        """With ``agent.normalize_obs=false``, refuse observations whose raw values overflow the
        new model's observation embedding: ``|W x + b + E_time|`` must stay below the bound of
        :func:`~rl_tformers.agents.common.policy.embedding_target_limit` (the embedding LayerNorm
        squares it), checked with the row sums of ``|W|`` on the dataset's largest |observation|.

        Raises:
            ValueError: naming ``agent.normalize_obs``, the dataset's largest |observation| and
                the limit (the first loss would be NaN whatever the learning rate).
        """
        m = self.model
        w = m.embed_state.weight.detach().float().abs().sum(dim=1)  # (d,): |W x|_i <= |W_i|_1 max|x|
        c = (m.embed_state.bias.detach().float() + m.embed_timestep.weight.detach().float()).abs().max()
        limit = embedding_target_limit(w, float(c), 1.0)
        m_obs = largest_observation(self.dataset)
        if m_obs > limit:
            where = plain(self.cfg.dataset).get("path") if self.cfg is not None else None
            raise ValueError(
                f"agent.normalize_obs=false: the dataset {where or self.info.dataset}'s largest |observation| "
                f"{m_obs:g} would overflow float32 in this model's observation embedding (its LayerNorm), which takes "
                f"raw observations up to {limit:g}: the first loss would be NaN whatever train.lr is; set "
                f"agent.normalize_obs=true (observations standardised by the dataset's mean/std) or rescale them")

    def _check_data_returns(self) -> None:
        """Refuse training data whose largest |return-to-go| the new model's return embedding cannot
        take at ``agent.reward_scale`` (:meth:`DTPolicy.target_limit`, the bound the evaluation
        targets are held to): a tiny scale whose scaled returns-to-go are finite in float32 (checked
        by :func:`~rl_tformers.agents.common.offline.check_scaled_returns`) can still overflow the
        embedding LayerNorm and make the first loss NaN.

        Raises:
            ValueError: naming ``agent.reward_scale``, the dataset's largest |return-to-go| and the
                smallest scale that fits.
        """

        scale = float(self.info.reward_scale)
        m_rtg, _ = largest_returns_to_go(self.dataset)
        limit = float(self.policy().target_limit())
        self.model.train()
        if m_rtg > limit:
            where = plain(self.cfg.dataset).get("path") if self.cfg is not None else None
            need = f"use agent.reward_scale >= {m_rtg * scale / limit:g}" if limit > 0 else "use a larger agent.reward_scale"
            raise ValueError(
                f"agent.reward_scale={scale:g} is too small for the dataset {where or self.info.dataset}: its largest "
                f"|return-to-go| {m_rtg:g} / {scale:g} = {m_rtg / scale:g} would overflow float32 in this model's "
                f"return embedding (its LayerNorm), which takes |return-to-go| up to {limit:g} at this scale, and "
                f"the first loss would be NaN; {need} ('auto' picks the power of ten at or below the largest "
                f"|episode return|, at most 1000)")

    # -- Trainable ---------------------------------------------------------------------------
    def batches(self, start_step: int):
        """Step-indexed dataset: batch ``s`` = ``WindowSampler.sample(B, default_rng([seed, s]))``.

        ``agent.align``: ``start`` (the paper's sampler, the default in ``causal`` mode) or
        ``end`` (every window ends at a uniformly drawn real step; required by ``last_action``
        mode, whose target is that step's action; in causal mode it covers the first K steps of
        each episode far more often, see docs/dt.md).
        """

        if self.dataset is None:
            raise RuntimeError("this DT agent was loaded for inference only (no dataset)")
        data = self.dataset
        held = self.inference.heldout_mask(data)
        if held.any():
            data = data.select(~held)  # calibration episodes never trained on
        stats = None if self.info.image_obs else ObsStats(  # images: scaled in the encoder, not standardised
            self.info.obs_mean.reshape(self.dataset.observation_shape),
            self.info.obs_std.reshape(self.dataset.observation_shape))
        sampler = WindowSampler(
            data, self.model_cfg.context_len, align=self.align,
            reward_scale=self.info.reward_scale, obs_stats=stats, max_ep_len=self.model_cfg.max_ep_len,
        )
        return StepBatchDataset(sampler, int(self.cfg.train.batch_size), seed=self.seed, num_steps=int(self.cfg.train.steps))

    def loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        """:func:`dt_loss` on one sampler batch (already on the device)."""
        return dt_loss(self.model, to_model_batch(batch, self.info))

    # -- acting and evaluation -------------------------------------------------------------------
    def policy(self, timestep_overflow: str | None = None, sample: bool = False,
               generator: torch.Generator | None = None) -> DTPolicy | DTPolicyWrapper:
        """The :class:`DTPolicy` of the current weights (shares the model; puts it in eval mode),
        wrapped with the inference options in use (early exit, kNN-LM: :meth:`DTInference.wrap`).

        ``sample``/``generator``: act with draws of the gaussian head (:class:`DTPolicy`; Online DT's
        rollouts) instead of its mean (evaluation).
        """
        i = self.info
        return self.inference.wrap(DTPolicy(
            self.model, i.obs_mean, i.obs_std, i.reward_scale, i.action_low, i.action_high,
            default_target=self.default_targets()[0],
            timestep_overflow=timestep_overflow or self.options.timestep_overflow, align=self.align,
            action_start=i.action_start,
            action_shape=None if i.discrete else i.action_shape, sample=sample, generator=generator,
            context_steps=self.eval_context_len, deciding_step_only=self.options.deciding_step_only,
        ))

    def inference_setup(self, **options: Any) -> dict[str, Any]:
        """Evaluation options (``rl-tformers eval --early-exit / --knn-lambda``): :meth:`DTInference.setup`."""
        return self.inference.setup(**options)

    def make_env(self):
        """Zero-argument factory of the evaluation environment (the dataset's, or ``agent.env_id``)."""
        return self.info.make_env()

    def default_targets(self) -> list[float]:
        """``agent.targets`` or ``[best dataset return]`` (raw units)."""
        if self.config_targets is None:
            return [self.info.return_max]
        return list(self.config_targets)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Returns at each default target over ``eval.episodes`` episodes (+ normalised score, figure).

        The policy evaluated is the one ``rl-tformers eval RUN`` evaluates without options: the
        run's ``agent.early_exit.threshold`` (calibrated on the current weights for
        ``calibrate``) and ``agent.knn.*`` (a datastore built with the current weights when
        ``agent.knn.lam`` > 0) apply; both are dropped again afterwards.
        """
        was_training = self.model.training
        saved = self.inference.snapshot()
        try:
            self.inference.setup()  # nothing to do (and nothing spent) with the defaults
            report = evaluate(
                self.policy(), self.make_env(), self.default_targets(), episodes=int(self.cfg.eval.episodes),
                n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step), record_rewards=True,
                normalize=self.info.normalizer(), env_id=self.info.env_id,
            )
        finally:
            self.inference.restore(saved)
            self.model.train(was_training)
        out: dict[str, Any] = dict(report_logs(report))
        if self.options.eval_figure:
            from rl_tformers.runtime.plots import plot_return_conditioning  # matplotlib: only for the figure

            out["eval/return_conditioning"] = plot_return_conditioning(
                report.results, dataset_max=self.info.return_max, dataset_mean=self.info.return_mean,
                dataset_min=self.info.return_min,
                title=f"Decision Transformer, step {step}",
            )
        return out

    # -- checkpoint state ------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Dataset statistics: obs mean/std, reward scale, action bounds, returns, env (checkpoint-safe)."""
        return self.info.to_extra()

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Take the checkpoint's dataset statistics (``--resume``).

        A resumed run trains on the dataset it reads now with the checkpoint's statistics
        (observation mean/std, reward scale, default target): if the data behind
        ``dataset.path`` changed since the checkpoint (a rebuilt or overwritten file), it would
        go on training on other data with stale statistics, and the resume would not continue
        the run. That is refused, naming what changed.

        Raises:
            AgentBuildError: (a ValueError, reported by ``rl-tformers train`` as one ``error:``
                line) the statistics of the dataset read now differ from the checkpoint's.
        """
        saved = DatasetInfo.from_extra(state)
        if self.dataset is not None:  # training (not an inference-only agent): the data must be the run's
            where = plain(self.cfg.dataset).get("path") if self.cfg is not None else None
            saved.check_resumed_data(getattr(self, "info", None), where)
        self.info = saved


def load_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> DTAgent:
    """A :class:`DTAgent` rebuilt from a checkpoint (``state``: the checkpoint dict), no dataset needed."""
    agent = DTAgent(cfg, None, device, info=DatasetInfo.from_extra(state["extra"]))
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


@register_agent("dt", description="Decision Transformer (Chen et al. 2021) on any backbone", defaults=DT_DEFAULTS,
                config_cls=DTAgentConfig)
def build_dt(cfg: Any, run_dir: Path, device: torch.device) -> DTAgent:
    """Builder of ``agent.kind=dt``."""
    return DTAgent(cfg, run_dir, device)


register_inference_loader("dt")(load_for_inference)
