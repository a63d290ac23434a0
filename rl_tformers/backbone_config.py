"""Typed, frozen configs for the backbone and its five slots.

A backbone config has scalar fields (model width, depth, heads, dropout...) and five slots
(``attention``, ``position``, ``memory``, ``block``, ``depth``); each slot holds one registered
config whose kind is its tag in YAML::

    backbone:
      d_model: 128
      n_layers: 3
      n_heads: 1
      attention: {kind: sdpa}
      position: {kind: rotary}
      block: {kind: gated, gate: gru}

``layers`` sets the attention, position and block slots per layer (a list of partial overrides
merged over the backbone-wide slots: :mod:`rl_tformers.backbone_layers`).

:meth:`BackboneConfig.from_dict` / :meth:`BackboneConfig.to_dict` round-trip through plain
dicts (and so through YAML/OmegaConf). Unknown fields raise with the dotted path at fault.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rl_tformers.backbone_layers import LAYER_SLOTS, LayerOverride, entry_index, resolve_layers
from rl_tformers.registry import REGISTRIES, SLOTS, Capabilities, RegistryError, config_to_dict
from rl_tformers.typed_config import plain_number


class ConfigAdviceWarning(UserWarning):
    """A setting of the backbone config has no effect, said when the backbone is built (e.g.
    ``attn_dropout`` with a kernel that forms no attention probabilities).

    Actionable only where the config is chosen, before training: rebuilding a trained run for
    evaluation or plotting (:func:`rl_tformers.runtime.loading.load_run`) silences it.
    """


class IncompatibleConfig(ValueError):
    """Raised at construction when two slots cannot work together (the message names both).

    Also importable as ``rl_tformers.backbone.IncompatibleConfig``; it lives here so that slot
    configs' ``check(backbone_cfg)`` hooks can raise it without importing the backbone.
    """


@dataclass(frozen=True)
class SlotConfig:
    """Base of every slot config. Subclasses are frozen dataclasses registered per slot."""

    kind = "?"  # set by Registry.register
    slot = "?"

    def __post_init__(self) -> None:
        """Field checks of the kind (none here). Defined on the base so that every subclass's
        dataclass ``__init__`` calls ``__post_init__``: ``Registry.register`` wraps it with the
        field type check (:func:`rl_tformers.registry.check_field_types`)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form ``{"kind": ..., <fields>}`` (what the slot's ``from_dict`` reads)."""
        return config_to_dict(self)

    def config_capabilities(self) -> Capabilities:
        """The capabilities of this configuration: the kind's declared ones (``capabilities``,
        set by ``Registry.register``), unless a field changes one, e.g. ``blockwise`` is
        subquadratic only with a fixed block length (``block > 0``). The construction checks
        and the contract suite read these."""
        return type(self).capabilities  # type: ignore[attr-defined]


@dataclass(frozen=True)
class BuildContext:
    """What a slot config needs to build its module for one layer.

    Attributes:
        config: the whole backbone config (read-only).
        layer_idx: index of the layer being built (0-based); -1 for backbone-level modules.
        shared: scratch dict shared by every layer of one backbone build (``at_layer`` keeps
            the same dict), for parameters tied across layers (e.g. Linformer's layer-wise
            shared projection). Not part of the configuration.
    """

    config: BackboneConfig
    layer_idx: int = -1
    shared: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def d_model(self) -> int:
        """D, the model width."""
        return self.config.d_model

    @property
    def n_heads(self) -> int:
        """H, the number of attention heads."""
        return self.config.n_heads

    @property
    def head_dim(self) -> int:
        """Dh = D // H."""
        return self.config.d_model // self.config.n_heads

    @property
    def n_layers(self) -> int:
        """N, the number of blocks."""
        return self.config.n_layers

    def at_layer(self, i: int) -> BuildContext:
        """This context for layer ``i``: its config is layer ``i``'s
        (:meth:`BackboneConfig.layer_config`: the backbone-wide one with that layer's attention,
        position and block), with the same ``shared`` dict."""
        return dataclasses.replace(self, config=self.config.layer_config(i), layer_idx=i)


def _default(slot: str, kind: str) -> Any:
    def make() -> Any:  # the components are registered: importing this module imported rl_tformers
        return REGISTRIES[slot].get(kind).config_cls()

    return field(default_factory=make)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class BackboneConfig:
    """Configuration of a :class:`rl_tformers.backbone.Backbone`.

    Attributes:
        d_model: model width D.
        n_layers: number of blocks N.
        n_heads: attention heads H (``d_model`` must be divisible by it).
        d_ff: feed-forward width (``None``, the default: 4 * d_model; 0 is refused).
        dropout: residual/feed-forward dropout probability, in [0, 1).
        attn_dropout: dropout on attention probabilities, in [0, 1).
        ffn_dropout: dropout on the feed-forward hidden layer (after the activation); ``None``
            (default) = ``dropout``. GPT-2, and so the Decision Transformer reference code,
            has none there: ``ffn_dropout=0`` reproduces that placement (and on CPU saves the
            random numbers of the widest activation, about 60% of all dropout draws).
        activation: feed-forward activation, one of ``gelu``, ``relu``, ``gelu_tanh``.
        ffn_chunks: number of chunks along T for the chunked feed-forward (Reformer, Kitaev
            et al. 2020, section 3); 1 = no chunking. Same result, lower peak memory.
        causal: causal self-attention (query t sees keys <= t).
        max_position: largest position index learned tables must cover (positions are
            caller units, e.g. token index); larger positions raise.
        final_norm: apply a LayerNorm to the output (pre-norm/gated stacks).
        checkpoint: gradient checkpointing of every block (Chen et al. 2016; the Sparse
            Transformer's recomputation, Child et al. 2019 sec. 5.4): while gradients are
            recorded a block keeps only its input and runs its forward again in the backward
            pass (the same gradients, less activation memory, one more forward per block).
            Reversible blocks recompute by construction and refuse it.
        attention, position, memory, block, depth: the five slots.
        layers: per-layer overrides of the ``attention``, ``position`` and ``block`` slots: a
            list of ``n_layers`` entries, or a pattern whose length divides ``n_layers``,
            repeated up the stack; each entry a partial ``{attention: ..., position: ...,
            block: ...}`` merged over the backbone-wide slot (same kind: its fields over the
            backbone's; another kind: that kind's defaults). Empty (the default): every layer
            uses the backbone-wide slots. Stored resolved (:class:`LayerOverride`);
            :meth:`layer_config` gives one layer's config. See :mod:`rl_tformers.backbone_layers`.

    Raises:
        ValueError: naming ``backbone.<field>``: ``d_model``, ``n_layers``, ``n_heads``,
            ``d_ff``, ``ffn_chunks`` or ``max_position`` not an integer >= 1 (``16.0`` and
            ``"2"`` included), a dropout outside [0, 1) or not a number, ``causal``,
            ``final_norm`` or ``checkpoint`` not a bool, ``d_model`` not divisible by ``n_heads``, an unknown
            activation; ``layers`` of a length that neither equals nor divides ``n_layers``.
            RegistryError: a bad slot config, or a bad ``layers`` entry (the message names
            ``backbone.layers[i]`` and the key at fault).

    Numbers of other types (NumPy ``int64`` / ``float32`` scalars from a sweep) are stored as
    built-in ``int`` / ``float``, in slot configs too, so :meth:`to_dict` always dumps to
    YAML, OmegaConf and JSON.
    """

    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 1
    d_ff: int | None = None
    dropout: float = 0.1
    attn_dropout: float = 0.1
    ffn_dropout: float | None = None
    activation: str = "gelu"
    ffn_chunks: int = 1
    causal: bool = True
    max_position: int = 4096
    final_norm: bool = True
    checkpoint: bool = False
    attention: Any = _default("attention", "sdpa")
    position: Any = _default("position", "none")
    memory: Any = _default("memory", "none")
    block: Any = _default("block", "pre_norm")
    depth: Any = _default("depth", "fixed")
    layers: tuple[LayerOverride, ...] = ()

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "ffn_chunks", "max_position"):
            value = getattr(self, name)
            if name == "d_ff" and value is None:
                continue  # the default, 4 * d_model
            if not _is_int(value) or value < 1:
                default = " or null (4 * d_model)" if name == "d_ff" else ""
                raise ValueError(f"backbone.{name} must be an integer >= 1{default}, got {value!r}")
            object.__setattr__(self, name, plain_number(value))  # NumPy integers -> int (to_dict dumps)
        for name in ("dropout", "attn_dropout", "ffn_dropout"):
            value = getattr(self, name)
            if name == "ffn_dropout" and value is None:
                continue  # the default, dropout
            if not _is_real(value) or not 0.0 <= value < 1.0:
                default = " or null (= backbone.dropout)" if name == "ffn_dropout" else ""
                raise ValueError(f"backbone.{name} must be a probability in [0, 1){default}, got {value!r}")
            object.__setattr__(self, name, plain_number(value))  # NumPy floats -> float
        for name in ("causal", "final_norm", "checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"backbone.{name} must be true or false, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"backbone.d_model={self.d_model} is not divisible by backbone.n_heads={self.n_heads}")
        if not isinstance(self.activation, str) or self.activation not in ("gelu", "relu", "gelu_tanh"):
            raise ValueError(f"backbone.activation={self.activation!r}; use gelu, relu or gelu_tanh")
        object.__setattr__(self, "activation", str(self.activation))  # a str subclass (numpy.str_) -> str
        for slot in SLOTS:
            value = getattr(self, slot)
            if isinstance(value, Mapping):
                object.__setattr__(self, slot, REGISTRIES[slot].from_dict(value, where=f"backbone.{slot}"))
            elif getattr(value, "slot", None) != slot:
                raise RegistryError(f"backbone.{slot}: expected a {slot} config, got {value!r}")
        base = {slot: getattr(self, slot) for slot in LAYER_SLOTS}
        object.__setattr__(self, "layers", resolve_layers(self.layers, base, self.n_layers))

    @property
    def ff_dim(self) -> int:
        """Feed-forward hidden width: ``d_ff``, or 4 * ``d_model`` when ``d_ff`` is None."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def head_dim(self) -> int:
        """Dh = ``d_model`` // ``n_heads``."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (slot configs as ``{kind: ..., ...}``); inverse of :meth:`from_dict`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in SLOTS:
                v = config_to_dict(v)
            elif f.name == "layers":
                v = [entry.to_dict() for entry in v]
            out[f.name] = v
        return out

    # -- per-layer stacks ------------------------------------------------------------------------
    def layer_entry(self, i: int) -> LayerOverride | None:
        """The entry of ``layers`` that layer ``i`` (0-based) uses; None without ``layers``."""
        return self.layers[entry_index(len(self.layers), i)] if self.layers else None

    def layer_config(self, i: int) -> BackboneConfig:
        """Layer ``i``'s config: this one with the attention, position and block its entry of
        ``layers`` sets, and no ``layers`` (this config itself when there are none).

        Raises:
            IndexError: ``i`` outside [0, n_layers).
        """
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} of a backbone with n_layers={self.n_layers}")
        entry = self.layer_entry(i)
        if entry is None:
            return self
        return dataclasses.replace(self, layers=(), **{s: getattr(entry, s) for s in entry.slots()})

    def per_layer(self, slot: str) -> list[tuple[str, Any]]:
        """``(where, config)`` of ``slot`` for every layer, bottom first: ``where`` is the
        dotted path that sets it (``backbone.attention`` or ``backbone.layers[k].attention``),
        for messages; what agents and checks read when every layer's kind matters."""
        out = []
        for i in range(self.n_layers):
            entry = self.layer_entry(i)
            own = entry is not None and slot in LAYER_SLOTS and getattr(entry, slot) is not None
            out.append((self.layer_path(i, slot) if own else f"backbone.{slot}", getattr(self.layer_config(i), slot)))
        return out

    def layer_path(self, i: int, slot: str) -> str:
        """The dotted path of layer ``i``'s entry for ``slot``: ``backbone.layers[k].<slot>``,
        k = i, or i mod (number of entries) when a pattern repeats."""
        return f"backbone.layers[{entry_index(len(self.layers), i)}].{slot}"

    def at_layer_message(self, i: int, message: str) -> str:
        """``message`` (about layer ``i``'s config) with each ``backbone.<slot>`` that layer
        ``i``'s entry sets written as its entry's path (``backbone.layers[2].attention``), and
        ``layer i: `` in front when the message names no entry or a pattern repeats."""
        entry = self.layer_entry(i)
        out = message
        for slot in entry.slots() if entry is not None else ():
            out = re.sub(rf"\bbackbone\.{slot}\b", self.layer_path(i, slot), out)
        named = entry is not None and out != message or "backbone.layers[" in message
        return out if named and not self.layers_repeat else f"layer {i}: {out}"

    @property
    def layers_repeat(self) -> bool:
        """True when ``layers`` is a pattern shorter than the stack (repeated up it)."""
        return bool(self.layers) and len(self.layers) != self.n_layers

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | BackboneConfig | None, where: str = "backbone") -> BackboneConfig:
        """Build from a (possibly partial) dict; missing fields take their defaults.

        ``data`` may also be a built :class:`BackboneConfig` (returned as it is).

        Raises:
            RegistryError / ValueError naming the dotted path of an unknown or bad field.
            TypeError: ``data`` is neither a mapping, a :class:`BackboneConfig` nor None.
        """
        if isinstance(data, BackboneConfig):
            return data
        if data is not None and not isinstance(data, Mapping):
            raise TypeError(f"{where}: expected a BackboneConfig or a mapping of its fields "
                            f"(e.g. {{'d_model': 64, 'attention': {{'kind': 'sdpa'}}}}), got {type(data).__name__}")
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), sorted(names), n=1)
            hint = f"; did you mean {where}.{close[0]}?" if close else ""
            raise RegistryError(f"{where}.{unknown[0]}: unknown backbone field{hint} "
                                f"(fields: {', '.join(sorted(names))})")
        defaults = {f.name: f.default_factory() for f in dataclasses.fields(cls) if f.name in SLOTS}  # type: ignore[misc]
        for slot in SLOTS:
            if slot in data:
                data[slot] = REGISTRIES[slot].from_dict(data[slot], where=f"{where}.{slot}",
                                                        default_kind=defaults[slot].kind)
        return cls(**data)

    def replace(self, **changes: Any) -> BackboneConfig:
        """Copy with ``changes`` (``dataclasses.replace``: the field checks run again and raise
        as the constructor does; a slot may be given as a dict)."""
        return dataclasses.replace(self, **changes)
