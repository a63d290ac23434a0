"""The observation-encoder slot: its registry, capabilities, typed base config and module base.

An encoder config is a frozen dataclass registered under a ``kind`` in :data:`ENCODERS` (the
backbone slots' :class:`~rl_tformers.registry.Registry` machinery: unknown kinds and fields are
refused with a did-you-mean) and a :class:`~rl_tformers.typed_config.TypedConfig` (so an agent's
``agent:`` section holds it as the nested section ``agent.encoder``). ``build(obs_shape)`` makes
an :class:`ObservationEncoder`: observations ``(..., *obs_shape)`` in, features ``(..., F)`` out.

Input contract of image kinds (:attr:`EncoderCapabilities.image`): observations of an image
space are uint8 tensors of shape ``(..., C, H, W)`` (C stacked frames or colour channels, e.g.
``(4, 84, 84)`` from gymnasium's ``FrameStackObservation`` over ``AtariPreprocessing`` grey
frames); the encoder casts them to float and scales them by 1/255 itself, so no float copy of a
dataset is ever made. Float input in raw pixel units (0..255) is taken too, scaled the same way
(an evaluation policy that held observations as float32).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rl_tformers.registry import Entry, Registry, RegistryError, config_to_dict
from rl_tformers.typed_config import ConfigFieldError, TypedConfig, expected_words

#: the pixel scale of image observations: uint8 values 0..255 become floats in [0, 1]
PIXEL_SCALE = 1.0 / 255.0
#: the encoder of ``agent.encoder`` when its ``kind`` is not set (vector tasks)
DEFAULT_KIND = "linear"


@dataclass(frozen=True)
class EncoderCapabilities:
    """What a registered encoder takes; the contract tests (tests/agents/test_encoders.py) and the
    agents' observation check select by these flags.

    Attributes:
        image: takes image observations, uint8 ``(..., C, H, W)``, scaled by 1/255 inside.
        flat: takes flat observations ``(..., O)`` (any shape, flattened), already normalised
            by the agent (dataset mean/std).
        passthrough: the features are the flat observation itself (no weights): the agent's
            own linear embedding is the first layer that reads the observation.
        min_size: smallest H and W an image kind takes (0: any).
    """

    image: bool = False
    flat: bool = False
    passthrough: bool = False
    min_size: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flags(self) -> list[str]:
        """Names of the true boolean flags, for listings."""
        return [k for k, v in dataclasses.asdict(self).items() if v is True]


class EncoderRegistry(Registry[Any]):
    """Kind -> config class of the observation-encoder slot.

    The backbone's :class:`~rl_tformers.registry.Registry` (registration, ``from_dict`` with
    did-you-mean errors, field type checks) for a slot that is not one of the backbone's
    (:data:`rl_tformers.registry.SLOTS`): the backbone never builds an encoder.
    """

    def __init__(self) -> None:  # not a backbone slot: Registry.__init__ accepts only those
        self.slot = "encoder"
        self._entries: dict[str, Entry[Any]] = {}


#: every registered observation encoder (``agent.encoder.kind``)
ENCODERS = EncoderRegistry()


def is_image(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether observations of ``shape`` (one step) and ``dtype`` are images: uint8 ``(C, H, W)``."""
    return len(tuple(shape)) == 3 and np.dtype(dtype) == np.uint8


def observation_layout(dataset: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of one observation of an :class:`~rl_tformers.envs.dataset.EpisodeDataset`
    as its samplers hand it to a model: the shape and dtype of its observation space."""
    space = dataset.observation_space
    return tuple(int(k) for k in space.shape), np.dtype(space.dtype)


def check_observations(encoder: EncoderConfig, shape: tuple[int, ...], dtype: Any, source: str,
                       key: str = "agent.encoder.kind") -> None:
    """Refuse an encoder that does not take these observations: a flat kind on image observations,
    an image kind on flat ones, or images smaller than the kind's :attr:`EncoderCapabilities.min_size`.

    Args:
        encoder: the encoder config.
        shape, dtype: one observation's shape and dtype.
        source: where the observations come from, for the message (``"the dataset data/x.hdf5"``,
            ``"the environment ALE/Breakout-v5"``).
        key: the option named in the message.

    Raises:
        ConfigFieldError: one line naming ``key``, the kind, the observations and the kinds that fit.
    """
    caps: EncoderCapabilities = encoder.capabilities
    shape = tuple(int(k) for k in shape)
    what = f"observations of shape {shape} {np.dtype(dtype).name}"
    if is_image(shape, dtype) and not caps.image:
        fits = ", ".join(e.kind for e in ENCODERS if e.capabilities.image)
        raise ConfigFieldError(key, f"={encoder.kind} takes flat observations, but {source} has image {what} "
                                    f"(uint8 (C, H, W)); use an image encoder: {key}={fits.replace(', ', ' or ')}",
                               sep="")
    if not is_image(shape, dtype) and not caps.flat:
        fits = ", ".join(e.kind for e in ENCODERS if e.capabilities.flat)
        raise ConfigFieldError(key, f"={encoder.kind} takes image observations (uint8 (C, H, W)), but {source} has "
                                    f"{what}; use a flat encoder: {key}={fits.replace(', ', ' or ')}", sep="")
    if caps.image and min(shape[1:]) < caps.min_size:
        fits = " or ".join(e.kind for e in ENCODERS if e.capabilities.image and e.capabilities.min_size <= min(shape[1:]))
        other = f"{key}={fits} (which take these frames) or " if fits else ""
        raise ConfigFieldError(key, f"={encoder.kind} needs frames of at least {caps.min_size}x{caps.min_size} "
                                    f"pixels, but {source} has {what}; use {other}larger frames", sep="")


class EncoderConfig(TypedConfig):
    """Base of the encoder configs: the nested section ``agent.encoder`` of an agent's options.

    A subclass is a frozen dataclass registered with ``@ENCODERS.register(kind, ...)``; it
    implements :meth:`build`. :meth:`from_dict` picks the subclass by ``kind`` (default
    :data:`DEFAULT_KIND`), :meth:`to_dict` writes ``kind`` first.
    """

    #: set by the registry decorator: the kind and its :class:`EncoderCapabilities`
    kind: typing.ClassVar[str]
    capabilities: typing.ClassVar[EncoderCapabilities]

    def build(self, obs_shape: tuple[int, ...]) -> ObservationEncoder:
        """The encoder module for observations of shape ``obs_shape`` (one step)."""
        raise NotImplementedError

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        """F, the size of the features of observations of shape ``obs_shape`` (without building)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | TypedConfig | None, where: str = "") -> Any:
        """The registered config of ``data["kind"]`` (default ``linear``) with the other keys as fields.

        Raises:
            ConfigFieldError: starting with ``where`` (``agent.encoder``): an unknown kind (the
                registered ones listed), a field the kind does not have (did-you-mean, the kinds
                that have it), a value of the wrong type or out of range, or not a mapping.
        """
        where = where or "encoder"
        if isinstance(data, EncoderConfig):
            return data
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigFieldError(where, f"must be a mapping with a kind ({', '.join(ENCODERS.kinds())}) and its "
                                          f"fields, got {data!r}")
        try:
            return ENCODERS.from_dict(dict(data), where=where, default_kind=DEFAULT_KIND)
        except RegistryError as exc:
            msg = str(exc)
            detail = msg[len(where):] if msg.startswith(where) else f": {msg}"
            raise ConfigFieldError(where, detail, sep="") from None

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., **fields}`` (tuples as lists); :meth:`from_dict` reads it back."""
        return config_to_dict(self)

    @classmethod
    def fields_help(cls, prefix: str = "") -> list[tuple[str, str, Any, str]]:
        """Listing rows: ``<prefix>.kind`` (every registered kind), then each kind's fields as
        ``<prefix>.<field>`` with the kind named in the doc."""
        kinds = ENCODERS.kinds()
        key = f"{prefix}.kind" if prefix else "kind"
        flat = ", ".join(e.kind for e in ENCODERS if e.capabilities.flat)
        image = ", ".join(e.kind for e in ENCODERS if e.capabilities.image)
        rows = [(key, "one of " + ", ".join(f"'{k}'" for k in kinds), DEFAULT_KIND,
                 f"observation encoder: {flat} for flat observations, {image} for uint8 (C, H, W) images "
                 f"(scaled by 1/255 inside; docs/encoders.md)")]
        for e in ENCODERS:
            hints = e.config_cls.__dataclass_fields__
            for f in dataclasses.fields(e.config_cls):
                if not f.init:
                    continue
                name = f"{prefix}.{f.name}" if prefix else f.name
                spec = typing.get_type_hints(e.config_cls)[f.name]
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                default = list(default) if isinstance(default, tuple) else default
                rows.append((name, expected_words(spec, hints[f.name].metadata), default,
                             f"kind {e.kind}: {f.metadata.get('doc', '')}"))
        return rows


class ObservationEncoder(nn.Module):
    """Base of the encoder modules: ``(..., *obs_shape)`` -> ``(..., F)`` over any leading axes.

    :meth:`forward` folds the leading axes (B, T, ...) into one, calls :meth:`encode` on
    ``(N, *obs_shape)`` and restores them. A flat ``(..., O)`` input with O = prod(obs_shape)
    is taken too (it is unflattened; policies that keep a flat context window pass that).

    Attributes:
        obs_shape: one observation's shape.
        out_features: F, the size of the features.
    """

    def __init__(self, obs_shape: tuple[int, ...], out_features: int) -> None:
        super().__init__()
        self.obs_shape = tuple(int(k) for k in obs_shape)
        self.obs_dim = math.prod(self.obs_shape)
        self.out_features = int(out_features)

    def forward(self, obs: Tensor) -> Tensor:
        """obs (..., *obs_shape) or (..., O) -> features (..., F).

        Raises:
            ValueError: trailing axes that are neither ``obs_shape`` nor O.
        """
        n = len(self.obs_shape)
        if tuple(obs.shape[obs.dim() - n:]) == self.obs_shape and obs.dim() >= n:
            lead = obs.shape[:obs.dim() - n]
        elif obs.dim() >= 1 and obs.shape[-1] == self.obs_dim:
            lead = obs.shape[:-1]
        else:
            raise ValueError(f"encoder: observations must be (..., {', '.join(map(str, self.obs_shape))}) or "
                             f"(..., {self.obs_dim}), got {tuple(obs.shape)}")
        x = obs.reshape(-1, *self.obs_shape)  # (N, *obs_shape), N = prod(lead)
        y = self.encode(x)  # (N, F)
        return y.reshape(*lead, y.shape[-1])  # (..., F)

    def encode(self, x: Tensor) -> Tensor:
        """(N, *obs_shape) -> (N, F)."""
        raise NotImplementedError


def pixels_to_float(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Pixels (uint8 0..255, or floats in those units) -> ``dtype`` values in [0, 1]: ``x * (1/255)``.

    The cast happens here, on the batch only; uint8 and float input of the same values give the
    same result bit for bit (the cast of a uint8 to float is exact).
    """
    return x.to(dtype) * PIXEL_SCALE


def param_dtype(module: nn.Module) -> torch.dtype:
    """The floating dtype of ``module``'s first parameter (float32 when it has none)."""
    for p in module.parameters():
        return p.dtype
    return torch.get_default_dtype()
