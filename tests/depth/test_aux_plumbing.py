"""Attention aux losses and metrics (adaptive span's L1 penalty and span) reach the backbone
output through every memory and depth kind of this package."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.registry import ATTENTION

D = 16
SPAN = {"kind": "adaptive_span", "max_span": 8, "ramp": 2, "init": 0.5, "loss_coef": 0.1}

CASES = {
    "universal": ({"kind": "universal", "max_steps": 3}, {"kind": "none"}),
    "early_exit": ({"kind": "early_exit", "confidence": "saturation"}, {"kind": "none"}),
    "early_exit+xl": ({"kind": "early_exit", "confidence": "saturation"}, {"kind": "xl", "mem_len": 4}),
    "compressive": ({"kind": "fixed"}, {"kind": "compressive", "mem_len": 4, "compressed_len": 2, "rate": 2}),
    "knn": ({"kind": "fixed"}, {"kind": "knn", "mem_len": 4, "store_size": 8, "top_k": 2}),
}


@pytest.mark.skipif("adaptive_span" not in ATTENTION, reason="adaptive_span kernel not registered")
@pytest.mark.parametrize("case", sorted(CASES))
def test_span_penalty_and_metrics_reach_the_output(case):
    depth, memory = CASES[case]
    bb = Backbone({
        "d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
        "attention": SPAN, "depth": depth, "memory": memory,
    }).train()
    state = bb.initial_state(2) if memory["kind"] != "none" else None
    for _ in range(2):  # second call: memories are filled (compressive evicts, kNN retrieves)
        out = bb(torch.randn(2, 6, D), state=state, exit_threshold=0.0) if depth["kind"] == "early_exit" else bb(torch.randn(2, 6, D), state=state)
        state = out.state
    assert "span_l1" in out.aux and torch.isfinite(out.aux["span_l1"]) and out.aux["span_l1"] > 0
    assert any(k.endswith("/span") for k in out.metrics), sorted(out.metrics)
    # the penalty trains the spans
    spans = [p for n, p in bb.named_parameters() if "span" in n]
    grads = torch.autograd.grad(out.aux["span_l1"], spans, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
