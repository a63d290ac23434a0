"""rl_tformers.typed_config: replacing fields of a frozen option dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_tformers.typed_config import ConfigFieldError, TypedConfig, option


@dataclass(frozen=True)
class Inner(TypedConfig):
    width: int = option(4, "a width", ge=1)


@dataclass(frozen=True)
class Outer(TypedConfig):
    rate: float = option(0.5, "a rate", gt=0)
    inner: Inner = option(factory=Inner, doc="a nested section")


def test_replace_reads_a_nested_section_given_as_its_mapping() -> None:
    out = Outer().replace(rate=0.25, inner={"width": 8})
    assert out == Outer(rate=0.25, inner=Inner(width=8))
    assert Outer().replace(inner=Inner(width=2)).inner == Inner(width=2)


def test_replace_names_the_nested_key_at_fault() -> None:
    with pytest.raises(ConfigFieldError, match=r"^agent\.inner\.width must be"):
        Outer().replace(where="agent", inner={"width": 0})
    with pytest.raises(ConfigFieldError, match=r"^agent\.inner\.depth"):
        Outer().replace(where="agent", inner={"depth": 1})
