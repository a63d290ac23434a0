"""``rl-tformers bench train``: our variants through the Trainer, FLOP counts, MFU, ratios, the
peer data export, a peer that cannot start, and (slow, when a peer environment exists) the peers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from bench_helpers import TINY
from typer.testing import CliRunner

from rl_tformers.bench import train as bt
from rl_tformers.runtime.cpu_matmul import onednn_linear_available, resolve_cpu_matmul

#: the extra row with PyTorch's own GEMMs where the shipped default runs oneDNN (this CPU)
MKL = [bt.MKL_ROW] if resolve_cpu_matmul("auto") != "mkl" else []


def _settings(path, **kw):
    base = dict(dataset=str(path), repeats=2, steps=2, warmup=1, peers=(), overrides=TINY, matmul_sizes=(64, 128))
    return bt.Settings(**{**base, **kw})


def test_ours_rows_flops_mfu_and_ratios(tiny_hdf5):
    res = bt.run(_settings(tiny_hdf5, bf16=True, ffn_dropout_row=True))
    rows = {(r["impl"], r["mode"]): r for r in res.rows}
    variants = ["ours", "ours+bf16", "ours-ffn-dropout", *MKL]
    assert [r["impl"] for r in res.rows][::2] == variants
    assert set(rows) == {(v, m) for v in variants for m in ("e2e", "model")}
    f = {r["flops_per_step"] for r in res.rows}
    assert len(f) == 1 and f.pop() > 0  # dropout placement and precision do not change the FLOPs
    for r in res.rows:
        assert len(r["steps_per_s_all"]) == 2 and r["steps_per_s"] == pytest.approx(np.median(r["steps_per_s_all"]))
        peak = res.peak_gflops[r["peak_dtype"]]
        assert r["mfu"] == pytest.approx(r["flops_per_step"] * r["steps_per_s"] / 1e9 / peak)
    fp32 = [by for key, by in res.peak_by_size.items() if key.split("/")[0] == "fp32"]
    assert set(res.peak_by_size) == {"fp32", "bf16", *(["fp32/onednn"] if onednn_linear_available() else [])}
    assert res.peak_gflops["fp32"] == max(max(by.values()) for by in fp32)  # the faster GEMM library
    assert all(set(by) == {64, 128} for by in res.peak_by_size.values())
    assert rows[("ours+bf16", "model")]["peak_dtype"] == "bf16" and rows[("ours", "model")]["peak_dtype"] == "fp32"
    q = {(x["mode"], x["impl"], x["vs"]): x["ratio"] for x in res.ratios}
    by = {k: v["steps_per_s"] for k, v in rows.items()}
    assert q[("model", "ours+bf16", "ours")] == pytest.approx(by[("ours+bf16", "model")] / by[("ours", "model")])
    assert "peers skipped" not in " ".join(res.notes)
    md = bt.markdown(res)
    assert "| ours | model |" in md and "| ours-ffn-dropout | e2e |" in md and "matmul peak" in md


def test_variants_are_the_shipped_config_plus_one_override():
    s = bt.Settings(bf16=True, compile=True, ffn_dropout_row=True)
    assert bt.our_variants(s) == [("ours", []), ("ours+bf16", ["train.amp=bf16"]),
                                  ("ours+compile", ["train.compile=true"]),
                                  ("ours-ffn-dropout", ["backbone.ffn_dropout=0.1"]),
                                  *[(m, ["cpu_matmul=mkl"]) for m in MKL]]
    assert bt.our_variants(bt.Settings()) == [("ours", []), *[(m, ["cpu_matmul=mkl"]) for m in MKL]]
    # with the library given as an override (or on a GPU) there is no extra MKL row
    assert bt.our_variants(bt.Settings(overrides=("cpu_matmul=onednn",))) == [("ours", [])]
    assert bt.our_variants(bt.Settings(device="cuda")) == [("ours", [])]


def test_ours_is_the_peers_dropout_placement(tiny_hdf5, tmp_path):
    # the shipped DT config is GPT-2's placement (the peers' model); the optional row is not
    ours = bt.OursRunner("ours", _settings(tiny_hdf5), list(TINY), tmp_path / "a").trainer.model
    old = bt.OursRunner("x", _settings(tiny_hdf5), [*TINY, "backbone.ffn_dropout=0.1"], tmp_path / "b").trainer.model
    assert [b.ffn.dropout.p for b in ours.backbone.blocks] == [0.0]
    assert [b.ffn.dropout.p for b in old.backbone.blocks] == [0.1]
    assert [b.dropout.p for b in ours.backbone.blocks] == [b.dropout.p for b in old.backbone.blocks] == [0.1]


def test_ratios_against_peers():
    rows = [{"impl": "ours", "mode": "e2e", "steps_per_s": 6.0}, {"impl": "d3rlpy", "mode": "e2e", "steps_per_s": 4.0},
            {"impl": "ours", "mode": "model", "steps_per_s": 9.0}, {"impl": "ours+bf16", "mode": "model", "steps_per_s": 13.5},
            {"impl": "hf", "mode": "model", "steps_per_s": 3.0}, {"impl": "d3rlpy", "mode": "model", "steps_per_s": 4.5}]
    assert bt.ratios(rows) == [
        {"mode": "e2e", "impl": "ours", "vs": "d3rlpy", "ratio": 1.5},
        {"mode": "model", "impl": "ours", "vs": "d3rlpy", "ratio": 2.0},
        {"mode": "model", "impl": "ours", "vs": "hf", "ratio": 3.0},
        {"mode": "model", "impl": "ours+bf16", "vs": "d3rlpy", "ratio": 3.0},
        {"mode": "model", "impl": "ours+bf16", "vs": "hf", "ratio": 4.5},
        {"mode": "model", "impl": "ours+bf16", "vs": "ours", "ratio": 1.5},
    ]


def test_peer_data_export(tiny_hdf5, tmp_path):
    runner = bt.OursRunner("ours", _settings(tiny_hdf5), list(TINY), tmp_path / "run")
    data = np.load(bt.export_peer_data(runner, tmp_path / "d.npz"))
    meta = json.loads(str(data["meta"]))
    n, obs_dim = data["observations"].shape
    assert meta["context_len"] == 20 and meta["batch_size"] == 64
    assert meta["obs_dim"] == obs_dim == runner.trainer.agent.dataset.observation_shape[0]
    ds = runner.trainer.agent.dataset
    assert n == ds.num_steps and data["actions"].shape == (n, meta["act_dim"]) and meta["act_dim"] == 3
    ends = np.flatnonzero(data["terminals"] | data["timeouts"])
    assert list(ends) == list(np.cumsum(ds.lengths) - 1)  # every episode ends with a flag
    assert data["b_obs"].shape == (8, 64, 20, obs_dim) and data["b_mask"].dtype == bool
    assert np.abs(data["b_actions"]).max() <= 1.0  # model units


def test_a_peer_that_cannot_start_is_reported(tiny_hdf5):
    # this interpreter has no transformers: the hf worker exits at import, the run goes on without it
    res = bt.run(_settings(tiny_hdf5, repeats=1, steps=1, peers=("hf",), peer_python=sys.executable))
    assert [r["impl"] for r in res.rows] == ["ours", "ours", *[m for m in MKL for _ in range(2)]]
    assert any(n.startswith("peer hf skipped") for n in res.notes)


def test_cli_refuses_unknown_peer():
    from rl_tformers.cli import app

    r = CliRunner().invoke(app, ["bench", "train", "--peers", "rllib"])
    assert r.exit_code == 2 and "unknown peers" in r.output


@pytest.mark.slow
def test_real_peers(tiny_hdf5):
    python = bt.default_peer_python()
    if python is None:
        pytest.skip("no peer environment (rl-tformers bench train --build-peers)")
    res = bt.run(_settings(tiny_hdf5, repeats=1, steps=2, peers=bt.PEERS, peer_python=python))
    impls = {(r["impl"], r["mode"]) for r in res.rows}
    assert {("d3rlpy", "e2e"), ("d3rlpy", "model"), ("hf", "model")} <= impls, res.notes
    assert all(r["flops_per_step"] and r["flops_per_step"] > 0 for r in res.rows)
