"""The RL-scale case of ``bench attention --rl-scale`` (DT with a long context, dense vs efficient
kernels): rows, ratios and skips, on the synthetic Hopper file with a tiny budget."""

from __future__ import annotations

import math

import pytest

from rl_tformers.bench import attention as ba
from rl_tformers.bench import attention_rl

TINY = {"steps": 2, "context_len": 6, "batch_size": 2, "d_model": 16, "n_layers": 1, "n_heads": 2, "episodes": 1,
        "warmup_steps": 1}


def test_case_trains_each_causal_kind_and_skips_the_others(tiny_hdf5, tmp_path):
    assert ba.RL_SCALE_CASES[attention_rl.CASE] is attention_rl.dt_long_context
    rows, notes = ba.run_rl_scale(["performer", "longformer"], "cpu", dataset=str(tiny_hdf5),
                                  work_dir=str(tmp_path), timing_rounds=2, timing_updates=1, **TINY)
    assert notes == []
    by_kind = {r["kind"]: r for r in rows if r["case"] == attention_rl.CASE}
    assert list(by_kind) == ["sdpa", "performer", "longformer"]  # dense first, always
    assert by_kind["longformer"]["status"].startswith("skipped: no causal form")
    for kind in ("sdpa", "performer"):
        r = by_kind[kind]
        assert r["status"] == "ok" and r["tokens"] == 18 and r["steps"] == 2
        assert r["steps_per_s"] > 0 and math.isclose(r["seconds_per_step"] * r["steps_per_s"], 1.0)
        assert isinstance(r["normalised_score"], float) and isinstance(r["train_loss"], float)
        assert r["eval_seconds"] > 0
        assert (tmp_path / kind / "checkpoints").is_dir()
    assert by_kind["sdpa"]["speed_ratio"] == 1.0 and by_kind["sdpa"]["interleaved_speed_ratio"] == 1.0
    p = by_kind["performer"]
    assert p["interleaved_speed_ratio"] == by_kind["sdpa"]["interleaved_seconds_per_step"] / p["interleaved_seconds_per_step"]
    assert "interleaved_seconds_per_step" not in by_kind["longformer"]
    assert by_kind["performer"]["speed_ratio"] == by_kind["performer"]["steps_per_s"] / by_kind["sdpa"]["steps_per_s"]
    again = {r["kind"]: r for r in attention_rl.summarise_runs([str(tmp_path)])}  # from the kept run directories
    assert sorted(again) == ["performer", "sdpa"]
    for kind, r in again.items():
        for key in ("seconds_per_step", "steps_per_s", "speed_ratio", "normalised_score", "train_loss", "eval_seconds"):
            assert r[key] == by_kind[kind][key], (kind, key)
    table = attention_rl.markdown_table(rows)
    assert table.count("\n") == 4 and "| longformer | skipped" in table


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match="unknown dt_long_context options"):
        attention_rl.dt_long_context(["sdpa"], "cpu", stepz=3)


def test_overrides_carry_the_kernels_benchmark_settings():
    ov = attention_rl._overrides("local", {**attention_rl.DEFAULTS})
    assert "agent.context_len=500" in ov and "backbone.attention.block=64" in ov and "backbone.attention.memory=64" in ov
