"""Flat observation encoders: ``linear`` (the observation itself) and ``mlp``.

Both read the observation as one vector ``(..., O)``, O = prod(obs_shape), already normalised
by the agent (the dataset's mean/std, ``agent.normalize_obs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from rl_tformers.agents.common.encoders.base import (
    ENCODERS,
    EncoderCapabilities,
    EncoderConfig,
    ObservationEncoder,
    param_dtype,
)
from torch import Tensor, nn

from rl_tformers.typed_config import ConfigFieldError, option


class Flatten(ObservationEncoder):
    """The flat observation as features: (..., *obs_shape) -> (..., O), no weights.

    Floating input is returned as it is (a view when contiguous); integer input is cast to the
    default float dtype, unscaled (integer vector observations, e.g. a RAM state).
    """

    def __init__(self, obs_shape: tuple[int, ...]) -> None:
        super().__init__(obs_shape, 0)
        self.out_features = self.obs_dim

    def encode(self, x: Tensor) -> Tensor:
        """(N, *obs_shape) -> (N, O)."""
        x = x.reshape(x.shape[0], self.obs_dim)  # (N, O)
        return x if x.is_floating_point() else x.to(torch.get_default_dtype())


@ENCODERS.register(
    "linear",
    description="the flat observation (..., O) as it is; the agent's linear embedding reads it (vector tasks)",
    paper="Chen et al. 2021 (the DT's linear state embedding); Parisotto et al. 2019 (GTrXL's step embedding)",
    capabilities=EncoderCapabilities(flat=True, passthrough=True),
)
@dataclass(frozen=True)
class LinearEncoderConfig(EncoderConfig):
    """``agent.encoder.kind=linear``: no layer of its own. The agent's first layer (the DT's state
    embedding ``Linear(O, D)``, GTrXL's step embedding, BC's first MLP layer) reads the flat,
    normalised observation: F = O."""

    def build(self, obs_shape: tuple[int, ...]) -> Flatten:
        return Flatten(obs_shape)

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        return math.prod(obs_shape)


class MLPEncoder(ObservationEncoder):
    """ReLU MLP on the flat observation: (..., O) -> (..., hidden[-1]).

    ``Linear(O, h1) -> ReLU -> Linear(h1, h2) -> ReLU ...``; integer input is cast to the
    weights' dtype, unscaled.
    """

    def __init__(self, obs_shape: tuple[int, ...], hidden: tuple[int, ...]) -> None:
        super().__init__(obs_shape, hidden[-1])
        layers: list[nn.Module] = []
        width = self.obs_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.net = nn.Sequential(*layers)

    def encode(self, x: Tensor) -> Tensor:
        """(N, *obs_shape) -> (N, hidden[-1])."""
        x = x.reshape(x.shape[0], self.obs_dim)  # (N, O)
        if not x.is_floating_point():
            x = x.to(param_dtype(self))
        return self.net(x)


@ENCODERS.register(
    "mlp",
    description="a ReLU MLP on the flat observation (hidden widths), before the agent's embedding",
    paper="",
    capabilities=EncoderCapabilities(flat=True),
)
@dataclass(frozen=True)
class MLPEncoderConfig(EncoderConfig):
    """``agent.encoder.kind=mlp``: ``hidden`` ReLU layers on the flat observation; F = hidden[-1].

    Raises (on construction):
        ConfigFieldError: ``hidden`` empty or with a width < 1.
    """

    hidden: tuple[int, ...] = option((256,), "MLP widths (each followed by ReLU); the last is the feature size",
                                     ge=1)

    def __post_init__(self) -> None:
        if not self.hidden:
            raise ConfigFieldError("hidden", "must be a non-empty list of integers >= 1 (e.g. [256]), got []")

    def build(self, obs_shape: tuple[int, ...]) -> MLPEncoder:
        return MLPEncoder(obs_shape, self.hidden)

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        return self.hidden[-1]
