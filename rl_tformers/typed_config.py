"""Typed, frozen option dataclasses built from plain dicts, with one-line errors.

The machinery the backbone's slot configs (:mod:`rl_tformers.registry`) and the agents' option
classes (``agents/<agent>/config.py``) share. A field is declared with :func:`option`, which
holds its one-line doc and its range::

    @dataclass(frozen=True)
    class KNNOptions(TypedConfig):
        lam: float = option(0.0, "weight of the neighbours' action (0: off)", ge=0, le=1)
        k: int = option(16, "neighbours per query", ge=1)

    KNNOptions.from_dict({"lam": 2}, where="agent.knn")
    # ConfigFieldError: agent.knn.lam must be a number in [0, 1], got 2

Every construction checks each field against its annotation (``int``, ``float``, ``bool``,
``str``, ``tuple[X, ...]``, ``dict``, unions of them, ``None``) and its range or choices; a field
whose annotation is another :class:`TypedConfig` is a nested section, built from a mapping.
:meth:`TypedConfig.from_dict` refuses unknown keys with a did-you-mean. Every error is one line
that starts with the full dotted key. Cross-field rules go in the class's ``__post_init__``
(run after the field checks) and raise :class:`ConfigFieldError` naming the field.

This module imports nothing from the package, so the backbone library and the agents both
import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar


class ConfigFieldError(ValueError):
    """One option is unknown, of the wrong type or out of range.

    Attributes:
        key: the dotted key at fault (relative to the section until :meth:`TypedConfig.from_dict`
            prefixes it with its ``where``). detail: the rest of the message, e.g.
            ``"must be an integer >= 1, got 0"``.
    """

    def __init__(self, key: str, detail: str, sep: str = " ") -> None:
        super().__init__(f"{key}{sep}{detail}")
        self.key, self.detail, self.sep = key, detail, sep

    def under(self, where: str) -> ConfigFieldError:
        """The same error with ``where.`` in front of its key."""
        return ConfigFieldError(f"{where}.{self.key}" if where else self.key, self.detail, self.sep)


# -- types ------------------------------------------------------------------------------------------

def plain_number(value: Any) -> Any:
    """``value`` as a built-in ``int`` or ``float`` when it is another integral or real number
    type (NumPy ``int64`` / ``float32`` scalars, ...); built-in numbers are returned as they are.

    Configs hold only built-in types, so that their dict form dumps to YAML, OmegaConf and JSON
    (none of which represents a NumPy scalar) and round-trips through ``from_dict``.
    """
    if type(value) in (int, float) or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _members(spec: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(spec)
    return typing.get_args(spec) if origin in (typing.Union, types.UnionType) else (spec,)


def describe_type(spec: Any) -> str:
    """Words for a field annotation: ``int | None`` -> ``an integer or null``."""
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {describe_type(args[0]).split(' ', 1)[1]}s"
        return f"a list of {len(args)} {describe_type(args[0]).split(' ', 1)[1]}s"
    if spec is dict or origin is dict:
        return "a mapping"
    return {
        int: "an integer",
        float: "a finite number",
        bool: "true or false",
        str: "a string",
        type(None): "null",
    }.get(spec, repr(spec))


NO_MATCH = object()


def match_type(spec: Any, value: Any) -> Any:
    """``value`` (lists turned into tuples) if it fits the annotation ``spec``, else :data:`NO_MATCH`.

    int: an integral number, not a bool (``16.0`` and ``"2"`` do not fit); float: a finite real
    number, not a bool (ints fit); bool: a bool; str: a string; ``tuple[X, ...]`` / ``tuple[X, Y]``:
    a tuple or list of such items; ``dict``: a mapping (returned as a plain dict); unions: the
    first member that fits. Other annotations accept anything. Numbers of other types (NumPy
    scalars) come back as built-in ``int`` / ``float`` (:func:`plain_number`), strings of a
    ``str`` subclass as ``str``.
    """
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            got = match_type(a, value)
            if got is not NO_MATCH:
                return got
        return NO_MATCH
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return NO_MATCH
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            return NO_MATCH
        out = tuple(match_type(a, v) for a, v in zip(items, value))
        return NO_MATCH if any(o is NO_MATCH for o in out) else out
    if spec is dict or origin is dict:
        return dict(value) if isinstance(value, Mapping) else NO_MATCH
    if spec is type(None):
        return value if value is None else NO_MATCH
    if spec is bool:
        return value if isinstance(value, bool) else NO_MATCH
    if spec is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return plain_number(value) if ok else NO_MATCH
    if spec is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
        return plain_number(value) if ok else NO_MATCH
    if spec is str:
        return value if type(value) is str else str(value) if isinstance(value, str) else NO_MATCH
    return value


def _finite(value: numbers.Real) -> bool:
    """``value`` is a finite number a float can hold (an integer beyond ~1.8e308 is not: math.isfinite
    would raise OverflowError on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# -- fields -----------------------------------------------------------------------------------------

_BOUNDS = ("ge", "gt", "le", "lt")


def option(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None,
           choices: Sequence[str] | None = None) -> Any:
    """A dataclass field with its one-line ``doc`` and its allowed values.

    Args:
        default: the default value (immutable: numbers, strings, tuples, None).
        doc: one line, shown by ``rl-tformers agents KIND``.
        factory: zero-argument callable making the default instead (a nested section's class).
        ge, gt, le, lt: bounds of a numeric value (``>=``, ``>``, ``<=``, ``<``); a list's items
            are held to them too.
        choices: the strings allowed (a string value of a ``float | str`` field included).
    """
    meta = {"doc": doc, **{k: v for k, v in zip(_BOUNDS, (ge, gt, le, lt)) if v is not None}}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def range_words(meta: Mapping[str, Any]) -> str:
    """A field's bounds in words (``"in [0, 1)"``, ``"> 0"``, ``">= 1"``; ``""`` without bounds)."""
    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def expected_words(spec: Any, meta: Mapping[str, Any]) -> str:
    """What a field takes, in words: ``"an integer >= 1 or null"``, ``"'auto' or a number > 0"``."""
    rng = range_words(meta)
    parts = []
    for m in _members(spec):
        if m is str and meta.get("choices"):
            choices = meta["choices"]
            parts.append(f"'{choices[0]}'" if len(choices) == 1 else
                         "one of " + ", ".join(f"'{c}'" for c in choices))
        elif m in (int, float) and rng:
            parts.append(f"{'an integer' if m is int else 'a number'} {rng}")
        elif typing.get_origin(m) is tuple and rng:
            parts.append(f"{describe_type(m)} {rng}")
        else:
            parts.append(describe_type(m))
    return " or ".join(parts)


def _in_range(value: Any, meta: Mapping[str, Any]) -> bool:
    if isinstance(value, tuple):
        return all(_in_range(v, meta) for v in value)
    if isinstance(value, str):
        return "choices" not in meta or value in meta["choices"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return True
    return (("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"]))


def _hints(cls: type) -> dict[str, Any]:
    hints = cls.__dict__.get("_field_hints")
    if hints is None:
        hints = typing.get_type_hints(cls)
        cls._field_hints = hints  # type: ignore[attr-defined]
    return hints


def _section_cls(spec: Any) -> type | None:
    """The :class:`TypedConfig` subclass of a nested-section annotation, else None."""
    return spec if isinstance(spec, type) and issubclass(spec, TypedConfig) else None


def check_value(cls: type, name: str, value: Any, key: str | None = None) -> Any:
    """``value`` checked against field ``name`` of ``cls`` (annotation, range, choices), with lists
    as tuples and NumPy numbers as built-in ones. Also for values given outside the config (an
    evaluation command's option that overrides the field).

    Raises:
        ConfigFieldError: naming ``key`` (default: ``name``), what the field takes and the value.
    """
    key = key or name
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    spec, meta = _hints(cls)[name], f.metadata
    got = match_type(spec, value)
    if got is NO_MATCH:
        raise ConfigFieldError(key, f"must be {expected_words(spec, meta)}, got {value!r} ({type(value).__name__})")
    if not _in_range(got, meta):
        raise ConfigFieldError(key, f"must be {expected_words(spec, meta)}, got {value!r}")
    return got


def check_fields(cfg: Any) -> None:
    """Check every init field of the dataclass ``cfg`` against its annotation and range, storing
    lists as tuples and NumPy numbers as built-in ones (frozen instances included).

    Raises:
        ConfigFieldError: naming the field (relative key), e.g. ``k must be an integer >= 1, got 0``.
    """
    cls = type(cfg)
    hints = _hints(cls)
    for f in dataclasses.fields(cfg):
        spec = hints.get(f.name)
        if spec is None or not f.init:
            continue
        value = getattr(cfg, f.name)
        section = _section_cls(spec)
        if section is not None:
            if not isinstance(value, section):
                raise ConfigFieldError(f.name, f"must be a mapping of options ({', '.join(section.field_names())}), "
                                               f"got {value!r}")
            continue
        got = check_value(cls, f.name, value)
        if got is not value:
            object.__setattr__(cfg, f.name, got)  # frozen configs hold tuples and built-in numbers


# -- the base class -----------------------------------------------------------------------------

class TypedConfig:
    """Base of a frozen option dataclass: field checks on construction, :meth:`from_dict`,
    :meth:`to_dict`, :meth:`fields_help`.

    A subclass's own ``__post_init__`` (cross-field rules) runs after the field checks.
    """

    _rules: ClassVar[tuple[Any, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_typed_wrapper", False):
            cls._rules = (*cls._rules, own)  # a subclass keeps its parents' rules, then adds its own

        def __post_init__(self: Any) -> None:  # field types first, then the classes' own rules
            check_fields(self)
            for rule in type(self)._rules:
                rule(self)

        __post_init__._typed_wrapper = True  # type: ignore[attr-defined]
        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | TypedConfig | None, where: str = "") -> Any:
        """Build from a (possibly partial) mapping; missing keys take their defaults, nested
        sections are built from mappings (a section given as null is refused).

        Args:
            data: a mapping, an instance (returned as it is) or None (all defaults).
            where: dotted key of this section, put in front of every error (``"agent"``).

        Raises:
            ConfigFieldError: one line starting with the full dotted key: an unknown key (with
                the closest field name and the section's fields), a wrong type, a value out of
                range, a section that is not a mapping, or a cross-field rule of the class.
        """
        if isinstance(data, cls):
            return data
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigFieldError(where or cls.__name__,
                                   f"must be a mapping of options ({', '.join(cls.field_names())}), got {data!r}")
        names = cls.field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            raise unknown_key_error(str(unknown[0]), names, where)
        hints = _hints(cls)
        kwargs = {}
        for name, value in data.items():
            section = _section_cls(hints.get(name))
            sub = f"{where}.{name}" if where else name
            if section is not None and isinstance(value, Mapping):
                value = section.from_dict(value, sub)
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except ConfigFieldError as exc:
            raise exc.under(where) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of every field (tuples as lists); :meth:`from_dict` reads it back."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}  # type: ignore[arg-type]

    def replace(self, where: str = "", **changes: Any) -> Any:
        """A copy with ``changes`` (checked as :meth:`from_dict` checks, errors under ``where``); a
        nested section may be given as its mapping (read by the section's ``from_dict``)."""
        hints = _hints(type(self))
        try:
            for name, value in changes.items():
                section = _section_cls(hints.get(name))
                if section is not None and isinstance(value, Mapping):
                    changes[name] = section.from_dict(value, name)
            return dataclasses.replace(self, **changes)  # type: ignore[type-var]
        except ConfigFieldError as exc:
            raise exc.under(where) from None

    @classmethod
    def fields_help(cls, prefix: str = "") -> list[tuple[str, str, Any, str]]:
        """``(dotted key, type in words, default, doc)`` of every field, nested sections expanded."""
        out = []
        hints = _hints(cls)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            key = f"{prefix}.{f.name}" if prefix else f.name
            section = _section_cls(hints[f.name])
            if section is not None:
                out += section.fields_help(key)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append((key, expected_words(hints[f.name], f.metadata), _plain(default), f.metadata.get("doc", "")))
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, TypedConfig):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def unknown_key_error(key: str, names: Sequence[str], where: str) -> ConfigFieldError:
    """``<where>.<key>: unknown key; did you mean <where>.<close>? (keys of <where>: ...)``."""
    full = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
    return ConfigFieldError(full, f"unknown key{hint} (keys of {where or 'the section'}: {', '.join(names)})", sep=": ")


def format_fields(cls: type[TypedConfig], prefix: str = "") -> list[str]:
    """Listing lines ``key = default  (type words)  doc`` of every field of ``cls``, aligned."""
    rows = [(k, repr_default(d), words, doc) for k, words, d, doc in cls.fields_help(prefix)]
    width = max((len(f"{k} = {d}") for k, d, _, _ in rows), default=0)
    return [f"{f'{k} = {d}':<{width}}  {doc} ({words})" for k, d, words, doc in rows]


def repr_default(value: Any) -> str:
    """A default as YAML writes it: ``null``, ``true``, ``[256, 256]``, ``auto``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(repr_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {repr_default(v)}" for k, v in value.items()) + "}"
    return str(value)
