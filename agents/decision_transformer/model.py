"""Decision Transformer model (Chen et al. 2021, "Decision Transformer: Reinforcement Learning via
Sequence Modeling", section 2.2 and figure 1): a pure ``nn.Module``, no data handling.

A trajectory window of K environment steps becomes 3K tokens, interleaved per step::

    (R_0, s_0, a_0, R_1, s_1, a_1, ..., R_{K-1}, s_{K-1}, a_{K-1})

Each modality has its own linear embedding; a learned *timestep* embedding (the episode step,
not the token index) is added to all three tokens of a step. Padding uses timestep index 0
and real step ``t`` uses index ``t + 1``, so padding never shares an embedding with a real
step (the official code and CORL pad with real indices). The sequence goes through any
registered :class:`~rl_tformers.backbone.Backbone`; the backbone receives the *token index*
inside the window (0 .. 3K-1) as positions, so relative and rotary encodings see the right
distances. The action a_i is predicted from the hidden state of the state token s_i.

Two modes (``mode``):

- ``causal`` (the paper): causal attention, every step's action is predicted and trained.
  Needs a kernel with a causal form (``Capabilities.causal``) and ``backbone.causal=true``.
- ``last_action``: for kernels without a causal form (Linformer, ETC, Big Bird-style global
  tokens...): the window holds the past only and ends with the current state token (3K-1
  tokens, no action token for the current step), attention is bidirectional inside it
  (``backbone.causal=false``), and only the last action is predicted. Train on windows that end
  at a real step (the sampler's ``align="end"``).

Heads (``head``): ``deterministic`` (tanh, the paper; trained with MSE), ``gaussian``
(tanh-squashed Gaussian with a learned entropy temperature, Online DT, Zheng et al. 2022,
section 3), and, for discrete action spaces, a linear ``categorical`` head (cross-entropy).
Continuous actions are handled in normalised units ``[-1, 1]``; the agent maps them to the
environment's box (see :func:`to_env_action` / :func:`from_env_action`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from rl_tformers.agents.common.encoders import EncoderConfig, ObservationEncoder
from torch import Tensor, nn

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.depth.early_exit import SCHEMES, with_final_norm
from rl_tformers.dropout import Dropout
from rl_tformers.position.base import embedding_table
from rl_tformers.types import BackboneOutput, TokenIndex, take_tokens

MODES = ("causal", "last_action")
HEADS = ("deterministic", "gaussian", "categorical")
EMBED_INITS = ("gpt2", "paper")


def paper_backbone() -> BackboneConfig:
    """The paper's GPT-style backbone: 3 pre-norm layers, 1 head, 128 dims, ReLU, dropout 0.1.

    No positional encoding in the backbone: the timestep embedding carries position (the
    official implementation removes GPT-2's position table).
    """
    return BackboneConfig(d_model=128, n_layers=3, n_heads=1, dropout=0.1, attn_dropout=0.1, activation="relu")


@dataclass(frozen=True)
class DTConfig:
    """Configuration of :class:`DecisionTransformer`.

    Attributes:
        obs_dim: observation size (flat), O = prod(obs_shape).
        act_dim: action size (continuous) or number of actions (discrete).
        discrete: discrete action space (categorical head, cross-entropy loss).
        obs_shape: shape of one observation (``(C, H, W)`` for images); None: ``(obs_dim,)``.
        encoder: the observation encoder (``agent.encoder``: a config of
            :mod:`rl_tformers.agents.common.encoders` or its dict); None: ``linear``, the flat
            observation read by the linear state embedding (the paper's).
        context_len: K, number of environment steps in a window (paper: 20).
        max_ep_len: largest episode length; timesteps must lie in ``[0, max_ep_len)``.
        mode: ``causal`` or ``last_action`` (see the module docstring).
        head: ``deterministic`` or ``gaussian`` (continuous); ``deterministic`` becomes
            ``categorical`` for discrete actions (``gaussian`` with discrete actions raises).
        embed_dropout: dropout after the embedding LayerNorm (official code: same as the backbone).
        embed_init: initialisation of the four embeddings and the action head. ``gpt2``: weights
            N(0, 0.02), zero biases (Hugging Face's ``DecisionTransformerModel`` and d3rlpy);
            ``paper``: PyTorch's defaults, as in the official code (Chen et al. 2021,
            ``gym/decision_transformer/models/decision_transformer.py``, which initialises only
            the GPT-2 stack): timestep embedding N(0, 1), return embedding weight and bias
            U(-1, 1). The embedding LayerNorm is scale-invariant, so with ``gpt2`` the
            return-to-go token LN(w R + e_t) starts out nearly independent of the size of R
            (its direction is w's once |w R| >> |e_t|); with ``paper`` the bias and the timestep
            embedding are as large as w R and the token's direction varies with R from the start.
        log_std_min, log_std_max: bounds of the Gaussian head's log standard deviation.
        init_temperature: initial entropy temperature of the Gaussian head (Online DT: 0.1).
        target_entropy: entropy target of the temperature loss; ``None`` = -act_dim (Online DT).
        backbone: any backbone configuration (default :func:`paper_backbone`).
        exit_scheme: depth kind ``early_exit`` only: how the head is trained on every exit
            (:func:`rl_tformers.depth.early_exit.exit_loss`: ``sampled``, Elbayad et al.
            2020's one random exit per token; ``weighted``, CALM's; ``uniform``).
        exit_tol: continuous actions, early exit only: layer n "agrees" with the last layer when
            ``max |a^n - a^N| <= exit_tol`` (normalised action units; labels of the CALM
            classifier and the consistency used by calibration).

    Raises:
        ValueError: unknown mode/head (whatever the action space), a gaussian head on discrete
            actions; ``causal`` mode with a non-causal backbone (future action tokens would leak
            into the prediction); a ``backbone.memory.kind`` other than ``none`` (the DT carries
            no memory state); windows of more tokens than the attention kind's fixed
            ``backbone.attention.max_len`` (linformer's linear projection, sinkhorn);
            ``embed_dropout`` outside [0, 1); an unknown ``embed_init`` or ``exit_scheme``;
            ``context_len`` or ``max_ep_len`` < 1; 3K token positions beyond
            ``backbone.max_position``; a ``backbone.depth.threshold`` set (early exit: the
            threshold belongs to evaluation, ``agent.early_exit.threshold``).
    """

    obs_dim: int
    act_dim: int
    discrete: bool = False
    context_len: int = 20
    max_ep_len: int = 1000
    mode: str = "causal"
    head: str = "deterministic"
    embed_dropout: float = 0.1
    embed_init: str = "gpt2"
    log_std_min: float = -5.0
    log_std_max: float = 2.0
    init_temperature: float = 0.1
    target_entropy: float | None = None
    backbone: BackboneConfig = field(default_factory=paper_backbone)
    exit_scheme: str = "sampled"
    exit_tol: float = 0.1
    obs_shape: tuple[int, ...] | None = None
    encoder: EncoderConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.backbone, Mapping):
            object.__setattr__(self, "backbone", BackboneConfig.from_dict(self.backbone))
        shape = (int(self.obs_dim),) if self.obs_shape is None else tuple(int(k) for k in self.obs_shape)
        object.__setattr__(self, "obs_shape", shape)
        object.__setattr__(self, "encoder", EncoderConfig.from_dict(self.encoder, "agent.encoder"))
        self._check_backbone_slots()
        self._check_mode_and_head()
        self._check_window()

    def _check_backbone_slots(self) -> None:
        """Refuse a memory kind (the DT passes no state between windows) and a stored exit threshold."""
        memory = getattr(self.backbone.memory, "kind", "none")
        if memory != "none":
            raise ValueError(
                f"backbone.memory.kind={memory!r}: the Decision Transformer re-encodes its K-step window at "
                f"every step and passes no memory state between windows, so this memory would do nothing; "
                f"use backbone.memory.kind=none (its default), or GTrXL (agent.kind=gtrxl) for a recurrent "
                f"memory (docs/gtrxl.md). Retrieval for the DT is the kNN-LM action memory at evaluation "
                f"(agent.knn.*, rl-tformers eval --knn-lambda; docs/memory_adaptive.md)"
            )
        threshold = getattr(self.backbone.depth, "threshold", None)
        if threshold is not None:
            # the backbone would exit with it in every training forward (every exit trained on
            # layer 1's state) and in the "full model" of evaluation and calibration
            raise ValueError(
                f"backbone.depth.threshold={threshold}: the Decision Transformer trains every exit at full depth "
                f"and picks the exit threshold at evaluation; leave backbone.depth.threshold unset and give "
                f"agent.early_exit.threshold (a number or 'calibrate') or rl-tformers eval --early-exit"
            )

    def _check_mode_and_head(self) -> None:
        """Refuse unknown names (embed_init, mode, head, exit scheme) and a head that does not fit the
        action space; a discrete space's head becomes ``categorical``."""
        if self.embed_init not in EMBED_INITS:
            raise ValueError(f"agent.embed_init={self.embed_init!r}; use one of {', '.join(EMBED_INITS)}")
        if self.mode not in MODES:
            raise ValueError(f"agent.mode={self.mode!r}; use one of {', '.join(MODES)}")
        if self.head not in HEADS:  # a typo is refused whatever the action space
            use = ("deterministic (categorical) for discrete actions" if self.discrete
                   else "deterministic or gaussian for continuous actions")
            raise ValueError(f"agent.head={self.head!r}; use {use}")
        if self.discrete and self.head == "gaussian":
            raise ValueError("agent.head=gaussian needs continuous actions; this action space is discrete")
        if self.discrete:
            object.__setattr__(self, "head", "categorical")
        if not self.discrete and self.head == "categorical":
            raise ValueError(f"agent.head={self.head!r}; use deterministic or gaussian for continuous actions")
        if self.exit_scheme not in SCHEMES:
            raise ValueError(f"agent.early_exit.scheme={self.exit_scheme!r}; use one of {', '.join(SCHEMES)}")

    def _check_window(self) -> None:
        """Refuse windows the backbone cannot take: a non-causal backbone in causal mode, sizes
        below 1, more token positions than ``backbone.max_position`` or the attention kind's fixed
        length; and an ``embed_dropout`` outside [0, 1)."""
        if self.mode == "causal" and not self.backbone.causal:
            raise ValueError(
                "agent.mode=causal needs backbone.causal=true (with bidirectional attention the "
                "action tokens a_t, a_t+1... would leak into the prediction of a_t); for kernels "
                "without a causal form use agent.mode=last_action"
            )
        if self.context_len < 1 or self.max_ep_len < 1:
            raise ValueError(f"agent.context_len and agent.max_ep_len must be >= 1, got {self.context_len}, {self.max_ep_len}")
        if 3 * self.context_len > self.backbone.max_position:
            raise ValueError(
                f"agent.context_len={self.context_len} needs {3 * self.context_len} token positions; "
                f"backbone.max_position={self.backbone.max_position}"
            )
        for where, att in self.backbone.per_layer("attention"):  # every layer's kernel (backbone.layers)
            max_keys = getattr(att, "max_keys", None)  # attention kinds with a fixed maximum length
            if max_keys is not None and self.n_tokens > max_keys:
                raise ValueError(
                    f"agent.context_len={self.context_len} makes windows of {self.n_tokens} tokens "
                    f"({'3K' if self.mode == 'causal' else '3K-1'} in agent.mode={self.mode}), more than attention "
                    f"kind {att.kind!r} takes: {where}.max_len={att.max_len}; lower agent.context_len or raise "
                    f"{where}.max_len"
                )
        if not 0.0 <= self.embed_dropout < 1.0:
            raise ValueError(f"agent.embed_dropout must be in [0, 1), got {self.embed_dropout}")

    @property
    def n_tokens(self) -> int:
        """Tokens per window: 3K (causal) or 3K - 1 (last_action: no current action token)."""
        return 3 * self.context_len - (self.mode == "last_action")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (``backbone`` as its dict); inverse of :meth:`from_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["backbone"] = self.backbone.to_dict()
        out["obs_shape"] = list(self.obs_shape)
        out["encoder"] = self.encoder.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DTConfig:
        """Build from a dict of the fields (``backbone`` may be a dict).

        Raises:
            ValueError: an unknown field (named as ``agent.<field>``), or as the constructor.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"agent.{unknown[0]}: unknown Decision Transformer field; fields: {', '.join(sorted(names))}")
        return cls(**dict(data))


@dataclass
class DTOutput:
    """Result of :meth:`DecisionTransformer.forward`. P = K (causal), or 1 (last_action, or
    causal with ``predict_at``: the given step of each row).

    Attributes:
        action: (B, P, A) normalised action in [-1, 1] (continuous: tanh of the mean) or
            (B, P) long argmax (discrete).
        logits: (B, P, n_actions) for discrete actions, else ``None``.
        mean: (B, P, A) pre-tanh mean (continuous heads).
        log_std: (B, P, A) log standard deviation (gaussian head), else ``None``.
        aux: the backbone's weighted auxiliary losses; metrics: its logged values.
        features: (B, P, D) backbone output at the predicting state tokens (after the final
            norm): what the head reads, and the context embedding of a kNN datastore.
        hidden_states: with ``output_hidden_states=True``: N per-layer outputs (B, P, D) at
            the predicting state tokens, before the final norm (early-exit training).
    """

    action: Tensor
    logits: Tensor | None = None
    mean: Tensor | None = None
    log_std: Tensor | None = None
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    features: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None

    def take_rows(self, index: Tensor) -> DTOutput:
        """The predictions of rows ``index`` ((B',) long, repeats allowed) of every per-row field;
        ``aux`` and ``metrics`` (of the whole batch) unchanged."""
        def take(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[index]

        hs = None if self.hidden_states is None else tuple(h[index] for h in self.hidden_states)
        return DTOutput(take(self.action), take(self.logits), take(self.mean), take(self.log_std), self.aux,
                        self.metrics, take(self.features), hs)


class DecisionTransformer(nn.Module):
    """Return-conditioned sequence model over (R, s, a) tokens.

    Args:
        cfg: :class:`DTConfig`.
    """

    def __init__(self, cfg: DTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.backbone.d_model
        self.embed_timestep = embedding_table(cfg.max_ep_len + 1, d, "agent.max_ep_len")  # index 0 = padding, t -> t + 1
        self.embed_return = nn.Linear(1, d)
        #: (B, K, *obs_shape) -> (B, K, F) features of each state (``linear``: the flat observation)
        self.encode_obs: ObservationEncoder = cfg.encoder.build(cfg.obs_shape)
        self.embed_state = nn.Linear(self.encode_obs.out_features, d)
        self.embed_action = nn.Embedding(cfg.act_dim, d) if cfg.discrete else nn.Linear(cfg.act_dim, d)
        self.embed_ln = nn.LayerNorm(d)
        self.embed_drop = Dropout(cfg.embed_dropout)
        out = 2 * cfg.act_dim if cfg.head == "gaussian" else cfg.act_dim
        self.head = nn.Linear(d, out)
        if cfg.embed_init == "gpt2":  # "paper": keep PyTorch's defaults, as the official code does
            for m in (self.embed_timestep, self.embed_return, self.embed_state, self.embed_action, self.head):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        self.backbone = Backbone(cfg.backbone)
        if cfg.head == "gaussian":
            self.log_temperature = nn.Parameter(torch.tensor(math.log(cfg.init_temperature)))
        # token index inside a window (B-independent), given to the backbone as positions
        self.register_buffer("token_pos", torch.arange(cfg.n_tokens), persistent=False)

    @property
    def target_entropy(self) -> float:
        """Entropy target of the Gaussian head's temperature loss (nats): ``cfg.target_entropy``,
        or -act_dim when it is None (Online DT, Zheng et al. 2022)."""
        return -float(self.cfg.act_dim) if self.cfg.target_entropy is None else self.cfg.target_entropy

    def timestep_index(self, timesteps: Tensor, mask: Tensor) -> Tensor:
        """Embedding index of each step: ``t + 1`` for real steps, 0 for padding.

        Args:
            timesteps: (B, K) long episode steps (0-based); padded entries may hold anything.
            mask: (B, K) bool, True = real step.
        Returns:
            (B, K) long.
        Raises:
            ValueError: outside training mode, a real timestep outside ``[0, max_ep_len)`` (names
                ``agent.max_ep_len``).

        In training mode the range is not checked here: that would cost a host-device sync per
        update, and the window samplers refuse a dataset with an episode longer than
        ``max_ep_len`` when they are built (``WindowSampler(max_ep_len=...)``); the embedding
        lookup itself still rejects an out-of-range index.
        """
        t = torch.where(mask, timesteps.long(), torch.zeros_like(timesteps, dtype=torch.long))
        if self.training or torch.compiler.is_compiling():
            # no host sync in an update, nor under torch.compile (a graph break, and a
            # recompilation for every new max timestep)
            return torch.where(mask, t + 1, t.new_zeros(()))
        hi, lo = torch.stack((t.max(), t.min())).tolist()  # one device sync
        if hi >= self.cfg.max_ep_len or lo < 0:
            raise ValueError(
                f"Decision Transformer: timestep {hi if hi >= self.cfg.max_ep_len else lo} is outside "
                f"[0, agent.max_ep_len={self.cfg.max_ep_len}); raise agent.max_ep_len (it must cover the "
                f"longest episode) or evaluate with timestep_overflow='clamp'"
            )
        return torch.where(mask, t + 1, t.new_zeros(()))

    def forward(
        self, obs: Tensor, actions: Tensor, rtg: Tensor, timesteps: Tensor, mask: Tensor, *,
        output_hidden_states: bool = False, predict_at: Tensor | None = None,
    ) -> DTOutput:
        """Predict actions from a window of K steps (Chen et al. 2021, Algorithm 1).

        Args:
            obs: (B, K, obs_dim) normalised observations, or (B, K, *obs_shape) for the encoder
                (image kinds: uint8 pixels, or floats in 0..255, of (B, K, C, H, W) or flat).
            actions: (B, K, A) normalised continuous actions in [-1, 1], or (B, K) long discrete
                actions. In ``causal`` mode a_t is never seen by the prediction of a_t (pass
                anything, e.g. zeros, for the step being decided); in ``last_action`` mode the
                last step's action is dropped from the input.
            rtg: (B, K) or (B, K, 1) returns-to-go, already multiplied by the reward scale.
            timesteps: (B, K) long episode steps (0-based).
            mask: (B, K) bool, True = real step, False = padding (any place in the window).
            output_hidden_states: also return every layer's output at the predicting state
                tokens (``DTOutput.hidden_states``).
            predict_at: causal mode only: (B,) integer step slots in [0, K), one per row: predict
                only the action of that step of each row (acting: the step being decided), P = 1.
                The same values as the full output at those steps; with a backbone that allows it
                (:attr:`~rl_tformers.backbone.Backbone.query_subset`) the last layer computes that
                one state token per row instead of K.

        Returns:
            :class:`DTOutput` with predictions for every step (causal), the ``predict_at`` steps,
            or the last one (last_action).

        Raises:
            ValueError: wrong shapes, a window of more than ``context_len`` steps, or a timestep
                outside ``[0, max_ep_len)``; a ``predict_at`` in last_action mode, not of shape
                (B,), not of an integer dtype or (outside training) outside [0, K).
        """
        x, tok_mask, pos = self.embed(obs, actions, rtg, timesteps, mask)  # (B, n, D): R_t, s_t, a_t per step
        tokens = self._predicting_tokens(x.shape[1], obs.shape[1], predict_at)
        out = self.backbone(x, positions=pos, mask=tok_mask, output_hidden_states=output_hidden_states,
                            output_tokens=tokens, **self.exit_kwargs(x, obs.shape[1]))
        return self.predict_states(out, tokens)  # the action head at the state tokens s_t

    def forward_early_exit(
        self, obs: Tensor, actions: Tensor, rtg: Tensor, timesteps: Tensor, mask: Tensor, *,
        exit_steps: Tensor | None = None, exit_threshold: float | None = None, output_hidden_states: bool = False,
        predict_at: Tensor | None = None,
    ) -> DTOutput:
        """:meth:`forward` whose backbone runs layer by layer and stops early (depth kind ``early_exit``).

        The same tokens go through the backbone's early-exit depth slot, which applies the final
        norm and action head after each layer and stops once every deciding state token is
        confident (:mod:`rl_tformers.depth.early_exit`; CALM, Schuster et al. 2022).

        Args:
            obs, actions, rtg, timesteps, mask, output_hidden_states, predict_at: as :meth:`forward`
                (the exit loop still runs every token; only the output is gathered).
            exit_steps: (B, K) bool, the steps whose state token decides (the ones whose action is
                used, e.g. the current step when acting); the exit loop stops once they all
                exited. ``None``: every predicting state token (the ``predict_at`` steps with it).
            exit_threshold: confidence threshold for this call (``None``: the backbone's stored
                one, +inf unless calibrated; +inf runs every layer).

        Returns:
            :class:`DTOutput`; ``metrics`` hold ``exit/mean_layer`` and ``exit/early_frac``.

        Raises:
            ValueError: as :meth:`forward`, or a backbone whose depth kind is not ``early_exit``.
        """
        if not self.early_exit:
            raise ValueError("DT: exit_steps / exit_threshold need backbone.depth.kind=early_exit")
        x, tok_mask, pos = self.embed(obs, actions, rtg, timesteps, mask)
        tokens = self._predicting_tokens(x.shape[1], obs.shape[1], predict_at)
        if exit_steps is None and predict_at is not None:  # the predicted steps decide
            exit_steps = F.one_hot(predict_at.long(), obs.shape[1]).bool()  # (B, K)
        depth_kw = self.exit_kwargs(x, obs.shape[1], exit_steps, exit_threshold)
        out = self.backbone(x, positions=pos, mask=tok_mask, output_hidden_states=output_hidden_states,
                            output_tokens=tokens, **depth_kw)
        return self.predict_states(out, tokens)

    def embed(self, obs: Tensor, actions: Tensor, rtg: Tensor, timesteps: Tensor,
              mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The token sequence of a window: (R_t, s_t, a_t) per step, each plus its timestep embedding.

        Args: as :meth:`forward`.

        Returns:
            x (B, n, D) tokens after the embedding LayerNorm and dropout (n = 3K, or 3K - 1 in
            ``last_action`` mode: the sequence ends with s_{K-1}), their mask (B, n) bool and
            positions (B, n) (the token index inside the window).

        Raises:
            ValueError: as :meth:`forward`.
        """
        cfg = self.cfg
        b, k = obs.shape[:2]
        if obs.shape[2:] != (cfg.obs_dim,) and obs.shape[2:] != cfg.obs_shape:
            shape = ", ".join(map(str, cfg.obs_shape))
            raise ValueError(f"DT: obs must be (B, K, {cfg.obs_dim}) or (B, K, {shape}), got {tuple(obs.shape)}")
        if k > cfg.context_len:
            raise ValueError(f"DT: window of {k} steps exceeds agent.context_len={cfg.context_len}")
        if mask.shape != (b, k) or timesteps.shape != (b, k):
            raise ValueError(f"DT: mask and timesteps must be ({b}, {k}), got {tuple(mask.shape)}, {tuple(timesteps.shape)}")
        mask = mask.bool()
        state = self.encode_obs(obs)  # (B, K, F)
        rtg = rtg.reshape(b, k, 1).to(state.dtype)
        time_emb = self.embed_timestep(self.timestep_index(timesteps, mask))  # (B, K, D)
        act_emb = self.embed_action(actions.long() if cfg.discrete else actions.to(state.dtype))  # (B, K, D)
        tokens = torch.stack(
            (self.embed_return(rtg) + time_emb, self.embed_state(state) + time_emb, act_emb + time_emb), dim=2
        )  # (B, K, 3, D)
        tokens = tokens.reshape(b, 3 * k, tokens.shape[-1])  # (B, 3K, D): R_0, s_0, a_0, R_1, ...
        tok_mask = mask.repeat_interleave(3, dim=1)  # (B, 3K)
        if cfg.mode == "last_action":
            tokens, tok_mask = tokens[:, :-1], tok_mask[:, :-1]  # (B, 3K-1, D): ends with s_{K-1}
        x = self.embed_drop(self.embed_ln(tokens))
        n = x.shape[1]
        return x, tok_mask, self.token_pos[:n].expand(b, n)

    def predict_states(self, out: BackboneOutput, tokens: TokenIndex | None = None) -> DTOutput:
        """The action head at the predicting state tokens of the backbone's output (its last layer
        computed only those: ``output_tokens``, ``tokens``; None: :meth:`_token_slice`); their
        per-layer states, aux losses and metrics ride along."""
        hs = None
        if out.hidden_states is not None:
            hs = tuple(self._select(hl, tokens) for hl in out.hidden_states)
        res = self.predict(out.hidden)  # (B, P, D) state tokens
        res.aux, res.metrics, res.hidden_states = out.aux, out.metrics, hs
        return res

    def exit_kwargs(self, x: Tensor, k: int, exit_steps: Tensor | None = None,
                    exit_threshold: float | None = None) -> dict[str, Any]:
        """The early-exit depth slot's arguments for tokens ``x`` (B, n, D) of a K-step window
        (empty for other depth kinds): the exit head (final norm + action head), the deciding
        tokens (the state tokens of ``exit_steps``, default every predicting state token) and
        the threshold (when given)."""
        if not self.early_exit:
            return {}
        b, n = x.shape[:2]
        depth_kw: dict[str, Any] = {"exit_head": with_final_norm(self.backbone, self.head)}
        if exit_threshold is not None:
            depth_kw["exit_threshold"] = float(exit_threshold)
        if exit_steps is not None:
            em = torch.zeros(b, 3 * k, dtype=torch.bool, device=x.device)  # (B, 3K)
            em[:, 1::3] = exit_steps.to(device=x.device, dtype=torch.bool)  # state tokens decide
            depth_kw["exit_mask"] = em[:, :n]
        else:
            depth_kw["exit_mask"] = self._state_token_mask(b, k, n, x.device)
        return depth_kw

    @property
    def early_exit(self) -> bool:
        """True when the backbone's depth kind is ``early_exit`` (exit options apply)."""
        return hasattr(self.backbone.depth, "exit_classifier_loss")

    def _state_token_mask(self, b: int, k: int, n: int, device: torch.device) -> Tensor:
        """(B, n) bool: the predicting state tokens (all in causal mode, the last in last_action)."""
        em = torch.zeros(b, 3 * k, dtype=torch.bool, device=device)
        if self.cfg.mode == "causal":
            em[:, 1::3] = True
        else:
            em[:, n - 1] = True
        return em[:, :n]

    def _token_slice(self, n: int) -> slice:
        """The predicting state tokens among n: every third from s_0 (causal), the last (last_action)."""
        return slice(1, None, 3) if self.cfg.mode == "causal" else slice(n - 1, n)

    def _predicting_tokens(self, n: int, k: int, predict_at: Tensor | None) -> TokenIndex:
        """The state tokens whose actions are predicted among n tokens of a K-step window:
        :meth:`_token_slice`, or with ``predict_at`` (B,) the (B, 1) token index 3 s + 1 of each
        row's step s.

        Raises:
            ValueError: as :meth:`forward` says of ``predict_at``.
        """
        if predict_at is None:
            return self._token_slice(n)
        if self.cfg.mode != "causal":
            raise ValueError("DT: predict_at needs agent.mode=causal (last_action predicts the last step only)")
        if predict_at.dim() != 1 or (predict_at.is_floating_point() or predict_at.is_complex()
                                     or predict_at.dtype == torch.bool):
            raise ValueError(f"DT: predict_at must be a (B,) integer tensor of step slots, got {predict_at.dtype} "
                             f"of shape {tuple(predict_at.shape)}")
        if not (self.training or torch.compiler.is_compiling()) and predict_at.numel():
            lo, hi = torch.stack(torch.aminmax(predict_at)).tolist()  # one host read
            if lo < 0 or hi >= k:
                raise ValueError(f"DT: predict_at holds step {lo if lo < 0 else hi}, outside the window's [0, {k})")
        return (3 * predict_at.long() + 1)[:, None]  # (B, 1): s_t of each row

    def _select(self, h: Tensor, tokens: TokenIndex | None = None) -> Tensor:
        """(B, n, D) token states -> (B, P, D) the predicting state tokens (``tokens``, default
        :meth:`_token_slice`)."""
        return take_tokens(h, self._token_slice(h.shape[1]) if tokens is None else tokens)

    def predict(self, h: Tensor) -> DTOutput:
        """Apply the action head to normalised state-token features h (B, P, D)."""
        cfg = self.cfg
        y = self.head(h)  # (B, P, A) or (B, P, 2A)
        if cfg.discrete:
            return DTOutput(action=y.argmax(-1), logits=y, features=h)
        if cfg.head == "gaussian":
            mean, log_std = y.chunk(2, dim=-1)  # (B, P, A) each
            lo, hi = cfg.log_std_min, cfg.log_std_max
            log_std = lo + 0.5 * (hi - lo) * (torch.tanh(log_std) + 1.0)
            return DTOutput(action=torch.tanh(mean), mean=mean, log_std=log_std, features=h)
        return DTOutput(action=torch.tanh(y), mean=y, features=h)


# -- action-space mapping (continuous) ----------------------------------------------------------

def to_env_action(a: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Normalised action in [-1, 1] -> environment box ``[low, high]``; shapes broadcast (..., A).

    ``low + (a + 1) / 2 * (high - low)``, clamped to ``[low, high]`` so that float rounding never
    puts an action outside the box. A dimension whose width ``high - low`` overflows (bounds
    like ``[-3e38, 3e38]`` in float32) uses the convex combination ``(1 - a) / 2 * low +
    (1 + a) / 2 * high`` instead (finite); a fixed dimension (``low == high``) gives ``low``.
    """
    span = high - low
    x = low + 0.5 * (a + 1.0) * span
    wide = ~torch.isfinite(span)
    x = torch.where(wide, 0.5 * (1.0 - a) * low + 0.5 * (1.0 + a) * high, x)
    return torch.minimum(torch.maximum(x, low), high)


def from_env_action(a: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Environment action -> normalised [-1, 1] (clipped); inverse of :func:`to_env_action`.

    ``2 (a - low) / (high - low) - 1``. A fixed dimension (``low == high``, which gymnasium's
    Box allows) maps to 0 instead of 0 / 0 = NaN (which turned the whole training loss into NaN);
    a dimension whose width overflows uses ``(a - mid) / half`` with ``mid = low / 2 + high / 2``
    and ``half = high / 2 - low / 2`` (finite). Shapes broadcast (..., A).
    """
    span = high - low
    fixed = span == 0
    wide = ~torch.isfinite(span)
    safe = torch.where(fixed | wide, torch.ones_like(span), span)
    x = 2.0 * (a - low) / safe - 1.0
    half = torch.where(wide, 0.5 * high - 0.5 * low, torch.ones_like(span))
    x = torch.where(wide, (a - (0.5 * low + 0.5 * high)) / half, x)
    return torch.where(fixed, torch.zeros_like(x), x).clamp(-1.0, 1.0)


def squashed_gaussian_log_prob(mean: Tensor, log_std: Tensor, action: Tensor, eps: float = 1e-6) -> Tensor:
    """log pi(a) of a tanh-squashed Gaussian at normalised action ``a`` in (-1, 1).

    log pi(a) = log N(atanh(a); mean, std) - sum log(1 - a^2)  (change of variables; Haarnoja
    et al. 2018, appendix C). Shapes: (..., A) -> (...).
    """
    a = action.clamp(-1.0 + eps, 1.0 - eps)
    u = torch.atanh(a)
    normal = torch.distributions.Normal(mean, log_std.exp())
    return (normal.log_prob(u) - torch.log1p(-a.pow(2) + eps)).sum(-1)


def squashed_gaussian_sample(mean: Tensor, log_std: Tensor) -> Tensor:
    """Reparameterised sample tanh(mean + std * eps), (..., A)."""
    return torch.tanh(mean + log_std.exp() * torch.randn_like(mean))


def discrete_ce(logits: Tensor, target: Tensor) -> Tensor:
    """Per-step cross-entropy: logits (..., n), target (...) long -> (...)."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten().long(), reduction="none").view(target.shape)
