"""The evaluation report's log keys and the evaluation seed (rl_tformers.runtime.evaluation)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from rl_tformers.runtime.evaluation import EvalReport, TargetResult, eval_seed, report_logs
from rl_tformers.runtime.seeding import derive_seed


def test_report_logs_maps_every_scalar_of_every_target_to_one_key() -> None:
    first = TargetResult(target_return=100.0, returns=[1.0, 3.0], lengths=[5, 7], seeds=[0, 1], normalized=[10.0, 30.0])
    second = TargetResult(target_return=50.0, returns=[2.0, 2.0], lengths=[5, 5], seeds=[0, 1])
    logs = report_logs(EvalReport([first, second], episodes=2, n_envs=2))
    assert logs == {
        "eval/return_mean": 2.0, "eval/return_std": 1.0, "eval/normalized_score": 20.0,
        "eval/normalized_score_std": 10.0, "eval/target": 100.0,
        "eval/return_mean_target1": 2.0, "eval/return_std_target1": 0.0, "eval/target_target1": 50.0,
    }
    assert all(type(v) is float for v in logs.values())


def test_report_logs_of_an_unconditioned_target_has_no_target_key() -> None:
    r = TargetResult(target_return=None, returns=[4.0], lengths=[9], seeds=[3])
    assert report_logs(EvalReport([r])) == {"eval/return_mean": 4.0, "eval/return_std": 0.0}


def test_json_and_logs_share_the_scalars_of_summary() -> None:
    r = TargetResult(target_return=None, returns=[1.0, 2.0], lengths=[1, 1], seeds=[0, 1])
    d = r.to_dict()
    assert {k: d[k] for k in r.summary()} == r.summary()
    assert set(d) == {"target_return", "returns", "lengths", "seeds", *r.summary()}


def test_eval_seed_is_the_derived_seed_in_31_bits() -> None:
    assert eval_seed(7, 1000) == derive_seed(7, "eval", 1000) % 2**31
    assert 0 <= eval_seed(2**63, 5) < 2**31
    assert eval_seed(7, 1000) != eval_seed(7, 2000)


class _NaNPolicy:
    """Finite actions for ``good_steps`` steps, then NaN."""

    def __init__(self, good_steps: int) -> None:
        self.good_steps = good_steps

    def initial_state(self, n, target=None):
        return {"t": 0}

    def act(self, obs, state, episode_start, last_reward=None):
        state["t"] += 1
        value = 0.0 if state["t"] <= self.good_steps else float("nan")
        return np.full((len(obs), 1), value, np.float32), state


def test_evaluate_stops_at_a_non_finite_action_without_sending_it(monkeypatch) -> None:
    from rl_tformers.runtime.evaluation import NonFiniteError, evaluate

    sent: list[np.ndarray] = []

    class Spy(gym.Wrapper):
        def step(self, action):
            sent.append(np.asarray(action))
            return self.env.step(action)

    with pytest.raises(NonFiniteError) as info:
        evaluate(_NaNPolicy(3), lambda: Spy(gym.make("Pendulum-v1")), [250.0], episodes=1, n_envs=1, seed=7)
    assert str(info.value) == ("evaluate: the policy returned a non-finite action for target return 250 at step 3 "
                               "of episode 0 (env 0, reset seed 7): [nan]; it was not sent to the environment")
    assert len(sent) == 3 and all(np.isfinite(a).all() for a in sent)


def test_non_finite_eval_targets_refused_by_evaluate() -> None:
    from rl_tformers.runtime.evaluation import evaluate

    with pytest.raises(ValueError, match="finite"):
        evaluate(None, lambda: None, [float("nan")], episodes=1, n_envs=1)


def test_console_line_of_an_evaluation_gives_each_target_return_and_score() -> None:
    from rl_tformers.runtime.evaluation import logs_line

    a = TargetResult(target_return=3600.0, returns=[1000.0, 1100.0], lengths=[5, 5], seeds=[0, 1],
                     normalized=[30.0, 32.0])
    b = TargetResult(target_return=1800.0, returns=[900.0, 900.0], lengths=[5, 5], seeds=[0, 1],
                     normalized=[27.0, 27.0])
    logs = {**report_logs(EvalReport([a, b], env_id="Hopper-v5", episodes=2, n_envs=2, seed=0)), "eval/time_s": 4.25}
    assert logs_line(1000, logs) == ("eval at step 1000: target 3600: return 1050.0 +- 50.0, normalised score 31.0; "
                                     "target 1800: return 900.0 +- 0.0, normalised score 27.0 (4.2 s)")
    plain = report_logs(EvalReport([TargetResult(target_return=None, returns=[7.0], lengths=[7], seeds=[0])],
                                   env_id="CartPole-v1", episodes=1, n_envs=1, seed=0))
    assert logs_line(5, plain) == "eval at step 5: return 7.0 +- 0.0"
    assert logs_line(3, {"eval/mse": 0.0123, "eval/time_s": 0.5}) == "eval at step 3: mse=0.0123 (0.5 s)"
