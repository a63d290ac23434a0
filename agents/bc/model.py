"""Behaviour cloning policy network: an MLP from one observation to one action (pure nn.Module).

The baseline beside every Decision Transformer number (Chen et al. 2021, table 2 "BC" and
"%BC": the same network trained on the top X% of episodes by return). Continuous actions are
produced in normalised units [-1, 1] (tanh) like the DT's; discrete ones as logits.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rl_tformers.agents.common.encoders import EncoderConfig, ObservationEncoder
from torch import Tensor, nn

from rl_tformers.dropout import Dropout


@dataclass(frozen=True)
class BCConfig:
    """Configuration of :class:`BCModel`.

    Attributes:
        obs_dim: observation size (flat), O = prod(obs_shape).
        act_dim: action size (continuous) or number of actions (discrete).
        discrete: discrete action space (logits, cross-entropy).
        hidden: widths of the hidden layers (default two layers of 256).
        dropout: dropout after each hidden activation.
        obs_shape: shape of one observation (``(C, H, W)`` for images); None: ``(obs_dim,)``.
        encoder: the observation encoder (``agent.encoder``, a config or its dict); None:
            ``linear`` (the MLP reads the flat observation).

    Raises:
        ValueError: ``hidden`` not a non-empty list/tuple of integers >= 1, ``dropout`` outside
            [0, 1) (both named as ``agent.*``).
    """

    obs_dim: int
    act_dim: int
    discrete: bool = False
    hidden: tuple[int, ...] = (256, 256)
    dropout: float = 0.1
    obs_shape: tuple[int, ...] | None = None
    encoder: EncoderConfig | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        shape = (int(self.obs_dim),) if self.obs_shape is None else tuple(int(k) for k in self.obs_shape)
        object.__setattr__(self, "obs_shape", shape)
        object.__setattr__(self, "encoder", EncoderConfig.from_dict(self.encoder, "agent.encoder"))
        hidden = self.hidden
        if (not isinstance(hidden, (list, tuple)) or not hidden
                or not all(isinstance(h, numbers.Integral) and not isinstance(h, bool) and h >= 1 for h in hidden)):
            raise ValueError(f"agent.hidden must be a non-empty list of integer widths >= 1 (e.g. [256, 256]), "
                             f"got {hidden!r}")
        object.__setattr__(self, "hidden", tuple(int(h) for h in hidden))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"agent.dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (``hidden`` as a list); inverse of :meth:`from_dict`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["hidden"] = list(self.hidden)
        d["obs_shape"] = list(self.obs_shape)
        d["encoder"] = self.encoder.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BCConfig:
        """Build from a dict of the fields.

        Raises:
            ValueError: an unknown field (named as ``agent.<field>``), or as the constructor.
            TypeError: ``obs_dim`` or ``act_dim`` missing.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"agent.{unknown[0]}: unknown BC field; fields: {', '.join(sorted(names))}")
        return cls(**dict(data))


class BCModel(nn.Module):
    """MLP policy on the encoded observation: obs (B, obs_dim) or (B, *obs_shape) -> normalised
    action (B, A) in [-1, 1] or logits (B, n)."""

    def __init__(self, cfg: BCConfig) -> None:
        super().__init__()
        self.cfg = cfg
        #: (..., *obs_shape) -> (..., F) (``linear``: the flat observation itself)
        self.encode_obs: ObservationEncoder = cfg.encoder.build(cfg.obs_shape)
        layers: list[nn.Module] = []
        width = self.encode_obs.out_features
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), Dropout(cfg.dropout)]
            width = h
        layers.append(nn.Linear(width, cfg.act_dim))
        if not cfg.discrete:
            layers.append(nn.Tanh())
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Tensor) -> Tensor:
        """obs (..., obs_dim) normalised, or (..., *obs_shape) (image kinds: uint8 pixels) -> (..., A)
        action in [-1, 1] or (..., n) logits."""
        return self.net(self.encode_obs(obs))
