"""GTrXL policy and value networks on the shared backbone (Parisotto et al. 2019).

One token per environment step. The token is a linear embedding of the step's inputs
``[enc(obs_t) ; rtg_t ; a_{t-1} ; r_{t-1}]`` (the last three optional; ``enc`` the observation
encoder, ``agent.encoder``: the flat observation itself by default, a CNN for pixels), run through a
:class:`~rl_tformers.backbone.Backbone` configured as a gated Transformer-XL:

    backbone:
      block:    {kind: gated, gate: gru, gate_bias: 2}   # GTrXL gating, identity at init
      position: {kind: xl_relative}                      # Dai et al. 2019 relative positions
      memory:   {kind: xl, mem_len: M, detach: true}     # stop-gradient memory of M steps

Axis names: B batch (environments or sampled segments), T steps of the segment,
M memory slots per layer, D model width, O observation size, A action size (number of
actions when discrete).

Memory is an explicit :class:`~rl_tformers.types.BackboneState` that the caller owns: the
module keeps nothing between calls. Feeding one step at a time with the returned state costs
O(M) per step (one query over M + 1 keys per layer), never a re-encoding of the history.
Positions are absolute environment steps of each token; with relative encodings only their
differences matter, so memory offsets stay exact across segment boundaries. Rows of a batch
are independent streams; ``episode_start`` (B, T) makes a token (and the ones after it) blind
to everything before it, so a segment may cross an episode boundary without leaking, and
:meth:`GTrXLEncoder.reset_state` clears exactly the rows whose episode ended.

Heads: a deterministic/Gaussian actor (tanh mean in [-1, 1]) or a categorical actor; a
state-value head (PPO, IQL's V); twin Q heads (IQL). Actions are in the normalised space
[-1, 1]^A for continuous control; the agent maps them to the environment's bounds.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from rl_tformers.agents.common.encoders import EncoderConfig, ObservationEncoder
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from rl_tformers.backbone import Backbone, IncompatibleConfig
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.position.absolute import LearnedPosition
from rl_tformers.registry import REGISTRIES
from rl_tformers.types import BackboneState

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def gtrxl_backbone(
    *,
    d_model: int = 128,
    n_layers: int = 3,
    n_heads: int = 4,
    mem_len: int = 32,
    gate: str = "gru",
    gate_bias: float = 2.0,
    dropout: float = 0.0,
) -> dict[str, Any]:
    """The GTrXL backbone of Parisotto et al. 2019 as a plain config dict.

    Gated blocks (``gate``: gru, input, output, highway or sigmoid_tanh; bias b_g), Transformer-XL
    relative positions, XL memory of ``mem_len`` detached slots, dense attention, final
    layer norm, no dropout (the usual setting in RL).
    """
    return {
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "dropout": dropout,
        "attn_dropout": dropout,
        "causal": True,
        "attention": {"kind": "sdpa"},
        "position": {"kind": "xl_relative"},
        "memory": {"kind": "xl", "mem_len": mem_len, "detach": True},
        "block": {"kind": "gated", "gate": gate, "gate_bias": gate_bias},
        "final_norm": True,
    }


@dataclass(frozen=True)
class GTrXLConfig:
    """Hyper-parameters of :class:`GTrXLModel`.

    Attributes:
        obs_dim: O, flat observation size (prod(obs_shape)).
        act_dim: A, action dimension (continuous) or number of actions (discrete).
        discrete: categorical actor (True) or tanh-Gaussian/deterministic actor (False).
        backbone: backbone config dict (default :func:`gtrxl_backbone`); its memory kind must
            be stateful (``xl``, ...), else the agent has no memory across segments.
        rtg_input: feed the (scaled) return-to-go as an input (return-conditioned BC, as DT).
        prev_action_input: feed a_{t-1} (one-hot when discrete; zeros at an episode start, see
            ``prev_action_zero_at_start`` for discrete actions).
        prev_reward_input: feed r_{t-1} (scaled; zero at an episode start).
        head_hidden: hidden width of the actor/value MLP heads (0 = linear head).
        critic: ``"none"`` (BC), ``"value"`` (PPO: V head on the shared encoder) or
            ``"iql"`` (V and twin Q heads on a critic encoder).
        critic_hidden: hidden width of the IQL critic heads.
        share_critic_encoder: IQL critics on the actor's encoder (True) or on their own
            GTrXL encoder (False, the default: the separate networks of Kostrikov et al. 2021).
        log_std_init: initial log standard deviation of the Gaussian actor.
        prev_action_zero_at_start: discrete a_{t-1} input: a negative index (``-1``, what the
            offline agent's batches and :class:`~rl_tformers.agents.gtrxl.agent.GTrXLPolicy` pass
            at an episode start: no previous action) is the zero vector (True, set by the offline
            agent), or the one-hot of action 0 (False, the default: models from before this
            field, whose starts were encoded so, and PPO, whose rollouts pass action 0 at a start).
        window: W > 0 with a memory kind that keeps nothing between calls (``none``; needed by
            depth kinds that refuse a state, e.g. ``universal``): a plain context window. The
            policy keeps the inputs of the last W steps and re-encodes them at every step
            (O(W) tokens per step instead of one token over the memory); train with
            ``agent.seq_len = W`` and ``agent.burn_in = 0``. 0 (default): recurrent memory.
        obs_shape: shape of one observation (``(C, H, W)`` for images); None: ``(obs_dim,)``.
        encoder: the observation encoder as a dict (``agent.encoder``: ``{"kind": ..., ...}``,
            :mod:`rl_tformers.agents.common.encoders`); None: ``linear`` (the flat observation).
    """

    obs_dim: int
    act_dim: int
    discrete: bool = False
    backbone: Mapping[str, Any] = field(default_factory=gtrxl_backbone)
    rtg_input: bool = False
    prev_action_input: bool = False
    prev_reward_input: bool = False
    head_hidden: int = 0
    critic: str = "none"
    critic_hidden: int = 256
    share_critic_encoder: bool = False
    log_std_init: float = -0.5
    window: int = 0
    prev_action_zero_at_start: bool = False
    obs_shape: tuple[int, ...] | None = None
    encoder: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        shape = (int(self.obs_dim),) if self.obs_shape is None else tuple(int(k) for k in self.obs_shape)
        object.__setattr__(self, "obs_shape", shape)
        object.__setattr__(self, "encoder", self.encoder_config.to_dict())  # plain data (checkpoints)
        if self.window < 0:
            raise ValueError(f"agent.window must be >= 0, got {self.window}")
        if self.obs_dim < 1 or self.act_dim < 1:
            raise ValueError(f"gtrxl: obs_dim and act_dim must be >= 1, got {self.obs_dim}, {self.act_dim}")
        for name in ("head_hidden", "critic_hidden"):  # _mlp treats any width <= 0 as "linear": refuse < 0
            if getattr(self, name) < 0:
                raise ValueError(f"agent.{name} must be >= 0 (0: a linear head), got {getattr(self, name)}")
        if self.critic not in ("none", "value", "iql"):
            raise ValueError(f"agent.critic={self.critic!r}; use none, value or iql")

    @property
    def encoder_config(self) -> EncoderConfig:
        """The typed observation-encoder config of :attr:`encoder`."""
        return EncoderConfig.from_dict(self.encoder, "agent.encoder")

    @property
    def obs_features(self) -> int:
        """F, the observation encoder's feature size (O for ``linear``)."""
        return self.encoder_config.out_features(self.obs_shape)

    @property
    def extra_dim(self) -> int:
        """E, the size of the inputs besides the observation: rtg, a_{t-1}, r_{t-1} (when configured)."""
        return int(self.rtg_input) + (self.act_dim if self.prev_action_input else 0) + int(self.prev_reward_input)

    @property
    def input_dim(self) -> int:
        """Size of the per-step input vector fed to the token embedding: F + E."""
        return (
            self.obs_features
            + int(self.rtg_input)
            + (self.act_dim if self.prev_action_input else 0)
            + int(self.prev_reward_input)
        )


def memory_kernels(position: str | None = None) -> list[str]:
    """Attention kinds that can serve GTrXL: causal, accept memory keys, and (when given) apply
    the positional kind ``position``."""
    out = []
    for e in REGISTRIES["attention"]:
        c = e.capabilities
        if c.memory and c.causal and (position is None or c.positions is None or position in c.positions):
            out.append(e.kind)
    return out


def window_recipe(window: int | str) -> str:
    """The settings of GTrXL's plain-window mode, for error messages."""
    return (f"agent.window={window} backbone.memory.kind=none agent.burn_in=0 agent.seq_len={window} (a window "
            f"of W steps re-encoded at every step; training segments of W steps, nothing carried over)")


def check_causal(cfg: BackboneConfig) -> None:
    """Refuse a non-causal GTrXL backbone (the agents' ``check_backbone`` hook, also run by
    :func:`build_backbone`).

    A training segment attending to its later steps would train each action on the future
    (their observations, and a_t, r_t as the next steps' inputs), which acting one step at a time
    never sees; GTrXL has no last-action mode to offer instead.

    Raises:
        IncompatibleConfig: ``backbone.causal=false``, or an attention kind without a causal form
            (the message lists the causal kernels that attend over GTrXL's memory).
    """
    if not cfg.causal:
        raise IncompatibleConfig(
            "gtrxl: backbone.causal=false would let each step of a training segment attend to the later steps "
            "of its segment (the future), which acting one step at a time never sees; GTrXL is causal: "
            "leave backbone.causal=true"
        )
    bad = _first_layer_without(cfg, "causal")
    if bad is not None:
        where, kind, at, pos_where, pos = bad
        raise IncompatibleConfig(
            f"gtrxl: {where}.kind={kind!r}{at} has no causal form, and GTrXL acts one step "
            f"at a time on the past only; causal kernels that attend over its memory (with "
            f"{pos_where}.kind={pos!r}): {', '.join(memory_kernels(pos))}"
        )


def _first_layer_without(cfg: BackboneConfig, capability: str) -> tuple[str, str, str, str, str] | None:
    """The first layer whose attention kind lacks ``capability`` (every layer's kernel, with
    ``backbone.layers``): ``(where it is set, kind, " (layer i)" or "", where its position is set,
    position kind)``, or None."""
    for i, (where, att) in enumerate(cfg.per_layer("attention")):
        if not getattr(REGISTRIES["attention"].get(att.kind).capabilities, capability):
            at, pos_where = (f" (layer {i})", f"layer {i}'s position") if cfg.layers else ("", "backbone.position")
            return where, att.kind, at, pos_where, cfg.layer_config(i).position.kind
    return None


def needs_find_unused(cfg: BackboneConfig) -> bool:
    """Whether some GTrXL updates leave trainable backbone parameters without a gradient, so that
    DistributedDataParallel must look for them (the agent's ``ddp_find_unused``, docs/runtime.md).

    - ``depth.kind=early_exit``: IQL trains its actor and critics at full depth, so the exit
      classifier gets no gradient there;
    - ``memory.kind=compressive``: the compression function runs only in updates where some row
      forms a group of old memories (an episode boundary or a full FIFO in its window), which
      depends on the data each process drew; without this, one rank reduces gradients the other
      does not have and gloo aborts on the mismatch;
    - ``memory.kind=spalm``: its gate gets a gradient only from steps that retrieved something
      from the long-term store, which a rank's batch may lack (episode starts, PPO samples).
    """
    return cfg.depth.kind == "early_exit" or cfg.memory.kind in ("compressive", "spalm")


def check_memory_keys(cfg: BackboneConfig) -> None:
    """Refuse a layer whose attention kind takes no memory keys (GTrXL attends over its memory).

    Raises:
        IncompatibleConfig: naming the layer's kind, where it is set (``backbone.attention`` or
            ``backbone.layers[i].attention``) and the kernels that can.
    """
    bad = _first_layer_without(cfg, "memory")
    if bad is not None:
        where, kind, at, pos_where, pos = bad
        raise IncompatibleConfig(
            f"gtrxl: {where}.kind={kind!r}{at} takes no memory keys, but GTrXL attends over its memory; "
            f"kernels that can (with {pos_where}.kind={pos!r}): {', '.join(memory_kernels(pos))}"
        )


def build_backbone(cfg: Mapping[str, Any] | BackboneConfig, window: int = 0) -> Backbone:
    """Build the backbone, refusing what GTrXL cannot use with messages naming the option.

    Args:
        cfg: backbone config.
        window: ``agent.window`` (:class:`GTrXLConfig`): > 0 selects the plain-window mode,
            which needs a memory kind that keeps nothing between calls.

    Raises:
        IncompatibleConfig: ``backbone.causal=false`` or an attention kind without a causal
            form (the message lists the kernels GTrXL can use); a memory kind that keeps nothing between calls without
            ``agent.window``, or ``agent.window`` with a stateful memory; an attention kind
            that takes no memory keys (the message lists the kernels that do); or whatever
            :func:`rl_tformers.backbone.check_compatible` refuses (causal form, positions...).
        RegistryError: unknown kinds or fields (dotted path in the message).
    """
    if not isinstance(cfg, BackboneConfig):  # before the generic check, which cannot name GTrXL's way out
        depth = str(dict(cfg.get("depth") or {}).get("kind", "fixed"))
        memory = str(dict(cfg.get("memory") or {}).get("kind", "xl"))
        if depth == "universal" and memory != "none":
            raise IncompatibleConfig(
                f"gtrxl: backbone.depth.kind='universal' carries no state between calls, so it cannot run with "
                f"backbone.memory.kind={memory!r}; in GTrXL it runs in the plain-window mode: {window_recipe('W')}"
            )
    bb_cfg = cfg if isinstance(cfg, BackboneConfig) else BackboneConfig.from_dict(cfg, where="backbone")
    check_causal(bb_cfg)
    mem = REGISTRIES["memory"].get(bb_cfg.memory.kind).capabilities
    if window > 0:
        if mem.stateful:
            raise IncompatibleConfig(
                f"gtrxl: agent.window={window} re-encodes a plain context window, but backbone.memory.kind="
                f"{bb_cfg.memory.kind!r} carries memory; use agent.window=0, or the whole window recipe: "
                f"{window_recipe(window)}"
            )
    elif not mem.stateful:
        raise IncompatibleConfig(
            f"gtrxl: backbone.memory.kind={bb_cfg.memory.kind!r} keeps no memory between steps; "
            f"GTrXL needs a memory kind that carries state ("
            f"{', '.join(e.kind for e in REGISTRIES['memory'] if e.capabilities.stateful)}), or a plain context "
            f"window: {window_recipe('W')}"
        )
    else:
        check_memory_keys(bb_cfg)
    threshold = getattr(bb_cfg.depth, "threshold", None)
    if threshold is not None:
        # a stored threshold would exit in training too (the loss trains the actor on every layer
        # at full depth); acting takes its threshold from the agent's options
        raise IncompatibleConfig(
            f"gtrxl: backbone.depth.threshold={threshold}: GTrXL trains at full depth; the acting threshold is "
            f"agent.early_exit.threshold (a number or 'calibrate') or rl-tformers eval --early-exit; leave "
            f"backbone.depth.threshold unset"
        )
    try:
        return Backbone(bb_cfg)
    except IncompatibleConfig as exc:
        raise IncompatibleConfig(f"gtrxl: {exc}") from exc


@dataclass
class EncoderOutput:
    """Result of :meth:`GTrXLEncoder.forward`.

    Attributes:
        features: (B, T, D) per-step features for the heads.
        state: next :class:`BackboneState` (``None`` when called without a state).
        metrics: backbone metrics (gate values, ...), floats or 0-d tensors.
        aux: weighted auxiliary losses from the backbone (usually empty for GTrXL).
        hidden_states: N x (B, T, D) every layer's output before the final norm
            (``output_hidden_states=True``), else None.
    """

    features: Tensor
    state: BackboneState | None
    metrics: dict[str, Any]
    aux: dict[str, Tensor]
    hidden_states: tuple[Tensor, ...] | None = None


class GTrXLEncoder(nn.Module):
    """Per-step token embedding + gated Transformer-XL backbone.

    Args:
        cfg: model config (input flags and backbone).
    """

    def __init__(self, cfg: GTrXLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = build_backbone(cfg.backbone, cfg.window)
        d = self.backbone.config.d_model
        #: (B, T, *obs_shape) -> (B, T, F) (``linear``: the flat observation itself)
        self.encode_obs: ObservationEncoder = cfg.encoder_config.build(cfg.obs_shape)
        self.embed = nn.Linear(cfg.input_dim, d)

    @property
    def d_model(self) -> int:
        """D, the backbone width (the size of the encoder's output features)."""
        return self.backbone.config.d_model

    @property
    def stateful(self) -> bool:
        """False in the plain-window mode (``window > 0``): no state is carried between calls."""
        return self.cfg.window == 0

    @property
    def mem_len(self) -> int:
        """Memory slots per layer (``backbone.memory.mem_len``; 0 for memory kinds without one)."""
        return int(getattr(self.backbone.config.memory, "mem_len", 0))

    @property
    def early_exit(self) -> bool:
        """True when the backbone's depth kind is ``early_exit`` (exit options apply)."""
        return hasattr(self.backbone.depth, "exit_classifier_loss")

    def initial_state(self, batch: int, device: torch.device | str | None = None) -> BackboneState:
        """Empty memory for ``batch`` streams (every slot invalid)."""
        return self.backbone.initial_state(batch, device)

    def reset_state(self, state: BackboneState, episode_start: Tensor) -> BackboneState:
        """Clear the rows where ``episode_start`` (B,) bool is True; other rows unchanged, bit for bit."""
        return self.backbone.reset_state(state, episode_start)

    def initial_window(self, batch: int, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """The empty plain window of ``batch`` streams (``window > 0``): ``window_x`` (B, W,
        input_dim) zeros, ``window_pos`` (B, W) long zeros, ``window_valid`` (B, W) bool False."""
        w = self.cfg.window
        return {"window_x": torch.zeros(batch, w, self.cfg.input_dim, device=device),
                "window_pos": torch.zeros(batch, w, dtype=torch.long, device=device),
                "window_valid": torch.zeros(batch, w, dtype=torch.bool, device=device)}

    @staticmethod
    def shift_window(window: Mapping[str, Tensor], x: Tensor, t: Tensor, start: Tensor) -> dict[str, Tensor]:
        """The plain window after one step: shifted left by one slot, the new step's inputs ``x``
        (B, 1, input_dim) at step ``t`` (B,) in slot W - 1; a row where ``start`` (B,) bool is
        True forgets its older slots (invalid), so a window never holds two episodes."""
        keep = (~start)[:, None]  # (B, 1)
        return {"window_x": torch.cat([window["window_x"][:, 1:], x], 1),
                "window_pos": torch.cat([window["window_pos"][:, 1:], t[:, None]], 1),
                "window_valid": torch.cat([window["window_valid"][:, 1:] & keep, torch.ones_like(keep)], 1)}

    def encode_window(self, window: Mapping[str, Tensor], **kwargs: Any) -> EncoderOutput:
        """Encode a plain window (:meth:`shift_window`): its last token's features are the newest
        step's, ``.features[:, -1]`` (B, D); invalid slots are masked out of attention."""
        return self(window["window_x"], window["window_pos"], mask=window["window_valid"], **kwargs)

    @property
    def pixels(self) -> bool:
        """True when the observation encoder takes uint8 images (PPO keeps them in its rollouts
        and encodes them again in each update)."""
        return self.cfg.encoder_config.capabilities.image

    def inputs(
        self,
        obs: Tensor,
        rtg: Tensor | None = None,
        prev_action: Tensor | None = None,
        prev_reward: Tensor | None = None,
    ) -> Tensor:
        """Concatenate the configured inputs: the encoded observation and :meth:`extra_inputs`.

        Shapes: obs (B, T, O) or (B, T, *obs_shape) (image kinds: uint8 pixels), rtg (B, T),
        prev_action (B, T, A) or (B, T) long, prev_reward (B, T) -> (B, T, input_dim).

        Raises:
            ValueError: when a configured input is missing, or observations of another shape.
        """
        return self.extra_inputs(self.encode_obs(obs), rtg, prev_action, prev_reward)

    def extra_inputs(
        self,
        features: Tensor,
        rtg: Tensor | None = None,
        prev_action: Tensor | None = None,
        prev_reward: Tensor | None = None,
    ) -> Tensor:
        """``[features ; rtg ; a_{t-1} ; r_{t-1}]`` (the configured ones): features (B, T, F) -> (B, T, F + E).

        A discrete ``prev_action`` (B, T) long is one-hot encoded; ``-1`` (no previous action: an
        episode start) gives zeros when the model was built with ``prev_action_zero_at_start``.
        ``features`` may have F = 0 (PPO's stored inputs besides the pixels).

        Raises:
            ValueError: when a configured input is missing.
        """
        obs = features
        parts = [obs]
        if self.cfg.rtg_input:
            if rtg is None:
                raise ValueError("gtrxl: the model is return-conditioned (rtg_input) but no rtg was given")
            parts.append(rtg.unsqueeze(-1).to(obs.dtype))
        if self.cfg.prev_action_input:
            if prev_action is None:
                raise ValueError("gtrxl: prev_action_input is set but no prev_action was given")
            if self.cfg.discrete and prev_action.dim() == obs.dim() - 1:
                idx = prev_action.long()
                one_hot = F.one_hot(idx.clamp_min(0), self.cfg.act_dim)  # (B, T, A)
                if self.cfg.prev_action_zero_at_start:  # -1: no previous action (episode start) -> zeros
                    one_hot = one_hot * (idx >= 0).unsqueeze(-1).to(one_hot.dtype)
                prev_action = one_hot
            parts.append(prev_action.to(obs.dtype))
        if self.cfg.prev_reward_input:
            if prev_reward is None:
                raise ValueError("gtrxl: prev_reward_input is set but no prev_reward was given")
            parts.append(prev_reward.unsqueeze(-1).to(obs.dtype))
        return torch.cat(parts, dim=-1)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        *,
        state: BackboneState | None = None,
        episode_start: Tensor | None = None,
        mask: Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
        **depth_kwargs: Any,
    ) -> EncoderOutput:
        """Encode a segment of steps.

        Args:
            x: (B, T, input_dim) from :meth:`inputs`.
            positions: (B, T) long, environment step of each token within its episode.
            state: memory from :meth:`initial_state` or a previous call (``None``: no memory,
                one segment on its own).
            episode_start: (B, T) bool, True where a token starts a new episode.
            mask: (B, T) bool, False for padding.
            need_weights: compute attention probabilities (for attention-entropy logging).
            output_hidden_states: also return every layer's output (N x (B, T, D), before the
                final norm; depth kind ``early_exit`` trains the actor on each).
            depth_kwargs: passed to the depth module (``early_exit``: ``exit_threshold``,
                ``exit_head``, ``exit_mask``, ``exit_layers``; :mod:`rl_tformers.depth.early_exit`).

        Returns:
            :class:`EncoderOutput` with features (B, T, D) and the next state.
        """
        out = self.backbone(
            self.embed(x), positions, mask=mask, state=state, episode_start=episode_start, need_weights=need_weights,
            output_hidden_states=output_hidden_states, **depth_kwargs,
        )
        return EncoderOutput(out.hidden, out.state, out.metrics, out.aux, out.hidden_states)


def _mlp(d_in: int, hidden: int, d_out: int) -> nn.Module:
    if hidden <= 0:
        return nn.Linear(d_in, d_out)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


class Actor(nn.Module):
    """Policy head: features (..., D) -> action distribution.

    Continuous: mean = tanh(f(h)) in [-1, 1]^A and a state-independent log std (clamped to
    [-5, 2]), i.e. a Gaussian whose mode is the deterministic action (the tanh-mean Gaussian
    of CORL's IQL). Discrete: categorical logits (..., A).
    """

    def __init__(self, d_model: int, act_dim: int, discrete: bool, hidden: int, log_std_init: float) -> None:
        super().__init__()
        self.discrete = discrete
        self.net = _mlp(d_model, hidden, act_dim)
        self.log_std = None if discrete else nn.Parameter(torch.full((act_dim,), float(log_std_init)))

    def forward(self, h: Tensor) -> Tensor:
        """(..., D) -> (..., A): tanh mean (continuous) or logits (discrete)."""
        out = self.net(h)
        return out if self.discrete else torch.tanh(out)

    def dist(self, h: Tensor) -> Distribution:
        """Action distribution at features (..., D); Normal's log_prob must be summed over A."""
        out = self(h)
        # no argument validation: it reads every value on the host (a device sync per update)
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        std = self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).exp().expand_as(out)
        return Normal(out, std, validate_args=False)

    def log_prob(self, h: Tensor, action: Tensor) -> Tensor:
        """log pi(a | h): h (..., D), action (..., A) float or (...) long -> (...)."""
        d = self.dist(h)
        return d.log_prob(action.long()) if self.discrete else d.log_prob(action).sum(-1)

    def entropy(self, h: Tensor) -> Tensor:
        """Entropy of pi(. | h): (..., D) -> (...)."""
        d = self.dist(h)
        return d.entropy() if self.discrete else d.entropy().sum(-1)

    def mode(self, h: Tensor) -> Tensor:
        """Deterministic action: argmax (..., ) long or the tanh mean (..., A)."""
        out = self(h)
        return out.argmax(-1) if self.discrete else out


class TwinQ(nn.Module):
    """Two Q heads (IQL's twin critics). Continuous: (h (..., D), a (..., A)) -> two (...)
    values. Discrete: two (..., A) tables from h, gathered at ``a`` (...) long (required):
    two (...) values."""

    def __init__(self, d_model: int, act_dim: int, discrete: bool, hidden: int) -> None:
        super().__init__()
        self.discrete = discrete
        d_in = d_model if discrete else d_model + act_dim
        d_out = act_dim if discrete else 1
        self.q1 = _mlp(d_in, hidden, d_out)
        self.q2 = _mlp(d_in, hidden, d_out)

    def forward(self, h: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
        """(Q1(h, a), Q2(h, a)), each (...); shapes in the class docstring."""
        if self.discrete:
            idx = action.long().unsqueeze(-1)  # (..., 1)
            return self.q1(h).gather(-1, idx).squeeze(-1), self.q2(h).gather(-1, idx).squeeze(-1)
        x = torch.cat([h, action.to(h.dtype)], dim=-1)  # (..., D + A)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class GTrXLModel(nn.Module):
    """Encoder + actor (+ value head for PPO, or IQL's critic encoder, V and twin Q).

    Attributes:
        encoder: :class:`GTrXLEncoder` of the actor.
        actor: :class:`Actor`.
        value: V head on ``encoder`` (``critic="value"``) or on ``critic_encoder`` (``"iql"``).
        critic_encoder: IQL's critic encoder (the actor's when ``share_critic_encoder``).
        q: :class:`TwinQ` (IQL only).
        target: frozen Polyak copy of ``{"encoder": critic encoder, "q": twin Q}`` (IQL only).
    """

    def __init__(self, cfg: GTrXLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = GTrXLEncoder(cfg)
        d = self.encoder.d_model
        self.actor = Actor(d, cfg.act_dim, cfg.discrete, cfg.head_hidden, cfg.log_std_init)
        self.value: nn.Module | None = None
        self.critic_encoder: GTrXLEncoder | None = None
        self.q: TwinQ | None = None
        if cfg.critic == "value":
            self.value = _mlp(d, cfg.head_hidden, 1)
        elif cfg.critic == "iql":
            if not cfg.share_critic_encoder:
                self.critic_encoder = GTrXLEncoder(cfg)
            self.value = _mlp(d, cfg.critic_hidden, 1)
            self.q = TwinQ(d, cfg.act_dim, cfg.discrete, cfg.critic_hidden)
        # IQL's Polyak-averaged target (critic encoder + twin Q), frozen; part of the state_dict
        self.target: nn.ModuleDict | None = self.make_target() if cfg.critic == "iql" else None

    @property
    def critic_net(self) -> GTrXLEncoder:
        """The encoder under the IQL critics (the actor's when shared)."""
        return self.critic_encoder if self.critic_encoder is not None else self.encoder

    def critic_target_modules(self) -> nn.ModuleDict:
        """The modules IQL keeps a Polyak-averaged target copy of (critic encoder and twin Q)."""
        if self.q is None:
            raise ValueError("gtrxl: the model has no Q heads (critic must be 'iql')")
        return nn.ModuleDict({"encoder": self.critic_net, "q": self.q})

    def make_target(self) -> nn.ModuleDict:
        """Frozen deep copy of :meth:`critic_target_modules` (requires_grad off)."""
        tgt = copy.deepcopy(self.critic_target_modules())
        for p in tgt.parameters():
            p.requires_grad_(False)
        return tgt

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` the modules the agents call (``train.compile=true``), in place.

        The model has no ``forward``: the losses and policies call its encoder(s) and heads directly,
        so :meth:`torch.nn.Module.compile` of the model itself compiled nothing that ever runs
        (``train.compile=true`` was a silent no-op for GTrXL). Each called submodule is compiled
        instead, with the same arguments; parameter names and checkpoints are unchanged. IQL's
        frozen target copy stays uncompiled (it is only read under ``no_grad``).
        """
        for module in (self.encoder, self.actor, self.value, self.critic_encoder, self.q):
            if module is not None:
                module.compile(*args, **kwargs)

    def state_value(self, h: Tensor) -> Tensor:
        """V(h): (..., D) -> (...)."""
        if self.value is None:
            raise ValueError("gtrxl: the model has no value head (critic must be 'value' or 'iql')")
        return self.value(h).squeeze(-1)


def position_limit(module: nn.Module) -> int | None:
    """Largest position + 1 the backbone's learned absolute position tables take, or ``None``.

    GTrXL's positions are episode steps (0 at each episode start), so with
    ``backbone.position.kind=learned`` an episode of more than ``backbone.max_position`` steps
    has no table row for its later steps; the other position kinds have no such limit.
    """

    limits = [m.max_position for m in module.modules() if isinstance(m, LearnedPosition) and m.table is not None]
    return min(limits) if limits else None


class record_attention:
    """Context manager collecting each layer's attention probabilities (B, H, T, S) from the
    forward calls made with ``need_weights=True`` inside it (forward hooks on the attention
    modules, removed on exit). Used to log attention entropy without changing the backbone.

    Example::

        with record_attention(encoder) as weights:
            encoder(x, positions, state=s, need_weights=True)
        entropies = [attention_entropy(w) for w in weights]
    """

    def __init__(self, encoder: GTrXLEncoder) -> None:
        self.encoder = encoder
        self.store: list[Tensor] = []
        self.handles: list[Any] = []

    def _hook(self, _module: nn.Module, _inputs: Any, out: Any) -> None:
        if getattr(out, "weights", None) is not None:
            self.store.append(out.weights)

    def __enter__(self) -> list[Tensor]:
        self.store = []
        self.handles = [blk.attn.register_forward_hook(self._hook) for blk in self.encoder.backbone.blocks]
        return self.store

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def gate_logs(metrics: Mapping[str, Any]) -> dict[str, Tensor | float]:
    """Backbone metrics ``layer{i}/gate_{attn|ffn}`` (mean gate values) as ``gate/layer{i}_{attn|ffn}``:
    detached 0-dim tensors as they come (no device synchronisation), or floats."""
    out = {}
    for k, v in metrics.items():
        if k.startswith("layer") and "/gate_" in k:
            layer, gate = k.split("/gate_")
            out[f"gate/{layer}_{gate}"] = v.detach() if isinstance(v, Tensor) else float(v)
    return out
