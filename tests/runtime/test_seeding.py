"""RNG capture/restore (all generators, through weights_only loading) and derived seeds."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from rl_tformers.runtime.seeding import (
    capture_rng_state,
    derive_seed,
    isolated_rng,
    restore_rng_state,
    seed_everything,
)


def draw() -> tuple:
    return random.random(), float(np.random.standard_normal()), torch.rand(3).tolist(), random.gauss(0, 1)


def test_capture_restore_through_a_checkpoint_file() -> None:
    seed_everything(5)
    draw()  # move every stream, leave a cached gauss behind
    random.gauss(0, 1)
    np.random.standard_normal()
    state = capture_rng_state()
    expected = draw()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    draw()
    restore_rng_state(loaded)
    assert draw() == expected


def test_seed_everything_is_reproducible() -> None:
    seed_everything(3)
    a = draw()
    seed_everything(3)
    assert draw() == a
    seed_everything(4)
    assert draw() != a
    with pytest.raises(ValueError, match="seed must be >= 0"):
        seed_everything(-1)


def test_isolated_rng_leaves_streams_untouched() -> None:
    seed_everything(1)
    expected = draw()
    seed_everything(1)
    with isolated_rng():
        draw()
        draw()
    assert draw() == expected


def test_derive_seed() -> None:
    a = derive_seed(0, "eval", 100)
    assert a == derive_seed(0, "eval", 100) and 0 <= a < 2**32
    assert len({a, derive_seed(1, "eval", 100), derive_seed(0, "eval", 101), derive_seed(0, "collect", 100)}) == 4
    assert derive_seed(0, "eval", 100) == 3976765062  # pinned: a change would silently reseed every environment
    with pytest.raises(TypeError):
        derive_seed(0, 1.5)  # type: ignore[arg-type]
