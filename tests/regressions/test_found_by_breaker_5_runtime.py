"""Defects found by the fifth breaker pass in the runtime: a final evaluation refusing its input
(traceback and a suggestion that fails the same way), counters averaged over the logging window
(PPO's ``train/env_steps``) and float positions silently truncated by the backbone.

Every test is tiny (a few updates of a tiny model) and runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_found_by_tester import _write_h5
from typer.testing import CliRunner

import rl_tformers  # noqa: F401  (registers every kind)
from rl_tformers import Backbone
from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import MetricWindow, train

runner = CliRunner()

TINY_DT = ["train.steps=2", "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1",
           "agent.context_len=4", "train.progress=false", "--device", "cpu"]


def _clean_exit(r) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output


# ------------------------------------------------- 1: a final evaluation that refuses its input
def test_final_eval_bad_input_is_one_error_line_and_keeps_the_model(tmp_path: Path) -> None:
    """agent.max_ep_len=10 < CartPole's 500 steps with agent.timestep_overflow=error: the final
    evaluation raises the DT's ValueError. Was: a traceback (exit 1) and the suggestion
    `rl-tformers eval RUN`, which fails the same way."""
    h5 = _write_h5(tmp_path / "ok.hdf5")
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", *TINY_DT, "eval.every=0",
                            "eval.at_end=true", "eval.episodes=1", "eval.n_envs=1", "agent.max_ep_len=10",
                            "--run-dir", str(run)])
    _clean_exit(r)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    assert "agent.max_ep_len=10" in errors[0] and "--timestep-overflow clamp" in errors[0]
    assert "step_000000002.pt" in errors[0]  # nothing lost: the trained model is named
    assert f"evaluate it with: rl-tformers eval {run}" not in r.output  # would fail the same way
    assert (run / "checkpoints" / "step_000000002.pt").is_file()


def test_mid_run_eval_bad_input_saves_and_suggests_a_resume_that_works(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime import toy

    def refuse(self, step):
        raise ValueError("agent.some_option=3 cannot be evaluated; set agent.some_option=2")

    monkeypatch.setattr(toy.ToyAgent, "evaluate", refuse)
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "agent.kind=toy", "train.steps=6", "train.batch_size=4", "backbone.n_layers=1",
                            "train.checkpoint_every=100", "train.log_every=100", "eval.every=3",
                            "eval.at_end=false", "train.progress=false", "device=cpu", "--run-dir", str(run)])
    _clean_exit(r)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "agent.some_option=3" in errors[0], r.output
    assert f"rl-tformers train --resume {run} eval.every=0 eval.at_end=false" in errors[0]
    assert (run / "checkpoints" / "step_000000003.pt").is_file()  # not a scheduled checkpoint


# ------------------------------------------------------------- 2: counters keep their latest value
def test_metric_window_latest_keys_keep_the_last_value_across_a_resume() -> None:
    def run(split: bool) -> list[dict[str, float]]:
        w, out = MetricWindow(latest=["train/env_steps"]), []
        for i in range(1, 7):
            w.add({"train/loss": torch.tensor(float(i)), "train/env_steps": 32.0 * ((i + 3) // 4)}, samples=4)
            if split and i == 4:  # a checkpoint mid-window, restored into a fresh window
                state = w.state_dict()
                w = MetricWindow(latest=["train/env_steps"])
                w.load_state_dict(state, torch.device("cpu"))
            if i % 3 == 0:
                out.append(w.reduce(torch.device("cpu"))[0])
                w.reset()
        return out

    straight = run(False)
    assert [m["train/env_steps"] for m in straight] == [32.0, 64.0]  # was the mean: 32, 53.33
    assert [m["train/loss"] for m in straight] == [2.0, 5.0]  # other keys are still averaged
    assert run(True) == straight


def test_ppo_env_steps_logs_the_latest_count(tmp_path: Path) -> None:
    """4 updates per rollout of 2 envs x 16 steps, logged every 3 updates: the window of updates
    4..6 spans rollouts 1 and 2 (32 and 64 steps). Was: 53.33 (the window's mean)."""
    cfg = compose("gtrxl/ppo_cartpole", [
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "agent.n_envs=2", "agent.n_steps=16",
        "agent.n_epochs=2", "agent.n_minibatches=2", "train.log_every=3", "train.steps=8", "eval.at_end=false",
        "eval.every=0", "train.progress=false", "device=cpu"])
    run = tmp_path / "ppo"
    train(cfg, run)
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(x["step"], x["train/env_steps"]) for x in m if "train/env_steps" in x]
    assert logged == [(3, 32.0), (6, 64.0), (8, 64.0)]


# ----------------------------------------------------------- 3: float positions are refused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_backbone_refuses_non_integer_positions(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0,
                   "position": {"kind": "learned"}}).eval()
    x = torch.randn(2, 5, 16)
    pos = torch.arange(5).expand(2, 5) + 0.7  # was truncated silently to arange(5)
    with pytest.raises(ValueError, match=r"positions.*integer dtype.*int64.*got torch\.(float|bool)"):
        bb(x, positions=pos.to(dtype))


def test_backbone_accepts_any_integer_positions_exactly() -> None:
    torch.manual_seed(0)
    bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0,
                   "position": {"kind": "learned"}}).eval()
    x = torch.randn(2, 5, 16)
    pos = torch.arange(5).expand(2, 5)
    a = bb(x, positions=pos).hidden
    b = bb(x, positions=pos.to(torch.int32)).hidden
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["tgt_pos", "src_pos"])
def test_encoder_decoder_refuses_non_integer_decoder_positions(name: str) -> None:
    from rl_tformers.encoder_decoder import EncoderDecoder

    small = {"d_model": 16, "n_heads": 2, "n_layers": 1, "dropout": 0.0, "attn_dropout": 0.0}
    m = EncoderDecoder({"encoder": small, "decoder": small}).eval()
    tgt, memory = torch.randn(2, 4, 16), torch.randn(2, 6, 16)
    pos = {"tgt_pos": torch.arange(4).expand(2, 4) + 0.5, "src_pos": torch.arange(6).expand(2, 6) + 0.5}[name]
    with pytest.raises(ValueError, match=rf"encoder_decoder: {name} must have an integer dtype.*got torch\.float32"):
        m.decode(tgt, memory, **{name: pos})
