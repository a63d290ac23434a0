"""``minatar_cnn``: the network of the MinAtar paper on its small binary-channel frames.

Young and Tian 2019, "MinAtar: An Atari-Inspired Testbed for Thorough and Reproducible
Reinforcement Learning Experiments", sec. 4 (the DQN and actor-critic architecture): one
convolution of 16 filters 3 x 3 with stride 1 over the 10 x 10 x C game-object channels, a
rectifier, then a fully connected layer of 128 rectifier units. MinAtar frames are far below
:mod:`.nature_cnn`'s 36 x 36 minimum, so this is the encoder of ``MinAtar/<Game>-v1`` tasks::

    (N, C, 10, 10) uint8 (0 or 255) -> /255 -> conv 3x3/1 (16) -> (N, 16, 8, 8) -> flatten (N, 1024)
                                             -> fc (features, 128) -> (N, 128)

Any frame of at least 3 x 3 pixels is taken (the convolution leaves (H - 2) x (W - 2)
positions). Weights keep PyTorch's default initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rl_tformers.agents.common.encoders.base import (
    ENCODERS,
    EncoderCapabilities,
    EncoderConfig,
    ObservationEncoder,
    param_dtype,
    pixels_to_float,
)
from torch import Tensor, nn

from rl_tformers.typed_config import option

#: smallest H and W the 3 x 3 convolution takes
MINATAR_MIN_SIZE = 3


class MinAtarCNN(ObservationEncoder):
    """Young and Tian 2019's network: (..., C, H, W) pixels -> (..., features).

    Args:
        obs_shape: (C, H, W), H and W >= 3 (MinAtar: 10 x 10).
        features: units of the fully connected layer (paper: 128).
        channels_last: run the convolution in ``torch.channels_last`` memory format.
    """

    def __init__(self, obs_shape: tuple[int, ...], features: int = 128, channels_last: bool = True) -> None:
        super().__init__(obs_shape, features)
        c, h, w = self.obs_shape
        self.channels_last = channels_last
        self.conv = nn.Sequential(nn.Conv2d(c, 16, 3, stride=1), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(16 * (h - 2) * (w - 2), features), nn.ReLU())
        if channels_last:
            self.conv.to(memory_format=torch.channels_last)

    def encode(self, x: Tensor) -> Tensor:
        """(N, C, H, W) pixels (uint8, or floats in 0..255) -> (N, features)."""
        x = pixels_to_float(x, param_dtype(self))  # (N, C, H, W) in [0, 1]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.fc(self.conv(x).flatten(1))  # (N, 16, H-2, W-2) -> (N, features)


@ENCODERS.register(
    "minatar_cnn",
    description="Young and Tian 2019's MinAtar network on uint8 (C, H, W) frames: 16 3x3/1, fc 128",
    paper="Young and Tian 2019, MinAtar: An Atari-Inspired Testbed (sec. 4)",
    capabilities=EncoderCapabilities(image=True, min_size=MINATAR_MIN_SIZE),
)
@dataclass(frozen=True)
class MinAtarCNNConfig(EncoderConfig):
    """``agent.encoder.kind=minatar_cnn``: :class:`MinAtarCNN`."""

    features: int = option(128, "units of the fully connected layer (the feature size F)", ge=1)
    channels_last: bool = option(True, "run the convolution in channels_last memory format (docs/encoders.md)")

    def build(self, obs_shape: tuple[int, ...]) -> MinAtarCNN:
        return MinAtarCNN(obs_shape, self.features, self.channels_last)

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        return self.features
