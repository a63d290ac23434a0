"""The DT's kNN-LM acting wrapper (KNNLMPolicy): the interpolation of the plain decision with its neighbours."""

from __future__ import annotations

import numpy as np
import torch
from rl_tformers.agents.common.knn_memory import ActionDatastore, KNNPolicyMemory
from rl_tformers.agents.decision_transformer.early_exit import EarlyExitPolicy
from rl_tformers.agents.decision_transformer.knn_lm import KNNLMPolicy
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy

from rl_tformers.backbone_config import BackboneConfig
from tests.threads import one_thread as _one_thread  # noqa: F401 - autouse: one torch thread

LOW, HIGH = np.array([-2.0, 0.0], np.float32), np.array([2.0, 0.5], np.float32)
D = 16


def _model(discrete: bool = False, depth: dict | None = None) -> DecisionTransformer:
    torch.manual_seed(0)
    bb = {"d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    if depth is not None:
        bb["depth"] = depth
    return DecisionTransformer(DTConfig(obs_dim=3, act_dim=3 if discrete else 2, discrete=discrete, context_len=4,
                                       max_ep_len=50, backbone=BackboneConfig.from_dict(bb)))


def _plain(model: DecisionTransformer) -> DTPolicy:
    return DTPolicy(model, np.zeros(3), np.ones(3), 10.0, LOW, HIGH, default_target=5.0)


def _memory(actions: torch.Tensor, lam: float, n: int = 8, k: int = 1) -> KNNPolicyMemory:
    keys = torch.randn(n, D, generator=torch.Generator().manual_seed(2))
    return KNNPolicyMemory(ActionDatastore(keys, actions, torch.arange(n)), k=k, lam=lam)


def _decisions(policy, steps: int = 5, n: int = 3) -> list[torch.Tensor]:
    """The model-unit actions ``policy`` wrote into its context at each step (seeded observations)."""
    obs = np.random.default_rng(1).normal(size=(steps, n, 3)).astype(np.float32)
    state = policy.initial_state(n)
    out = []
    for t in range(steps):
        _, state = policy.act(obs[t], state, np.full(n, t == 0), None if t == 0 else np.ones(n))
        out.append(state.actions[:, min(t, 3)].clone())
    return out


def test_knn_lm_with_weight_zero_acts_like_the_wrapped_policy_and_counts_its_hits():
    model = _model()
    wrapped = KNNLMPolicy(_plain(model), _memory(torch.rand(8, 2) * 2 - 1, lam=0.0))
    for a, b in zip(_decisions(wrapped), _decisions(_plain(model))):
        assert torch.equal(a, b)
    st = wrapped.stats()
    assert list(st) == ["steps", "forward_ms_per_step", "knn_hit_frac"] and st["knn_hit_frac"] == 1.0


def test_knn_lm_interpolates_a_continuous_action_with_its_one_neighbour():
    """k = 1: the neighbour's weight is 1, so the action is (1 - lam) a_model + lam a_neighbour."""
    base = _plain(_model())
    plain = []  # the plain policy's decision of every step, on the context the wrapper wrote
    decide = base.decide

    def spy(*args):
        d = decide(*args)
        plain.append(d.action.clone())
        return d

    base.decide = spy
    got = _decisions(KNNLMPolicy(base, _memory(torch.full((8, 2), 0.5), lam=0.25)))  # every neighbour: 0.5
    assert len(got) == len(plain) == 5
    for a, p in zip(got, plain):
        torch.testing.assert_close(a, 0.75 * p + 0.25 * 0.5, rtol=0, atol=1e-6)


def test_knn_lm_with_weight_one_takes_the_neighbours_discrete_action():
    model = _model(discrete=True)
    wrapped = KNNLMPolicy(_plain(model), _memory(torch.full((8,), 2), lam=1.0))
    assert all(torch.equal(a, torch.full((3,), 2)) for a in _decisions(wrapped))
    obs = np.zeros((3, 3), np.float32)
    env_a, _ = wrapped.act(obs, wrapped.initial_state(3), np.ones(3, bool))
    assert env_a.tolist() == [2, 2, 2] and env_a.dtype == np.int64


def test_knn_lm_over_early_exit_reports_both_and_counts_only_the_counted_rows():
    model = _model(depth={"kind": "early_exit", "confidence": "saturation"})
    base = _plain(model)
    mem = _memory(torch.zeros(8, 2), lam=0.5)
    wrapped = KNNLMPolicy(EarlyExitPolicy(base, 0.0), mem)
    assert wrapped.base is base and wrapped.exit_threshold == 0.0 and wrapped.knn is mem
    wrapped.count_rows(np.array([True, False, True]))
    _decisions(wrapped, steps=2)
    st = wrapped.stats()
    assert list(st) == ["steps", "forward_ms_per_step", "exit_mean_layer", "exit_early_frac", "knn_hit_frac"]
    assert (st["steps"], st["exit_mean_layer"], st["knn_hit_frac"]) == (2, 1.0, 1.0)
    assert wrapped.decisions == 4 and wrapped.hits == 4
    wrapped.reset_stats()
    assert wrapped.stats() == {"steps": 0} and wrapped.hits == 0


def test_knn_lm_queries_with_the_feature_the_head_read():
    model = _model()
    seen = []
    mem = _memory(torch.zeros(8, 2), lam=0.5)
    real = mem.neighbours

    def spy(features, exclude_groups=None):
        seen.append(features.clone())
        return real(features, exclude_groups)

    mem.neighbours = spy
    base = _plain(model)
    state = base.initial_state(2)
    KNNLMPolicy(base, mem).act(np.ones((2, 3), np.float32), state, np.ones(2, bool))
    out = model(state.obs, state.actions, state.rtg, state.timesteps, state.mask)
    assert len(seen) == 1 and torch.equal(seen[0], out.features[:, 0])  # step 0 decides at slot 0
