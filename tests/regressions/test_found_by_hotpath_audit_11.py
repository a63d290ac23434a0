"""Found by the hot-path audit (session 11): memory kind ``knn`` with ``search: auto`` searched
one-token calls (acting one step of N environments) through the faiss path, a Python loop over
B x H flat indexes rebuilt from the store at every call, once the store reached
``faiss_min_store`` entries. Measured on CPU (one thread, H = 4, stores of 65,536-262,144
entries): 3.7-4.9x the time of the batched torch search for the retrieval, 1.5x for a whole
acting step of 32 environments with a full 65,536-entry store. ``auto`` now searches one-token
calls in torch; the neighbours, and so the outputs, are those of the faiss search (up to ties,
none here). Calls of more than one token keep the faiss path under ``auto``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_tformers import Backbone
from rl_tformers.memory._search import faiss_available
from rl_tformers.memory.knn import KNNAugmentedAttention, KNNStore

D, H = 16, 2
pytestmark = pytest.mark.skipif(not faiss_available(), reason="faiss not installed")


def _layer(search: str) -> KNNAugmentedAttention:
    torch.manual_seed(0)
    bb = Backbone({"d_model": D, "n_layers": 1, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0,
                   "memory": {"kind": "knn", "mem_len": 2, "store_size": 8, "top_k": 3, "layer": 0,
                              "search": search, "faiss_min_store": 1}})
    return bb.blocks[0].attn


def _store(b: int = 3, n: int = 40) -> KNNStore:
    g = torch.Generator().manual_seed(1)
    keys = F.normalize(torch.randn(b, H, n, D // H, generator=g), dim=-1)
    valid = torch.rand(b, n, generator=g) > 0.25
    seg = torch.zeros(b, n, dtype=torch.long)
    seg[:, :5] = -1  # an older episode: never retrieved
    return KNNStore(keys, torch.randn(b, H, n, D // H, generator=g), torch.arange(n).expand(b, n).clone(), valid, seg)


def _retrieve(layer: KNNAugmentedAttention, store: KNNStore, t: int):
    g = torch.Generator().manual_seed(2)
    b = store.keys.shape[0]
    q = F.normalize(torch.randn(b, H, t, D // H, generator=g), dim=-1)
    seg_q = torch.zeros(b, t, dtype=torch.long)
    pos_q = torch.full((b, t), store.capacity) + torch.arange(t)
    return layer.retrieve(q, store, seg_q, pos_q, layer.allowed(store, seg_q, pos_q))


def test_auto_searches_one_token_calls_in_torch_with_the_faiss_neighbours(monkeypatch):
    store = _store()
    faiss_out = _retrieve(_layer("faiss"), store, 1)  # the search auto made before the fix
    torch_out = _retrieve(_layer("torch"), store, 1)
    auto = _layer("auto")
    assert auto.use_faiss(store, 1) is False and auto.use_faiss(store, 4) is True
    assert auto.use_faiss(store) is True  # no query count given: the store-size rule, as before

    def no_faiss(*_a, **_k):
        raise AssertionError("auto used the faiss loop for a one-token call")

    monkeypatch.setattr(KNNAugmentedAttention, "_faiss_topk", no_faiss)
    vm, hit, age = _retrieve(auto, store, 1)
    assert torch.equal(vm, torch_out[0]) and torch.equal(hit, torch_out[1]) and torch.equal(age, torch_out[2])
    # the same neighbours as the faiss search: hits and ages bit for bit, the mixed values to rounding
    assert torch.equal(hit, faiss_out[1]) and torch.equal(age, faiss_out[2])
    torch.testing.assert_close(vm, faiss_out[0], rtol=0, atol=1e-6)


def test_auto_keeps_faiss_for_multi_token_calls(monkeypatch):
    store = _store()
    calls = []
    real = KNNAugmentedAttention._faiss_topk

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(KNNAugmentedAttention, "_faiss_topk", counted)
    out = _retrieve(_layer("auto"), store, 4)
    assert calls == [1]
    ref = _retrieve(_layer("torch"), store, 4)
    assert torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)


def test_acting_step_through_the_backbone_equals_the_faiss_search():
    """A whole one-token backbone step with a stored state: auto (torch) vs forced faiss."""
    torch.manual_seed(0)
    bb = Backbone({"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0,
                   "memory": {"kind": "knn", "mem_len": 2, "store_size": 16, "top_k": 3, "layer": 1,
                              "search": "auto", "faiss_min_store": 1}}).eval()
    layer = bb.blocks[1].attn
    with torch.no_grad():
        st = bb(torch.randn(3, 12, D), state=bb.initial_state(3)).state
        x = torch.randn(3, 1, D)
        out_auto = bb(x, state=st)
        layer.search = "faiss"
        out_faiss = bb(x, state=st)
    hit = [float(v) for k, v in out_auto.metrics.items() if k.endswith("knn/hit_rate")]
    assert hit and hit[0] > 0  # the step did retrieve from the store
    torch.testing.assert_close(out_auto.hidden, out_faiss.hidden, rtol=0, atol=1e-6)
    assert torch.equal(bb.memory.store(out_auto.state).keys, bb.memory.store(out_faiss.state).keys)
