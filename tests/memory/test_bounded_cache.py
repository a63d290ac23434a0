"""Memory kind ``none`` with a bounded incremental cache keeps O(window) key bookkeeping.

Kernels whose cache holds only the last w keys (``attn.cache_keeps()`` an int: local, local_2d,
sliding_window, adaptive_span) let the state drop the pos/valid/seg slots no layer reads any
more (``state.key_offset`` counts them), so a decoding step costs O(w), not O(steps so far).
Decoding stays exact: token by token equals one full pass, across padding, episode boundaries
and ``reset_state``; dense caches keep every slot.
"""

from __future__ import annotations

import io

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.memory import none as none_memory
from rl_tformers.memory.none import keys_kept
from tests.memory.decoding import chunks, feed, run_with_reset

D, H, B = 16, 2, 2
TOL = {"atol": 1e-10, "rtol": 1e-10}

# kind config -> the bound on the state's slots (the largest lookback over the 2 layers)
BOUNDED = {
    "local": ({"kind": "local", "block": 4, "memory": 3}, 4 - 1 + 3),
    "local_2d": ({"kind": "local_2d", "width": 4, "query_shape": (2, 2), "flange": (1, 1)}, (2 - 1 + 1) * 4 + 2 - 1 + 1),
    # per-layer windows, one dilated head: layer 0 keeps (3 - 1) * 1, layer 1 (5 - 1) * 2 keys
    "sliding_window": ({"kind": "sliding_window", "window": (3, 5), "dilation": (1, 2), "dilated_heads": 1}, 8),
    "adaptive_span": ({"kind": "adaptive_span", "max_span": 8, "ramp": 2, "init": 0.5}, 8 - 1),
    # factorised kinds whose every head is A1 only: a band of [0, stride], a block of stride
    "strided_a1": ({"kind": "strided", "stride": 3, "mode": "heads", "head_patterns": ("a1", "a1")}, 3),
    "fixed_a1": ({"kind": "fixed", "stride": 4, "summary": 1, "mode": "heads", "head_patterns": ("a1", "a1")}, 4 - 1),
}
# patterns invariant under a shift of the key indices (no block alignment)
SHIFT_INVARIANT = ("sliding_window", "adaptive_span", "strided_a1")


def _backbone(attention: dict) -> Backbone:
    torch.manual_seed(0)
    cfg = {"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "max_position": 256,
           "attention": attention, "position": {"kind": "alibi"}, "memory": {"kind": "none"}}
    return Backbone(cfg).eval().to(torch.float64)


def _inputs(n: int, seed: int = 0):
    """x (B, n, D) float64, mask (B, n) with padding, episode_start (B, n) with a late boundary."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[0, n // 2 : n // 2 + 2] = False  # padding in the middle, long after the first trim
    starts = torch.zeros(B, n, dtype=torch.bool)
    starts[1, n - 7] = True  # a new episode inside the stream, after several trims
    return x, mask, starts


@pytest.mark.parametrize("kind", sorted(BOUNDED))
def test_bounded_cache_keeps_window_slots_and_equals_the_full_pass(kind):
    attention, bound = BOUNDED[kind]
    bb = _backbone(attention)
    assert keys_kept(bb.blocks) == bound
    n = 3 * bound + 5
    x, mask, starts = _inputs(n)
    with torch.no_grad():
        full = bb(x, mask=mask, episode_start=starts).hidden  # (B, n, D)
        outs = []
        for e, o in feed(bb, x, mask, starts, chunks(n)):
            st = o.state
            outs.append(o.hidden)
            kept = min(e, bound)
            assert st.pos.shape == st.valid.shape == st.seg.shape == (B, kept)
            assert st.key_offset == e - kept
            for blk, ls in zip(bb.blocks, st.layers, strict=True):
                assert ls.cache.k.shape[2] == min(e, blk.attn.lookback())
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    assert st.key_offset == n - bound > 2 * bound  # trimmed many times over


@pytest.mark.parametrize("kind", sorted(BOUNDED))
def test_reset_state_masks_correctly_across_the_trim(kind, monkeypatch):
    attention, bound = BOUNDED[kind]
    bb = _backbone(attention)
    n = 4 * bound + 3
    x, _, _ = _inputs(n, seed=1)
    steps = [(t, t + 1) for t in range(n)]
    reset_at = 2 * bound + 1  # the state has been trimmed for a while
    rows = torch.tensor([False, True])
    with torch.no_grad():
        got, st = run_with_reset(bb, x, steps, reset_at, rows)
        assert st.pos.shape == (B, bound) and st.key_offset == n - bound
        # the same calls with untrimmed bookkeeping (the behaviour before the trim existed)
        monkeypatch.setattr(none_memory, "keys_kept", lambda blocks: None)
        want, st_full = run_with_reset(bb, x, steps, reset_at, rows)
        monkeypatch.undo()
        assert st_full.pos.shape == (B, n) and st_full.key_offset == 0
        torch.testing.assert_close(got, want, **TOL)
        # row 0 never reset: as one full pass
        torch.testing.assert_close(got[0], bb(x[:1]).hidden[0], **TOL)
        # the reset row sees nothing from before the reset: a pattern on key distances only
        # equals a fresh stream fed the tokens since (block-aligned patterns keep the old index
        # grid, documented in attention/local.py)
        if kind in SHIFT_INVARIANT:
            fresh = bb(x[1:, reset_at:]).hidden[0]
            torch.testing.assert_close(got[1, reset_at:], fresh, **TOL)


@pytest.mark.parametrize("attention", [{"kind": "sdpa"}, {"kind": "strided", "stride": 3}],
                         ids=["sdpa", "strided"])
def test_unbounded_caches_keep_the_full_history(attention):
    bb = _backbone(attention)
    assert keys_kept(bb.blocks) is None
    n = 17
    x, mask, starts = _inputs(n)
    with torch.no_grad():
        full = bb(x, mask=mask, episode_start=starts).hidden
        outs = []
        for e, o in feed(bb, x, mask, starts, chunks(n)):
            st = o.state
            outs.append(o.hidden)
            assert st.pos.shape == (B, e) and st.key_offset == 0
            assert st.layers[0].cache.k.shape[2] == e
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    torch.testing.assert_close(st.pos, torch.arange(n).expand(B, n))


def test_trimmed_state_round_trips_through_weights_only_load():
    attention, bound = BOUNDED["local"]
    bb = _backbone(attention)
    n = 3 * bound
    x, _, _ = _inputs(n, seed=2)
    with torch.no_grad():
        full = bb(x).hidden
        st = bb(x[:, : 2 * bound], state=bb.initial_state(B)).state
        assert st.key_offset == bound
        buf = io.BytesIO()
        torch.save(st, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        assert back.key_offset == bound
        rest = bb(x[:, 2 * bound :], state=back).hidden
    torch.testing.assert_close(rest, full[:, 2 * bound :], **TOL)
