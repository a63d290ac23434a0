"""Memory kind ``knn``: acting one step at a time equals the training forward it was trained with.

With ``retrieval: steps`` (the default) a query retrieves the entries of its episode whose
age is in ``[min_age, store_size]``, from the store and from the earlier tokens of its own
forward pass, so the retrieved set does not depend on how the sequence is split. With XL memory
that covers the local context (``mem_len`` >= the sequence), any split then gives the outputs of
one pass (float64: to rounding). ``retrieval: segments`` (a pass reads only the store written by
earlier passes) depends on the split: that is what made GTrXL's step-by-step acting differ from
its training segments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.loss import SegmentBatch, encode_segment
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone

from rl_tformers import Backbone
from rl_tformers.memory._search import faiss_available
from rl_tformers.registry import RegistryError

D, H, T = 16, 2, 20
SPLITS = [[1] * T, [2] * 10, [5, 7, 8], [19, 1]]


def _bb(dtype=torch.float64, **mem) -> Backbone:
    """GTrXL-like stack (gated blocks, XL-relative positions); XL memory covering the whole sequence."""
    cfg = {
        "d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0,
        "attention": {"kind": "sdpa"}, "position": {"kind": "xl_relative"},
        "block": {"kind": "gated", "gate": "gru", "gate_bias": 2.0},
        "memory": {"kind": "knn", "layer": -1, "mem_len": T, "store_size": 32, "top_k": 4, "search": "torch", **mem},
    }
    torch.manual_seed(1)
    bb = Backbone(cfg).eval().to(dtype)
    with torch.no_grad():  # a gate of 0.73 (not the 0.5 of the initialisation): retrieval weighs in
        for blk in bb.blocks:
            if hasattr(blk.attn, "gate_logit"):
                blk.attn.gate_logit.fill_(1.0)
    return bb


def _run(bb: Backbone, x: torch.Tensor, split: list[int], episode_start: torch.Tensor | None = None):
    st, outs, i = bb.initial_state(x.shape[0]), [], 0
    with torch.no_grad():
        for c in split:
            es = None if episode_start is None else episode_start[:, i:i + c]
            o = bb(x[:, i:i + c], state=st, episode_start=es)
            st, i = o.state, i + c
            outs.append(o.hidden)
    return torch.cat(outs, 1), st


def _x(dtype=torch.float64, b=3):
    torch.manual_seed(0)
    return torch.randn(b, T, D, dtype=dtype)


@pytest.mark.parametrize("split", SPLITS, ids=["steps", "pairs", "5-7-8", "19-1"])
def test_default_any_split_equals_one_pass(split):
    """The default configuration: step-by-step (and any split) equals one pass, float64."""
    bb = _bb()
    x = _x()
    full, st_full = _run(bb, x, [T])
    out, st = _run(bb, x, split)
    torch.testing.assert_close(out, full, atol=1e-12, rtol=0)
    # and the stores left behind are the same
    a, b = bb.memory.store(st_full), bb.memory.store(st)
    assert torch.equal(a.pos, b.pos) and torch.equal(a.valid, b.valid) and torch.equal(a.seg, b.seg)
    torch.testing.assert_close(a.keys, b.keys, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mem", [
    {"store_size": 6},  # the FIFO evicts: the age bound store_size gives the same set in one pass
    {"min_age": 4, "store_size": 9},
    {"layer": 0},  # the kNN layer below an XL layer
    {"search": "faiss", "store_size": 7},
    {"search": "faiss", "min_age": 3},
], ids=["evicting-store", "min-age", "layer0", "faiss", "faiss-min-age"])
def test_options_any_split_equals_one_pass(mem):
    if mem.get("search") == "faiss" and not faiss_available():
        pytest.skip("faiss not installed")
    bb = _bb(**mem)
    x = _x()
    full, _ = _run(bb, x, [T])
    for split in SPLITS:
        torch.testing.assert_close(_run(bb, x, split)[0], full, atol=1e-12, rtol=0)


def test_float32_step_by_step_equals_one_pass():
    bb = _bb(torch.float32)
    x = _x(torch.float32)
    torch.testing.assert_close(_run(bb, x, [1] * T)[0], _run(bb, x, [T])[0], atol=1e-5, rtol=0)


def test_faiss_and_torch_search_give_the_same_outputs():
    if not faiss_available():
        pytest.skip("faiss not installed")
    x = _x()
    for split in ([T], [1] * T, [5, 7, 8]):
        a = _run(_bb(search="torch", store_size=7), x, split)[0]
        b = _run(_bb(search="faiss", store_size=7), x, split)[0]
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_retrieval_really_happens_and_min_age_is_respected():
    bb = _bb(min_age=3)
    layer = bb.blocks[-1].attn
    seen = {}
    hook = layer.register_forward_hook(lambda m, a, o: seen.update(m=o.metrics))
    _run(bb, _x(), [T])
    hook.remove()
    # in one pass from an empty state: every query from position 3 on retrieves (17 of 20)
    assert seen["m"]["knn/hit_rate"] == pytest.approx(17 / 20)
    assert seen["m"]["knn/top1_age"] >= 3
    # the gate is not closed: the outputs differ from those of the same weights with a closed gate
    closed = _bb(min_age=3)
    with torch.no_grad():
        closed.blocks[-1].attn.gate_logit.fill_(-1e4)
    assert (_run(bb, _x(), [T])[0] - _run(closed, _x(), [T])[0]).abs().max() > 1e-3


def test_segments_rule_depends_on_the_split():
    """``retrieval: segments`` (the store of earlier passes only): one pass from an empty state
    retrieves nothing, step by step retrieves every earlier token: the outputs differ (measured
    3.8e-2 for a 2-layer model of width 32), which is the acting/training mismatch of that rule."""
    bb = _bb(retrieval="segments")
    x = _x()
    full, _ = _run(bb, x, [T])
    steps, _ = _run(bb, x, [1] * T)
    assert (steps - full).abs().max() > 1e-3
    closed = _bb(retrieval="segments")
    with torch.no_grad():
        closed.blocks[-1].attn.gate_logit.fill_(-1e4)
    torch.testing.assert_close(full, _run(closed, x, [T])[0], atol=0, rtol=0)


def test_one_token_at_a_time_both_rules_agree():
    """Acting (one token per call) is the same under both rules: models trained with the old
    per-pass rule act exactly as before; only their training forward differs."""
    x = _x()
    a, sa = _run(_bb(retrieval="steps"), x, [1] * T)
    b, sb = _run(_bb(retrieval="segments"), x, [1] * T)
    assert torch.equal(a, b)
    assert torch.equal(sa.layers[-1].cache.keys, sb.layers[-1].cache.keys)


def test_episode_start_inside_a_segment_equals_a_reset_when_acting():
    """Training segments cross episode boundaries (episode_start, positions restart); acting
    resets the state at the boundary. Both give the same outputs."""
    bb = _bb(store_size=8)
    x = _x(b=2)
    k = 11  # row 0 starts a new episode at step 11; row 1 does not
    pos = torch.stack([torch.cat([torch.arange(k), torch.arange(T - k)]), torch.arange(T)])
    start = torch.zeros(2, T, dtype=torch.bool)
    start[0, k] = True
    with torch.no_grad():
        full = bb(x, pos, state=bb.initial_state(2), episode_start=start).hidden
        st, outs = bb.initial_state(2), []
        for t in range(T):
            if start[:, t].any():
                st = bb.reset_state(st, start[:, t])
            o = bb(x[:, t:t + 1], pos[:, t:t + 1], state=st)
            st = o.state
            outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=0)


def test_bad_options_are_refused():
    with pytest.raises(RegistryError, match="memory.retrieval"):
        _bb(retrieval="blocks")
    with pytest.raises(RegistryError, match="memory.min_age"):
        _bb(min_age=0)


# -- the GTrXL agent: policy.act step by step == the training forward (burn-in + window) ----------
def _gtrxl(retrieval: str, length: int) -> GTrXLModel:
    bb = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=length)
    bb["memory"] = {"kind": "knn", "layer": -1, "mem_len": length, "store_size": 64, "top_k": 4, "search": "torch",
                    "retrieval": retrieval}
    torch.manual_seed(3)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, prev_action_input=True, prev_reward_input=True)).eval()
    with torch.no_grad():
        model.encoder.backbone.blocks[-1].attn.gate_logit.fill_(1.0)
    return model


@pytest.mark.parametrize("retrieval", ["steps", "segments"])
def test_gtrxl_acting_equals_the_burn_in_training_forward(retrieval):
    n, burn_in, length = 2, 7, 16
    model = _gtrxl(retrieval, length)
    pol = GTrXLPolicy(model, obs_mean=np.zeros(3, np.float32), obs_std=np.ones(3, np.float32),
                      action_low=-np.ones(2, np.float32), action_high=np.ones(2, np.float32), rtg_scale=10.0)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(length, n, 3)).astype(np.float32)
    rew = rng.normal(size=(length, n)).astype(np.float32)
    state, acts = pol.initial_state(n), []
    for t in range(length):
        a, state = pol.act(obs[t], state, np.full(n, t == 0), None if t == 0 else rew[t - 1])
        acts.append(torch.as_tensor(a))
    actions = torch.stack(acts, 1)  # (N, L, A)
    # the same episode as a training row: burn-in of 7 steps without gradient, then the window
    prev_r = torch.as_tensor(np.concatenate([np.zeros((1, n), np.float32), rew[:-1]], 0)).T
    start = torch.zeros(n, length, dtype=torch.bool)
    start[:, 0] = True
    batch = SegmentBatch(
        obs=torch.as_tensor(obs).transpose(0, 1), actions=actions, rewards=torch.as_tensor(rew).T,
        rtg=torch.zeros(n, length), prev_action=torch.cat([torch.zeros(n, 1, 2), actions[:, :-1]], 1),
        prev_reward=prev_r, terminals=torch.zeros(n, length, dtype=torch.bool), episode_start=start,
        timesteps=torch.arange(length).expand(n, length), mask=torch.ones(n, length, dtype=torch.bool),
        burn_in=burn_in,
    )
    with torch.no_grad():
        window = model.actor.mode(encode_segment(model.encoder, batch).features)  # (N, L - burn_in, A)
    gap = (window - actions[:, burn_in:]).abs().max().item()
    if retrieval == "steps":
        assert gap < 1e-5, gap
    else:  # the window's queries could not read the window's earlier steps in training
        assert gap > 1e-4, gap
