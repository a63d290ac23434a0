"""Observation masks (rl_tformers.envs.pomdp): argument checks."""

from __future__ import annotations

import gymnasium as gym
import pytest
from rl_tformers.envs.pomdp import ObservationMaskWrapper


@pytest.mark.parametrize("indices, message", [
    ([False, True, True], "got a boolean mask [False, True, True]"),
    ([0.5, 2], "observation indices must be integers, got [0.5, 2.0]"),
])
def test_observation_mask_refuses_boolean_masks_and_fractional_indices(indices, message) -> None:
    """Boolean masks and fractional indices are refused: [False, True, True] would read as indices
    [0, 1, 1] and [True, False] as [1, 0] (every entry kept, reordered), 0.5 as index 0."""
    env = gym.make("CartPole-v1")
    with pytest.raises(ValueError) as info:
        ObservationMaskWrapper(env, indices)
    assert message in str(info.value)
    assert ObservationMaskWrapper(env, [2.0, 0]).indices.tolist() == [2, 0]  # whole floats are indices
