"""``nature_cnn``: the DQN convolutional network of Mnih et al. 2015 on stacked pixel frames.

Mnih et al. 2015, "Human-level control through deep reinforcement learning" (Nature 518),
Methods, "Model architecture": the input is 84 x 84 x 4 (the last 4 preprocessed grey frames);
a convolution of 32 filters 8 x 8 stride 4, one of 64 filters 4 x 4 stride 2 and one of 64
filters 3 x 3 stride 1, each followed by a rectifier, then a fully connected layer of 512
rectifier units. With C stacked frames of H x W pixels::

    (N, C, 84, 84) uint8  -> /255 -> conv 8x8/4 (32)  -> (N, 32, 20, 20)
                                  -> conv 4x4/2 (64)  -> (N, 64, 9, 9)
                                  -> conv 3x3/1 (64)  -> (N, 64, 7, 7) -> flatten (N, 3136)
                                  -> fc (features, 512) -> (N, 512)

The Decision Transformer's Atari code (Chen et al. 2021, ``atari/mingpt/model_atari.py``) embeds
each state with the same three convolutions. Frames must be at least 36 x 36 (the smallest that
leaves one position after the third convolution). Weights keep PyTorch's default initialisation.
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

#: smallest H and W the three convolutions take: (36 - 8) / 4 + 1 = 8, (8 - 4) / 2 + 1 = 3, 3 - 3 + 1 = 1
NATURE_MIN_SIZE = 36


def conv_out(size: int, kernel: int, stride: int, padding: int = 0) -> int:
    """Output length of a convolution or pooling along one axis (PyTorch's floor rule)."""
    return (size + 2 * padding - kernel) // stride + 1


class NatureCNN(ObservationEncoder):
    """Mnih et al. 2015's CNN: (..., C, H, W) pixels -> (..., features); see the module docstring.

    Args:
        obs_shape: (C, H, W), H and W >= 36.
        features: units of the fully connected layer (paper: 512).
        channels_last: run the convolutions in ``torch.channels_last`` memory format.
    """

    def __init__(self, obs_shape: tuple[int, ...], features: int = 512, channels_last: bool = True) -> None:
        super().__init__(obs_shape, features)
        c, h, w = self.obs_shape
        self.channels_last = channels_last
        self.convs = nn.Sequential(
            nn.Conv2d(c, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
        )
        oh, ow = h, w
        for k, s in ((8, 4), (4, 2), (3, 1)):
            oh, ow = conv_out(oh, k, s), conv_out(ow, k, s)
        self.fc = nn.Sequential(nn.Linear(64 * oh * ow, features), nn.ReLU())
        if channels_last:
            self.convs.to(memory_format=torch.channels_last)

    def encode(self, x: Tensor) -> Tensor:
        """(N, C, H, W) pixels (uint8, or floats in 0..255) -> (N, features)."""
        x = pixels_to_float(x, param_dtype(self))  # (N, C, H, W) in [0, 1]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = self.convs(x)  # (N, 64, H', W')
        return self.fc(h.flatten(1))  # (N, 64 H' W') -> (N, features)


@ENCODERS.register(
    "nature_cnn",
    description="Mnih et al. 2015's CNN on uint8 (C, H, W) frames: 32 8x8/4, 64 4x4/2, 64 3x3/1, fc 512",
    paper="Mnih et al. 2015, Human-level control through deep reinforcement learning (Nature)",
    capabilities=EncoderCapabilities(image=True, min_size=NATURE_MIN_SIZE),
)
@dataclass(frozen=True)
class NatureCNNConfig(EncoderConfig):
    """``agent.encoder.kind=nature_cnn``: :class:`NatureCNN`."""

    features: int = option(512, "units of the last fully connected layer (the feature size F)", ge=1)
    channels_last: bool = option(True, "run the convolutions in channels_last memory format (faster on CPU, "
                                 "docs/encoders.md)")

    def build(self, obs_shape: tuple[int, ...]) -> NatureCNN:
        return NatureCNN(obs_shape, self.features, self.channels_last)

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        return self.features
