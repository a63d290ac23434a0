"""Online PPO with the GTrXL model in gymnasium vector environments (``agent.kind=gtrxl_ppo``).

The setting of Parisotto et al. 2019 (there with V-MPO/IMPALA; PPO as in CleanRL's TrXL-PPO
and RLlib's attention nets): N vector environments step together, one token per environment
and step goes through the backbone with its memory, and the policy is trained with the clipped
surrogate of Schulman et al. 2017 plus a value loss and an entropy bonus on the same encoder.

The parts (as Stable-Baselines3's on-policy algorithm: collect a rollout, then train on it):
:mod:`~rl_tformers.agents.gtrxl.rollout` collects rollouts into a buffer (the running episodes
of the N environments), :mod:`~rl_tformers.agents.gtrxl.ppo_update` holds GAE, the clipped loss
and the minibatch epochs, :mod:`~rl_tformers.agents.gtrxl.env_state` checkpoints each process's
environments, :mod:`~rl_tformers.agents.gtrxl.fine_tune` starts from an offline run, and
:class:`GTrXLPPO` wires them for the trainer.

Memory during updates: **stored per rollout step**. At every step the collector records the
backbone state each environment acted with (per layer (N, M, D) memory plus slot positions,
validity and episode ids, after the reset of finished rows). The update recomputes each sample
as one query over exactly that memory, so before the first optimiser step the recomputed
log-probabilities equal the rollout's, up to float rounding (1e-6 tested: the importance ratio
starts at 1); the memory content itself is the rollout's (detached, from the weights at
collection time), as in CleanRL's TrXL-PPO. A segment-based recompute (re-running
whole rollout segments with the new weights) would change the attention pattern between acting
(one token over M slots) and learning (a segment over M + T slots), so the importance ratio
would not start at 1; we do not do it. Cost per sample: O(M) keys per layer; storage
S x N x layers x M x D floats per rollout.

No dropout: the PPO model is built with ``backbone.dropout``, ``attn_dropout`` and
``ffn_dropout`` set to 0 (:func:`without_dropout`; a config or offline checkpoint that sets them
gets a :class:`~rl_tformers.backbone_config.ConfigAdviceWarning`). With dropout the rollout's
log-probabilities and values would come from one dropout mask and their recomputation from
another, so the ratio would not start at 1 and the clip would act on dropout noise; collecting
with dropout off (eval mode) and updating with it on, as some libraries do, leaves the same
mismatch between the acting network and the recomputed one. Huang et al. 2024 ("The N+
implementation details of RLHF with PPO") disable dropout for this reason; CleanRL's PPO
networks have none.

Memory kind: ``xl``, ``spalm`` or ``compressive``; the offline agent takes any stateful kind.
The compressive memory (Rae et al. 2019) grows its FIFO to ``m_m + c - 1`` slots in a stream's
first steps, so each step's memory is stored at that full width, invalid slots inserted after
the compressed ones (:func:`~rl_tformers.agents.gtrxl.ppo_update.pad_memory`; masked), and the
rollout acts over it at that width, so the recomputation matches the rollout up to float rounding
with any attention kind (one that groups keys by slot, local or fixed, would see other blocks at
another width); only its parameter-free compressions
(``max``, ``mean``) are taken: the rollout updates the memory without gradient, so a learned
compressor would never train. ``agent.window`` W with memory kind ``none`` stores each step's
plain window instead (W inputs re-encoded by the update). With ``spalm`` each step also stores the long-term
store it acted with (per environment, reset at its episode starts): S x N x K x (2 D + 3)
values per rollout for a store of K records, kept as plain tensors (not FIFO-encoded) in a
checkpoint taken inside a rollout.

Rows whose episode ended are reset before the next step (the backbone state of only those rows
is cleared). Time-limit truncations are bootstrapped with V(final observation), computed with
the memory of the finished episode; terminations are not.

Trainer integration: ``batches()`` is an iterable that collects a rollout with the live model,
then yields ``n_epochs x n_minibatches`` minibatches; one trainer update = one minibatch. So
``train.steps = rollouts x n_epochs x n_minibatches`` and the environment steps are
``rollouts x n_envs x n_steps``.

Resuming (``--resume``) is bit-identical to an uninterrupted run, stopped at any update (inside
a rollout too): weights, ``metrics.jsonl`` values and final state. Besides the run-wide state
(weights, optimiser, RNG states, observation statistics, the ``env_steps``/``rollouts``
counters: :meth:`GTrXLPPO.extra_state`) every checkpoint holds each process's own state
(:meth:`GTrXLPPO.process_state`, the trainer's per-process hook): the N environments as plain
data (every wrapper's and the environment's attributes, their random generators' states and
MuJoCo's integration state, restored onto environments made anew from the run's id and kwargs;
:func:`~rl_tformers.agents.gtrxl.env_state.env_snapshot`: nothing is unpickled), the vector environment's
autoreset flags, the running episodes (last observation, backbone memory, a_{t-1}, r_{t-1},
step, start flags, return and length so far), the recent episode returns and lengths, and,
when the run stopped after update j of a rollout's U = ``n_epochs x n_minibatches`` (0 < j <
U), that rollout with j. The resumed stream first serves the rollout's last U - j minibatches
(their permutations are a pure function of ``(seed, rollout, epoch)``), then collects the next
rollout from the restored environments; the trainer restores the RNG states just before the
first update, and the saved rollout draws nothing, so the next rollout samples its actions
from the same RNG state as the uninterrupted run. Tested with CartPole, the position-only
tasks (CartPole, Pendulum, Hopper-v5), Recall and Hopper-v5, and under DDP with the same
number of processes, every rank getting back its own environments
(tests/agents/test_gtrxl_ppo_resume.py).

Size: the environments and running episodes of configs/gtrxl/ppo_cartpole.yaml add about
0.16 MB to a checkpoint (2.8 -> 3.0 MB; the backbone memory, N x layers x M x D floats, is
most of it; a MuJoCo environment pickles its model and data, about 1.2 MB each); a rollout in
progress adds about 2.0 MB (the per-step memories, S x N x layers x M x D floats = 16.8 MB, are
stored as the one new slot per step, :func:`~rl_tformers.agents.gtrxl.env_state.fifo_encode`, losslessly). The shipped config
checkpoints every 160 updates, at rollout boundaries, so only a stop (SIGINT/SIGTERM,
``--stop-at``) inside a rollout saves one.

Not exact, and said so by the warning ``--resume`` prints (:meth:`GTrXLPPO.resume_note`):
an environment holding state that is not plain data (a Box2D world, an object of its own
classes; a warning names the attributes at the first checkpoint), a resume with another number
of processes than the checkpoint's, or a checkpoint written before this state was saved. Such
an environment is also saved pickled (attribute by attribute, :class:`~rl_tformers.agents.gtrxl.env_state._EnvPickler`), and
``--resume --unsafe-unpickle-envs`` unpickles it, which runs code stored in the checkpoint: only
for runs you made or trust. Otherwise the environments
restart with fresh resets (and empty memory) at the next rollout; a checkpointed rollout in
progress is still finished exactly (from an old checkpoint: a fresh rollout feeds the last U - j updates, and its
``n_envs x n_steps`` steps are counted in ``train/env_steps`` on top of the cut one's). Loading
a checkpoint for evaluation or inference never reads the environments.

Under DDP (``--nproc W``) W processes act as one process with ``W x n_envs`` environments:
every process runs its own ``n_envs`` environments (rank r seeds them after rank r - 1's, the
seeds one process with ``W x n_envs`` environments would give them), collects its own rollout
and trains on every row of its own minibatches (the agent sets ``local_batches``, so the
trainer does not split them again); ``train/env_steps`` counts the steps of every process.
One update's global minibatch is therefore the union of the ranks' minibatches, W x
``n_envs x n_steps / n_minibatches`` rows, and the gradient is exactly that of one process on
that union: the loss terms are means over equal-sized minibatches (every rank splits its
rollout the same way, so DDP's gradient average is the global mean) and the advantages are
normalised with the mean and standard deviation of the whole global minibatch
(:func:`~rl_tformers.agents.gtrxl.ppo_update.normalize_advantages`, three scalar all-reduces; tested against one process). The
only difference from one process with ``W x n_envs`` environments: each rank draws its
minibatches from its own rollout (a global minibatch takes the same number of rows from
every rank's rollout, not a uniform draw over their union).

Logged (``train/...``): PPO losses, approximate KL, clip fraction, entropy, mean gate values per
layer (``gate/layer{i}_attn|ffn``), attention entropy per layer (nats, at the rollout's last
step), episodic return/length (mean of the episodes finished in the latest rollouts) and
environment steps (``train/env_steps``: the count at the window's last update, not a mean over
the window: the agent's ``latest_logs``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.encoders import EncoderConfig, check_observations
from rl_tformers.agents.gtrxl import env_state, ppo_update
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy, _plain, model_config_dict
from rl_tformers.agents.gtrxl.config import PPOAgentConfig
from rl_tformers.agents.gtrxl.fine_tune import (
    DROPOUT_KEYS,
    check_offline_spaces,
    load_offline,
    read_offline,
    warn_ignored_settings,
)
from rl_tformers.agents.gtrxl.model import (
    GTrXLConfig,
    GTrXLModel,
    check_causal,
    gtrxl_backbone,
    needs_find_unused,
    position_limit,
)
from rl_tformers.agents.gtrxl.ppo_update import ppo_loss
from rl_tformers.agents.gtrxl.rollout import OBS_CLIP, EnvSpec, RolloutCollector, RunningMeanStd
from torch import Tensor

from rl_tformers.backbone_config import BackboneConfig, ConfigAdviceWarning
from rl_tformers.runtime.agent_registry import register_agent, resume_state
from rl_tformers.runtime.distributed import dist_info
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.loading import register_inference_loader
from rl_tformers.typed_config import ConfigFieldError

log = logging.getLogger(__name__)

#: Registered defaults of ``agent.kind=gtrxl_ppo`` (its ``agent`` section: :class:`PPOAgentConfig`'s)
#: memory kinds PPO can store per rollout step
PPO_MEMORY_KINDS = ("xl", "spalm", "compressive")
#: compressions of the compressive memory PPO takes: the parameter-free ones (Rae et al. 2019, sec. 3.1)
PPO_COMPRESSIONS = ("max", "mean")

PPO_DEFAULTS: dict[str, Any] = {
    "agent": PPOAgentConfig().to_dict(),
    "backbone": gtrxl_backbone(d_model=64, n_layers=2, n_heads=4, mem_len=16),
    "train": {
        "lr": 3.0e-4, "weight_decay": 0.0, "grad_clip": 0.5, "warmup_steps": 0, "schedule": "constant",
        "eps": 1.0e-5, "steps": 1600, "log_every": 16,
    },
    "eval": {"every": 0, "episodes": 10, "n_envs": 10},
}


def without_dropout(backbone: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``backbone`` (a plain backbone config dict) with every dropout probability 0, and the
    settings in effect that were not 0 (``["backbone.dropout=0.1", ...]``; a missing key is
    :class:`~rl_tformers.backbone_config.BackboneConfig`'s default; ``ffn_dropout`` only when set).

    PPO trains the network it acts with: with dropout the rollout's log-probabilities and
    values come from one dropout mask and the update recomputes them under another, so the
    first update's importance ratio is not 1 and the clip acts on dropout noise (the N+
    implementation details of RLHF with PPO, Huang et al. 2024, disable dropout for this
    reason; CleanRL's PPO networks have none). So the PPO model is built with none at all.

    Raises:
        ValueError: the backbone config is invalid (as :class:`~rl_tformers.backbone_config.BackboneConfig`
            says, naming the key), before any value is replaced.
    """
    cfg = BackboneConfig.from_dict(backbone, where="backbone")  # validated values in effect
    in_effect = {"dropout": cfg.dropout, "attn_dropout": cfg.attn_dropout}
    if cfg.ffn_dropout is not None:
        in_effect["ffn_dropout"] = cfg.ffn_dropout
    turned_off = [f"backbone.{k}={v:g}" for k, v in in_effect.items() if v > 0]
    return {**backbone, **dict.fromkeys(DROPOUT_KEYS, 0.0)}, turned_off


def _warn_amp(cfg: Any) -> None:
    """Warn about ``train.amp=bf16`` (the importance ratio would not start at 1)."""
    amp = dict(cfg.get("train") or {}).get("amp", "none")
    if str(getattr(amp, "value", amp)) == "bf16":
        warnings.warn(
            "gtrxl_ppo with train.amp=bf16: the rollout acts in float32 (the trainer's autocast covers only "
            "the update) and the update recomputes each sample's log-probability under bfloat16 autocast, so "
            "PPO's ratio does not start at 1 and the clip acts on rounding noise (first-minibatch "
            "log-probabilities differed by up to 3e-3 in a 32-wide model; collecting under the same "
            "autocast by up to 8e-3, as bfloat16 rounding depends on the batch's shape); set "
            "train.amp=none for ratios that start at 1", ConfigAdviceWarning, stacklevel=3)


def check_ppo_memory(memory: Mapping[str, Any], init_checkpoint: str | None, window: int) -> None:
    """Refuse a ``backbone.memory`` section PPO cannot store per rollout step (the errors of
    :func:`ppo_backbone`)."""
    mem_kind = memory.get("kind", "none")
    if init_checkpoint and mem_kind == "none":
        raise ValueError(
            f"gtrxl_ppo: agent.init_checkpoint={init_checkpoint} is a plain-window run (backbone.memory.kind='none'); "
            f"PPO fine-tunes offline runs with memory ({', '.join(repr(k) for k in PPO_MEMORY_KINDS)}) only: train "
            f"the offline run with one of them, or start PPO's plain window without agent.init_checkpoint "
            f"(agent.window=W backbone.memory.kind=none)")
    if window and (mem_kind != "none" or init_checkpoint):
        why = (f"agent.init_checkpoint={init_checkpoint} is fine-tuned with its own memory kind {mem_kind!r}"
               if init_checkpoint else f"backbone.memory.kind={mem_kind!r} carries memory")
        raise ValueError(f"gtrxl_ppo: agent.window={window} re-encodes a plain window of the last {window} steps at "
                         f"every step, but {why}; use agent.window=0, or agent.window={window} with "
                         f"backbone.memory.kind=none (and no agent.init_checkpoint)")
    if not window and mem_kind not in PPO_MEMORY_KINDS:
        src = (f"agent.init_checkpoint={init_checkpoint} was trained with backbone.memory.kind="
               f"{mem_kind!r}" if init_checkpoint else f"backbone.memory.kind={mem_kind!r}")
        fix = ("; train the offline run with one of them" if init_checkpoint else
               ", or runs 'none' with a plain window of W steps (agent.window=W; offline agent.kind=gtrxl takes any "
               "stateful memory kind)")
        raise ValueError(
            f"gtrxl_ppo: {src}; PPO stores the memory of every rollout step, which it does for "
            f"{', '.join(repr(k) for k in PPO_MEMORY_KINDS)}{fix}"
        )
    if mem_kind == "compressive" and memory.get("compression", "conv") not in PPO_COMPRESSIONS:
        comp = memory.get("compression", "conv")
        src = f" (agent.init_checkpoint={init_checkpoint})" if init_checkpoint else ""
        # fine-tuning runs the checkpoint's backbone: the config's compression would be ignored
        fix = "train the offline run with" if init_checkpoint else "use"
        raise ValueError(
            f"gtrxl_ppo: backbone.memory.compression={comp!r}{src}; PPO collects its rollouts without gradient and "
            f"recomputes each step over the memory it stored, so a learned compressor (conv, dilated_conv: trained "
            f"by the compression losses of the memory update) would never train, and most_used needs each slot's "
            f"attention usage carried with it; {fix} backbone.memory.compression=max or mean")
    if mem_kind == "spalm" and memory.get("mem_len", 64) == 0:
        raise ValueError("gtrxl_ppo: backbone.memory.mem_len=0; PPO stores each step's XL memory, so the spalm "
                         "memory needs mem_len >= 1")


def ppo_backbone(backbone: Mapping[str, Any], init_checkpoint: str | None, window: int = 0) -> dict[str, Any]:
    """The backbone PPO runs: ``backbone`` (the config's, or the offline run's when fine-tuning)
    without dropout.

    Args:
        window: ``agent.window`` W (> 0: the plain-window mode, memory kind ``none``).

    Raises:
        ValueError (:func:`check_ppo_memory`): without ``agent.window``, a memory kind other than
            ``xl``, ``spalm`` or ``compressive`` (PPO stores the memory of every rollout step);
            with it, a memory kind other than ``none`` or an ``agent.init_checkpoint``
            (fine-tuning starts from a run with memory); an ``agent.init_checkpoint`` of a
            plain-window run (memory kind ``none``); a learned or usage-based compression
            of the compressive memory (:data:`PPO_COMPRESSIONS`); ``spalm`` with ``mem_len`` 0.

    Warns:
        ConfigAdviceWarning: a dropout probability set (turned off: :func:`without_dropout`);
            ``memory.detach=false`` (no effect); ``depth.kind=early_exit`` (trained and run at
            full depth: no exit).
    """
    check_ppo_memory(dict(backbone.get("memory") or {}), init_checkpoint, window)
    backbone, turned_off = without_dropout(backbone)
    src = f" (the backbone of agent.init_checkpoint={init_checkpoint})" if init_checkpoint else ""
    if turned_off:
        warnings.warn(
            f"gtrxl_ppo trains without dropout: {', '.join(turned_off)}{src} set to 0. With dropout the "
            f"update would recompute each sample's log-probability under another dropout mask than the "
            f"rollout's, so PPO's ratio would not start at 1 and its clip would act on dropout noise; "
            f"set {'it' if len(turned_off) == 1 else 'them'} to 0 to silence this", ConfigAdviceWarning,
            stacklevel=4)
    if dict(backbone.get("memory") or {}).get("detach", True) is False:
        warnings.warn(
            f"gtrxl_ppo: backbone.memory.detach=false{src} has no effect: the update recomputes each rollout "
            f"step as one query over the memory that step acted with, stored by the rollout (collected "
            f"without gradient), so no gradient reaches the memory, as with detach=true", ConfigAdviceWarning,
            stacklevel=4)
    if dict(backbone.get("depth") or {}).get("kind") == "early_exit":
        fix = "" if init_checkpoint else "; use backbone.depth.kind=fixed to silence this"
        warnings.warn(
            f"gtrxl_ppo: backbone.depth.kind=early_exit{src} runs every layer here: PPO's loss trains the policy "
            f"and value at full depth, so the exit classifier gets no gradient and the run acts and evaluates at "
            f"full depth (early exit is trained by the offline objectives bc and rcbc){fix}", ConfigAdviceWarning,
            stacklevel=4)
    return backbone


def with_encoder(a: PPOAgentConfig, spec: EnvSpec, inputs: dict[str, Any]) -> dict[str, Any]:
    """The model inputs ``inputs`` with the observation encoder (``agent.encoder``, or the offline run's
    when fine-tuning) and the environment's observation shape.

    Raises:
        ConfigFieldError: the encoder does not take the environment's observations (a flat kind on
            uint8 (C, H, W) images or the reverse; :func:`check_observations`), or an image encoder
            with ``agent.window`` (a rollout would keep W frames per step to encode them again).
    """
    encoder = inputs.get("encoder") or a.encoder.to_dict()
    enc_cfg = EncoderConfig.from_dict(encoder, "agent.encoder")
    check_observations(enc_cfg, spec.obs_shape, spec.obs_dtype, f"the environment {spec.env_id}")
    if a.window and enc_cfg.capabilities.image:
        raise ConfigFieldError(
            "agent.window", f"={a.window} with agent.encoder.kind={enc_cfg.kind}: each update encodes a step's "
            f"pixels again with the weights it trains, and a plain window would need the rollout to keep the "
            f"last {a.window} frames of every step; use backbone.memory.kind=xl (agent.window=0) for images", sep="")
    return {**inputs, "encoder": encoder, "obs_shape": spec.obs_shape}


def _agent_config(cfg: Any) -> PPOAgentConfig:
    """The typed ``agent`` section of a run config."""
    return PPOAgentConfig.from_dict({k: v for k, v in _plain(cfg.agent).items() if k != "kind"}, where="agent")


class GTrXLPPO:
    """PPO-GTrXL (the runtime's ``Trainable``); see the module docstring.

    Built by one of three constructors: :meth:`fresh` (a new run, from scratch or fine-tuning
    ``agent.init_checkpoint``), :meth:`resumed_fine_tune` (a resumed fine-tuning run, rebuilt from
    its own checkpoint) and :meth:`for_inference` (a saved run's policy); :meth:`for_training`
    picks one of the first two. ``__init__`` only wires the parts: the model, the
    :class:`~rl_tformers.agents.gtrxl.rollout.RolloutCollector` (rollouts and their buffer), the
    update (:mod:`rl_tformers.agents.gtrxl.ppo_update`) and environment checkpointing
    (:mod:`rl_tformers.agents.gtrxl.env_state`).

    Args:
        cfg: resolved run config (``agent`` as in :data:`PPO_DEFAULTS`, ``backbone``, ``train``, ``eval``, ``seed``).
        a: its typed ``agent`` section.
        spec: the environment's spaces.
        model_cfg: the model to build.
        device: training device.
    """

    #: Each rank's minibatches are its own share of the global minibatch (the trainer does not
    #: shard them under DDP; see the module docstring).
    local_batches = True
    #: Counters the trainer logs at their latest value, not averaged over its logging window.
    latest_logs = ("env_steps",)

    def __init__(self, cfg: Any, a: PPOAgentConfig, spec: EnvSpec, model_cfg: GTrXLConfig,
                 device: torch.device | str) -> None:
        self.cfg, self.a, self.spec, self.model_cfg = cfg, a, spec, model_cfg
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.env_id, self.env_kwargs = spec.env_id, spec.env_kwargs
        self.obs_rms = RunningMeanStd((spec.obs_dim,))
        self.model = GTrXLModel(model_cfg).to(self.device)
        info = dist_info()  # under DDP (torchrun) every process collects its own rollouts
        self.rank, self.world_size = info.rank, info.world_size
        self.n_envs, self.n_steps = int(a.n_envs), int(a.n_steps)
        # normalise (and clip to +-OBS_CLIP) the inputs: with running statistics (obs_norm), or with the offline
        # run's when fine-tuning; otherwise the raw observations, never clipped; pixels never (uint8, scaled in the CNN)
        norm = (bool(a.obs_norm) or bool(a.init_checkpoint)) and not self.model.encoder.pixels
        self.collector = RolloutCollector(
            self.model, spec, self.device, n_envs=self.n_envs, n_steps=self.n_steps, seed=self.seed,
            gamma=float(a.gamma), gae_lambda=float(a.gae_lambda), reward_scale=float(a.reward_scale),
            normalize_obs=norm, obs_rms=self.obs_rms, rank=self.rank, world_size=self.world_size,
            position_limit=position_limit(self.model))
        self.collector.update_obs_stats = bool(a.obs_norm) and not self.model.encoder.pixels
        #: critic-only updates (agent.critic_warmup) leave the encoder and actor without a gradient, as
        #: some backbones leave parts of theirs (needs_find_unused): under DDP the trainer must let
        #: DistributedDataParallel find them (else the next update fails)
        self.ddp_find_unused = a.critic_warmup > 0 or needs_find_unused(self.model.encoder.backbone.config)
        #: the rollout the updates are learning from and how many of its minibatches were served
        self._rollout: dict[str, Any] | None = None
        self._served = 0
        #: why a resume is not exact (None: it is); set by load_extra_state / load_process_state
        self._resume_problem: str | None = None
        self._envs_problem_logged = False

    # -- the three constructors ---------------------------------------------------------------------
    @classmethod
    def for_training(cls, cfg: Any, run_dir: Path | None, device: torch.device | str) -> GTrXLPPO:
        """A training run: :meth:`resumed_fine_tune` when the trainer resumes a fine-tuning run,
        else :meth:`fresh` (``run_dir`` is unused).

        Raises:
            ValueError: rollout or loss options out of range (:class:`PPOAgentConfig`, before any
                environment is made), unsupported spaces (:meth:`EnvSpec.probe`), and the errors of
                :meth:`fresh` and :meth:`RolloutCollector.check_time_limit`.

        Warns:
            ConfigAdviceWarning: ``train.amp=bf16`` (the ratio does not start at 1).
        """
        a = _agent_config(cfg)
        a.check_world_size(dist_info().world_size)
        _warn_amp(cfg)
        spec = EnvSpec.probe(str(a.env_id), dict(a.env_kwargs or {}))
        # a resumed fine-tuning run rebuilds its own model from its checkpoint, never agent.init_checkpoint
        # read again (that run may have been retrained, moved or deleted since)
        resumed = resume_state() if a.init_checkpoint else None
        own_model = dict((resumed or {}).get("extra") or {}).get("model")
        if own_model is not None:
            return cls.resumed_fine_tune(cfg, a, spec, GTrXLConfig(**own_model), device)
        return cls.fresh(cfg, a, spec, device)

    @classmethod
    def fresh(cls, cfg: Any, a: PPOAgentConfig, spec: EnvSpec, device: torch.device | str) -> GTrXLPPO:
        """A new run: the config's model, or the encoder and actor of ``agent.init_checkpoint``.

        Raises:
            ValueError: a memory kind other than ``xl`` (:func:`ppo_backbone`), an
                ``agent.init_checkpoint`` trained on other spaces than ``agent.env_id``'s
                (:func:`check_offline_spaces`) or with ``plugins`` this run does not list
                (:func:`~rl_tformers.runtime.plugins.check_source_plugins`), and those of
                :meth:`RolloutCollector.check_time_limit`.

        Warns:
            ConfigAdviceWarning: the backbone sets a dropout probability (PPO builds its model
                without dropout: :func:`without_dropout`); ``backbone.memory.detach=false`` (no effect).
                Fine-tuning: an agent input or head option that differs from the checkpoint's
                (:func:`fine_tune_input_changes`).
            UserWarning: fine-tuning with a ``backbone.*`` setting that differs from the
                checkpoint's (:func:`fine_tune_backbone_changes`).
        """
        backbone = _plain(cfg.backbone)
        inputs = {"prev_action_input": bool(a.prev_action), "prev_reward_input": bool(a.prev_reward),
                  "head_hidden": int(a.head_hidden)}
        offline = None
        if a.init_checkpoint:
            configured = backbone
            offline, backbone, inputs = read_offline(str(a.init_checkpoint), cfg.get("plugins"))
            check_offline_spaces(offline.get("extra") or {}, str(a.init_checkpoint), spec.env_id, spec.obs_dim,
                                 spec.act_dim, spec.discrete, spec.low, spec.high, spec.action_start)
            warn_ignored_settings(a, configured, backbone, inputs)
        model_cfg = GTrXLConfig(obs_dim=spec.obs_dim, act_dim=spec.act_dim, discrete=spec.discrete, critic="value",
                                backbone=ppo_backbone(backbone, a.init_checkpoint, a.window), window=a.window,
                                **with_encoder(a, spec, inputs))
        agent = cls(cfg, a, spec, model_cfg, device)
        agent.collector.check_time_limit(a.init_checkpoint)
        if offline is not None:
            load_offline(agent.model, agent.obs_rms, agent.collector, offline)
        return agent

    @classmethod
    def resumed_fine_tune(cls, cfg: Any, a: PPOAgentConfig, spec: EnvSpec, model_cfg: GTrXLConfig,
                          device: torch.device | str) -> GTrXLPPO:
        """A resumed fine-tuning run: its own model config (the trainer restores the weights and the
        offline run's observation statistics, which stay frozen)."""
        agent = cls(cfg, a, spec, model_cfg, device)
        agent.collector.check_time_limit(a.init_checkpoint)
        agent.collector.update_obs_stats = False
        return agent

    @classmethod
    def for_inference(cls, cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> GTrXLPPO:
        """A saved run's agent from its checkpoint ``state`` (its own model config, weights and
        observation statistics; no offline checkpoint or rollout needed), in eval mode."""
        a = _agent_config(cfg)
        agent = cls(cfg, a, EnvSpec.probe(str(a.env_id), dict(a.env_kwargs or {})),
                    GTrXLConfig(**state["extra"]["model"]), device)
        agent.load_extra_state(state["extra"])
        agent.model.load_state_dict(state["model"])
        agent.model.eval()
        return agent

    # -- the learning loop: collect a rollout, serve its minibatches ---------------------------------
    def minibatches(self, ro: Mapping[str, Any], skip: int = 0) -> Iterator[dict[str, Any]]:
        """The minibatches of rollout ``ro`` after the first ``skip`` (:func:`ppo_update.minibatches`
        with this run's seed, rollout number, epochs and critic warm-up)."""
        rollouts = self.collector.rollouts
        return ppo_update.minibatches(
            ro, seed=self.seed, rollout=rollouts, n_epochs=int(self.a.n_epochs),
            n_minibatches=int(self.a.n_minibatches), critic_only=rollouts <= int(self.a.critic_warmup),
            device=self.device, skip=skip)

    @property
    def updates_per_rollout(self) -> int:
        """Updates that learn from one rollout (``n_epochs x n_minibatches``): the trainer redraws
        random attention features (Performer/RFA/LSH ``redraw_every``) only between rollouts."""
        return int(self.a.n_epochs) * int(self.a.n_minibatches)

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]:
        """Endless stream of minibatches; a new rollout every ``n_epochs x n_minibatches`` updates.

        Rollouts start at updates that are multiples of U = ``updates_per_rollout``. Resuming at
        ``start_step`` after update j = ``start_step % U`` of a rollout, the stream first serves
        the last U - j minibatches of the checkpointed rollout (:meth:`load_process_state`), then
        collects the next one from the restored environments: the same minibatches, in the same
        order, as the uninterrupted run. Without a checkpointed rollout a fresh rollout feeds
        those U - j updates (see the module docstring).
        """
        skip = int(start_step) % self.updates_per_rollout

        def stream() -> Iterator[dict[str, Any]]:
            if skip:
                saved = self._rollout is not None and self._served == skip
                yield from self._serve(self._rollout if saved else self.collector.collect(), skip)
            while True:
                yield from self._serve(self.collector.collect(), 0)

        return stream()

    def _serve(self, ro: dict[str, Any], skip: int) -> Iterator[dict[str, Any]]:
        """The minibatches of ``ro`` after the first ``skip``, keeping count for :meth:`process_state`."""
        self._rollout, self._served = ro, skip
        for mb in self.minibatches(ro, skip):
            self._served += 1  # counted when handed over: a checkpoint follows the update on it
            yield mb
        self._rollout = None  # (before the next rollout is collected: one rollout in memory)

    def loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor | float]]:
        """PPO loss of one minibatch (:func:`ppo_loss`) and the latest rollout statistics."""
        mb = {k: v.to(self.device) for k, v in batch.items() if isinstance(v, Tensor)}
        a = self.a
        loss, logs = ppo_loss(self.model, mb, clip_coef=float(a.clip_coef), ent_coef=float(a.ent_coef),
                              vf_coef=float(a.vf_coef), norm_adv=bool(a.norm_adv),
                              critic_only=bool(batch.get("critic_only", False)))
        logs.update(batch.get("stats", {}))
        return loss, logs

    def resume_note(self, step: int) -> str | None:
        """The warning ``--resume`` prints when it is not bit-identical (None when it is).

        Exact when the checkpoint holds this process's environments (:meth:`process_state`);
        otherwise one line saying what is restored, what restarts and why.
        """
        if self._resume_problem is None:
            return None
        col = self.collector
        return env_state.resume_note(
            self._resume_problem, step, self.updates_per_rollout,
            resumes_rollout=self._rollout is not None and self._served == step % self.updates_per_rollout,
            env_steps=col.env_steps * self.world_size, rollouts=col.rollouts,
            rollout_steps=self.n_steps * self.n_envs * self.world_size)

    # -- inference side -------------------------------------------------------------------------
    def policy(self, deterministic: bool | None = None) -> GTrXLPolicy:
        """A :class:`GTrXLPolicy` of the current weights and observation statistics;
        ``deterministic`` defaults to ``agent.deterministic``."""
        det = bool(self.a.deterministic) if deterministic is None else deterministic
        norm, spec = self.collector.normalize_obs, self.spec
        o = self.model_cfg.obs_dim
        return GTrXLPolicy(
            self.model, obs_mean=self.obs_rms.mean if norm else np.zeros(o), obs_std=self.obs_rms.std if norm else np.ones(o),
            action_low=spec.low, action_high=spec.high, reward_mult=self.collector.input_reward_mult,
            deterministic=det, obs_clip=OBS_CLIP if norm else None,
            action_start=spec.action_start, action_shape=None if spec.discrete else spec.action_shape,
        )

    def make_env(self):
        """Zero-argument factory of the training environment (:meth:`EnvSpec.make`)."""
        return self.spec.make

    def default_targets(self) -> list[float | None]:
        """``[None]``: PPO is not return-conditioned."""
        return [None]

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean/std return of the deterministic policy over ``eval.episodes`` episodes."""
        was_training = self.model.training
        report = evaluate(self.policy(), self.make_env(), [None], episodes=int(self.cfg.eval.episodes),
                          n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step), env_id=self.env_id)
        self.model.train(was_training)
        return report_logs(report)

    # -- checkpoints ------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Observation statistics, step counters (environment steps, rollouts), recent episode
        returns/lengths, reward multiplier, environment and model config for a checkpoint."""
        return {
            "obs_mean": torch.as_tensor(self.obs_rms.mean), "obs_var": torch.as_tensor(self.obs_rms.var),
            "obs_count": float(self.obs_rms.count), **self.collector.counters_state(),
            "env_id": self.env_id, "env_kwargs": dict(self.env_kwargs), "model": model_config_dict(self.model_cfg),
        }

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore the observation statistics, step counters, reward multiplier and recent
        episode returns/lengths that :meth:`extra_state` saved (``--resume``)."""
        # until load_process_state says otherwise (a checkpoint without it: not exact)
        self._resume_problem = "the checkpoint holds no environment state (written before gtrxl_ppo saved it)"
        self.obs_rms.mean = np.asarray(state["obs_mean"], np.float64)
        self.obs_rms.var = np.asarray(state["obs_var"], np.float64)
        self.obs_rms.count = float(state["obs_count"])
        self.collector.load_counters_state(state)

    def process_state(self) -> dict[str, Any]:
        """This process's running state, saved in every checkpoint (the trainer's per-process hook):
        :func:`env_state.process_state` of the collector, with the rollout in progress between the
        first and last update of a rollout. An environment whose state is not all plain data is
        named (logged once): a resume restores it only by unpickling (``--unsafe-unpickle-envs``),
        else restarts the environments and says so."""
        in_progress = 0 < self._served < self.updates_per_rollout and self._rollout is not None
        st = env_state.process_state(self.collector, self._rollout if in_progress else None, self._served)
        if st["envs_problem"] is not None and not self._envs_problem_logged and self.rank == 0:
            log.warning("gtrxl_ppo: %s; a --resume of this run restores them only by unpickling them "
                        "(--unsafe-unpickle-envs), else restarts them (not bit-identical)", st["envs_problem"])
            self._envs_problem_logged = True
        return st

    def load_process_state(self, states: list[Mapping[str, Any]] | None) -> None:
        """Restore this rank's :meth:`process_state` from a checkpoint's list of every rank's.

        Sets :attr:`_resume_problem` (None: the continuation is exact) when the environments
        cannot come back: no state in the checkpoint, another number of processes or format, a malformed
        rollout in progress (nothing restored), or environments that could not be restored (or only by
        unpickling, not allowed). A well-formed checkpointed rollout is served by :meth:`batches` either way.
        """
        if states is None:
            return  # (load_extra_state set the problem)
        if len(states) != self.world_size:
            self._resume_problem = (f"the checkpoint was written by {len(states)} process(es) and this run has "
                                    f"{self.world_size}, so no process gets the environments it ran")
            return
        st = states[self.rank]
        self._resume_problem = env_state.format_problem(st, self.n_envs)
        if self._resume_problem is not None:
            return
        rollout, served, self._resume_problem = env_state.checked_rollout(st, self.collector, self.updates_per_rollout)
        if self._resume_problem is not None:
            return
        if rollout is not None:
            self._rollout, self._served = rollout, served
        self._resume_problem = env_state.restore_process_state(self.collector, st)


def load_ppo_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> GTrXLPPO:
    """A :class:`GTrXLPPO` rebuilt from a checkpoint (:meth:`GTrXLPPO.for_inference`)."""
    return GTrXLPPO.for_inference(cfg, state, device)


register_inference_loader("gtrxl_ppo")(load_ppo_for_inference)


@register_agent(
    "gtrxl_ppo",
    description="GTrXL trained online with PPO in gymnasium vector envs (from scratch or from an offline gtrxl run)",
    defaults=PPO_DEFAULTS,
    config_cls=PPOAgentConfig,
    local_batches=True,  # every rank trains on its own rollout: train.batch_size is not split
    check_backbone=check_causal,
)
def build_gtrxl_ppo(cfg: Any, run_dir: Path, device: torch.device) -> GTrXLPPO:
    """Builder of ``agent.kind=gtrxl_ppo`` (:meth:`GTrXLPPO.for_training`)."""
    return GTrXLPPO.for_training(cfg, run_dir, device)
