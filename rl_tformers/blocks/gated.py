"""GTrXL gated residual block (``gated``; Parisotto et al. 2019, "Stabilizing Transformers for RL")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.blocks.base import BlockConfig, BlockModule
from rl_tformers.registry import BLOCK, Capabilities
from rl_tformers.types import AttnContext, BlockOutput, LayerState

GATES = ("input", "output", "highway", "sigmoid_tanh", "gru")


class Gate(nn.Module):
    """Gating layer g(x, y) replacing the residual x + y (Parisotto et al. 2019, sec. 3.2).

    x is the residual stream (B, T, D), y the sub-layer output (B, T, D). W, U are bias-free
    D x D maps; b_g is a learned (D,) bias initialised to ``bias``:

    - ``input``:        g = sigmoid(W_g x) * x + y
    - ``output``:       g = x + sigmoid(W_g x - b_g) * y
    - ``highway``:      g = sigmoid(W_g x + b_g) * x + (1 - sigmoid(W_g x + b_g)) * y
    - ``sigmoid_tanh``: g = x + sigmoid(W_g y - b_g) * tanh(U_g y)
    - ``gru``:          r = sigmoid(W_r y + U_r x),  z = sigmoid(W_z y + U_z x - b_g),
                        h = tanh(W_g y + U_g (r * x)),  g = (1 - z) * x + z * h

    A positive b_g pushes every gate but ``input`` towards passing x through (for GRU, z -> 0),
    so the block starts close to an identity map; with a huge b_g the GRU gate returns x
    exactly. ``forward`` returns (g (B, T, D), mean gate value as a detached 0-d tensor: z for
    GRU, the sigmoid for the others).

    Raises:
        ValueError: ``kind`` is not one of :data:`GATES`.
    """

    def __init__(self, kind: str, d_model: int, bias: float) -> None:
        super().__init__()
        if kind not in GATES:
            raise ValueError(f"block.gate={kind!r}; use one of {', '.join(GATES)}")
        self.kind = kind
        d = d_model
        if kind in ("input", "output", "highway"):
            self.w = nn.Linear(d, d, bias=False)  # W_g x
        elif kind == "sigmoid_tanh":
            self.w = nn.Linear(d, 2 * d, bias=False)  # [W_g y ; U_g y]
        else:
            self.w = nn.Linear(d, 3 * d, bias=False)  # [W_r y ; W_z y ; W_g y]
            self.u = nn.Linear(d, 2 * d, bias=False)  # [U_r x ; U_z x]
            self.u_g = nn.Linear(d, d, bias=False)  # U_g (r * x)
        self.b_g = None if kind == "input" else nn.Parameter(torch.full((d,), float(bias)))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        if self.kind == "input":
            s = torch.sigmoid(self.w(x))
            return s * x + y, s.detach().mean()
        if self.kind == "output":
            s = torch.sigmoid(self.w(x) - self.b_g)
            return x + s * y, s.detach().mean()
        if self.kind == "highway":
            s = torch.sigmoid(self.w(x) + self.b_g)
            return s * x + (1 - s) * y, s.detach().mean()
        if self.kind == "sigmoid_tanh":
            wy, uy = self.w(y).chunk(2, dim=-1)  # (B, T, D) each
            s = torch.sigmoid(wy - self.b_g)
            return x + s * torch.tanh(uy), s.detach().mean()
        wr, wz, wg = self.w(y).chunk(3, dim=-1)  # (B, T, D) each
        ur, uz = self.u(x).chunk(2, dim=-1)  # (B, T, D) each
        r = torch.sigmoid(wr + ur)
        z = torch.sigmoid(wz + uz - self.b_g)
        h = torch.tanh(wg + self.u_g(r * x))
        return (1 - z) * x + z * h, z.detach().mean()


class GatedBlock(BlockModule):
    """GTrXL block: layer norm on the sub-layer inputs only, ReLU on sub-layer outputs, gates
    in place of the residual additions (Parisotto et al. 2019, sec. 3.1 identity map reordering,
    sec. 3.2 gating layers)::

        Y  = MHA(LN([SG(M), E]))          (memory normed too, as in pre-norm)
        E' = g_MHA(E, ReLU(Y))
        F  = FFN(LN(E'))
        E  = g_MLP(E', ReLU(F))

    The residual stream itself is never normalised, so an identity-initialised gate gives an
    identity path from input to output (the paper's "identity map reordering").
    ``metrics``: ``gate_attn`` and ``gate_ffn``, the mean gate values (z for GRU).

    Args:
        gate: one of ``input``, ``output``, ``highway``, ``sigmoid_tanh``, ``gru``.
        gate_bias: b_g (unused by ``input``).
        relu: apply the ReLU to sub-layer outputs (paper: yes).
    """

    def __init__(self, ctx, position, gate: str, gate_bias: float, relu: bool) -> None:
        super().__init__(ctx, position)
        d = ctx.d_model
        self.norm1 = nn.LayerNorm(d)
        self.norm2 = nn.LayerNorm(d)
        self.gate_attn = Gate(gate, d, gate_bias)
        self.gate_ffn = Gate(gate, d, gate_bias)
        self.relu = relu

    def _act(self, y: Tensor) -> Tensor:
        y = self.dropout(y)
        return F.relu(y) if self.relu else y

    def forward(self, x: Tensor, ctx: AttnContext, state: LayerState | None = None) -> BlockOutput:
        mem = None if state is None or state.memory is None else self.norm1(state.memory)
        a = self.attend(self.norm1(x), mem, ctx, state)
        e, g1 = self.gate_attn(x, self._act(a.out))
        out, g2 = self.gate_ffn(e, self._act(self.transition(self.norm2(e), ctx)))
        metrics = dict(a.metrics)
        metrics["gate_attn"] = g1
        metrics["gate_ffn"] = g2
        return BlockOutput(out, a.cache, a.aux, metrics, a.weights)


@BLOCK.register(
    "gated",
    description="GTrXL: input-stream layer norm, ReLU sub-layer outputs, gated residuals (input/output/highway/sigmoid-tanh/GRU)",
    paper="Parisotto et al. 2019, Stabilizing Transformers for Reinforcement Learning (sec. 3)",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class GatedConfig(BlockConfig):
    """``gate``: input, output, highway, sigmoid_tanh or gru (the paper's best, default);
    ``gate_bias``: b_g (2 by default, so GRU/output/highway/sigmoid-tanh gates start near the
    identity map); ``relu``: ReLU on sub-layer outputs before the gate (paper: true).

    Raises:
        ValueError: ``gate`` is not one of :data:`GATES`.
    """

    gate: str = "gru"
    gate_bias: float = 2.0
    relu: bool = True

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"block.gate={self.gate!r}; use one of {', '.join(GATES)}")

    def build(self, ctx, position) -> BlockModule:
        return GatedBlock(ctx, position, self.gate, self.gate_bias, self.relu)
