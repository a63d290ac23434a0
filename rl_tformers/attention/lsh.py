"""Reformer LSH attention (``lsh``; Kitaev et al. 2020, "Reformer: The Efficient Transformer", ICLR 2020)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rl_tformers.attention._grouped import (
    GATHERED_POSITIONS,
    gather_rows,
    group_attention,
    merge_lse,
    require_scoreless_position,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput, acc_dtype, to_acc


class LSHAttention(AttentionModule):
    """Locality-sensitive-hashing attention with shared queries and keys.

    Kitaev et al. 2020, sec. 2 and appendix A:

    * **Shared QK** (sec. 2, "shared-QK Transformer"): one projection gives the query q_j and the
      key k_j = q_j / |q_j| of every token (so a token is as close to itself as possible, hence
      the next rule).
    * **Hash** (sec. 2, eq. 3-4): ``h(x) = argmax([x R; -x R])`` with a random Gaussian
      R (Dh, b/2) per hash round; b buckets (``n_buckets``, default ~S / m as in the paper).
    * **Sort and chunk** (sec. 2, Fig. 2): items are sorted by (bucket, position); each bucket is
      cut into chunks of m = ``bucket_size`` consecutive items and a query attends the keys of
      its bucket in its own chunk and the previous chunk. Chunks are aligned to the start of each
      bucket (the paper chunks the globally sorted list): the keys a token sees then depend only
      on its bucket's members at or before it, which makes the causal variant exactly causal and
      padding invariant (padding goes to a bucket of its own). With several episodes in a row
      (episode ids, or a Transformer-XL memory of an earlier episode) every episode has buckets
      of its own (:meth:`groups`), so no episode's tokens change another's outputs. Cross-bucket
      pairs are masked as in the paper's P_i.
    * **Multi-round** (sec. 2 eq. 6, appendix A): ``n_hashes`` independent rounds give query i
      the key sets P_i^(r) (its bucket, its own and the previous chunk, the masks); the output is
      one softmax over their union P_i = U_r P_i^(r). Each round attends its P_i^(r) with the
      duplicate correction ``-log N_ij`` (N_ij = number of rounds whose P_i^(r) holds j: same
      bucket *and* own or previous chunk in that round) and the rounds merge by their
      log-sum-exps, so a key found by several rounds counts once.
    * **No attention to self** (sec. 2, "causal masking for shared-QK attention"): a token
      attends itself only when the union P_i holds no other key.

    Masks: causal (key index), key padding, episode ids, inside every chunk. Prefix keys
    (Transformer-XL memory) are hashed with the segment; only the last T items are queries.
    Queries must be the last T keys (self-attention layout); no cross-attention.

    Random rotations are a buffer, drawn at construction and redrawn only by :meth:`redraw`
    (``redraw_random_features``), never inside forward (the paper resamples per step; here a
    rollout and its update must see the same hash).

    Attention dropout (training) is drawn on the sorted, chunked layout, whose order depends on
    every token's bucket: with the same random seed, changing a later token permutes which
    dropout draws the earlier pairs get (their distribution, and the exact causality of the
    attention itself, are unchanged; in eval mode outputs are exactly causal).

    Cost: O(n_hashes S m Dh) time and memory, plus an O(S log S) sort. Cannot: incremental
    decoding (a new token changes the chunking), score-based positions (hooks do not take
    per-head gathered positions), ``need_weights``.
    """

    random_buffers = ("rotations",)

    def __init__(self, ctx, position, cfg: LSHConfig) -> None:
        super().__init__(ctx, position, shared_qk=True)
        require_scoreless_position(ctx, position, "LSH gathers keys per head and hash round")
        self.cfg = cfg
        self.redraw_every = cfg.redraw_every
        gen = None
        if cfg.seed is not None:
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * max(ctx.layer_idx, 0))
        self.register_buffer("rotations", self._draw(gen))  # (n_hashes, Dh, max_buckets / 2)

    def _draw(self, generator: torch.Generator | None) -> Tensor:
        half = max(1, self.cfg.max_buckets // 2)
        return torch.randn(self.cfg.n_hashes, self.head_dim, half, generator=generator)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw new random rotations in place (explicit call only)."""
        self.rotations.copy_(self._draw(generator).to(self.rotations.device))

    def n_buckets_for(self, s: int) -> int:
        """Buckets used for S keys: ``n_buckets`` or, if None, the even number nearest S / m (>= 2)."""
        if self.cfg.n_buckets is not None:
            return self.cfg.n_buckets
        nb = 2 * max(1, round(s / (2 * self.cfg.bucket_size)))
        return min(nb, self.cfg.max_buckets)

    def hash(self, keys: Tensor, n_buckets: int) -> Tensor:
        """Bucket ids h(x) = argmax([xR; -xR]): keys (B, H, S, Dh) -> (B, H, n_hashes, S) long."""
        b, h, s, _ = keys.shape
        if n_buckets == 1:
            return torch.zeros(b, h, self.cfg.n_hashes, s, dtype=torch.long, device=keys.device)
        rot = self.rotations[:, :, : n_buckets // 2].float()  # (R, Dh, b/2)
        proj = torch.einsum("bhsd,rdk->bhrsk", keys.float(), rot)  # (B, H, R, S, b/2)
        return torch.cat([proj, -proj], dim=-1).argmax(dim=-1)  # (B, H, R, S)

    @staticmethod
    def groups(buckets: Tensor, nb: int, valid: Tensor, seg_k: Tensor | None) -> tuple[Tensor, int]:
        """Sort groups of the keys: their bucket within their episode.

        Each episode (a run of keys with the same ``seg_k``, as the backbone lays episodes out)
        gets buckets of its own, so which keys share a chunk with a token depends only on its
        own episode's keys: tokens of another episode (before or after it in the row, or in a
        Transformer-XL memory) never change its output. Padding keeps one group of its own.

        Args:
            buckets: (B, H, R, S) bucket ids in [0, nb], nb = padding.
            nb: number of buckets.
            valid: (B, S) bool.
            seg_k: (B, S) episode ids, or None (one episode).
        Returns:
            group ids (B, H, R, S) (sorted in time order of the episodes, padding last) and the
            number G of possible groups.
        """
        s = buckets.shape[-1]
        if seg_k is None or s < 2:
            return buckets, nb + 1
        run = F.pad((seg_k[:, 1:] != seg_k[:, :-1]).long().cumsum(1), (1, 0))  # (B, S) episode run index
        n_runs = int(run.max()) + 1  # one host sync
        if n_runs == 1:
            return buckets, nb + 1
        grouped = run[:, None, None, :] * nb + buckets  # (B, H, R, S)
        return torch.where(valid[:, None, None, :], grouped, n_runs * nb), n_runs * nb + 1

    def _shared_qk(self, x_kv: Tensor, ctx: AttnContext) -> tuple[Tensor, Tensor, Tensor]:
        """Queries qk (B, H, S, Dh) (rotated), unit keys (B, H, S, Dh), values (B, H, S, Dh)."""
        qk = self.position.rotate(self.split_heads(self.q_proj(x_kv)), ctx.pos_k)  # (B, H, S, Dh)
        v = self.split_heads(self.v_proj(x_kv))
        return qk, F.normalize(to_acc(qk), dim=-1).to(qk.dtype), v

    def _chunk_layout(self, groups: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
        """Sort the S items of every hash round by (group, position) and lay each group out from
        a chunk boundary (chunks of ``bucket_size`` m). ``groups`` (B, H, R, S) long.

        Returns:
            item_at (B, H, R, slots): the item in each slot (S = an empty slot); slot_of_item
            (B, H, R, S): the slot of each item.
        """
        b, h, r, s = groups.shape
        m = self.cfg.bucket_size
        idx = torch.arange(s, device=groups.device)
        perm = torch.argsort(groups * s + idx, dim=-1)  # (B, H, R, S) item at sorted position p
        sorted_g = groups.gather(-1, perm)  # (B, H, R, S)
        first = F.pad(sorted_g[..., 1:] != sorted_g[..., :-1], (1, 0), value=True)  # a group starts at p
        rank = idx - torch.where(first, idx, 0).cummax(-1).values  # (B, H, R, S) rank of p in its group
        chunk = ((rank % m) == 0).long().cumsum(-1) - 1  # chunk of p: a group's every m-th item opens one
        slot = chunk * m + rank % m  # (B, H, R, S)
        # bound on the chunks used: sum_g ceil(count_g / m) <= (S + G (m - 1)) / m, and <= S
        n_slots = min(s, -(-(s + min(s, n_groups) * (m - 1)) // m)) * m
        item_at = torch.full((b, h, r, n_slots), s, dtype=torch.long, device=groups.device).scatter_(-1, slot, perm)
        return item_at, torch.empty_like(perm).scatter_(-1, perm, slot)

    @staticmethod
    def _allowed(i_s: Tensor, i_w: Tensor, same_bucket: Tensor, valid: Tensor, ctx: AttnContext) -> Tensor:
        """(B, H, R, nC, m, 2m) bool: which of its chunk's and the previous chunk's 2m keys (items
        ``i_w``) each query slot (items ``i_s`` (B, H, R, nC, m); S = empty) may attend to in its
        round: a real query, a ``valid`` (B, S) key of the ``same_bucket``, not later (causal), of
        its episode; itself included (the no-self rule is applied to the union of the rounds,
        :meth:`_no_self_unless_alone`)."""
        b, h, s = i_s.shape[0], i_s.shape[1], valid.shape[1]
        key_ok = gather_rows(F.pad(valid, (0, 1), value=False)[:, None], i_w.flatten(2)).view(i_w.shape)
        allowed = (i_s[..., :, None] < s) & key_ok[..., None, :]  # real query slot, valid key
        allowed &= same_bucket
        if ctx.causal:
            allowed &= i_w[..., None, :] <= i_s[..., :, None]
        if ctx.seg_k is not None:
            seg = F.pad(ctx.seg_k, (0, 1), value=-(2**62))  # (B, S + 1)
            seg_q = seg[:, None].expand(b, h, -1).gather(2, i_s.flatten(2)).view(i_s.shape)
            seg_k = seg[:, None].expand(b, h, -1).gather(2, i_w.flatten(2)).view(i_w.shape)
            allowed &= seg_q[..., :, None] == seg_k[..., None, :]
        return allowed

    @staticmethod
    def _no_self_unless_alone(allowed: Tensor, is_self: Tensor, item_at: Tensor, slot_of_item: Tensor) -> Tensor:
        """Reformer's rule on the union of the rounds (sec. 2): a token attends itself only when
        no round gives it another key. ``allowed``, ``is_self`` (B, H, R, nC, m, 2m); ``item_at``
        (B, H, R, slots) and ``slot_of_item`` (B, H, R, S) from :meth:`_chunk_layout`."""
        others = allowed & ~is_self
        has_other = others.any(-1).flatten(3).gather(3, slot_of_item).any(2)  # (B, H, S): in some round
        alone = ~F.pad(has_other, (0, 1), value=True).gather(2, item_at.flatten(2)).view(allowed.shape[:-1])
        return others | (allowed & is_self & alone[..., None])  # (B, H, R, nC, m, 2m)

    def _slot_views(self, qk: Tensor, keys: Tensor, v: Tensor, buckets: Tensor, item_at: Tensor, slot_of_item: Tensor):
        """Gather per slot (index S = an empty slot): queries (B, H, R, nC, m, Dh), keys and values
        of the own and previous chunk (B, H, R, nC, 2m, Dh), the items of the query slots (.., m)
        and key slots (.., 2m), and every round's (bucket, chunk) of the query items
        (B, H, R, nC, m, R, 2) and key items (B, H, R, nC, 2m, R, 2)."""
        b, h, r, n_slots = item_at.shape
        s, m, dh = qk.shape[2], self.cfg.bucket_size, self.head_dim
        n_c = n_slots // m

        def pad_row(x: Tensor, value: float = 0.0) -> Tensor:
            return F.pad(x, (0, 0, 0, 1), value=value) if x.dim() == 4 else F.pad(x, (0, 1), value=value)

        def look_back(x: Tensor, fill: float) -> Tensor:  # (B, H, R, nC, m, ...) -> (.., 2m, ..)
            prev = F.pad(x[:, :, :, :-1], (0, 0) * (x.dim() - 4) + (1, 0), value=fill)
            return torch.cat([prev, x], dim=4)

        q_s = gather_rows(pad_row(qk), item_at).view(b, h, r, n_c, m, dh)
        k_s = gather_rows(pad_row(keys), item_at).view(b, h, r, n_c, m, dh)
        v_s = gather_rows(pad_row(v), item_at).view(b, h, r, n_c, m, dh)
        i_s = item_at.view(b, h, r, n_c, m)
        place = torch.stack([buckets, slot_of_item // m], -1).transpose(2, 3).flatten(-2).float()  # (B, H, S, 2R)
        pl_s = gather_rows(pad_row(place, -1.0), item_at).view(b, h, r, n_c, m, r, 2)
        return q_s, look_back(k_s, 0.0), look_back(v_s, 0.0), i_s, look_back(i_s, s), pl_s, look_back(pl_s, -1.0)

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache=None) -> AttnOutput:
        if cache is not None:
            raise NotImplementedError("attention kind 'lsh' has no incremental (cached) form")
        b, s, _ = x_kv.shape
        t = x_q.shape[1]
        if s != ctx.k_len:
            raise ValueError(f"attention: {s} keys but the context describes {ctx.k_len}")
        qk, keys, v = self._shared_qk(x_kv, ctx)
        h, dh, r = self.n_heads, self.head_dim, self.cfg.n_hashes
        nb = self.n_buckets_for(s)
        valid = torch.ones(b, s, dtype=torch.bool, device=x_kv.device) if ctx.key_valid is None else ctx.key_valid
        buckets = self.hash(keys, nb)  # (B, H, R, S)
        buckets = torch.where(valid[:, None, None, :], buckets, nb)  # padding: bucket nb of its own
        groups, n_groups = self.groups(buckets, nb, valid, ctx.seg_k)  # (B, H, R, S)
        item_at, slot_of_item = self._chunk_layout(groups, n_groups)  # (B, H, R, slots), (B, H, R, S)
        n_slots = item_at.shape[-1]
        q_s, k_w, v_w, i_s, i_w, pl_s, pl_w = self._slot_views(qk, keys, v, groups, item_at, slot_of_item)

        # P_i^(r') membership of every window key, in every round r': same group, own or previous chunk
        d_chunk = pl_s[..., :, None, :, 1] - pl_w[..., None, :, :, 1]  # (B, H, R, nC, m, 2m, R)
        member = (pl_s[..., :, None, :, 0] == pl_w[..., None, :, :, 0]) & (d_chunk >= 0) & (d_chunk <= 1)
        same_bucket = torch.diagonal(member, dim1=2, dim2=6).movedim(-1, 2)  # (B, H, R, nC, m, 2m): round r's
        allowed = self._allowed(i_s, i_w, same_bucket, valid, ctx)  # (B, H, R, nC, m, 2m)
        allowed = self._no_self_unless_alone(allowed, i_w[..., None, :] == i_s[..., :, None], item_at, slot_of_item)
        # one softmax over the union of the rounds (appendix A): a key in N_ij rounds' sets counts once
        bias = -torch.log(member.sum(-1).clamp_min(1).to(acc_dtype(qk.dtype))) if r > 1 else None
        out, lse = group_attention(q_s, k_w, v_w, allowed, scale=self.scale, bias=bias, dropout_p=self.dropout_p)
        out = out.view(b, h, r, n_slots, dh)  # (B, H, R, slots, Dh)
        lse = lse.view(b, h, r, n_slots)
        out_i = out.gather(3, slot_of_item[..., None].expand(-1, -1, -1, -1, dh))  # (B, H, R, S, Dh)
        lse_i = lse.gather(3, slot_of_item)  # (B, H, R, S)
        y = merge_lse(out_i, lse_i, dim=2)[:, :, s - t :]  # (B, H, T, Dh)
        return AttnOutput(self.o_proj(self.merge_heads(y.to(v.dtype))))

    def reference_forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext) -> AttnOutput:
        """What LSH attention approximates (and equals with one bucket, one round, m >= S):
        dense shared-QK attention ``softmax(q_i . k^_j / sqrt(Dh))`` with unit keys, masked by
        ``ctx.allowed()`` and the no-self rule. x_q (B, T, D), x_kv (B, S, D) -> (B, T, D). Tests only.
        """
        b, s, _ = x_kv.shape
        t = x_q.shape[1]
        qk, keys, v = self._shared_qk(x_kv, ctx)
        q = qk[:, :, s - t :].float()  # (B, H, T, Dh)
        allowed = ctx.allowed().expand(b, 1, t, s)
        self_mask = torch.zeros(t, s, dtype=torch.bool, device=x_kv.device)
        self_mask[torch.arange(t), torch.arange(t) + s - t] = True
        others = allowed & ~self_mask
        allowed = torch.where(others.any(-1, keepdim=True), others, allowed)
        scores = (q @ keys.float().transpose(-1, -2)) * self.scale  # (B, H, T, S)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1) * allowed.any(-1, keepdim=True)  # rows with no allowed key -> 0
        y = probs @ v.float()
        return AttnOutput(self.o_proj(self.merge_heads(y.to(v.dtype))), weights=probs)


@ATTENTION.register(
    "lsh",
    description="Reformer LSH attention: shared QK, angular hashing, sorted chunks, multi-round, no self-attention",
    paper="Kitaev et al. 2020, Reformer: The Efficient Transformer (sec. 2, appendix A)",
    capabilities=Capabilities(
        memory=True, exact=False, approximate=True, subquadratic=True, positions=GATHERED_POSITIONS,
        cross_attention=False,  # shared QK: the queries are the last T keys (self-attention layout)
    ),
)
@dataclass(frozen=True)
class LSHConfig(AttentionConfig):
    """LSH options.

    Attributes:
        bucket_size: chunk length m (each query sees at most 2m keys per round).
        n_hashes: hash rounds (more rounds = closer to dense, linear cost).
        n_buckets: buckets per round (even, or 1 = one bucket); None = ~S / m (the paper's choice).
        max_buckets: cap for the automatic choice (1 or even); size of the rotation buffer.
        redraw_every: redraw period in updates for ``maybe_redraw_random_features`` (0 = never, >= 0).
        seed: seed of the initial rotations (per layer: seed + 7919 * layer); None: global RNG.
    """

    bucket_size: int = 32
    n_hashes: int = 2
    n_buckets: int | None = None
    max_buckets: int = 256
    redraw_every: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_size < 1 or self.n_hashes < 1:
            raise ValueError("attention: lsh needs bucket_size >= 1 and n_hashes >= 1")
        if self.redraw_every < 0:  # a negative period silently never redrew
            raise ValueError(f"attention.redraw_every must be >= 0 (0 = never redraw), got {self.redraw_every}")
        if self.max_buckets < 1 or (self.max_buckets > 1 and self.max_buckets % 2):
            # 0 failed in the first forward (argmax over no rotation), an odd cap gave an odd
            # automatic n_buckets of which [xR; -xR] can reach only the even part
            raise ValueError(f"attention.max_buckets must be 1 or even (argmax over [xR; -xR]), got {self.max_buckets}")
        if self.n_buckets is not None and (self.n_buckets < 1 or (self.n_buckets > 1 and self.n_buckets % 2)):
            raise ValueError(f"attention.n_buckets must be 1 or even (argmax over [xR; -xR]), got {self.n_buckets}")
        if self.n_buckets is not None and self.n_buckets > self.max_buckets:
            raise ValueError(f"attention.n_buckets={self.n_buckets} exceeds attention.max_buckets={self.max_buckets}")

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: several chunks and buckets at test length, fixed seed."""
        return {"bucket_size": 4, "n_buckets": 4, "seed": 0}

    @classmethod
    def contract_convergence(cls, seq_len: int) -> list[dict]:
        """Growing numbers of hash rounds: the union of buckets approaches every key."""
        return [{"n_hashes": r, "n_buckets": 4, "bucket_size": seq_len} for r in (1, 4, 16)]

    def build(self, ctx, position) -> AttentionModule:
        return LSHAttention(ctx, position, self)

