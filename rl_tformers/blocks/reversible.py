"""Reversible residual layers (``reversible``; RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020).

A reversible stack keeps two streams X1, X2 (both start as the input x) and each layer maps::

    Y1 = X1 + F(X2),   F(.) = Attn(LN(.))      (Reformer, Kitaev et al. 2020, sec. 3)
    Y2 = X2 + G(Y1),   G(.) = FFN(LN(.))

which is invertible: X2 = Y2 - G(Y1), X1 = Y1 - F(X2). The backward pass therefore needs only
the last layer's outputs: it walks the layers in reverse, reconstructs each layer's inputs and
recomputes F and G with autograd enabled for one layer at a time (a custom
``torch.autograd.Function``), so activation memory does not grow with depth. Dropout masks are
reproduced by saving and restoring the RNG state per sub-layer, and the recomputation runs
under the autocast state of the forward pass (e.g. bf16 ``torch.autocast``; the backward pass
would otherwise recompute F and G in float32, invert the layers with other values than the
forward added and give other gradients than ``recompute=false``). The stack's output is the mean
(Y1 + Y2) / 2 of the two streams (as in Reformer implementations that keep width D).

Auxiliary losses of the attention (adaptive span's L1 penalty, the routing commitment loss)
are outputs of the reversible function like the streams: their gradient is backpropagated by
the same layer-by-layer recomputation, as with ``recompute=false``.

Limitations (refused, with the option named): no memory kinds, no incremental cache, only
``depth.kind=fixed`` (which hands the whole stack to :func:`run_reversible`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.blocks.base import BlockConfig, BlockModule
from rl_tformers.depth.base import DepthOutput
from rl_tformers.registry import BLOCK, REGISTRIES, Capabilities
from rl_tformers.types import AttnContext, BlockOutput, LayerState, merge_into


class ReversibleBlock(BlockModule):
    """One reversible layer: F = attention on LN(X2), G = feed-forward on LN(Y1).

    Run a stack of them with :func:`run_reversible` (``FixedDepth`` does so automatically);
    ``forward`` runs this block alone as a one-layer stack. Shapes: x (B, T, D) -> (B, T, D).
    """

    reversible = True

    def __init__(self, ctx, position, recompute: bool) -> None:
        super().__init__(ctx, position)
        self.norm1 = nn.LayerNorm(ctx.d_model)
        self.norm2 = nn.LayerNorm(ctx.d_model)
        self.recompute = recompute

    def f(self, x2: Tensor, ctx: AttnContext):
        """F(X2) = Dropout(Attn(LN(X2))): (B, T, D) -> ((B, T, D), AttnOutput)."""
        h = self.norm1(x2)
        a = self.attn(h, h, ctx, None)
        return self.dropout(a.out), a

    def g(self, y1: Tensor) -> Tensor:
        """G(Y1) = Dropout(FFN(LN(Y1))): (B, T, D) -> (B, T, D)."""
        return self.dropout(self.ffn(self.norm2(y1)))

    def f_params(self) -> list[nn.Parameter]:
        """Trainable parameters of F (``norm1`` and the attention)."""
        return [p for m in (self.norm1, self.attn) for p in m.parameters() if p.requires_grad]

    def g_params(self) -> list[nn.Parameter]:
        """Trainable parameters of G (``norm2`` and the feed-forward)."""
        return [p for m in (self.norm2, self.ffn) for p in m.parameters() if p.requires_grad]

    def run_stack(self, blocks, x: Tensor, ctx: AttnContext, layer_states, need_hidden: bool) -> DepthOutput:
        """Entry point used by ``FixedDepth``: see :func:`run_reversible`.

        Raises:
            NotImplementedError: ``layer_states`` given (no memory or incremental cache).
        """
        if layer_states is not None:
            raise NotImplementedError(
                "backbone.block.kind='reversible' keeps no memory or key/value cache: call the backbone "
                "without a state (use block.kind=pre_norm for incremental decoding or memory)"
            )
        return run_reversible(blocks, x, ctx, recompute=self.recompute, need_hidden=need_hidden)

    def forward(self, x: Tensor, ctx: AttnContext, state: LayerState | None = None) -> BlockOutput:
        """This block alone as a one-layer stack: x (B, T, D) -> hidden (B, T, D), no cache.

        Raises:
            NotImplementedError: ``state`` is not None.
        """
        out = self.run_stack([self], x, ctx, None if state is None else [state], False)
        return BlockOutput(out.hidden, None, out.aux, out.metrics, out.weights[0])


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[Tensor, Tensor | None] | None, device: torch.device):
    """Run the body with the RNG state saved in the forward pass (same dropout masks)."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _Stack:
    """The layers of one reversible call and what the forward pass recorded for backward."""

    def __init__(self, blocks, ctx: AttnContext, pes: list[Tensor | None], need_hidden: bool) -> None:
        self.blocks, self.ctx, self.pes, self.need_hidden = list(blocks), ctx, pes, need_hidden
        self.rng: list[tuple[Any, Any]] = []
        self.out = DepthOutput(hidden=None, layer_inputs=[], caches=[], weights=[])  # type: ignore[arg-type]
        self.hidden: list[Tensor] = []
        #: per layer, the auxiliary losses of its attention recorded in the forward pass (record=True):
        #: outputs of the reversible function, merged into ``out.aux`` by :func:`run_reversible`
        self.aux: list[dict[str, Tensor]] = []
        self.autocast: dict[str, Any] | None = None  # autocast state of the forward pass (set by record)

    def record_autocast(self, device: torch.device) -> None:
        """Remember the autocast state of the forward pass, for the recomputation in backward."""
        kind = device.type
        self.autocast = {
            "device_type": kind,
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }

    def forward_layers(self, x1: Tensor, x2: Tensor, record: bool) -> tuple[Tensor, Tensor]:
        """Y streams after every layer; records RNG states (``record``) and metrics/weights."""
        for i, blk in enumerate(self.blocks):
            self.ctx.layer_idx = i
            if self.pes[i] is not None:
                x1, x2 = x1 + self.pes[i], x2 + self.pes[i]
            self.out.layer_inputs.append(x2)
            rng_f = _rng_state(x2.device) if record and blk.training else None
            f, a = blk.f(x2, self.ctx)
            y1 = x1 + f
            rng_g = _rng_state(x2.device) if record and blk.training else None
            y2 = x2 + blk.g(y1)
            if record:
                self.rng.append((rng_f, rng_g))
                self.aux.append({k: v for k, v in a.aux.items() if isinstance(v, Tensor)})
                merge_into(self.out.aux, {k: v for k, v in a.aux.items() if not isinstance(v, Tensor)})
            else:
                merge_into(self.out.aux, a.aux)
            merge_into(self.out.metrics, a.metrics, prefix=f"layer{i}/")
            self.out.weights.append(a.weights)
            self.out.caches.append(None)
            self.out.extras.append(None)
            if self.need_hidden:
                self.hidden.append(0.5 * (y1 + y2))
            x1, x2 = y1, y2
        return x1, x2

    def backward_layers(self, y1: Tensor, y2: Tensor, dy1: Tensor, dy2: Tensor, tensors: list[Tensor],
                        dhidden: Sequence[Tensor | None] = (), daux: Sequence[dict[str, Tensor | None]] = ()):
        """Gradients w.r.t. (x1, x2) and ``tensors`` (parameters, positional terms), layer by layer.

        ``dhidden``: the gradients w.r.t. each layer's output (Y1 + Y2) / 2 (``need_hidden``; None
        where that output was not used), added to both streams' gradients at their layer.
        ``daux``: per layer, the gradients w.r.t. its attention's auxiliary losses (None: unused),
        backpropagated with F's output.
        """
        index = {id(t): k for k, t in enumerate(tensors)}
        grads: list[Tensor | None] = [None] * len(tensors)

        def add(ts, gs) -> None:
            for t, g in zip(ts, gs):
                if g is not None:
                    k = index[id(t)]
                    grads[k] = g if grads[k] is None else grads[k] + g

        dev = y1.device
        amp = self.autocast or {"device_type": dev.type, "enabled": False}
        for i in reversed(range(len(self.blocks))):
            blk = self.blocks[i]
            self.ctx.layer_idx = i
            if i < len(dhidden) and dhidden[i] is not None:  # hidden_i = (Y1 + Y2) / 2 of this layer
                dy1, dy2 = dy1 + 0.5 * dhidden[i], dy2 + 0.5 * dhidden[i]
            rng_f, rng_g = self.rng[i]
            with torch.enable_grad(), torch.autocast(**amp):
                y1_ = y1.detach().requires_grad_(True)
                with _restored_rng(rng_g, dev):
                    g = blk.g(y1_)
            gp = blk.g_params()
            gr = torch.autograd.grad(g, [y1_, *gp], dy2, allow_unused=True)
            add(gp, gr[1:])
            dy1 = dy1 + gr[0]  # dL/dY1 through G as well
            x2 = y2 - g.detach()  # invert: X2 = Y2 - G(Y1)
            with torch.enable_grad(), torch.autocast(**amp):
                x2_ = x2.detach().requires_grad_(True)
                with _restored_rng(rng_f, dev):
                    f, a = blk.f(x2_, self.ctx)
            fp = blk.f_params()
            outs, gouts = [f], [dy1]
            for k, g_aux in (daux[i] if i < len(daux) else {}).items():
                v = a.aux.get(k)
                if g_aux is not None and isinstance(v, Tensor) and v.requires_grad:
                    outs.append(v)
                    gouts.append(g_aux.to(v.dtype))
            fr = torch.autograd.grad(outs, [x2_, *fp], gouts, allow_unused=True)
            add(fp, fr[1:])
            x1 = y1 - f.detach()  # invert: X1 = Y1 - F(X2)
            dx1, dx2 = dy1, dy2 + (fr[0] if fr[0] is not None else 0)
            pe = self.pes[i]
            if pe is not None:  # x1 = x1_in + pe, x2 = x2_in + pe
                if pe.requires_grad:
                    add([pe], [dx1 + dx2])
                x1, x2 = x1 - pe, x2 - pe
            y1, y2, dy1, dy2 = x1, x2, dx1, dx2
        return dy1, dy2, grads


class _ReversibleStackFn(torch.autograd.Function):
    """Autograd function of a whole reversible stack: saves only the final two streams.

    Outputs (Y1, Y2), then, with ``need_hidden``, every layer's (Y1 + Y2) / 2, then every
    layer's auxiliary attention losses (:attr:`_Stack.aux`, layer by layer in key order), so that a
    loss on the per-layer outputs (``output_hidden_states``) or on the auxiliary losses
    backpropagates too.
    """

    @staticmethod
    def forward(fctx, x1: Tensor, x2: Tensor, stack: _Stack, *tensors: Tensor):
        stack.record_autocast(x1.device)
        y1, y2 = stack.forward_layers(x1, x2, record=True)
        fctx.stack = stack
        fctx.tensors = tensors  # the parameter objects themselves: gradients are matched by identity
        fctx.save_for_backward(y1, y2)
        return (y1, y2, *stack.hidden, *(v for layer in stack.aux for v in layer.values()))

    @staticmethod
    def backward(fctx, dy1: Tensor | None, dy2: Tensor | None, *rest: Tensor | None):
        y1, y2 = fctx.saved_tensors
        stack = fctx.stack
        dy1 = torch.zeros_like(y1) if dy1 is None else dy1
        dy2 = torch.zeros_like(y2) if dy2 is None else dy2
        n_hidden = len(stack.hidden)
        dhidden, flat = rest[:n_hidden], iter(rest[n_hidden:])
        daux = [{k: next(flat) for k in layer} for layer in stack.aux]
        dx1, dx2, grads = stack.backward_layers(y1, y2, dy1, dy2, list(fctx.tensors), dhidden, daux)
        return (dx1, dx2, None, *grads)


def run_reversible(
    blocks, x: Tensor, ctx: AttnContext, *, recompute: bool = True, need_hidden: bool = False
) -> DepthOutput:
    """Run reversible layers ``blocks`` on x (B, T, D); output hidden (Y1 + Y2) / 2 (B, T, D).

    Args:
        blocks: sequence of :class:`ReversibleBlock`.
        x: (B, T, D) input; both streams start as x.
        ctx: attention context (self-attention, no memory).
        recompute: True = memory-saving backward (activations recomputed, flat in depth);
            False = ordinary autograd through the same computation (the baseline in tests and
            the benchmark). Without grad mode both run the plain forward.
        need_hidden: also return each layer's (Y1 + Y2) / 2 (differentiable under recompute too:
            a loss on them backpropagates through the reversible function).

    Absolute positional encodings ``embed`` (added per layer) are added to both streams at
    their layer; they must be additive (``embed(x, pos) = x + P(pos)``), as all shipped ones are.

    Returns:
        :class:`DepthOutput` with ``layer_inputs`` = the X2 stream entering each layer (under
        recompute: detached), no caches.
    """
    pes: list[Tensor | None] = []
    zeros = torch.zeros_like(x)
    for blk in blocks:
        pe = blk.attn.position.embed(zeros, ctx.pos_q)
        pes.append(None if pe is zeros else pe)  # (B, T, D) additive term of this layer, or None
    stack = _Stack(blocks, ctx, pes, need_hidden)
    if recompute and torch.is_grad_enabled():
        params = [p for blk in blocks for p in (*blk.f_params(), *blk.g_params())]
        extra = [pe for pe in pes if pe is not None]
        y1, y2, *rest = _ReversibleStackFn.apply(x, x, stack, *params, *extra)
        # the Function's outputs: differentiable, unlike the tensors recorded inside it
        n_hidden = len(stack.hidden)
        stack.hidden = list(rest[:n_hidden])
        flat = iter(rest[n_hidden:])
        for layer in stack.aux:
            merge_into(stack.out.aux, {k: next(flat) for k in layer})
    else:
        y1, y2 = stack.forward_layers(x, x, record=False)
    out = stack.out
    out.hidden = 0.5 * (y1 + y2)
    out.hidden_states = tuple(stack.hidden) if need_hidden else None
    return out


@BLOCK.register(
    "reversible",
    description="Reversible residual layers (Y1 = X1 + Attn(X2), Y2 = X2 + FFN(Y1)); activations recomputed in backward",
    paper="Gomez et al. 2017, The Reversible Residual Network; Kitaev et al. 2020, Reformer (sec. 3)",
    capabilities=Capabilities(memory=False, incremental=False),
)
@dataclass(frozen=True)
class ReversibleConfig(BlockConfig):
    """``recompute``: memory-saving backward (default); false = ordinary autograd (baseline)."""

    runs_stack = True  # the stack is one reversible function: every layer of it is reversible

    recompute: bool = True

    def check(self, cfg) -> None:
        """Refuse memory kinds, depth kinds other than ``fixed`` and ``backbone.checkpoint``
        (raises IncompatibleConfig)."""
        if REGISTRIES["memory"].get(cfg.memory.kind).capabilities.stateful:
            raise IncompatibleConfig(
                f"backbone.memory.kind={cfg.memory.kind!r} is not supported by backbone.block.kind='reversible' "
                f"(it keeps no per-layer memory); blocks that keep it: "
                f"{', '.join(e.kind for e in REGISTRIES['block'] if e.capabilities.memory)}"
            )
        if cfg.depth.kind != "fixed":
            raise IncompatibleConfig(
                f"backbone.block.kind='reversible' needs backbone.depth.kind='fixed' (it runs the whole stack "
                f"as one reversible function), got {cfg.depth.kind!r}"
            )
        if cfg.checkpoint:
            raise IncompatibleConfig(
                "backbone.checkpoint=true with backbone.block.kind='reversible': reversible blocks recompute "
                "their activations in backward already (block.recompute); set backbone.checkpoint=false"
            )

    def build(self, ctx, position) -> BlockModule:
        return ReversibleBlock(ctx, position, self.recompute)
