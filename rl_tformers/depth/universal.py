"""Universal Transformer with per-position ACT halting (depth kind ``universal``).

Dehghani et al. 2019, "Universal Transformers" (sec. 2.1-2.2): one block (self-attention and
a transition function: the block's position-wise feed-forward network, or with ``transition:
sepconv`` the paper's separable convolution) is applied
recurrently with shared weights. Before every step t the coordinate embedding

    P^t_{i, 2k} = sin(i / 10000^{2k/D}) + sin(t / 10000^{2k/D})
    P^t_{i, 2k+1} = cos(i / 10000^{2k/D}) + cos(t / 10000^{2k/D})

(position i from the caller, recurrence step t = 1, 2, ...) is added to the state (eq. 3-4 /
the reference implementation adds it to the state before the block).

Adaptive Computation Time per position (Graves 2016, sec. 2, eq. 5-13; UT sec. 2.2): at step
n a halting unit gives ``p_n = sigmoid(w . s_n + b)``. A position halts at the first step
N with ``sum_{n<=N} p_n >= 1 - eps`` (or at ``max_steps``); its halting weights are
``p_n`` for n < N and the remainder ``R = 1 - sum_{n<N} p_n`` at N, so they sum to 1 and the
output is ``y = sum_n w_n h_n``. After halting, a position's state is frozen (copied to later
steps, where the other positions still attend to it) until every position halted (the loop
then stops) or ``max_steps``. Ponder cost ``rho = N + R`` (eq. 11) averaged over valid
positions and weighted by ``ponder_weight`` goes to ``aux["ponder"]``; the mean number of
steps to ``metrics["act/ponder_steps"]``.

``act=false`` is the fixed-steps form: ``max_steps`` applications of the shared block, output
the last state.

All positions are computed at every step (halted ones are overwritten by their frozen state),
so ACT saves no FLOPs inside a step, as in the reference implementation; it stops the loop
once all positions have halted.

Cannot do: memory kinds (Transformer-XL, compressive, kNN) and incremental (cached) decoding:
the per-step states of past tokens would have to be cached for every step a later token may
reach. Both are refused (capabilities ``memory=False``, ``incremental=False``; a state passed
to ``forward`` raises).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.blocks.transition import SepConvTransition
from rl_tformers.depth.base import DepthConfig, DepthModule, DepthOutput, call_block
from rl_tformers.depth.fixed import build_blocks
from rl_tformers.position.absolute import sinusoid
from rl_tformers.registry import DEPTH, Capabilities
from rl_tformers.types import AttnContext, LayerState, acc_dtype, merge_into


def coordinate_embedding(pos: Tensor, step: int, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """UT coordinate embedding P^t (Dehghani et al. 2019, sec. 2.1): sinusoid(position) + sinusoid(step).

    Args:
        pos: (B, T) positions.
        step: recurrence step t (1-based).
        dim: D (even).
        dtype: table dtype (float32; float64 for a float64 model).
    Returns:
        (B, T, D) in ``dtype``.
    """
    t = torch.full((1, 1), step, device=pos.device)
    return sinusoid(pos, dim, dtype=dtype) + sinusoid(t, dim, dtype=dtype)


@dataclass
class ACTState:
    """Running ACT bookkeeping of every position (Graves 2016, sec. 2).

    Attributes:
        halting: (B, T) sum of the halting probabilities used so far (1 once halted).
        remainders: (B, T) R, set at the halting step.
        n_updates: (B, T) N, number of steps taken.
        running: (B, T) bool, not halted yet.
    """

    halting: Tensor
    remainders: Tensor
    n_updates: Tensor
    running: Tensor

    @classmethod
    def start(cls, like: Tensor, running: Tensor) -> ACTState:
        """Bookkeeping before step 1: halting, remainders and N zeros shaped and typed like
        ``like`` (B, T); ``running`` (B, T) bool copied."""
        z = torch.zeros_like(like)
        return cls(z, z.clone(), z.clone(), running.clone())


def act_step(p: Tensor, st: ACTState, threshold: float, last: bool) -> tuple[Tensor, ACTState]:
    """One ACT step: the halting weight of this step and the updated bookkeeping.

    Args:
        p: (B, T) halting probabilities of this step.
        st: bookkeeping before the step.
        threshold: 1 - eps.
        last: the step limit is reached: every running position halts now.
    Returns:
        w (B, T): weight of this step's state in the output (p for positions that keep running,
        the remainder R = 1 - sum of earlier p for those halting now, 0 for halted ones), and
        the new bookkeeping. Over all steps the weights of a position sum to 1.
    """
    run = st.running.to(p.dtype)
    if last:
        halt_now = st.running
    else:
        halt_now = st.running & (st.halting + p * run >= threshold)
    keep = st.running & ~halt_now
    rem = (1.0 - st.halting) * halt_now.to(p.dtype)  # R for positions halting now
    w = p * keep.to(p.dtype) + rem
    new = ACTState(
        halting=st.halting + p * keep.to(p.dtype) + rem,
        remainders=st.remainders + rem,
        n_updates=st.n_updates + run,
        running=keep,
    )
    return w, new


@dataclass
class UTResult:
    """Everything one Universal Transformer pass computed.

    Attributes:
        hidden: (B, T, D) output (ACT: sum_n w_n h_n; fixed steps: the last state).
        weights: (B, T, S) halting weight of each step (S steps run); rows sum to 1 (ACT) or
            are one-hot on the last step (fixed steps).
        n_updates: (B, T) steps taken per position (N).
        remainders: (B, T) remainders R (0 for fixed steps).
        steps: number of steps run.
        states: per step, the (B, T, D) state after the block (for ``output_hidden_states``).
    """

    hidden: Tensor
    weights: Tensor
    n_updates: Tensor
    remainders: Tensor
    steps: int
    states: list[Tensor]


class UniversalDepth(DepthModule):
    """One shared block applied recurrently, with or without ACT halting (module docstring).

    Args:
        ctx: build context (the block is built once, as layer 0).
        cfg: the :class:`UniversalConfig`.

    Raises:
        IncompatibleConfig: the block kind is reversible.
    """

    def __init__(self, ctx, cfg: UniversalConfig) -> None:
        super().__init__()
        self.blocks = build_blocks(ctx, 1)
        if getattr(self.blocks[0], "reversible", False):
            raise IncompatibleConfig(
                f"depth.kind='universal' cannot run backbone.block.kind={ctx.config.block.kind!r} (a reversible stack)"
            )
        if cfg.transition == "sepconv":  # the block's feed-forward network becomes the separable convolution
            bcfg = ctx.config
            dropout = bcfg.dropout if bcfg.ffn_dropout is None else bcfg.ffn_dropout
            self.blocks[0].ffn = SepConvTransition(bcfg.d_model, bcfg.ff_dim, cfg.transition_kernel, bcfg.activation,
                                                   dropout)
        self.max_steps = cfg.max_steps or ctx.n_layers
        self.act, self.threshold = cfg.act, 1.0 - cfg.epsilon
        self.ponder_weight, self.coordinate = cfg.ponder_weight, cfg.coordinate
        self.d_model = ctx.d_model
        self.halt = nn.Linear(ctx.d_model, 1) if cfg.act else None
        if self.halt is not None:
            nn.init.constant_(self.halt.bias, cfg.halt_bias_init)

    def run(self, x: Tensor, ctx: AttnContext, out: DepthOutput | None = None) -> UTResult:
        """The recurrence on x (B, T, D); block aux/metrics are merged into ``out`` when given."""
        block = self.blocks[0]
        b, t, _ = x.shape
        valid = ctx.key_valid[:, -t:] if ctx.key_valid is not None else torch.ones(b, t, dtype=torch.bool, device=x.device)
        ctx.layer_idx = 0
        state = block.attn.position.embed(x, ctx.pos_q)  # the configured position, once (as layer 0)
        # ACT bookkeeping (halting sums, remainders, N) and the weighted output sum run in float32
        # for half-precision models (float64 stays float64): in bfloat16 the halting sum stalls once
        # p drops below its spacing near 1 and N stops counting at 256
        bk = acc_dtype(state.dtype)
        acc = torch.zeros_like(state, dtype=bk)
        weights, states = [], []
        act = ACTState.start(valid.to(bk), torch.ones_like(valid)) if self.act else None
        for n in range(1, self.max_steps + 1):
            coord = coordinate_embedding(ctx.pos_q, n, self.d_model, acc_dtype(state.dtype)) if self.coordinate else None
            s = state + coord.to(state.dtype) if coord is not None else state
            if out is not None:
                out.layer_inputs.append(s)
            bo = call_block(block, s, ctx, None)
            h = bo.hidden  # (B, T, D)
            if out is not None:
                out.caches.append(bo.cache)
                out.weights.append(bo.weights)
                out.extras.append(None)
                merge_into(out.aux, bo.aux)
                merge_into(out.metrics, bo.metrics, prefix=f"step{n}/")
            states.append(h)
            if act is None:
                state = h
                continue
            p = torch.sigmoid(self.halt(s).to(bk)).squeeze(-1)  # (B, T) halting probability at step n
            if n == 1:  # padded positions halt at once (weight 1 on step 1): they never hold the loop
                p = torch.where(valid, p, torch.ones_like(p))
            w, act = act_step(p, act, self.threshold, last=n == self.max_steps)
            weights.append(w)
            acc = acc + w[..., None] * h.to(bk)
            # halted positions keep their final output as state (copied forward, still attended
            # to by the others); running ones continue from h
            state = torch.where(act.running[..., None], h, acc.to(h.dtype))
            if not bool(act.running.any()):
                break
        steps = len(states)
        if act is None:
            w = torch.zeros(b, t, steps, device=x.device, dtype=x.dtype)
            w[..., -1] = 1
            zeros = torch.zeros(b, t, device=x.device, dtype=x.dtype)
            return UTResult(state, w, zeros + steps, zeros, steps, states)
        return UTResult(acc.to(x.dtype), torch.stack(weights, -1), act.n_updates, act.remainders, steps, states)

    def forward(
        self, x: Tensor, ctx: AttnContext, layer_states: list[LayerState] | None, need_hidden: bool = False, **kw
    ) -> DepthOutput:
        """x (B, T, D) -> :class:`DepthOutput` with hidden (B, T, D) (:meth:`run`),
        ``aux["ponder"]`` (ACT only) and ``metrics`` ``act/ponder_steps`` (mean N over valid positions, in steps),
        ``act/steps_run`` and, with ACT, ``act/remainder`` (mean R).

        Raises:
            TypeError: any extra keyword argument (``kw``).
            NotImplementedError: ``layer_states`` given (no memory or incremental form).
        """
        if kw:
            raise TypeError(f"depth kind 'universal' takes no extra arguments, got {sorted(kw)}")
        if layer_states is not None:
            raise NotImplementedError(
                "depth kind 'universal' has no incremental or memory form (ACT states of past tokens are not cached); "
                "call the backbone without a state (re-run the context window)"
            )
        out = DepthOutput(hidden=x, layer_inputs=[], caches=[], weights=[])
        res = self.run(x, ctx, out)
        out.hidden = res.hidden
        out.hidden_states = tuple(res.states) if need_hidden else None
        t = x.shape[1]
        valid = ctx.key_valid[:, -t:] if ctx.key_valid is not None else torch.ones_like(res.n_updates, dtype=torch.bool)
        n_valid = valid.sum().clamp_min(1)
        steps = (res.n_updates * valid).sum() / n_valid
        out.metrics["act/ponder_steps"] = steps.detach()
        out.metrics["act/steps_run"] = float(res.steps)
        if self.act:
            ponder = ((res.n_updates + res.remainders) * valid).sum() / n_valid  # Graves eq. 11
            out.aux["ponder"] = self.ponder_weight * ponder
            out.metrics["act/remainder"] = ((res.remainders * valid).sum() / n_valid).detach()
        return out


@DEPTH.register(
    "universal",
    description="One block applied recurrently with shared weights; per-position ACT halting or fixed steps; "
                "feed-forward or separable-convolution transition",
    paper="Dehghani et al. 2019, Universal Transformers (sec. 2); Graves 2016, Adaptive Computation Time (sec. 2)",
    capabilities=Capabilities(memory=False, incremental=False, exact_chunking=False),
)
@dataclass(frozen=True)
class UniversalConfig(DepthConfig):
    """Universal Transformer depth.

    Attributes:
        act: per-position ACT halting (False: the fixed-steps form).
        max_steps: step limit (ACT) or number of steps (fixed); default ``backbone.n_layers``.
        epsilon: ACT halts when the summed halting probability reaches 1 - epsilon.
        ponder_weight: tau, weight of the ponder cost in ``aux["ponder"]``.
        halt_bias_init: initial bias of the halting unit (1.0 as in the reference code).
        coordinate: add the position-and-step coordinate embedding before every step.
        transition: the transition function after the self-attention (sec. 2.1): ``ffn`` (the
            block's position-wise feed-forward network) or ``sepconv`` (two depthwise-separable
            convolutions along the sequence, D -> d_ff -> D, :mod:`rl_tformers.blocks.transition`;
            causal in a causal backbone, never across padding or episodes).
        transition_kernel: w, the width of the separable convolutions (``sepconv``).

    Raises:
        ValueError: ``max_steps`` < 1, ``epsilon`` outside [0, 1), ``ponder_weight`` < 0, an
            unknown ``transition``, ``transition_kernel`` < 1.
        IncompatibleConfig: (:meth:`check`) ``coordinate`` with an odd ``backbone.d_model``;
            ``transition: sepconv`` with ``backbone.ffn_chunks`` > 1.
    """

    act: bool = True
    max_steps: int | None = None
    epsilon: float = 0.01
    ponder_weight: float = 0.01
    halt_bias_init: float = 1.0
    coordinate: bool = True
    transition: str = "ffn"
    transition_kernel: int = 3

    block_per_layer = False  # one shared block at every step: backbone.layers cannot vary it

    def __post_init__(self) -> None:
        if self.transition not in ("ffn", "sepconv"):
            raise ValueError(f"depth.transition must be ffn or sepconv, got {self.transition!r}")
        if self.transition_kernel < 1:
            raise ValueError(f"depth.transition_kernel must be >= 1, got {self.transition_kernel}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"depth.max_steps must be >= 1, got {self.max_steps}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"depth.epsilon must be in [0, 1), got {self.epsilon}")
        if self.ponder_weight < 0:
            raise ValueError(f"depth.ponder_weight must be >= 0, got {self.ponder_weight}")

    def check(self, cfg) -> None:
        """Refuse an odd width with the coordinate embedding, and chunks with ``sepconv``."""
        if self.coordinate and cfg.d_model % 2:
            raise IncompatibleConfig(f"depth.coordinate needs an even backbone.d_model, got {cfg.d_model}")
        if self.transition == "sepconv" and cfg.ffn_chunks > 1:
            raise IncompatibleConfig(
                f"depth.transition='sepconv' convolves the whole sequence; backbone.ffn_chunks={cfg.ffn_chunks} "
                f"chunks only the feed-forward network: set backbone.ffn_chunks=1"
            )

    def build(self, ctx) -> DepthModule:
        return UniversalDepth(ctx, self)

