"""Vanilla Transformer encoder-decoder with cross-attention."""

from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from rl_tformers.registry import RegistryError

D = 16
SMALL = {"d_model": D, "n_heads": 2, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0}


def _model(block="post_norm", **kw):
    torch.manual_seed(0)
    cfg = {"encoder": {**SMALL, "block": {"kind": block}}, "decoder": {**SMALL, "block": {"kind": block}}, **kw}
    return EncoderDecoder(cfg).eval()


def test_vanilla_defaults():
    cfg = EncoderDecoderConfig()
    for part, causal in ((cfg.encoder, False), (cfg.decoder, True)):
        assert part.causal is causal
        assert part.block.kind == "post_norm" and part.position.kind == "sinusoidal" and part.activation == "relu"
    assert cfg.cross_attention.kind == "sdpa"
    m = _model()
    layer = m.layers[0]
    assert {"self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3"} <= {n for n, _ in layer.named_children()}


@pytest.mark.parametrize("block", ["post_norm", "pre_norm"])
def test_shapes_and_decoder_causality(block):
    m = _model(block)
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    out = m(src, tgt)
    assert out.hidden.shape == (2, 5, D) and out.memory.shape == (2, 7, D)
    for t in range(4):
        tgt2 = tgt.clone()
        tgt2[:, t + 1 :] += torch.randn(2, 4 - t, D)
        torch.testing.assert_close(m(src, tgt2).hidden[:, : t + 1], out.hidden[:, : t + 1], atol=1e-6, rtol=0)
    tg = tgt.clone().requires_grad_(True)
    h = m(src, tg).hidden
    (g,) = torch.autograd.grad((h[:, 1] * torch.randn(2, D)).sum(), tg)
    assert torch.count_nonzero(g[:, 2:]) == 0 and g[:, :2].abs().sum() > 0


def test_every_target_position_reads_the_whole_real_source():
    m = _model()
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    src_mask = torch.ones(2, 7, dtype=torch.bool)
    src_mask[1, 4:] = False
    sg = src.clone().requires_grad_(True)
    h = m(sg, tgt, src_mask=src_mask).hidden
    (g,) = torch.autograd.grad((h[:, 0] * torch.randn(2, D)).sum(), sg)  # not a plain sum: LN outputs sum to 0
    per_token = g.abs().sum(-1)  # (B, S)
    assert (per_token[src_mask] > 0).all()  # not causal over the source
    assert (per_token[~src_mask] == 0).all()  # padded source tokens are never read
    # garbage in padded source slots changes nothing
    src2 = src.clone()
    src2[1, 4:] = torch.randn(3, D) * 100
    torch.testing.assert_close(m(src2, tgt, src_mask=src_mask).hidden, h.detach(), atol=1e-6, rtol=0)


def test_target_padding_invariance_and_bf16():
    m = _model()
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    tmask = torch.ones(2, 5, dtype=torch.bool)
    tmask[0, 3:] = False
    a = m(src, tgt, tgt_mask=tmask).hidden
    tgt2 = tgt.clone()
    tgt2[0, 3:] = 50
    b = m(src, tgt2, tgt_mask=tmask).hidden
    torch.testing.assert_close(b[tmask], a[tmask], atol=1e-6, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        smask = torch.zeros(2, 7, dtype=torch.bool)  # no real source at all: cross rows are empty
        out = m(src, tgt, src_mask=smask, tgt_mask=tmask).hidden
    assert torch.isfinite(out.float()).all()


def test_config_round_trip_and_partial_dicts():
    m = _model("pre_norm", cross_attention={"kind": "reference"})
    cfg = m.config
    assert EncoderDecoderConfig.from_dict(cfg.to_dict()) == cfg
    yaml = OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    assert EncoderDecoderConfig.from_dict(OmegaConf.to_container(OmegaConf.create(yaml))) == cfg
    part = EncoderDecoderConfig.from_dict({"encoder": {"d_model": 32, "n_heads": 4}, "decoder": {"d_model": 32}})
    assert part.encoder.causal is False and part.decoder.causal is True and part.encoder.block.kind == "post_norm"


def test_refusals_name_the_option():
    with pytest.raises(IncompatibleConfig, match="encoder.d_model=16 and decoder.d_model=32"):
        EncoderDecoderConfig.from_dict({"encoder": {"d_model": 16, "n_heads": 2}, "decoder": {"d_model": 32, "n_heads": 2}})
    with pytest.raises(IncompatibleConfig, match="decoder.block.kind='gated'"):
        EncoderDecoderConfig.from_dict({"decoder": {"block": {"kind": "gated"}}})
    with pytest.raises(IncompatibleConfig, match="encoder_decoder.foo"):
        EncoderDecoderConfig.from_dict({"foo": 1})


@pytest.mark.slow
def test_learns_to_copy_through_cross_attention():
    """Target position t must output source token t: only cross-attention can carry it."""
    torch.manual_seed(0)
    m = EncoderDecoder({"encoder": {**SMALL, "d_model": 32, "n_heads": 4}, "decoder": {**SMALL, "d_model": 32, "n_heads": 4}}).train()
    vocab, n = 8, 5
    emb = torch.nn.Embedding(vocab + 1, 32)  # token vocab = start symbol
    head = torch.nn.Linear(32, vocab)
    opt = torch.optim.Adam([*m.parameters(), *emb.parameters(), *head.parameters()], lr=3e-3)
    for _ in range(250):
        tok = torch.randint(0, vocab, (32, n))
        start = torch.full((32, 1), vocab)
        logits = head(m(emb(tok), emb(torch.cat([start, tok[:, :-1]], 1))).hidden)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tok.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    tok = torch.randint(0, vocab, (64, n), generator=torch.Generator().manual_seed(3))
    start = torch.full((64, 1), vocab)
    acc = (head(m(emb(tok), emb(torch.cat([start, tok[:, :-1]], 1))).hidden).argmax(-1) == tok).float().mean()
    assert acc > 0.9, f"copy accuracy {acc:.2f}"


def test_constructor_takes_mappings_like_from_dict():
    """``EncoderDecoderConfig(cross_attention={...})`` builds the attention config from the dict
    (not AttributeError: 'dict' object has no attribute 'kind')."""
    cfg = EncoderDecoderConfig(encoder={"d_model": 32, "n_heads": 4}, decoder={"d_model": 32, "n_heads": 4},
                               cross_attention={"kind": "reference"})
    want = EncoderDecoderConfig.from_dict({"encoder": {"d_model": 32, "n_heads": 4},
                                           "decoder": {"d_model": 32, "n_heads": 4},
                                           "cross_attention": {"kind": "reference"}})
    assert cfg == want and cfg.cross_attention.kind == "reference" and cfg.decoder.causal is True
    with pytest.raises(TypeError, match="cross_attention: expected an attention config"):
        EncoderDecoderConfig(cross_attention="sdpa")


@pytest.mark.parametrize("kind", ["sdpa", "strided", "sliding_window", "performer", "lsh", "local_2d"])
def test_empty_target_gives_an_empty_output_for_every_decoder_kind(kind):
    """An empty target (T = 0) returns (B, 0, D) as Backbone.forward does for an empty segment,
    with the sparse decoder kernels too; an empty source leaves cross rows empty."""
    torch.manual_seed(0)
    m = EncoderDecoder({"encoder": SMALL, "decoder": {**SMALL, "block": {"kind": "pre_norm"}, "attention": {"kind": kind}}})
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    out = m.eval()(src, tgt[:, :0])
    assert out.hidden.shape == (2, 0, D) and out.memory.shape == (2, 7, D)
    both = m(src[:, :0], tgt[:, :0])
    assert both.hidden.shape == (2, 0, D) and both.memory.shape == (2, 0, D)


# ------------------------------------------------- encoder-decoder: no target left without a source
@pytest.mark.parametrize("kind", ["local", "local_2d", "strided", "fixed", "sliding_window", "adaptive_span"])
def test_key_index_patterns_are_refused_as_cross_attention(kind) -> None:
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    with pytest.raises(IncompatibleConfig, match=rf"cross_attention\.kind='{kind}' cannot attend to another sequence: "
                                                 r"its queries must be the last T of its S keys"):
        EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})


def test_every_accepted_cross_attention_kind_lets_every_target_read_the_source() -> None:
    from rl_tformers.encoder_decoder import EncoderDecoder
    from rl_tformers.registry import ATTENTION

    small = {"d_model": 16, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    accepted = [e.kind for e in ATTENTION if e.capabilities.cross_attention and e.capabilities.bidirectional]
    assert "sdpa" in accepted and "local" not in accepted
    for kind in accepted:
        torch.manual_seed(0)
        model = EncoderDecoder({"encoder": small, "decoder": small, "cross_attention": {"kind": kind}}).eval()
        for s_len, t_len in ((3, 9), (1, 4), (9, 3)):
            tgt = torch.randn(1, t_len, 16, generator=torch.Generator().manual_seed(1))
            memory = torch.randn(1, s_len, 16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
            hidden, _, _ = model.decode(tgt, memory)  # the encoder output directly: what cross-attention reads
            for t in range(t_len):
                (g,) = torch.autograd.grad((hidden[0, t] * torch.arange(16.0)).sum(), memory, retain_graph=True)
                reads = int((g[0].abs().sum(-1) > 0).sum())
                assert reads == s_len, (kind, s_len, t_len, t, reads)  # e.g. local: 0 for the first targets


# ------------------------------------------------- Linformer: the cross-attention's max_len
def test_linformer_cross_attention_names_its_own_max_len() -> None:
    """A 12-token source over a cross-attention Linformer with max_len=8 names the
    encoder-decoder's own option (not "12 keys exceed attention.max_len=8": there is no such
    option there)."""
    from rl_tformers.encoder_decoder import EncoderDecoder

    stack = {"d_model": 16, "n_heads": 2, "n_layers": 1}
    model = EncoderDecoder({"encoder": stack, "decoder": stack,
                            "cross_attention": {"kind": "linformer", "k": 4, "max_len": 8}})
    with pytest.raises(ValueError) as err:
        model(torch.randn(1, 12, 16), torch.randn(1, 3, 16))
    assert str(err.value) == ("attention kind 'linformer': 12 keys exceed cross_attention.max_len=8 "
                              "(E and F have a fixed length)")
    # the encoder's own Linformer names the encoder's option
    model = EncoderDecoder({"encoder": {**stack, "attention": {"kind": "linformer", "k": 4, "max_len": 8}},
                            "decoder": stack, "cross_attention": {"kind": "linformer", "k": 4, "max_len": 16}})
    with pytest.raises(ValueError) as err:
        model(torch.randn(1, 12, 16), torch.randn(1, 3, 16))
    assert str(err.value) == ("attention kind 'linformer': 12 keys exceed encoder.attention.max_len=8 "
                              "(E and F have a fixed length)")
    model(torch.randn(1, 8, 16), torch.randn(1, 3, 16))  # within both: runs


# ------------------------------------------------- blockwise: no cross-attention
def test_blockwise_is_refused_as_cross_attention() -> None:
    """Refused when the config is built, naming the option and the kinds that work: source
    padding would change the real targets' outputs (three trailing pad tokens on a 6-token
    source move them by 0.46: blocks of ceil(S / n) cut over the padded S). Blockwise
    self-attention in the encoder is accepted."""
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoder
    from rl_tformers.registry import ATTENTION

    assert ATTENTION.get("blockwise").capabilities.cross_attention is False
    with pytest.raises(IncompatibleConfig) as err:
        EncoderDecoder({"cross_attention": {"kind": "blockwise", "n_blocks": 3}})
    assert str(err.value).startswith("cross_attention.kind='blockwise' cannot attend to another sequence: ")
    assert str(err.value).endswith("use one of linformer, performer, reference, rfa, sdpa")
    stack = {"d_model": 16, "n_heads": 2, "n_layers": 1}
    model = EncoderDecoder({"encoder": {**stack, "n_heads": 4, "attention": {"kind": "blockwise", "n_blocks": 3}},
                            "decoder": stack})
    assert model(torch.randn(1, 6, 16), torch.randn(1, 9, 16)).hidden.shape == (1, 9, 16)


# ------------------------------------------------- encoder-decoder shapes and decoder kinds
def _encdec() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder({"encoder": {"d_model": 16, "n_layers": 1, "n_heads": 2},
                           "decoder": {"d_model": 16, "n_layers": 1, "n_heads": 2}}).eval()


@pytest.mark.parametrize("kwargs, message", [
    ({"memory": (1, 5, 16)}, "memory (the encoder output) must be (2, S, 16) for tgt of shape (2, 4, 16), got (1, 5, 16)"),
    ({"memory": (2, 5, 8)}, "memory (the encoder output) must be (2, S, 16)"),
    ({"src_mask": (1, 5)}, "src_mask must be (2, 5) (B, S), got (1, 5)"),
    ({"src_mask": (2, 6)}, "src_mask must be (2, 5) (B, S), got (2, 6)"),
    ({"tgt_mask": (4,)}, "tgt_mask must be (2, 4) (B, T), got (4,)"),
    ({"tgt_pos": (2, 5)}, "tgt_pos must be (2, 4) (B, T), got (2, 5)"),
    ({"src_pos": (1, 5)}, "src_pos must be (2, 5) (B, S), got (1, 5)"),
])
def test_encoder_decoder_decode_refuses_mismatched_shapes(kwargs, message) -> None:
    """A memory or source mask of batch 1 is refused, not broadcast over the batch silently;
    other mismatches name the argument instead of failing deep in the kernels."""
    m = _encdec()
    tgt = torch.randn(2, 4, 16)
    mem = torch.randn(*kwargs.pop("memory", (2, 5, 16)))
    args = {}
    for name, shape in kwargs.items():
        args[name] = torch.ones(shape, dtype=torch.bool) if "mask" in name else torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError) as info:
        m.decode(tgt, mem, **args)
    assert message in str(info.value)


def test_encoder_decoder_forward_refuses_different_batch_sizes() -> None:
    with pytest.raises(ValueError, match=r"src \(3, 5, 16\) and tgt \(2, 4, 16\) must have the same batch size"):
        _encdec()(torch.randn(3, 5, 16), torch.randn(2, 4, 16))


@pytest.mark.parametrize("kind", ["longformer", "bigbird", "blockwise", "linformer"])
def test_causal_decoder_refuses_a_kernel_without_a_causal_form(kind) -> None:
    """The decoder stack is no Backbone, so nothing checked it: longformer/bigbird/blockwise ran
    in a causal decoder (a form their registry entry says they lack) and linformer failed only
    at the first forward, naming backbone.causal."""
    with pytest.raises(IncompatibleConfig) as info:
        EncoderDecoderConfig.from_dict({"decoder": {"attention": {"kind": kind}}})
    msg = str(info.value)
    assert msg.startswith(f"decoder.attention.kind={kind!r} has no causal form; set decoder.causal=false")
    assert "backbone." not in msg and "Decision Transformer" not in msg


def test_encoder_decoder_field_errors_name_the_encoder_or_decoder() -> None:
    with pytest.raises(RegistryError, match=r"^decoder\.attention\.window: unknown key"):
        EncoderDecoderConfig.from_dict({"decoder": {"attention": {"kind": "local", "window": 3}}})
    with pytest.raises(RegistryError, match=r"^encoder\.n_layer: unknown backbone field"):
        EncoderDecoderConfig.from_dict({"encoder": {"n_layer": 3}})


def test_the_attention_dropout_warning_names_the_cross_attention_kind():
    from rl_tformers.encoder_decoder import EncoderDecoder

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EncoderDecoder({"encoder": {"d_model": 32, "n_heads": 2, "n_layers": 2},
                        "decoder": {"d_model": 32, "n_heads": 2, "n_layers": 2, "attn_dropout": 0.1},
                        "cross_attention": {"kind": "performer"}})
    msgs = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("attention kind 'performer' forms no attention probabilities")


# ------------------------------------------------- encoder-decoder: cross-attention kinds that need S == T
def test_sinkhorn_cross_attention_is_refused_at_construction_naming_the_option() -> None:
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    with pytest.raises(IncompatibleConfig, match=r"cross_attention\.kind='sinkhorn' .*its queries must be its keys"):
        EncoderDecoderConfig.from_dict({"cross_attention": {"kind": "sinkhorn", "block_size": 2, "max_len": 16}})


def test_cross_attention_capability_is_truthful_for_every_attention_kind() -> None:
    """Kinds declaring ``cross_attention`` run with S > T and S < T source keys; the others are
    refused when the config is built."""
    from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
    from rl_tformers.registry import ATTENTION

    small = {"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0, "dropout": 0.0}
    src = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))
    tgt = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    for e in ATTENTION:
        spec = {"encoder": small, "decoder": small, "cross_attention": {"kind": e.kind}}
        if not (e.capabilities.cross_attention and e.capabilities.bidirectional):
            with pytest.raises(IncompatibleConfig, match=rf"cross_attention\.kind='{e.kind}'"):
                EncoderDecoderConfig.from_dict(spec)
            continue
        torch.manual_seed(0)
        model = EncoderDecoder(spec).eval()
        for s, t in ((src, tgt), (src[:, :4], tgt)):
            out = model(s, t).hidden
            assert out.shape == t.shape and torch.isfinite(out).all(), e.kind
