"""Gradient checkpointing of ordinary blocks (``backbone.checkpoint``): the same outputs,
exactly the same gradients and buffers as the ordinary pass (dropout and the routing centroids'
EMA step included), in every depth kind that runs blocks one by one, with memory and episodes;
and lower peak memory in training."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone, IncompatibleConfig
from rl_tformers.bench.memory import cpu_peak_bytes

D = 16


def _grads(cfg: dict, checkpoint: bool, with_state: bool = False):
    torch.manual_seed(0)
    bb = Backbone({**cfg, "checkpoint": checkpoint}).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, D, generator=g, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False
    starts = torch.zeros(2, 9, dtype=torch.bool)
    starts[0, 5] = True
    kw = {"mask": mask, "episode_start": starts}
    if with_state:  # a first segment fills the memory, the second backpropagates through both
        kw["state"] = bb(torch.randn(2, 9, D, generator=g), **kw, state=bb.initial_state(2)).state
        assert kw["state"] is not None
    torch.manual_seed(5)  # dropout draws
    out = bb(x, **kw)
    loss = out.hidden[mask].square().mean() + sum(out.aux.values(), torch.zeros(()))
    loss.backward()
    grads = {n: p.grad for n, p in bb.named_parameters()}
    return out.hidden.detach(), x.grad, grads, {n: b.clone() for n, b in bb.named_buffers()}


CASES = {
    "pre_norm": ({"block": {"kind": "pre_norm"}}, False),
    "post_norm": ({"block": {"kind": "post_norm"}, "attention": {"kind": "local", "block": 4, "memory": 4}}, False),
    "gated_xl_memory": ({"block": {"kind": "gated"}, "position": {"kind": "xl_relative"},
                         "memory": {"kind": "xl", "mem_len": 6}}, True),
    "early_exit": ({"depth": {"kind": "early_exit"}}, False),
    "universal_act": ({"depth": {"kind": "universal", "max_steps": 3}}, False),
    "universal_sepconv": ({"depth": {"kind": "universal", "max_steps": 2, "transition": "sepconv"}}, False),
    "lsh": ({"attention": {"kind": "lsh", "bucket_size": 2, "n_hashes": 2, "seed": 0}, "position": {"kind": "rotary"}},
            False),
    # the centroids' EMA step runs once (in the recomputation), from the centroids the forward used
    "routing_ema": ({"attention": {"kind": "routing", "n_clusters": 3, "local_window": 4, "cluster_window": 4,
                                   "seed": 0, "ema_decay": 0.5}, "position": {"kind": "rotary"}}, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointed_gradients_equal_the_ordinary_ones_exactly(case):
    fields, with_state = CASES[case]
    cfg = {"d_model": D, "n_layers": 3, "n_heads": 2, "dropout": 0.2, "attn_dropout": 0.1, **fields}
    h0, gx0, gp0, buf0 = _grads(cfg, False, with_state)
    h1, gx1, gp1, buf1 = _grads(cfg, True, with_state)
    assert torch.equal(h0, h1)
    assert torch.equal(gx0, gx1)
    assert buf0.keys() == buf1.keys() and all(torch.equal(buf0[n], buf1[n]) for n in buf0)
    assert gp0.keys() == gp1.keys()
    for name in gp0:
        assert (gp0[name] is None) == (gp1[name] is None), name
        if gp0[name] is not None:
            assert torch.equal(gp0[name], gp1[name]), name


def test_checkpointing_lowers_the_training_peak_memory():
    """Forward + backward of 4 pre-norm layers at T = 512: the ordinary pass holds every layer's
    activations until backward, the checkpointed one only the layers' inputs."""
    cfg = {"d_model": 64, "n_layers": 4, "n_heads": 4, "dropout": 0.0, "attn_dropout": 0.0}
    x = torch.randn(2, 512, 64, requires_grad=True)
    peaks = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        bb = Backbone({**cfg, "checkpoint": ckpt}).train()
        bb(x).hidden.square().mean().backward()  # gradient buffers exist before the measured call
        peaks[ckpt] = cpu_peak_bytes(lambda bb=bb: bb(x).hidden.square().mean().backward())
    if peaks[False] is None:
        pytest.skip("this torch build's profiler records no memory events")
    assert peaks[True] < 0.6 * peaks[False], peaks


def test_checkpoint_outside_training_changes_nothing():
    torch.manual_seed(0)
    a = Backbone({"d_model": D, "n_heads": 2}).eval()
    torch.manual_seed(0)
    b = Backbone({"d_model": D, "n_heads": 2, "checkpoint": True}).eval()
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        assert torch.equal(a(x).hidden, b(x).hidden)


def test_checkpoint_is_checked_and_refused_with_reversible_blocks():
    with pytest.raises(ValueError, match=r"^backbone.checkpoint must be true or false, got 'yes'"):
        Backbone({"checkpoint": "yes"})
    with pytest.raises(IncompatibleConfig, match=r"^backbone.checkpoint=true with backbone.block.kind='reversible'"):
        Backbone({"d_model": D, "n_heads": 2, "checkpoint": True, "block": {"kind": "reversible"}})
