"""Policy-level kNN memory: datastore search, kNN-LM interpolation, SPALM gate."""

from __future__ import annotations

import pytest
import torch
from rl_tformers.agents.common.knn_memory import (
    ActionDatastore,
    KNNPolicyMemory,
    Neighbours,
    SpalmGate,
    interpolate_continuous,
    interpolate_discrete,
    knn_distribution,
    neighbour_weights,
)

from rl_tformers.memory._search import faiss_available

BACKENDS = ["torch"] + (["faiss"] if faiss_available() else [])


def _store(n=200, d=8, discrete=True, backend="torch", metric="l2"):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(n, d, generator=g)
    acts = torch.randint(0, 5, (n,), generator=g) if discrete else torch.randn(n, 3, generator=g)
    groups = torch.arange(n) // 10  # episodes of 10 steps
    return ActionDatastore(keys, acts, groups, metric=metric, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_search_is_exact(backend, metric):
    ds = _store(backend=backend, metric=metric)
    q = torch.randn(6, 8)
    nb = ds.search(q, k=7)
    ref = ds.distances(q)  # (6, N), brute force
    top = ref.topk(7, dim=1, largest=False)
    assert torch.equal(nb.index, top.indices)
    torch.testing.assert_close(nb.dist, top.values, atol=1e-4, rtol=1e-5)
    assert nb.valid.all()
    assert torch.equal(nb.actions, ds.actions[top.indices])


def test_torch_search_is_chunked_consistently():
    ds = _store(n=300)
    q = torch.randn(4, 8)
    a, b = ds.search(q, 9, chunk=64), ds.search(q, 9, chunk=4096)
    assert torch.equal(a.index, b.index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exclude_groups_skips_the_queries_episode(backend):
    ds = _store(backend=backend)
    q = ds.keys[[3, 57]] + 1e-3  # contexts from the datastore itself (episodes 0 and 5)
    ex = ds.groups[[3, 57]]
    nb = ds.search(q, k=12, exclude_groups=ex)
    assert nb.valid.all()
    assert (ds.groups[nb.index] != ex[:, None]).all()
    plain = ds.search(q, k=1)
    assert plain.index[:, 0].tolist() == [3, 57]  # without exclusion, itself
    ref = ds.distances(q).masked_fill(ds.groups[None] == ex[:, None], float("inf")).topk(12, largest=False).indices
    assert torch.equal(nb.index, ref)


def test_discrete_interpolation_matches_knn_lm():
    ds = _store()
    q = torch.randn(3, 8)
    nb = ds.search(q, 10)
    logits = torch.randn(3, 5)
    for lam in (0.0, 0.3, 1.0):
        logp = interpolate_discrete(logits, nb, lam, temperature=2.0)
        w = torch.softmax(-nb.dist / 2.0, -1)
        p_knn = torch.zeros(3, 5).scatter_add_(1, nb.actions, w)
        expect = lam * p_knn + (1 - lam) * torch.softmax(logits, -1)
        torch.testing.assert_close(logp.exp(), expect, atol=1e-6, rtol=0)
        torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(knn_distribution(nb, 5, 2.0), p_knn)
    # gradients reach the model's logits for lambda < 1
    lg = logits.clone().requires_grad_(True)
    interpolate_discrete(lg, nb, 0.5)[:, 0].sum().backward()
    assert torch.isfinite(lg.grad).all() and lg.grad.abs().sum() > 0


def test_continuous_interpolation_is_the_mixture_mean():
    ds = _store(discrete=False)
    q = torch.randn(4, 8)
    nb = ds.search(q, 6)
    a = torch.randn(4, 3)
    w = torch.softmax(-nb.dist, -1)
    a_knn = (w[..., None] * nb.actions).sum(1)
    torch.testing.assert_close(interpolate_continuous(a, nb, 0.25), 0.75 * a + 0.25 * a_knn)
    torch.testing.assert_close(interpolate_continuous(a, nb, 0.0), a)
    torch.testing.assert_close(interpolate_continuous(a, nb, 1.0), a_knn)
    with pytest.raises(ValueError, match="lambda"):
        interpolate_continuous(a, nb, 1.5)


def test_rows_without_neighbours_use_the_model():
    nb = Neighbours(
        dist=torch.tensor([[0.1, 0.2], [float("inf"), float("inf")]]),
        index=torch.tensor([[0, 1], [0, 0]]),
        actions=torch.tensor([[1, 1], [0, 0]]),
        valid=torch.tensor([[True, True], [False, False]]),
    )
    logits = torch.randn(2, 3)
    out = interpolate_discrete(logits, nb, 0.5)
    torch.testing.assert_close(out[1], torch.log_softmax(logits[1], -1))
    assert torch.isfinite(out).all()
    assert neighbour_weights(nb)[1].sum() == 0
    out1 = interpolate_discrete(logits, nb, 1.0)
    torch.testing.assert_close(out1[1], torch.log_softmax(logits[1], -1))
    assert out1[0, 1] == 0.0  # all kNN mass on action 1


def test_spalm_gate():
    torch.manual_seed(0)
    ds = _store()
    gate = SpalmGate(8, n_actions=5)
    h = torch.randn(3, 8, requires_grad=True)
    nb = ds.search(h.detach(), 4)
    z, g = gate(h, nb)
    y = gate.embed(nb.actions)  # (3, 4, 8)
    m = (torch.softmax(torch.einsum("bkd,bd->bk", y, h), -1)[..., None] * y).sum(1)
    torch.testing.assert_close(z, (1 - g) * m + g * h)
    torch.testing.assert_close(g, torch.full((3, 1), 0.5))  # sigmoid(0) with zero-initialised w_g
    z.pow(2).sum().backward()
    assert gate.embed.weight.grad.abs().sum() > 0 and gate.gate.bias.grad.abs() > 0
    # gate open to the local state: z = h; no neighbours: z = h
    with torch.no_grad():
        gate.gate.bias.fill_(1e4)
    torch.testing.assert_close(gate(h, nb)[0], h)
    empty = Neighbours(nb.dist, nb.index, nb.actions, torch.zeros_like(nb.valid))
    with torch.no_grad():
        gate.gate.bias.zero_()
    torch.testing.assert_close(gate(h, empty)[0], h)
    cont = SpalmGate(8, action_dim=3)
    z, _ = cont(h, _store(discrete=False).search(h.detach(), 4))
    assert z.shape == (3, 8)
    with pytest.raises(ValueError):
        SpalmGate(8)


def test_policy_memory_api_and_save_load(tmp_path):
    ds = ActionDatastore.build(
        [(torch.randn(50, 8), torch.randint(0, 4, (50,)), torch.zeros(50, dtype=torch.long)) for _ in range(3)]
    )
    assert len(ds) == 150 and ds.discrete
    mem = KNNPolicyMemory(ds, k=5, lam=0.5)
    q = torch.randn(2, 8)
    logp = mem.discrete(q, torch.zeros(2, 4))
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2))
    ds.save(tmp_path / "ds.pt")
    ds2 = ActionDatastore.load(tmp_path / "ds.pt", backend="torch")
    assert torch.equal(ds2.search(q, 5).index, ds.search(q, 5).index)
    with pytest.raises(ValueError, match="agree"):
        ActionDatastore(torch.randn(3, 2), torch.zeros(4), torch.zeros(3))
