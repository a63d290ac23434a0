"""Defects found by the ninth breaker pass over the backbone memory kinds (``xl``, ``compressive``,
``knn``) and their use by the GTrXL agent, after ``knn`` got ``retrieval: steps`` and ``min_age``:

1. ``knn`` with ``retrieval: steps`` reads entries of the *same forward pass* by position age
   only, never by token order: when positions within an episode are not increasing (they
   restart without an ``episode_start`` flag, or the caller counts down), a query retrieves
   tokens that come after it in the segment, so a causal backbone's output depends on future
   inputs. Every other part of the stack (local attention, XL memory) is causal by token index.
2. ``knn`` accepts ``min_age > store_size`` with ``retrieval: steps``: the retrievable ages
   ``[min_age, store_size]`` are then empty, so the kNN layer never retrieves anything (its gate
   and scale never train), silently. Easy to hit with the documented recipe
   ``min_age: mem_len + 1`` when ``mem_len >= store_size``.
3. docs/gtrxl.md "Known limits" still described the old ``segments`` rule as current (its test is
   tests/regressions/test_found_by_fresh_user_9.py, found twice).

Every test builds tiny models and data in memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.registry import RegistryError

REPO = Path(__file__).resolve().parents[2]
D, H = 16, 2


def _knn(**mem) -> Backbone:
    cfg = {
        "d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0,
        "attention": {"kind": "sdpa"}, "position": {"kind": "xl_relative"},
        "block": {"kind": "gated", "gate": "gru", "gate_bias": 2.0},
        "memory": {"kind": "knn", "layer": -1, "mem_len": 16, "store_size": 16, "top_k": 4, "search": "torch", **mem},
    }
    torch.manual_seed(1)
    bb = Backbone(cfg).eval().double()
    with torch.no_grad():  # an open gate (0.73), so that retrieval weighs in
        bb.blocks[-1].attn.gate_logit.fill_(1.0)
    return bb


# ------------------------------------------------- 1. same-pass retrieval must stay causal
@pytest.mark.parametrize("positions", [
    [0, 1, 2, 3, 4, 0, 1, 2, 3, 4],  # positions restart (a second episode, no episode_start flag)
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],  # positions counting down
], ids=["restart", "decreasing"])
@pytest.mark.parametrize("search", ["torch", "faiss"])
def test_knn_steps_retrieval_never_reads_later_tokens_of_the_pass(positions, search) -> None:
    """A causal backbone (``causal: true``, the default) must not let token i depend on tokens
    j > i. With ``retrieval: steps`` the kNN layer allows an entry of the same pass when
    ``pos_q - pos >= min_age``, without checking that the entry comes before the query, so here
    earlier outputs change by up to about 0.5 when one later input changes.
    Expected: entries of the current pass are retrievable only from earlier tokens (index order),
    as local attention and the XL memory already are."""
    from rl_tformers.memory._search import faiss_available

    if search == "faiss" and not faiss_available():
        pytest.skip("faiss not installed")
    bb = _knn(search=search)
    t = len(positions)
    pos = torch.tensor([positions])
    torch.manual_seed(0)
    x = torch.randn(1, t, D, dtype=torch.float64)
    with torch.no_grad():
        a = bb(x, pos, state=bb.initial_state(1)).hidden
        leaks = []
        for j in range(1, t):  # change token j only: the outputs of tokens 0..j-1 must not move
            x2 = x.clone()
            x2[:, j] += torch.randn(D, dtype=torch.float64)
            b = bb(x2, pos, state=bb.initial_state(1)).hidden
            leaks.append((a - b)[:, :j].abs().max().item())
    assert max(leaks) < 1e-12, f"earlier outputs changed by up to {max(leaks):.3g} when one later token changed: {leaks}"


# ------------------------------------------------- 2. a retrieval window that is empty by construction
@pytest.mark.parametrize(("store_size", "min_age"), [(8, 9), (16, 17), (64, 65)])
def test_knn_min_age_beyond_the_store_is_refused(store_size: int, min_age: int) -> None:
    """With ``retrieval: steps`` a query reads entries aged in ``[min_age, store_size]``; with
    ``min_age > store_size`` that is empty, so the kNN layer is inert for every input and split
    (hit rate 0 for 40 one-step calls and for one pass of 40: measured), while the config was
    accepted without a word. Expected: refused at construction, naming both options (like
    ``min_age < 1`` is)."""
    with pytest.raises((ValueError, RegistryError, IncompatibleConfig)) as err:
        _knn(store_size=store_size, min_age=min_age, mem_len=4)
    text = str(err.value)
    assert "min_age" in text and "store_size" in text, text
