"""Real complexity of the fixed-pattern sparse kernels: at L = 16384 (dense scores would be
L * L = 268M elements per head, 1 GiB in float32) no tensor of the forward or backward pass
comes near L x L.

The largest tensor produced by any ATen op (views included) is recorded with a
``TorchDispatchMode`` while one forward + backward runs, and compared with the kind's own
budget (its largest score block, from the configuration) and with L * L / 8.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_tformers import BackboneConfig
from rl_tformers.backbone_config import BuildContext
from rl_tformers.types import AttnContext

L, D, H = 16384, 16, 2


class LargestTensor(TorchDispatchMode):
    """Largest op output (elements) seen inside the ``with`` block, and the op's name."""

    def __init__(self) -> None:
        super().__init__()
        self.peak, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.peak:
                self.peak, self.op = t.numel(), str(func)
        return out


def bq(w: int) -> int:
    """The engine's automatic query block for a band of w (see longformer.auto_block)."""
    return max(16, min(128, w))


# kind -> (fields at L, causal, largest score block in elements for B = 1 and H heads)
CASES = {
    "local": ({"block": 64, "memory": 64}, True, H * L * (64 + 64)),
    "local_2d": ({"width": 128, "query_shape": (8, 16), "flange": (4, 8)}, True, H * L * (8 + 4) * (16 + 16)),
    "strided": ({"stride": 128}, True, H * (L * (128 + 128 + 1) + L * L // 128)),
    "fixed": ({"stride": 128, "summary": 4}, True, H * L * (128 + 4 * L // 128)),
    "blockwise": ({"n_blocks": 64}, False, H * L * (L // 64)),
    "etc": ({"radius": 64, "global_tokens": (0, -1)}, False, H * L * (bq(64) + 129 + 2)),
    "sliding_window": ({"window": 128, "dilation": 2, "dilated_heads": 1}, True, H * L * (bq(64) + 128)),
    "longformer": ({"window": 128, "global_tokens": (0,)}, False, H * L * (bq(64) + 129 + 1)),
    "bigbird": ({"block": 32, "random_blocks": 3, "global_tokens": (0,)}, False, H * L * 32 * (3 + 3 + 1)),
    "adaptive_span": ({"max_span": 256, "ramp": 32, "init": 0.5}, True, H * L * (bq(160) + 160)),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_no_l_by_l_tensor_in_forward_or_backward(kind):
    fields, causal, budget = CASES[kind]
    cfg = BackboneConfig(d_model=D, n_heads=H, n_layers=1, attn_dropout=0.0, causal=causal, max_position=L,
                         attention={"kind": kind, **fields})
    ctx = BuildContext(cfg, 0)
    mod = cfg.attention.build(ctx, cfg.position.build(ctx))
    x = torch.randn(1, L, D, requires_grad=True)
    pos = torch.arange(L)[None]
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[0, -7:] = False  # padding: the mask path is exercised
    actx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
    with LargestTensor() as mode:
        out = mod(x, x, actx)
        out.out.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert mode.peak <= budget, f"{kind}: largest tensor {mode.peak} ({mode.op}) exceeds its budget {budget}"
    assert mode.peak <= L * L // 8, f"{kind}: largest tensor {mode.peak} ({mode.op}) is O(L^2)"


def test_budgets_are_far_below_dense():
    """The budgets themselves: every kind at least 8x below one dense L x L score matrix per head."""
    for kind, (_, _, budget) in CASES.items():
        assert budget <= H * L * L / 8, kind
    assert math.isqrt(L) == 128  # strided/fixed use the paper's l ~ sqrt(n)
