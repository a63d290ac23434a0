"""DT inference: RTG bookkeeping equals training, context layout equals training windows, batching,
timestep overflow policy."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig, from_env_action
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.trajectory import ObsStats, dataset_returns_to_go, returns_to_go

from rl_tformers.runtime.evaluation import evaluate

K, LEN = 4, 11
SCALE = 8.0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small per-step forward passes: one intra-op thread is as fast on an idle machine and far
    faster on a busy one (no waiting for a descheduled OpenMP worker)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

class RewardSeqEnv(gym.Env):
    """Episodes of ``length`` steps; reward at step t is (t % 3) + 1 whatever the action (integers)."""

    def __init__(self, length: int = LEN):
        self.length = length
        self.observation_space = spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = spaces.Box(-2.0, 2.0, (2,), np.float32)
        self.t = 0

    def _obs(self):
        return np.array([self.t, np.sin(self.t), self.np_random.uniform()], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        r = float(self.t % 3 + 1)
        self.t += 1
        return self._obs(), r, self.t >= self.length, False, {}


ENV_ID = "RLTformersTest/RewardSeq-v0"
if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=RewardSeqEnv)


def _model(mode="causal", max_ep_len=50):
    bb = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": mode == "causal"}
    cfg = DTConfig(obs_dim=3, act_dim=2, context_len=K, max_ep_len=max_ep_len, mode=mode, embed_dropout=0.0, backbone=bb)
    return DecisionTransformer(cfg).eval()


STATS = ObsStats(np.array([5.0, 0.0, 0.5], np.float32), np.array([3.0, 0.7, 0.3], np.float32))
LOW, HIGH = np.full(2, -2.0, np.float32), np.full(2, 2.0, np.float32)


class Recorder:
    """Wraps a DTPolicy and records the raw obs, actions, rewards and the context it fed the model."""

    def __init__(self, policy):
        self.policy = policy
        self.obs, self.actions, self.rewards, self.rtg_fed, self.ts_fed, self.obs_fed = [], [], [], [], [], []

    def initial_state(self, n, target=None):
        return self.policy.initial_state(n, target)

    def act(self, obs, state, episode_start, last_reward=None):
        if last_reward is not None and not episode_start[0]:
            self.rewards.append(float(last_reward[0]))
        a, state = self.policy.act(obs, state, episode_start, last_reward)
        slot = min(int(state.t[0]), K - 1) if self.policy.align == "start" else K - 1
        self.obs.append(obs[0].copy())
        self.actions.append(a[0].copy())
        real = state.mask[0]
        self.rtg_fed.append(state.rtg[0][real].clone())
        self.ts_fed.append(state.timesteps[0][real].clone())
        self.obs_fed.append(state.obs[0][real].clone())
        assert bool(real[slot])  # the current step sits at the slot the prediction is read from
        return a, state


def _rollout(mode="causal", align=None):
    model = _model(mode)
    pol = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH, align=align)
    rec = Recorder(pol)
    target = float(returns_to_go(np.array([t % 3 + 1 for t in range(LEN)], float))[0])  # the episode's return: 21
    rep = evaluate(rec, lambda: gym.make(ENV_ID), [target], episodes=1, n_envs=1, seed=3, record_rewards=True)
    rec.rewards = rep.results[0].rewards[0]
    ds = EpisodeDataset.from_episodes([{
        "observations": np.concatenate([np.stack(rec.obs), np.zeros((1, 3), np.float32)]),
        "actions": np.stack(rec.actions), "rewards": np.asarray(rec.rewards),
        "terminations": np.eye(1, LEN, LEN - 1, dtype=bool)[0], "truncations": np.zeros(LEN, bool),
    }], action_space=spaces.Box(-2.0, 2.0, (2,), np.float32))
    return model, rec, ds, target


@pytest.mark.parametrize("align", ["start", "end"])
def test_eval_rtg_equals_training_rtg_of_the_same_trajectory(align):
    _, rec, ds, target = _rollout(align=align)
    assert target == 21.0 and sum(rec.rewards) == 21.0
    train_rtg = (dataset_returns_to_go(ds) / SCALE).astype(np.float32)  # what the WindowSampler feeds, (L,)
    for t in range(LEN):
        lo = max(0, t - K + 1)
        fed = rec.rtg_fed[t].numpy()
        assert fed.dtype == np.float32
        np.testing.assert_array_equal(fed, train_rtg[lo: t + 1])  # bit-exact
        np.testing.assert_array_equal(rec.ts_fed[t].numpy(), np.arange(lo, t + 1))
        np.testing.assert_array_equal(rec.obs_fed[t].numpy(), STATS.normalize(np.stack(rec.obs[lo: t + 1])))


@pytest.mark.parametrize(("mode", "align"), [("causal", "start"), ("causal", "end"), ("last_action", "end")])
def test_policy_actions_equal_model_on_training_layout_windows(mode, align):
    """Every action taken equals the model's prediction on the window the sampler would build."""
    model, rec, ds, _ = _rollout(mode, align)
    rtg = torch.as_tensor((dataset_returns_to_go(ds) / SCALE).astype(np.float32))
    obs = torch.as_tensor(STATS.normalize(np.asarray(ds.observations)))
    act = from_env_action(torch.as_tensor(np.asarray(ds.actions)), torch.as_tensor(LOW), torch.as_tensor(HIGH))
    for t in range(LEN):
        if align == "start":  # window [s, s + K) with s = max(0, t - K + 1); predict slot t - s
            s = max(0, t - K + 1)
            idx, pad, slot = torch.arange(s, s + K), 0, t - s
        else:  # align="end": window ends at t, left-padded; predict the last slot
            n = min(t + 1, K)
            idx, pad, slot = torch.arange(t - n + 1, t + 1), K - n, -1
        mask = torch.zeros(1, K, dtype=torch.bool)
        mask[0, pad:] = True
        def put(x, _pad=pad):
            out = torch.zeros((1, K) + x.shape[1:], dtype=x.dtype)
            out[0, _pad:] = x
            return out
        with torch.no_grad():
            out = model(put(obs[idx]), put(act[idx]), put(rtg[idx]), put(idx), mask).action  # (1, P, 2)
        pred = (LOW + (out[0, slot if mode == "causal" else -1].numpy() + 1) * 0.5 * (HIGH - LOW)).astype(np.float32)
        np.testing.assert_allclose(rec.actions[t], pred, atol=1e-5, rtol=0)


def test_one_forward_pass_per_step_for_all_envs():
    model = _model()
    calls = []
    model.register_forward_hook(lambda m, inp, out: calls.append(inp[0].shape[0]))
    pol = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH)
    rep = evaluate(pol, lambda: gym.make(ENV_ID), [21.0, 5.0], episodes=6, n_envs=3, seed=0)
    assert [r.returns for r in rep.results] == [[21.0] * 6] * 2
    # 2 targets x 2 episodes per env x 11 steps, each one call with all 3 envs
    assert calls == [3] * (2 * 2 * LEN)


def test_episode_start_resets_one_row_only():
    model = _model()
    pol = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH)
    st = pol.initial_state(2, 10.0)
    obs = np.ones((2, 3), np.float32)
    for _ in range(6):
        _, st = pol.act(obs, st, np.array([False, False]) if st.t[0] >= 0 else np.array([True, True]), np.array([1.0, 2.0]))
    assert st.t.tolist() == [5, 5] and st.rtg_raw.tolist() == [5.0, 0.0]
    _, st = pol.act(obs, st, np.array([True, False]), np.array([1.0, 2.0]))
    assert st.t.tolist() == [0, 6] and st.rtg_raw.tolist() == [10.0, -2.0]
    assert st.mask[0].tolist() == [True, False, False, False] and st.mask[1].all()
    end = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH, align="end")
    st = end.initial_state(1, 3.0)
    _, st = end.act(obs[:1], st, np.array([True]))
    _, st = end.act(obs[:1], st, np.array([False]), np.array([1.0]))
    assert st.mask[0].tolist() == [False, False, True, True] and st.rtg[0, 2:].tolist() == [3.0 / SCALE, 2.0 / SCALE]
    with pytest.raises(ValueError, match="align='start'"):
        DTPolicy(_model("last_action"), STATS.mean, STATS.std, SCALE, LOW, HIGH, align="start")


def test_timestep_past_max_ep_len_error_and_clamp_policy():
    model = _model(max_ep_len=5)  # the env runs 11 steps
    pol = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH)
    with pytest.raises(ValueError, match=r"episode step 5 >= agent.max_ep_len=5.*timestep_overflow='clamp'"):
        evaluate(pol, lambda: gym.make(ENV_ID), [21.0], episodes=1, n_envs=1)
    clamp = DTPolicy(model, STATS.mean, STATS.std, SCALE, LOW, HIGH, timestep_overflow="clamp")
    seen = []
    model.register_forward_hook(lambda m, inp, out: seen.append(int(inp[3][inp[4]].max())))
    rep = evaluate(clamp, lambda: gym.make(ENV_ID), [21.0], episodes=1, n_envs=1)
    assert rep.results[0].lengths == [LEN]
    assert seen == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 4]  # steps >= 5 reuse the last timestep index 4


def test_act_before_episode_start_is_a_clear_error():
    pol = DTPolicy(_model(), STATS.mean, STATS.std, SCALE, LOW, HIGH)
    st = pol.initial_state(1, 1.0)
    with pytest.raises(ValueError, match="never started"):
        pol.act(np.zeros((1, 3), np.float32), st, np.array([False]))


def test_discrete_actions_cartpole_one_batched_step_per_env_step():
    bb = {"d_model": 16, "n_layers": 1, "n_heads": 1, "dropout": 0.0, "attn_dropout": 0.0}
    model = DecisionTransformer(DTConfig(obs_dim=4, act_dim=2, discrete=True, context_len=K, max_ep_len=500,
                                         embed_dropout=0.0, backbone=bb)).eval()
    pol = DTPolicy(model, np.zeros(4, np.float32), np.ones(4, np.float32), 100.0)
    st = pol.initial_state(3, 200.0)
    assert st.actions.dtype == torch.long and st.actions.shape == (3, K)
    rep = evaluate(pol, lambda: gym.make("CartPole-v1"), [200.0], episodes=3, n_envs=3, seed=0)
    res = rep.results[0]
    assert res.lengths == [int(x) for x in res.returns]  # CartPole: reward 1 per step
    a, st = pol.act(np.zeros((3, 4), np.float32), st, np.ones(3, bool))
    assert a.dtype == np.int64 and set(a.tolist()) <= {0, 1}


@pytest.mark.parametrize("align", ["start", "end"])
@pytest.mark.parametrize("c", [1, 2])
def test_context_steps_act_as_a_model_with_that_context_length(align, c):
    """``context_steps=c`` (``agent.eval_context_len``; Online DT's evaluation context) on a K-step
    model acts exactly as the same weights with K = c: the older steps are masked out. Three
    environments whose episodes start at different steps, over more steps than K."""
    torch.manual_seed(0)
    full = _model()
    short_cfg = DTConfig(**{**full.cfg.__dict__, "context_len": c})
    short = DecisionTransformer(short_cfg).eval()
    short.load_state_dict(full.state_dict())  # no weight depends on K (no slot positions)
    kw = dict(align=align)
    masked = DTPolicy(full, STATS.mean, STATS.std, SCALE, LOW, HIGH, context_steps=c, **kw)
    plain = DTPolicy(short, STATS.mean, STATS.std, SCALE, LOW, HIGH, **kw)
    unmasked = DTPolicy(full, STATS.mean, STATS.std, SCALE, LOW, HIGH, **kw)
    rng = np.random.default_rng(0)
    s1, s2, s3 = (p.initial_state(3, 20.0) for p in (masked, plain, unmasked))
    differs = False
    for step in range(3 * K):
        obs = rng.normal(size=(3, 3)).astype(np.float32)
        start = np.array([step == 0, step in (0, 5), step in (0, 2, 9)])
        rew = None if step == 0 else rng.normal(size=3)
        a1, s1 = masked.act(obs, s1, start, rew)
        a2, s2 = plain.act(obs, s2, start, rew)
        a3, s3 = unmasked.act(obs, s3, start, rew)
        np.testing.assert_allclose(a1, a2, rtol=0, atol=1e-6)
        differs |= not np.allclose(a1, a3, atol=1e-4)
    assert differs  # the older steps did change the full-context actions: the mask is what made them equal


def test_context_steps_out_of_range_is_refused_by_name():
    with pytest.raises(ValueError, match=r"context_steps=5; give an integer in \[1, 4\]"):
        DTPolicy(_model(), STATS.mean, STATS.std, SCALE, LOW, HIGH, context_steps=5)
    from rl_tformers.agents.decision_transformer.config import DTAgentConfig

    with pytest.raises(ValueError, match=r"^agent.eval_context_len must be an integer >= 1 or null, got 0$"):
        DTAgentConfig.from_dict({"eval_context_len": 0}, where="agent")
    with pytest.raises(ValueError, match=r"^agent.eval_context_len must be an integer >= 1 or null, got '5' \(str\)$"):
        DTAgentConfig.from_dict({"eval_context_len": "5"}, where="agent")
    acting = [DTAgentConfig(eval_context_len=n).acting_context for n in (None, 20, 5)]
    assert acting == [None, None, 5]


def test_dt_with_nan_predictions_raises_instead_of_acting(pendulum_dt_run: Path, cartpole_dt_run: Path, monkeypatch) -> None:
    """The backstop behind the up-front check: if the model's output is NaN anyway (here: the
    limit switched off), no action comes out of it, continuous or discrete (argmax of NaN)."""
    import torch
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    from rl_tformers.runtime.evaluation import NonFiniteError, evaluate
    from rl_tformers.runtime.loading import load_run

    monkeypatch.setattr(DTPolicy, "target_limit", lambda self: math.inf)
    for path in (pendulum_dt_run, cartpole_dt_run):
        run = load_run(path, torch.device("cpu"))
        with pytest.raises(NonFiniteError, match=r"not finite \(NaN/inf\) for target return 1e\+30 at episode "
                                                 r"step 0 \(env 0;"):
            evaluate(run.agent.policy(), run.agent.make_env(), [1e30], episodes=1, n_envs=1)


@pytest.mark.parametrize(("env_id", "head", "align", "context_steps"), [
    ("Pendulum-v1", "deterministic", "start", None), ("Pendulum-v1", "deterministic", "start", 2),
    ("Pendulum-v1", "gaussian", "start", None), ("Pendulum-v1", "deterministic", "end", None),
    ("CartPole-v1", "deterministic", "start", None),
])
def test_acting_at_the_deciding_step_only_equals_the_full_forward(env_id, head, align, context_steps):
    """A rollout of 3 environments over 4K steps (filling up, then sliding; rows restarting their
    episodes at different steps, so their deciding steps sit at different slots): the policy with
    ``deciding_step_only``, whose last layer computes one state token per row, takes the actions
    of the default full forward over all K state tokens (continuous within 1e-6, discrete equal;
    a Gaussian head's draws from equally seeded generators)."""
    envs = [gym.make(env_id) for _ in range(3)]
    discrete = isinstance(envs[0].action_space, spaces.Discrete)
    obs_dim = envs[0].observation_space.shape[0]
    bb = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    torch.manual_seed(0)
    model = DecisionTransformer(DTConfig(obs_dim=obs_dim, act_dim=2 if discrete else 1, discrete=discrete,
                                         context_len=K, max_ep_len=50, head=head, embed_dropout=0.0,
                                         backbone=bb)).eval()
    space = envs[0].action_space
    low, high = (None, None) if discrete else (space.low, space.high)
    kw = dict(align=align, context_steps=context_steps, sample=head == "gaussian")
    stats = (np.zeros(obs_dim, np.float32), np.ones(obs_dim, np.float32), 10.0, low, high)
    fast = DTPolicy(model, *stats, generator=torch.Generator().manual_seed(1), deciding_step_only=True, **kw)
    full = DTPolicy(model, *stats, generator=torch.Generator().manual_seed(1), **kw)
    queries = []
    model.backbone.blocks[-1].attn.register_forward_hook(lambda m, a, o: queries.append(a[0].shape[1]))
    s_fast, s_full = fast.initial_state(3, 30.0), full.initial_state(3, 30.0)
    obs = np.stack([e.reset(seed=i)[0] for i, e in enumerate(envs)])
    start, rew, slots = np.ones(3, bool), None, []
    for step in range(4 * K):
        restart = np.array([False, step in (3, 9), step in (6, 7)])  # episodes restarting mid-way
        for i in np.flatnonzero(restart):
            obs[i] = envs[i].reset(seed=10 + step)[0]
        start = start | restart
        queries.clear()
        a_fast, s_fast = fast.act(obs, s_fast, start, rew)
        a_full, s_full = full.act(obs, s_full, start, rew)
        assert queries == [1, K]  # one state token per row, then all K
        slots.append(np.minimum(s_fast.t, K - 1).tolist())  # the rows' slots (align start: the deciding ones)
        if discrete:
            np.testing.assert_array_equal(a_fast, a_full)
        else:
            np.testing.assert_allclose(a_fast, a_full, rtol=0, atol=1e-6)
        steps = [e.step(a) for e, a in zip(envs, a_fast, strict=True)]
        obs = np.stack([s[0] for s in steps]).astype(np.float32)
        rew = np.array([s[1] for s in steps], np.float64)
        start = np.array([s[2] or s[3] for s in steps])
        for i in np.flatnonzero(start):  # an episode that ended restarts
            obs[i] = envs[i].reset(seed=20 + step)[0]
    assert any(len(set(sl)) == 3 for sl in slots)  # three rows at three different slots at once
    assert any(max(sl) == K - 1 and min(sl) < K - 1 for sl in slots)  # one row sliding while another fills up


class AllRowsPolicy(DTPolicy):
    """Runs the model on every row, whether its decision is counted or not."""

    def decide(self, state, rows, slot, counted):
        return super().decide(state, rows, slot, np.ones_like(counted))


@pytest.mark.parametrize(("env_id", "head", "deciding_step_only"), [
    ("Pendulum-v1", "deterministic", False), ("Pendulum-v1", "gaussian", False), ("CartPole-v1", "deterministic", False),
    ("Pendulum-v1", "deterministic", True)])
def test_rows_past_their_quota_are_not_run_and_returns_are_unchanged(env_id, head, deciding_step_only):
    """5 episodes on 3 environments: once an environment is past its quota (its actions are
    discarded) the model runs on the rows of counted episodes only; the episodes, their returns
    and lengths are those of a policy that runs every row, bit for bit (a Gaussian head's draws
    too; within 1e-6 with ``deciding_step_only``)."""
    env = gym.make(env_id)
    discrete = isinstance(env.action_space, spaces.Discrete)
    obs_dim = env.observation_space.shape[0]
    bb = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    torch.manual_seed(0)
    model = DecisionTransformer(DTConfig(obs_dim=obs_dim, act_dim=2 if discrete else 1, discrete=discrete,
                                         context_len=K, max_ep_len=500, head=head, embed_dropout=0.0,
                                         backbone=bb)).eval()
    low, high = (None, None) if discrete else (env.action_space.low, env.action_space.high)
    args = (model, np.zeros(obs_dim, np.float32), np.ones(obs_dim, np.float32), 10.0, low, high)
    kw = dict(sample=head == "gaussian", deciding_step_only=deciding_step_only)
    batch = []
    model.register_forward_hook(lambda m, inp, out: batch.append(inp[0].shape[0]))
    reps = [evaluate(p, lambda: gym.make(env_id), [50.0], episodes=5, n_envs=3, seed=0, record_rewards=True)
            for p in (DTPolicy(*args, **kw), AllRowsPolicy(*args, **kw))]
    live, every = batch[: len(batch) // 2], batch[len(batch) // 2:]
    assert set(every) == {3} and len(live) == len(every) and live[0] == 3 and min(live) < 3
    if env_id == "Pendulum-v1":  # 200-step episodes: env 2 is past its quota for the second 200 steps
        assert live == [3] * 200 + [2] * 200
    (a,), (b,) = (r.results for r in reps)
    assert a.lengths == b.lengths
    if deciding_step_only:  # its GEMMs of few rows round by the number of rows
        for ra, rb in zip(a.rewards, b.rewards, strict=True):
            np.testing.assert_allclose(ra, rb, rtol=1e-6, atol=0)
    else:  # the counted rows' inputs keep the whole batch's layout: the same values, bit for bit
        assert a.returns == b.returns and all(np.array_equal(ra, rb) for ra, rb in zip(a.rewards, b.rewards, strict=True))
