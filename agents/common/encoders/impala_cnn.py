"""``impala_cnn``: the residual CNN of IMPALA (Espeholt et al. 2018) on stacked pixel frames.

Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance Weighted
Actor-Learner Architectures" (ICML), figure 3 (right, the "large" network): three stages of
16, 32 and 32 channels; each stage is a 3 x 3 convolution (stride 1), a 3 x 3 max pooling of
stride 2 and two residual blocks ``x + conv(relu(conv(relu(x))))`` (3 x 3 convolutions); then a
rectifier, a fully connected layer of 256 units and a rectifier (the LSTM of the paper is the
agent's sequence model here). Padding keeps sizes ("SAME"), the pooling rounds up::

    (N, C, 84, 84) uint8 -> /255 -> stage 16 -> (N, 16, 42, 42)
                                 -> stage 32 -> (N, 32, 21, 21)
                                 -> stage 32 -> (N, 32, 11, 11) -> relu, flatten (N, 3872)
                                 -> fc (features, 256) -> (N, 256)

Any frame size of at least 1 x 1 pixels works. Weights keep PyTorch's default initialisation.
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
from rl_tformers.agents.common.encoders.nature_cnn import conv_out
from torch import Tensor, nn

from rl_tformers.typed_config import ConfigFieldError, option


class ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with two 3 x 3 convolutions of ``channels``: (N, c, H, W) -> same."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ImpalaStage(nn.Module):
    """Conv 3 x 3 -> max pool 3 x 3 stride 2 -> two residual blocks: (N, c_in, H, W) -> (N, c, ceil(H/2), ceil(W/2))."""

    def __init__(self, c_in: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, channels, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.res0 = ResidualBlock(channels)
        self.res1 = ResidualBlock(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.res1(self.res0(self.pool(self.conv(x))))


class ImpalaCNN(ObservationEncoder):
    """IMPALA's CNN: (..., C, H, W) pixels -> (..., features); see the module docstring.

    Args:
        obs_shape: (C, H, W).
        channels: the stages' widths (paper: 16, 32, 32).
        features: units of the fully connected layer (paper: 256).
        channels_last: run the convolutions in ``torch.channels_last`` memory format.
    """

    def __init__(self, obs_shape: tuple[int, ...], channels: tuple[int, ...] = (16, 32, 32), features: int = 256,
                 channels_last: bool = True) -> None:
        super().__init__(obs_shape, features)
        c, h, w = self.obs_shape
        self.channels_last = channels_last
        stages = []
        for ch in channels:
            stages.append(ImpalaStage(c, ch))
            c, h, w = ch, conv_out(h, 3, 2, 1), conv_out(w, 3, 2, 1)
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Sequential(nn.Linear(c * h * w, features), nn.ReLU())
        if channels_last:
            self.stages.to(memory_format=torch.channels_last)

    def encode(self, x: Tensor) -> Tensor:
        """(N, C, H, W) pixels (uint8, or floats in 0..255) -> (N, features)."""
        x = pixels_to_float(x, param_dtype(self))  # (N, C, H, W) in [0, 1]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = torch.relu(self.stages(x))  # (N, c, H', W')
        return self.fc(h.flatten(1))  # (N, c H' W') -> (N, features)


@ENCODERS.register(
    "impala_cnn",
    description="Espeholt et al. 2018's residual CNN on uint8 (C, H, W) frames: stages 16/32/32, fc 256",
    paper="Espeholt et al. 2018, IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner "
          "Architectures (ICML), figure 3",
    capabilities=EncoderCapabilities(image=True, min_size=1),
)
@dataclass(frozen=True)
class ImpalaCNNConfig(EncoderConfig):
    """``agent.encoder.kind=impala_cnn``: :class:`ImpalaCNN`.

    Raises (on construction):
        ConfigFieldError: ``channels`` empty.
    """

    channels: tuple[int, ...] = option((16, 32, 32), "channels of the stages (conv, max pool, two residual "
                                       "blocks each)", ge=1)
    features: int = option(256, "units of the last fully connected layer (the feature size F)", ge=1)
    channels_last: bool = option(True, "run the convolutions in channels_last memory format (faster on CPU, "
                                 "docs/encoders.md)")

    def __post_init__(self) -> None:
        if not self.channels:
            raise ConfigFieldError("channels", "must be a non-empty list of integers >= 1 (e.g. [16, 32, 32]), got []")

    def build(self, obs_shape: tuple[int, ...]) -> ImpalaCNN:
        return ImpalaCNN(obs_shape, self.channels, self.features, self.channels_last)

    def out_features(self, obs_shape: tuple[int, ...]) -> int:
        return self.features
