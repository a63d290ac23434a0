"""``Backbone.forward(output_tokens=slice)``: the same values (and gradients) as slicing the full
output, for every positional encoding, both norm blocks and both dense kernels, with padding and
episode boundaries; the last layer then computes only the selected queries; other stacks fall back."""

from __future__ import annotations

import pytest
import torch

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig

POSITIONS = ["none", "sinusoidal", "learned", "alibi", "distance_aware", "rotary", "shaw", "xl_relative"]


def _backbone(**kw) -> Backbone:
    base = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    torch.manual_seed(0)
    return Backbone(BackboneConfig.from_dict({**base, **kw}))


def _inputs(b: int = 3, t: int = 12):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, t, 16, generator=g, requires_grad=True)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :4] = False  # left padding (DT windows)
    mask[2, -2:] = False  # right padding
    pos = torch.arange(t).expand(b, t)
    return x, pos, mask


def _check(bb: Backbone, sl: slice, subset: bool, **fw) -> None:
    x, pos, mask = _inputs()
    real = mask[:, sl]  # outputs of padded tokens are unspecified
    full = bb(x, positions=pos, mask=mask, **fw).hidden[:, sl]
    (g_full,) = torch.autograd.grad((full * real[..., None]).sum(), x)
    calls = []
    hook = bb.blocks[-1].attn.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    part = bb(x, positions=pos, mask=mask, output_tokens=sl, **fw).hidden
    hook.remove()
    assert part.shape == full.shape
    torch.testing.assert_close(part[real], full[real], rtol=1e-5, atol=1e-6)
    (g_part,) = torch.autograd.grad((part * real[..., None]).sum(), x)
    torch.testing.assert_close(g_part, g_full, rtol=1e-5, atol=1e-6)
    assert calls[-1] == (len(range(12)[sl]) if subset else 12)  # queries of the last layer run


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("block", ["pre_norm", "post_norm"])
def test_same_values_as_slicing_the_full_output(position, block):
    bb = _backbone(position={"kind": position}, block={"kind": block})
    assert bb.query_subset
    for sl in (slice(1, None, 3), slice(11, 12), slice(0, 5)):
        _check(bb, sl, subset=True)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_bidirectional_and_episodes(causal):
    bb = _backbone(attention={"kind": "reference"}, causal=causal)
    assert bb.query_subset
    _check(bb, slice(1, None, 3), subset=True)
    x, pos, mask = _inputs()
    starts = torch.zeros(3, 12, dtype=torch.bool)
    starts[0, 5] = True  # a new episode inside row 0
    full = bb(x, positions=pos, mask=mask, episode_start=starts).hidden[:, 2::3]
    part = bb(x, positions=pos, mask=mask, episode_start=starts, output_tokens=slice(2, None, 3)).hidden
    torch.testing.assert_close(part[mask[:, 2::3]], full[mask[:, 2::3]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{"attention": {"kind": "local", "block": 4}}, {"block": {"kind": "gated"}},
                                {"depth": {"kind": "universal"}}])
def test_other_stacks_fall_back_to_slicing(kw):
    bb = _backbone(**kw)
    assert not bb.query_subset
    _check(bb, slice(1, None, 3), subset=False)


def test_fall_back_when_the_last_layer_is_needed_whole():
    bb = _backbone()
    _check(bb, slice(1, None, 3), subset=False, output_hidden_states=True)
    _check(bb, slice(1, None, 3), subset=False, need_weights=True)
    x, pos, mask = _inputs()
    out = bb(x, positions=pos, mask=mask, output_tokens=slice(1, None, 3), output_hidden_states=True)
    assert out.hidden.shape == (3, 4, 16) and out.hidden_states[-1].shape == (3, 12, 16)
    with pytest.raises(TypeError, match="output_tokens must be a slice"):
        bb(x, output_tokens=[1, 4])
