"""The vanilla Transformer encoder-decoder (Vaswani et al. 2017) built from backbone configs.

The encoder is a :class:`~rl_tformers.backbone.Backbone` (any registered kinds, usually
bidirectional). Each decoder layer has masked self-attention, cross-attention over the encoder
output and a feed-forward network (Vaswani et al. 2017, sec. 3.1, fig. 1)::

    post_norm:  y = LN(y + SelfAttn(y));  y = LN(y + CrossAttn(y, enc));  y = LN(y + FFN(y))
    pre_norm:   y = y + SelfAttn(LN(y));  y = y + CrossAttn(LN(y), enc);  y = y + FFN(LN(y))

Config (dict/YAML)::

    encoder: {d_model: 64, n_layers: 2, n_heads: 4, causal: false, block: {kind: post_norm}, ...}
    decoder: {d_model: 64, n_layers: 2, n_heads: 4, causal: true, block: {kind: post_norm}, ...}
    cross_attention: {kind: sdpa}

Partial ``encoder``/``decoder`` dicts are merged over the vanilla defaults (post-norm,
sinusoidal positions, ReLU, no final norm; encoder bidirectional, decoder causal).
The decoder's self-attention kind and positional kind come from ``decoder``; cross-attention
uses ``cross_attention`` (a kernel that accepts S != T keys without a causal mask, e.g. ``sdpa``:
``Capabilities.cross_attention`` and ``bidirectional``, checked when the config is built)
with no positional term (positions of source and target live in different sequences).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.backbone import Backbone, check_compatible
from rl_tformers.backbone_config import BackboneConfig, BuildContext, IncompatibleConfig
from rl_tformers.blocks.base import build_ffn
from rl_tformers.dropout import Dropout
from rl_tformers.position.base import PositionModule, check_position_dtype
from rl_tformers.registry import ATTENTION, REGISTRIES, config_to_dict
from rl_tformers.types import AttnContext, BackboneOutput, merge_into

_VANILLA = {
    "block": {"kind": "post_norm"},
    "position": {"kind": "sinusoidal"},
    "activation": "relu",
    "final_norm": False,
}


def _vanilla(causal: bool, overrides: Mapping[str, Any] | BackboneConfig | None = None,
             where: str = "backbone") -> BackboneConfig:
    """The vanilla stack config with ``overrides`` (a partial dict) merged over it; a built
    :class:`BackboneConfig` is taken as it is (as ``EncoderDecoderConfig(encoder=...)`` does)."""
    if isinstance(overrides, BackboneConfig):
        return overrides
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"{where}: expected a BackboneConfig or a mapping of its fields, got {type(overrides).__name__}")
    data = {**_VANILLA, "causal": causal, **dict(overrides or {})}
    return BackboneConfig.from_dict(data, where=where)


def _check_stack(cfg: BackboneConfig, name: str) -> None:
    """:func:`~rl_tformers.backbone.check_compatible` for the ``encoder``/``decoder`` stack, its
    messages naming ``name.`` options instead of ``backbone.`` ones (the decoder stack is no
    :class:`Backbone`, so nothing else checks it: a kernel without a causal form would run in a
    causal decoder)."""
    try:
        check_compatible(cfg)
    except IncompatibleConfig as exc:
        msg = re.sub(r" \(for the Decision Transformer[^)]*\)", "", str(exc))  # a hint for another model
        raise IncompatibleConfig(msg.replace("backbone.", f"{name}.")) from exc


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Configuration of :class:`EncoderDecoder`.

    Attributes:
        encoder: :class:`BackboneConfig` of the encoder (default: vanilla, bidirectional).
        decoder: :class:`BackboneConfig` of the decoder stack (default: vanilla, causal). Its
            ``block.kind`` must be ``post_norm`` or ``pre_norm``, ``memory.kind`` ``none`` and
            ``depth.kind`` ``fixed``.
        cross_attention: attention config of the cross-attention (default ``sdpa``).

    Raises:
        IncompatibleConfig: mismatched widths, an unsupported decoder block/memory/depth kind,
            a causal-only cross-attention kind, or one that cannot take keys of another
            sequence of any length (``Capabilities.cross_attention`` false: ``sinkhorn``, whose
            queries are its keys, the kinds whose queries are the last T keys, among them the
            key-index patterns ``local``, ``strided``, ``sliding_window``..., and ``blockwise``,
            whose query block i reads a key block of the same sequence); each message names
            the option. Also whatever :func:`~rl_tformers.backbone.check_compatible` refuses in
            either stack (named ``encoder.`` / ``decoder.``).
        TypeError: ``encoder`` / ``decoder`` neither a :class:`BackboneConfig` nor a mapping, or
            ``cross_attention`` neither an attention config nor a mapping.
    """

    encoder: BackboneConfig = field(default_factory=lambda: _vanilla(False))
    decoder: BackboneConfig = field(default_factory=lambda: _vanilla(True))
    cross_attention: Any = field(default_factory=lambda: ATTENTION.get("sdpa").config_cls())

    def __post_init__(self) -> None:
        # mappings given to the constructor are built as from_dict builds them (a partial
        # encoder/decoder dict merges over the vanilla stack)
        if not isinstance(self.encoder, BackboneConfig):
            object.__setattr__(self, "encoder", _vanilla(False, self.encoder, where="encoder"))
        if not isinstance(self.decoder, BackboneConfig):
            object.__setattr__(self, "decoder", _vanilla(True, self.decoder, where="decoder"))
        if isinstance(self.cross_attention, Mapping):
            object.__setattr__(self, "cross_attention", ATTENTION.from_dict(self.cross_attention, where="cross_attention"))
        elif not hasattr(self.cross_attention, "kind"):
            raise TypeError(f"cross_attention: expected an attention config or a mapping with kind, got "
                            f"{type(self.cross_attention).__name__}")
        enc, dec = self.encoder, self.decoder
        if enc.d_model != dec.d_model:
            raise IncompatibleConfig(
                f"encoder.d_model={enc.d_model} and decoder.d_model={dec.d_model} must be equal"
            )
        if dec.layers:  # DecoderLayer builds from the decoder-wide slots (Backbone builds the encoder's per layer)
            raise IncompatibleConfig("decoder.layers: the decoder's layers use the decoder-wide attention, position "
                                     "and block; per-layer kinds (layers) are for the encoder; remove decoder.layers")
        if dec.block.kind not in ("post_norm", "pre_norm"):
            raise IncompatibleConfig(f"decoder.block.kind={dec.block.kind!r}; the decoder supports post_norm, pre_norm")
        if dec.memory.kind != "none" or dec.depth.kind != "fixed":
            raise IncompatibleConfig(
                f"decoder.memory.kind={dec.memory.kind!r}, decoder.depth.kind={dec.depth.kind!r}: "
                f"the decoder supports memory none and depth fixed"
            )
        attn = REGISTRIES["attention"]
        kind = self.cross_attention.kind
        caps = attn.get(kind).capabilities
        usable = [e.kind for e in attn if e.capabilities.cross_attention and e.capabilities.bidirectional]
        if not caps.bidirectional:
            raise IncompatibleConfig(
                f"cross_attention.kind={kind!r} is causal-only; cross-attention sees every source key; kinds that "
                f"can: {', '.join(usable)}"
            )
        if not caps.cross_attention:
            why = ("its queries must be its keys (S == T; no other keys)" if not caps.memory
                   else "its queries must be the last T of its S keys (S >= T)")
            raise IncompatibleConfig(
                f"cross_attention.kind={kind!r} cannot attend to another sequence: {why}, while cross-attention "
                f"takes S encoder outputs as keys for T decoder queries, any S and T; use one of "
                f"{', '.join(usable)}"
            )
        _check_stack(enc, "encoder")
        _check_stack(dec, "decoder")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form ``{encoder, decoder, cross_attention}``; inverse of :meth:`from_dict`."""
        return {
            "encoder": self.encoder.to_dict(),
            "decoder": self.decoder.to_dict(),
            "cross_attention": config_to_dict(self.cross_attention),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | EncoderDecoderConfig | None) -> EncoderDecoderConfig:
        """Build from a (partial) dict; ``encoder``/``decoder`` dicts merge over the vanilla
        defaults, built :class:`BackboneConfig` values are taken as they are. A built
        :class:`EncoderDecoderConfig` is returned as it is.

        Raises:
            TypeError: ``data`` (or its ``encoder``/``decoder``) is neither a mapping nor a built config.
            IncompatibleConfig: a top-level field other than ``encoder``, ``decoder``,
                ``cross_attention``, or any combination the constructor refuses.
        """
        if isinstance(data, EncoderDecoderConfig):
            return data
        if data is not None and not isinstance(data, Mapping):
            raise TypeError(f"encoder_decoder: expected an EncoderDecoderConfig or a mapping with encoder, "
                            f"decoder, cross_attention, got {type(data).__name__}")
        data = dict(data or {})
        unknown = sorted(set(data) - {"encoder", "decoder", "cross_attention"})
        if unknown:
            raise IncompatibleConfig(f"encoder_decoder.{unknown[0]}: unknown field; fields: cross_attention, decoder, encoder")
        kw: dict[str, Any] = {}
        if "encoder" in data:
            kw["encoder"] = _vanilla(False, data["encoder"], where="encoder")
        if "decoder" in data:
            kw["decoder"] = _vanilla(True, data["decoder"], where="decoder")
        if "cross_attention" in data:
            kw["cross_attention"] = ATTENTION.from_dict(data["cross_attention"], where="cross_attention")
        return cls(**kw)

    def replace(self, **changes: Any) -> EncoderDecoderConfig:
        """Copy with ``changes`` (``dataclasses.replace``: the constructor's checks run again)."""
        return dataclasses.replace(self, **changes)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward.

    Shapes: y (B, T, D) target stream, enc (B, S, D) encoder output -> (B, T, D).
    """

    def __init__(self, ctx: BuildContext, position: PositionModule, cross_cfg, pre_norm: bool) -> None:
        super().__init__()
        d = ctx.d_model
        self.self_attn = ctx.config.attention.build(ctx, position)
        self.cross_attn = cross_cfg.build(ctx, PositionModule())
        self.ffn = build_ffn(ctx)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.dropout = Dropout(ctx.config.dropout)
        self.pre_norm = pre_norm

    def forward(self, y: Tensor, enc: Tensor, self_ctx: AttnContext, cross_ctx: AttnContext):
        """Returns (y (B, T, D), aux, metrics)."""
        aux: dict[str, Tensor] = {}
        metrics: dict[str, Any] = {}
        if self.pre_norm:
            h = self.norm1(y)
            a = self.self_attn(h, h, self_ctx)
            y = y + self.dropout(a.out)
            c = self.cross_attn(self.norm2(y), enc, cross_ctx)
            y = y + self.dropout(c.out)
            y = y + self.dropout(self.ffn(self.norm3(y)))
        else:
            a = self.self_attn(y, y, self_ctx)
            y = self.norm1(y + self.dropout(a.out))
            c = self.cross_attn(y, enc, cross_ctx)
            y = self.norm2(y + self.dropout(c.out))
            y = self.norm3(y + self.dropout(self.ffn(y)))
        for prefix, o in (("self/", a), ("cross/", c)):
            merge_into(aux, o.aux)
            merge_into(metrics, o.metrics, prefix=prefix)
        return y, aux, metrics


@dataclass
class EncoderDecoderOutput:
    """hidden (B, T, D) decoder output; memory (B, S, D) encoder output; aux losses; metrics."""

    hidden: Tensor
    memory: Tensor
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def _name_option(module: nn.Module, section: str) -> None:
    """Set ``option`` (the config section their messages name, e.g. ``attention.max_len``) on the
    attention modules under ``module`` that declare one: a source longer than a cross-attention
    Linformer's ``max_len`` must name ``cross_attention.max_len``, not the self-attention's option."""
    for m in module.modules():
        if isinstance(getattr(type(m), "option", None), str):
            m.option = section


def _default_pos(x: Tensor) -> Tensor:
    b, n, _ = x.shape
    return torch.arange(n, device=x.device).expand(b, n)  # (B, L)


class EncoderDecoder(nn.Module):
    """Vanilla Transformer encoder-decoder (Vaswani et al. 2017) on the backbone library.

    ``forward(src (B, S, D), tgt (B, T, D), src_pos, tgt_pos, src_mask, tgt_mask)`` returns
    :class:`EncoderDecoderOutput`. Positions are (B, S)/(B, T) long in the caller's units
    (default arange); masks are (B, S)/(B, T) bool, True = real token. Target query t sees
    target keys <= t (when ``decoder.causal``) and every real source key.
    No incremental decoding: re-run :meth:`decode` on the growing target prefix.

    Args:
        config: :class:`EncoderDecoderConfig` or a dict for :meth:`EncoderDecoderConfig.from_dict`.
    """

    def __init__(self, config: EncoderDecoderConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__()
        config = EncoderDecoderConfig.from_dict(config)  # a built config as it is; a dict merged over the defaults
        self.config = config
        self.encoder = Backbone(config.encoder)
        dec = config.decoder
        ctx = BuildContext(dec)
        pre = dec.block.kind == "pre_norm"
        layers = []
        for i in range(dec.n_layers):
            lctx = ctx.at_layer(i)
            layers.append(DecoderLayer(lctx, dec.position.build(lctx), config.cross_attention, pre))
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(dec.d_model) if dec.final_norm else nn.Identity()
        # kernels that name their options in messages (linformer's max_len) name this model's sections
        _name_option(self.encoder, "encoder.attention")
        for layer in self.layers:
            _name_option(layer.self_attn, "decoder.attention")
            _name_option(layer.cross_attn, "cross_attention")

    def encode(self, src: Tensor, src_pos: Tensor | None = None, src_mask: Tensor | None = None) -> BackboneOutput:
        """Encoder pass: src (B, S, D) -> BackboneOutput with hidden (B, S, D).

        Raises:
            ValueError: as :meth:`rl_tformers.backbone.Backbone.forward` (shapes of ``src``,
                ``src_pos``, ``src_mask``; a non-integer ``src_pos``).
        """
        return self.encoder(src, positions=src_pos, mask=src_mask)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_pos: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        src_pos: Tensor | None = None,
        src_mask: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Any]]:
        """Decoder pass: tgt (B, T, D) over encoder output memory (B, S, D) -> (hidden (B, T, D), aux, metrics).

        Raises:
            ValueError: ``tgt`` not (B, T, D_decoder); ``memory`` not (B, S, D_decoder) for the
                same B (never broadcast from a batch of 1); ``tgt_mask``/``tgt_pos`` not (B, T) or
                ``src_mask``/``src_pos`` not (B, S) (each message names the argument and both
                shapes); ``tgt_pos``/``src_pos`` not of an integer dtype
                (:func:`~rl_tformers.position.base.check_position_dtype`).
        """
        d = self.config.decoder.d_model
        if tgt.dim() != 3 or tgt.shape[-1] != d:
            raise ValueError(f"encoder_decoder: tgt must be (B, T, {d}), got {tuple(tgt.shape)}")
        b, t = tgt.shape[:2]
        if memory.dim() != 3 or memory.shape[0] != b or memory.shape[-1] != d:
            raise ValueError(
                f"encoder_decoder: memory (the encoder output) must be ({b}, S, {d}) for tgt of shape "
                f"{tuple(tgt.shape)}, got {tuple(memory.shape)}")
        s_len = memory.shape[1]
        for name, arr, want in (("tgt_mask", tgt_mask, (b, t)), ("tgt_pos", tgt_pos, (b, t)),
                                ("src_mask", src_mask, (b, s_len)), ("src_pos", src_pos, (b, s_len))):
            if arr is not None and tuple(arr.shape) != want:
                raise ValueError(f"encoder_decoder: {name} must be {want} (B, {'T' if name[0] == 't' else 'S'}), "
                                 f"got {tuple(arr.shape)}")
        for name, pos in (("tgt_pos", tgt_pos), ("src_pos", src_pos)):
            if pos is not None:
                check_position_dtype(pos, "encoder_decoder", name)
        tgt_pos = _default_pos(tgt) if tgt_pos is None else tgt_pos.long()
        src_pos = _default_pos(memory) if src_pos is None else src_pos.long()
        self_ctx = AttnContext(
            pos_q=tgt_pos, pos_k=tgt_pos, key_valid=None if tgt_mask is None else tgt_mask.bool(),
            causal=self.config.decoder.causal,
        )
        cross_ctx = AttnContext(
            pos_q=tgt_pos, pos_k=src_pos, key_valid=None if src_mask is None else src_mask.bool(), causal=False
        )
        aux: dict[str, Tensor] = {}
        metrics: dict[str, Any] = {}
        if t == 0:  # no target token to compute (as Backbone.forward with an empty segment)
            return self.final_norm(tgt), aux, metrics
        y = tgt
        for i, layer in enumerate(self.layers):
            self_ctx.layer_idx = cross_ctx.layer_idx = i
            y = layer.self_attn.position.embed(y, tgt_pos)
            y, a, m = layer(y, memory, self_ctx, cross_ctx)
            merge_into(aux, a)
            merge_into(metrics, m, prefix=f"decoder/layer{i}/")
        return self.final_norm(y), aux, metrics

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_pos: Tensor | None = None,
        tgt_pos: Tensor | None = None,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> EncoderDecoderOutput:
        """Encode ``src`` (B, S, D), decode ``tgt`` (B, T, D) over it (see :meth:`decode`).

        Raises:
            ValueError: ``src`` and ``tgt`` of different batch sizes (never broadcast), or any
                shape :meth:`encode` / :meth:`decode` refuse.
        """
        if src.dim() == 3 and tgt.dim() == 3 and src.shape[0] != tgt.shape[0]:
            raise ValueError(f"encoder_decoder: src {tuple(src.shape)} and tgt {tuple(tgt.shape)} must have the "
                             f"same batch size")
        enc = self.encode(src, src_pos, src_mask)
        hidden, aux, metrics = self.decode(tgt, enc.hidden, tgt_pos, tgt_mask, src_pos, src_mask)
        merge_into(aux, enc.aux)
        merge_into(metrics, enc.metrics, prefix="encoder/")
        return EncoderDecoderOutput(hidden=hidden, memory=enc.hidden, aux=aux, metrics=metrics)
