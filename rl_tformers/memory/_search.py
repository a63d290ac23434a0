"""Nearest-neighbour search shared by the kNN memories: exact torch top-k and faiss.

Exact search is a masked matmul + ``topk`` (batched, any device, differentiable through the
returned scores). faiss (``faiss-cpu``, optional dependency) is an exact flat index on CPU;
its results are indices only (no autograd), the caller re-scores the neighbours in torch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor


@functools.lru_cache(maxsize=1)
def faiss_available() -> bool:
    """True when ``import faiss`` works (the ``faiss`` extra: ``pip install faiss-cpu``)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def masked_topk(scores: Tensor, allowed: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k of ``scores`` along the last axis among the ``allowed`` entries.

    Args:
        scores: (..., N) similarity (higher = closer).
        allowed: bool broadcastable to ``scores`` (True = may be returned), or None.
        k: neighbours wanted; ``min(k, N)`` are returned.
    Returns:
        values (..., k'), indices (..., k') long, ok (..., k') bool: False where fewer than k'
        entries were allowed (those slots hold arbitrary indices and must be ignored).
    """
    k = min(k, scores.shape[-1])
    if allowed is not None:
        allowed = allowed.expand_as(scores)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    vals, idx = scores.topk(k, dim=-1)
    ok = torch.ones_like(idx, dtype=torch.bool) if allowed is None else allowed.gather(-1, idx)
    return vals, idx, ok


def faiss_search(db: Tensor, queries: Tensor, k: int, metric: str = "ip") -> tuple[Tensor, Tensor]:
    """Exact k-NN with a faiss flat index built on the fly.

    Args:
        db: (N, Dk) database vectors (any float dtype; searched in float32 on CPU).
        queries: (Q, Dk).
        k: neighbours wanted (``min(k, N)`` returned).
        metric: ``ip`` (inner product, higher = closer) or ``l2`` (squared L2, lower = closer).
    Returns:
        distances (Q, k') float32 and indices (Q, k') long on the queries' device; index -1
        where faiss found no neighbour.
    Raises:
        ImportError: faiss is not installed.
    """
    import faiss

    k = min(k, db.shape[0])
    dev = queries.device
    if k == 0:
        return torch.zeros(queries.shape[0], 0, device=dev), torch.zeros(queries.shape[0], 0, dtype=torch.long, device=dev)
    xb = np.ascontiguousarray(db.detach().float().cpu().numpy())
    xq = np.ascontiguousarray(queries.detach().float().cpu().numpy())
    index = faiss.IndexFlatIP(xb.shape[1]) if metric == "ip" else faiss.IndexFlatL2(xb.shape[1])
    index.add(xb)
    dist, idx = index.search(xq, k)
    return torch.from_numpy(dist).to(dev), torch.from_numpy(idx).long().to(dev)
