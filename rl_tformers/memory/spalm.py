"""SPALM memory (memory kind ``spalm``): Transformer-XL short-term memory plus a kNN long-term store.

Yogatama et al. 2021, "Adaptive Semiparametric Language Models" (TACL 9), its model section. The model
keeps two memories besides its current segment:

- **short-term memory**: Transformer-XL's cache of the previous segments' hidden states in
  every layer (``mem_len`` slots per layer, detached; :class:`~rl_tformers.memory.xl.XLMemory`);
- **long-term memory**: a key-value store searched by k-nearest-neighbours. A key is the
  representation ``h`` of a context, its value what followed that context (in the paper: the
  next token, read through the word embedding). At the final layer, with ``h_t`` the output
  for the current token and ``y_1..y_K`` the embedded values of the K nearest keys:

  (1) ``m_t = sum_k softmax_k(y_k . h_t) y_k``   (attention over the retrieved values; the
      neighbours' distances select them and are not used further)
  (2) ``g_t = sigmoid(w_g . h_t + b_g)``           (context-dependent gate)
  (3) ``z_t = (1 - g_t) * m_t + g_t * h_t``        (what the output layer reads)

  The equation numbers are this module's; the paper states them where it describes its long-term
  memory and gating (Weng's survey writes the same three lines), with ``g_t = sigmoid(w_g^T h_t)``: the bias ``b_g`` is added here
  (initialised to ``gate_init``, trained), and ``b_g = 0`` gives the paper's gate exactly.

What key and value are for a policy (one token per environment step, no vocabulary):

- the store is the **episode's own past**, per batch row (environment), never shared across
  rows or episodes, cleared by ``reset`` at ``episode_start``;
- key of step ``j``: the backbone's output ``h_j`` at step ``j`` (after the final norm: the
  representation the heads read, the analogue of the LM's final-layer ``h``), detached;
- value of step ``j``: the backbone's input ``x_{j+1}`` at the next step of the same episode,
  detached: what followed the context, embedded by the same input embedding, as SPALM embeds
  the next token with the word embedding. So a step's pair is complete once its episode's
  next step has arrived; the store keeps per-step (key, input) records and pairs each key with
  the next record's input;
- search: exact squared-L2 nearest neighbours (the kNN-LM distance the paper's retrieval
  follows), ``knn_k`` of them, by a masked top-k over the padded per-row store, batched over
  rows and query tokens (``torch.topk``; no loop over environments or tokens);
- which pairs a query at token ``i`` may read: valid pairs of its episode whose key is between
  ``min_age`` and ``store_len`` tokens older than it (so the value, at most the query's own
  input, is never from its future). The default ``min_age`` is ``mem_len + 1``: only what
  the short-term memory no longer holds when acting one step at a time (the paper's division
  of labour between the two memories); 1 reads every earlier step.

The set of readable pairs depends only on the token's place in its episode, and pairs of the
current forward pass are read as well as stored ones (detached, as stored), so any split of a
sequence into segments, one step at a time included, gives the same long-term reads; with
``mem_len`` covering the local context the outputs equal one pass exactly (``exact_chunking``).
Without a state the forward reads the pairs of its own tokens only.

Differences from the paper, all forced by the setting: the store holds the current episode
(the paper's holds the training corpus, keys from a pretrained model), values are next inputs
rather than next tokens, and no gradient reaches keys or values (the paper's keys are fixed;
its values go through the trained word embedding). Gradients reach ``h_t`` through (1)-(3)
and the gate's ``w_g``, ``b_g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.memory._search import masked_topk
from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, empty_prefix
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import BackboneState, LayerState, neg_inf, state_type, to_acc


@state_type
@dataclass
class SpalmStore:
    """Per-row FIFO of the last N steps' (key, input) records of the long-term memory.

    Record ``s`` and the next record ``s + 1`` form the pair (key ``keys[s]``, value
    ``inputs[s + 1]``) when both are valid and of the same episode.

    Attributes:
        keys: (B, N, D) backbone outputs ``h_j`` (detached).
        inputs: (B, N, D) backbone inputs ``x_j`` (detached).
        pos: (B, N) long positions of the records.
        valid: (B, N) bool, False for unfilled, padded or cleared records.
        seg: (B, N) long episode id of each record (-1 when cleared).
    """

    keys: Tensor
    inputs: Tensor
    pos: Tensor
    valid: Tensor
    seg: Tensor

    @property
    def capacity(self) -> int:
        """N: records per row, valid or not."""
        return self.valid.shape[1]


def empty_spalm_store(batch: int, size: int, d_model: int, device, dtype) -> SpalmStore:
    """A store of ``size`` invalid records per row: zeros, episode id -1."""
    z = torch.zeros(batch, size, d_model, device=device, dtype=dtype)
    pos, valid, seg = empty_prefix(batch, size, device)
    return SpalmStore(z, z.clone(), pos, valid, seg)


def spalm_combine(h: Tensor, y: Tensor, ok: Tensor, gate: nn.Linear) -> tuple[Tensor, Tensor]:
    """SPALM's long-term read and gate, equations (1)-(3) of the module docstring.

    Args:
        h: (..., D) local hidden states (queries).
        y: (..., K, D) embedded values of the K retrieved neighbours (entries where ``ok`` is
            False are ignored, whatever they hold).
        ok: (..., K) bool, True for a real neighbour.
        gate: ``nn.Linear(D, 1)``: ``w_g`` and ``b_g``.

    Returns:
        z (..., D) and the gate g (..., 1), the weight of the local state; rows without a real
        neighbour get g = 1, so z = h.
    """
    y = torch.where(ok[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    scores = (y * h[..., None, :]).sum(-1)  # (..., K): y_k . h
    scores = torch.where(ok, scores, torch.full_like(scores, neg_inf(scores.dtype)))
    a = torch.softmax(to_acc(scores), dim=-1).to(h.dtype)
    a = torch.where(ok, a, torch.zeros_like(a))  # (..., K)
    m = (a[..., None] * y).sum(-2)  # (..., D): eq. (1)
    g = torch.sigmoid(gate(h))  # (..., 1): eq. (2)
    g = torch.where(ok.any(-1, keepdim=True), g, torch.ones_like(g))
    return (1 - g) * m + g * h, g  # eq. (3)


class SpalmMemory(MemoryModule):
    """State and long-term read of memory kind ``spalm`` (see the module docstring).

    State: per layer an XL memory of ``mem_len`` slots (``None`` when 0) and, in the last
    layer's ``LayerState.extra``, the :class:`SpalmStore` of ``store_len`` records per row.
    The backbone calls :meth:`read` on its output (after the final norm) and hands what it
    returns to :meth:`update` as ``SegmentRecord.readout``.

    Args:
        mem_len: XL memory per layer (0 = none).
        store_len: N, records kept per row (the long-term memory's reach, in steps).
        knn_k: K, neighbours retrieved per query.
        min_age: a query reads keys at least this many tokens older than itself (>= 1).
        d_model: D.
        gate_init: initial gate bias b_g.
    """

    reads_output = True

    def __init__(self, mem_len: int, store_len: int, knn_k: int, min_age: int, d_model: int, gate_init: float) -> None:
        super().__init__()
        self.mem_len, self.store_len, self.knn_k, self.min_age, self.d_model = mem_len, store_len, knn_k, min_age, d_model
        self.gate = nn.Linear(d_model, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, gate_init)

    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        """Per layer a zero (B, M, D) XL memory (``None`` when ``mem_len`` = 0); the last layer's
        ``extra`` an empty store of N = ``store_len`` records per row."""
        m, n_layers = self.mem_len, len(blocks)
        layers = [
            LayerState(
                memory=torch.zeros(batch, m, self.d_model, device=device, dtype=dtype) if m else None,
                extra=empty_spalm_store(batch, self.store_len, self.d_model, device, dtype) if i == n_layers - 1 else None,
            )
            for i in range(n_layers)
        ]
        pos, valid, seg = empty_prefix(batch, m, device)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=zeros, next_pos=zeros.clone())

    @staticmethod
    def store(state: BackboneState) -> SpalmStore:
        """The long-term store held in ``state``."""
        return state.layers[-1].extra

    # -- the long-term read --------------------------------------------------------------------
    def allowed(self, rec_valid: Tensor, rec_seg: Tensor, seg_q: Tensor, n_stored: int) -> Tensor:
        """(B, T, P) bool: which pairs each query may read.

        Args:
            rec_valid, rec_seg: (B, N + T) the stored records followed by the segment's.
            seg_q: (B, T) episode id of each query.
            n_stored: N, the stored records (query ``i`` is record ``N + i``).

        Pair ``c`` (P = N + T - 1 of them) is (key of record ``c``, input of record ``c + 1``):
        readable when both records are valid and of the query's episode and the key's age
        ``N + i - c`` in tokens lies in [``min_age``, ``store_len``].
        """
        p = rec_valid.shape[1] - 1
        t = seg_q.shape[1]
        pair = rec_valid[:, :-1] & rec_valid[:, 1:] & (rec_seg[:, :-1] == rec_seg[:, 1:])  # (B, P)
        age = (n_stored + torch.arange(t, device=seg_q.device))[:, None] - torch.arange(p, device=seg_q.device)  # (T, P)
        in_reach = (age >= self.min_age) & (age <= self.store_len)
        return pair[:, None, :] & (rec_seg[:, None, :-1] == seg_q[:, :, None]) & in_reach[None]

    def retrieve(self, h: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Exact k-nearest pairs by squared L2 distance.

        Args:
            h: (B, T, D) queries.
            keys, values: (B, P, D) pair keys and values.
            allowed: (B, T, P) bool (:meth:`allowed`).

        Returns:
            indices (B, T, K') long, ok (B, T, K') bool and the values (B, T, K', D) there,
            K' = min(``knn_k``, P), nearest first.
        """
        k = keys.to(h.dtype)
        # -||h - k||^2 up to the per-query constant ||h||^2: 2 h.k - ||k||^2, ordered as L2
        score = 2 * torch.matmul(h.detach(), k.transpose(1, 2)) - (k * k).sum(-1)[:, None, :]  # (B, T, P)
        _, idx, ok = masked_topk(score, allowed, self.knn_k)
        b, t, kk = idx.shape
        y = values.to(h.dtype).gather(1, idx.reshape(b, t * kk, 1).expand(-1, -1, values.shape[-1]))  # (B, T*K', D)
        return idx, ok, y.view(b, t, kk, values.shape[-1])  # (B, T*K', D) -> (B, T, K', D); B = 0 too

    def read(self, h: Tensor, x: Tensor, valid: Tensor, seg: Tensor, state: BackboneState | None
             ) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """The long-term read of a segment: equations (1)-(3) on every token.

        Args:
            h: (B, T, D) backbone output (after the final norm).
            x: (B, T, D) backbone input of the segment.
            valid: (B, T) bool, False for padding.
            seg: (B, T) long episode id of each token.
            state: the state the segment runs with (None: read the segment's own pairs only).

        Returns:
            z (B, T, D), the segment's records ``(keys, inputs)`` (detached, for
            :meth:`update`), and metrics ``memory/spalm_gate`` (mean g over the valid tokens
            that retrieved something) and ``memory/spalm_hit_rate``.
        """
        new_k, new_x = h.detach(), x.detach()
        store = None if state is None else self.store(state)
        if store is None:
            keys, inputs, rv, rs, n = new_k, new_x, valid, seg, 0
        else:
            keys = torch.cat([store.keys.to(h.dtype), new_k], 1)  # (B, N + T, D)
            inputs = torch.cat([store.inputs.to(h.dtype), new_x], 1)
            rv, rs, n = torch.cat([store.valid, valid], 1), torch.cat([store.seg, seg], 1), store.capacity
        if keys.shape[1] < 2:  # a single record forms no pair
            return h, (new_k, new_x), {}
        allowed = self.allowed(rv, rs, seg, n)
        _, ok, y = self.retrieve(h, keys[:, :-1], inputs[:, 1:], allowed)
        z, g = spalm_combine(h, y, ok, self.gate)
        hit = ok.any(-1) & valid  # (B, T)
        n_hit = hit.sum().clamp_min(1)
        metrics = {
            "memory/spalm_gate": ((g[..., 0] * hit).sum() / n_hit).detach(),
            "memory/spalm_hit_rate": (hit.sum() / valid.sum().clamp_min(1)).detach().float(),
        }
        return z, (new_k, new_x), metrics

    # -- state ---------------------------------------------------------------------------------
    def update(self, state: BackboneState, rec: SegmentRecord):
        """XL FIFO update of every layer's memory (detached, last M slots) and the store's
        (last N records, from ``rec.readout``); returns (state, {}, {})."""
        m, n = self.mem_len, self.store_len
        layers = []
        for ls, hin in zip(state.layers, rec.layer_inputs):
            mem = torch.cat([ls.memory.to(hin.dtype), hin.detach()], 1)[:, -m:] if m else None  # (B, M, D)
            layers.append(LayerState(memory=mem))
        s = self.store(state)
        new_k, new_x = rec.readout
        layers[-1].extra = SpalmStore(
            keys=torch.cat([s.keys, new_k.to(s.keys.dtype)], 1)[:, -n:],  # (B, N, D)
            inputs=torch.cat([s.inputs, new_x.to(s.inputs.dtype)], 1)[:, -n:],
            pos=torch.cat([s.pos, rec.pos], 1)[:, -n:],
            valid=torch.cat([s.valid, rec.valid], 1)[:, -n:],
            seg=torch.cat([s.seg, rec.seg], 1)[:, -n:],
        )
        if m:
            pos = torch.cat([state.pos, rec.pos], 1)[:, -m:]
            valid = torch.cat([state.valid, rec.valid], 1)[:, -m:]
            seg = torch.cat([state.seg, rec.seg], 1)[:, -m:]
        else:
            pos, valid, seg = state.pos, state.valid, state.seg
        return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=state.episode,
                             next_pos=state.next_pos), {}, {}

    def reset(self, state: BackboneState, episode_start: Tensor) -> BackboneState:
        """Clear the rows where ``episode_start`` (B,) is True: XL memory and the store's records
        (invalid, episode id -1, contents zeroed); other rows are untouched.

        Raises:
            ValueError: ``episode_start`` not of shape (B,).
        """
        st = super().reset(state, episode_start)  # zeroes the store's float rows too
        keep = ~episode_start.to(device=state.valid.device, dtype=torch.bool)
        s = st.layers[-1].extra
        st.layers[-1].extra = SpalmStore(
            keys=s.keys, inputs=s.inputs, pos=s.pos * keep[:, None], valid=s.valid & keep[:, None],
            seg=torch.where(keep[:, None], s.seg, torch.full_like(s.seg, -1)),
        )
        return st


@MEMORY.register(
    "spalm",
    description="SPALM: XL short-term memory plus a per-episode kNN long-term store read at the output through a learned gate",
    paper="Yogatama et al. 2021, Adaptive Semiparametric Language Models",
    capabilities=Capabilities(stateful=True, memory=True, exact_chunking=True),
)
@dataclass(frozen=True)
class SpalmMemoryConfig(MemoryConfig):
    """SPALM memory: XL memory in every layer, the long-term store read at the final layer.

    Attributes:
        mem_len: Transformer-XL memory of every layer, in tokens (the short-term memory); 0 = none.
        store_len: N, (key, input) records kept per row: the long-term memory reaches back
            ``store_len`` steps of the episode.
        knn_k: K, nearest neighbours retrieved per query (exact, squared L2).
        min_age: a query reads only keys at least this many steps older than itself; None
            (default): ``mem_len + 1``, what the XL memory no longer holds when acting.
        gate_init: initial gate bias b_g (g = sigmoid(b_g) at start: the local state's weight).

    Raises:
        ValueError: ``mem_len`` < 0, ``store_len`` or ``knn_k`` < 1, ``min_age`` < 1, or an
            age range ``[min_age, store_len]`` that holds no step.
    """

    mem_len: int = 64
    store_len: int = 1024
    knn_k: int = 16
    min_age: int | None = None
    gate_init: float = 0.0

    #: the gate gets a gradient only from tokens that retrieved something.
    contract_no_grad = ("memory.gate.*",)

    def __post_init__(self) -> None:
        if self.mem_len < 0:
            raise ValueError(f"memory.mem_len must be >= 0, got {self.mem_len}")
        if self.store_len < 1 or self.knn_k < 1:
            raise ValueError(f"memory.store_len and memory.knn_k must be >= 1, got {self.store_len}, {self.knn_k}")
        if self.min_age is not None and self.min_age < 1:
            raise ValueError(f"memory.min_age must be >= 1 (a key's value must not lie in the future), got {self.min_age}")
        if self.age_min > self.store_len:
            raise ValueError(
                f"memory.store_len={self.store_len} < memory.min_age={self.age_min}"
                f"{' (mem_len + 1)' if self.min_age is None else ''}: the long-term memory would read nothing; "
                f"raise memory.store_len or lower memory.min_age")

    @property
    def age_min(self) -> int:
        """The minimum key age in use: ``min_age``, or ``mem_len + 1`` when it is None."""
        return self.mem_len + 1 if self.min_age is None else self.min_age

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Small field values for the contract tests with segments of ``seq_len`` tokens."""
        return {"mem_len": max(2, seq_len // 2), "store_len": 2 * seq_len, "knn_k": 4}

    def build(self, ctx) -> MemoryModule:
        cfg = ctx.config
        return SpalmMemory(self.mem_len, self.store_len, self.knn_k, self.age_min, cfg.d_model, self.gate_init)
