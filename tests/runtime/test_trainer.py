"""Trainer behaviour: run directory, logging, evaluation isolation, workers, amp, protocol errors."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import assert_same_weights, model_state, read_events, toy_cfg
from typer.testing import CliRunner

from rl_tformers import Backbone
from rl_tformers.cli import app
from rl_tformers.runtime import agent_registry as agents_mod
from rl_tformers.runtime import toy
from rl_tformers.runtime import trainer as trainer_mod
from rl_tformers.runtime.agent_registry import register_agent
from rl_tformers.runtime.checkpoint import list_checkpoints, load_checkpoint
from rl_tformers.runtime.cpu_matmul import recorded_choice
from rl_tformers.runtime.resolved import read_resolved, resolved_block, split_resolved
from rl_tformers.runtime.run_config import compose, to_yaml
from rl_tformers.runtime.trainer import (
    MetricWindow,
    NonFiniteLossError,
    RunDirError,
    Trainer,
    _with_run_dir,
    resume,
    train,
)
from tests.datafiles import write_d4rl_h5


def test_run_directory_layout(run_dir: Path) -> None:
    cfg = toy_cfg("train.steps=10", "train.checkpoint_every=5", "train.keep_last=1", "eval.every=5")
    result = train(cfg, run_dir)
    assert result.complete and result.checkpoint == run_dir / "checkpoints" / "step_000000010.pt"
    names = sorted(p.name for p in run_dir.iterdir())
    assert names[0] == ".train.lock"  # the trainer's lock (runlock), released but kept
    names = names[1:]
    assert names[:3] == ["checkpoints", "config.yaml", names[2]] and names[2].startswith("events.out.tfevents")
    assert names[3:] == ["metrics.jsonl"]
    assert [s for s, _ in list_checkpoints(run_dir)] == [10]  # keep_last=1
    saved = (run_dir / "config.yaml").read_text()
    block, body = split_resolved(saved)
    assert body == to_yaml(_with_run_dir(cfg, run_dir)) == load_checkpoint(result.checkpoint)["config"]
    assert block == resolved_block(read_resolved(saved)) and read_resolved(saved)["device"] == "cpu"
    assert compose(start=__import__("omegaconf").OmegaConf.create(saved)).run_dir == str(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10]
    assert {"train/loss", "train/grad_norm", "train/lr", "train/mae", "perf/steps_per_s", "perf/samples_per_s"} <= set(
        train_rows[0])
    assert [r["step"] for r in rows if "eval/mse" in r] == [5, 10]
    tags = {v.tag for ev in read_events(run_dir) for v in ev.summary.value}
    assert {"train/loss", "train/lr", "eval/mse", "eval/return", "config/text_summary", "_hparams_/experiment"} <= tags
    assert result.last_eval["eval/mse"] == rows[-1]["eval/mse"]


def test_evaluation_does_not_change_training(tmp_path: Path) -> None:
    train(toy_cfg("train.steps=12"), tmp_path / "a")
    train(toy_cfg("train.steps=12", "eval.every=3", "agent.eval_figure=true"), tmp_path / "b")
    assert_same_weights(model_state(tmp_path / "a", 10), model_state(tmp_path / "b", 10))
    images = [v.tag for ev in read_events(tmp_path / "b") for v in ev.summary.value
              if v.metadata.plugin_data.plugin_name == "images"]
    assert images == ["eval/predictions"] * 4


def test_dataloader_workers_give_identical_batches(tmp_path: Path) -> None:
    train(toy_cfg("train.steps=10"), tmp_path / "w0")
    train(toy_cfg("train.steps=10", "train.num_workers=2"), tmp_path / "w2")
    assert_same_weights(model_state(tmp_path / "w0", 10), model_state(tmp_path / "w2", 10))


def test_extra_state_is_checkpointed_and_restored(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train(toy_cfg(), run_dir, stop_at=10)
    extra = load_checkpoint(run_dir / "checkpoints" / "step_000000010.pt")["extra"]
    assert set(extra) == {"x_mean", "x_std"} and extra["x_std"].shape == (3,)
    seen = []
    original = toy.ToyAgent.load_extra_state
    monkeypatch.setattr(toy.ToyAgent, "load_extra_state", lambda self, s: (seen.append(s), original(self, s)))
    resume(run_dir, ["train.steps=12"])
    assert len(seen) == 2  # once in the builder, once from the checkpoint
    assert torch.equal(seen[1]["x_mean"], extra["x_mean"])


def test_non_finite_loss_stops_without_checkpoint(run_dir: Path) -> None:
    cfg = _with_run_dir(toy_cfg("train.checkpoint_every=2"), run_dir)
    trainer = Trainer(cfg, run_dir)
    loss, calls = trainer.agent.loss, {"n": 0}

    def nan_at_3(batch):
        calls["n"] += 1
        out, logs = loss(batch)
        return (out * float("nan") if calls["n"] == 3 else out), logs

    trainer.agent.loss = nan_at_3
    with pytest.raises(NonFiniteLossError, match="non-finite train/loss, train/grad_norm"):
        trainer.fit()
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]


@pytest.mark.parametrize(("nan_call", "keys", "hint"), [
    (1, "train/loss, train/grad_norm, train/mae", "(the loss of the first update, computed before any parameter changed, is not finite, so the learning rate "
        "is not the cause: the data or the initial model overflow float32; check the scale of the observations, "
        "rewards and actions, e.g. agent.normalize_obs=true)"),
    (3, "train/loss, train/grad_norm, train/mae", "(try a lower train.lr, train.grad_clip, or train.amp=none)"),
])
def test_a_non_finite_first_loss_does_not_blame_the_learning_rate(run_dir: Path, nan_call: int, keys: str,
                                                                   hint: str) -> None:
    cfg = _with_run_dir(toy_cfg("train.log_every=5"), run_dir)
    trainer = Trainer(cfg, run_dir)
    loss, calls = trainer.agent.loss, {"n": 0}

    def nan_at(batch):
        calls["n"] += 1
        out, logs = loss(batch)
        return (out * float("inf") if calls["n"] == nan_call else out), logs

    trainer.agent.loss = nan_at
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit()
    assert str(info.value) == f"non-finite {keys} in updates 1..5 {hint}"


def test_bf16_autocast_on_cpu(run_dir: Path) -> None:
    result = train(toy_cfg("train.steps=5", "train.amp=bf16", "train.checkpoint_every=0"), run_dir)
    assert result.complete and torch.isfinite(torch.tensor(result.last_train["train/loss"]))


class _ListAgent:
    """Iterable batches, custom parameter groups, no evaluate/extra state."""

    def __init__(self, cfg, n_batches: int) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.n_batches = n_batches
        self.seed = int(cfg.seed)

    def param_groups(self):
        return [{"name": "all", "params": list(self.model.parameters()), "weight_decay": 0.0}]

    def batches(self, start_step):
        for s in range(start_step, self.n_batches):
            g = torch.Generator().manual_seed(self.seed * 100003 + s)
            yield torch.randn(4, 2, generator=g)

    def loss(self, batch):
        return self.model(batch).pow(2).mean(), {"custom/norm": batch.norm()}


@pytest.fixture
def test_agents():
    """Register three throw-away agent kinds for one test, then remove them from the registry."""
    builders = {
        "test_iterable": lambda cfg, run_dir, device: _ListAgent(cfg, n_batches=10**9),
        "test_short": lambda cfg, run_dir, device: _ListAgent(cfg, n_batches=3),
        "test_broken": lambda cfg, run_dir, device: object(),
    }
    for kind, builder in builders.items():
        register_agent(kind)(builder)
    yield
    for kind in builders:
        agents_mod._AGENTS.pop(kind, None)


@pytest.mark.usefixtures("test_agents")
def test_iterable_batches_and_param_groups(tmp_path: Path) -> None:
    base = ["device=cpu", "train.progress=false", "train.steps=8", "train.log_every=2", "eval.at_end=false"]
    full = train(compose(None, ["agent.kind=test_iterable", *base]), tmp_path / "full")
    assert "custom/norm" in full.last_train
    train(compose(None, ["agent.kind=test_iterable", *base]), tmp_path / "split", stop_at=3)
    resume(tmp_path / "split")
    assert_same_weights(model_state(tmp_path / "full", 8), model_state(tmp_path / "split", 8))
    groups = load_checkpoint(tmp_path / "full" / "checkpoints" / "step_000000008.pt")["optimizer"]["param_groups"]
    assert [g["name"] for g in groups] == ["all"]
    with pytest.raises(RuntimeError, match=r"batches\(\) ran out at step 3 of 8"):
        train(compose(None, ["agent.kind=test_short", *base]), tmp_path / "short")


@pytest.mark.usefixtures("test_agents")
def test_builder_must_return_a_trainable(run_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"agent 'test_broken'.*lacks: model .*loss\(\) method; batches\(\) method"):
        train(compose(None, ["agent.kind=test_broken", "device=cpu"]), run_dir)


def test_register_agent_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_agent("toy")(lambda cfg, run_dir, device: None)


@pytest.mark.slow
def test_compile(run_dir: Path) -> None:
    result = train(toy_cfg("train.steps=4", "train.compile=true", "train.checkpoint_every=0"), run_dir)
    assert result.complete
    assert not [k for k in model_state(run_dir, 4) if "_orig_mod" in k]  # checkpoints unaffected by compile


@pytest.mark.cuda
def test_cuda_bf16_resume(tmp_path: Path) -> None:
    """On CUDA: bf16 autocast, RNG (CUDA generator) restore, pinned batches; resume matches closely."""
    cfg = toy_cfg("device=cuda", "train.amp=bf16", "train.deterministic=true", "train.num_workers=1")
    full = train(cfg, tmp_path / "full")
    train(cfg, tmp_path / "split", stop_at=23)
    assert load_checkpoint(tmp_path / "split" / "checkpoints" / "step_000000023.pt")["rng"]["cuda"] is not None
    resume(tmp_path / "split")
    a, b = model_state(tmp_path / "full", 40), model_state(tmp_path / "split", 40)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(torch.tensor(full.last_train["train/loss"]))


runner = CliRunner()


# ------------------------------------------- a diverged run ends in a traceback
def test_diverged_training_ends_with_one_error_line_not_a_traceback(tmp_path: Path) -> None:
    """``rl-tformers train -c toy train.lr=1e300`` diverges at update 2 and the CLI lets
    ``NonFiniteLossError`` escape: ~40 lines of traceback for a user-level outcome whose message
    already says what to do. Every other refusal of the command is one ``error: ...`` line."""
    from rl_tformers.runtime.trainer import NonFiniteLossError

    r = runner.invoke(app, ["train", "-c", "toy", "train.lr=1e300", "train.steps=5", "train.warmup_steps=1",
                            "train.log_every=1", "train.progress=false", "eval.every=0", "eval.at_end=false",
                            "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code != 0
    assert not isinstance(r.exception, NonFiniteLossError), "NonFiniteLossError escaped the CLI (a traceback)"
    assert r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr


def test_resumed_window_splits_the_saved_samples_over_the_new_ranks() -> None:
    """Resuming a 2-process run in 1 process (or 1 in 2) counts the saved window's samples once
    (counted ``new / saved`` times, ``perf/samples_per_s`` of the first window would be off by
    that factor)."""
    import torch

    from rl_tformers.runtime.trainer import MetricWindow

    ranks = []
    for loss in (1.0, 3.0):
        w = MetricWindow()
        w.add({"loss": torch.tensor(loss)}, samples=4)  # 8 samples in all
        ranks.append(w.state_dict())
    mean = MetricWindow.mean_state(ranks)
    for new in (1, 2, 4):
        parts = [MetricWindow() for _ in range(new)]
        for p in parts:
            p.load_state_dict(MetricWindow.for_ranks(mean, 2, new), torch.device("cpu"))
        assert sum(p.samples for p in parts) == 8.0  # what reduce sums over the new ranks
        assert parts[0].means() == {"loss": 2.0}
    one = MetricWindow()
    one.add({"loss": torch.tensor(1.0)}, samples=6)  # a one-process run's own window
    two = [MetricWindow.for_ranks(one.state_dict(), 1, 2)["samples"] for _ in range(2)]
    assert sum(two) == 6.0


TINY_DT = ["train.steps=2", "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1",
           "agent.context_len=4", "train.progress=false", "--device", "cpu"]


def _clean_exit(r) -> None:
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output


# ------------------------------------------------- a final evaluation that refuses its input
def test_final_eval_bad_input_is_one_error_line_and_keeps_the_model(tmp_path: Path) -> None:
    """agent.max_ep_len=10 < CartPole's 500 steps with agent.timestep_overflow=error: the final
    evaluation raises the DT's ValueError: one error line, the model kept, and no suggestion of
    `rl-tformers eval RUN`, which would fail the same way."""
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
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


# ------------------------------------------------------------- counters keep their latest value
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
    assert [m["train/env_steps"] for m in straight] == [32.0, 64.0]  # not the mean: 32, 53.33
    assert [m["train/loss"] for m in straight] == [2.0, 5.0]  # other keys are still averaged
    assert run(True) == straight


def test_ppo_env_steps_logs_the_latest_count(tmp_path: Path) -> None:
    """4 updates per rollout of 2 envs x 16 steps, logged every 3 updates: the window of updates
    4..6 spans rollouts 1 and 2 (32 and 64 steps): the latest count, 64, not the window's mean
    (53.33)."""
    cfg = compose("gtrxl/ppo_cartpole", [
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "agent.n_envs=2", "agent.n_steps=16",
        "agent.n_epochs=2", "agent.n_minibatches=2", "train.log_every=3", "train.steps=8", "eval.at_end=false",
        "eval.every=0", "train.progress=false", "device=cpu"])
    run = tmp_path / "ppo"
    train(cfg, run)
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [(x["step"], x["train/env_steps"]) for x in m if "train/env_steps" in x]
    assert logged == [(3, 32.0), (6, 64.0), (8, 64.0)]


# ----------------------------------------------------------- float positions are refused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_backbone_refuses_non_integer_positions(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "dropout": 0.0,
                   "position": {"kind": "learned"}}).eval()
    x = torch.randn(2, 5, 16)
    pos = torch.arange(5).expand(2, 5) + 0.7  # not truncated silently to arange(5)
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


def _toy(*extra: str):
    return compose(None, ["agent.kind=toy", "device=cpu", "train.progress=false", "train.batch_size=4",
                          "train.steps=5", "train.warmup_steps=0", "train.log_every=5",
                          "train.checkpoint_every=0", "eval.every=0", "eval.at_end=true", *extra])


def _trainer(run: Path, *extra: str) -> Trainer:
    return Trainer(trainer_mod._with_run_dir(_toy(*extra), run), run)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------- Ctrl-C during the final evaluation
def test_ctrl_c_during_the_final_evaluation_does_not_promise_a_stop_it_never_makes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`rl-tformers train ... eval.episodes=400` (Hopper DT), Ctrl-C 5 s after the last update,
    during the final evaluation: the command either stops (exit 130, the run trained but not
    evaluated) or does not say it will (no "received SIGINT: finishing the current update, saving
    a checkpoint, then stopping" followed by 100 s more of evaluation and exit 0)."""
    run = tmp_path / "run"
    trainer = _trainer(run)
    real = trainer.agent.evaluate

    def evaluate_with_ctrl_c(step: int):
        os.kill(os.getpid(), signal.SIGINT)
        return real(step)

    trainer.agent.evaluate = evaluate_with_ctrl_c
    with caplog.at_level(logging.INFO, logger="rl_tformers"):
        result = trainer.fit()
    promised = [m for m in _messages(caplog) if "then stopping" in m]
    assert result.interrupted == signal.SIGINT or not promised, (result.interrupted, promised)


# ------------------------------------------------------------------- second Ctrl-C during the final evaluation
def test_abort_during_the_final_evaluation_does_not_send_the_user_to_a_resume_that_does_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A second Ctrl-C during the final evaluation does not point to `rl-tformers train --resume
    RUN`: that resume says "RUN is complete (step 10 of train.steps=10); pass train.steps=N to
    train longer" and exits 0 without running the final evaluation. Either the evaluation runs,
    or the user is told to run `rl-tformers eval`. (The sweep knows this state: "unevaluated".)"""
    run = tmp_path / "run"
    trainer = _trainer(run)
    real = trainer.agent.evaluate

    def evaluate_with_two_ctrl_c(step: int):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt here
        return real(step)

    trainer.agent.evaluate = evaluate_with_two_ctrl_c
    with caplog.at_level(logging.INFO, logger="rl_tformers"), pytest.raises(KeyboardInterrupt):
        trainer.fit()
    note = [m for m in _messages(caplog) if "aborted at once" in m]
    assert note, _messages(caplog)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rl_tformers"):
        result = resume(run)
    said = " ".join(_messages(caplog))
    # the trained model's final evaluation is either run by the resume, or the user is told how
    # to get it, by the abort note or by the resume
    told = any("rl-tformers eval" in m for m in (note[0], said)) or "not evaluated" in said \
        or "final evaluation" in said
    assert result.last_eval or told, (note[0], said)


# ------------------------------------------------------------------- the last progress line
def test_last_progress_line_does_not_count_the_final_evaluation_as_training_time(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without a terminal, `rl-tformers train` prints its last line after the final evaluation
    (the bar is closed in ``train_dt``'s ``finally``), so the evaluation's time enters the shown
    rate: a Hopper DT that trained at 20 steps/s (``perf/steps_per_s`` in metrics.jsonl) ended
    with "train: 10/10 steps (100%), 0.0967 steps/s, elapsed 1m43s"; the README demo's
    300-update run at ~4.7 steps/s ended with "3.74 steps/s, elapsed 1m20s"."""
    run = tmp_path / "run"
    trainer = _trainer(run, "train.progress=true", "train.steps=20", "train.log_every=20")
    real = trainer.agent.evaluate

    def slow_evaluate(step: int):
        time.sleep(4.0)
        return real(step)

    trainer.agent.evaluate = slow_evaluate
    trainer.fit()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: 20/20")]
    assert lines, err
    m = re.search(r"([0-9.e+]+) steps/s", lines[-1])
    assert m, lines[-1]
    # 20 toy updates take well under a second; with the 4 s evaluation counted the line shows < 5/s
    assert float(m.group(1)) > 8.0, lines[-1]


TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=3", "train.batch_size=4",
       "train.warmup_steps=1", "train.log_every=1", "eval.at_end=true"]


# ------------------------------------------------- a late Ctrl-C
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_ctrl_c_after_the_run_finished_leaves_exit_status_0(tmp_path: Path) -> None:
    """SIGINT as soon as ``done:`` is printed (the summary, then the interpreter's shutdown)."""
    code = "import sys; from rl_tformers.cli import main; sys.argv = ['rl-tformers', *sys.argv[1:]]; main()"
    cmd = [sys.executable, "-c", code, "train", *TOY, "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("done: 3 steps"):
            for _ in range(3):  # during the summary and during the shutdown
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)
    proc.wait(timeout=120)
    assert any(line.startswith("done: 3 steps") for line in lines), "".join(lines)
    assert proc.returncode == 0, "".join(lines)  # not 130 (or -2: killed by the signal)


def test_the_summary_window_ignores_signals_and_restores_the_handlers() -> None:
    from rl_tformers.cli.train import finished_run, finished_run_signals

    before = signal.getsignal(signal.SIGINT)
    with finished_run_signals():
        signal.raise_signal(signal.SIGINT)  # recorded and ignored: no KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is before
    assert finished_run()


# ------------------------------------------------- the Python API's run directory message
def test_a_second_run_in_a_used_directory_names_the_python_calls_too(tmp_path: Path) -> None:
    train(compose(None, [*TOY, "eval.at_end=false"]), tmp_path / "run")
    with pytest.raises(RunDirError) as info:
        train(compose(None, [*TOY, "eval.at_end=false"]), tmp_path / "run")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'run'} already holds a run; continue it with --resume {tmp_path / 'run'} ")
    assert f"rl_tformers.runtime.trainer.resume({str(tmp_path / 'run')!r}, ['train.steps=N'])" in msg
    assert "train(cfg, run_dir=...)" in msg


SLEEP_S = 0.02  # every update lasts at least this long below


def toy_cfg_warmup5(*overrides: str):
    return compose(None, ["agent.kind=toy", "device=cpu", "train.progress=false", "train.batch_size=8",
                          "train.lr=3e-3", "train.warmup_steps=5", "eval.at_end=false", *overrides])


def _slow_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    update = trainer_mod.Trainer.update

    def slow(self, batch):
        time.sleep(SLEEP_S)
        return update(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "update", slow)


def _rates(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["perf/steps_per_s"] for r in rows if "perf/steps_per_s" in r}


def test_throughput_after_resume_counts_only_updates_timed_since(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The first log after a resume divided the whole window (9 updates made before the stop
    plus 1 after) by the time of the 1 update since the resume: 10x the real rate. Every
    update here lasts >= 20 ms, so no logged rate may exceed 50 updates/s."""
    _slow_updates(monkeypatch)
    cfg = toy_cfg_warmup5("train.log_every=10", "train.checkpoint_every=100", "train.steps=20")
    train(cfg, tmp_path / "run", stop_at=19)
    resume(tmp_path / "run")
    rates = _rates(tmp_path / "run")
    assert sorted(rates) == [10, 20]
    assert all(0 < r <= 1 / SLEEP_S for r in rates.values()), rates


def test_throughput_window_keeps_the_time_before_a_checkpoint(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint in the middle of a log window restarted the window's clock without
    forgetting its updates: the rate counted 10 updates over the time of the last 3."""
    _slow_updates(monkeypatch)
    cfg = toy_cfg_warmup5("train.log_every=10", "train.checkpoint_every=7", "train.steps=10")
    train(cfg, tmp_path / "run")
    rates = _rates(tmp_path / "run")
    assert sorted(rates) == [10]
    assert 0 < rates[10] <= 1 / SLEEP_S, rates


def test_resume_with_fewer_steps_than_trained_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`train --resume RUN train.steps=N` below the run's step warns (not only "complete" at info level)."""
    import logging

    train(toy_cfg_warmup5("train.steps=10", "train.log_every=5", "train.checkpoint_every=5"), tmp_path / "run")
    with caplog.at_level(logging.INFO):
        r = resume(tmp_path / "run", ["train.steps=5"])
    assert r.step == 10
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warned) == 1 and "train.steps=5 is below the step" in warned[0].getMessage()
    assert "(10)" in warned[0].getMessage() and "never shortened" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resume(tmp_path / "run")  # complete at its own train.steps: no warning
    assert not [rec for rec in caplog.records if rec.levelno == logging.WARNING]


def test_short_run_warns_that_warmup_never_ends_and_pctbc_says_what_it_kept(tmp_path, caplog):
    """A 300-step run of a 10k-warmup config warns that its warmup never ends (it would learn
    nothing); %BC says which episodes it kept."""
    import logging

    import numpy as np
    from rl_tformers.agents.common.scripted import collect_delayed_expert
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    ds = collect_delayed_expert(20, seed=0, n_envs=10)
    path = save_d4rl_hdf5(ds, tmp_path / "cp.hdf5")
    ret = np.sort(ds.episode_returns)[::-1]
    common = [f"dataset.path={path}", "train.steps=3", "train.batch_size=4", "train.progress=false",
              "eval.every=0", "eval.at_end=false", "device=cpu", "agent.kind=bc", "agent.top_fraction=0.1"]
    lg = logging.getLogger("rl_tformers")  # the CLI sets propagate=False: listen on it directly
    level = lg.level
    lg.addHandler(caplog.handler)
    lg.setLevel(logging.INFO)
    try:
        train(compose(None, [*common, "train.warmup_steps=10", "train.schedule=linear_warmup"]), tmp_path / "a")
        text = caplog.text
        caplog.clear()
        train(compose(None, [*common, "train.warmup_steps=2"]), tmp_path / "b")
    finally:
        lg.removeHandler(caplog.handler)
        lg.setLevel(level)
    assert "train.warmup_steps=10 >= train.steps=3: the learning rate stays in its linear warmup" in text
    assert "agent.top_fraction=0.1: training on 2 of 20 episodes" in text and f"returns >= {ret[1]:.1f}" in text
    assert "warmup" not in caplog.text


# ------------------------------------------------------------------- evaluations on the console
def test_each_periodic_evaluation_prints_one_console_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """eval.every=2 over 5 steps evaluates at steps 2, 4 and (eval.at_end) 5: one console line
    for each periodic one, with the values metrics.jsonl records for that step (the final one is
    the `rl-tformers train` summary's line: not said twice)."""
    trainer = _trainer(tmp_path / "run", "eval.every=2")
    with caplog.at_level(logging.INFO, logger="rl_tformers"):
        trainer.fit()
    lines = [m for m in _messages(caplog) if m.startswith("eval at step ")]
    assert [ln.split(":")[0] for ln in lines] == ["eval at step 2", "eval at step 4"]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    at4 = next(r for r in logged if r.get("step") == 4 and "eval/mse" in r)
    assert lines[1].startswith(f"eval at step 4: mse={at4['eval/mse']:.4g}, return={at4['eval/return']:.4g} (")


# ------------------------------------------- a run directory whose write paths are taken
_TOY = ["train", "-c", "toy", "train.steps=4", "train.checkpoint_every=2", "train.progress=false", "eval.every=0",
        "eval.at_end=false", "--device", "cpu"]


@pytest.mark.parametrize("taken", ["checkpoints/step_000000002.pt/", "checkpoints", "config.yaml/", "metrics.jsonl/"])
def test_a_checkpoint_or_log_path_taken_by_something_else_is_refused_before_training(tmp_path: Path,
                                                                                       taken: str) -> None:
    run = tmp_path / "run"
    target = run / taken.rstrip("/")
    if taken.endswith("/"):
        target.mkdir(parents=True)
    else:
        target.parent.mkdir(parents=True)
        target.write_text("not a folder")
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    r = runner.invoke(app, [*_TOY, "--run-dir", str(run)])
    kind = "a folder" if taken.endswith("/") else "a file"
    if taken == "checkpoints":
        want = (f"error: --run-dir {run}: {target} is a file, not the folder the run keeps its checkpoints in; "
                f"move it away or pick another --run-dir")
    else:
        what = ("a checkpoint; the run writes its checkpoints" if taken.startswith("checkpoints/") else
                "a file; the run writes that file")
        want = f"error: --run-dir {run}: {target} is {kind}, not {what} under that name: move it away or pick another --run-dir"
    assert (r.exit_code, r.stderr.strip()) == (2, want)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before  # nothing written


def test_a_resumed_run_whose_next_checkpoint_name_is_a_folder_is_refused_before_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert runner.invoke(app, [*_TOY, "--run-dir", str(run)]).exit_code == 0
    (run / "checkpoints" / "step_000000006.pt").mkdir()
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=8"])
    assert (r.exit_code, r.stderr.strip()) == (2, f"error: --resume {run}: {run}/checkpoints/step_000000006.pt is a "
                                                  f"folder, not a checkpoint; the run writes its checkpoints under "
                                                  f"that name: move it away")
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_000000002.pt", "step_000000004.pt",
                                                                         "step_000000006.pt"]


# ------------------------------------------- the values resolved at start are recorded
def _hparams(run_dir: Path) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2

    for ev in read_events(run_dir):
        for v in ev.summary.value:
            if v.tag == "_hparams_/session_start_info":
                info = plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info
                return {k: (h.string_value or h.number_value) for k, h in info.hparams.items()}
    return {}


def test_resolved_values_are_in_config_yaml_the_hparams_and_the_first_log_line(
        run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = toy_cfg("train.steps=2", "cpu_matmul=auto")
    with caplog.at_level(logging.INFO, logger="rl_tformers.runtime.trainer"):
        train(cfg, run_dir)
    want = {"cpu_matmul": str(cfg.cpu_matmul), "device": "cpu", "processes": 1,
            "torch.num_interop_threads": torch.get_num_interop_threads(), "torch.num_threads": torch.get_num_threads()}
    assert cfg.cpu_matmul in ("mkl", "onednn")  # auto is resolved when the config is composed
    choice = recorded_choice(cfg)  # the measurement auto was resolved by, recorded with the library
    if choice.gflops:
        want.update({"cpu_matmul.gflops_mkl": round(choice.gflops["mkl"], 1),
                     "cpu_matmul.gflops_onednn": round(choice.gflops["onednn"], 1),
                     "cpu_matmul.source": choice.source, "cpu_matmul.threads": torch.get_num_threads()})
    text = (run_dir / "config.yaml").read_text()
    assert read_resolved(text) == want
    assert text.startswith("# resolved at start (the values this run uses where its config leaves the choice to "
                           "it;\n# recorded, never read back):\n#   cpu_matmul: ")
    hp = _hparams(run_dir)
    assert {k: hp[f"resolved.{k}"] for k in want} == want
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run "))
    assert first.endswith(" | resolved: " + ", ".join(f"{k}={want[k]}" for k in sorted(want)))


# ------------------------------------------------------- no host-device sync inside an update
def _in_xl_span(frame) -> bool:
    """Whether the call comes from ``position/xl_relative.py``'s ``_span`` (the XL relative
    bias's read of the range of allowed distances, once per forward)."""
    while frame is not None:
        if frame.f_code.co_name == "_span" and frame.f_code.co_filename.endswith("xl_relative.py"):
            return True
        frame = frame.f_back
    return False


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that wait for the device (a value read on the host): ``item``,
    ``tolist``, ``numpy``, ``cpu``, and ``bool``/``float``/``int`` of a tensor (a Python branch
    on a tensor's value); with ``skip_xl_span``, not those of the XL relative bias's ``_span``.
    While ``only_in_update`` is set, only inside :meth:`Trainer.update` (``counting`` True)."""

    NAMES = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"})

    def __init__(self, skip_xl_span: bool = False, only_in_update: bool = False) -> None:
        super().__init__()
        self.count = 0
        self.skip_xl_span = skip_xl_span
        self.counting = not only_in_update

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and getattr(func, "__name__", "") in self.NAMES:
            if not (self.skip_xl_span and _in_xl_span(sys._getframe(1))):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _host_syncs(config: str | None, overrides: list[str], steps: int, run_dir: Path, *, skip_xl_span: bool = False,
                only_in_update: bool = False, monkeypatch: pytest.MonkeyPatch | None = None) -> int:
    cfg = compose(config, [*overrides, f"train.steps={steps}", "train.log_every=1000", "train.checkpoint_every=1000",
                           "eval.every=0", "eval.at_end=false", "train.progress=false", "device=cpu"])
    mode = _HostSyncs(skip_xl_span, only_in_update)
    if only_in_update:
        update = Trainer.update

        def counted(self, batch):
            mode.counting = True
            try:
                return update(self, batch)
            finally:
                mode.counting = False

        monkeypatch.setattr(Trainer, "update", counted)
    with mode:
        train(cfg, run_dir)
    return mode.count


_TINY_GTRXL = ["backbone.d_model=16", "backbone.n_layers=2", "backbone.n_heads=2", "agent.seq_len=8",
               "agent.burn_in=4", "backbone.memory={kind: xl, mem_len: 4}", "dataset.path=null",
               "dataset.scripted={task: recall, episodes: 12, delay: 2}", "train.batch_size=8", "train.warmup_steps=2"]


@pytest.mark.parametrize("agent", ["dt", "bc", "dt-data-on-device", "gtrxl-bc", "gtrxl-iql", "gtrxl-bc-data-on-device",
                                   "gtrxl-ppo"])
def test_updates_between_log_and_checkpoint_steps_make_no_host_device_sync(agent: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU-ready loop: the host reads device values only at log and checkpoint steps (and when a
    run starts and ends). Runs of 20 and 40 updates with the same log and checkpoint steps (the
    last one only) make exactly as many host syncs: none of them is per update. The offline
    agents are counted over the whole run (batches drawn on the host, or on the device with
    ``train.data_on_device``); PPO-GTrXL inside its updates only (its rollouts step environments
    on the host, one action transfer per environment step).

    GTrXL's XL relative position bias still reads the span of the allowed distances once per
    forward to size its table (``position/xl_relative.py``, ``_span``): those reads are not
    counted; every other part of the GTrXL updates (segments, losses, IQL targets, PPO) is."""
    from rl_tformers.agents.common.scripted import collect_delayed_expert
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "train.batch_size=4",
            "train.warmup_steps=2"]
    on_device = ["train.data_on_device=true"] if agent.endswith("data-on-device") else []
    if agent.startswith("gtrxl"):
        config, over = ("gtrxl/ppo_cartpole", ["agent.n_envs=2", "agent.n_steps=8", "agent.n_epochs=1",
                                               "agent.n_minibatches=2", *tiny[:3], "backbone.memory.mem_len=4"]) \
            if agent == "gtrxl-ppo" else ("gtrxl/recall_bc", [*_TINY_GTRXL, *on_device])
        if agent == "gtrxl-iql":
            over.append("agent.objective=iql")
    else:
        data = save_d4rl_hdf5(collect_delayed_expert(20, seed=0, n_envs=10), tmp_path / "cp.hdf5")
        config, over = ("dt/cartpole_demo", [f"dataset.path={data}", *tiny, "agent.context_len=4", *on_device]) \
            if agent.startswith("dt") else (None, [f"dataset.path={data}", "agent.kind=bc", "train.batch_size=4"])
    counts = [_host_syncs(config, over, n, tmp_path / f"run{n}", skip_xl_span=agent.startswith("gtrxl"),
                          only_in_update=agent == "gtrxl-ppo", monkeypatch=monkeypatch) for n in (20, 40)]
    assert counts[0] == counts[1], counts


# ------------------------------------------------------- device options
@pytest.mark.parametrize("agent", ["dt", "gtrxl"])
def test_a_dataset_on_the_device_trains_the_same_weights_as_host_batches(agent: str, tmp_path: Path) -> None:
    """``train.data_on_device``: batches drawn from the dataset held as tensors (here on the CPU)
    equal the NumPy sampler's, so the weights after 6 updates are bit-identical."""
    from rl_tformers.agents.common.scripted import collect_delayed_expert
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    if agent == "dt":
        data = save_d4rl_hdf5(collect_delayed_expert(20, seed=0, n_envs=10), tmp_path / "cp.hdf5")
        config, over = "dt/cartpole_demo", [f"dataset.path={data}", "train.batch_size=4", "backbone.d_model=16",
                                            "backbone.n_layers=1", "agent.context_len=4"]
    else:
        config, over = "gtrxl/recall_bc", list(_TINY_GTRXL)
    quiet = ["train.steps=6", "train.checkpoint_every=0", "eval.every=0", "eval.at_end=false",
             "train.progress=false", "device=cpu"]
    for on in ("false", "true"):
        train(compose(config, [*over, *quiet, f"train.data_on_device={on}"]), tmp_path / on)
    assert_same_weights(model_state(tmp_path / "false", 6), model_state(tmp_path / "true", 6))
    assert "data_on_device: true" in (tmp_path / "true" / "config.yaml").read_text()


def test_cuda_graphs_are_refused_off_cuda_naming_the_option(tmp_path: Path) -> None:
    from rl_tformers.runtime.run_config import ConfigError

    with pytest.raises(ConfigError) as err:
        compose("toy", ["train.cuda_graphs=true", "device=cpu"])
    assert str(err.value) == ("train.cuda_graphs=true captures the update in CUDA graphs and needs a CUDA device, "
                              "but device=cpu is cpu; set train.cuda_graphs=false")
    r = CliRunner().invoke(app, ["train", "-c", "toy", "train.cuda_graphs=true", "device=cpu",
                                 f"run_dir={tmp_path / 'run'}"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith("error: train.cuda_graphs=true "), r.output
    assert not (tmp_path / "run").exists()


def test_bf16_and_compile_apply_on_cpu_too() -> None:
    """``train.amp=bf16`` and ``train.compile`` are not CUDA-only: the CPU runs them (native bf16
    where the CPU has it), so a CPU config keeps them."""
    cfg = compose("toy", ["train.amp=bf16", "train.compile=true", "device=cpu"])
    assert cfg.train.compile and str(cfg.train.amp.value) == "bf16" and not cfg.train.cuda_graphs


def test_a_dataset_on_the_device_with_dataloader_workers_is_refused() -> None:
    from rl_tformers.runtime.run_config import ConfigError

    with pytest.raises(ConfigError, match=r"^train.data_on_device=true .* train.num_workers=2 .* set "
                                          r"train.num_workers=0$"):
        compose("toy", ["train.data_on_device=true", "train.num_workers=2", "device=cpu"])


def test_a_dataset_on_the_device_is_refused_for_an_agent_without_a_window_or_segment_sampler(run_dir: Path) -> None:
    from rl_tformers.runtime.agent_registry import AgentBuildError

    with pytest.raises(AgentBuildError, match=r"^train.data_on_device=true: agent 'toy' does not draw its batches "
                                              r"from a dataset with a window or segment sampler \(ToyBatches\); "
                                              r"set train.data_on_device=false$"):
        train(toy_cfg("train.data_on_device=true"), run_dir)
    assert not run_dir.exists()


@pytest.mark.cuda
def test_a_dataset_on_the_gpu_trains_in_bf16(tmp_path: Path) -> None:
    cfg = compose("gtrxl/recall_bc", [*_TINY_GTRXL, "train.steps=4", "train.checkpoint_every=0", "eval.every=0",
                                      "eval.at_end=false", "train.progress=false", "device=cuda",
                                      "train.data_on_device=true", "train.amp=bf16"])
    assert train(cfg, tmp_path / "run").complete
    assert all(torch.isfinite(v).all() for v in model_state(tmp_path / "run", 4).values())


def test_cuda_graphs_compile_in_reduce_overhead_mode_and_mark_every_update(run_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing of ``train.cuda_graphs`` (CUDA only, so the config is edited past the refusal
    and the compilation recorded instead of run): the model is compiled with
    ``mode="reduce-overhead"`` and each update starts a new CUDA-graph step."""
    from omegaconf import OmegaConf

    compiled, marks = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cfg = toy_cfg("train.steps=6", "train.checkpoint_every=0")
    OmegaConf.set_readonly(cfg, False)
    cfg.train.cuda_graphs = True
    OmegaConf.set_readonly(cfg, True)
    assert train(cfg, run_dir).complete
    assert compiled == [{"mode": "reduce-overhead"}] and len(marks) == 6
    compiled.clear()
    assert train(toy_cfg("train.steps=2", "train.compile=true", "train.checkpoint_every=0"), run_dir.parent / "c").complete
    assert compiled == [{}]
