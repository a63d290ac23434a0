"""Interface of positional encodings.

A positional encoding is built once per layer (``build(ctx)`` with ``ctx.layer_idx``) and
offers hooks that attention kernels call; positions always come from the caller (DT passes
token indices built from environment timesteps, GTrXL absolute steps), never from
``arange`` inside the module, so memory and cache offsets stay right.

Hooks (each a no-op in the base class; a kind overrides those it needs and sets the flag):

- ``embed(x, pos)``: absolute encodings added to the layer input (``absolute``).
- ``score_bias(q, pos_q, pos_k)``: additive score term (ALiBi, Shaw keys, XL's (b)+(d)). Kernels
  add it to the *already scaled* scores ``q.k / sqrt(Dh)``: a kind whose paper scales its term
  (Shaw, XL) scales it itself.
- ``content_query(q)``: query used for the content term (XL: q + u).
- ``rotate(x, pos)``: rotate queries or keys by their positions (RoPE).
- ``transform_scores(scores, pos_q, pos_k)``: re-weight raw scores (DA-Transformer).
- ``value_term(probs, pos_q, pos_k)``: extra value term from probabilities (Shaw values).

Kernels that never materialise scores (linear attention) accept only positions that do not
need scores (``absolute``, ``rotary``, ``none``); others are refused at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.backbone_config import SlotConfig


@dataclass(frozen=True)
class PositionConfig(SlotConfig):
    """Base class of positional-encoding configs (``build(ctx) -> PositionModule``)."""

    def build(self, ctx) -> PositionModule:  # pragma: no cover - abstract
        raise NotImplementedError


class PositionModule(nn.Module):
    """Per-layer positional hooks. Shapes: q (B, H, ..., T, Dh), pos_q (B, ..., T), pos_k (B, ..., S).

    The ``...`` lets block-sparse kernels pass gathered blocks: any leading dims between the
    batch and the token axis are carried through.
    """

    absolute = False  # embed() adds to the layer input
    additive_bias = False  # score_bias() returns a term
    rotates = False  # rotate() changes q, k
    transforms_scores = False  # transform_scores() changes scores (needs explicit scores)
    value_bias = False  # value_term() adds to the output (needs probabilities)

    @property
    def needs_scores(self) -> bool:
        """True if this encoding needs the score matrix (cannot run inside linear attention)."""
        return self.additive_bias or self.transforms_scores or self.value_bias

    @property
    def needs_probs(self) -> bool:
        """True if this encoding needs the attention probabilities or the raw score matrix
        before softmax (``transform_scores`` / ``value_term``)."""
        return self.transforms_scores or self.value_bias

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """x: (B, T, D), pos: (B, T) -> (B, T, D)."""
        return x

    def score_bias(self, q: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor | None:
        """q: (B, H, ..., T, Dh) -> additive bias (B, H, ..., T, S) or None."""
        return None

    def content_query(self, q: Tensor) -> Tensor:
        """Query (B, H, ..., T, Dh) used for the content score q.k (XL: q + u); identity here."""
        return q

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        """Rotate queries or keys (B, H, ..., L, Dh) by their positions (B, ..., L) (RoPE); identity here."""
        return x

    def transform_scores(self, scores: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """Scaled scores (B, H, ..., T, S) (bias added, before masking) -> re-weighted scores."""
        return scores

    def value_term(self, probs: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor | None:
        """probs: (B, H, ..., T, S) -> (B, H, ..., T, Dh) to add to the attention output, or None."""
        return None


def rel_distance(pos_q: Tensor, pos_k: Tensor) -> Tensor:
    """Signed distances i - j: (B, ..., T) and (B, ..., S) -> (B, 1, ..., T, S) long (head axis added)."""
    return (pos_q[..., :, None] - pos_k[..., None, :]).unsqueeze(1)


def per_head(param: Tensor, ndim: int) -> Tensor:
    """Broadcast a per-head tensor against a (B, H, ..., T, S)-shaped score tensor.

    Args:
        param: (H,) or (H, Dh) per-head values.
        ndim: number of dims of the tensor it will meet (4 for (B, H, T, S), more with ``...``).
    Returns:
        (1, H, 1, ..., 1) for (H,) input, or (1, H, 1, ..., 1, Dh) for (H, Dh) input, with
        ``ndim`` dims in total.
    """
    if param.dim() == 1:
        return param.view(1, -1, *([1] * (ndim - 2)))  # (1, H, 1.., 1)
    return param.view(1, param.shape[0], *([1] * (ndim - 3)), param.shape[1])  # (1, H, 1.., Dh)


def check_position_dtype(pos: Tensor, who: str, name: str = "positions") -> None:
    """Refuse positions that are not integers (float, complex or bool tensors).

    Positions index tables and phases; a float tensor is never rounded or truncated silently.

    Raises:
        ValueError: ``pos`` does not have an integer dtype; the message names ``who``, ``name``,
            the dtype and the expected one (int64, or any integer dtype).
    """
    dt = pos.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise ValueError(
            f"{who}: {name} must have an integer dtype (torch.int64, or any integer dtype), got {dt}; "
            f"positions are token indices or episode steps: pass them as integers (e.g. .long() after "
            f"rounding them yourself, if they really are whole numbers)"
        )


def check_positions(pos: Tensor, limit: int, who: str) -> None:
    """Raise ValueError naming ``who`` if ``pos`` is not an integer tensor
    (:func:`check_position_dtype`) or any position is outside [0, limit)."""
    check_position_dtype(pos, who)
    if pos.numel() == 0:
        return
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0 or hi >= limit:
        raise ValueError(
            f"{who}: positions must lie in [0, {limit}) but got [{lo}, {hi}]; "
            f"raise backbone.max_position or pass smaller positions"
        )


def embedding_table(rows: int, dim: int, option: str) -> nn.Embedding:
    """An ``nn.Embedding(rows, dim)`` whose allocation failure names the option that sized it.

    Args:
        rows: table rows (positions, episode steps).
        dim: row width (d_model).
        option: the dotted config key that set ``rows`` (e.g. ``backbone.max_position``).

    Raises:
        ValueError: the (rows, dim) float32 table cannot be allocated (a config value far beyond
            the data, or beyond int64); the message gives its size in bytes and the option to lower, instead of
            the allocator's bare RuntimeError.
    """
    try:
        return nn.Embedding(rows, dim)
    except (RuntimeError, TypeError) as err:  # TypeError: a size beyond int64 ("Overflow when unpacking long")
        if "alloc" not in str(err) and "Overflow" not in str(err):
            raise
        raise ValueError(
            f"the ({rows}, {dim}) float32 table sized by {option} ({rows * dim * 4:,} bytes) cannot be "
            f"allocated; lower {option} to the largest position/step the data really has"
        ) from None

