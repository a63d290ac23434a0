"""``rl-tformers bench train``: our variants through the Trainer, FLOP counts, MFU, ratios, the
peer data export, a peer that cannot start, the pixel task (MinAtar-shaped frames, discrete
actions, ``--memory``), and (slow, when a peer environment exists) the peers."""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
import pytest
import torch
from bench_helpers import TINY
from rl_tformers.envs.loaders import load_d4rl_hdf5
from typer.testing import CliRunner

from rl_tformers.bench import train as bt
from rl_tformers.bench.data import write_synthetic_frames
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
    # the PyTorch-dropout row: the shipped config, its updates inside torch_draws()
    assert ("ours+torch-dropout", []) in bt.our_variants(bt.Settings(torch_dropout_row=True))


def test_the_torch_dropout_row_draws_its_dropouts_from_f_dropout(tiny_hdf5, tmp_path, monkeypatch):
    calls = []
    real = torch.nn.functional.dropout
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda *a, **k: calls.append(1) or real(*a, **k))
    s = _settings(tiny_hdf5, torch_dropout_row=True)
    ours = bt.OursRunner("ours", s, list(TINY), tmp_path / "a")
    ours.step("model")
    assert calls == []  # the library's lanes
    bt.OursRunner(bt.TORCH_DROPOUT_ROW, s, list(TINY), tmp_path / "b").step("model")
    assert calls  # every dropout of the update through F.dropout


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


# -- the pixel task (--task minatar-breakout) -------------------------------------------------------

PIXEL_STEPS = 600


@pytest.fixture(scope="module")
def tiny_pixels(tmp_path_factory):
    """600 MinAtar-shaped steps in D4RL layout: uint8 (4, 10, 10) frames of 0/255 pixels,
    actions 0..2 (the loader infers Discrete(3)), 40-step episodes ending in a termination."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("pixels") / "minatar-synthetic.hdf5"
    terminals = np.zeros(PIXEL_STEPS, dtype=bool)
    terminals[39::40] = True
    with h5py.File(path, "w") as f:
        f["observations"] = (rng.random((PIXEL_STEPS, 4, 10, 10)) < 0.1).astype(np.uint8) * 255
        f["actions"] = rng.integers(0, 3, PIXEL_STEPS).astype(np.int64)
        f["rewards"] = (rng.random(PIXEL_STEPS) < 0.2).astype(np.float32)
        f["terminals"] = terminals
        f["timeouts"] = np.zeros(PIXEL_STEPS, dtype=bool)
    return path


def _pixel_settings(path, **kw):
    return _settings(path, task="minatar-breakout", **kw)


def test_hopper_stays_the_default_task():
    s = bt.Settings()
    assert (s.spec.config, s.dataset_path, s.peer_list, s.spec.base) == ("dt/hopper_medium", bt.DEFAULT_DATASET,
                                                                          ("d3rlpy", "hf"), ())
    px = bt.Settings(task="minatar-breakout")
    assert (px.spec.config, px.dataset_path, px.peer_list) == (
        "dt/minatar_breakout", "rlt/minatar-breakout/dqn-replay-v1", ("d3rlpy",))


def test_pixel_ours_is_float32_and_bf16_its_own_row(tiny_pixels, tmp_path):
    # dt/minatar_breakout ships train.amp=bf16: the task's base override makes the ours row float32
    s = _pixel_settings(tiny_pixels)
    ours = bt.OursRunner("ours", s, [], tmp_path / "a")
    bf16 = bt.OursRunner("ours+bf16", s, ["train.amp=bf16"], tmp_path / "b")
    assert (ours.amp, bf16.amp) == ("none", "bf16")
    cfg = ours.trainer.cfg
    assert (cfg.agent.context_len, cfg.agent.encoder.kind, cfg.train.batch_size) == (30, "minatar_cnn", 64)
    assert ours.presampled[0]["observations"].dtype == torch.uint8


def test_pixel_peer_data_keeps_frames_uint8_and_actions_as_classes(tiny_pixels, tmp_path):
    runner = bt.OursRunner("ours", _pixel_settings(tiny_pixels), [], tmp_path / "run")
    data = np.load(bt.export_peer_data(runner, tmp_path / "d.npz"))
    meta = json.loads(str(data["meta"]))
    with h5py.File(tiny_pixels) as f:
        frames, actions = f["observations"][()], f["actions"][()]
    assert data["observations"].dtype == np.uint8 and np.array_equal(data["observations"], frames)
    assert data["actions"].dtype == np.int64 and np.array_equal(data["actions"], actions)
    assert list(np.flatnonzero(data["terminals"])) == list(range(39, PIXEL_STEPS, 40))
    assert not data["timeouts"].any()
    assert (meta["discrete"], meta["image_obs"], meta["obs_shape"], meta["act_dim"]) == (True, True, [4, 10, 10], 3)
    assert meta["encoder"] == {"filters": [[16, 3, 1]], "features": 128}
    assert (meta["context_len"], meta["d_model"], meta["n_layers"], meta["n_heads"], meta["batch_size"]) == (
        30, 16, 1, 1, 64)  # TINY's backbone
    assert (meta["lr"], meta["weight_decay"], meta["grad_clip"]) == (6e-4, 0.1, 0.25)
    assert data["b_obs"].shape == (8, 64, 30, 4, 10, 10) and data["b_obs"].dtype == np.uint8


def test_stacked_frames_are_not_exported(tmp_path):
    ds = load_d4rl_hdf5(write_synthetic_frames(tmp_path / "atari.hdf5", 100, frame_stack=4, side=36, ep_len=50))
    with pytest.raises(ValueError, match="stacks 4 frames per observation"):
        bt.d4rl_arrays(ds, 0)


def test_pixel_task_rows_memory_and_json(tiny_pixels):
    res = bt.run(_pixel_settings(tiny_pixels, repeats=1, steps=1, bf16=True, memory=True))
    variants = ["ours", "ours+bf16", *MKL]
    assert [(r["impl"], r["mode"]) for r in res.rows] == [(v, m) for v in variants for m in ("e2e", "model")]
    assert all(r["flops_per_step"] > 0 for r in res.rows)
    d = json.loads(json.dumps(res.as_dict()))
    assert d["settings"]["task"] == "minatar-breakout" and d["settings"]["dataset"] == str(tiny_pixels)
    assert d["settings"]["peers"] == [] and d["settings"]["memory"] is True
    m = d["memory"]["ours"]
    assert (m["observations_dtype"], m["observations_bytes"]) == ("uint8", PIXEL_STEPS * 4 * 10 * 10)
    assert 0 < m["rss_start"] <= m["rss_built"] <= m["peak_rss_built"] <= m["peak_rss"]
    assert {r["cpu_matmul"] for r in res.rows} <= {"mkl", "onednn"}
    assert set(d["memory"]) == {"ours"} and not res.notes
    md = bt.markdown(res)
    assert "| ours | uint8, 0.2 MiB |" in md and "peak after training" in md and "| e2e | ours+bf16 | ours |" in md


def test_pixel_task_refuses_hugging_face():
    with pytest.raises(ValueError, match="--peers hf: not measured on --task minatar-breakout"):
        bt.Settings(task="minatar-breakout", peers=("hf",)).check()
    with pytest.raises(ValueError, match="--task 'atari': choose from hopper, minatar-breakout"):
        bt.Settings(task="atari").check()
    from rl_tformers.cli import app  # as test_cli_refuses_unknown_peer does

    r = CliRunner().invoke(app, ["bench", "train", "--task", "minatar-breakout", "--peers", "hf"])
    assert r.exit_code == 2 and "error: --peers hf: not measured on --task minatar-breakout" in r.output


@pytest.mark.slow
def test_real_d3rlpy_on_pixels(tiny_pixels):
    python = bt.default_peer_python()
    if python is None:
        pytest.skip("no peer environment (rl-tformers bench train --build-peers)")
    res = bt.run(_pixel_settings(tiny_pixels, repeats=1, steps=1, peers=("d3rlpy",), peer_python=python, memory=True))
    rows = {(r["impl"], r["mode"]): r for r in res.rows}
    assert {("d3rlpy", "e2e"), ("d3rlpy", "model")} <= set(rows), res.notes
    ours, peer = rows[("ours", "model")], rows[("d3rlpy", "model")]
    assert peer["versions"]["d3rlpy"].startswith("2.8")
    assert abs(peer["params"] - ours["params"]) < 0.01 * ours["params"]  # the same model: CNN, embeddings, GPT
    assert res.memory["d3rlpy"]["observations_dtype"] == "uint8"  # d3rlpy keeps the frames as given
    assert res.memory["d3rlpy"]["observations_bytes"] == PIXEL_STEPS * 4 * 10 * 10
    m = res.memory["d3rlpy"]
    assert 0 < m["rss_start"] <= m["rss_built"] <= m["peak_rss_built"] <= m["peak_rss"]


# -- bad input on the command line: one error line, exit 2, before anything is measured --------------

def _cli(*args):
    from rl_tformers.cli import app  # as test_cli_refuses_unknown_peer does

    return CliRunner().invoke(app, ["bench", "train", *args])


def _refused(r, message):
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert lines == [f"error: {message}"] and "Traceback" not in r.output, r.output


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--matmul-sizes", "512,abc"], "--matmul-sizes '512,abc': 'abc' is not a whole number (e.g. 512,1024,2048)"),
    (["--matmul-sizes", "0"], "--matmul-sizes must be >= 1, got 0"),
    (["--matmul-sizes", ","], "--matmul-sizes is empty; give sizes like 512,1024,2048"),
    (["--device", "gpu"], "--device 'gpu': use cpu or cuda (e.g. cuda:0)"),
])
def test_cli_refuses_bad_counts_sizes_and_device(args, message):
    _refused(_cli("--task", "minatar-breakout", "--peers", "", *args), message)


def test_cli_missing_dataset_is_an_error_line(tmp_path):
    missing = tmp_path / "missing.hdf5"
    r = _cli("--task", "minatar-breakout", "--peers", "", "--dataset", str(missing), "--steps", "1")
    _refused(r, f"--dataset: no such HDF5 file: {missing}")


def test_cli_flat_dataset_on_the_pixel_task_names_the_encoder(tiny_hdf5):
    r = _cli("--task", "minatar-breakout", "--peers", "", "--dataset", str(tiny_hdf5), "--steps", "1")
    _refused(r, "agent.encoder.kind=minatar_cnn takes image observations (uint8 (C, H, W)), but the dataset "
                f"{tiny_hdf5} has observations of shape (11,) float32; use a flat encoder: "
                "agent.encoder.kind=linear or mlp")


def test_cli_unknown_override_is_an_error_line(tiny_pixels):
    r = _cli("--task", "minatar-breakout", "--peers", "", "--dataset", str(tiny_pixels), "--steps", "1",
             "agent.frame_stack=4")
    assert r.exit_code == 2 and "error: agent.frame_stack: unknown key" in r.output and "Traceback" not in r.output


def test_cli_stacked_frames_with_peers_is_an_error_line(tmp_path):
    path = write_synthetic_frames(tmp_path / "stacked.hdf5", 300, frame_stack=4, side=10, ep_len=50)
    r = _cli("--task", "minatar-breakout", "--dataset", str(path), "--peer-python", sys.executable,
             "--steps", "1", "--matmul-sizes", "64", *TINY)
    _refused(r, f"--dataset {path}: the peers read one stored frame as one observation; this dataset stacks 4 "
                "frames per observation (frame_stack); measure ours alone with --peers ''")
