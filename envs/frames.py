"""Pixel observations in datasets: frames stored once, stacked when a sample is drawn.

A pixel dataset stores one ``(C, H, W)`` uint8 frame per step (grey-scale Atari: ``C = 1``,
MinAtar: ``C`` object channels), never the stacked observation the agent acts on; its metadata
says how many frames make one observation (``frame_stack``: 4 for Atari, 1 for MinAtar). The
samplers (:mod:`rl_tformers.envs.samplers`) build each sampled step's stack from the stored
frames with :func:`stack_frames`, so the dataset's memory stays about 1x its frames' bytes
(a stored stack would cost ``frame_stack`` times that, as would a float copy four times more).

Stacks never cross an episode start: the slots of a stack before the episode's first frame are
zeros, as in Dopamine's replay buffer (the DQN-replay data, Agarwal et al. 2020, on which the
Decision Transformer's Atari code samples its states) and in the evaluation environment
(``FrameStackObservation(padding_type="zero")``, :mod:`rl_tformers.envs.pixels`): step ``t`` of
an episode gets ``[f_{t-k+1}, ..., f_t]`` (oldest first) with ``f_i = 0`` for ``i < 0``; step 0
is ``[0, ..., 0, f_0]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: the metadata key (``DatasetMetadata.extra``, the rl_tformers record of a Minari dataset, an
#: attribute of a D4RL file) holding the frames per observation of a pixel dataset
FRAME_STACK_KEY = "frame_stack"
#: the most frames one observation stacks (Atari stacks 4): a larger ``frame_stack`` in a received
#: file is refused, as each sampled step would hold that many frames
MAX_FRAME_STACK = 64


def is_image_shape(shape: tuple[int, ...]) -> bool:
    """A per-step observation shape of three axes, read as ``(C, H, W)``."""
    return len(tuple(shape)) == 3


def stack_rows(flat: np.ndarray, steps: np.ndarray, frame_stack: int) -> tuple[np.ndarray, np.ndarray]:
    """The dataset rows of each stack slot and whether the slot holds a frame of the episode.

    Args:
        flat: ``(...)`` int64 flat row of each sampled step.
        steps: ``(...)`` int64 step of that row inside its episode.
        frame_stack: k, frames per observation.

    Returns:
        ``rows (..., k)`` int64 (slot j reads row ``flat - (k - 1 - j)``; a slot before the
        episode start reads ``flat`` itself, to be zeroed) and ``valid (..., k)`` bool (False
        before the episode start).
    """
    back = np.arange(frame_stack - 1, -1, -1, dtype=np.int64)  # (k,) k-1, ..., 0: oldest slot first
    valid = np.asarray(steps)[..., None] >= back  # (..., k)
    rows = np.where(valid, np.asarray(flat)[..., None] - back, np.asarray(flat)[..., None])  # (..., k)
    return rows, valid


def stack_frames(observations: Any, flat: np.ndarray, steps: np.ndarray, frame_stack: int,
                 mask: np.ndarray | None = None) -> np.ndarray:
    """Frame-stacked observations of sampled steps, read from one-frame-per-step storage.

    Args:
        observations: ``(N, C, H, W)`` uint8 frames (a numpy array or a lazy HDF5 array).
        flat: ``(B, L)`` flat rows of the sampled steps.
        steps: ``(B, L)`` their steps inside their episodes.
        frame_stack: k.
        mask: ``(B, L)`` bool, False on padded slots (whose stack is all zeros); ``None``: all real.

    Returns:
        ``(B, L, k * C, H, W)`` uint8, frames oldest first along the channel axis (frame ``j``
        in channels ``[j * C, (j + 1) * C)``), zeros before the episode start and on padding.
        Only the B x L x k frames read are copied; nothing is converted to float.
    """
    k = int(frame_stack)
    rows, valid = stack_rows(flat, steps, k)  # (B, L, k)
    if mask is not None:
        valid = valid & np.asarray(mask)[..., None]
    frames = np.asarray(observations[rows])  # (B, L, k, C, H, W)
    frames[~valid] = 0
    b, length = rows.shape[:2]
    return frames.reshape(b, length, k * frames.shape[3], *frames.shape[4:])  # (B, L, k*C, H, W)
