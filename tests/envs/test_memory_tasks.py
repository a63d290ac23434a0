"""Memory tasks (rl_tformers.envs.memory_tasks): argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from rl_tformers.envs.memory_tasks import RecallEnv


# ------------------------------------------------- memory / POMDP task arguments
@pytest.mark.parametrize("kwargs, message", [
    ({"delay": 2.0}, "Recall: delay must be an integer, got 2.0 (float)"),
    ({"delay": True}, "Recall: delay must be an integer, got True (bool)"),
    ({"length": "10"}, "Recall: length must be an integer, got '10' (str)"),
])
def test_recall_refuses_arguments_that_are_not_integers(kwargs, message) -> None:
    """delay=2.0 (a YAML float) built an env that crashed at its first scored step with numpy's
    "only integers ... are valid indices"; delay=True silently meant 1."""
    with pytest.raises(ValueError) as info:
        RecallEnv(**kwargs)
    assert str(info.value) == message
    env = RecallEnv(delay=np.int64(2), n_symbols=3, length=5)  # numpy integers are integers
    env.reset(seed=0)
    assert env.step(0)[1] == 0.0 and env.delay == 2
