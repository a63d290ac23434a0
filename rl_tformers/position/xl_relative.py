"""Transformer-XL relative positional encoding (``xl_relative``; Dai et al. 2019, sec. 3.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.position.absolute import sinusoid
from rl_tformers.position.base import PositionConfig, PositionModule, per_head, rel_distance
from rl_tformers.registry import POSITION, Capabilities
from rl_tformers.types import AttnContext, acc_dtype


class XLRelativePosition(PositionModule):
    """Relative scores of Transformer-XL with sinusoidal r_{i-j} and global biases u, v.

    Dai et al. 2019, "Transformer-XL", sec. 3.3, eq. for A^rel_{i,j}::

        A^rel_ij = q_i^T k_j                 (a) content
                 + q_i^T W_kR r_{i-j}        (b) content-dependent position
                 + u^T   k_j                 (c) global content bias
                 + v^T   W_kR r_{i-j}        (d) global position bias

    with q_i = W_q E_xi, k_j = W_kE E_xj (the kernel's own projections) and a separate,
    bias-free W_kR (D -> D) for the fixed sinusoids r (no learned position table).
    This module supplies ``content_query(q) = q + u`` for (a)+(c) and
    ``score_bias = (q + v)^T W_kR r_{i-j} / sqrt(Dh)`` for (b)+(d) (kernels scale q.k by
    1/sqrt(Dh) but add the bias unscaled, so the bias is scaled here as in the paper's code).

    Distances i - j come from the caller's positions, so keys from memory or a KV cache are
    automatically at the right offset. u, v are learned **per layer** here (the paper shares
    one pair across layers); each is (H, Dh), initialised to zero.

    Efficiency: the sinusoids of the R distinct distances of the call are projected once,
    (R, D) -> (R, H, Dh); (q + v) meets them in one matmul (B, H, ..., T, R) and the result is
    gathered to (B, H, ..., T, S). No (T, S, D) tensor is built. With contiguous positions R =
    T + S - 1 (the range [min(i-j), max(i-j)]); when that range is longer (positions far apart:
    unfilled memory slots at position 0 read from a late step, a window crossing an episode
    start), only the distances that occur are used (``torch.unique``): R is then the number of
    distinct distances (never more than the range), whatever the positions' magnitude. Dense
    attention calls :meth:`masked_score_bias` instead, which builds the table once per forward
    for all layers, over the pairs the mask allows (R = S with XL memory, no ``unique``).
    """

    additive_bias = True

    def __init__(self, d_model: int, n_heads: int, base: float) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.base = d_model, n_heads, base
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.r_proj = nn.Linear(d_model, d_model, bias=False)  # W_kR
        self.u = nn.Parameter(torch.zeros(n_heads, self.head_dim))
        self.v = nn.Parameter(torch.zeros(n_heads, self.head_dim))

    def content_query(self, q: Tensor) -> Tensor:
        """q (B, H, ..., T, Dh) -> q + u (terms (a) + (c))."""
        return q + per_head(self.u, q.dim()).to(q.dtype)

    def score_bias(self, q: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """Terms (b) + (d), scaled: q (B, H, ..., T, Dh) -> (B, H, ..., T, S)."""
        dist = rel_distance(pos_q, pos_k)  # (B, 1, ..., T, S) long
        lo, hi = _span(dist)
        if hi - lo + 1 <= pos_q.shape[-1] + pos_k.shape[-1] - 1:  # contiguous positions: the whole range
            grid = torch.arange(lo, hi + 1, device=q.device)  # (R,) every distance in [lo, hi]
            inv = dist - lo
        else:  # far-apart positions (unfilled memory at 0, an episode start in the window): only those that occur
            grid, inv = torch.unique(dist, sorted=True, return_inverse=True)  # (R,), index of each pair's distance
        return self._bias(q, self._table(grid), inv)

    def masked_score_bias(self, q: Tensor, ctx: AttnContext) -> Tensor:
        """:meth:`score_bias` for a kernel that masks with ``ctx.allowed()``: q (B, H, T, Dh)
        -> (B, H, T, S), the same values on every pair ``ctx`` allows; the other pairs get
        finite values of no meaning (the kernel masks them).

        The distance table is built once per context (cached on it: every layer of a forward
        shares it) and over the allowed pairs only. With XL memory a query attends only the last
        S steps of its own episode, so the table is the S distances 0..S-1, where a table over
        all pairs must also cover unfilled slots and earlier episodes: ``torch.unique`` over
        B x T x S pairs in every layer (with GTrXL's burn-in from mid-episode, every training
        forward) and a table of up to T + S - 1 rows otherwise.
        """
        key = ("xl_relative", self.d_model, self.base, self.r_proj.weight.dtype)
        hit = ctx._derived.get(key)
        if hit is None:
            hit = ctx._derived[key] = self._allowed_distances(ctx)
        return self._bias(q, *hit)

    def _allowed_distances(self, ctx: AttnContext) -> tuple[Tensor, Tensor]:
        """Sinusoids of the distances i - j of the pairs ``ctx`` allows, (R, D) in the
        projection's dtype, and each pair's row in them, (B, 1, T, S) long (some row in range
        for the pairs not allowed)."""
        dist = ctx.pos_q[:, :, None] - ctx.pos_k[:, None, :]  # (B, T, S)
        s = ctx.k_len
        if ctx.has_mask:
            allowed = ctx.allowed()[:, 0]  # (B|1, T, S)
            inv = torch.where(allowed, dist, 0)
            lo, hi = _span(inv)
            if 0 <= lo and hi < s:
                # keys at most S - 1 steps back (causal, XL memory): always the S distances 0..S-1, so the
                # table's shape (hence a row's rounding) does not depend on the other rows' positions
                return self._table(torch.arange(s, device=dist.device)), inv.unsqueeze(1)
            occurs = dist[allowed.expand_as(dist)]  # (P,) the allowed pairs' own range (0 need not be one)
            lo, hi = _span(occurs) if occurs.numel() else (0, 0)
            dist = dist.masked_fill(~allowed, lo)
        else:
            lo, hi = _span(dist)
        if hi - lo + 1 <= ctx.q_len + s - 1:  # every distance in [lo, hi], as score_bias
            grid, inv = torch.arange(lo, hi + 1, device=dist.device), dist - lo  # (R,), (B, T, S)
        else:  # far apart (allowed pairs of a non-causal context): only the distances that occur
            grid, inv = torch.unique(dist, sorted=True, return_inverse=True)
        return self._table(grid), inv.unsqueeze(1)

    def _table(self, grid: Tensor) -> Tensor:
        """Sinusoids r of the distances ``grid`` (R,) -> (R, D) in the projection's dtype."""
        w = self.r_proj.weight.dtype
        return sinusoid(grid, self.d_model, self.base, acc_dtype(w)).to(w)

    def _bias(self, q: Tensor, table: Tensor, inv: Tensor) -> Tensor:
        """(q + v)^T W_kR r / sqrt(Dh) of each pair: q (B, H, ..., T, Dh), table (R, D) of r, inv
        (B, 1, ..., T, S) each pair's row of the table -> (B, H, ..., T, S)."""
        r = self.r_proj(table)  # (R, D)
        r = r.view(-1, self.n_heads, self.head_dim).transpose(0, 1).to(q.dtype)  # (H, R, Dh)
        r = r.view(1, self.n_heads, *([1] * (q.dim() - 4)), *r.shape[1:])  # (1, H, 1.., R, Dh)
        qv = q + per_head(self.v, q.dim()).to(q.dtype)  # (B, H, ..., T, Dh)
        bd = torch.matmul(qv, r.transpose(-1, -2))  # (B, H, ..., T, R)
        idx = inv.expand(*bd.shape[:-1], inv.shape[-1])  # (B, H, ..., T, S)
        return torch.gather(bd, -1, idx).mul_(self.scale)


def _span(x: Tensor) -> tuple[int, int]:
    """(min, max) of an integer tensor, read in one host transfer; (0, 0) for an empty one (an
    empty batch: nothing to look up)."""
    if x.numel() == 0:
        return 0, 0
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    return lo, hi


@POSITION.register(
    "xl_relative",
    description="Transformer-XL relative encoding: sinusoidal r_{i-j}, separate W_k,R, content/position biases u, v",
    paper="Dai et al. 2019, Transformer-XL (sec. 3.3)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class XLRelativeConfig(PositionConfig):
    """``base``: wavelength base of the sinusoids r (10000 as in the paper).

    Raises:
        ValueError: ``base`` <= 0; (``build``) an odd ``backbone.d_model``.
    """

    base: float = 10000.0

    def __post_init__(self) -> None:
        if self.base <= 0:
            raise ValueError(f"position.base must be > 0 (the wavelength base), got {self.base}")

    def build(self, ctx) -> PositionModule:
        if ctx.d_model % 2:
            raise ValueError(f"position.kind='xl_relative' needs an even backbone.d_model, got {ctx.d_model}")
        return XLRelativePosition(ctx.d_model, ctx.n_heads, self.base)
