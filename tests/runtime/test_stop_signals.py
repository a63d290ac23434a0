"""SIGINT/SIGTERM handling in one process: the start-up modes of GracefulInterrupt, the abort by a
second signal, a Ctrl-C while ``rl-tformers train`` starts, the torchrun wrapper's handler and the
``--nproc`` launcher's report. The multi-process runs (a Ctrl-C to ``train --nproc 2`` while it
trains and while its ranks start) are in tests/runtime/test_distributed.py.

Signals are sent to this process with ``os.kill``; the handler runs before the next line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from runtime_helpers import toy_cfg
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.cli.train import _remove_if_only_the_lock, stop_report
from rl_tformers.runtime import trainer as trainer_mod
from rl_tformers.runtime.checkpoint import list_checkpoints
from rl_tformers.runtime.runlock import LOCK_FILE, hold_run
from rl_tformers.runtime.torchrun import SHUTDOWN_TIMEOUT_S, StopRequests, _with_our_settings
from rl_tformers.runtime.trainer import GracefulInterrupt, Interrupted, Trainer, train

runner = CliRunner()
SIGINT, SIGTERM = signal.SIGINT, signal.SIGTERM


def _signal_self(signum: int) -> None:
    """Send ``signum`` to this (the main) thread: a process-directed ``os.kill`` would go to any
    thread that does not block it (threads started by earlier tests), not stay pending here."""
    signal.pthread_kill(threading.get_ident(), signum)


@pytest.fixture
def harmless_sigterm():
    """SIGTERM's handler is a no-op during the test (a test that fails with a SIGTERM pending or
    a start-up handler left in place must not kill pytest)."""
    previous = signal.signal(SIGTERM, lambda signum, frame: None)
    yield
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {SIGTERM})
    signal.signal(SIGTERM, previous)


# -------------------------------------------------------------------------- GracefulInterrupt
def test_raise_mode_interrupts_the_start_up_at_once_and_restores_the_handlers() -> None:
    before = signal.getsignal(SIGINT)
    stop = GracefulInterrupt(startup="raise")
    with pytest.raises(Interrupted) as info, stop:
        _signal_self(SIGINT)
        _signal_self(SIGINT)  # not reached: the first signal raised
    assert info.value.signum == SIGINT and stop.signum == SIGINT and stop.aborted is None
    assert str(info.value) == "interrupted by SIGINT before the first update"
    assert signal.getsignal(SIGINT) is before


def test_a_signal_pending_before_entering_acts_as_the_with_statement_enters(harmless_sigterm) -> None:
    """The ranks of `train --nproc` start with SIGINT/SIGTERM blocked: one sent meanwhile waits."""
    noop = signal.getsignal(SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGTERM})
    _signal_self(SIGTERM)
    assert SIGTERM in signal.sigpending()
    stop = GracefulInterrupt(startup="raise")
    with pytest.raises(Interrupted) as info:
        with stop:
            pytest.fail("the pending SIGTERM did not interrupt the start-up")
    assert info.value.signum == SIGTERM
    assert SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # entering unblocked it
    assert signal.getsignal(SIGTERM) is noop  # restored although __enter__ raised


@pytest.mark.parametrize("first, second, aborts", [
    (SIGINT, SIGINT, True), (SIGINT, SIGTERM, True), (SIGTERM, SIGINT, True),
    (SIGTERM, SIGTERM, False),  # a scheduler's SIGTERM to every process plus the launcher's forwarded one
])
def test_a_second_signal_aborts_unless_both_are_sigterm(first: int, second: int, aborts: bool,
                                                         harmless_sigterm) -> None:
    with GracefulInterrupt(announce=False) as stop:
        _signal_self(first)
        assert stop.signum == first and stop.aborted is None
        if aborts:
            with pytest.raises(KeyboardInterrupt):
                _signal_self(second)
                _signal_self(second)  # not reached
            assert stop.aborted == second
        else:
            _signal_self(second)
            assert stop.aborted is None
        _signal_self(SIGTERM)  # later signals change nothing
    assert stop.signum == first


def test_default_mode_keeps_the_default_action_until_training_begins(harmless_sigterm) -> None:
    with GracefulInterrupt(startup="default") as stop:
        assert signal.getsignal(SIGINT) is signal.SIG_DFL and signal.getsignal(SIGTERM) is signal.SIG_DFL
        stop.begin_training()
        _signal_self(SIGTERM)
        assert stop.signum == SIGTERM
    code = ("import os, signal\nfrom rl_tformers.runtime.trainer import GracefulInterrupt\n"
            "with GracefulInterrupt(startup='default'):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n    print('alive')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (r.returncode, r.stdout, r.stderr) == (-SIGINT, "", "")  # ended at once, silently


def test_unknown_startup_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"startup must be one of \(None, 'raise', 'default'\), got 'yes'"):
        GracefulInterrupt(startup="yes")


# ------------------------------------------------------------------------------------ Trainer
def test_a_signal_before_the_first_update_leaves_the_run_directory_unwritten(run_dir: Path,
                                                                              harmless_sigterm) -> None:
    trainer = Trainer(trainer_mod._with_run_dir(toy_cfg(), run_dir), run_dir)
    batches = trainer.agent.batches

    def signal_then_batches(start: int):
        _signal_self(SIGTERM)
        return batches(start)

    trainer.agent.batches = signal_then_batches
    with pytest.raises(Interrupted) as info:
        trainer.fit()
    assert info.value.signum == SIGTERM
    assert not run_dir.exists()  # the ranks agree to start before anything is written


def test_a_second_sigint_aborts_at_once_and_says_where_the_run_stands(run_dir: Path, caplog) -> None:
    before = signal.getsignal(SIGINT)  # default_int_handler, or SIG_IGN in a background job
    trainer = Trainer(trainer_mod._with_run_dir(toy_cfg("train.checkpoint_every=5"), run_dir), run_dir)
    loss, calls = trainer.agent.loss, {"n": 0}

    def loss_then_two_sigints(batch):
        calls["n"] += 1
        if calls["n"] == 7:
            _signal_self(SIGINT)  # stop after this update...
            _signal_self(SIGINT)  # ...no: at once
        return loss(batch)

    trainer.agent.loss = loss_then_two_sigints
    log = logging.getLogger("rl_tformers.runtime.trainer")
    log.addHandler(caplog.handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit()
    finally:
        log.removeHandler(caplog.handler)
    ckpt = run_dir / "checkpoints" / "step_000000005.pt"
    assert [s for s, _ in list_checkpoints(run_dir)] == [5]
    assert caplog.messages[-1] == (f"aborted at once by a second signal (SIGINT) at step 6; the run continues from "
                                   f"its last checkpoint, step 5 ({ckpt}): rl-tformers train --resume {run_dir}")
    assert signal.getsignal(SIGINT) == before  # the handler it found is back


# ------------------------------------------------------------------------ rl-tformers train
@pytest.fixture
def sigint_while_the_agent_is_built(monkeypatch):
    build = trainer_mod.build_agent

    def sigint_then_build(*args, **kwargs):
        _signal_self(SIGINT)
        return build(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "build_agent", sigint_then_build)


def test_ctrl_c_while_a_new_run_starts_is_one_line_and_130(tmp_path: Path,
                                                            sigint_while_the_agent_is_built) -> None:
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "toy", "--device", "cpu", "train.steps=5", "--run-dir", str(run)])
    assert r.exit_code == 130, r.output
    assert r.output == ("interrupted by SIGINT before the first update: nothing was trained or saved "
                        "(nothing to resume)\n")
    assert not run.exists()  # the directory made for its lock is gone again


def test_ctrl_c_while_a_run_resumes_leaves_it_unchanged(tmp_path: Path, request) -> None:
    run = tmp_path / "run"
    train(toy_cfg(), run, stop_at=10)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    request.getfixturevalue("sigint_while_the_agent_is_built")
    r = runner.invoke(app, ["train", "--resume", str(run)])
    assert r.exit_code == 130, r.output
    assert r.output == (f"interrupted by SIGINT before the first update: {run} is unchanged; continue with: "
                        f"rl-tformers train --resume {run}\n")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------- torchrun wrapper
def test_the_wrapper_starts_a_shutdown_for_the_first_two_signals_only() -> None:
    class Shutdown(Exception):
        def __init__(self, msg: str, sigval: signal.Signals) -> None:
            super().__init__(msg)
            self.sigval = sigval

    stops = StopRequests(Shutdown)
    for signum in (SIGINT, SIGTERM):
        with pytest.raises(Shutdown) as info:
            stops(signum, None)
        assert info.value.sigval == signum
    stops(SIGINT, None)  # torchrun is already shutting the ranks down (and kills them after the timeout)
    assert stops.received == [SIGINT, SIGTERM, SIGINT]


def test_the_wrapper_keeps_sigint_sigterm_and_waits_longer_for_the_ranks(monkeypatch) -> None:
    from torch.distributed.run import parse_args

    if not hasattr(parse_args(["x"]), "signals_to_handle"):
        pytest.skip("this torch's torchrun has no --signals-to-handle")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    args = _with_our_settings(parse_args(["--standalone", "--nproc-per-node=2", "-m", "m"]))
    assert (args.signals_to_handle, args.shutdown_timeout) == ("SIGHUP,SIGQUIT", SHUTDOWN_TIMEOUT_S)
    assert _with_our_settings(parse_args(["--shutdown-timeout=7", "-m", "m"])).shutdown_timeout == 7
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")  # torchrun's own setting wins
    assert _with_our_settings(parse_args(["-m", "m"])).shutdown_timeout is None


# ------------------------------------------------------------------------- launcher's report
def test_the_launcher_reports_what_the_run_directory_holds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    nothing = "interrupted by SIGINT before the first checkpoint: nothing to resume"
    assert stop_report(run, 2, [SIGINT], 100, 100) == (nothing, 130)
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert stop_report(run, 2, [SIGINT], 100, 100) == (
        f"{nothing}; {run} holds only the logs of its start: delete it, or pick another --run-dir, to start again",
        130)
    (run / "checkpoints").mkdir()
    for step in (10, 20):
        (run / "checkpoints" / f"step_{step:09d}.pt").write_bytes(b"")  # found by name
    newest = run / "checkpoints" / "step_000000020.pt"
    cont = f"continue with: rl-tformers train --resume {run} --nproc 2"
    assert stop_report(run, 2, [SIGTERM], 100, 100) == (
        f"stopped by SIGTERM at step 20 of 100; checkpoint {newest}; {cont}", 143)
    assert stop_report(run, 2, [SIGINT, SIGTERM], 100, 100) == (
        f"aborted by a second signal (SIGTERM); last checkpoint: step 20 of 100 ({newest}); {cont}", 130)
    assert stop_report(run, 2, [SIGINT], 100, 20) == ("", 0)  # reached --stop-at 20 first; rank 0 said so


def test_the_launcher_removes_a_new_run_directory_holding_only_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with hold_run(run):
        _remove_if_only_the_lock(run)  # somebody trains it
        assert (run / LOCK_FILE).exists()
    run.mkdir(exist_ok=True)
    (run / LOCK_FILE).write_text("1\n")
    (run / "config.yaml").write_text("a: 1\n")
    _remove_if_only_the_lock(run)  # holds more than the lock
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "config.yaml"]
    (run / "config.yaml").unlink()
    _remove_if_only_the_lock(run)
    assert not run.exists()
