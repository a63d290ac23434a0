"""Memorizing Transformer memory (memory kind ``knn``).

Wu et al. 2022, "Memorizing Transformers" (sec. 3): one attention layer near the top of the
stack is *kNN-augmented*. Besides its local attention, each query retrieves the top-k
(key, value) pairs of an external FIFO store of past keys and values (per batch row and per
head), attends over them, and a learned per-head gate mixes the two results (sec. 3.2)::

    V_a = V_m * g + V_c * (1 - g),    g = sigmoid(b_g) per head

The store holds the keys and values this layer computed for earlier tokens, detached (no
gradient into the memory, sec. 3.1), L2-normalised to limit the distribution shift of stale
entries (sec. 3.2: keys, and by default values too), with the position, validity and episode
id of each entry. Other layers get Transformer-XL memory of ``mem_len`` slots (the paper's
local cache); ``mem_len=0`` gives purely segment-local attention everywhere except the
retrieval.

How the pieces fit the backbone (no Python object state):

- the config's ``wrap_attention(ctx, attn)`` hook (called by every block at construction)
  wraps the attention of layer ``layer`` in :class:`KNNAugmentedAttention`, which keeps the
  configured kernel for the local branch;
- the store is that layer's ``LayerState.cache`` (a :class:`KNNStore`): the block hands it to
  the attention as its cache, the attention returns the appended store as its new cache, and
  :meth:`KNNMemory.update` puts it in the next state;
- ``reset`` clears the store rows of finished episodes (and retrieval never crosses episode
  ids, so a segment that starts a new episode mid-way cannot read the old one).

Search (``search``): ``torch`` is exact (masked matmul + top-k, batched over rows, heads and
queries, on any device); ``faiss`` builds an exact flat inner-product index per (row, head)
from the stored tensors at each call (the state stays a plain value; a Python loop over B * H
indexes). faiss is not faster: measured on CPU (one thread, H = 4, stores of 65,536-262,144
entries) it took 1.0-1.4x the torch time for calls of 8-32 tokens, 2.5x for 2-4 tokens and
3.7-4.9x for one token; it only avoids the torch path's (B, H, T, N) score tensor, so it saves
memory on CPU for large stores and many tokens per call. ``auto`` (default) uses faiss when it
is installed, the store is on CPU, the call has more than one query token and the entries
searched (the store, plus the segment's own with ``retrieval: steps``) number at least
``faiss_min_store``, torch otherwise (a one-token call, acting one step, always searches in
torch). Both return the same neighbours (up to ties); the retrieved scores are recomputed in
torch so gradients reach the queries and the gate either way.

Which entries a query may retrieve (``retrieval``; always only valid entries of its own
episode, at least ``min_age`` positions old):

- ``steps`` (default): every earlier entry of the episode whose age ``p - pos`` is in
  ``[min_age, store_size]``, read from the store *and* from the earlier tokens of the same
  forward pass (detached, as stored). The set depends only on the query's position, so any
  split of a sequence into segments retrieves the same entries: acting one step at a time
  equals the training forward (burn-in + window) exactly when XL memory covers the local
  context too (``mem_len`` >= the tokens a training query sees locally), as for ``xl``.
  With a smaller ``mem_len`` the remaining mismatch is XL's own (a training query attends
  locally to its whole segment, an acting one to ``mem_len`` slots).
- ``segments``: the paper's training procedure taken literally (fixed segments; each
  segment's keys are added to the store after the segment): a pass retrieves only from the
  store as it was before it. Acting one step at a time then retrieves the steps that a
  training segment saw only through local attention, so acting differs from training by the
  segmentation itself (measured, random 2-layer model of width 32, ``mem_len`` covering the
  24 steps, float64: 3.8e-2 between 24 one-step calls and one pass, 1.6e-2 for two passes of
  12). This was the only rule before ``retrieval`` existed; one token per call gives the
  same outputs under both rules (acting is unchanged, training differs).

Retrieval is content-only (no positional terms), as in the paper. A query with no retrievable
entry (empty store, new episode, first step) uses the local result alone (its gate is 0), so
without a state, or before anything was stored, the layer equals its plain attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.memory._search import faiss_available, faiss_search, masked_topk
from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, empty_prefix
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import AttnContext, AttnOutput, BackboneState, LayerState, neg_inf, state_type, to_acc

SEARCHES = ("auto", "torch", "faiss")
RETRIEVALS = ("steps", "segments")


@state_type
@dataclass
class KNNStore:
    """FIFO of past (key, value) pairs of the kNN-augmented layer, per row and head.

    Attributes:
        keys: (B, H, N, Dh) L2-normalised keys.
        values: (B, H, N, Dh) values (L2-normalised when ``normalize_values``).
        pos: (B, N) long positions of the entries.
        valid: (B, N) bool, False for unfilled or cleared entries.
        seg: (B, N) long episode id of each entry.
    """

    keys: Tensor
    values: Tensor
    pos: Tensor
    valid: Tensor
    seg: Tensor

    @property
    def capacity(self) -> int:
        """N: entries per row, valid or not (the FIFO size)."""
        return self.valid.shape[1]

    def count(self) -> Tensor:
        """(B,) number of valid entries per row."""
        return self.valid.sum(1)


def empty_store(batch: int, heads: int, size: int, head_dim: int, device, dtype) -> KNNStore:
    """A store of ``size`` invalid entries per row: keys/values zero, episode id -1."""
    z = torch.zeros(batch, heads, size, head_dim, device=device, dtype=dtype)
    pos, valid, seg = empty_prefix(batch, size, device)
    return KNNStore(z, z.clone(), pos, valid, seg)


def extend_store(store: KNNStore, keys: Tensor, values: Tensor, pos: Tensor, valid: Tensor, seg: Tensor) -> KNNStore:
    """The N stored entries followed by T new ones (keys/values (B, H, T, Dh), bookkeeping (B, T)): N + T entries."""
    return KNNStore(
        keys=torch.cat([store.keys, keys.to(store.keys.dtype)], 2),  # (B, H, N + T, Dh)
        values=torch.cat([store.values, values.to(store.values.dtype)], 2),
        pos=torch.cat([store.pos, pos], 1),
        valid=torch.cat([store.valid, valid], 1),
        seg=torch.cat([store.seg, seg], 1),
    )


def newest(store: KNNStore, n: int) -> KNNStore:
    """The newest ``n`` entries of ``store`` (FIFO eviction)."""
    return KNNStore(store.keys[:, :, -n:], store.values[:, :, -n:], store.pos[:, -n:], store.valid[:, -n:], store.seg[:, -n:])



class KNNAugmentedAttention(nn.Module):
    """A layer's attention plus retrieval from a :class:`KNNStore` (Wu et al. 2022, sec. 3.2).

    ``forward(x_q (B, T, D), x_kv (B, S, D), ctx, cache: KNNStore | None) -> AttnOutput`` with
    ``cache`` the appended store (``None`` when called without one).

    The local branch is the wrapped kernel, unchanged (its per-head output ``V_c`` is read at
    the input of its output projection). The memory branch: queries ``q = W_q x`` normalised,
    top-k entries by cosine similarity, ``V_m = softmax(s * cos) V_top`` with a learned
    per-head scale ``s`` (initialised to sqrt(Dh), the typical magnitude of q.k/sqrt(Dh) for
    unit-variance features). Output: ``W_o [V_c + g (V_m - V_c)] + b_o`` per head, i.e. the
    paper's gate applied before the shared output projection; ``g = 0`` for queries that
    retrieved nothing.

    Args:
        base: the attention module built for this layer (any kernel whose output is
            ``o_proj`` of a (B, T, D) tensor, as every :class:`AttentionModule` does).
        top_k: neighbours per query and head.
        search: ``auto``, ``torch`` or ``faiss``.
        faiss_min_store: store size from which ``auto`` uses faiss (CPU only).
        gate_init: initial gate logit b_g (0 -> g = 0.5).
        normalize_values: L2-normalise stored values (keys are always normalised).
        retrieval: ``steps`` (default) or ``segments``: which entries a query may retrieve
            (:meth:`allowed`; see :class:`KNNMemoryConfig`).
        min_age: a query at position p retrieves only entries at positions <= p - min_age.
    """

    def __init__(
        self, base: nn.Module, top_k: int, search: str, faiss_min_store: int, gate_init: float, normalize_values: bool,
        retrieval: str = "steps", min_age: int = 1,
    ) -> None:
        super().__init__()
        self.base = base
        self.top_k, self.search, self.faiss_min_store = top_k, search, faiss_min_store
        self.normalize_values = normalize_values
        self.retrieval, self.min_age = retrieval, min_age
        h, dh = base.n_heads, base.head_dim
        self.gate_logit = nn.Parameter(torch.full((h,), float(gate_init)))
        self.log_scale = nn.Parameter(torch.full((h,), math.log(math.sqrt(dh))))

    # the block and the depth read these from their attention
    @property
    def position(self):
        """The wrapped kernel's positional module."""
        return self.base.position

    @property
    def n_heads(self) -> int:
        """H, the wrapped kernel's number of heads."""
        return self.base.n_heads

    @property
    def head_dim(self) -> int:
        """Dh, the wrapped kernel's head dimension."""
        return self.base.head_dim

    def gate(self) -> Tensor:
        """(H,) memory weight g = sigmoid(b_g)."""
        return torch.sigmoid(self.gate_logit)

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: KNNStore | None = None) -> AttnOutput:
        """Local attention plus gated retrieval (see the class docstring); without ``cache``
        the wrapped kernel's output unchanged.

        Raises:
            RuntimeError: the wrapped kernel did not apply ``o_proj`` exactly once to a
                (B, T, D) tensor (its per-head output cannot be read).
        """
        if cache is None:  # no state: the plain layer
            return self.base(x_q, x_kv, ctx, None)
        base = self.base
        seen: list[Tensor] = []
        hook = base.o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            local = base(x_q, x_kv, ctx, None)
        finally:
            hook.remove()
        if len(seen) != 1 or seen[0].shape != x_q.shape:
            raise RuntimeError(
                f"memory kind 'knn' needs an attention kernel that applies o_proj once to a (B, T, D) tensor; "
                f"{type(base).__name__} did not"
            )
        b, t, _ = x_q.shape
        vc = base.split_heads(seen[0])  # (B, H, T, Dh) local per-head output
        k_lin = base.q_proj if base.k_proj is None else base.k_proj
        q = F.normalize(base.split_heads(base.q_proj(x_q)), dim=-1)  # (B, H, T, Dh)
        k_new = F.normalize(base.split_heads(k_lin(x_q)), dim=-1).detach()
        v_new = base.split_heads(base.v_proj(x_q)).detach()
        if self.normalize_values:
            v_new = F.normalize(v_new, dim=-1)
        seg_q = ctx.seg_q if ctx.seg_q is not None else torch.zeros(b, t, dtype=torch.long, device=x_q.device)
        valid_q = ctx.key_valid[:, -t:] if ctx.key_valid is not None else torch.ones(b, t, dtype=torch.bool, device=x_q.device)

        grown = extend_store(cache, k_new, v_new, ctx.pos_q, valid_q, seg_q)  # (N + T entries)
        if self.retrieval == "steps":  # the store and this segment, by age
            searched, allowed = grown, self.allowed(grown, seg_q, ctx.pos_q, max_age=cache.capacity, n_new=t)
        else:  # the store as it was before this segment
            searched, allowed = cache, self.allowed(cache, seg_q, ctx.pos_q)
        vm, hit, top_age = self.retrieve(q, searched, seg_q, ctx.pos_q, allowed)
        g = self.gate().to(vm.dtype).view(1, -1, 1, 1) * hit[..., None].to(vm.dtype)  # (B, H, T, 1)
        delta = base.merge_heads(g * (vm - vc))  # (B, T, D)
        out = local.out + F.linear(delta, base.o_proj.weight)
        store = newest(grown, cache.capacity)
        metrics = dict(local.metrics)
        live = valid_q[:, None, :].expand_as(hit)
        n_live = live.sum().clamp_min(1)
        metrics["knn/gate"] = self.gate().mean().detach()
        metrics["knn/hit_rate"] = ((hit & live).sum() / n_live).detach()
        metrics["knn/top1_age"] = ((top_age * (hit & live)).sum() / (hit & live).sum().clamp_min(1)).detach().float()
        return AttnOutput(out, cache=store, aux=dict(local.aux), metrics=metrics, weights=local.weights)

    def use_faiss(self, store: KNNStore, n_queries: int | None = None) -> bool:
        """Whether :meth:`retrieve` searches with faiss (``search``; ``n_queries``: T of the call).

        ``auto`` never uses faiss for a one-token call (T = 1: acting, one step of N
        environments): the faiss path loops over B x H flat indexes built from the store at each
        call, and measured on CPU (B = 8-32, H = 4, store 65,536-262,144, one thread) it took
        3.7-4.9x the time of the batched torch search, whose scores are then only (B, H, 1, N).
        """
        if self.search == "faiss":
            return True
        return (
            self.search == "auto" and (n_queries is None or n_queries > 1) and faiss_available()
            and store.keys.device.type == "cpu" and store.capacity >= self.faiss_min_store
        )

    def allowed(self, store: KNNStore, seg_q: Tensor, pos_q: Tensor, max_age: int | None = None,
                n_new: int = 0) -> Tensor:
        """(B, 1, T, N) bool: which entries of ``store`` each query may retrieve.

        Valid entries of the query's episode whose age ``pos_q - pos`` is at least ``min_age``
        and, when given, at most ``max_age``. With ``retrieval='steps'`` ``store`` is the
        state's store followed by this segment's ``n_new`` = T entries and ``max_age`` the store
        size (what the FIFO holds when the sequence comes one token per position), so the set
        depends only on the query's position and episode, not on where the segments start. Of
        the segment's own entries a query reads only those of *earlier tokens* (token order, not
        only position: positions that restart or decrease inside a pass never open a later
        token to an earlier query).
        """
        age = pos_q[:, :, None] - store.pos[:, None, :]  # (B, T, N)
        ok = store.valid[:, None, :] & (store.seg[:, None, :] == seg_q[:, :, None]) & (age >= self.min_age)
        if max_age is not None:
            ok = ok & (age <= max_age)
        if n_new:
            t, n = pos_q.shape[1], store.pos.shape[1]
            entry = torch.arange(n, device=pos_q.device) - (n - n_new)  # (N,) token index of new entries, < 0 stored
            ok = ok & (entry[None, None, :] < torch.arange(t, device=pos_q.device)[None, :, None])
        return ok[:, None]

    def retrieve(
        self, q: Tensor, store: KNNStore, seg_q: Tensor, pos_q: Tensor, allowed: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Top-k attention over the store.

        Args:
            q: (B, H, T, Dh) normalised queries.
            store: the :class:`KNNStore` searched (N entries).
            seg_q: (B, T) episode id of each query (entries of other episodes are never read).
            pos_q: (B, T) query positions (for the age metric).
            allowed: (B, 1, T, N) bool, the entries each query may read (:meth:`allowed`);
                default: the valid entries of the query's episode.
        Returns:
            V_m (B, H, T, Dh), hit (B, H, T) bool (at least one entry retrieved), and the age
            ``pos_q - pos`` of the best entry (B, H, T) long (0 where nothing was retrieved).
        """
        if allowed is None:
            allowed = (store.valid[:, None, :] & (store.seg[:, None, :] == seg_q[:, :, None]))[:, None]  # (B, 1, T, N)
        if self.use_faiss(store, q.shape[2]):
            idx, ok = self._faiss_topk(q, store, allowed)
            k_top = _gather_rows(store.keys, idx)  # (B, H, T, k, Dh)
            sims = (q[..., None, :] * k_top.to(q.dtype)).sum(-1)  # (B, H, T, k)
        else:
            scores = torch.matmul(q, store.keys.to(q.dtype).transpose(-1, -2))  # (B, H, T, N)
            sims, idx, ok = masked_topk(scores, allowed, self.top_k)
        scale = self.log_scale.exp().to(q.dtype).view(1, -1, 1, 1)  # (1, H, 1, 1)
        logits = torch.where(ok, sims * scale, torch.full_like(sims, neg_inf(sims.dtype)))
        p = torch.softmax(to_acc(logits), dim=-1).to(q.dtype) * ok  # (B, H, T, k); fp64 stays fp64
        v_top = _gather_rows(store.values, idx).to(q.dtype)  # (B, H, T, k, Dh)
        vm = (p[..., None] * v_top).sum(-2)  # (B, H, T, Dh)
        hit = ok.any(-1)
        b, h, t, _ = idx.shape
        best = store.pos[:, None, None, :].expand(b, h, t, -1).gather(-1, idx[..., :1])[..., 0]  # (B, H, T)
        age = torch.where(hit, pos_q[:, None, :] - best, torch.zeros_like(best))
        return vm, hit, age

    def _faiss_topk(self, q: Tensor, store: KNNStore, allowed: Tensor) -> tuple[Tensor, Tensor]:
        """Indices (B, H, T, k) and ok mask via one exact faiss search per (row, head).

        Each (row, head) is one database: the entries any of the row's queries may read. A
        query that may not read ``e`` of them gets ``k + e`` neighbours (``e`` the largest such
        count in the row: 0 with ``retrieval='segments'`` inside one episode, at most about T
        with ``steps``), of which its first k allowed ones, in score order, are its top k.
        """
        b, h, t, _ = q.shape
        k = min(self.top_k, store.capacity)
        idx = torch.zeros(b, h, t, k, dtype=torch.long, device=q.device)
        ok = torch.zeros(b, h, t, k, dtype=torch.bool, device=q.device)
        per_query = allowed[:, 0].expand(b, t, store.capacity)  # (B, T, N)
        union = per_query.any(1)  # (B, N)
        for i in range(b):  # faiss has no batched multi-database search
            sel = union[i].nonzero()[:, 0]
            if sel.numel() == 0:
                continue
            extra = sel.numel() - int(per_query[i].sum(-1).min())
            kq = min(k + extra, sel.numel())
            for j in range(h):
                _, found = faiss_search(store.keys[i, j, sel], q[i, j], kq, metric="ip")  # (T, kq)
                cand = sel[found.clamp_min(0)]  # (T, kq) store indices, best first
                good = (found >= 0) & per_query[i].gather(-1, cand)
                first = torch.sort((~good).to(torch.uint8), dim=-1, stable=True).indices[:, :k]  # allowed first
                kk = first.shape[1]
                idx[i, j, :, :kk] = cand.gather(-1, first)
                ok[i, j, :, :kk] = good.gather(-1, first)
        ok = ok & allowed.expand(b, h, t, -1).gather(-1, idx)
        return idx, ok


def _gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """x (B, H, N, Dh) at idx (B, H, T, k) -> (B, H, T, k, Dh)."""
    b, h, t, k = idx.shape
    flat = idx.reshape(b, h, t * k, 1).expand(-1, -1, -1, x.shape[-1])  # (B, H, T*k, Dh)
    return x.gather(2, flat).view(b, h, t, k, x.shape[-1])  # (B, H, T*k, Dh) -> (B, H, T, k, Dh)


class KNNMemory(MemoryModule):
    """State management of memory kind ``knn``: XL memory in every layer (``mem_len`` slots,
    possibly 0) and the :class:`KNNStore` of the kNN-augmented layer in its ``cache``.

    Args:
        layer: index of the kNN-augmented layer.
        mem_len: Transformer-XL memory per layer (0 = none).
        store_size: N, entries per row in the store.
        n_heads, head_dim, d_model: from the backbone config.
    """

    def __init__(self, layer: int, mem_len: int, store_size: int, n_heads: int, head_dim: int, d_model: int) -> None:
        super().__init__()
        self.layer, self.mem_len, self.store_size = layer, mem_len, store_size
        self.n_heads, self.head_dim, self.d_model = n_heads, head_dim, d_model

    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        """Per layer a zero (B, M, D) XL memory (``None`` when ``mem_len`` = 0) and, in layer
        ``layer``, an empty store of N = ``store_size`` invalid entries per row and head."""
        m = self.mem_len
        layers = [
            LayerState(
                memory=torch.zeros(batch, m, self.d_model, device=device, dtype=dtype) if m else None,
                cache=empty_store(batch, self.n_heads, self.store_size, self.head_dim, device, dtype) if i == self.layer else None,
            )
            for i in range(len(blocks))
        ]
        pos, valid, seg = empty_prefix(batch, m, device)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=zeros, next_pos=zeros.clone())

    def store(self, state: BackboneState) -> KNNStore:
        """The kNN store held in ``state``."""
        return state.layers[self.layer].cache

    def update(self, state: BackboneState, rec: SegmentRecord):
        """XL FIFO update of every layer's memory (detached, last M slots) and the store
        returned by the kNN layer as its cache; returns (state, {}, {"knn/store_fill"})."""
        m = self.mem_len
        layers = []
        for i, (ls, h) in enumerate(zip(state.layers, rec.layer_inputs)):
            mem = None
            if m:
                mem = torch.cat([ls.memory.to(h.dtype), h.detach()], 1)[:, -m:]  # (B, M, D)
            cache = None
            if i == self.layer:
                cache = rec.caches[i] if i < len(rec.caches) and isinstance(rec.caches[i], KNNStore) else ls.cache
            layers.append(LayerState(memory=mem, cache=cache))
        if m:
            pos = torch.cat([state.pos, rec.pos], 1)[:, -m:]
            valid = torch.cat([state.valid, rec.valid], 1)[:, -m:]
            seg = torch.cat([state.seg, rec.seg], 1)[:, -m:]
        else:
            pos, valid, seg = state.pos, state.valid, state.seg
        st = BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=state.episode, next_pos=state.next_pos)
        store = layers[self.layer].cache
        return st, {}, {"knn/store_fill": store.valid.float().mean().detach()}

    def reset(self, state: BackboneState, episode_start: Tensor) -> BackboneState:
        """Clear the rows where ``episode_start`` (B,) is True: XL memory and the store's rows."""
        st = super().reset(state, episode_start)
        keep = ~episode_start.to(device=state.valid.device, dtype=torch.bool)
        s = st.layers[self.layer].cache
        st.layers[self.layer].cache = KNNStore(
            keys=s.keys, values=s.values, pos=s.pos * keep[:, None], valid=s.valid & keep[:, None],
            seg=torch.where(keep[:, None], s.seg, torch.full_like(s.seg, -1)),
        )
        return st


@MEMORY.register(
    "knn",
    description="Memorizing Transformer: one kNN-augmented attention layer over a FIFO store of past keys/values",
    paper="Wu et al. 2022, Memorizing Transformers (sec. 3)",
    capabilities=Capabilities(stateful=True, memory=True),
)
@dataclass(frozen=True)
class KNNMemoryConfig(MemoryConfig):
    """Memorizing Transformer memory.

    Attributes:
        layer: index of the kNN-augmented layer; negative counts from the top (-1 = last
            layer), clamped to 0. Default -2: near the top, as in the paper.
        mem_len: Transformer-XL memory of every layer (the paper's local cache); 0 = none.
        store_size: N, (key, value) entries kept per batch row (FIFO).
        top_k: entries retrieved per query and head.
        search: ``auto``, ``torch`` (exact, batched) or ``faiss`` (exact flat index on CPU).
        faiss_min_store: with ``auto``, the store size from which faiss is used (for calls of
            more than one token; one-token calls always search in torch).
        gate_init: initial gate logit b_g (g = sigmoid(b_g)).
        normalize_values: L2-normalise stored values (keys always are).
        retrieval: which entries a query retrieves.

            - ``steps`` (default): every earlier entry of the query's episode whose age
              ``p - pos`` is in ``[min_age, store_size]``, from the store *and* from the tokens
              before it in the same forward pass (detached, like stored ones). The retrieved set
              depends only on the query's position, so a sequence split into any segments
              (one step at a time when acting, burn-in + window in training) retrieves the
              same entries: with XL memory covering the local context (``mem_len`` >= the
              tokens before the query in its training segment and memory), step-by-step acting
              equals the training forward exactly. Exact FIFO equivalence assumes one token
              per position (the GTrXL agent); otherwise the FIFO of ``store_size`` entries may
              evict some entries earlier than the age bound does.
            - ``segments``: the paper's training rule taken literally: a forward pass retrieves
              only from the store as it was before the pass (entries of earlier passes), and
              writes its own entries after it. Outputs then depend on the segmentation: from
              an empty state, one pass over T tokens retrieves nothing, while T passes of one
              token retrieve every earlier token (measured: up to 3.8e-2 on the outputs of a
              random 2-layer model in float64, with ``mem_len`` covering everything).
        min_age: a query at position p retrieves only entries at positions <= p - min_age
            (>= 1). 1: every earlier step; ``mem_len + 1``: only what the local attention
            cannot see when acting one step at a time (the paper's division of labour).

    Raises:
        ValueError: ``mem_len`` < 0, ``store_size`` or ``top_k`` < 1, an unknown ``search`` or
            ``retrieval``, ``min_age`` < 1, or ``min_age`` > ``store_size`` with ``steps``.
        IncompatibleConfig: (:meth:`check`, when the backbone is built) ``layer`` >=
            ``n_layers``, or ``search='faiss'`` without faiss installed.
    """

    layer: int = -2
    mem_len: int = 64
    store_size: int = 1024
    top_k: int = 32
    search: str = "auto"
    faiss_min_store: int = 65536
    gate_init: float = 0.0
    normalize_values: bool = True
    retrieval: str = "steps"
    min_age: int = 1

    #: the gate and the retrieval scale get a gradient only once the store has entries.
    contract_no_grad = ("depth.blocks.*.attn.gate_logit", "depth.blocks.*.attn.log_scale")

    def __post_init__(self) -> None:
        if self.mem_len < 0:
            raise ValueError(f"memory.mem_len must be >= 0, got {self.mem_len}")
        if self.store_size < 1 or self.top_k < 1:
            raise ValueError(f"memory.store_size and memory.top_k must be >= 1, got {self.store_size}, {self.top_k}")
        if self.search not in SEARCHES:
            raise ValueError(f"memory.search={self.search!r}; choose one of {', '.join(SEARCHES)}")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"memory.retrieval={self.retrieval!r}; choose one of {', '.join(RETRIEVALS)}")
        if self.min_age < 1:
            raise ValueError(f"memory.min_age must be >= 1 (a query never retrieves itself), got {self.min_age}")
        if self.retrieval == "steps" and self.min_age > self.store_size:
            raise ValueError(
                f"memory.min_age={self.min_age} > memory.store_size={self.store_size}: with retrieval='steps' a query "
                f"reads entries aged min_age..store_size, none here, so the kNN layer would retrieve nothing; "
                f"raise memory.store_size or lower memory.min_age")

    def layer_index(self, n_layers: int) -> int:
        """The kNN layer's index in a stack of ``n_layers``."""
        return max(0, n_layers + self.layer) if self.layer < 0 else self.layer

    def check(self, cfg) -> None:
        """Refuse a layer index outside the stack and ``search=faiss`` without faiss."""
        if self.layer >= cfg.n_layers:
            raise IncompatibleConfig(f"memory.layer={self.layer} but backbone.n_layers={cfg.n_layers}")
        if self.search == "faiss" and not faiss_available():
            raise IncompatibleConfig("memory.search='faiss' but faiss is not installed (pip install faiss-cpu); use 'torch' or 'auto'")

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Small field values for the contract tests with segments of ``seq_len`` tokens."""
        return {"mem_len": max(2, seq_len // 2), "store_size": 2 * seq_len, "top_k": 4}

    def wrap_attention(self, ctx, attn: nn.Module) -> nn.Module:
        """Block-construction hook: wrap layer :meth:`layer_index` in :class:`KNNAugmentedAttention`."""
        if ctx.layer_idx != self.layer_index(ctx.n_layers):
            return attn
        return KNNAugmentedAttention(
            attn, self.top_k, self.search, self.faiss_min_store, self.gate_init, self.normalize_values,
            self.retrieval, self.min_age,
        )

    def build(self, ctx) -> MemoryModule:
        cfg = ctx.config
        return KNNMemory(self.layer_index(cfg.n_layers), self.mem_len, self.store_size, cfg.n_heads, cfg.head_dim, cfg.d_model)
