"""Non-differentiable external memory for policies: kNN-LM and SPALM carried to actions.

Khandelwal et al. 2020, "Generalization through Memorization: Nearest Neighbor Language
Models" (sec. 2) and Yogatama et al. 2021, "Adaptive Semiparametric Language Models"
(SPALM), with the next token replaced by the next action.

Datastore (:class:`ActionDatastore`): (key, value) = (context embedding ``f(x)``, next action),
built once from the training dataset with the trained policy (``f(x)`` is the policy's hidden
state at the token that predicts the action, e.g. DT's last state token), plus the group
(episode id) of every entry so training-time retrieval can skip the query's own episode. It is a
fixed, agent-side resource (never per-episode state): the policy keeps it as an attribute and
its faiss index is built once.

Search: squared L2 distance ``d(k, q) = ||k - q||^2`` (kNN-LM) or inner product, exact either
way: a faiss flat index when faiss is installed (CPU), a chunked torch matmul otherwise.

kNN-LM interpolation with weight lambda (``p = lambda p_kNN + (1 - lambda) p_model``):

- discrete actions (:func:`interpolate_discrete`): ``p_kNN(a) ∝ sum_i 1[a_i = a] exp(-d_i / T)``
  over the k neighbours, mixed in probability space (returned as log-probabilities);
- continuous actions (:func:`interpolate_continuous`), the documented weighted form: the kNN
  "distribution" is the mixture of Diracs at the neighbours' actions with the same weights
  ``w_i = softmax(-d_i / T)``; for a deterministic policy the action taken is the mean of the
  interpolated distribution, ``(1 - lambda) a_model + lambda sum_i w_i a_i`` (a
  Nadaraya-Watson estimate mixed with the policy's action; for a Gaussian policy it is the mean
  of the mixture ``lambda p_kNN + (1 - lambda) N(a_model, Sigma)``).

SPALM gate (:class:`SpalmGate`): the retrieved actions are embedded (``y_i``, a learned action
embedding: the analogue of SPALM's output word embeddings, trained while the keys stay fixed)
and aggregated with the local hidden state ``h`` as the query, then gated::

    m = sum_i softmax_i(y_i . h) y_i,    g = sigmoid(w_g . h + b_g),    z = (1 - g) m + g h

(Yogatama et al. 2021, sec. 2; :func:`rl_tformers.memory.spalm.spalm_combine`, the combination
the backbone's memory kind ``spalm`` reads with; the neighbour distances are not used, as in the paper). The agent
feeds ``z`` instead of ``h`` to its action head. With no retrievable neighbour, ``z = h``.
When training the gate on the datastore's own dataset, pass the query's episode as
``exclude_groups`` so a context never retrieves itself (its own next action).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.memory._search import faiss_available
from rl_tformers.memory.spalm import spalm_combine

METRICS = ("l2", "ip")
BACKENDS = ("auto", "torch", "faiss")


@dataclass
class Neighbours:
    """Result of :meth:`ActionDatastore.search` for B queries.

    Attributes:
        dist: (B, k) distances (squared L2; for ``ip`` the negated inner product), ascending.
        index: (B, k) long datastore indices.
        actions: (B, k) long or (B, k, A) float actions of the neighbours.
        valid: (B, k) bool, False where fewer than k neighbours were allowed.
    """

    dist: Tensor
    index: Tensor
    actions: Tensor
    valid: Tensor


@dataclass
class ActionDatastore:
    """Keys (context embeddings) and values (next actions) of a training dataset.

    Attributes:
        keys: (N, D) float32 embeddings (CPU).
        actions: (N,) long discrete or (N, A) float continuous actions.
        groups: (N,) long episode id of every entry (for ``exclude_groups``).
        metric: ``l2`` (squared L2 distance, kNN-LM) or ``ip`` (inner product).
        backend: ``auto`` (faiss when installed), ``torch`` or ``faiss``.

    Raises:
        ValueError: an unknown ``metric`` or ``backend``; keys not (N, D) or actions / groups
            whose first axis is not N; continuous actions not (N, A) or discrete ones not (N,).
        ImportError: ``backend='faiss'`` without faiss installed.
    """

    keys: Tensor
    actions: Tensor
    groups: Tensor
    metric: str = "l2"
    backend: str = "auto"
    _index: Any = field(default=None, init=False, repr=False)
    _max_group: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}; choose one of {', '.join(METRICS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.backend == "faiss" and not faiss_available():
            raise ImportError("backend='faiss' needs faiss (pip install faiss-cpu)")
        n = self.keys.shape[0]
        if self.keys.dim() != 2 or self.actions.shape[0] != n or self.groups.shape != (n,):
            raise ValueError(
                f"datastore: keys (N, D), actions (N, ...) and groups (N,) must agree; got "
                f"{tuple(self.keys.shape)}, {tuple(self.actions.shape)}, {tuple(self.groups.shape)}"
            )
        if self.actions.is_floating_point() and self.actions.dim() != 2:
            raise ValueError(
                f"datastore: continuous actions must be (N, A), got {tuple(self.actions.shape)} (one action "
                f"dimension: (N, 1)); discrete actions are (N,) integers"
            )
        if not self.actions.is_floating_point() and self.actions.dim() != 1:
            raise ValueError(f"datastore: discrete actions must be (N,) integers, got {tuple(self.actions.shape)}")
        self.keys = self.keys.detach().float().cpu().contiguous()
        self.actions = self.actions.detach().cpu()
        self.groups = self.groups.detach().long().cpu()
        if n:
            self._max_group = int(torch.unique(self.groups, return_counts=True)[1].max())
        if self.uses_faiss and n:
            import faiss

            dim = self.keys.shape[1]
            self._index = faiss.IndexFlatL2(dim) if self.metric == "l2" else faiss.IndexFlatIP(dim)
            self._index.add(self.keys.numpy())

    @property
    def uses_faiss(self) -> bool:
        """True when searches go through a faiss flat index (``faiss``, or ``auto`` with faiss)."""
        return self.backend == "faiss" or (self.backend == "auto" and faiss_available())

    @property
    def discrete(self) -> bool:
        """True for (N,) integer actions, False for (N, A) float ones."""
        return not self.actions.is_floating_point()

    def __len__(self) -> int:
        return self.keys.shape[0]

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def build(cls, pairs: Iterable[tuple[Tensor, Tensor, Tensor]], metric: str = "l2", backend: str = "auto") -> ActionDatastore:
        """Concatenate ``(keys (n, D), actions (n, ...), groups (n,))`` chunks, e.g. produced by
        running the trained policy over the training dataset under ``torch.no_grad()``.

        Raises:
            ValueError: no chunk given, or as the constructor.
        """
        ks, acts, gs = [], [], []
        for k, a, g in pairs:
            ks.append(k.detach().float().cpu())
            acts.append(a.detach().cpu())
            gs.append(g.detach().long().cpu())
        if not ks:
            raise ValueError("datastore: no (keys, actions, groups) chunks given")
        return cls(torch.cat(ks), torch.cat(acts), torch.cat(gs), metric=metric, backend=backend)

    def save(self, path: str | Path) -> None:
        """Write keys, actions, groups and the metric with ``torch.save`` (not the backend)."""
        torch.save({"keys": self.keys, "actions": self.actions, "groups": self.groups, "metric": self.metric}, path)

    @classmethod
    def load(cls, path: str | Path, backend: str = "auto") -> ActionDatastore:
        """Read a file written by :meth:`save` (``weights_only=True``) with this ``backend``."""
        d = torch.load(path, map_location="cpu", weights_only=True)
        return cls(d["keys"], d["actions"], d["groups"], metric=d["metric"], backend=backend)

    # -- search ------------------------------------------------------------------------------------
    def distances(self, queries: Tensor) -> Tensor:
        """Exact distances of (B, D) queries to every key: (B, N) (``ip``: negated products)."""
        q = queries.detach().float().cpu()
        if self.metric == "ip":
            return -(q @ self.keys.t())
        return (q * q).sum(-1, keepdim=True) - 2 * q @ self.keys.t() + (self.keys * self.keys).sum(-1)[None]

    def search(self, queries: Tensor, k: int, exclude_groups: Tensor | None = None, chunk: int = 4096) -> Neighbours:
        """The k nearest entries of each query.

        Args:
            queries: (B, D) context embeddings.
            k: neighbours.
            exclude_groups: (B,) long; entries of that group are never returned for that
                query (training-time retrieval from the datastore's own dataset).
            chunk: keys per block in the torch path (bounds the (B, chunk) distance matrix).
        Returns:
            :class:`Neighbours` on the queries' device.
        Raises:
            ValueError: queries not (B, D) with the keys' D, a non-finite query, ``k`` not an
                integer >= 0.
        """
        if queries.dim() != 2 or queries.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"datastore search: queries must be (B, D) with D = {self.keys.shape[1]} (the width of the keys), "
                f"got {tuple(queries.shape)}"
            )
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"datastore search: k must be an integer >= 0, got {k!r}")
        bad = ~torch.isfinite(queries).all(-1)  # (B,)
        if bool(bad.any()):  # torch would rank NaN distances, faiss return no neighbour: neither is an answer
            raise ValueError(f"datastore search: query row {int(bad.nonzero()[0])} is not finite (NaN/inf "
                             f"features); the model's features must be finite to retrieve neighbours")
        dev = queries.device
        b = queries.shape[0]
        n = len(self)
        k = min(k, n)
        if k == 0:
            empty = torch.zeros(b, 0, device=dev)
            shape = (b, 0) if self.discrete else (b, 0, self.actions.shape[-1])
            return Neighbours(empty, empty.long(), torch.zeros(shape, dtype=self.actions.dtype, device=dev), empty.bool())
        ex = None if exclude_groups is None else exclude_groups.detach().long().cpu()
        if self._index is not None:
            dist, idx = self._faiss_search(queries, k, ex)
        else:
            dist, idx = self._torch_search(queries, k, ex, chunk)
        valid = idx >= 0
        idx0 = idx.clamp_min(0)
        if ex is not None:
            valid = valid & (self.groups[idx0] != ex[:, None])
        dist = torch.where(valid, dist, torch.full_like(dist, float("inf")))
        return Neighbours(dist.to(dev), idx0.to(dev), self.actions[idx0].to(dev), valid.to(dev))

    def _torch_search(self, queries: Tensor, k: int, ex: Tensor | None, chunk: int) -> tuple[Tensor, Tensor]:
        best_d = best_i = None
        q = queries.detach().float().cpu()
        for s in range(0, len(self), chunk):  # blocks of keys, not tokens: bounded memory
            d = self._block_dist(q, s, chunk)  # (B, <=chunk)
            if ex is not None:
                d = d.masked_fill(self.groups[None, s : s + chunk] == ex[:, None], float("inf"))
            i = torch.arange(s, s + d.shape[1])[None].expand_as(d)
            if best_d is not None:
                d, i = torch.cat([best_d, d], 1), torch.cat([best_i, i], 1)
            kk = min(k, d.shape[1])
            best_d, pos = d.topk(kk, dim=1, largest=False)
            best_i = i.gather(1, pos)
        best_i = torch.where(torch.isinf(best_d), torch.full_like(best_i, -1), best_i)
        return best_d, best_i

    def _block_dist(self, q: Tensor, s: int, chunk: int) -> Tensor:
        keys = self.keys[s : s + chunk]
        if self.metric == "ip":
            return -(q @ keys.t())
        return (q * q).sum(-1, keepdim=True) - 2 * q @ keys.t() + (keys * keys).sum(-1)[None]

    def _faiss_search(self, queries: Tensor, k: int, ex: Tensor | None) -> tuple[Tensor, Tensor]:
        # excluded entries are filtered after the search: ask for enough extra neighbours to
        # still return k (at most one group per query is excluded)
        extra = self._max_group if ex is not None else 0
        kk = min(len(self), k + extra)
        d, i = self._index.search(queries.detach().float().cpu().numpy(), kk)
        d, i = torch.from_numpy(d), torch.from_numpy(i).long()
        if self.metric == "ip":
            d = -d
        if ex is not None:
            bad = (i < 0) | (self.groups[i.clamp_min(0)] == ex[:, None])
            d = d.masked_fill(bad, float("inf"))
            d, pos = d.topk(k, dim=1, largest=False)  # stable enough: ties broken by faiss order
            i = i.gather(1, pos)
        else:
            d, i = d[:, :k], i[:, :k]
        i = torch.where(torch.isinf(d), torch.full_like(i, -1), i)
        return d, i


def neighbour_weights(nb: Neighbours, temperature: float = 1.0) -> Tensor:
    """kNN-LM weights ``softmax_i(-d_i / T)`` over valid neighbours: (B, k); rows without any are 0."""
    logits = (-nb.dist / temperature).masked_fill(~nb.valid, float("-inf"))
    w = torch.softmax(logits.float(), dim=-1)
    return torch.nan_to_num(w, nan=0.0) * nb.valid


def knn_distribution(nb: Neighbours, n_actions: int, temperature: float = 1.0) -> Tensor:
    """p_kNN(a) ∝ sum_i 1[a_i = a] exp(-d_i / T) (Khandelwal et al. 2020, eq. 2): (B, n_actions).

    Raises:
        ValueError: a valid neighbour's action is outside ``[0, n_actions)``.
    """
    w = neighbour_weights(nb, temperature)  # (B, k)
    found = nb.actions[nb.valid]
    if found.numel() and (int(found.min()) < 0 or int(found.max()) >= n_actions):
        bad = int(found.min()) if int(found.min()) < 0 else int(found.max())
        raise ValueError(f"kNN: a neighbour's action {bad} is not one of the model's {n_actions} actions "
                         f"(0..{n_actions - 1}; was the datastore built for another action space?)")
    p = torch.zeros(w.shape[0], n_actions, device=w.device, dtype=w.dtype)
    return p.scatter_add_(1, nb.actions.long().clamp_min(0), w)


def interpolate_discrete(logits: Tensor, nb: Neighbours, lam: float, temperature: float = 1.0) -> Tensor:
    """kNN-LM: ``log(lambda p_kNN + (1 - lambda) p_model)`` for discrete actions.

    Args:
        logits: (B, A) the policy's action logits.
        nb: neighbours of the B contexts.
        lam: lambda in [0, 1]; rows without a valid neighbour use the model alone.
        temperature: T of the distance kernel.
    Returns:
        (B, A) log-probabilities (differentiable w.r.t. ``logits``).
    Raises:
        ValueError: ``lam`` outside [0, 1], or a neighbour action outside the A actions.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must lie in [0, 1], got {lam}")
    logp_model = torch.log_softmax(logits.float(), -1)
    p_knn = knn_distribution(nb, logits.shape[-1], temperature).to(logp_model.device)
    has = nb.valid.any(-1, keepdim=True).to(logp_model.device)  # (B, 1)
    if lam == 1.0:
        return torch.where(has, torch.log(p_knn), logp_model)
    lam_t = has.float() * lam  # rows without neighbours: the model alone
    return torch.logaddexp(torch.log1p(-lam_t) + logp_model, torch.log(lam_t) + torch.log(p_knn))


def interpolate_continuous(action: Tensor, nb: Neighbours, lam: float, temperature: float = 1.0) -> Tensor:
    """Weighted form for continuous actions: ``(1 - lambda) a_model + lambda sum_i w_i a_i``.

    The mean of ``lambda p_kNN + (1 - lambda) p_model`` with ``p_kNN`` the Dirac mixture at the
    neighbours' actions, weights ``w = softmax(-d / T)`` (module docstring).

    Args:
        action: (B, A) the policy's action (or mean action).
        nb: neighbours (actions (B, k, A)).
        lam: lambda in [0, 1]; rows without a valid neighbour keep the model's action.
    Returns:
        (B, A).
    Raises:
        ValueError: ``lam`` outside [0, 1].
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must lie in [0, 1], got {lam}")
    w = neighbour_weights(nb, temperature).to(action.dtype)  # (B, k)
    a_knn = (w[..., None] * nb.actions.to(action.dtype)).sum(1)  # (B, A)
    has = nb.valid.any(-1, keepdim=True)
    return torch.where(has, (1 - lam) * action + lam * a_knn, action)


class SpalmGate(nn.Module):
    """SPALM gate mixing the local hidden state with retrieved actions (Yogatama et al. 2021; equations (1)-(3) of
    :mod:`rl_tformers.memory.spalm`).

    Args:
        d_model: D, width of the hidden state.
        n_actions: number of discrete actions (embedding table), or
        action_dim: width of continuous actions (linear embedding); exactly one of the two.
        gate_init: initial gate bias (g = sigmoid(gate_init) weight on the local state).

    ``forward(h (B, D), nb: Neighbours) -> (z (B, D), g (B, 1))``; rows without a valid
    neighbour get g = 1, so z = h.

    Raises:
        ValueError: both or neither of ``n_actions`` and ``action_dim`` given.
    """

    def __init__(self, d_model: int, n_actions: int | None = None, action_dim: int | None = None, gate_init: float = 0.0) -> None:
        super().__init__()
        if (n_actions is None) == (action_dim is None):
            raise ValueError("SpalmGate: give exactly one of n_actions (discrete) or action_dim (continuous)")
        self.embed = nn.Embedding(n_actions, d_model) if n_actions is not None else nn.Linear(action_dim, d_model)
        self.discrete = n_actions is not None
        self.gate = nn.Linear(d_model, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, gate_init)

    def forward(self, h: Tensor, nb: Neighbours) -> tuple[Tensor, Tensor]:
        acts = nb.actions.long().clamp_min(0) if self.discrete else nb.actions.to(h.dtype)
        y = self.embed(acts.to(h.device))  # (B, k, D) embedded neighbour actions
        return spalm_combine(h, y, nb.valid.to(h.device), self.gate)  # the backbone's SPALM read, eq. (1)-(3)


class KNNPolicyMemory:
    """A datastore and the kNN-LM settings an agent applies at inference.

    Args:
        datastore: the :class:`ActionDatastore`.
        k: neighbours per query.
        lam: interpolation weight lambda.
        temperature: distance temperature T.

    Use::

        mem = KNNPolicyMemory(ActionDatastore.build(pairs), k=16, lam=0.25)
        logp = mem.discrete(embedding, logits)      # (B, A) log-probabilities
        action = mem.continuous(embedding, action)  # (B, A)

    Raises:
        ValueError: ``k`` not an integer >= 1, ``lam`` outside [0, 1], ``temperature`` <= 0.
    """

    def __init__(self, datastore: ActionDatastore, k: int = 16, lam: float = 0.25, temperature: float = 1.0) -> None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lambda must lie in [0, 1], got {lam}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the distance kernel exp(-d / T)), got {temperature}")
        self.datastore, self.k, self.lam, self.temperature = datastore, k, lam, temperature

    def neighbours(self, embedding: Tensor, exclude_groups: Tensor | None = None) -> Neighbours:
        """The ``k`` neighbours of (B, D) embeddings (:meth:`ActionDatastore.search`)."""
        return self.datastore.search(embedding, self.k, exclude_groups)

    def discrete(self, embedding: Tensor, logits: Tensor) -> Tensor:
        """(B, D) embeddings, (B, A) logits -> (B, A) interpolated log-probabilities."""
        return interpolate_discrete(logits, self.neighbours(embedding), self.lam, self.temperature)

    def continuous(self, embedding: Tensor, action: Tensor) -> Tensor:
        """(B, D) embeddings, (B, A) actions -> (B, A) interpolated actions."""
        return interpolate_continuous(action, self.neighbours(embedding), self.lam, self.temperature)


__all__ = [
    "ActionDatastore",
    "KNNPolicyMemory",
    "Neighbours",
    "SpalmGate",
    "interpolate_continuous",
    "interpolate_discrete",
    "knn_distribution",
    "neighbour_weights",
]
