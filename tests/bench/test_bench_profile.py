"""``rl-tformers bench profile``: operator categories, AdamW implementations, the report."""

from __future__ import annotations

import pytest
import torch
from bench_helpers import TINY

from rl_tformers.bench import profile as bp


def test_categories():
    assert bp.category("aten::addmm", "aten::linear") == "matmul"
    assert bp.category("aten::copy_", "aten::addmm") == "addmm bias copy"
    assert bp.category("aten::copy_", "aten::clone") == "other"
    assert bp.category("aten::bernoulli_", None) == "dropout RNG"
    assert bp.category("aten::_fused_adamw_", None) == "optimizer"
    assert bp.category("aten::native_layer_norm_backward", None) == "norm"
    assert bp.category("aten::threshold_backward", None) == "elementwise"


@pytest.mark.parametrize("adamw", ["loop", "fused"])
def test_profile_run(tiny_hdf5, adamw):
    res = bp.run(list(TINY), steps=2, profile_steps=2, adamw=adamw, dataset=str(tiny_hdf5))
    assert res["adamw"] == adamw and res["updates_per_s"] > 0
    shares = [c["share"] for c in res["categories"].values()]
    assert sum(shares) == pytest.approx(1.0) and res["categories"]["matmul"]["ms"] > 0
    assert ("aten::_fused_adamw_" in res["top_ops"] or "optimizer" in res["categories"]) if adamw == "fused" else True
    assert "| matmul |" in bp.markdown(res)


def test_set_adamw_keeps_groups_and_schedule(tiny_hdf5, tmp_path):
    runner = bp.OursRunner("ours", bp.Settings(dataset=str(tiny_hdf5)), list(TINY), tmp_path)
    before = [(g["weight_decay"], g["lr"], len(g["params"])) for g in runner.trainer.optimizer.param_groups]
    bp.set_adamw(runner, "loop")
    opt = runner.trainer.optimizer
    assert opt.defaults["foreach"] is False and not opt.defaults.get("fused")
    assert [(g["weight_decay"], g["lr"], len(g["params"])) for g in opt.param_groups] == before
    runner.run("model", 2)
    assert runner.trainer.scheduler.last_epoch == 2 and torch.isfinite(opt.param_groups[0]["params"][0]).all()
    with pytest.raises(ValueError, match="--adamw"):
        bp.set_adamw(runner, "sgd")
