"""The Backbone class (rl_tformers.backbone): dtypes, episode isolation, states, weights, empty inputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.backbone_config import BuildContext
from rl_tformers.types import AttnContext
from tests.contracts.contract_variants import all_variants

D, H = 16, 2


BASE = {"d_model": D, "n_heads": H, "n_layers": 2, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0}


def _backbone(**cfg) -> Backbone:
    torch.manual_seed(0)
    return Backbone({**BASE, **cfg}).eval()


def test_sinusoidal_with_an_odd_width_is_refused_at_construction():
    """Old code: built, then 'sinusoidal encoding needs an even dimension' at the first forward."""
    with pytest.raises(ValueError, match=r"backbone\.d_model"):
        Backbone({**BASE, "d_model": 15, "n_heads": 3, "position": {"kind": "sinusoidal"}})


# ------------------------------------------------- float64 models
@pytest.mark.parametrize(
    ("attention", "causal"),
    [
        ({"kind": "sinkhorn", "block_size": 4, "max_len": 64}, True),
        ({"kind": "sinkhorn", "block_size": 4, "max_len": 64}, False),
        ({"kind": "routing", "n_clusters": 2, "local_window": 4, "cluster_window": 4, "seed": 0}, False),
    ],
)
def test_float64_models_of_gathered_kernels_run(attention, causal):
    """Old code: 'expected scalar type Double but found Float' (sinkhorn) and 'scatter(): Expected
    self.dtype to be equal to src.dtype' (routing top-k) on a model moved to float64."""
    bb = _backbone(attention=attention, position={"kind": "rotary"}, causal=causal)
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(1))
    want = bb(x).hidden
    b64 = bb.to(torch.float64)
    got = b64(x.double()).hidden
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=0)
    xg = x.double().requires_grad_(True)
    b64(xg).hidden.sum().backward()
    assert torch.isfinite(xg.grad).all()


def _module(kind: str, position: str, causal: bool, **fields):
    cfg = BackboneConfig.from_dict(
        {
            **BASE,
            "max_position": 64,
            "causal": causal,
            "attention": {"kind": kind, **fields},
            "position": {"kind": position},
        }
    )
    ctx = BuildContext(cfg).at_layer(0)
    torch.manual_seed(3)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).eval().double()


@pytest.mark.parametrize(
    ("kind", "fields", "position"),
    [
        ("adaptive_span", {"max_span": 8, "ramp": 2, "init": 0.5}, "shaw"),
        ("adaptive_span", {"max_span": 8, "ramp": 2, "init": 0.5}, "xl_relative"),
        ("adaptive_span", {"max_span": 8, "ramp": 2, "init": 0.5, "dynamic": True}, "distance_aware"),
        ("local", {"block": 4, "memory": 4}, "distance_aware"),
        ("strided", {"stride": 4}, "distance_aware"),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_exact_kernels_with_score_positions_in_float64_equal_their_reference(kind, fields, position, causal):
    """Old code: adaptive span added the positional bias in float32 (1e-9 off) and DA re-weighted
    scores in float32 (1e-8 off) in a float64 model."""
    mod = _module(kind, position, causal, **fields)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, D, generator=g, dtype=torch.float64)
    pos = torch.arange(12).expand(2, 12) + torch.tensor([[0], [7]])
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :3] = False
    ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
    with torch.no_grad():
        out = mod(x, x, ctx).out
        ref = mod.reference_forward(x, x, ctx).out
    assert out.dtype == ref.dtype == torch.float64
    assert (out - ref)[valid].abs().max().item() < 1e-12


def test_distance_aware_weights_are_float64_for_a_float64_model():
    mod = _module("sdpa", "distance_aware", True)
    da = mod.position
    scores = torch.randn(1, H, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)[None] * 1000
    got = da.transform_scores(scores, pos, pos)
    dist = (pos[0, :, None] - pos[0, None, :]).abs().double()  # (T, S)
    alpha, beta = da.alpha.detach().view(H, 1, 1), da.beta.detach().view(H, 1, 1)
    f = (1 + torch.exp(beta)) / (1 + torch.exp(beta - alpha * dist))  # Wu et al. 2021, sec. 3
    assert got.dtype == torch.float64
    assert (got[0] - scores[0].clamp_min(0) * f).abs().max().item() < 1e-12


def test_universal_coordinate_embedding_in_float64():
    from rl_tformers.depth.universal import coordinate_embedding

    pos = torch.tensor([[0, 3, 123457]])
    got = coordinate_embedding(pos, 3, 8, torch.float64)
    inv = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    want = np.stack(
        [
            np.sin(pos.numpy()[..., None] * inv) + np.sin(3 * inv),
            np.cos(pos.numpy()[..., None] * inv) + np.cos(3 * inv),
        ],
        -1,
    ).reshape(1, 3, 8)
    assert got.dtype == torch.float64
    assert np.abs(got.numpy() - want).max() < 1e-9


# ------------------------------------------------- reversible recomputation under autocast
def test_reversible_recompute_under_bf16_autocast_equals_plain_autograd():
    """Old code: the backward recomputed F and G without autocast (float32), so the inverted
    inputs and every gradient differed from recompute=false by ~1% (bf16 rounding)."""
    cfg = {**BASE, "n_layers": 4, "dropout": 0.1, "attn_dropout": 0.1, "position": {"kind": "learned"}}
    torch.manual_seed(0)
    a = Backbone({**cfg, "block": {"kind": "reversible", "recompute": True}}).train()
    b = Backbone({**cfg, "block": {"kind": "reversible", "recompute": False}}).train()
    b.load_state_dict(a.state_dict())
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 12, D, generator=g), torch.randn(2, 12, D, generator=g)
    grads = []
    for m in (a, b):
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(xx).hidden
        (out.float() * r).sum().backward()
        grads.append([xx.grad] + [p.grad for p in m.parameters()])
    names = ["x"] + [n for n, _ in a.named_parameters()]
    for name, ga, gb in zip(names, *grads):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            tol = 1e-5 * max(1.0, gb.abs().max().item())
            assert (ga - gb).abs().max().item() <= tol, f"{name}: {(ga - gb).abs().max().item():.3g}"


# ------------------------------------------------- episodes never change each other (LSH, routing)
def _two_episodes(bb: Backbone, t: int = 24, start: int = 10, seed: int = 0, **kw):
    """Max change of episode 2's outputs when episode 1's tokens change, and vice versa."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t, D, generator=g)
    es = torch.zeros(2, t, dtype=torch.bool)
    es[:, start] = True
    out = bb(x, episode_start=es, **kw).hidden
    x1, x2 = x.clone(), x.clone()
    x1[:, :start] = torch.randn(2, start, D, generator=g) * 3
    x2[:, start:] = torch.randn(2, t - start, D, generator=g) * 3
    e12 = (bb(x1, episode_start=es, **kw).hidden[:, start:] - out[:, start:]).abs().max().item()
    e21 = (bb(x2, episode_start=es, **kw).hidden[:, :start] - out[:, :start]).abs().max().item()
    return e12, e21


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fields", [{"bucket_size": 2, "n_hashes": 2}, {"bucket_size": 4, "n_hashes": 1}])
def test_lsh_tokens_of_one_episode_never_change_another(causal, fields):
    """Buckets are not shared by the episodes of a row (if they were, the tokens of the previous
    episode would decide which keys of the next one share its chunk: changes up to 1.9; GTrXL
    trains on rows that cross episode boundaries)."""
    bb = _backbone(attention={"kind": "lsh", "seed": 0, **fields}, position={"kind": "rotary"}, causal=causal)
    for seed in range(3):
        assert _two_episodes(bb, seed=seed) == (0.0, 0.0)


def test_lsh_memory_of_a_previous_episode_never_changes_the_new_one():
    bb = _backbone(
        attention={"kind": "lsh", "seed": 0, "bucket_size": 2, "n_hashes": 2},
        memory={"kind": "xl", "mem_len": 12},
        position={"kind": "rotary"},
    )
    g = torch.Generator().manual_seed(2)
    old, new = torch.randn(2, 12, D, generator=g), torch.randn(2, 12, D, generator=g)
    es = torch.zeros(2, 12, dtype=torch.bool)
    es[:, 0] = True  # the second segment starts a new episode (memory kept, masked by episode id)
    outs = []
    for first in (old, torch.randn(2, 12, D, generator=g) * 3):
        st = bb(first, state=bb.initial_state(2)).state
        outs.append(bb(new, state=st, episode_start=es).hidden)
    assert torch.equal(outs[0], outs[1])


def test_routing_topk_refuses_several_episodes_in_a_row():
    """Top-k clusters are balanced over the whole row, so either episode's tokens would change
    the other's outputs (up to 1.3): refused, as linformer and sinkhorn do."""
    bb = _backbone(
        attention={
            "kind": "routing",
            "n_clusters": 3,
            "local_window": 4,
            "cluster_window": 4,
            "seed": 0,
            "local_heads": 0,
        },
        position={"kind": "rotary"},
        causal=False,
    )
    with pytest.raises(ValueError, match="one episode per row"):
        _two_episodes(bb)
    x = torch.randn(2, 24, D)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[:, :10] = False  # padding is not another episode
    assert torch.isfinite(bb(x, mask=mask).hidden).all()
    one = _backbone(attention={"kind": "routing", "n_clusters": 1, "local_heads": 0}, causal=False)
    assert max(_two_episodes(one)) < 1e-5  # one cluster: every key, no competition (sum order only)


# ------------------------------------------------- empty segments
@pytest.mark.parametrize(
    "cfg",
    [
        {"attention": {"kind": "adaptive_span", "max_span": 8, "ramp": 2}},
        {"attention": {"kind": "strided", "stride": 4}},
        {"attention": {"kind": "performer", "chunk_size": 4, "seed": 0}},
        {"attention": {"kind": "rfa", "chunk_size": 4, "seed": 0}},
        {"attention": {"kind": "lsh", "bucket_size": 4, "seed": 0}, "memory": {"kind": "xl", "mem_len": 6}},
        {"attention": {"kind": "sinkhorn", "block_size": 4, "max_len": 64}, "causal": False},
        {"position": {"kind": "xl_relative"}},
        {"memory": {"kind": "knn", "mem_len": 6, "store_size": 24, "top_k": 4}},
        {"depth": {"kind": "early_exit"}, "memory": {"kind": "xl", "mem_len": 6}},
    ],
)
def test_an_empty_segment_returns_nothing_and_keeps_the_state(cfg):
    """Old code: T = 0 failed inside the kernels (reshape of 0 elements, amax of an empty
    dim, index -1 out of bounds...), with and without a state."""
    bb = _backbone(**cfg)
    empty = torch.zeros(2, 0, D)
    out = bb(empty, output_hidden_states=True)
    assert out.hidden.shape == (2, 0, D) and len(out.hidden_states) == 2
    try:
        st = bb.initial_state(2)
    except NotImplementedError:  # no incremental form: nothing more to check
        return
    x = torch.randn(2, 5, D)
    s1 = bb(x[:, :3], state=st).state
    s2 = bb(empty, state=s1)
    assert s2.hidden.shape == (2, 0, D) and s2.state is s1
    torch.testing.assert_close(
        bb(x[:, 3:], state=s2.state).hidden, bb(x[:, 3:], state=s1).hidden, atol=0, rtol=0
    )


def _bb(**cfg) -> Backbone:
    torch.manual_seed(0)
    return Backbone({"d_model": D, "n_heads": 2, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0, **cfg}).eval()


# -- a state of another batch size ----------------------------------------------------------------
@pytest.mark.parametrize("memory", [{"kind": "none"}, {"kind": "xl", "mem_len": 4}])
@pytest.mark.parametrize("with_starts", [False, True])
def test_a_state_of_another_batch_size_is_refused_naming_both(memory, with_starts) -> None:
    """The check ``state is for batch 3, x has batch 2`` runs before the episode ids of the state
    are broadcast against the segment's (after, the caller would get torch's "The size of tensor
    a (3) must match the size of tensor b (2) at non-singleton dimension 0")."""
    bb = _bb(memory=memory)
    kw = {"episode_start": torch.zeros(2, 5, dtype=torch.bool)} if with_starts else {}
    with pytest.raises(ValueError, match=r"^backbone: state is for batch 3, x has batch 2$"):
        bb(torch.randn(2, 5, D), state=bb.initial_state(3), **kw)


# -- need_weights -----------------------------------------------------------------------------
def test_need_weights_returns_every_layers_attention_probabilities() -> None:
    """``forward(..., need_weights=True)`` makes the kernels compute probabilities (the slower
    path) and returns them as ``out.attentions``, one (B, H, T, S) tensor per layer over the
    memory keys and the segment (no forward hooks on the attention modules needed)."""
    bb = _bb()
    x = torch.randn(2, 5, D)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 2] = False
    out = bb(x, mask=mask, need_weights=True)
    assert bb(x, mask=mask).attentions is None
    assert len(out.attentions) == 2
    for w in out.attentions:
        assert w.shape == (2, 2, 5, 5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5), atol=1e-6, rtol=0)
        assert (w.triu(1) == 0).all()  # causal: no weight on the future
        assert (w[1, :, :, 2] == 0).all()  # the padded key
    # every token's row, also when only some tokens' hidden states are asked for
    sub = bb(x, mask=mask, need_weights=True, output_tokens=slice(1, None, 2))
    assert sub.hidden.shape == (2, 2, D)
    for a, b in zip(sub.attentions, out.attentions):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # with XL memory: S = M + T keys, nothing on unfilled slots, rows of a step equal the full pass
    xl = _bb(memory={"kind": "xl", "mem_len": 6}, position={"kind": "xl_relative"}, block={"kind": "gated"})
    first = xl(x, state=xl.initial_state(2), need_weights=True)
    assert [w.shape for w in first.attentions] == [(2, 2, 5, 11)] * 2
    assert all((w[..., :6] == 0).all() for w in first.attentions)  # the 6 unfilled memory slots
    full = xl(x, need_weights=True).attentions
    for w, f in zip(first.attentions, full):
        torch.testing.assert_close(w[..., 6:], f, atol=1e-6, rtol=0)
    # a kernel that forms no probabilities says so with None
    perf = _bb(attention={"kind": "performer"}).train(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert perf(x, need_weights=True).attentions == (None, None)


def test_need_weights_of_step_by_step_decoding_equal_the_rows_of_the_full_pass() -> None:
    """Incremental decoding equals the full pass (docs/backbone.md): the probabilities returned
    for each step over the cache must be the full pass's row of that token."""
    bb = _bb(position={"kind": "alibi"})
    x = torch.randn(2, 4, D)
    full = bb(x, need_weights=True).attentions
    st = bb.initial_state(2)
    for t in range(4):
        o = bb(x[:, t:t + 1], state=st, need_weights=True)
        st = o.state
        for w, f in zip(o.attentions, full):
            assert w.shape == (2, 2, 1, t + 1)
            torch.testing.assert_close(w[:, :, 0], f[:, :, t, :t + 1], atol=1e-6, rtol=0)


# -- an empty batch -----------------------------------------------------------------------------
_VARIANTS = all_variants()


@pytest.mark.parametrize("v", _VARIANTS, ids=[v.id for v in _VARIANTS])
def test_an_empty_batch_runs_through_every_registered_kind(v) -> None:
    """B = 0 (no environment left in a filtered batch): every kind returns (0, T, D), with and
    without a state, and with ``need_weights`` (torch's reductions and reshapes of empty tensors
    in ``xl_relative``, ``lsh`` and ``routing`` would raise "aminmax(): cannot compute aminmax
    over an empty dimension" or "cannot reshape tensor of 0 elements into shape [0, 2, -1]")."""
    causal = v.modes()[0]
    bb = v.build(causal).eval()
    kw = v.forward_kwargs(bb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert bb(torch.randn(0, 5, D), **kw).hidden.shape == (0, 5, D)
        assert bb(torch.randn(0, 5, D), need_weights=True, **kw).hidden.shape == (0, 5, D)
        if v.stateful or (v.incremental and causal):
            o = bb(torch.randn(0, 5, D), state=bb.initial_state(0), **kw)
            o = bb(torch.randn(0, 2, D), state=o.state, **kw)
            assert o.hidden.shape == (0, 2, D) and o.state.batch_size == 0


# -- dtypes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("memory", [{"kind": "none"}, {"kind": "xl", "mem_len": 4}])
def test_an_input_or_state_of_another_dtype_is_refused_naming_both_dtypes(memory) -> None:
    """``initial_state(B, dtype=torch.float64)`` on a float32 model (or a state kept across
    ``model.double()``) and a float64 ``x``: the forward says which input has which dtype and how
    to convert it (not torch's "mixed dtype (CPU): all inputs must share same datatype" or
    "Expected query, key, and value to have the same dtype" from deep inside); a state of another
    dtype still runs under autocast."""
    bb = _bb(memory=memory)
    x = torch.randn(2, 3, D)
    with pytest.raises(ValueError, match=r"^backbone: x is torch\.float64 but the backbone's parameters are "
                                         r"torch\.float32; pass x as torch\.float32"):
        bb(x.double(), state=bb.initial_state(2))
    with pytest.raises(ValueError, match=r"^backbone: the state holds torch\.float64 tensors but x and the "
                                         r"backbone's parameters are torch\.float32 .*state\.map_tensors"):
        bb(x, state=bb.initial_state(2, dtype=torch.float64))
    # converting the state as the message says works, and equals a fresh float32 state
    st = bb.initial_state(2, dtype=torch.float64).map_tensors(
        lambda t: t.to(torch.float32) if t.is_floating_point() else t)
    torch.testing.assert_close(bb(x, state=st).hidden, bb(x, state=bb.initial_state(2)).hidden, atol=0, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 state of a float32 model under autocast
        o = bb(x, state=bb.initial_state(2, dtype=torch.bfloat16))
        assert torch.isfinite(bb(x, state=o.state).hidden).all()


# -- initial_state of a kernel without a cache ----------------------------------------------------
@pytest.mark.parametrize("attention, causal, says", [
    ({"kind": "lsh", "bucket_size": 2}, True, "LSHAttention has no incremental"),
    ({"kind": "performer"}, False, "incremental decoding needs backbone.causal=true"),
])
def test_initial_state_of_a_kernel_without_a_cache_names_the_kind(attention, causal, says) -> None:
    """``initial_state`` with memory ``none`` of a kernel without an incremental form names
    ``backbone.attention.kind`` and ``backbone.memory.kind`` (the options, not a class name such
    as LSHAttention), what to do, and the kernels that have a cache."""
    bb = _bb(attention=attention, causal=causal)
    kind = attention["kind"]
    with pytest.raises(NotImplementedError) as info:
        bb.initial_state(2)
    msg = str(info.value)
    assert msg.startswith("Backbone.initial_state: with backbone.memory.kind='none' the state is a key/value "
                          f"cache for incremental decoding, which backbone.attention.kind='{kind}' cannot keep here")
    assert says in msg
    assert msg.endswith("or use a kernel with an incremental form: adaptive_span, fixed, local, local_2d, "
                        "performer, reference, rfa, sdpa, sliding_window, strided")


# -- rotary at large positions --------------------------------------------------------------------
@pytest.mark.parametrize("offset", [10**6, 10**9])
@pytest.mark.parametrize("memory", [None, {"kind": "xl", "mem_len": 4}])
def test_rotary_output_is_shift_invariant_at_large_positions(offset, memory) -> None:
    """RoPE scores depend on i - j only (docs/backbone.md): the angles m * theta are formed in
    float64 and reduced modulo 2 pi, so shifting every position by 1e6 or 1e9 leaves the output
    equal to float32 rounding (angles formed in float32 would move it by 2.5e-4 and 0.16)."""
    bb = _bb(position={"kind": "rotary"}, max_position=2**40, **({"memory": memory} if memory else {}))
    x = torch.randn(2, 6, D)
    pos = torch.arange(6).expand(2, 6)
    ref = bb(x, positions=pos).hidden
    torch.testing.assert_close(bb(x, positions=pos + offset).hidden, ref, atol=2e-6, rtol=0)


# -- reset_state with the arrays a vector environment returns --------------------------------------
@pytest.mark.parametrize("memory", [{"kind": "xl", "mem_len": 4}, {"kind": "knn", "mem_len": 4, "store_size": 8}])
def test_reset_state_takes_the_numpy_flags_of_a_vector_environment(memory) -> None:
    """``bb.reset_state(state, terminated | truncated)`` takes gymnasium's NumPy flags (or a
    list) with the same result as the tensor."""
    bb = _bb(memory=memory)
    st = bb(torch.randn(2, 3, D), state=bb.initial_state(2)).state
    want = bb.reset_state(st, torch.tensor([True, False]))
    for flags in (np.array([True, False]), [True, False], np.array([1, 0])):
        got = bb.reset_state(st, flags)
        assert got.episode.tolist() == want.episode.tolist() == [1, 0]
        assert torch.equal(got.valid, want.valid) and not got.valid[0].any() and got.valid[1].any()
        x = torch.randn(2, 2, D)
        torch.testing.assert_close(bb(x, state=got).hidden, bb(x, state=want).hidden, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"^reset: episode_start must have shape \(2,\), got \(3,\)$"):
        bb.reset_state(st, np.array([True, False, True]))


def test_a_float64_cache_of_a_float32_model_is_refused_by_every_incremental_kernel() -> None:
    """A float64 KV cache (``initial_state(..., dtype=torch.float64)``) of a float32 model is
    refused by every incremental kernel, naming the dtypes (accepting it would silently promote
    the layer to float64)."""
    import torch

    from rl_tformers.backbone import Backbone
    from rl_tformers.registry import REGISTRIES

    kinds = [e.kind for e in REGISTRIES["attention"] if e.capabilities.incremental and e.capabilities.causal]
    assert {"sdpa", "local", "performer"} <= set(kinds)
    for kind in kinds:
        bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 1, "attention": {"kind": kind}}).eval()
        state = bb.initial_state(2, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"^backbone: the state holds torch.float64 tensors but x and the "
                                             r"backbone's parameters are torch.float32"):
            bb(torch.randn(2, 3, 16), positions=torch.arange(3).expand(2, 3), state=state)
        ok = bb(torch.randn(2, 3, 16), positions=torch.arange(3).expand(2, 3), state=bb.initial_state(2))
        assert ok.hidden.dtype == torch.float32, kind


# ------------------------------------------------------------------- capability refusals list what works
def _with_extra_attention_kind(monkeypatch, kind: str, **capabilities) -> None:
    """Register ``kind`` (a copy of sdpa's config class with these capabilities) in the attention
    registry for the test only."""
    import dataclasses

    from rl_tformers.registry import REGISTRIES, Capabilities, Entry

    sdpa = REGISTRIES["attention"].get("sdpa")
    caps = dataclasses.replace(Capabilities(), **capabilities)
    monkeypatch.setitem(REGISTRIES["attention"]._entries, kind,
                        Entry("attention", kind, sdpa.config_cls, "test kind", "", caps))


def test_a_kernel_without_a_causal_form_names_the_kinds_that_have_one_and_the_last_action_route(monkeypatch):
    from rl_tformers.backbone import IncompatibleConfig, check_compatible, kinds_with
    from rl_tformers.backbone_config import BackboneConfig

    _with_extra_attention_kind(monkeypatch, "zz_causal", causal=True, positions=("rotary",))
    causal = kinds_with("attention", "causal", position="none")
    assert {"local", "sliding_window", "strided", "fixed", "sdpa"} <= set(causal)
    assert not {"linformer", "longformer", "bigbird", "zz_causal"} & set(causal)  # zz_causal: no 'none' position
    assert "zz_causal" in kinds_with("attention", "causal", position="rotary")
    with pytest.raises(IncompatibleConfig) as exc:
        check_compatible(BackboneConfig.from_dict({"attention": {"kind": "linformer"}, "causal": True}))
    assert str(exc.value) == (
        "backbone.attention.kind='linformer' has no causal form; set backbone.causal=false (for the Decision "
        "Transformer both backbone.causal=false and agent.mode=last_action, which predicts only the last action of "
        "each window, so no step attends to a later one), or use a kind that has one (with "
        f"backbone.position.kind='none'): {', '.join(causal)}")


def test_other_capability_refusals_name_the_kinds_that_have_the_capability(monkeypatch):
    from rl_tformers.backbone import IncompatibleConfig, check_compatible, kinds_with
    from rl_tformers.backbone_config import BackboneConfig

    _with_extra_attention_kind(monkeypatch, "zz_alibi", causal=True, positions=("alibi",))
    with pytest.raises(IncompatibleConfig) as exc:
        check_compatible(BackboneConfig.from_dict({"attention": {"kind": "linformer"}, "causal": False,
                                                   "position": {"kind": "alibi"}}))
    applies = kinds_with("attention", "bidirectional", position="alibi")
    assert "zz_alibi" in applies and "linformer" not in applies
    assert str(exc.value) == ("backbone.position.kind='alibi' cannot be used with backbone.attention.kind='linformer'; "
                              f"it supports: none, sinusoidal, learned, rotary; attention kinds that apply 'alibi': "
                              f"{', '.join(applies)}")
    with pytest.raises(IncompatibleConfig) as exc:
        check_compatible(BackboneConfig.from_dict({"depth": {"kind": "universal"}, "memory": {"kind": "xl"}}))
    assert "; depth kinds that do: early_exit, fixed; or use backbone.memory.kind=none" in str(exc.value)
    assert kinds_with("depth", "memory") == ["early_exit", "fixed"]
