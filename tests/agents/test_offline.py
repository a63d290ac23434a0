"""The offline agents' shared data summaries (rl_tformers.agents.common.offline)."""

from __future__ import annotations

import numpy as np
import pytest
from rl_tformers.agents.common import offline
from rl_tformers.envs import dataset as dataset_module
from rl_tformers.envs.dataset import EpisodeDataset


@pytest.mark.parametrize("discrete", [False, True])
def test_action_summary_of_a_selection_skips_the_chunks_it_leaves_out(monkeypatch, discrete: bool) -> None:
    """Three episodes of 4 steps scanned in chunks of 4: a selection of the last episode only
    leaves the first two chunks empty; the summary is the last episode's mean action."""
    n = 12
    actions = (np.arange(n) % 3).astype(np.int64) if discrete else np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    terminals = np.zeros(n, bool)
    terminals[[3, 7, 11]] = True
    ds = EpisodeDataset.from_flags(np.zeros((n, 2), np.float32), actions, np.ones(n, np.float32), terminals,
                                   np.zeros(n, bool))
    monkeypatch.setattr(offline, "iter_chunks", lambda arr: dataset_module.iter_chunks(arr, chunk=4))
    last = ds.select(np.array([2]))
    if discrete:  # actions 2, 0, 1, 2: frequencies of actions 0, 1, 2
        np.testing.assert_array_equal(offline.action_summary(last, 3), np.array([0.25, 0.25, 0.5], np.float32))
    else:  # rows 8..11: [16, 17], [18, 19], [20, 21], [22, 23]
        np.testing.assert_array_equal(offline.action_summary(last, 2), np.array([19.0, 20.0], np.float32))
