"""Parameter lists of the contract suite, built from the registries.

Every registered kind of every slot becomes one :class:`Variant`: a small backbone config in
which that slot holds the kind and the other slots hold partners it works with (``sdpa``,
``none`` position or one the kernel accepts, ``none`` memory, ``pre_norm``, ``fixed``). Tests
select variants by the declared :class:`~rl_tformers.registry.Capabilities`, so a kind is tested
the moment it registers.

Extension points a config class may define (all optional; see docs/backbone.md):

- ``contract_config(cls, seq_len) -> dict``: field values that make the kind valid and
  meaningful at test length ``seq_len`` (block sizes, windows, numbers of features...).
- ``contract_backbone(cls, seq_len) -> dict``: backbone-level overrides (``n_heads``,
  ``causal``, another slot such as ``{"position": {"kind": "none"}}``).
- ``contract_no_grad``: class attribute, fnmatch patterns of parameter names (as in
  ``Backbone.named_parameters()``) that legitimately receive no gradient.
- ``contract_forward_kwargs(cls, backbone) -> dict``: extra keyword arguments for
  ``Backbone.forward`` (depth kinds such as early exit).
- ``contract_convergence(cls, seq_len) -> list[dict]``: approximate attention kinds, field
  values with a growing budget; the error to dense attention must shrink along the list.

Kinds that cannot change their class (or need values only for tests) can get an entry in
``CONTRACT_TABLE`` instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

import rl_tformers  # noqa: F401  (registers every kind)
from rl_tformers import Backbone, BackboneConfig
from rl_tformers.registry import REGISTRIES, SLOTS, Capabilities

B, T, D, H = 2, 12, 16, 2
BASE: dict[str, Any] = {
    "d_model": D,
    "n_layers": 2,
    "n_heads": H,
    "d_ff": 32,
    "dropout": 0.0,
    "attn_dropout": 0.0,
    "max_position": 8192,
}
PARTNERS: dict[str, dict[str, Any]] = {
    "attention": {"kind": "sdpa"},
    "position": {"kind": "none"},
    "memory": {"kind": "none"},
    "block": {"kind": "pre_norm"},
    "depth": {"kind": "fixed"},
}
#: Test parameters for kinds that do not define ``contract_config``: {(slot, kind): fields}.
CONTRACT_TABLE: dict[tuple[str, str], dict[str, Any]] = {}
#: Backbone overrides for kinds that do not define ``contract_backbone``.
CONTRACT_BACKBONE_TABLE: dict[tuple[str, str], dict[str, Any]] = {}
#: Positional kinds tried, in order, as the partner of an attention kind.
POSITION_PREFERENCE = ("rotary", "none")


def config_cls(slot: str, kind: str) -> type:
    return REGISTRIES[slot].get(kind).config_cls


def caps_of(slot: str, kind: str) -> Capabilities:
    return REGISTRIES[slot].get(kind).capabilities


def kind_fields(slot: str, kind: str, seq_len: int) -> dict[str, Any]:
    """Field values of ``kind`` at test length ``seq_len`` (``contract_config`` or the table)."""
    hook = getattr(config_cls(slot, kind), "contract_config", None)
    if hook is not None:
        return dict(hook(seq_len))
    return dict(CONTRACT_TABLE.get((slot, kind), {}))


def kind_backbone(slot: str, kind: str, seq_len: int) -> dict[str, Any]:
    hook = getattr(config_cls(slot, kind), "contract_backbone", None)
    if hook is not None:
        return dict(hook(seq_len))
    return dict(CONTRACT_BACKBONE_TABLE.get((slot, kind), {}))


def position_for(att_caps: Capabilities) -> str:
    """A positional kind an attention kind accepts (rotary when possible: it exercises positions)."""
    if att_caps.positions is None:
        return POSITION_PREFERENCE[0]
    for k in POSITION_PREFERENCE:
        if k in att_caps.positions:
            return k
    return att_caps.positions[0]


@dataclass(frozen=True)
class Variant:
    """One registered kind in a small backbone; ``config`` is a BackboneConfig dict."""

    slot: str
    kind: str
    config: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.slot}:{self.kind}"

    def caps(self, slot: str) -> Capabilities:
        return caps_of(slot, self.config[slot]["kind"])

    def _all(self, flag: str, slots=SLOTS) -> bool:
        return all(getattr(self.caps(s), flag) for s in slots)

    @property
    def causal_ok(self) -> bool:
        return self._all("causal")

    @property
    def bidirectional_ok(self) -> bool:
        return self._all("bidirectional")

    @property
    def key_padding(self) -> bool:
        return self._all("key_padding")

    @property
    def stateful(self) -> bool:
        return self.caps("memory").stateful

    @property
    def incremental(self) -> bool:
        """Step-by-step decoding with the ``none`` memory's cache equals the full pass."""
        return not self.stateful and self._all("incremental")

    @property
    def exact_chunking(self) -> bool:
        """Segments with carried memory equal one pass (with this variant's memory if stateful,
        else with ``xl`` memory, which needs memory support from attention, block and depth)."""
        slots = ("attention", "position", "block", "depth", "memory")
        if self.stateful:
            return self._all("exact_chunking", slots)
        mem_ok = all(self.caps(s).memory for s in ("attention", "block", "depth"))
        return mem_ok and self._all("exact_chunking", slots[:4])

    def modes(self) -> list[bool]:
        """Causal flags this variant supports: [True], [False] or [True, False]."""
        return [c for c, ok in ((True, self.causal_ok), (False, self.bidirectional_ok)) if ok]

    def with_config(self, **changes: Any) -> Variant:
        return dataclasses.replace(self, config={**self.config, **changes})

    def backbone_config(self, causal: bool | None = None) -> BackboneConfig:
        cfg = dict(self.config)
        if causal is not None:
            cfg["causal"] = causal
        return BackboneConfig.from_dict(cfg)

    def build(self, causal: bool | None = None) -> Backbone:
        """The backbone (seeded: equal weights for equal seeds), in train mode."""
        torch.manual_seed(1234)
        return Backbone(self.backbone_config(causal))

    def no_grad_patterns(self) -> tuple[str, ...]:
        pats: list[str] = []
        for s in SLOTS:
            pats += list(getattr(config_cls(s, self.config[s]["kind"]), "contract_no_grad", ()))
        return tuple(pats)

    def forward_kwargs(self, bb: Backbone) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in SLOTS:
            hook = getattr(config_cls(s, self.config[s]["kind"]), "contract_forward_kwargs", None)
            if hook is not None:
                out.update(hook(bb))
        return out


def make_variant(slot: str, kind: str, seq_len: int = T) -> Variant:
    """The variant testing ``slot: kind`` with compatible partners at length ``seq_len``."""
    cfg: dict[str, Any] = dict(BASE)
    cfg.update({s: dict(v) for s, v in PARTNERS.items()})
    cfg[slot] = {"kind": kind, **kind_fields(slot, kind, seq_len)}
    caps = caps_of(slot, kind)
    if slot == "attention":
        cfg["position"] = {"kind": position_for(caps)}
    if not caps.causal:
        cfg["causal"] = False
    for k, v in kind_backbone(slot, kind, seq_len).items():
        cfg[k] = v
    return Variant(slot, kind, cfg)


def all_variants(seq_len: int = T) -> list[Variant]:
    return [make_variant(e.slot, e.kind, seq_len) for s in SLOTS for e in REGISTRIES[s]]


def variant_params(select=lambda v: True) -> list:
    """pytest params (with ids) of the variants ``select`` accepts."""
    import pytest

    return [pytest.param(v, id=v.id) for v in all_variants() if select(v)]


def mode_params(select=lambda v: True) -> list:
    """pytest params over (variant, causal) for every causal mode a variant supports."""
    import pytest

    return [
        pytest.param(v, c, id=f"{v.id}-{'causal' if c else 'bidir'}")
        for v in all_variants()
        if select(v)
        for c in v.modes()
    ]


def padding_mask(b: int = B, t: int = T) -> torch.Tensor:
    """(B, T) bool: row 0 right-padded by 3, row 1 left-padded by 2 (causal: empty rows)."""
    m = torch.ones(b, t, dtype=torch.bool)
    m[0, t - 3 :] = False
    if b > 1:
        m[1, :2] = False
    return m
