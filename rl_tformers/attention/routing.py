"""Routing Transformer attention (``routing``; Roy et al. 2021, "Efficient Content-Based Sparse
Attention with Routing Transformers", TACL 2021)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rl_tformers.attention._grouped import (
    GATHERED_POSITIONS,
    gather_rows,
    group_attention,
    require_scoreless_position,
    scatter_merge,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule, buffer_updates_enabled
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput


def _sum_over_ddp_ranks(sums: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """The EMA statistics of the global batch: ``sums`` (h, K, Dh) and ``counts`` (h, K) summed
    over the ranks inside a DDP training forward (:func:`rl_tformers.runtime.distributed.shard_mean_total`'s
    condition: every rank runs it, in step), so the centroids move with the mean over every
    shard, as one process on the same global batch, and stay identical on every rank; unchanged
    anywhere else (one process, evaluation, a forward outside the trainer's DDP loss).

    Without it each rank averaged its own shard and DDP's buffer broadcast kept rank 0's
    centroids: a 2-process run followed rank 0's half of every batch (0.06 centroid difference
    from one process after 10 toy updates).
    """

    dist_rt = sys.modules.get("rl_tformers.runtime.distributed")  # only loaded by the trainer
    if dist_rt is None or not getattr(dist_rt, "_IN_DDP_LOSS", False):
        return sums, counts

    flat = torch.cat([sums.reshape(-1), counts.reshape(-1)]).to(torch.float64)  # one all-reduce
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    n = sums.numel()
    return flat[:n].view_as(sums).to(sums.dtype), flat[n:].view_as(counts).to(counts.dtype)


class RoutingAttention(AttentionModule):
    """Online k-means routing attention on some heads, local attention on the others.

    Roy et al. 2021, sec. 4 (routing attention) and sec. 5 (best models mix routing heads and
    local heads):

    * Queries and keys are normalised to the unit sphere and routed to the nearest of K shared
      centroids mu (H_r, K, Dh) (one set per routing head); attention runs only inside a
      cluster, with the dot-product scores of the raw q, k (scale 1/sqrt(Dh)).
    * **Balanced top-k assignment** (sec. 4.1, ``assignment="topk"``): each centroid takes the
      w = ceil(L / K) nearest queries and the w nearest keys, so every cluster has the same size
      and the cost is O(L K Dh + L^2 Dh / K) (O(L^1.5 Dh) with K ~ sqrt(L)). A query picked by
      several clusters merges its results by log-sum-exp; a query picked by none gets zeros
      from the routing heads (the local heads still see it). A future token can push a past key
      out of a cluster's top-w, so this assignment is **bidirectional only**; for the same reason
      it takes one episode per row (several episodes in a row raise, with K > 1 clusters:
      the tokens of one episode would change which keys of another enter a cluster).
    * **Causal form** (``assignment="argmax"``, the default when the backbone is causal): each
      query/key goes to its nearest centroid and a query attends the ``cluster_window`` most
      recent keys of its cluster at or before it. Which keys a token sees then depends only on
      the past, so causality is exact. (The paper's causal models apply the causal mask inside
      top-k clusters; that still lets the future change cluster membership.)
    * **Centroid updates** (sec. 4.1, EMA k-means): mu <- normalise(lambda mu + (1 - lambda) mean of
      the unit queries and keys assigned to it), ``lambda = ema_decay``, computed without
      gradient **only in training mode and only when autograd is recording** (so a reversible
      block's no-grad forward and its recomputation in backward update once, with the same
      centroids; so does a checkpointed block, ``backbone.checkpoint``, whose first forward
      defers the update to its recomputation: :func:`deferred_buffer_updates`). Eval-mode forwards (rollouts) never change the module. Under the trainer's
      DDP the statistics are summed over the ranks (:func:`_sum_over_ddp_ranks`): the centroids
      follow the global batch and stay identical on every rank (a reversible block, which
      updates them during backward, keeps rank 0's, which DDP broadcasts). The paper sums the
      assigned vectors; the mean is used here so lambda means the same at any batch size.
      Statistics go to ``metrics``: ``routing_commitment`` (mean 1 - cos to the nearest
      centroid), ``routing_cluster_entropy`` (normalised entropy of cluster sizes),
      ``routing_coverage`` (share of valid queries routed somewhere). With
      ``commitment_weight > 0`` a VQ-style commitment loss pulls q, k to their centroids (aux).
    * **Local heads** (sec. 5): the first ``local_heads`` heads attend blocks of
      ``local_window`` queries to their own and previous key block (and the next one when
      bidirectional).

    Masks: causal (key index), key padding, episode ids in every group; prefix keys (memory)
    are routed like the segment's keys. Cannot: incremental decoding, score-based positions
    (hooks do not take per-head gathered positions), ``need_weights``.
    """

    def __init__(self, ctx, position, cfg: RoutingConfig) -> None:
        super().__init__(ctx, position)
        require_scoreless_position(ctx, position, "routing gathers keys per head and cluster")
        self.cfg = cfg
        self.n_local = cfg.local_heads if cfg.local_heads is not None else self.n_heads // 2
        if not 0 <= self.n_local <= self.n_heads:
            raise ValueError(f"attention.local_heads={cfg.local_heads} must lie in [0, backbone.n_heads={self.n_heads}]")
        self.n_route = self.n_heads - self.n_local
        mode = cfg.assignment
        self.assignment = ("argmax" if ctx.config.causal else "topk") if mode == "auto" else mode
        gen = None
        if cfg.seed is not None:
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * max(ctx.layer_idx, 0))
        mu = F.normalize(torch.randn(self.n_route, cfg.n_clusters, self.head_dim, generator=gen), dim=-1)
        self.register_buffer("centroids", mu)  # (H_r, K, Dh) unit vectors

    # -- local heads ---------------------------------------------------------------------------
    def _local(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext) -> Tensor:
        """Blocked local attention: q (B, h, T, Dh), k/v (B, h, S, Dh) -> (B, h, T, Dh) float32."""
        b, h, t, dh = q.shape
        s = k.shape[2]
        m0 = s - t
        w = self.cfg.local_window
        dev = q.device
        n_blk = -(-t // w)
        qi = torch.arange(n_blk * w, device=dev).view(n_blk, w)  # (nB, w) query index
        span = 2 * w if ctx.causal else 3 * w
        ki = m0 + torch.arange(n_blk, device=dev)[:, None] * w - w + torch.arange(span, device=dev)  # (nB, K)
        q_g = F.pad(q, (0, 0, 0, n_blk * w - t)).view(b, h, n_blk, w, dh)  # (B, h, nB, w, Dh)
        kc = ki.clamp(0, s - 1).reshape(-1)
        k_g = k.index_select(2, kc).view(b, h, n_blk, span, dh)  # (B, h, nB, K, Dh)
        v_g = v.index_select(2, kc).view(b, h, n_blk, span, dh)
        allowed = ((ki >= 0) & (ki < s))[None, None, :, None, :] & (qi < t)[None, None, :, :, None]
        qk = (qi + m0)[:, :, None]  # (nB, w, 1) key index of each query
        if ctx.causal:
            allowed = allowed & (ki[:, None, :] <= qk)[None, None]
        if ctx.key_valid is not None:
            allowed = allowed & ctx.key_valid.index_select(1, kc).view(b, 1, n_blk, 1, span)
        if ctx.seg_k is not None:
            sq = F.pad(ctx.seg_k, (0, n_blk * w - t)).index_select(1, (qi + m0).clamp(0, s - 1).reshape(-1))
            sk = ctx.seg_k.index_select(1, kc)
            allowed = allowed & (sq.view(b, 1, n_blk, w, 1) == sk.view(b, 1, n_blk, 1, span))
        out, _ = group_attention(q_g, k_g, v_g, allowed, scale=self.scale, dropout_p=self.dropout_p)
        return out.reshape(b, h, n_blk * w, dh)[:, :, :t]

    # -- routing heads -----------------------------------------------------------------------------
    def _pair_mask(self, qi: Tensor, ki: Tensor, ctx: AttnContext) -> Tensor:
        """Causal/episode mask of gathered pairs: qi (B, h, G, n) query key-index, ki (B, h, G, K)."""
        allowed = torch.ones(1, dtype=torch.bool, device=qi.device)
        if ctx.causal:
            allowed = ki[..., None, :] <= qi[..., :, None]
        if ctx.seg_k is not None:
            sq = gather_rows(ctx.seg_k[:, None], qi)
            sk = gather_rows(ctx.seg_k[:, None], ki)
            allowed = allowed & (sq[..., :, None] == sk[..., None, :])
        return allowed

    def _route_topk(self, q, k, v, sq, sk, q_ok, k_ok, ctx) -> tuple[Tensor, Tensor]:
        """Balanced top-w clusters (bidirectional). Returns out (B, h, T, Dh), coverage (0-d)."""
        b, h, t, _ = q.shape
        s = k.shape[2]
        n_c = self.cfg.n_clusters
        if n_c > 1 and ctx.seg_k is not None and s > 1:  # clusters are balanced over the whole row
            big = 2**62
            lo = ctx.seg_k.masked_fill(~k_ok, big).amin(1)
            hi = ctx.seg_k.masked_fill(~k_ok, -big).amax(1)
            if bool((hi > lo).any()):
                raise ValueError(
                    "attention kind 'routing' with assignment='topk' balances its clusters over the whole row, so "
                    "the tokens of one episode would decide which keys of another enter a cluster; feed one "
                    "episode per row (or use assignment='argmax')"
                )
        wq, wk = -(-t // n_c), -(-s // n_c)
        # -inf is a top-k selection sentinel here, not an attention-score fill: invalid tokens are
        # picked last and recognised by isfinite below (the attention itself fills finfo.min)
        score_q = sq.masked_fill(~q_ok[:, None, :, None], float("-inf")).transpose(-1, -2)  # (B, h, K, T)
        score_k = sk.masked_fill(~k_ok[:, None, :, None], float("-inf")).transpose(-1, -2)  # (B, h, K, S)
        val_q, idx_q = score_q.topk(wq, dim=-1)  # (B, h, K, wq)
        val_k, idx_k = score_k.topk(wk, dim=-1)  # (B, h, K, wk)
        live_q, live_k = torch.isfinite(val_q), torch.isfinite(val_k)
        q_g, k_g, v_g = gather_rows(q, idx_q), gather_rows(k, idx_k), gather_rows(v, idx_k)  # (B, h, K, w, Dh)
        allowed = live_q[..., :, None] & live_k[..., None, :] & self._pair_mask(idx_q + (s - t), idx_k, ctx)
        out, lse = group_attention(q_g, k_g, v_g, allowed, scale=self.scale, dropout_p=self.dropout_p)
        y = scatter_merge(out, lse, idx_q, live_q, t)  # (B, h, T, Dh)
        routed = torch.zeros(b, h, t, device=q.device).scatter_add(2, idx_q.flatten(2), live_q.flatten(2).float())
        coverage = ((routed > 0) & q_ok[:, None]).float().sum() / (q_ok.float().sum() * h).clamp_min(1)
        return y, coverage

    def _route_argmax(self, q, k, v, cq, ck, k_ok, ctx) -> Tensor:
        """Nearest-centroid clusters, last ``cluster_window`` same-cluster keys (causal-exact)."""
        b, h, t, dh = q.shape
        s = k.shape[2]
        n_c, w = self.cfg.n_clusters, self.cfg.cluster_window
        dev = q.device
        ck = torch.where(k_ok[:, None, :], ck, n_c)  # padding -> cluster K of its own
        idx = torch.arange(s, device=dev)
        comp, perm = torch.sort(ck * s + idx, dim=-1)  # (B, h, S) keys sorted by (cluster, index)
        counts = torch.zeros(b, h, n_c + 1, dtype=torch.long, device=dev).scatter_add_(-1, ck, torch.ones_like(ck))
        start = counts.cumsum(-1) - counts  # (B, h, K + 1)
        lo_c = start.gather(-1, cq)  # (B, h, T) first sorted position of the query's cluster
        hi_c = lo_c + counts.gather(-1, cq)
        qi = torch.arange(t, device=dev) + (s - t)  # (T,) key index of each query
        n_le = torch.searchsorted(comp, cq * s + qi, right=True)  # (B, h, T) end of "keys <= query"
        first = n_le - w if ctx.causal else n_le - (w + 1) // 2
        pos = first[..., None] + torch.arange(w, device=dev)  # (B, h, T, W) sorted positions
        live = (pos >= lo_c[..., None]) & (pos < hi_c[..., None])
        ki = perm.gather(-1, pos.clamp(0, s - 1).flatten(2)).view(b, h, t, w)  # (B, h, T, W)
        k_g, v_g = gather_rows(k, ki), gather_rows(v, ki)  # (B, h, T, W, Dh)
        qi_b = qi.view(1, 1, t, 1).expand(b, h, t, 1)
        allowed = live[..., None, :] & self._pair_mask(qi_b, ki, ctx)  # (B, h, T, 1, W)
        out, _ = group_attention(q[..., None, :], k_g, v_g, allowed, scale=self.scale, dropout_p=self.dropout_p)
        return out.squeeze(-2)  # (B, h, T, Dh)

    @torch.no_grad()
    def ema_step(self, qn: Tensor, kn: Tensor, cq: Tensor, ck: Tensor, q_ok: Tensor, k_ok: Tensor) -> None:
        """One EMA k-means step on the centroids buffer (no autograd).

        qn (B, h, T, Dh), kn (B, h, S, Dh) unit vectors; cq (B, h, T), ck (B, h, S) nearest
        centroids; q_ok (B, T), k_ok (B, S) validity. Clusters nothing was assigned to keep their centroid.
        The statistics are float32 under bf16 autocast too (the einsums would otherwise round the
        unit vectors and their sums to bf16: centroids 2e-3 off the float32 step).
        """
        n_c = self.cfg.n_clusters
        with torch.autocast(qn.device.type, enabled=False):
            oq = F.one_hot(cq, n_c).float() * q_ok[:, None, :, None]  # (B, h, T, K)
            ok = F.one_hot(ck, n_c).float() * k_ok[:, None, :, None]  # (B, h, S, K)
            sums = torch.einsum("bhtk,bhtd->hkd", oq, qn.float()) + torch.einsum("bhsk,bhsd->hkd", ok, kn.float())
            counts = oq.sum((0, 2)) + ok.sum((0, 2))  # (h, K)
        sums, counts = _sum_over_ddp_ranks(sums, counts)
        mean = sums / counts.clamp_min(1)[..., None]
        lam = self.cfg.ema_decay
        new = F.normalize(lam * self.centroids + (1 - lam) * mean, dim=-1)
        self.centroids.copy_(torch.where(counts[..., None] > 0, new, self.centroids))

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache=None) -> AttnOutput:
        if cache is not None:
            raise NotImplementedError("attention kind 'routing' has no incremental (cached) form")
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S, Dh) x2
        b, _, t, _ = q.shape
        s = k.shape[2]
        if s != ctx.k_len:
            raise ValueError(f"attention: {s} keys but the context describes {ctx.k_len}")
        q = self.position.rotate(q, ctx.pos_q)
        k = self.position.rotate(k, ctx.pos_k)
        parts, aux, metrics = [], {}, {}
        hl = self.n_local
        if hl:
            parts.append(self._local(q[:, :hl], k[:, :hl], v[:, :hl], ctx))
        if self.n_route:
            qr, kr, vr = q[:, hl:], k[:, hl:], v[:, hl:]
            k_ok = torch.ones(b, s, dtype=torch.bool, device=q.device) if ctx.key_valid is None else ctx.key_valid
            q_ok = k_ok[:, s - t :]
            qn, kn = F.normalize(qr.float(), dim=-1), F.normalize(kr.float(), dim=-1)
            mu = self.centroids.clone().float()  # snapshot: the EMA step below must not touch the graph
            with torch.autocast(q.device.type, enabled=False):
                sq = torch.einsum("bhtd,hkd->bhtk", qn, mu)  # (B, h, T, K) cosine to each centroid
                sk = torch.einsum("bhsd,hkd->bhsk", kn, mu)  # (B, h, S, K)
            best_q, cq = sq.max(-1)  # (B, h, T)
            best_k, ck = sk.max(-1)  # (B, h, S)
            if self.assignment == "topk":
                y, coverage = self._route_topk(qr, kr, vr, sq, sk, q_ok, k_ok, ctx)
            else:
                y, coverage = self._route_argmax(qr, kr, vr, cq, ck, k_ok, ctx), torch.ones(())
            parts.append(y)
            nq, nk = q_ok.float().sum().clamp_min(1), k_ok.float().sum().clamp_min(1)
            h = self.n_route
            commit = ((1 - best_q) * q_ok[:, None]).sum() / (nq * h) + ((1 - best_k) * k_ok[:, None]).sum() / (nk * h)
            sizes = F.one_hot(ck, self.cfg.n_clusters).float().mul(k_ok[:, None, :, None]).sum((0, 1, 2))  # (K,)
            p = sizes / sizes.sum().clamp_min(1)
            ent = -(p * p.clamp_min(1e-12).log()).sum() / torch.log(torch.tensor(float(max(self.cfg.n_clusters, 2))))
            metrics = {
                "routing_commitment": 0.5 * commit.detach(),
                "routing_cluster_entropy": ent.detach(),
                "routing_coverage": coverage.detach(),
            }
            if self.cfg.commitment_weight > 0:
                nearest_q = mu.unsqueeze(0).expand(b, -1, -1, -1).gather(2, cq[..., None].expand(-1, -1, -1, mu.shape[-1]))
                nearest_k = mu.unsqueeze(0).expand(b, -1, -1, -1).gather(2, ck[..., None].expand(-1, -1, -1, mu.shape[-1]))
                lq = ((qn - nearest_q) ** 2).sum(-1).mul(q_ok[:, None]).sum() / (nq * h)
                lk = ((kn - nearest_k) ** 2).sum(-1).mul(k_ok[:, None]).sum() / (nk * h)
                aux["routing_commitment"] = self.cfg.commitment_weight * (lq + lk)
            if self.training and torch.is_grad_enabled() and self.cfg.ema_decay < 1 and buffer_updates_enabled():
                self.ema_step(qn, kn, cq, ck, q_ok, k_ok)
        y = torch.cat(parts, dim=1).to(v.dtype)  # (B, H, T, Dh): local heads first
        return AttnOutput(self.o_proj(self.merge_heads(y)), aux=aux, metrics=metrics)


@ATTENTION.register(
    "routing",
    description="Routing Transformer: online k-means clusters of queries/keys (EMA centroids) + local heads",
    paper="Roy et al. 2021, Efficient Content-Based Sparse Attention with Routing Transformers (sec. 4-5)",
    capabilities=Capabilities(memory=True, exact=False, subquadratic=True, positions=GATHERED_POSITIONS,
                              cross_attention=False),  # queries are the last T keys (routed with them)
)
@dataclass(frozen=True)
class RoutingConfig(AttentionConfig):
    """Routing options.

    Attributes:
        n_clusters: K centroids per routing head (K ~ sqrt(L) gives the paper's O(L^1.5)).
        local_heads: heads using local attention (None: half of them, as in the paper's best models).
        local_window: block length of the local heads.
        assignment: ``topk`` (balanced, bidirectional only), ``argmax`` (nearest centroid, causal-exact)
            or ``auto`` (argmax when the backbone is causal, else topk).
        cluster_window: keys of its cluster a query sees in the argmax form.
        ema_decay: lambda of the centroid EMA (1 = frozen centroids).
        commitment_weight: weight of the optional commitment loss in ``aux`` (0 = none).
        seed: seed of the initial centroids (per layer: seed + 7919 * layer); None: global RNG.
    """

    n_clusters: int = 4
    local_heads: int | None = None
    local_window: int = 32
    assignment: str = "auto"
    cluster_window: int = 32
    ema_decay: float = 0.999
    commitment_weight: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.assignment not in ("auto", "topk", "argmax"):
            raise ValueError(f"attention.assignment must be auto, topk or argmax, got {self.assignment!r}")
        if min(self.n_clusters, self.local_window, self.cluster_window) < 1:
            raise ValueError("attention: n_clusters, local_window and cluster_window must be >= 1")
        if not 0 <= self.ema_decay <= 1 or self.commitment_weight < 0:
            raise ValueError("attention: ema_decay must lie in [0, 1] and commitment_weight be >= 0")

    @classmethod
    def bench_config(cls, seq_len: int) -> dict:
        """Benchmark fields at length L: K ~ sqrt(L) clusters (the paper's O(L^1.5) setting)."""
        return {"n_clusters": max(4, math.isqrt(seq_len))}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: two clusters, small windows, fixed seed (one local, one routing head)."""
        return {"n_clusters": 2, "local_window": 4, "cluster_window": 4, "seed": 0}

    def check(self, backbone_cfg) -> None:
        if backbone_cfg.causal and self.assignment == "topk":
            raise IncompatibleConfig(
                "backbone.attention.assignment='topk' (balanced clusters) lets a future token change which past "
                "keys a query sees; with backbone.causal=true use assignment='argmax' (or 'auto')"
            )

    def build(self, ctx, position) -> AttentionModule:
        return RoutingAttention(ctx, position, self)
