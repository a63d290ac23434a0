"""Registries of backbone components, one per slot.

Every attention kernel, positional encoding, memory, block type and depth scheme registers
its *config class* under a ``kind`` string in the registry of its slot. The config class is a
frozen dataclass whose ``build(...)`` makes the module, so the kind string appears in the
class decorator and in YAML, nowhere else (d3rlpy-style tagged factories, timm-style registry).

Capabilities are declared at registration and drive the contract suite in
``tests/contracts/`` (a new variant is tested the moment it registers) and the construction
checks in :class:`rl_tformers.backbone.Backbone` (an unsupported combination is refused with an
error that names both sides).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rl_tformers.typed_config import ConfigFieldError, check_fields, plain_number  # noqa: F401  (re-exported)

T = TypeVar("T")

SLOTS = ("attention", "position", "memory", "block", "depth")


@dataclass(frozen=True)
class Capabilities:
    """What a registered component supports; the contract suite selects tests by these flags.

    Attributes:
        causal: can be used with a causal mask (query i sees keys j <= i only).
        bidirectional: can be used without a causal mask.
        key_padding: honours a key-padding mask (padded keys never change a valid output).
        memory: accepts extra prefix keys/values (Transformer-XL style memory, KV caches).
        incremental: step-by-step decoding with a cache equals the full forward pass.
        stateful: carries state between calls (memory kinds, caches).
        exact: equals dense masked softmax attention restricted to its pattern.
        approximate: approximates dense attention; converges as its budget grows.
        subquadratic: never materialises an L x L score matrix.
        exact_chunking: a long sequence in segments with carried state equals one pass.
        cross_attention: (attention kinds) takes the keys and values of another sequence, of
            any length S (longer or shorter than the T queries, which need not be among the
            keys): usable as the encoder-decoder's ``cross_attention.kind``. Kinds whose
            queries must be the last T of their keys (S >= T: the self-attention / memory
            layout, e.g. patterns on key indices), or all of them (S == T), or whose pattern
            pairs blocks of one sequence (``blockwise``) lack it.
        positions: positional kinds this component works with (``None`` = all).
    """

    causal: bool = True
    bidirectional: bool = True
    key_padding: bool = True
    memory: bool = False
    incremental: bool = False
    stateful: bool = False
    exact: bool = True
    approximate: bool = False
    subquadratic: bool = False
    exact_chunking: bool = False
    cross_attention: bool = True
    positions: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """Names of the true boolean flags, for listings."""
        return [k for k, v in dataclasses.asdict(self).items() if v is True]


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its slot, kind, config class and documentation."""

    slot: str
    kind: str
    config_cls: type[T]
    description: str
    paper: str
    capabilities: Capabilities = field(default_factory=Capabilities)

    def fields(self) -> dict[str, Any]:
        """The kind's config fields with their defaults (tuples as lists; ``"<required>"`` for a
        field without a default), in declaration order."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self.config_cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                v = f.default
            elif f.default_factory is not dataclasses.MISSING:
                v = f.default_factory()
            else:
                v = "<required>"
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "kind": self.kind,
            "description": self.description,
            "paper": self.paper,
            "capabilities": self.capabilities.as_dict(),
            "fields": self.fields(),
        }


class FieldError(ValueError):
    """A slot config field has a value of the wrong type (raised by :func:`check_field_types`).

    Attributes:
        field: the field name; ``detail``: what was expected and what came, e.g.
        ``"must be an integer, got 2.5 (float)"``.
    """

    def __init__(self, slot: str, field: str, detail: str) -> None:
        super().__init__(f"{slot}.{field} {detail}")
        self.field, self.detail = field, detail


def check_field_types(cfg: Any) -> None:
    """Check every field of a slot config against its annotation (lists become tuples).

    Run by every registered config before its own ``__post_init__`` (so its range checks see
    values of the right type), whether it is built from YAML/dicts or in Python.

    Raises:
        FieldError: naming ``<slot>.<field>``, the expected type and the value, e.g.
            ``attention.block_size must be an integer, got 2.5 (float)``; also for NaN or
            infinite floats.
    """
    try:
        check_fields(cfg)
    except ConfigFieldError as exc:
        raise FieldError(getattr(type(cfg), "slot", "?"), exc.key, exc.detail) from None


class RegistryError(KeyError):
    """Raised for an unknown kind, a duplicate registration or a malformed slot config."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Kind -> config class for one slot (``attention``, ``position``, ...).

    Registering the same kind twice raises :class:`RegistryError`; so does asking for an
    unknown kind (the message lists the registered ones).
    """

    def __init__(self, slot: str) -> None:
        if slot not in SLOTS:
            raise ValueError(f"unknown slot {slot!r}; slots are {SLOTS}")
        self.slot = slot
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self,
        kind: str,
        *,
        description: str,
        paper: str,
        capabilities: Capabilities | None = None,
    ) -> Callable[[type[T]], type[T]]:
        """Class decorator: register a frozen config dataclass under ``kind``.

        The decorated class gets ``kind`` and ``slot`` class attributes and
        ``capabilities``, and its ``__post_init__`` first runs :func:`check_field_types`
        (every field against its annotation: a wrong type raises :class:`FieldError` naming the
        field). Raises :class:`RegistryError` when ``kind`` is taken.
        """

        def deco(cls: type[T]) -> type[T]:
            if kind in self._entries:
                prev = self._entries[kind].config_cls
                raise RegistryError(
                    f"{self.slot} kind {kind!r} is already registered by {prev.__module__}.{prev.__qualname__}"
                )
            caps = capabilities or Capabilities()
            own_post_init = getattr(cls, "__post_init__", None)

            def __post_init__(self) -> None:  # field types first, then the kind's own checks
                check_field_types(self)
                if own_post_init is not None:
                    own_post_init(self)

            cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
            cls.kind = kind  # type: ignore[attr-defined]
            cls.slot = self.slot  # type: ignore[attr-defined]
            cls.capabilities = caps  # type: ignore[attr-defined]
            self._entries[kind] = Entry(self.slot, kind, cls, description, paper, caps)
            return cls

        return deco

    def get(self, kind: str) -> Entry[T]:
        """Entry for ``kind``; :class:`RegistryError` naming the known kinds otherwise."""
        try:
            return self._entries[kind]
        except KeyError:
            raise RegistryError(
                f"unknown {self.slot} kind {kind!r}; registered kinds: {', '.join(sorted(self._entries))}"
            ) from None

    def __contains__(self, kind: object) -> bool:
        return kind in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.kind))

    def __len__(self) -> int:
        return len(self._entries)

    def kinds(self) -> list[str]:
        return sorted(self._entries)

    def kinds_with_field(self, name: str) -> list[str]:
        """The registered kinds whose config has a field ``name`` (sorted)."""
        return [k for k, e in sorted(self._entries.items())
                if any(f.name == name and f.init for f in dataclasses.fields(e.config_cls))]  # type: ignore[arg-type]

    def _unknown_field(self, key: Any, entry: Entry[T], names: set[str], where: str, implied: bool) -> RegistryError:
        """The error of a field ``key`` that kind ``entry`` does not have (its fields: ``names``):
        a close field name (``kind`` included), else the slot's other kinds that have the field,
        else the nearest fields of any kind; then the valid fields."""
        close = (difflib.get_close_matches(str(key), sorted(names), n=1)
                 or difflib.get_close_matches(str(key), ["kind"], n=1, cutoff=0.75))
        hint = f"; did you mean {where}.{close[0]}?" if close else ""
        having = [k for k in self.kinds_with_field(str(key)) if k != entry.kind]
        if having:
            hint += (f"{' Or' if close else ';'} set {where}.kind to a kind that has it ({self.slot} kinds "
                     f"with a {key!r} field: {', '.join(having)})")
        elif not close:
            others = sorted({f.name for e in self._entries.values()
                             for f in dataclasses.fields(e.config_cls) if f.init} - names)  # type: ignore[arg-type]
            near = difflib.get_close_matches(str(key), others, n=3)
            hint = f"; no {self.slot} kind has a field {key!r}" + (
                "; nearest: " + ", ".join(f"{n} ({', '.join(self.kinds_with_field(n))})" for n in near)
                if near else "")
        kind = f"{entry.kind!r} (the default: {where}.kind is not set)" if implied else repr(entry.kind)
        return RegistryError(
            f"{where}.{key}: unknown key: {self.slot} kind {kind} has no field {key!r}{hint} "
            f"(fields: {', '.join(sorted(names)) or '(none)'})"
        )

    def from_dict(self, data: Mapping[str, Any] | T, where: str | None = None,
                  default_kind: str | None = None) -> T:
        """Build the config of one slot from ``{"kind": ..., **fields}``.

        Args:
            data: a mapping with a ``kind`` key, or an already-built config (returned as is).
            where: dotted path used in error messages (default: the slot name).
            default_kind: the kind of a mapping without ``kind`` (e.g. the backbone's default
                ``sdpa`` for ``backbone.attention.dropout=...``); None: ``kind`` is required.

        Raises:
            RegistryError: no ``kind`` (and no ``default_kind``), unknown kind, a field the
                kind does not have (the message names the dotted path, suggests a close field
                name, ``kind`` included, names the slot's other kinds that have the field, or
                else the nearest fields of any kind, and lists the valid fields), or a field value of the
                wrong type or out of range (``backbone.attention.block_size must be an integer,
                got 2.5 (float)``).
        """
        where = where or self.slot
        if dataclasses.is_dataclass(data) and not isinstance(data, type):
            if getattr(data, "slot", None) != self.slot:
                raise RegistryError(f"{where}: expected a {self.slot} config, got {type(data).__name__}")
            return data  # type: ignore[return-value]
        if not isinstance(data, Mapping):
            raise RegistryError(f"{where}: expected a mapping with a 'kind' key, got {type(data).__name__}")
        implied = "kind" not in data
        if implied and default_kind is None:
            near = [k for k in data if difflib.get_close_matches(str(k), ["kind"], n=1, cutoff=0.75)]
            hint = f" ({where}.{near[0]} is not a field; did you mean {where}.kind?)" if near else ""
            raise RegistryError(f"{where}: missing 'kind'{hint}; registered kinds: {', '.join(self.kinds())}")
        entry = self.get(str(default_kind if implied else data["kind"]))
        cls = entry.config_cls
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs = {k: v for k, v in data.items() if k != "kind"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise self._unknown_field(unknown[0], entry, names, where, implied)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in kwargs and isinstance(kwargs[f.name], list):
                kwargs[f.name] = tuple(kwargs[f.name])  # frozen configs hold tuples, YAML gives lists
        try:
            return cls(**kwargs)  # type: ignore[return-value]
        except FieldError as exc:
            raise RegistryError(f"{where}.{exc.field} {exc.detail}") from exc
        except (TypeError, ValueError) as exc:
            raise RegistryError(f"{where}: {exc}") from exc


ATTENTION: Registry[Any] = Registry("attention")
POSITION: Registry[Any] = Registry("position")
MEMORY: Registry[Any] = Registry("memory")
BLOCK: Registry[Any] = Registry("block")
DEPTH: Registry[Any] = Registry("depth")

REGISTRIES: dict[str, Registry[Any]] = {
    "attention": ATTENTION,
    "position": POSITION,
    "memory": MEMORY,
    "block": BLOCK,
    "depth": DEPTH,
}


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A slot config as a plain dict with its ``kind`` first (tuples become lists)."""
    out: dict[str, Any] = {"kind": cfg.kind}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def all_entries() -> list[Entry[Any]]:
    """Every registered component of every slot (the package ``rl_tformers``, imported before any of
    its modules, registers them all)."""
    return [e for slot in SLOTS for e in REGISTRIES[slot]]
