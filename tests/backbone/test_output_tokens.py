"""``Backbone.forward(output_tokens=slice)``: the same values (and gradients) as slicing the full
output, for every positional encoding, both norm blocks and both dense kernels, with padding and
episode boundaries; the last layer then computes only the selected queries; other stacks fall back.
``output_tokens`` as a (B, P) tensor of per-row indices: the same values as gathering the full
output, on the same fast path; invalid indices are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.types import take_tokens

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


def _check(bb: Backbone, tokens, subset: bool, **fw) -> None:
    """``output_tokens=tokens`` (a slice or a (3, P) index tensor) against the full output sliced
    (gathered): values and gradients; the last layer runs P queries (``subset``) or all 12."""
    x, pos, mask = _inputs()
    real = take_tokens(mask, tokens)  # outputs of padded tokens are unspecified
    full = take_tokens(bb(x, positions=pos, mask=mask, **fw).hidden, tokens)
    (g_full,) = torch.autograd.grad((full * real[..., None]).sum(), x)
    calls = []
    hook = bb.blocks[-1].attn.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[1]))
    part = bb(x, positions=pos, mask=mask, output_tokens=tokens, **fw).hidden
    hook.remove()
    assert part.shape == full.shape
    torch.testing.assert_close(part[real], full[real], rtol=1e-5, atol=1e-6)
    (g_part,) = torch.autograd.grad((part * real[..., None]).sum(), x)
    torch.testing.assert_close(g_part, g_full, rtol=1e-5, atol=1e-6)
    assert calls[-1] == (full.shape[1] if subset else 12)  # queries of the last layer run


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


#: per-row token indices of the 3 rows of _inputs(): a different P = 3 tokens in each row, out of
#: order, one repeated, and in row 1 a real token after its left padding
ROWS = torch.tensor([[1, 7, 4], [11, 4, 4], [0, 9, 5]])


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("block", ["pre_norm", "post_norm"])
def test_per_row_indices_same_values_as_gathering_the_full_output(position, block):
    bb = _backbone(position={"kind": position}, block={"kind": block})
    for idx in (ROWS, ROWS[:, :1], torch.tensor([[11], [4], [0]], dtype=torch.int32)):
        _check(bb, idx, subset=True)


@pytest.mark.parametrize("causal", [True, False])
def test_per_row_indices_reference_kernel_bidirectional_and_episodes(causal):
    bb = _backbone(attention={"kind": "reference"}, causal=causal)
    _check(bb, ROWS, subset=True)
    x, pos, mask = _inputs()
    starts = torch.zeros(3, 12, dtype=torch.bool)
    starts[0, 5] = True  # a new episode inside row 0
    rows = torch.arange(3)[:, None]
    full = bb(x, positions=pos, mask=mask, episode_start=starts).hidden[rows, ROWS]
    part = bb(x, positions=pos, mask=mask, episode_start=starts, output_tokens=ROWS).hidden
    real = mask[rows, ROWS]
    torch.testing.assert_close(part[real], full[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [{"attention": {"kind": "local", "block": 4}}, {"block": {"kind": "gated"}}])
def test_per_row_indices_other_stacks_compute_everything_then_gather(kw):
    bb = _backbone(**kw)
    assert not bb.query_subset
    _check(bb, ROWS, subset=False)


def test_per_row_indices_of_every_token_run_the_whole_last_layer():
    """T indices per row (a permutation): no fewer queries to compute, so the full layer runs
    and its outputs are gathered in the asked order (a causal kernel's plain-causal fast path
    never sees permuted queries)."""
    bb = _backbone()
    perm = torch.stack([torch.randperm(12, generator=torch.Generator().manual_seed(i)) for i in range(3)])
    _check(bb, perm, subset=False)
    x, pos, _ = _inputs()  # no padding: the kernel would take the plain causal mask
    full = bb(x, positions=pos).hidden[torch.arange(3)[:, None], perm]
    torch.testing.assert_close(bb(x, positions=pos, output_tokens=perm).hidden, full, rtol=0, atol=1e-6)


def test_per_row_indices_with_empty_selection_and_empty_segment():
    bb = _backbone()
    x, pos, mask = _inputs()
    assert bb(x, positions=pos, mask=mask, output_tokens=torch.zeros(3, 0, dtype=torch.long)).hidden.shape == (3, 0, 16)
    empty = torch.zeros(3, 0, 16)
    assert bb(empty, output_tokens=torch.zeros(3, 0, dtype=torch.long)).hidden.shape == (3, 0, 16)


@pytest.mark.parametrize(("idx", "why"), [
    (torch.tensor([[1, 12], [0, 0], [0, 0]]), r"output_tokens holds index 12, outside \[0, 12\)"),
    (torch.tensor([[1, 2], [-1, 0], [0, 0]]), r"output_tokens holds index -1, outside \[0, 12\)"),
    (torch.tensor([1, 2, 3]), r"output_tokens must be a slice or a \(3, P\) tensor of token indices, got shape \(3,\)"),
    (torch.zeros(2, 1, dtype=torch.long), r"output_tokens must be a slice or a \(3, P\) tensor .* got shape \(2, 1\)"),
    (torch.zeros(3, 1), r"output_tokens must hold integer token indices, got torch.float32"),
    (torch.zeros(3, 1, dtype=torch.bool), r"output_tokens must hold integer token indices, got torch.bool"),
])
def test_invalid_per_row_indices_are_refused_by_name(idx, why):
    bb = _backbone()
    x, pos, mask = _inputs()
    with pytest.raises(ValueError, match=why):
        bb(x, positions=pos, mask=mask, output_tokens=idx)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor a state holds (dataclass fields, lists, tuples and dicts), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _tensors(obj[k])]
    return []


@pytest.mark.parametrize("memory", [{"kind": "xl", "mem_len": 8}, {"kind": "knn", "mem_len": 8},
                                    {"kind": "compressive", "mem_len": 8, "compressed_len": 4, "rate": 2}])
def test_per_row_indices_with_a_memory_state_gather_and_keep_the_whole_state(memory):
    """With a ``state`` the whole last layer runs: ``hidden`` is the full output gathered over
    two segments, and the next state (memory of every token) equals the one without
    ``output_tokens``; invalid indices are refused by name as without a state."""
    bb = _backbone(memory=memory).eval()
    g = torch.Generator().manual_seed(2)
    segments = [torch.randn(3, 12, 16, generator=g) for _ in range(2)]
    full_state, part_state = bb.initial_state(3), bb.initial_state(3)
    rows = torch.arange(3)[:, None]
    for x in segments:
        full = bb(x, state=full_state)
        part = bb(x, state=part_state, output_tokens=ROWS)
        torch.testing.assert_close(part.hidden, full.hidden[rows, ROWS], rtol=0, atol=0)
        full_state, part_state = full.state, part.state
        held, kept = _tensors(full_state), _tensors(part_state)
        assert len(held) == len(kept) > 4 and all(torch.equal(a, b) for a, b in zip(held, kept))
    with pytest.raises(ValueError, match=r"output_tokens holds index 12, outside \[0, 12\)"):
        bb(segments[0], state=bb.initial_state(3), output_tokens=ROWS + 1)
