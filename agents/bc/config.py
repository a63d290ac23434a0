"""Options of behaviour cloning (``agent.kind=bc``), typed and checked.

:class:`BCAgentConfig` is the ``agent:`` section of a run config; ``rl-tformers agents bc`` lists
its fields with their defaults and docs. A bad value is refused with one line naming
``agent.<key>`` (:meth:`~rl_tformers.typed_config.TypedConfig.from_dict`), before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_tformers.agents.common.encoders import EncoderConfig
from rl_tformers.agents.common.encoders.flat import LinearEncoderConfig

from rl_tformers.typed_config import ConfigFieldError, TypedConfig, option


@dataclass(frozen=True)
class BCAgentConfig(TypedConfig):
    """``agent:`` of ``agent.kind=bc`` (an MLP on the encoded current observation).

    Raises (on construction):
        ConfigFieldError: a field of the wrong type or out of range; ``hidden`` empty.
    """

    hidden: tuple[int, ...] = option((256, 256), "MLP hidden widths", ge=1)
    dropout: float = option(0.1, "dropout after each hidden layer", ge=0, lt=1)
    top_fraction: float = option(1.0, "train on the best episodes by return only (0.1 = %BC, 1 = BC)", gt=0, le=1)
    normalize_obs: bool = option(True, "standardise flat observations with the (filtered) dataset's mean/std "
                                 "(image observations are scaled by 1/255 in the encoder instead)")
    encoder: EncoderConfig = option(factory=LinearEncoderConfig, doc="observation encoder (its features are the "
                                    "MLP's input)")
    env_id: str | None = option(None, "evaluation environment; null = the dataset's")
    env_kwargs: dict | None = option(None, "gym.make keyword arguments of the evaluation environment")

    def __post_init__(self) -> None:
        if not self.hidden:
            raise ConfigFieldError("hidden", "must be a non-empty list of integers >= 1 (e.g. [256, 256]), got []")
