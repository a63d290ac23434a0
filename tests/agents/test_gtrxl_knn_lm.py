"""kNN-LM for GTrXL policies: interpolation on a tiny datastore (exact values), the datastore
built from the offline dataset with the features the policy computes when acting, and the
refusals (IQL, a sampling continuous policy)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from rl_tformers.agents.common.knn_memory import ActionDatastore, KNNPolicyMemory
from rl_tformers.agents.gtrxl.agent import GTrXLAgent, GTrXLPolicy
from rl_tformers.agents.gtrxl.knn_lm import KNNLMPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import train
from tests.threads import one_thread

_one_thread = one_thread  # autouse, module scope: one torch thread

FAST = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=2", "train.progress=false", "train.log_every=2",
        "train.checkpoint_every=4", "device=cpu", "eval.every=0", "eval.at_end=false"]
TINY = ["backbone.d_model=16", "backbone.n_layers=2", "backbone.n_heads=2", "agent.seq_len=8", "agent.burn_in=4",
        "backbone.memory={kind: xl, mem_len: 4}", "dataset.path=null",
        "dataset.scripted={task: recall, episodes: 12, delay: 2}"]


def _policy(discrete: bool, deterministic: bool = True) -> GTrXLPolicy:
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, discrete=discrete,
                                   backbone=gtrxl_backbone(d_model=8, n_layers=1, n_heads=2, mem_len=4)))
    kw = {} if discrete else {"action_low": -np.ones(2), "action_high": np.ones(2)}
    return GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3), deterministic=deterministic, **kw)


OBS = np.array([[0.5, -1.0, 2.0]], dtype=np.float32)


def _first_decision(policy: GTrXLPolicy):
    """The plain policy's first decision on OBS (features, actor output, action)."""
    seen = []

    def record(*args):
        d = policy.decide(*args)
        seen.append(d)
        return d

    policy.step(OBS, policy.initial_state(1), np.array([True]), None, record)
    return seen[0]


def test_continuous_action_is_the_weighted_mix_of_model_and_neighbour():
    plain = _policy(discrete=False)
    d = _first_decision(plain)
    f = d.features  # (1, D): the key of entry 0 is exactly the query, entry 1 lies 2 away (squared L2: 4)
    keys = torch.cat([f, f + torch.tensor([2.0] + [0.0] * (f.shape[1] - 1))])
    store = ActionDatastore(keys, torch.tensor([[0.5, -0.5], [-1.0, 1.0]]), torch.tensor([0, 1]))
    pol = KNNLMPolicy(_policy(discrete=False), KNNPolicyMemory(store, k=2, lam=0.5, temperature=1.0))
    a, _ = pol.act(OBS, pol.initial_state(1), np.array([True]))
    w0, w1 = 1 / (1 + np.exp(-4.0)), np.exp(-4.0) / (1 + np.exp(-4.0))  # softmax(-d / T) of d = 0, 4
    knn = w0 * np.array([0.5, -0.5]) + w1 * np.array([-1.0, 1.0])
    expected = 0.5 * d.out[0].numpy() + 0.5 * knn
    np.testing.assert_allclose(a[0], expected, rtol=0, atol=1e-6)
    assert pol.stats() == {"knn_hit_frac": 1.0}


def test_discrete_action_follows_the_interpolated_probabilities():
    plain = _policy(discrete=True)
    d = _first_decision(plain)
    p_model = torch.softmax(d.out[0], -1)
    other = int(1 - p_model.argmax())  # the action the model does not take
    store = ActionDatastore(d.features.clone(), torch.tensor([other]), torch.tensor([0]))
    # p = lam 1[a = other] + (1 - lam) p_model: the neighbour wins exactly when lam > (p_max - p_other) / (1 + p_max - p_other)
    gap = float(p_model.max() - p_model[other])
    switch = gap / (1 + gap)
    for lam, expected in ((0.0, 1 - other), (switch - 0.01, 1 - other), (switch + 0.01, other), (1.0, other)):
        pol = KNNLMPolicy(_policy(discrete=True), KNNPolicyMemory(store, k=1, lam=max(lam, 0.0)))
        a, _ = pol.act(OBS, pol.initial_state(1), np.array([True]))
        assert a.tolist() == [expected], lam


def test_lambda_zero_gives_the_plain_actions_exactly():
    plain = _policy(discrete=False)
    store = ActionDatastore(torch.randn(5, 8), torch.rand(5, 2) * 2 - 1, torch.arange(5))
    pol = KNNLMPolicy(_policy(discrete=False), KNNPolicyMemory(store, k=3, lam=0.0))
    rng = np.random.default_rng(0)
    s1, s2 = plain.initial_state(2), pol.initial_state(2)
    for i in range(4):
        o = rng.normal(size=(2, 3)).astype(np.float32)
        a1, s1 = plain.act(o, s1, np.full(2, i == 0))
        a2, s2 = pol.act(o, s2, np.full(2, i == 0))
        assert np.array_equal(a1, a2)


def test_a_sampling_continuous_policy_is_refused():
    store = ActionDatastore(torch.randn(2, 8), torch.zeros(2, 2), torch.arange(2))
    with pytest.raises(ValueError, match="agent.deterministic=true"):
        KNNLMPolicy(_policy(discrete=False, deterministic=False), KNNPolicyMemory(store))


def test_the_datastore_keys_are_the_acting_features_and_lambda_one_replays_the_data():
    agent = GTrXLAgent(compose("gtrxl/recall_bc", [*TINY, *FAST]), None, "cpu")
    info = agent.inference.build_knn_memory(lam=1.0, k=1)
    data = agent.dataset
    store = agent.inference.knn_memory.datastore
    assert info["entries"] == len(store) == data.num_steps
    # acting through episode 3's observations: the features queried are the datastore's keys of
    # that episode, and with lam = 1, k = 1 each decision is the dataset's own action
    e = 3
    s, n = int(data.starts[e]), int(data.lengths[e])
    pol = agent.policy()
    seen = []
    inner_decide = pol.inner.decide

    def record(*args):
        d = inner_decide(*args)
        seen.append(d.features)
        return d

    pol.inner.decide = record
    state = pol.initial_state(1)
    actions = []
    for t in range(n):
        a, state = pol.act(data.observations[s + t][None], state, np.array([t == 0]))
        actions.append(int(a[0]))
    keys = store.keys[store.groups == e]
    torch.testing.assert_close(torch.cat(seen), keys, rtol=0, atol=1e-5)
    assert actions == [int(x) for x in data.actions[s : s + n]]


def test_knn_is_refused_for_iql(tmp_path):
    with pytest.raises(ConfigError, match=r"^agent\.knn\.lam=0\.5: the kNN-LM memory interpolates"):
        compose("gtrxl/recall_bc", [*TINY, "agent.objective=iql", "agent.knn.lam=0.5"])
    train(compose("gtrxl/recall_bc", [*TINY, *FAST, "agent.objective=iql"]), tmp_path / "iql")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "iql"), "--episodes", "1", "--knn-lambda", "0.5"])
    assert res.exit_code == 2 and "--knn-lambda with agent.objective=iql" in res.output


def test_eval_with_knn_reports_the_datastore(tmp_path):
    train(compose("gtrxl/recall_bc", [*TINY, *FAST]), tmp_path / "bc")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "bc"), "--episodes", "2", "--envs", "2", "--json",
                                   "--knn-lambda", "0.25", "--knn-k", "4", "--knn-max-entries", "50"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["extra"]["knn"]["entries"] == 50 and out["extra"]["knn"]["k"] == 4
    assert out["extra"]["knn_hit_frac"] == 1.0
