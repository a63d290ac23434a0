"""Defects the lead found in session 6, each pinned by a test."""

from __future__ import annotations

import warnings

import pytest

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig


def _build(kind: str, attn_dropout: float, causal: bool = True) -> list[str]:
    cfg = BackboneConfig.from_dict(
        {"d_model": 32, "n_heads": 2, "n_layers": 3, "attn_dropout": attn_dropout, "causal": causal,
         "attention": {"kind": kind}}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Backbone(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_linear_attention_says_once_that_attention_dropout_is_not_applied(kind):
    # performer/rfa form no probabilities: attn_dropout=0.1 (the DT default) was dropped silently
    msgs = _build(kind, 0.1)
    assert msgs == [
        f"attention kind {kind!r} forms no attention probabilities, so attn_dropout=0.1 is not applied to it "
        "(residual and feed-forward dropout still are); set attn_dropout=0 to say so and silence this warning"
    ]
    assert _build(kind, 0.0) == []


def test_kernels_with_probabilities_do_not_warn_about_attention_dropout():
    assert _build("sdpa", 0.1) == []
    assert _build("linformer", 0.1, causal=False) == []


# -- save_d4rl_hdf5 wrote in place: an interrupted write left a truncated file under the name --
def test_a_failed_hdf5_write_leaves_neither_a_partial_file_nor_a_changed_old_one(tmp_path, monkeypatch):
    from rl_tformers.envs import loaders
    from rl_tformers.envs.loaders import load_d4rl_hdf5, save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    ds = scripted_dataset("recall", 6, delay=2, seed=0)
    target = tmp_path / "data.hdf5"
    save_d4rl_hdf5(ds, target)
    before = target.read_bytes()
    real = loaders._write_d4rl

    def interrupted(path, *args):
        real(path, *args)  # the temporary file is complete, the rename has not happened yet
        raise KeyboardInterrupt

    monkeypatch.setattr(loaders, "_write_d4rl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_d4rl_hdf5(scripted_dataset("recall", 9, delay=2, seed=1), target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.hdf5"]
    with pytest.raises(KeyboardInterrupt):
        save_d4rl_hdf5(ds, tmp_path / "new.hdf5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.hdf5"]
    monkeypatch.setattr(loaders, "_write_d4rl", real)
    assert load_d4rl_hdf5(save_d4rl_hdf5(ds, tmp_path / "new.hdf5")).num_steps == ds.num_steps


# -- collect: SIGTERM ended the process without cleanup, leaving <root>/tmpXXXX of Minari --
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_collect_stopped_by_a_signal_leaves_nothing_in_the_data_root(tmp_path, sig):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "rl_tformers.cli", "collect", "--env", "CartPole-v1", "--policy", "random",
           "--steps", "100000000", "--root", str(root), "--dataset-id", "rlt/cartpole-v1/random-v0", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("tmp") for p in root.glob("*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert any(p.name.startswith("tmp") for p in root.glob("*")), "collection never started"
        time.sleep(0.5)  # inside the rollout loop
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    signum = int(getattr(signal, sig))
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == (
        f"interrupted ({sig}): no half-written dataset is left (Minari's temporary folder removed too); "
        "datasets reported above are complete")
    assert [p for p in root.rglob("*") if not p.is_dir() and p.name != "namespace_metadata.json"] == []


def test_the_attention_dropout_warning_names_the_cross_attention_kind():
    from rl_tformers.encoder_decoder import EncoderDecoder

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EncoderDecoder({"encoder": {"d_model": 32, "n_heads": 2, "n_layers": 2},
                        "decoder": {"d_model": 32, "n_heads": 2, "n_layers": 2, "attn_dropout": 0.1},
                        "cross_attention": {"kind": "performer"}})
    msgs = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(msgs) == 1 and msgs[0].startswith("attention kind 'performer' forms no attention probabilities")


def test_metrics_jsonl_writes_every_non_finite_scalar_as_null(tmp_path):
    import json
    import math

    from rl_tformers.runtime.tracking import RunLogger

    log = RunLogger(tmp_path)
    log.scalars(3, {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1e308, "e": 2.5})
    log.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {k: rec[k] for k in "abcde"} == {"a": None, "b": None, "c": None, "d": 1e308, "e": 2.5}


def test_sweep_markdown_escapes_a_pipe_in_a_grid_value():
    from rl_tformers.runtime.sweep import markdown

    rows = [{"run": "k=a|b/seed0", "seed": 0, "status": "ok", "step": 5, "seconds": 1.0, "train/loss": 0.5}]
    summary = [{"point": "k=a|b", "mean": 0.5, "std": 0.0, "n": 1, "of": 1}]
    text = markdown(rows, summary, "train/loss")
    assert "| k=a\\|b | 0.5 | 0 | 1/1 |" in text
    assert "| k=a\\|b/seed0 | 0 | ok | 5 | 1 | 0.5 |" in text
    assert all(line.count("|") - line.count("\\|") == 5 for line in text.splitlines()[2:4])


def test_env_kwargs_take_any_key_in_a_closed_agent_section():
    # gtrxl_ppo closes its agent section; its env_kwargs default {} inherited the struct flag, so
    # agent.env_kwargs={max_episode_steps: 10} was refused as an unknown key
    from rl_tformers.runtime.run_config import ConfigError, compose

    cfg = compose("gtrxl/ppo_cartpole", overrides=["agent.env_kwargs={max_episode_steps: 10}"])
    assert dict(cfg.agent.env_kwargs) == {"max_episode_steps": 10}
    with pytest.raises(ConfigError, match="agent.no_such_option: unknown key"):
        compose("gtrxl/ppo_cartpole", overrides=["agent.no_such_option=1"])


# -- performer with one 128-wide head (the DT's): the causal key shift exp(-max|w|^2/2) ~ exp(-90)
#    made 99.9% of key features subnormal (20-50x slower, and precision lost to subnormal rounding)
def test_performer_causal_key_shift_is_capped():
    import torch

    from rl_tformers.attention.performer import causal_key_shift

    def omega(sq_norm):  # rows with the given squared norms
        return torch.sqrt(torch.tensor(sq_norm))[:, None] * torch.nn.functional.one_hot(torch.arange(2), 4).float()

    assert causal_key_shift(omega([40.0, 30.0])).item() == 20.0  # B = 20 <= 60: the bound itself
    assert causal_key_shift(omega([180.0, 30.0])).item() == 60.0  # B = 90: capped
    assert causal_key_shift(omega([400.0, 30.0])).item() == 122.0  # B = 200: B - 78


def test_performer_key_features_of_a_128_wide_head_are_normal_floats():
    import torch

    from rl_tformers.backbone import Backbone

    torch.manual_seed(0)
    bb = Backbone(BackboneConfig.from_dict({"d_model": 128, "n_heads": 1, "n_layers": 1, "attn_dropout": 0.0,
                                            "attention": {"kind": "performer"}}))
    attn = bb.depth.blocks[0].attn
    k = torch.randn(2, 1, 60, 128)  # (B, H, S, Dh): keys of a LayerNorm-scaled width
    phi = attn.features(k, is_query=False, valid=None)
    assert phi.shape == (2, 1, 60, attn.m)
    assert bool((phi >= torch.finfo(torch.float32).tiny).all())  # no subnormals, no zeros
    assert bool(torch.isfinite(phi).all())


def test_sweep_default_threads_keep_the_users_omp_num_threads():
    import os

    from rl_tformers.runtime.sweep import default_threads

    assert default_threads(2, {"OMP_NUM_THREADS": "1"}) == 1
    assert default_threads(1, {"OMP_NUM_THREADS": " 3 "}) == 3
    cores = os.cpu_count() or 1
    for bad in ({}, {"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "x"}):
        assert default_threads(2, bad) == max(1, cores // 2)


def test_a_command_line_kind_change_names_the_slot_fields_it_drops(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "backbone.memory.kind=compressive", "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning")]
    assert lines == [
        "warning: backbone.memory.kind: 'xl' -> 'compressive' replaces the slot; the fields set for 'xl' are "
        "dropped (mem_len=16, detach=True) and 'compressive' takes its own defaults; give them again "
        "(backbone.memory.KEY=VALUE) to set them"]
    # fields given with the new kind are not dropped; only the rest is named
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "backbone.memory={kind: compressive, mem_len: 16}", "--print-config"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "dropped (detach=True)" in r.stderr, r.stderr
    # a config file's own slot over the agent's defaults (no command line change): no warning
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_a_missing_recipe_dataset_names_its_recipe(tmp_path, monkeypatch):
    from rl_tformers.envs.loaders import load_minari

    (tmp_path / "policies").mkdir()  # found: the hint needs no --policies (a clean clone has no ../shared)
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "policies"))

    with pytest.raises(FileNotFoundError, match=r"`rl-tformers collect --recipe walker2d-medium`"):
        load_minari("rlt/walker2d-v5/medium-v0", root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"`rl-tformers collect --recipe \.\.\.`"):
        load_minari("rlt/none-v5/nothing-v0", root=tmp_path)
