"""Policy-level kNN memory: datastore search, kNN-LM interpolation, SPALM gate."""

from __future__ import annotations

import numpy as np
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
from rl_tformers.agents.decision_transformer.agent import DTAgent
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.memory._search import faiss_available
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.threads import one_thread

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


_one_thread = one_thread


TINY = ["backbone.d_model=16", "backbone.n_heads=1", "agent.context_len=5", "train.steps=2", "train.batch_size=4",
        "device=cpu", "eval.every=0", "eval.at_end=false", "agent.targets=[10]", "backbone.dropout=0.0"]


def _agent(path, *extra) -> DTAgent:
    return DTAgent(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY, *extra]), None, "cpu")


def _replay_features(agent: DTAgent, episodes=(0, 1, 2), steps: int = 9) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(query features, stored key of that dataset step) for every decision of the policy replaying
    dataset episodes with their own returns (the datastore holds every step, in dataset order)."""
    mem = agent.inference.knn_memory
    seen = []
    mem.neighbours = lambda f, ex=None: (seen.append(f.detach().clone()), type(mem).neighbours(mem, f, ex))[1]
    pol = agent.policy()
    ds = agent.dataset
    pairs = []
    for i in episodes:
        ep = ds.episode(i)
        state = pol.initial_state(1, float(ep.rewards.sum()))
        for t in range(steps):
            r = None if t == 0 else ep.rewards[t - 1 : t]
            _, state = pol.act(ep.observations[t : t + 1], state, np.array([t == 0]), r)
            pairs.append((seen[-1][0], mem.datastore.keys[int(ds.starts[i]) + t]))
    return pairs


# ------------------------------------- kNN keys on the acting context (agent.eval_context_len)
@pytest.mark.parametrize("align", ["start", "end"])
def test_knn_keys_are_computed_on_the_acting_context_with_eval_context_len(tmp_path, cartpole_h5, align):
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "agent.eval_context_len=2", f"agent.align={align}")
    assert agent.inference.build_knn_memory(lam=1.0, k=1)["entries"] == 30
    for query, key in _replay_features(agent):
        torch.testing.assert_close(query, key, atol=1e-5, rtol=1e-5)


# ------------------------------------------------- kNN keys with the early-exit threshold in use
def test_knn_keys_are_the_exited_features_when_acting_with_early_exit(tmp_path, cartpole_h5):
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "backbone.n_layers=2", "backbone.depth={kind: early_exit, confidence: saturation}",
                   "agent.early_exit.heldout_frac=0")
    info = agent.inference_setup(early_exit=0.0, knn_lambda=1.0, knn_k=1)  # every decision exits at layer 1
    assert info["early_exit"] == {"threshold": 0.0} and info["knn"]["entries"] == 30
    for query, key in _replay_features(agent):
        torch.testing.assert_close(query, key, atol=1e-5, rtol=1e-5)


def test_knn_datastore_built_for_another_threshold_is_refused_not_silently_mismatched(tmp_path, cartpole_h5):
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "backbone.n_layers=2", "backbone.depth={kind: early_exit, confidence: saturation}")
    agent.inference.build_knn_memory(lam=0.5, k=2)  # keys of the full model
    agent.inference.set_exit_threshold(0.0)  # acting would now query with layer-1 features
    with pytest.raises(ValueError, match="build_knn_memory"):
        agent.policy()
    agent.inference.build_knn_memory(lam=0.5, k=2)  # rebuilt for the threshold in use
    agent.policy()


# ------------------------------------ early-exit calibration on the acting context
def test_early_exit_calibration_decides_on_the_acting_context(tmp_path, cartpole_h5):
    path = cartpole_h5(tmp_path / "cp.hdf5", n=60)
    agent = _agent(path, "backbone.n_layers=2", "backbone.depth={kind: early_exit, confidence: saturation}",
                   "agent.eval_context_len=1")
    calls = []
    forward = agent.model.forward_early_exit

    def spy(obs, actions, rtg, timesteps, mask, **kw):
        calls.append((mask.clone(), kw.get("exit_steps")))
        return forward(obs, actions, rtg, timesteps, mask, **kw)

    agent.model.forward_early_exit = spy
    agent.inference.calibrate_early_exit(windows=20, candidates=[0.5])
    assert calls
    for mask, decide in calls:  # only the deciding step itself (eval_context_len=1) is in the context
        assert decide is not None and torch.equal(mask, decide & mask) and bool(mask.any(1).all())


# ------------------------------------ plot evaluates the policy eval evaluates
def test_plot_applies_the_runs_early_exit_threshold_and_knn_options_like_eval(tmp_path, cartpole_h5, monkeypatch):
    import rl_tformers.runtime.evaluation as evaluation

    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    run_dir = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY, "backbone.n_layers=2", "train.progress=false",
                                       "train.warmup_steps=1", "agent.env_kwargs={max_episode_steps: 5}",
                                       "backbone.depth={kind: early_exit, confidence: saturation}",
                                       "agent.early_exit.threshold=0", "agent.knn.lam=0.5", "agent.knn.k=2"]), run_dir)
    policies = []
    real = evaluation.evaluate

    def spy(policy, *args, **kwargs):
        policies.append(policy)
        return real(policy, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    for cmd in (["eval", str(run_dir)], ["plot", str(run_dir), "--out", str(tmp_path / "fig.png"), "--no-tensorboard",
                                         "--targets", "10"]):
        res = CliRunner().invoke(app, [*cmd, "--episodes", "1", "--envs", "1"])
        assert res.exit_code == 0, res.output
    got = [(getattr(p, "policy", p).exit_threshold, getattr(p, "policy", p).knn is not None) for p in policies]
    assert got == [(0.0, True), (0.0, True)]


# ------------------------------------ the datastore API names what is wrong
@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_knn_datastore_refuses_mismatched_queries_and_actions_by_name(backend):
    from rl_tformers.agents.common.knn_memory import ActionDatastore, KNNPolicyMemory

    from rl_tformers.memory._search import faiss_available

    if backend == "faiss" and not faiss_available():
        pytest.skip("faiss is not installed")
    keys, groups = torch.randn(10, 4), torch.arange(10) // 3
    ds = ActionDatastore(keys, torch.randint(0, 3, (10,)), groups, backend=backend)
    for q in (torch.randn(2, 5), torch.randn(4), torch.randn(2, 1, 4)):
        with pytest.raises(ValueError, match=r"queries must be \(B, D\) with D = 4"):
            ds.search(q, 3)
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        ds.search(torch.randn(2, 4), -1)
    assert ds.search(torch.randn(2, 4), 50).valid.sum() == 20  # k above the store: every entry
    with pytest.raises(ValueError, match="not one of the model's 2 actions"):
        KNNPolicyMemory(ds, k=10, lam=0.5).discrete(torch.randn(2, 4), torch.randn(2, 2))
    neg = ActionDatastore(keys, torch.full((10,), -1), groups, backend=backend)
    with pytest.raises(ValueError, match="action -1 is not one of"):
        KNNPolicyMemory(neg, k=2, lam=0.5).discrete(torch.randn(2, 4), torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"continuous actions must be \(N, A\)"):
        ActionDatastore(keys, torch.randn(10), groups, backend=backend)
    with pytest.raises(ValueError, match="lambda must lie in"):
        KNNPolicyMemory(ds, k=2, lam=2.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        KNNPolicyMemory(ds, k=2, lam=0.5, temperature=0.0)
    # a non-finite query is refused (torch would rank NaN distances, faiss return no neighbour)
    q = torch.randn(3, 4)
    q[1, 2] = float("nan")
    with pytest.raises(ValueError, match="query row 1 is not finite"):
        ds.search(q, 2)


# ------------------------------------ a negative exit-classifier weight is refused
def test_early_exit_negative_depth_penalty_is_refused():
    """depth_penalty is a cost per layer; a negative one would reward depth."""
    from rl_tformers.depth.early_exit import EarlyExitConfig

    with pytest.raises(ValueError, match=r"depth.depth_penalty must be >= 0 \(a cost per layer"):
        EarlyExitConfig(depth_penalty=-0.1)
    assert EarlyExitConfig(depth_penalty=0.0).depth_penalty == 0.0


@pytest.mark.parametrize("weight", [-1.0, -1e-3])
def test_early_exit_negative_classifier_weight_is_refused(tmp_path, cartpole_h5, weight):
    from rl_tformers.depth.early_exit import EarlyExitConfig

    with pytest.raises(ValueError, match="depth.classifier_weight must be >= 0"):
        EarlyExitConfig(classifier_weight=weight)
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    res = CliRunner().invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={path}", *TINY,
                                   f"backbone.depth={{kind: early_exit, classifier_weight: {weight}}}",
                                   "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2 and "classifier_weight" in res.output, res.output
    assert EarlyExitConfig(classifier_weight=0.0).classifier_weight == 0.0


# ------------------------------------ evaluations during training use the configured policy
def test_training_evaluation_applies_the_early_exit_threshold_and_knn_options(tmp_path, cartpole_h5, monkeypatch):
    import rl_tformers.agents.decision_transformer.agent as dt_agent

    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "backbone.n_layers=2", "backbone.depth={kind: early_exit, confidence: saturation}",
                   "agent.early_exit.threshold=0", "agent.knn.lam=0.5", "agent.knn.k=2", "eval.episodes=1",
                   "eval.n_envs=1", "agent.env_kwargs={max_episode_steps: 3}", "agent.eval_figure=false")
    seen = []
    real = dt_agent.evaluate

    def spy(policy, *args, **kwargs):
        seen.append((policy.exit_threshold, policy.knn is not None))
        return real(policy, *args, **kwargs)

    monkeypatch.setattr(dt_agent, "evaluate", spy)
    agent.model.train()
    out = agent.evaluate(step=2)
    assert seen == [(0.0, True)] and "eval/return_mean" in out
    # nothing stays behind for training: the model is back in train mode, no datastore is kept
    assert agent.model.training and agent.inference.knn_memory is None and agent.inference.exit_threshold is None


# ------------------------------------ exit statistics count only the evaluated decisions
def test_exit_statistics_do_not_depend_on_the_number_of_environments(tmp_path, cartpole_h5):
    from rl_tformers.runtime.evaluation import evaluate

    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "backbone.n_layers=3", "backbone.depth={kind: early_exit, confidence: saturation}",
                   "agent.env_kwargs={max_episode_steps: 40}")
    mixed = 0
    for thr in (0.9, 0.95, 0.97, 0.98, 0.985, 0.99):
        agent.inference.set_exit_threshold(thr)
        got = []
        for envs in (1, 2, 3):  # 5 episodes of different lengths: idle rows with 2 and 3 envs
            pol = agent.policy()
            rep = evaluate(pol, agent.make_env(), [10.0], episodes=5, n_envs=envs, seed=0)
            st = pol.stats()
            got.append((list(rep.results[0].returns), st["exit_mean_layer"], st["exit_early_frac"]))
        assert got[1][0] == got[0][0] and got[2][0] == got[0][0]  # the same episodes
        if 0 < got[0][2] < 1:
            mixed += 1
        for other in got[1:]:
            assert other[1:] == pytest.approx(got[0][1:], abs=1e-6), (thr, got)
    assert mixed  # some threshold exits some decisions early and not others


# ------------------------------------ a missing training dataset is one error line
@pytest.mark.parametrize("option", [["--knn-lambda", "0.5"], ["--early-exit", "calibrate"]])
def test_knn_or_calibration_without_the_training_dataset_is_an_error_line(tmp_path, cartpole_h5, option):
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    run_dir = tmp_path / "run"
    depth = ["backbone.depth={kind: early_exit, confidence: saturation}"] if "--early-exit" in option else []
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY, "backbone.n_layers=2", "train.progress=false",
                                       "train.warmup_steps=1", "agent.env_kwargs={max_episode_steps: 5}", *depth]),
          run_dir)
    path.unlink()
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--episodes", "1", "--envs", "1", *option])
    assert res.exit_code == 2 and not isinstance(res.exception, OSError), (res.output, res.exception)
    assert "cannot be read now" in res.output and str(path) in res.output


# ---------------------- inference_setup replaces, not accumulates, the earlier call's setup
def test_inference_setup_with_the_defaults_after_options_evaluates_what_the_config_says(tmp_path, cartpole_h5):
    """A second ``inference_setup()`` with the defaults (threshold none, lam 0 in the config)
    replaces the first call's threshold and datastore: the full model, no kNN."""
    path = cartpole_h5(tmp_path / "cp.hdf5", n=30)
    agent = _agent(path, "backbone.n_layers=2", "backbone.depth={kind: early_exit, confidence: saturation}")
    agent.inference_setup(early_exit=0.0, knn_lambda=0.5, knn_k=2)
    assert agent.inference.exit_threshold == 0.0 and agent.inference.knn_memory is not None
    assert agent.inference_setup() == {}
    assert agent.inference.exit_threshold is None and agent.inference.knn_memory is None
    pol = agent.policy()
    assert pol.exit_threshold is None and pol.knn is None


# ---------------------- count_rows for another number of rows is refused, not ignored
def test_count_rows_of_another_batch_size_is_refused(tmp_path, cartpole_h5):
    agent = _agent(cartpole_h5(tmp_path / "cp.hdf5", n=30))
    pol = agent.policy()
    obs = agent.dataset.episode(0).observations[:2]
    state = pol.initial_state(2, 10.0)
    pol.count_rows(np.array([True, False, True]))
    with pytest.raises(ValueError, match="count_rows was given 3 rows but act got 2"):
        pol.act(obs, state, np.array([True, True]), None)
    pol.count_rows(None)
    pol.act(obs, state, np.array([True, True]), None)
    assert pol.stats()["steps"] == 1 and pol.counters.decisions == 2
