"""Sparse Sinkhorn attention (``sinkhorn``; Tay et al. 2020, "Sparse Sinkhorn Attention", ICML 2020)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.attention._grouped import GATHERED_POSITIONS, group_attention, require_scoreless_position
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput, acc_dtype, to_acc

_EPS_DIV = 1e-12  # smallest row/column sum divided by (its square stays a normal float32)
_EPS = 1e-9  # smallest mixed validity of a sorted key slot


def sinkhorn(logits: Tensor, mask: Tensor, iters: int, causal: bool) -> Tensor:
    """Sinkhorn balancing (Tay et al. 2020, sec. 3.2, eq. 7-8; Sinkhorn & Knopp 1967).

    ``exp(logits)`` restricted to ``mask`` (a row softmax), then alternating row and column
    normalisation. The causal variant (sec. 3.3, causal Sinkhorn balancing) normalises each
    entry (i, j) of a column only by the rows i' <= i (a cumulative sum), so row i of the
    result depends on rows <= i alone; with a strictly lower-triangular mask it never looks at
    the future. The iterations run in the linear domain (a masked softmax first), which keeps
    the causal column sums a plain ``cumsum``; entries below the float range become 0.

    Args:
        logits: (..., N, N) sorting logits (already divided by the temperature).
        mask: bool broadcastable to logits, True = entry may be non-zero.
        iters: number of (row, column) normalisation pairs.
    Returns:
        (..., N, N) soft permutation in float32 (float64 for float64 logits:
        :func:`~rl_tformers.types.acc_dtype`), exactly 0 outside ``mask`` (and in rows with no
        allowed entry).
    """
    x = to_acc(logits)
    x = x.masked_fill(~mask, torch.finfo(x.dtype).min)  # finite fill (no -inf - -inf)
    live = mask.expand_as(x).any(dim=-1, keepdim=True)  # rows with an allowed entry
    top = x.amax(dim=-1, keepdim=True).detach()  # row stabiliser (cancels in the row normalisation)
    p = torch.exp(x - torch.where(live, top, 0.0))  # underflows to exactly 0 where masked
    p = torch.where(live, p, 0.0)
    for _ in range(iters):  # loop over iterations (a hyper-parameter), not over tokens
        p = _normalise(p, p.sum(dim=-1, keepdim=True))
        p = _normalise(p, p.cumsum(dim=-2) if causal else p.sum(dim=-2, keepdim=True))
    return p


def _normalise(p: Tensor, den: Tensor) -> Tensor:
    """p / den, and 0 where den <= _EPS_DIV (there p <= den is ~0); no inf/NaN in the gradient."""
    ok = den > _EPS_DIV
    return torch.where(ok, p / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(p))


class SinkhornAttention(AttentionModule):
    """Block-sorted attention: each block attends its own keys and a learned soft-sorted block.

    Tay et al. 2020:

    * Blocks (sec. 3.1): the S keys are cut into N = S / b blocks of ``block_size`` b.
    * SortNet (sec. 3.2): a block summary (the mean of the block's valid layer inputs; the
      paper sums) goes through a two-layer ReLU network to N_max logits per head; the first N
      form the sorting matrix R (N x N) (N_max = ``max_len`` / b: **a fixed maximum length**).
    * Sinkhorn balancing (sec. 3.2) turns ``R / temperature`` into a soft permutation P
      (``sinkhorn_iters`` iterations; Gumbel noise in training if ``gumbel_noise``).
    * Attention (sec. 3.4, eq. 11): query block i attends its local block i and the sorted
      block ``sum_j P_ij K_j`` (values alike): 2b keys per query, O(S b Dh + N^2 b Dh) time,
      O(S b + N^2) memory.
    * SortCut (sec. 3.5, ``sortcut`` n_c > 0): the sorted sequence is cut after its first n_c
      blocks and every query attends those n_c b keys only (no local block): O(S n_c b) time
      and memory; bidirectional only.
    * Causal form (sec. 3.3): block i's summary is the mean of the blocks before it, R is masked
      to the blocks strictly before i and balanced causally (:func:`sinkhorn`), and the local
      block is causally masked: no output depends on a future token.

    Padding: padded tokens are left out of summaries, their keys/values zeroed, and a sorted
    slot mixes only valid keys (renormalised) with weight ``log(sum_j P_ij valid_js)`` in its
    score, which is exact masking when P is a hard permutation.

    Cannot: prefix keys (memory) or incremental decoding (the sort needs whole blocks),
    several episodes in one row (a sorted block mixes blocks of any episode: raises),
    sequences longer than ``max_len``, score-based positions, ``need_weights``.
    """

    def __init__(self, ctx, position, cfg: SinkhornConfig) -> None:
        super().__init__(ctx, position)
        require_scoreless_position(ctx, position, "sinkhorn attends soft-sorted key mixtures")
        self.cfg = cfg
        self.n_max = -(-cfg.max_len // cfg.block_size)
        hidden = cfg.sort_hidden or self.d_model
        self.sort_net = nn.Sequential(
            nn.Linear(self.d_model, hidden), nn.ReLU(), nn.Linear(hidden, self.n_heads * self.n_max)
        )

    def sort_matrix(self, x: Tensor, valid: Tensor, causal: bool) -> Tensor:
        """Soft permutation P (B, H, N, N) of the N blocks: x (B, N*b, D), valid (B, N*b).

        Computed in float32 (float64 for a float64 model, :func:`~rl_tformers.types.acc_dtype`).
        """
        b_sz = self.cfg.block_size
        bsz, s, d = x.shape
        n = s // b_sz
        acc = acc_dtype(x.dtype)
        xv = (x.to(acc) * valid[..., None].to(acc)).view(bsz, n, b_sz, d).sum(2)  # (B, N, D) block sums
        cnt = valid.view(bsz, n, b_sz).sum(2).to(acc)  # (B, N)
        if causal:  # summary of the blocks strictly before i
            xv, cnt_s = xv.cumsum(1) - xv, cnt.cumsum(1) - cnt
        else:
            cnt_s = cnt
        summary = xv / cnt_s.clamp_min(1)[..., None]  # (B, N, D)
        r = self.sort_net(summary.to(self.sort_net[0].weight.dtype)).view(bsz, n, self.n_heads, self.n_max)[..., :n]  # (B, N, H, N)
        r = r.permute(0, 2, 1, 3).to(acc) / self.cfg.temperature  # (B, H, N_i, N_j)
        if self.training and self.cfg.gumbel_noise:
            u = torch.rand_like(r).clamp(1e-9, 1 - 1e-9)
            r = r - torch.log(-torch.log(u)).to(r.dtype)
        mask = (cnt > 0)[:, None, None, :]  # (B, 1, 1, N_j): empty blocks are never sorted in
        if causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
        return sinkhorn(r, mask, self.cfg.sinkhorn_iters, causal)

    def _check_inputs(self, q: Tensor, ctx: AttnContext) -> tuple[int, Tensor]:
        """(number of blocks N, (B, S) key validity) of queries q (B, H, S, Dh); raises for
        prefix keys, more than ``max_len`` keys, or several episodes in one row."""
        if ctx.prefix_len:
            raise ValueError("attention kind 'sinkhorn' takes no prefix keys (memory); queries must be all keys")
        bsz, _, s, _ = q.shape
        n = -(-s // self.cfg.block_size)
        if n > self.n_max:
            raise ValueError(f"attention kind 'sinkhorn': {s} tokens exceed attention.max_len={self.cfg.max_len}")
        valid = torch.ones(bsz, s, dtype=torch.bool, device=q.device) if ctx.key_valid is None else ctx.key_valid
        if ctx.seg_k is not None and s > 1:
            big = 2**62
            lo = ctx.seg_k.masked_fill(~valid, big).amin(1)
            hi = ctx.seg_k.masked_fill(~valid, -big).amax(1)
            if bool((hi > lo).any()):
                raise ValueError(
                    "attention kind 'sinkhorn' mixes whole blocks and cannot keep several episodes of one row "
                    "apart; feed one episode per row"
                )
        return n, valid

    def sorted_blocks(self, x_kv: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, n: int, causal: bool):
        """Blocks and their soft-sorted mixtures (sec. 3.2, 3.4), in float32 (float64 for a float64
        model). q, k, v (B, H, S, Dh) rotated, valid (B, S).

        Returns:
            qb, kb, vb (B, H, N, b, Dh) (padded keys and values zeroed), vf (B, N, b) validity,
            ks, vs (B, H, N, b, Dh): sorted block i = sum_j P_ij K_j over valid keys only,
            renormalised by w (B, H, N, b), the valid mass of each sorted slot.
        """
        bsz, h, s, dh = q.shape
        b_sz = self.cfg.block_size
        pad = n * b_sz - s
        valid_p = F.pad(valid, (0, pad), value=False)  # (B, N*b)
        acc = acc_dtype(q.dtype)
        p_mat = self.sort_matrix(F.pad(x_kv, (0, 0, 0, pad)), valid_p, causal)  # (B, H, N, N)
        vm = valid_p[:, None, :, None].to(k.dtype)
        kb = (F.pad(k, (0, 0, 0, pad)) * vm).view(bsz, h, n, b_sz, dh).to(acc)  # (B, H, N, b, Dh)
        vb = (F.pad(v, (0, 0, 0, pad)) * vm).view(bsz, h, n, b_sz, dh).to(acc)
        qb = F.pad(q, (0, 0, 0, pad)).view(bsz, h, n, b_sz, dh)
        vf = valid_p.view(bsz, n, b_sz).to(acc)  # (B, N, b)
        w = torch.einsum("bhij,bjs->bhis", p_mat, vf)  # (B, H, N, b) valid mass of each sorted slot
        norm = w.clamp_min(_EPS)[..., None]
        ks = torch.einsum("bhij,bhjsd->bhisd", p_mat, kb) / norm  # (B, H, N, b, Dh)
        vs = torch.einsum("bhij,bhjsd->bhisd", p_mat, vb) / norm
        return qb, kb, vb, vf, ks, vs, w

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache=None) -> AttnOutput:
        if cache is not None:
            raise NotImplementedError("attention kind 'sinkhorn' has no incremental (cached) form")
        q, k, v = self.project(x_q, x_kv)  # (B, H, S, Dh) each
        bsz, h, s, dh = q.shape
        n, valid = self._check_inputs(q, ctx)
        q = self.position.rotate(q, ctx.pos_q)
        k = self.position.rotate(k, ctx.pos_k)
        with torch.autocast(q.device.type, enabled=False):  # float32 sorting and mixing (float64 model: float64)
            qb, kb, vb, vf, ks, vs, w = self.sorted_blocks(x_kv, q, k, v, valid, n, ctx.causal)
            if self.cfg.sortcut:
                return AttnOutput(self.o_proj(self.merge_heads(self._sortcut(qb, ks, vs, w, s).to(v.dtype))))
            keys = torch.cat([kb, ks], dim=3)  # (B, H, N, 2b, Dh): local block, sorted block
            vals = torch.cat([vb, vs], dim=3)
            b_sz = self.cfg.block_size
            local_ok = vf.bool()[:, None, :, None, :].expand(bsz, 1, n, b_sz, b_sz)  # (B, 1, N, b, b)
            if ctx.causal:
                local_ok = local_ok & torch.ones(b_sz, b_sz, dtype=torch.bool, device=q.device).tril()
            sorted_ok = (w > _EPS)[:, :, :, None, :].expand(bsz, h, n, b_sz, b_sz)  # (B, H, N, b, b)
            allowed = torch.cat([local_ok.expand(bsz, h, n, b_sz, b_sz), sorted_ok], dim=-1)  # (B, H, N, b, 2b)
            zeros = torch.zeros(bsz, h, n, 1, b_sz, device=q.device, dtype=w.dtype)
            bias = torch.cat([zeros, w.clamp_min(_EPS).log()[:, :, :, None, :]], dim=-1)  # (B, H, N, 1, 2b)
        out, _ = group_attention(qb, keys, vals, allowed, scale=self.scale, bias=bias, dropout_p=self.dropout_p)
        y = out.reshape(bsz, h, n * b_sz, dh)[:, :, :s].to(v.dtype)  # (B, H, S, Dh)
        return AttnOutput(self.o_proj(self.merge_heads(y)))

    def _sortcut(self, qb: Tensor, ks: Tensor, vs: Tensor, w: Tensor, s: int) -> Tensor:
        """SortCut (sec. 3.5): every query attends the first n_c = ``sortcut`` blocks of the sorted
        sequence only, ``softmax(Q psi_S(K)[:n_c b]^T / sqrt(Dh)) psi_S(V)[:n_c b]``: O(S n_c b).
        qb (B, H, N, b, Dh), ks, vs (B, H, N, b, Dh), w (B, H, N, b) -> (B, H, S, Dh)."""
        bsz, h, n, b_sz, dh = qb.shape
        cut = min(self.cfg.sortcut, n)
        keys = ks[:, :, :cut].reshape(bsz, h, cut * b_sz, dh)  # (B, H, n_c b, Dh)
        vals = vs[:, :, :cut].reshape(bsz, h, cut * b_sz, dh)
        mass = w[:, :, :cut].reshape(bsz, h, 1, cut * b_sz)  # (B, H, 1, n_c b)
        q = qb.reshape(bsz, h, n * b_sz, dh)[:, :, :s]  # (B, H, S, Dh)
        allowed = (mass > _EPS).expand(bsz, h, s, cut * b_sz)
        out, _ = group_attention(q, keys, vals, allowed, scale=self.scale, bias=mass.clamp_min(_EPS).log(),
                                 dropout_p=self.dropout_p)
        return out  # (B, H, S, Dh)


@ATTENTION.register(
    "sinkhorn",
    description="Sparse Sinkhorn attention: learned soft block sorting (Sinkhorn balancing) + local block; SortCut (sortcut)",
    paper="Tay et al. 2020, Sparse Sinkhorn Attention (sec. 3, causal Sinkhorn balancing sec. 3.3, SortCut sec. 3.5)",
    capabilities=Capabilities(exact=False, subquadratic=True, positions=GATHERED_POSITIONS,
                              cross_attention=False),  # its queries are its keys (S == T: no prefix keys)
)
@dataclass(frozen=True)
class SinkhornConfig(AttentionConfig):
    """Sinkhorn options.

    Attributes:
        block_size: b tokens per block (each query sees 2b keys).
        max_len: longest sequence (the SortNet has max_len / b outputs per head).
        sinkhorn_iters: row/column normalisation pairs.
        temperature: tau dividing the sorting logits (lower = closer to a hard permutation).
        gumbel_noise: Gumbel-Sinkhorn noise in training mode (eval is deterministic).
        sort_hidden: SortNet hidden width (None: d_model).
        sortcut: SortCut budget n_c (sec. 3.5): > 0 makes every query attend only the first n_c
            blocks of the soft-sorted sequence (n_c b keys, no local block): O(S n_c b);
            bidirectional only (the truncated sort mixes every block, the future included);
            0 = the local block plus the sorted block of each block.

    Raises:
        ValueError: a field out of range (``sortcut`` < 0 included).
        IncompatibleConfig: (:meth:`check`) ``sortcut`` with ``backbone.causal``.
    """

    block_size: int = 16
    max_len: int = 1024
    sinkhorn_iters: int = 8
    temperature: float = 0.75
    gumbel_noise: bool = False
    sort_hidden: int | None = None
    sortcut: int = 0

    def __post_init__(self) -> None:
        if self.sortcut < 0:
            raise ValueError(f"attention.sortcut must be >= 0 (0 = off), got {self.sortcut}")
        if self.block_size < 1 or self.max_len < 1 or self.sinkhorn_iters < 1 or self.temperature <= 0:
            raise ValueError("attention: sinkhorn needs block_size, max_len, sinkhorn_iters >= 1 and temperature > 0")
        if self.sort_hidden is not None and self.sort_hidden < 1:
            raise ValueError(f"attention.sort_hidden must be >= 1 or null (d_model), got {self.sort_hidden}")

    def check(self, cfg) -> None:
        """Refuse SortCut in a causal backbone: its first n_c sorted blocks mix every block."""
        if self.sortcut and cfg.causal:
            raise IncompatibleConfig(
                f"backbone.attention.sortcut={self.sortcut} has no causal form (the first sorted blocks mix "
                f"every block, later ones included; SortCut is for encoding, Tay et al. 2020 sec. 3.5); set "
                f"backbone.causal=false or attention.sortcut=0"
            )

    @property
    def max_keys(self) -> int:
        """Longest sequence this kind takes: the SortNet's ceil(max_len / b) blocks of b tokens."""
        return -(-self.max_len // self.block_size) * self.block_size

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: b ~ sqrt(S) (the memory-optimal block size, O(S) memory), a SortNet long enough."""
        return {"block_size": max(4, math.isqrt(seq_len)), "max_len": max(seq_len, 64)}

    @classmethod
    def bench_config(cls, seq_len: int) -> dict:
        """Benchmark fields at length L: b ~ sqrt(L) (O(L) memory) and a SortNet for L tokens."""
        return {"block_size": max(16, math.isqrt(seq_len)), "max_len": seq_len}

    def build(self, ctx, position) -> AttentionModule:
        return SinkhornAttention(ctx, position, self)
