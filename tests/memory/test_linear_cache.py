"""Memory kind ``none`` with the linear kernels (``performer``, ``rfa``) keeps no key bookkeeping.

Their cache (:class:`~rl_tformers.attention._linear.LinearCache`) carries the running sums and
the episode id of the last valid key they cover, so ``cache_keeps()`` is 0: the state's
pos/valid/seg stay (B, 0) and a decoding step is O(1) in the tokens so far. Decoding stays
exact: steps of 1..3 tokens equal one full pass across padding (a fully padded step included),
an episode boundary inside a step (one on a padded key included) and ``reset_state`` of one row;
a cache saved before ``last_seg``/``seen`` existed still decodes from untrimmed bookkeeping.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.attention._linear import LinearCache
from rl_tformers.memory import none as none_memory
from rl_tformers.memory.none import keys_kept
from tests.memory.decoding import chunks, feed, run_with_reset

D, H, B = 16, 2, 2
TOL = {"atol": 1e-10, "rtol": 1e-10}

# kernel config, position kind (rotary acts on q, k before the feature map; sinusoidal on x)
KINDS = {
    "performer-rotary": ({"kind": "performer", "chunk_size": 4, "seed": 0}, "rotary"),
    "rfa-sinusoidal": ({"kind": "rfa", "chunk_size": 4, "seed": 0}, "sinusoidal"),
    "rfa_gated-rotary": ({"kind": "rfa", "gate": True, "chunk_size": 4, "seed": 0}, "rotary"),
}


def _backbone(name: str) -> Backbone:
    attention, position = KINDS[name]
    torch.manual_seed(0)
    cfg = {"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "max_position": 256,
           "attention": attention, "position": {"kind": position}, "memory": {"kind": "none"}}
    return Backbone(cfg).eval().to(torch.float64)


def _inputs(n: int = 24, seed: int = 0):
    """x (B, n, D) float64; mask with left padding (row 1) and padding across steps (row 0: keys
    4..6, the step [4, 5) fully padded); episode starts inside steps: row 0 at key 7 (second key
    of [5, 8), right after the padding), row 1 at the padded key 10 (the run starts at 11) and at
    key 14 (inside [13, 16))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3] = False
    mask[0, 4:7] = False
    mask[1, 10] = False
    starts = torch.zeros(B, n, dtype=torch.bool)
    starts[0, 7] = True
    starts[1, 10] = True
    starts[1, 14] = True
    return x, mask, starts


def _decode(bb, x, mask, starts, steps):
    outs = []
    for e, o in feed(bb, x, mask, starts, steps):
        st = o.state
        outs.append(o.hidden)
        assert st.pos.shape == st.valid.shape == st.seg.shape == (B, 0)
        assert st.key_offset == e
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("name", sorted(KINDS))
def test_linear_cache_keeps_no_slots_and_equals_the_full_pass(name):
    bb = _backbone(name)
    assert keys_kept(bb.blocks) == 0
    x, mask, starts = _inputs()
    n = x.shape[1]
    with torch.no_grad():
        full = bb(x, mask=mask, episode_start=starts).hidden  # (B, n, D)
        got, st = _decode(bb, x, mask, starts, chunks(n))
    torch.testing.assert_close(got, full, **TOL)
    for blk, ls in zip(bb.blocks, st.layers, strict=True):
        assert ls.cache.state.shape == (B, H, blk.attn.n_features, D // H + 1)  # constant size
        assert ls.cache.last_seg.tolist() == [1, 2] and ls.cache.seen.all()
    # the per-token episode starts were honoured: row 1 from key 14 on is a fresh stream
    # (positions continue, so compare with a pass over the same tokens at the same positions)
    with torch.no_grad():
        fresh = bb(x[1:, 14:], positions=torch.arange(14, n)[None]).hidden[0]
    torch.testing.assert_close(got[1, 14:], fresh, **TOL)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_reset_state_of_one_row(name, monkeypatch):
    bb = _backbone(name)
    x, _, _ = _inputs(seed=1)
    n = x.shape[1]
    steps, reset_at = chunks(n), 9  # 9 starts a step
    rows = torch.tensor([False, True])
    with torch.no_grad():
        got, st = run_with_reset(bb, x, steps, reset_at, rows)
        assert st.pos.shape == (B, 0) and st.key_offset == n
        # the same calls with untrimmed bookkeeping (every key's pos/valid/seg at hand)
        monkeypatch.setattr(none_memory, "keys_kept", lambda blocks: None)
        want, st_full = run_with_reset(bb, x, steps, reset_at, rows)
        monkeypatch.undo()
        assert st_full.pos.shape == (B, n) and st_full.key_offset == 0
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got[0], bb(x[:1]).hidden[0], **TOL)  # row 0: never reset
        torch.testing.assert_close(got[1, reset_at:], bb(x[1:, reset_at:]).hidden[0], **TOL)  # a fresh stream


@pytest.mark.parametrize("name", ["performer-rotary", "rfa_gated-rotary"])
def test_trimmed_linear_state_round_trips_through_weights_only_load(name):
    bb = _backbone(name)
    x, mask, starts = _inputs(seed=2)
    n, half = x.shape[1], 12
    with torch.no_grad():
        full = bb(x, mask=mask, episode_start=starts).hidden
        st = bb(x[:, :half], mask=mask[:, :half], episode_start=starts[:, :half], state=bb.initial_state(B)).state
        assert st.pos.shape == (B, 0) and st.key_offset == half
        buf = io.BytesIO()
        torch.save(st, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        cache = back.layers[0].cache
        assert isinstance(cache, LinearCache) and back.key_offset == half
        assert cache.last_seg.dtype == torch.long and cache.seen.dtype == torch.bool
        outs = []
        for t, e in chunks(n - half):
            t, e = t + half, e + half
            o = bb(x[:, t:e], mask=mask[:, t:e], episode_start=starts[:, t:e], state=back)
            back = o.state
            outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full[:, half:], **TOL)


def test_a_cache_without_last_seg_decodes_from_untrimmed_bookkeeping(monkeypatch):
    """A state saved before LinearCache had last_seg/seen (bookkeeping never trimmed) continues
    exactly, and is trimmed from then on."""
    bb = _backbone("rfa_gated-rotary")
    x, mask, starts = _inputs(seed=3)
    half = 9  # key 8 is in episode 1 (row 0) / 0 (row 1, whose run 1 starts at 11, after the padded 10)
    with torch.no_grad():
        full = bb(x, mask=mask, episode_start=starts).hidden
        monkeypatch.setattr(none_memory, "keys_kept", lambda blocks: None)
        st = bb(x[:, :half], mask=mask[:, :half], episode_start=starts[:, :half], state=bb.initial_state(B)).state
        monkeypatch.undo()
        assert st.pos.shape == (B, half)
        old = dataclasses.replace(st, layers=[dataclasses.replace(
            ls, cache=dataclasses.replace(ls.cache, last_seg=None, seen=None)) for ls in st.layers])
        trimmed = dataclasses.replace(old, pos=old.pos[:, :0], valid=old.valid[:, :0], seg=old.seg[:, :0],
                                      key_offset=half)
        with pytest.raises(ValueError, match="last_seg"):
            bb(x[:, half:], state=trimmed)
        o = bb(x[:, half:], mask=mask[:, half:], episode_start=starts[:, half:], state=old)
    torch.testing.assert_close(o.hidden, full[:, half:], **TOL)
    assert o.state.pos.shape == (B, 0) and o.state.layers[0].cache.last_seg is not None


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_only_the_causal_form_drops_the_bookkeeping(kind):
    """Bidirectional linear kernels have no incremental form: cache_keeps() is None there."""
    for causal, want in ((True, 0), (False, None)):
        bb = Backbone({"d_model": D, "n_layers": 1, "n_heads": H, "attn_dropout": 0.0, "causal": causal,
                       "attention": {"kind": kind}})
        assert bb.blocks[0].attn.cache_keeps() == want
