"""Faults found by the fifteenth fresh-user pass (clone, the two README commands, the CLI on
real data, the Python API block).

1. A Ctrl-C just after ``rl-tformers train`` finished (while it printed ``done: ...`` and the
   final evaluation, or while the interpreter shut down) ended a complete, saved run with exit
   status 130 and no message, or killed the process (status -2), as if the run had been cut
   short; a wrapper script then believed the run was interrupted. The summary is now printed
   with SIGINT/SIGTERM ignored and the console script ignores SIGINT while it exits: status 0.
2. Running the README's Python API block twice in one folder failed with ``RunDirError: ...
   continue it with --resume runs/api-dt, or pick another --run-dir``: command-line flags
   for a Python caller. The message now names ``rl_tformers.runtime.trainer.resume`` and
   ``train(cfg, run_dir=...)`` too, and the README says the block runs once per folder.
3. ``rl-tformers dataset info --json`` printed one line where docs/data.md shows (and ``eval
   --json`` prints) an indented object.
4. ``rl-tformers collect --list-recipes``: names longer than 32 characters
   (``halfcheetah-medium-replay-positions``) pushed their row off the columns.
5. (docs) GTrXL BC on position-only CartPole logs ``train/accuracy`` of about 0.5 while it
   scores 500: docs/gtrxl.md now says why (no previous action input) and what lifts it
   (``agent.prev_action=true``: 0.87).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import RunDirError, train
from tests.datafiles import write_cartpole_h5

runner = CliRunner()
TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=3", "train.batch_size=4",
       "train.warmup_steps=1", "train.log_every=1", "eval.at_end=true"]


# ------------------------------------------------- 1: a late Ctrl-C
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
    assert proc.returncode == 0, "".join(lines)  # was 130 (or -2: killed by the signal)


def test_the_summary_window_ignores_signals_and_restores_the_handlers() -> None:
    from rl_tformers.cli.train import finished_run, finished_run_signals

    before = signal.getsignal(signal.SIGINT)
    with finished_run_signals():
        signal.raise_signal(signal.SIGINT)  # recorded and ignored: no KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is before
    assert finished_run()


# ------------------------------------------------- 2: the Python API's run directory message
def test_a_second_run_in_a_used_directory_names_the_python_calls_too(tmp_path: Path) -> None:
    train(compose(None, [*TOY, "eval.at_end=false"]), tmp_path / "run")
    with pytest.raises(RunDirError) as info:
        train(compose(None, [*TOY, "eval.at_end=false"]), tmp_path / "run")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'run'} already holds a run; continue it with --resume {tmp_path / 'run'} ")
    assert f"rl_tformers.runtime.trainer.resume({str(tmp_path / 'run')!r}, ['train.steps=N'])" in msg
    assert "train(cfg, run_dir=...)" in msg


# ------------------------------------------------- 3 and 4: output layout
def test_dataset_info_json_is_one_indented_object(tmp_path: Path) -> None:
    path = write_cartpole_h5(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["dataset", "info", str(path), "--json"])
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert text.startswith('{\n  "') and json.loads(text)["episodes"] == 3


def test_list_recipes_keeps_its_columns_for_long_names() -> None:
    r = runner.invoke(app, ["collect", "--list-recipes"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if line.strip()]
    assert any(row.startswith("halfcheetah-medium-replay-positions ") for row in rows)
    ids = [row.index("rlt/") for row in rows]
    assert len(set(ids)) == 1  # every dataset id starts in the same column
