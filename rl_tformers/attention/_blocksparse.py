"""Gathered block-sparse attention: the engine shared by the fixed-pattern kernels.

A fixed sparse pattern (local blocks, sliding or dilated windows, the strided/fixed
factorisations of the Sparse Transformer, block permutations, global tokens, random blocks)
is written as a few **pieces**. A piece tiles some queries into N groups of ``bq`` slots and
gives each group K key indices to gather, plus optionally a boolean ``keep`` (which of the
gathered (query, key) pairs belong to the pattern) and an additive ``bias`` (soft masks such
as adaptive span's log m_z). One piece costs O(N * bq * K) time and memory instead of
O(T * S)::

    q_g = q[:, :, q_idx]                           (B, h, N, bq, Dh)
    k_g = k[:, :, k_idx],  v_g = v[:, :, k_idx]    (B, h, N|1, K, Dh)
    s   = q_g k_g^T * scale (+ positional hooks) + bias                  (B, h, N, bq, K)
    allowed = keep & causal(k_idx <= q_idx) & key_valid[k_idx] & (seg_q[q_idx] == seg_k[k_idx])

Pieces over the same heads combine **exactly** into one softmax over the union of their key
sets. Pieces that share a query tiling are fused by concatenating their key sets (one fused
SDPA call on (B * N, h, bq, K) blocks when no score hook needs explicit scores); pieces with
different tilings merge their log-sum-exps (the merge of blockwise/flash attention; Rabe &
Staats 2021, Dao et al. 2022): ``lse = logsumexp_p lse_p``, ``out = sum_p exp(lse_p - lse)
out_p``, or are simply added when they cover disjoint queries. Each piece must therefore own a
disjoint set of keys per query (a piece's ``keep`` excludes keys owned by another); a query
that a piece does not tile gets ``lse = -inf`` (and a zero output) there.

Indices are **absolute key indices**: keys are ``[prefix (M); segment (T)]`` with
S = ``ctx.key_offset`` + M + T and query i sits at key index S - T + i (see
:class:`~rl_tformers.types.AttnContext`; ``ctx.key_offset`` is 0 unless a bounded incremental
cache dropped the bookkeeping of its oldest keys). With a bounded incremental cache only keys
``[k0, S)`` are at hand (``k0 = S - cached - new``); patterns never reach further back than
the cache keeps. Key ``a`` of the context's arrays (``ctx.pos_k``, ``key_valid``, ``seg_k``)
is read at ``a - ctx.key_offset``. Index tensors hold the *intended* index even where it falls outside the valid
range (the slot is then masked, and gathers clamp it); keeping pads next to the real indices
keeps positional hooks (whose cost may scale with the distance range) local.

Masks come from ``ctx.pos_*``, ``ctx.key_valid``, ``ctx.seg_*``, ``ctx.causal`` and
``ctx.prefix_len`` per piece; ``ctx.allowed()`` (dense T x S) is never called. Scores and the
softmax are float32 (also under bf16 autocast); disallowed scores are filled with
``torch.finfo(float32).min``; a query with no allowed key gets a zero output, never NaN.

What this engine cannot do: return the dense (B, H, T, S) attention weights (that would be
the L x L matrix it avoids), so ``ctx.need_weights`` is ignored by the kernels built on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from rl_tformers.attention.base import AttentionModule, KVCache
from rl_tformers.dropout import dropout
from rl_tformers.position.base import PositionModule
from rl_tformers.types import AttnContext, AttnOutput, neg_inf, to_acc


@dataclass
class Piece:
    """One component of a sparse pattern, evaluated by gathered attention.

    Attributes:
        q_idx: (N, bq) long absolute key index of each query slot. A slot is live iff
            ``M <= q_idx < S`` and ``q_ok`` (when given); each query occupies at most one live
            slot of a piece.
        k_idx: (N | 1, K) long absolute key indices gathered for each query group (1 = the
            same keys for every group). A key slot is live iff ``k0 <= k_idx < S`` and ``k_ok``.
        q_ok: optional (N, bq) bool extra liveness of query slots.
        k_ok: optional (N | 1, K) bool extra liveness of key slots (e.g. unused random blocks).
        keep: optional bool broadcastable to (B, h, N, bq, K): the pattern inside the gathered
            rectangle (True = in the pattern); usually (N, bq, K) or (1, bq, K).
        bias: optional float broadcastable to (B, h, N, bq, K), added to the scaled scores
            (soft masks). Where it is used, ``keep`` must exclude pairs it would send to -inf.
    """

    q_idx: Tensor
    k_idx: Tensor
    q_ok: Tensor | None = None
    k_ok: Tensor | None = None
    keep: Tensor | None = None
    bias: Tensor | None = None


@dataclass
class Heads:
    """Projected heads of one call, ready for gathering.

    Attributes:
        q: (B, H, T, Dh) queries for the content score (after ``content_query`` and ``rotate``).
        q_raw: (B, H, T, Dh) projected queries (the input of the ``score_bias`` hook).
        k: (B, H, S - k0, Dh) keys of absolute indices [k0, S), rotated.
        v: (B, H, S - k0, Dh) values.
        k0: absolute index of the first key at hand (``ctx.key_offset`` without a bounded cache).
        ctx: the call's context (describes keys [ctx.key_offset, S)).
    """

    q: Tensor
    q_raw: Tensor
    k: Tensor
    v: Tensor
    k0: int
    ctx: AttnContext

    @property
    def n_q(self) -> int:
        return self.q.shape[2]

    @property
    def n_k(self) -> int:
        """S: one past the absolute index of the last key (``ctx.key_offset + ctx.k_len``)."""
        return self.ctx.key_offset + self.ctx.k_len

    @property
    def q0(self) -> int:
        """Absolute index of the first query (M when ``ctx.key_offset`` is 0)."""
        return self.n_k - self.q.shape[2]


@dataclass
class HeadGroup:
    """Pieces evaluated on a subset of heads and combined into one softmax per query.

    Pieces that share their query tiling (the same ``q_idx`` tensor object) are fused into one
    piece by concatenating their key sets; the remaining pieces are LSE-merged, or simply added
    when ``disjoint`` (each query is live in at most one of them, e.g. global rows vs the rest).

    Attributes:
        heads: (h,) long head indices, or ``None`` for all heads.
        pieces: the pattern components for these heads (disjoint key sets per query).
        disjoint: the pieces, after fusion, cover disjoint sets of queries.
    """

    heads: Tensor | None
    pieces: list[Piece]
    disjoint: bool = False


# --------------------------------------------------------------------------------------------
# Index construction helpers (all shapes in absolute key-index space)
# --------------------------------------------------------------------------------------------
def tile_blocks(q0: int, s: int, bq: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Query blocks of ``bq`` consecutive key indices aligned to multiples of ``bq``.

    Covers the queries [q0, s). Returns ``q_idx`` (N, bq) and the block starts (N,), both long;
    slots outside [q0, s) are left in place (the engine masks them).
    """
    if s <= q0:
        empty = torch.zeros(0, bq, dtype=torch.long, device=device)
        return empty, torch.zeros(0, dtype=torch.long, device=device)
    starts = torch.arange(q0 // bq, (s - 1) // bq + 1, device=device) * bq  # (N,)
    return starts[:, None] + torch.arange(bq, device=device), starts  # (N, bq), (N,)


def key_range(starts: Tensor, lo: int, hi: int) -> Tensor:
    """Keys ``start + [lo, hi)`` for each start: (N,) -> (N, hi - lo) long (unclipped)."""
    return starts[:, None] + torch.arange(lo, hi, device=starts.device)


def band_piece(q0: int, s: int, lo: int, hi: int, dilation: int, bq: int, device: torch.device) -> Piece:
    """Sliding (optionally dilated) window: query a attends keys j with
    ``a - j in {lo*d, (lo+1)*d, ..., hi*d}`` (d = ``dilation``; lo <= hi).

    Longformer (Beltagy et al. 2020, sec. 3.1) windows: causal ``lo = 0, hi = w - 1``;
    bidirectional ``lo = -(w // 2), hi = w // 2``. A dilated window touches one residue class
    mod d only, so the sequence is split into its d interleaved sub-sequences
    ``a = r + d m`` and each is tiled into blocks of ``bq`` steps of m whose keys are the
    contiguous m-range ``[m_start - hi, m_start + bq - lo)``: K = bq + hi - lo gathered keys
    per block, O(S (bq + hi - lo)) in total, no (T, S) tensor.

    Returns a piece with N = d * n_blocks groups: q_idx (N, bq), k_idx (N, K) and the band
    keep (1, bq, K) (a - j depends only on the slot offsets, not on the group).
    """
    d = dilation
    m_first, m_last = q0 // d, (s - 1) // d  # m-range of the queries (any residue)
    starts = torch.arange(m_first // bq, m_last // bq + 1, device=device) * bq  # (nb,) m-starts
    r = torch.arange(d, device=device)[:, None, None]  # (d, 1, 1) residues
    q_idx = r + d * (starts[None, :, None] + torch.arange(bq, device=device))  # (d, nb, bq)
    k_off = torch.arange(-hi, bq - lo, device=device)  # (K,) m-offsets of the gathered keys
    k_idx = r + d * (starts[None, :, None] + k_off)  # (d, nb, K)
    steps = torch.arange(bq, device=device)[:, None] - k_off[None, :]  # (bq, K): (a - j) / d, the same in every block
    keep = (steps >= lo) & (steps <= hi)
    n = q_idx.shape[0] * q_idx.shape[1]
    return Piece(
        q_idx=q_idx.reshape(n, bq),  # (d * nb, bq)
        k_idx=k_idx.reshape(n, -1),  # (d * nb, K)
        keep=keep[None],  # (1, bq, K), broadcast over the groups
    )


def member(table: Tensor, idx: Tensor) -> Tensor:
    """``table[idx]`` for a (S,) bool table with indices clamped into range: idx (...) -> (...)."""
    flat = idx.clamp(0, table.shape[0] - 1).reshape(-1)
    return table.index_select(0, flat).view(idx.shape)


def global_table(indices: Tensor, s: int, device: torch.device) -> Tensor:
    """(S,) bool, True at the given absolute key indices (G,)."""
    table = torch.zeros(s, dtype=torch.bool, device=device)
    if indices.numel():
        table[indices] = True
    return table


def segment_indices(spec: Sequence[int], t: int, q0: int, device: torch.device) -> Tensor:
    """Absolute key indices (G,) of segment tokens given by index (negative = from the end).

    Indices outside [-T, T) are dropped (a short segment simply has fewer global tokens);
    duplicates are removed; the result is sorted.
    """
    out = sorted({i % t for i in spec if -t <= i < t}) if t > 0 else []
    return torch.tensor(out, dtype=torch.long, device=device) + q0


def with_globals(h: Heads, pieces: list[Piece], g_abs: Tensor) -> list[Piece]:
    """Add global tokens to local pieces (Longformer sec. 3.1; Big Bird's ITC global tokens).

    A global token attends every key and every query attends it. The local pieces lose the
    global keys and the global queries (their ``keep`` excludes them); two pieces are added:
    *columns* (every non-global query of the first piece's tiling -> the G global keys) and
    *rows* (the G global queries -> all keys at hand). Disjoint by construction, so the merge is
    one softmax over window | columns for a local query and over all keys for a global one.

    Args:
        g_abs: (G,) long sorted absolute key indices of the global tokens (segment tokens).
    Returns:
        the pieces, with the columns and rows pieces appended. Cost of the two: O(T G + G S).
    """
    if g_abs.numel() == 0:
        return pieces
    table = global_table(g_abs, h.n_k, h.q.device)  # (S,)
    out = []
    for p in pieces:
        excl = ~member(table, p.k_idx)[:, None, :] & ~member(table, p.q_idx)[:, :, None]  # (N, bq, K)
        out.append(replace(p, keep=excl if p.keep is None else p.keep & excl))
    base = pieces[0]
    cols = Piece(base.q_idx, g_abs[None, :], q_ok=base.q_ok, keep=~member(table, base.q_idx)[:, :, None])
    rows = Piece(g_abs[None, :], torch.arange(h.k0, h.n_k, device=h.q.device)[None, :])  # (1, G), (1, S - k0)
    return out + [cols, rows]


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
def take(x: Tensor, dim: int, idx: Tensor) -> Tensor:
    """``x`` indexed along ``dim`` by ``idx`` of any shape (clamped), the index shape spliced in."""
    flat = idx.reshape(-1)
    out = x.index_select(dim, flat)
    return out.view(*x.shape[:dim], *idx.shape, *x.shape[dim + 1 :])


def _windows(idx: Tensor) -> tuple[int, int] | None:
    """(start, row step) if ``idx`` (N, K) is ``start + step * n + k`` (consecutive windows with
    a constant step >= 1 between rows), else None. One host sync."""
    n, k = idx.shape
    if n == 0 or k == 0:
        return None
    start = int(idx[0, 0])
    step = int(idx[1, 0]) - start if n > 1 else 1
    if step < 1:
        return None
    expect = start + step * torch.arange(n, device=idx.device)[:, None] + torch.arange(k, device=idx.device)
    return (start, step) if torch.equal(idx, expect) else None


def gather_tokens(x: Tensor, rel: Tensor) -> Tensor:
    """Rows of ``x`` (B, h, L, Dh) at token indices ``rel`` (N, K) -> (B, h, N, K, Dh).

    Indices outside [0, L) give rows whose values do not matter (the engine masks them).
    Consecutive windows (band, block and local pieces) are cut with ``unfold`` from a padded
    view (no index_select, whose backward is a slow index_add on CPU); other index patterns
    are gathered with clamped indices.
    """
    win = _windows(rel)
    n, k = rel.shape
    length = x.shape[2]
    if win is not None:
        start, step = win
        end = start + step * (n - 1) + k  # one past the last index
        lo, hi = max(0, -start), max(0, end - length)
        xp = F.pad(x, (0, 0, lo, hi)) if lo or hi else x  # (B, h, L + lo + hi, Dh)
        span = xp[:, :, start + lo : end + lo]  # (B, h, step (N - 1) + K, Dh)
        return span.unfold(2, k, step).transpose(-1, -2)  # (B, h, N, K, Dh) view
    return take(x, 2, rel.clamp(0, max(length - 1, 0)))


def _inverse(q_idx: Tensor, live: Tensor, q0: int, t: int) -> Tensor:
    """(T,) long: the flat slot of each query in a piece, or N * bq (a dummy slot) if absent."""
    n_slots = q_idx.numel()
    inv = torch.full((t,), n_slots, dtype=torch.long, device=q_idx.device)
    flat_live = live.reshape(-1)
    slots = torch.arange(n_slots, device=q_idx.device)[flat_live]
    inv[(q_idx.reshape(-1)[flat_live] - q0)] = slots
    return inv


def run_piece(
    h: Heads,
    piece: Piece,
    position: PositionModule,
    *,
    scale: float,
    dropout_p: float,
    heads: Tensor | None,
    need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Attention of one piece, returned in token order.

    Args:
        h: the projected heads of the call.
        piece: the piece to evaluate.
        position: the layer's positional module (score hooks are applied on gathered blocks).
        scale: score scale (1 / sqrt(Dh)).
        dropout_p: dropout on the piece's probabilities (equivalent to dropout on the merged
            probabilities: merging rescales each piece's row by a per-row constant).
        heads: (h,) long head subset or None (all heads).
        need_lse: return the log-sum-exp (pieces to be merged). A lone piece without score
            hooks or bias then runs through fused SDPA on the gathered blocks.

    Returns:
        out (B, h, T, Dh) in the values' dtype, normalised within the piece (zeros for
        queries with no allowed key), and lse (B, h, T) float32 log-sum-exp of the piece's
        allowed scores (-inf where none), or None when not ``need_lse``.
    """
    t = h.q.shape[2]
    s, q0, k0 = h.n_k, h.q0, h.k0

    # Which heads to compute: score-based positional hooks have per-head parameters and need
    # all heads, so a head subset is then computed in full and sliced at the end.
    all_heads = heads is None or position.needs_scores
    q, k, v = h.q, h.k, h.v
    if not all_heads:
        q, k, v = q.index_select(1, heads), k.index_select(1, heads), v.index_select(1, heads)

    q_live, k_live, q_loc, k_ctx = _piece_index(h, piece)
    qg = gather_tokens(q, piece.q_idx - q0)  # (B, h, N, bq, Dh)
    kg = gather_tokens(k, piece.k_idx - k0)  # (B, h, N|1, K, Dh)
    vg = gather_tokens(v, piece.k_idx - k0)  # (B, h, N|1, K, Dh)

    allowed = _piece_mask(piece, h.ctx, q_live, k_live, q_loc, k_ctx)  # (B|1, h|1, N, bq, K)
    row_ok = allowed.any(dim=-1)  # (B|1, h|1, N, bq)
    if not position.needs_scores and piece.bias is None and not need_lse:
        out, lse = _fused_blocks(qg, kg, vg, allowed, row_ok, scale, dropout_p), None
    else:
        out, lse = _scored_blocks(h, piece, position, qg, kg, vg, allowed, row_ok, q_loc, k_ctx, scale=scale,
                                  dropout_p=dropout_p, need_lse=need_lse)
    out = out * row_ok[..., None].to(out.dtype)  # rows with no allowed key -> 0
    if all_heads and heads is not None:
        out = out.index_select(1, heads)
        lse = None if lse is None else lse.index_select(1, heads)
    return _token_order(out, lse, piece, q_live, q0, t, s)


def _piece_index(h: Heads, piece: Piece) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Where a piece's blocks sit among the call's tokens: q_live (N, bq) and k_live (N|1, K)
    bool (the query / key is one of the call's, and the piece keeps it), q_loc (N, bq) index into
    the T queries and k_ctx (N|1, K) index into the context's key arrays (absolute, clamped into
    the keys at hand)."""
    t, s, q0, k0 = h.q.shape[2], h.n_k, h.q0, h.k0
    q_live = (piece.q_idx >= q0) & (piece.q_idx < s)  # (N, bq)
    if piece.q_ok is not None:
        q_live = q_live & piece.q_ok
    k_live = (piece.k_idx >= k0) & (piece.k_idx < s)  # (N|1, K)
    if piece.k_ok is not None:
        k_live = k_live & piece.k_ok
    q_loc = (piece.q_idx - q0).clamp(0, max(t - 1, 0))  # (N, bq) index into the T queries
    k_ctx = piece.k_idx.clamp(max(k0, 0), s - 1) - h.ctx.key_offset  # (N|1, K)
    return q_live, k_live, q_loc, k_ctx


def _piece_mask(piece: Piece, ctx: AttnContext, q_live: Tensor, k_live: Tensor, q_loc: Tensor, k_ctx: Tensor) -> Tensor:
    """(B|1, 1|h, N, bq, K) bool: the key each query of a piece may attend to, built per block
    (live query and key, causal order, the piece's own ``keep``, key validity, same episode)."""
    allowed = q_live[:, :, None] & k_live[:, None, :]  # (N, bq, K)
    if ctx.causal:
        allowed = allowed & (piece.k_idx[:, None, :] <= piece.q_idx[:, :, None])
    if piece.keep is not None:
        allowed = allowed & piece.keep
    if allowed.dim() < 5:
        allowed = allowed.view(*([1] * (5 - allowed.dim())), *allowed.shape)  # (1|B, 1|h, N, bq, K)
    if ctx.key_valid is not None:
        kv = take(ctx.key_valid, 1, k_ctx)  # (B, N|1, K)
        allowed = allowed & kv[:, None, :, None, :]  # (B, 1|h, N, bq, K)
    if ctx.seg_q is not None and ctx.seg_k is not None:
        sq = take(ctx.seg_q, 1, q_loc)  # (B, N, bq)
        sk = take(ctx.seg_k, 1, k_ctx)  # (B, N|1, K)
        allowed = allowed & (sq[:, :, :, None] == sk[:, :, None, :])[:, None]  # (B, 1, N, bq, K)
    return allowed


def _fused_blocks(qg: Tensor, kg: Tensor, vg: Tensor, allowed: Tensor, row_ok: Tensor, scale: float,
                  dropout_p: float) -> Tensor:
    """Fused SDPA on the gathered blocks ``qg`` (B, h, N, bq, Dh), ``kg``, ``vg`` (B, h, N|1, K, Dh),
    laid out as a batch of B * N blocks of 4-D attention (the fused CPU kernels take 4-D input);
    rows with no allowed key attend everything and are zeroed by the caller (SDPA would return
    NaN for them). Returns (B, h, N, bq, Dh)."""
    b, hh, n, bq, dh = qg.shape
    kk = kg.shape[3]
    mask = (allowed | ~row_ok[..., None]).expand(b, -1, n, bq, kk)  # (B, 1|h, N, bq, K)
    out = F.scaled_dot_product_attention(
        qg.transpose(1, 2).reshape(b * n, hh, bq, dh),  # (B N, h, bq, Dh)
        kg.expand(-1, -1, n, -1, -1).transpose(1, 2).reshape(b * n, hh, kk, dh),  # (B N, h, K, Dh)
        vg.expand(-1, -1, n, -1, -1).transpose(1, 2).reshape(b * n, hh, kk, dh),
        attn_mask=mask.transpose(1, 2).reshape(b * n, mask.shape[1], bq, kk),  # (B N, 1|h, bq, K)
        dropout_p=dropout_p, scale=scale,
    )
    return out.view(b, n, hh, bq, dh).transpose(1, 2)  # (B, h, N, bq, Dh)


def _scored_blocks(h: Heads, piece: Piece, position: PositionModule, qg: Tensor, kg: Tensor, vg: Tensor,
                   allowed: Tensor, row_ok: Tensor, q_loc: Tensor, k_ctx: Tensor, *, scale: float,
                   dropout_p: float, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Explicit scores of the gathered blocks (with the positional module's score hooks and the
    piece's bias), softmax, dropout, values (and the positional value term). Returns out
    (B, h, N, bq, Dh) and, when ``need_lse``, the log-sum-exp (B, h, N, bq) (-inf for empty rows)."""
    ctx = h.ctx
    b, n, kk = qg.shape[0], qg.shape[2], kg.shape[3]
    pq = pk = None
    scores = to_acc(torch.matmul(qg * scale, kg.transpose(-1, -2)))  # (B, h, N, bq, K)
    if position.needs_scores:
        pq = take(ctx.pos_q, 1, q_loc)  # (B, N, bq)
        pk = take(ctx.pos_k, 1, k_ctx).expand(b, n, kk)  # (B, N, K)
        if position.additive_bias:
            bias = position.score_bias(take(h.q_raw, 2, q_loc), pq, pk)  # (B, H, N, bq, K)
            if bias is not None:
                scores = scores + to_acc(bias)
        if position.transforms_scores:
            scores = to_acc(position.transform_scores(scores, pq, pk))
    if piece.bias is not None:
        scores = scores + piece.bias
    scores = scores.masked_fill(~allowed, neg_inf(scores.dtype))
    probs = torch.softmax(scores, dim=-1)  # (B, h, N, bq, K) float32
    lse = None
    if need_lse:
        lse = torch.logsumexp(scores, dim=-1)  # (B, h, N, bq)
        lse = lse.masked_fill(~row_ok, float("-inf"))
    p = dropout(probs, dropout_p) if dropout_p > 0 else probs
    p = p.to(vg.dtype)
    if position.value_bias:
        p = p * row_ok[..., None]  # the value term must not see an empty row's uniform probs
    out = torch.matmul(p, vg)  # (B, h, N, bq, Dh)
    if position.value_bias:
        extra = position.value_term(p, pq, pk)  # (B, H, N, bq, Dh)
        if extra is not None:
            out = out + extra.to(out.dtype)
    return out, lse


def _token_order(out: Tensor, lse: Tensor | None, piece: Piece, q_live: Tensor, q0: int, t: int,
                 s: int) -> tuple[Tensor, Tensor | None]:
    """A piece's block results ``out`` (B, h, N, bq, Dh), ``lse`` (B|1, h, N, bq) back in token
    order: (B, h, T, Dh), (B, h, T); queries the piece does not tile get the zero / -inf dummy slot."""
    b, hh, n, bq, dh = out.shape
    out = out.reshape(b, hh, n * bq, dh)  # (B, h, N * bq, Dh)
    win = _windows(piece.q_idx.reshape(1, -1)) if piece.q_ok is None else None
    if win is not None and win[0] <= q0 and win[0] + n * bq >= s:  # consecutive tiling: a slice
        first = q0 - win[0]
        out = out[:, :, first : first + t]  # (B, h, T, Dh)
        if lse is not None:
            lse = lse.expand(b, hh, n, bq).reshape(b, hh, n * bq)[:, :, first : first + t]  # (B, h, T)
        return out, lse
    inv = _inverse(piece.q_idx, q_live, q0, t)  # (T,)
    out = torch.cat([out, out.new_zeros(b, hh, 1, dh)], dim=2).index_select(2, inv)  # (B, h, T, Dh)
    if lse is not None:
        lse = lse.expand(b, hh, n, bq).reshape(b, hh, n * bq)  # (B, h, N * bq)
        lse = torch.cat([lse, lse.new_full((b, hh, 1), float("-inf"))], dim=2).index_select(2, inv)  # (B, h, T)
    return out, lse


def merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tensor:
    """Exact softmax over the union of disjoint key sets from per-piece results.

    outs: each (B, h, T, Dh), normalised within its piece; lses: each (B, h, T) float32.
    Returns (B, h, T, Dh): sum_p w_p out_p with w_p = exp(lse_p - logsumexp_p lse_p); rows where
    every piece is empty stay zero.
    """
    if len(outs) == 1:
        return outs[0]
    stacked = torch.stack(list(lses))  # (P, B, h, T)
    top = stacked.amax(dim=0)  # (B, h, T)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(stacked - top)  # (P, B, h, T); 0 for empty pieces
    denom = w.sum(dim=0)  # (B, h, T)
    w = w / denom.clamp_min(torch.finfo(w.dtype).tiny)
    acc = sum(w[i][..., None] * to_acc(outs[i]) for i in range(len(outs)))  # (B, h, T, Dh)
    return acc.to(outs[0].dtype)


def fuse(pieces: Sequence[Piece]) -> list[Piece]:
    """Fuse pieces with the same query tiling (same ``q_idx`` object and ``q_ok``) into one.

    Key indices, key liveness, ``keep`` and ``bias`` are concatenated along the key axis, so the
    fused piece is one softmax over the union of the (disjoint) key sets: the same result as an
    LSE merge, in one fused SDPA call. Pieces with a per-batch/per-head ``keep`` or a ``bias``
    are left alone.
    """
    out: list[Piece] = []
    groups: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        simple = p.bias is None and (p.keep is None or p.keep.dim() <= 3)
        key = (id(p.q_idx), id(p.q_ok))
        if simple and key in groups:
            groups[key].append(p)
        elif simple:
            groups[key] = [p]
            out.append(p)
        else:
            out.append(p)
    for i, p in enumerate(out):
        same = groups.get((id(p.q_idx), id(p.q_ok)))
        if not same or len(same) == 1 or same[0] is not p:
            continue
        n, bq = p.q_idx.shape
        ks, oks, keeps = [], [], []
        for piece in same:
            kk = piece.k_idx.shape[1]
            ks.append(piece.k_idx.expand(n, kk))  # (N, K_p)
            ok = piece.k_ok if piece.k_ok is not None else torch.ones_like(piece.k_idx, dtype=torch.bool)
            oks.append(ok.expand(n, kk))
            keep = piece.keep if piece.keep is not None else torch.ones(1, 1, kk, dtype=torch.bool, device=ok.device)
            keeps.append(keep.expand(n, bq, kk))  # (N, bq, K_p)
        out[i] = Piece(p.q_idx, torch.cat(ks, 1), q_ok=p.q_ok, k_ok=torch.cat(oks, 1), keep=torch.cat(keeps, 2))
    return out


def attend_groups(
    h: Heads, groups: Sequence[HeadGroup], position: PositionModule, *, scale: float, dropout_p: float
) -> Tensor:
    """Evaluate every head group (pieces merged within a group) -> (B, H, T, Dh).

    Groups must partition the heads (a group with ``heads=None`` covers all of them).
    """
    outs, order = [], []
    for g in groups:
        pieces = fuse(g.pieces)
        need_lse = len(pieces) > 1 and not g.disjoint
        parts = [
            run_piece(h, p, position, scale=scale, dropout_p=dropout_p, heads=g.heads, need_lse=need_lse)
            for p in pieces
        ]
        if need_lse:
            outs.append(merge([o for o, _ in parts], [lse for _, lse in parts]))
        else:  # one piece, or pieces over disjoint queries (each is zero where it is not live)
            total = parts[0][0]
            for o, _ in parts[1:]:
                total = total + o
            outs.append(total)
        if g.heads is not None:
            order.append(g.heads)
    if len(groups) == 1 and groups[0].heads is None:
        return outs[0]
    out = torch.cat(outs, dim=1)  # (B, H, T, Dh) in group order
    perm = torch.argsort(torch.cat(order))  # group order -> head order
    if perm.numel() != h.q.shape[1]:
        raise ValueError(f"head groups cover {perm.numel()} heads, the layer has {h.q.shape[1]}")
    return out.index_select(1, perm)


def split_heads_by(labels: Sequence[int], device: torch.device) -> list[tuple[int, Tensor]]:
    """Group head indices by label: labels (H,) -> [(label, (h,) long head indices)], label order."""
    out = []
    for lab in sorted(set(labels)):
        idx = [i for i, x in enumerate(labels) if x == lab]
        out.append((lab, torch.tensor(idx, dtype=torch.long, device=device)))
    return out


# --------------------------------------------------------------------------------------------
# Module base
# --------------------------------------------------------------------------------------------
class BlockSparseAttention(AttentionModule):
    """Base of the fixed-pattern kernels: projections, positional hooks, cache, the engine.

    Subclasses implement :meth:`groups` (the pattern as head groups of pieces) and, when they
    have a causal form, :meth:`lookback` (how far back a query may reach, for the cache), and
    :meth:`pattern` (the same pattern as a dense mask, for tests at small lengths).

    ``forward(x_q (B, T, D), x_kv (B, S_new, D), ctx, cache) -> AttnOutput``: with a
    :class:`~rl_tformers.attention.base.KVCache` the keys are ``[cached; new]``; ``ctx``
    describes all S keys (the backbone's bookkeeping), of which the cache holds the last ones.
    """

    #: the kernel supports step-by-step decoding (set by subclasses with a causal form)
    incremental = False

    def lookback(self) -> int | None:
        """Largest ``a - j`` a causal query can attend (bounded caches keep that many keys);
        ``None`` = unbounded (the cache keeps every key)."""
        return None

    def cache_keeps(self) -> int | None:
        """:meth:`lookback` for a kernel with an incremental form (the engine reads the
        bookkeeping of the keys at hand only, through ``ctx.key_offset``), else None."""
        return self.lookback() if self.incremental else None

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:  # pragma: no cover - abstract
        raise NotImplementedError

    def init_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        if not self.incremental:
            return super().init_cache(batch, device, dtype)
        empty = torch.zeros(batch, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())

    def prepare(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: KVCache | None) -> tuple[Heads, KVCache | None]:
        """Project, apply positional rotations/content queries, append to the cache.

        Returns the :class:`Heads` of the call and the next cache (its last ``lookback()``
        keys, or all of them), or None without a cache.
        """
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S_new, Dh), (B, H, S_new, Dh)
        pos = self.position
        n_new = k.shape[2]
        s = ctx.k_len
        q_c = pos.rotate(pos.content_query(q), ctx.pos_q)
        k = pos.rotate(k, ctx.pos_k[:, s - n_new :])
        new_cache = None
        if cache is not None:
            k = torch.cat([cache.k.to(k.dtype), k], dim=2)  # (B, H, P + S_new, Dh)
            v = torch.cat([cache.v.to(v.dtype), v], dim=2)
            keep = self.lookback()
            first = 0 if keep is None else max(k.shape[2] - keep, 0)
            new_cache = KVCache(k[:, :, first:], v[:, :, first:])  # (B, H, min(P + S_new, keep), Dh)
        if k.shape[2] > s:
            raise ValueError(f"attention: {k.shape[2]} keys at hand but the context describes only {s}")
        k0 = ctx.key_offset + s - k.shape[2]
        return Heads(q=q_c, q_raw=q, k=k, v=v, k0=k0, ctx=ctx), new_cache

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: KVCache | None = None) -> AttnOutput:
        h, new_cache = self.prepare(x_q, x_kv, ctx, cache)
        out = attend_groups(h, self.groups(h, x_q), self.position, scale=self.scale, dropout_p=self.dropout_p)
        return AttnOutput(self.o_proj(self.merge_heads(out)), cache=new_cache)
