"""rl_tformers.envs.environments: one-hot observations, MultiDiscrete actions as one Discrete, POPGym ids."""

from __future__ import annotations

import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from rl_tformers.envs.environments import (
    POPGYM_INSTALL,
    FlatDiscreteAction,
    MissingExtraError,
    OneHotObservation,
    encode_spaces,
    make_task,
)


class _Shown(gym.Env):
    """Shows ``values[t]`` of ``observation_space`` at step t; actions of ``action_space`` are recorded."""

    def __init__(self, observation_space: gym.Space, values: list, action_space: gym.Space | None = None) -> None:
        self.observation_space = observation_space
        self.action_space = action_space or spaces.Discrete(2)
        self.values, self.t, self.taken = values, 0, []

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.values[0], {}

    def step(self, action):
        self.taken.append(action)
        self.t += 1
        return self.values[self.t], 0.0, self.t == len(self.values) - 1, False, {}


def _shown(space: gym.Space, values: list) -> list[np.ndarray]:
    env = OneHotObservation(_Shown(space, values))
    first, _ = env.reset()
    out = [first] + [env.step(0)[0] for _ in values[1:]]
    assert all(o.dtype == np.float32 and env.observation_space.contains(o) for o in out)
    return out


def test_discrete_observations_are_one_hot_from_the_space_start() -> None:
    env = OneHotObservation(_Shown(spaces.Discrete(4, start=1), [1, 3]))
    assert env.observation_space == spaces.Box(0.0, 1.0, (4,), np.float32)
    assert [o.tolist() for o in _shown(spaces.Discrete(4, start=1), [1, 3])] == [[1, 0, 0, 0], [0, 0, 1, 0]]


def test_multidiscrete_observations_are_the_concatenated_one_hots_of_their_components() -> None:
    out = _shown(spaces.MultiDiscrete([2, 3]), [np.array([1, 2]), np.array([0, 0])])
    assert [o.tolist() for o in out] == [[0, 1, 0, 0, 1], [1, 0, 1, 0, 0]]


def test_tuple_observations_concatenate_their_components_one_hot_and_box_values_as_they_are() -> None:
    out = _shown(spaces.Tuple((spaces.Discrete(2), spaces.Discrete(4))), [(1, 2), (0, 3)])
    assert [o.tolist() for o in out] == [[0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]]
    mixed = spaces.Tuple((spaces.Discrete(2), spaces.Box(-1.0, 1.0, (2,), np.float32)))
    out = _shown(mixed, [(0, np.array([0.5, -1.0], np.float32)), (1, np.array([0.25, 1.0], np.float32))])
    assert [o.tolist() for o in out] == [[1, 0, 0.5, -1.0], [0, 1, 0.25, 1.0]]
    assert OneHotObservation(_Shown(mixed, [])).observation_space == spaces.Box(
        np.array([0, 0, -1, -1], np.float32), np.array([1, 1, 1, 1], np.float32), dtype=np.float32)


def test_unflattenable_observations_are_refused_naming_the_space() -> None:
    with pytest.raises(ValueError, match=r"the observation space Sequence\(.*\) cannot be encoded as one vector"):
        OneHotObservation(_Shown(spaces.Sequence(spaces.Discrete(2)), []))


def test_multidiscrete_actions_become_one_discrete_in_c_order_from_the_start() -> None:
    inner = _Shown(spaces.Discrete(2), [0, 0, 0, 0], spaces.MultiDiscrete([8, 8], start=[1, 0]))
    env = FlatDiscreteAction(inner)
    assert env.action_space == spaces.Discrete(64)
    env.reset()
    for k in (0, 10, 63):
        env.step(k)
    assert [a.tolist() for a in inner.taken] == [[1, 0], [2, 2], [8, 7]]


def test_box_observations_and_discrete_actions_are_left_as_they_are() -> None:
    env = gym.make("CartPole-v1")
    assert encode_spaces(env) is env
    assert not isinstance(make_task("CartPole-v1"), (OneHotObservation, FlatDiscreteAction))


def test_popgym_tasks_are_made_with_one_hot_observations_of_their_spaces() -> None:
    pytest.importorskip("popgym")
    auto = make_task("popgym-AutoencodeEasy-v0")  # observes Tuple(Discrete(2), Discrete(4))
    raw = gym.make("popgym-AutoencodeEasy-v0")
    assert raw.observation_space == spaces.Tuple((spaces.Discrete(2), spaces.Discrete(4)))
    assert auto.observation_space == spaces.Box(0.0, 1.0, (6,), np.float32)
    (flag, card), _ = raw.reset(seed=3)
    obs, _ = auto.reset(seed=3)
    assert obs.tolist() == np.concatenate([np.eye(2)[flag], np.eye(4)[card]]).tolist()
    count = make_task("popgym-CountRecallEasy-v0")  # observes MultiDiscrete([2 2])
    assert count.observation_space.shape == (4,) and count.action_space == spaces.Discrete(27)
    ship = make_task("popgym-BattleshipEasy-v0")  # acts in MultiDiscrete([8 8])
    assert ship.action_space == spaces.Discrete(64)


def test_a_popgym_id_without_popgym_installed_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "popgym", None)  # `import popgym` raises ImportError
    with pytest.raises(MissingExtraError) as info:
        make_task("popgym-RepeatPreviousEasy-v0")
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("popgym-RepeatPreviousEasy-v0 is a POPGym task and popgym is not installed: "
                                      f"{POPGYM_INSTALL} (")
    assert "\n" not in str(info.value)
