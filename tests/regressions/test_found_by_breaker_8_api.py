"""Defects found by breaking the public Python API of the backbone library (breaker 8, api).

Each test is the reproduction of one defect, as a researcher calling ``Backbone`` from their own
training loop would meet it; the docstrings say what used to happen.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from tests.contracts.contract_variants import all_variants

D = 16


def _bb(**cfg) -> Backbone:
    torch.manual_seed(0)
    return Backbone({"d_model": D, "n_heads": 2, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0, **cfg}).eval()


# -- numbers of other types in configs ------------------------------------------------------------
def test_numpy_numbers_in_a_config_are_stored_as_python_numbers_and_dump_everywhere() -> None:
    """NumPy scalars (a sweep over ``np.arange`` / ``np.linspace``) were accepted and stored as
    they came, so ``to_dict()`` could no longer be written: ``yaml.safe_dump`` raised
    RepresenterError, ``OmegaConf.create`` UnsupportedValueType, ``json.dumps`` TypeError. They
    are now stored as built-in ints and floats, in the backbone fields and in slot configs."""
    cfg = BackboneConfig.from_dict({
        "d_model": np.int64(16), "n_heads": np.int32(2), "n_layers": np.int64(1), "d_ff": np.int16(24),
        "dropout": np.float64(0.25), "attn_dropout": np.float32(0.5), "activation": np.str_("relu"),
        "attention": {"kind": "local", "block": np.int64(4), "memory": np.int64(4)},
        "position": {"kind": "rotary", "base": np.float32(500.0)},
        "memory": {"kind": "xl", "mem_len": np.int64(6)},
    })
    assert [type(v) for v in (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff)] == [int] * 4
    assert (type(cfg.dropout), type(cfg.attn_dropout), type(cfg.activation)) == (float, float, str)
    assert (cfg.dropout, cfg.attn_dropout, cfg.activation) == (0.25, 0.5, "relu")
    assert (type(cfg.attention.block), type(cfg.position.base), type(cfg.memory.mem_len)) == (int, float, int)
    assert (cfg.attention.block, cfg.position.base, cfg.memory.mem_len) == (4, 500.0, 6)
    d = cfg.to_dict()
    assert BackboneConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert BackboneConfig.from_dict(OmegaConf.to_container(OmegaConf.create(d))) == cfg
    assert BackboneConfig.from_dict(json.loads(json.dumps(d))) == cfg
    # built in Python, without from_dict
    direct = BackboneConfig(d_model=np.int64(8), n_heads=np.int64(2), dropout=np.float32(0.5))
    assert (type(direct.d_model), type(direct.n_heads), type(direct.dropout)) == (int, int, float)
    yaml.safe_dump(direct.to_dict())


# -- config objects where a mapping is expected -----------------------------------------------
def test_built_configs_are_taken_where_a_config_mapping_is_expected() -> None:
    """``BackboneConfig.from_dict(cfg)`` and ``EncoderDecoder({"encoder": BackboneConfig(...)})``
    raised "TypeError: 'BackboneConfig' object is not iterable" (the slot registries take a built
    config as it is); ``Backbone("sdpa")`` raised "dictionary update sequence element #0 has
    length 1". Built configs are now taken as they are, and anything else is a TypeError saying
    what is expected."""
    cfg = BackboneConfig(d_model=8, n_heads=2, n_layers=1)
    assert BackboneConfig.from_dict(cfg) is cfg
    enc, dec = cfg.replace(causal=False), cfg.replace(block={"kind": "pre_norm"})
    edc = EncoderDecoderConfig.from_dict({"encoder": enc, "decoder": dec})
    assert edc.encoder is enc and edc.decoder is dec
    assert EncoderDecoderConfig.from_dict(edc) is edc
    model = EncoderDecoder({"encoder": enc, "decoder": dec})
    assert model.config.encoder is enc and model(torch.randn(2, 3, 8), torch.randn(2, 4, 8)).hidden.shape == (2, 4, 8)
    with pytest.raises(TypeError, match=r"^backbone: expected a BackboneConfig or a mapping of its fields .*got str$"):
        Backbone("sdpa")
    with pytest.raises(TypeError, match=r"^encoder: expected a BackboneConfig or a mapping of its fields, got list$"):
        EncoderDecoderConfig.from_dict({"encoder": [("d_model", 8)]})
    with pytest.raises(TypeError, match=r"^encoder_decoder: expected an EncoderDecoderConfig or a mapping"):
        EncoderDecoder("vanilla")


# -- a state of another batch size ----------------------------------------------------------------
@pytest.mark.parametrize("memory", [{"kind": "none"}, {"kind": "xl", "mem_len": 4}])
@pytest.mark.parametrize("with_starts", [False, True])
def test_a_state_of_another_batch_size_is_refused_naming_both(memory, with_starts) -> None:
    """The check ``state is for batch 3, x has batch 2`` ran after the episode ids of the state
    were broadcast against the segment's, so the caller got torch's "The size of tensor a (3)
    must match the size of tensor b (2) at non-singleton dimension 0" instead (only an empty
    segment got the message)."""
    bb = _bb(memory=memory)
    kw = {"episode_start": torch.zeros(2, 5, dtype=torch.bool)} if with_starts else {}
    with pytest.raises(ValueError, match=r"^backbone: state is for batch 3, x has batch 2$"):
        bb(torch.randn(2, 5, D), state=bb.initial_state(3), **kw)


# -- need_weights -----------------------------------------------------------------------------
def test_need_weights_returns_every_layers_attention_probabilities() -> None:
    """``forward(..., need_weights=True)`` made the kernels compute probabilities (the slower
    path) but ``BackboneOutput`` had no field for them: a caller could reach them only through
    forward hooks on the attention modules. They are now ``out.attentions``, one (B, H, T, S)
    tensor per layer over the memory keys and the segment."""
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
    """B = 0 (no environment left in a filtered batch) raised inside ``xl_relative`` (GTrXL's
    positional kind: "aminmax(): cannot compute aminmax over an empty dimension"), ``lsh`` and
    ``routing`` ("cannot reshape tensor of 0 elements into shape [0, 2, -1]"). Every kind now
    returns (0, T, D), with and without a state, and with ``need_weights``."""
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
    ``model.double()``) and a float64 ``x`` failed deep inside with torch's "mixed dtype (CPU):
    all inputs must share same datatype" or "Expected query, key, and value to have the same
    dtype", naming neither the argument nor the dtypes. The forward now says which input has
    which dtype and how to convert it; a state of another dtype still runs under autocast."""
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
    """``initial_state`` with memory ``none`` of a kernel without an incremental form said
    "attention kind LSHAttention has no incremental (cached) form": a class name, not the option.
    It now names ``backbone.attention.kind`` and ``backbone.memory.kind``, what to do, and the
    kernels that have a cache."""
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
    """RoPE scores depend on i - j only (docs/backbone.md), but the angles m * theta were formed
    in float32: shifting every position by 1e6 changed the output by 2.5e-4, by 1e9 by 0.16 (the
    angle lost to float32 rounding). They are now formed in float64 and reduced modulo 2 pi: the
    shifted output equals the unshifted one to float32 rounding."""
    bb = _bb(position={"kind": "rotary"}, max_position=2**40, **({"memory": memory} if memory else {}))
    x = torch.randn(2, 6, D)
    pos = torch.arange(6).expand(2, 6)
    ref = bb(x, positions=pos).hidden
    torch.testing.assert_close(bb(x, positions=pos + offset).hidden, ref, atol=2e-6, rtol=0)


# -- reset_state with the arrays a vector environment returns --------------------------------------
@pytest.mark.parametrize("memory", [{"kind": "xl", "mem_len": 4}, {"kind": "knn", "mem_len": 4, "store_size": 8}])
def test_reset_state_takes_the_numpy_flags_of_a_vector_environment(memory) -> None:
    """``bb.reset_state(state, terminated | truncated)`` with gymnasium's NumPy flags (or a list)
    raised "AttributeError: 'numpy.ndarray' object has no attribute 'to'". Array-likes are now
    taken, with the same result as the tensor."""
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
