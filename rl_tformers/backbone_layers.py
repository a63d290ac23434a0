"""Per-layer stacks: ``backbone.layers``, a list of per-layer overrides of the slots a layer owns.

A layer owns three slots: its ``attention`` kernel, its ``position`` hooks and its residual
``block``. ``memory`` (one state layout for the whole stack) and ``depth`` (who runs the
blocks) stay backbone-wide. Each entry of ``backbone.layers`` is a partial mapping of those three
slots, merged over the backbone-wide slot config::

    backbone:
      n_layers: 4
      attention: {kind: local, block: 16, memory: 16}
      layers:                                   # one entry per layer ...
        - {}
        - {}
        - {attention: {kind: routing, n_clusters: 4}}
        - {attention: {kind: routing, n_clusters: 4}}

    backbone:
      n_layers: 6
      layers:                                   # ... or a pattern repeated up the stack
        - {attention: {kind: strided, stride: 8}}
        - {attention: {kind: fixed, stride: 8}}

The list holds ``n_layers`` entries, or a pattern of k entries, k dividing ``n_layers``, applied
to layers i = 0 .. n_layers - 1 as entry ``i mod k`` (x-transformers' ``custom_layers`` /
``default_block`` repeated up the depth). Within an entry a slot given without ``kind``, or with
the backbone-wide kind, takes the backbone-wide fields with the entry's fields over them
(``{attention: {window: 64}}`` over a backbone-wide ``sliding_window``: the same kind, a wider
window); a slot with another kind starts from that kind's defaults, as a ``kind`` override of a
backbone-wide slot does. The resolved configs are stored (:class:`LayerOverride`), so
``to_dict()`` writes every field of every overridden slot and round-trips.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rl_tformers.registry import REGISTRIES, RegistryError, config_to_dict

#: The slots a layer may set for itself (the others are backbone-wide).
LAYER_SLOTS = ("attention", "position", "block")


@dataclass(frozen=True)
class LayerOverride:
    """The slots one entry of ``backbone.layers`` sets; None = the backbone-wide config.

    Attributes:
        attention, position, block: resolved slot configs (registered config dataclasses).
    """

    attention: Any = None
    position: Any = None
    block: Any = None

    def slots(self) -> tuple[str, ...]:
        """The slots this entry sets, in :data:`LAYER_SLOTS` order."""
        return tuple(s for s in LAYER_SLOTS if getattr(self, s) is not None)

    def to_dict(self) -> dict[str, Any]:
        """``{slot: {kind: ..., <every field>}}`` for the slots it sets (``{}`` for none)."""
        return {s: config_to_dict(getattr(self, s)) for s in self.slots()}


def _entry_key_error(key: Any, where: str) -> RegistryError:
    """The error of a key of a layer entry that is not one of :data:`LAYER_SLOTS`."""
    if key in ("memory", "depth"):
        return RegistryError(
            f"{where}.{key}: backbone.{key} is backbone-wide (one {key} for the whole stack); a layer sets only "
            f"{', '.join(LAYER_SLOTS)}; set backbone.{key} instead")
    close = difflib.get_close_matches(str(key), LAYER_SLOTS, n=1)
    hint = f"; did you mean {where}.{close[0]}?" if close else ""
    return RegistryError(f"{where}.{key}: unknown key{hint} (a layer sets: {', '.join(LAYER_SLOTS)})")


def resolve_entry(entry: Any, base: Mapping[str, Any], where: str) -> LayerOverride:
    """One entry of ``backbone.layers`` as a :class:`LayerOverride`.

    Args:
        entry: a mapping of some of :data:`LAYER_SLOTS` to partial slot mappings (or built slot
            configs), or a :class:`LayerOverride` (returned as it is).
        base: the backbone-wide slot configs, ``{slot: config}``.
        where: dotted path of the entry in messages, e.g. ``backbone.layers[2]``.

    Raises:
        RegistryError: the entry is not a mapping; a key that is not a layer slot (did-you-mean;
            ``memory`` and ``depth`` are named backbone-wide); a slot value that is not a
            mapping; an unknown kind or field, or a bad field value (``where.<slot>.<field>``).
    """
    if isinstance(entry, LayerOverride):
        return entry
    if not isinstance(entry, Mapping):
        raise RegistryError(f"{where}: expected a mapping of {', '.join(LAYER_SLOTS)} (e.g. "
                            f"{{attention: {{kind: local}}}}), got {type(entry).__name__}")
    for key in entry:
        if key not in LAYER_SLOTS:
            raise _entry_key_error(key, where)
    out: dict[str, Any] = {}
    for slot, value in entry.items():
        kind = value.get("kind") if isinstance(value, Mapping) else None
        if kind is not None and str(kind) not in REGISTRIES[slot]:
            known = REGISTRIES[slot].kinds()
            close = difflib.get_close_matches(str(kind), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise RegistryError(f"{where}.{slot}.kind={kind!r}: unknown {slot} kind{hint} (registered: "
                                f"{', '.join(known)}; a kind of your own registers when its module is listed in plugins)")
        if isinstance(value, Mapping) and value.get("kind", base[slot].kind) == base[slot].kind:
            value = {**config_to_dict(base[slot]), **value}  # same kind: the entry's fields over the backbone's
        out[slot] = REGISTRIES[slot].from_dict(value, where=f"{where}.{slot}")
    return LayerOverride(**out)


def resolve_layers(layers: Any, base: Mapping[str, Any], n_layers: int) -> tuple[LayerOverride, ...]:
    """``backbone.layers`` as a tuple of :class:`LayerOverride` (see the module docstring).

    Raises:
        RegistryError: ``layers`` is not a list, an entry is malformed (:func:`resolve_entry`).
        ValueError: the list's length neither equals ``n_layers`` nor divides it.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise RegistryError(f"backbone.layers: expected a list of per-layer entries, got {type(layers).__name__}")
    out = tuple(resolve_entry(e, base, f"backbone.layers[{i}]") for i, e in enumerate(layers))
    if out and n_layers % len(out):
        fits = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
        raise ValueError(
            f"backbone.layers has {len(out)} entries for backbone.n_layers={n_layers}; give one entry per layer "
            f"({n_layers}), or a pattern repeated up the stack whose length divides it ({', '.join(map(str, fits))})")
    return out


def entry_index(n_entries: int, layer: int) -> int:
    """The entry of ``backbone.layers`` (``n_entries`` long) that layer ``layer`` uses."""
    return layer % n_entries
