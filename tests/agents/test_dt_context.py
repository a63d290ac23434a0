"""The DT's acting context: the ring buffer gives the window that concatenation builds, value for value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rl_tformers.agents.decision_transformer.context import ContextWindow
from rl_tformers.agents.decision_transformer.model import DTConfig

K, OBS, ACT, MAX_EP = 4, 3, 2, 50
MEAN = np.array([0.5, -1.0, 2.0], np.float32)
STD = np.array([2.0, 0.3, 1.5], np.float32)


class ConcatWindow:
    """The reference: each buffer rebuilt every step by concatenation (drop the oldest slot, append
    the new step) in the layout of the module docstring."""

    def __init__(self, n: int, align: str, discrete: bool) -> None:
        self.align, self.discrete = align, discrete
        self.obs = torch.zeros(n, K, OBS)
        self.actions = torch.zeros(n, K, dtype=torch.long) if discrete else torch.zeros(n, K, ACT)
        self.rtg = torch.zeros(n, K)
        self.timesteps = torch.zeros(n, K, dtype=torch.long)
        self.mask = torch.zeros(n, K, dtype=torch.bool)

    def write(self, obs: np.ndarray, rtg: np.ndarray, t: np.ndarray, start: np.ndarray) -> np.ndarray:
        slot = np.minimum(t, K - 1) if self.align == "start" else np.full(len(t), K - 1)
        for name in ("obs", "actions", "rtg", "timesteps", "mask"):
            buf = getattr(self, name)
            for i in range(len(t)):
                row = buf[i]
                if start[i]:
                    row = torch.zeros_like(row)
                elif self.align == "end" or t[i] >= K:  # slide: drop slot 0, append an empty slot
                    row = torch.cat([row[1:], torch.zeros_like(row[:1])])
                buf[i] = row
        for i in range(len(t)):
            j = int(slot[i])
            self.obs[i, j] = (torch.as_tensor(obs[i]) - torch.as_tensor(MEAN)) / torch.as_tensor(STD)
            self.rtg[i, j] = float(np.float32(rtg[i]))
            self.timesteps[i, j] = int(min(t[i], MAX_EP - 1))
            self.mask[i, j] = True
            self.actions[i, j] = 0
        return slot


def _window(align: str, discrete: bool) -> ContextWindow:
    cfg = DTConfig(obs_dim=OBS, act_dim=ACT, discrete=discrete, context_len=K, max_ep_len=MAX_EP,
                   mode="causal" if align == "start" else "last_action")
    return ContextWindow(cfg, align, torch.as_tensor(MEAN), torch.as_tensor(STD), 10.0, "error", torch.device("cpu"))


@pytest.mark.parametrize("discrete", [False, True], ids=["box", "discrete"])
@pytest.mark.parametrize("align", ["start", "end"])
def test_ring_buffer_context_equals_the_concatenated_window_while_filling_and_sliding(align, discrete):
    """Three rows whose episodes start at different steps (so some fill up while others slide),
    over 5K steps: every model input equals the concatenation reference exactly at every step,
    including the actions written after each decision."""
    n = 3
    rng = np.random.default_rng(0)
    win, ref = _window(align, discrete), ConcatWindow(n, align, discrete)
    state = win.empty(n, 7.0)
    starts = {0: [True, True, True], 2: [False, True, False], 9: [True, False, False], 13: [False, False, True]}
    phases = set()
    for step in range(5 * K):
        start = np.array(starts.get(step, [False] * n))
        reward = rng.normal(size=n)
        obs = (rng.normal(size=(n, OBS)) * 3).astype(np.float32)
        t = win.advance(state, start, None if step == 0 else reward)
        rows, slot = win.write(state, obs, start, t)
        ref_slot = ref.write(obs, state.rtg_raw / 10.0, t, start)  # the same step: scaled return-to-go, timestep
        assert slot.tolist() == ref_slot.tolist()
        for name in ("obs", "actions", "rtg", "timesteps", "mask"):
            got, want = getattr(state, name), getattr(ref, name)
            assert got.dtype == want.dtype and torch.equal(got, want), (step, name)
        phases.add("slide" if (t >= K).any() else "fill")
        action = (torch.as_tensor(rng.integers(0, ACT, n)) if discrete
                  else torch.as_tensor(rng.uniform(-1, 1, (n, ACT)), dtype=torch.float32))
        win.write_action(state, rows, slot, action)
        ref.actions[rows, slot] = action
        assert torch.equal(state.actions, ref.actions)
    assert phases == {"fill", "slide"}


def test_observations_are_normalised_as_the_device_would():
    """The new step's row is built on the host: the same float32 values as torch's (obs - mean) / std."""
    win = _window("start", False)
    state = win.empty(64, 1.0)
    obs = (np.random.default_rng(3).normal(size=(64, OBS)) * 40).astype(np.float32)
    t = win.advance(state, np.ones(64, bool), None)
    win.write(state, obs, np.ones(64, bool), t)
    want = (torch.as_tensor(obs) - torch.as_tensor(MEAN)) / torch.as_tensor(STD)
    assert torch.equal(state.obs[:, 0], want)


def test_a_window_of_a_timestep_beyond_float32_exactness_is_refused():
    cfg = DTConfig(obs_dim=OBS, act_dim=ACT, context_len=K, max_ep_len=2**24 + 1)
    with pytest.raises(ValueError, match="agent.max_ep_len=16777217"):
        ContextWindow(cfg, "start", torch.zeros(OBS), torch.ones(OBS), 1.0, "error", torch.device("cpu"))
