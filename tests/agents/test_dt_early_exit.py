"""The DT's early-exit acting wrapper (EarlyExitPolicy): what it changes and what it leaves to the plain policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rl_tformers.agents.common.knn_memory import ActionDatastore, KNNPolicyMemory
from rl_tformers.agents.decision_transformer.early_exit import EarlyExitPolicy
from rl_tformers.agents.decision_transformer.knn_lm import KNNLMPolicy
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy

from rl_tformers.backbone_config import BackboneConfig
from tests.threads import one_thread as _one_thread  # noqa: F401 - autouse: one torch thread

LOW, HIGH = np.array([-2.0, 0.0], np.float32), np.array([2.0, 0.5], np.float32)
N_LAYERS = 3


def _model(depth: dict | None = None, seed: int = 0) -> DecisionTransformer:
    torch.manual_seed(seed)
    bb = {"d_model": 16, "n_layers": N_LAYERS, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    if depth is not None:
        bb["depth"] = depth
    return DecisionTransformer(DTConfig(obs_dim=3, act_dim=2, context_len=4, max_ep_len=50,
                                       backbone=BackboneConfig.from_dict(bb)))


def _plain(model: DecisionTransformer) -> DTPolicy:
    return DTPolicy(model, np.zeros(3), np.ones(3), 10.0, LOW, HIGH, default_target=5.0)


def _rollout(policy, steps: int = 7, n: int = 3) -> np.ndarray:
    """Actions (steps, n, 2) of ``policy`` on seeded observations; row 1 restarts at step 4."""
    obs = np.random.default_rng(1).normal(size=(steps, n, 3)).astype(np.float32)
    state = policy.initial_state(n)
    out = []
    for t in range(steps):
        start = np.array([t == 0, t in (0, 4), t == 0])
        a, state = policy.act(obs[t], state, start, None if t == 0 else np.ones(n))
        out.append(a)
    return np.stack(out)


SATURATION = {"kind": "early_exit", "confidence": "saturation"}


def test_early_exit_at_an_infinite_threshold_acts_like_the_plain_policy_and_runs_every_layer():
    model = _model(SATURATION)
    plain = _rollout(_plain(model))
    wrapped = EarlyExitPolicy(_plain(model), float("inf"))
    assert np.array_equal(_rollout(wrapped), plain)
    st = wrapped.stats()
    assert list(st) == ["steps", "forward_ms_per_step", "exit_mean_layer", "exit_early_frac"]
    assert st["steps"] == 7 and st["exit_mean_layer"] == float(N_LAYERS) and st["exit_early_frac"] == 0.0


def test_early_exit_at_threshold_zero_decides_every_counted_step_after_the_first_layer():
    model = _model(SATURATION)
    wrapped = EarlyExitPolicy(_plain(model), 0.0)
    early = _rollout(wrapped)
    st = wrapped.stats()
    assert st["exit_mean_layer"] == 1.0 and st["exit_early_frac"] == 1.0
    assert not np.array_equal(early, _rollout(_plain(model)))  # layer 1's action is not the full model's


def test_early_exit_counts_only_the_counted_rows_and_reset_stats_clears_its_counters():
    wrapped = EarlyExitPolicy(_plain(_model(SATURATION)), 0.0)
    wrapped.count_rows(np.array([True, False, True]))  # the plain policy's count_rows, through the wrapper
    _rollout(wrapped, steps=2)
    assert wrapped.decisions == 4 and wrapped.base.counters.decisions == 4
    wrapped.reset_stats()
    assert wrapped.stats() == {"steps": 0} and wrapped.decisions == 0


def test_early_exit_wrapper_hands_the_rest_of_the_protocol_to_the_plain_policy():
    base = _plain(_model(SATURATION))
    wrapped = EarlyExitPolicy(base, 0.5)
    assert wrapped.base is base and wrapped.inner is base
    assert wrapped.exit_threshold == 0.5 and wrapped.knn is None and base.exit_threshold is None
    assert wrapped.target_limit() == base.target_limit() and wrapped.default_target == 5.0
    with pytest.raises(ValueError, match="target return: 1e"):
        wrapped.check_targets([1e30])


def test_early_exit_wrapper_refuses_a_model_without_early_exit_and_a_wrapped_policy():
    with pytest.raises(ValueError, match="needs backbone.depth.kind=early_exit"):
        EarlyExitPolicy(_plain(_model()), 0.5)
    model = _model(SATURATION)
    store = ActionDatastore(torch.randn(4, 16), torch.zeros(4, 2), torch.arange(4))
    knn = KNNLMPolicy(_plain(model), KNNPolicyMemory(store, k=1, lam=0.5))
    with pytest.raises(TypeError, match="EarlyExitPolicy wraps a DTPolicy"):
        EarlyExitPolicy(knn, 0.5)
