"""Shared helpers of the decoding tests (tests/memory/test_bounded_cache.py, test_linear_cache.py):
feed a token stream to a backbone in chunks with the returned state."""

from __future__ import annotations

import torch


def chunks(n: int) -> list[tuple[int, int]]:
    """Steps of 1, 1, 2, 1, 3 tokens, repeated: [0,1) [1,2) [2,4) [4,5) [5,8) [8,9) [9,10) [10,12) ..."""
    out, t, sizes, i = [], 0, (1, 1, 2, 1, 3), 0
    while t < n:
        e = min(n, t + sizes[i % len(sizes)])
        out.append((t, e))
        t, i = e, i + 1
    return out


def run_with_reset(bb, x: torch.Tensor, steps, reset_at: int, rows: torch.Tensor):
    """Feed ``x`` (B, n, D) in ``steps`` ((start, end) pairs), resetting ``rows`` (B,) bool before
    token ``reset_at``; returns the outputs (B, n, D) and the last state."""
    st = bb.initial_state(x.shape[0])
    outs = []
    for t, e in steps:
        if t == reset_at:
            st = bb.reset_state(st, rows)
        o = bb(x[:, t:e], state=st)
        st = o.state
        outs.append(o.hidden)
    return torch.cat(outs, 1), st


def feed(bb, x: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, steps):
    """Feed ``x`` (B, n, D) with its key mask and episode starts (B, n) in ``steps``, from a fresh
    state; yields ``(end, output)`` after each step (``output.state`` is the state so far)."""
    st = bb.initial_state(x.shape[0])
    for t, e in steps:
        o = bb(x[:, t:e], mask=mask[:, t:e], episode_start=starts[:, t:e], state=st)
        st = o.state
        yield e, o
