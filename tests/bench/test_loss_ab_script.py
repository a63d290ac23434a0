"""scripts/loss_ab.py: the shipped DT's training loss in two variants (the library's dropout draws
and F.dropout's; float32 and bf16 autocast), the same seeds and data, and the spread between seeds
beside their difference."""

from __future__ import annotations

import json
import sys

import pytest

from scripts import script_module

ab = script_module("loss_ab")


def test_summary_puts_the_draws_difference_beside_the_seed_spread():
    runs = {"lanes": {0: {"blocks": [1.0, 0.5]}, 1: {"blocks": [3.0, 0.7]}},
            "torch": {0: {"blocks": [2.0, 0.4]}, 1: {"blocks": [4.0, 0.8]}}}
    rows = ab.summary(runs, [0, 1])
    assert rows[0] == {"block": 0, "lanes_mean": 2.0, "torch_mean": 3.0, "difference": -1.0,
                       "seed_sd": pytest.approx(2 ** 0.5)}
    assert rows[1]["difference"] == pytest.approx(0.0) and rows[1]["seed_sd"] == pytest.approx(2 ** 0.5 * 0.2 * 0.75)


def test_a_short_run_writes_both_draws_curves_per_seed(tiny_hdf5, tmp_path, monkeypatch):
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["loss_ab.py", "--updates", "4", "--every", "2", "--seeds", "0,1",
                                      "--dataset", str(tiny_hdf5), "--out", str(out)])
    ab.main()
    res = json.loads(out.read_text())
    for d in ("lanes", "torch"):
        assert set(res["runs"][d]) == {"0", "1"}
        assert all(len(r["blocks"]) == 2 and r["updates_per_cpu_s"] > 0 for r in res["runs"][d].values())
    assert res["runs"]["lanes"]["0"]["blocks"] != res["runs"]["torch"]["0"]["blocks"]  # other dropout masks
    assert [r["block"] for r in res["summary"]] == [0, 1]
    assert res["machine"]["cpu_vendor"] and res["command"].startswith("python scripts/loss_ab.py --compare draws")


def test_the_amp_comparison_trains_float32_against_bf16_autocast(tiny_hdf5, tmp_path, monkeypatch):
    out = tmp_path / "amp.json"
    monkeypatch.setattr(sys, "argv", ["loss_ab.py", "--compare", "amp", "--updates", "2", "--every", "2",
                                      "--seeds", "0", "--dataset", str(tiny_hdf5), "--out", str(out)])
    ab.main()
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"fp32", "bf16"} and {"fp32_mean", "bf16_mean"} <= set(res["summary"][0])
    assert res["runs"]["fp32"]["0"]["blocks"] != res["runs"]["bf16"]["0"]["blocks"]
