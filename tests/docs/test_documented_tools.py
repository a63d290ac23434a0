"""The ``python -m`` tools and the refusals the docs show: ``-h`` prints the usage, a bad work
directory is named in one line without a traceback, and a kernel that cannot take memory keys is
refused with the list of the kernels that can."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train


@pytest.mark.parametrize("module", ["rl_tformers.bench.attention_rl", "rl_tformers.envs.memory_tasks"])
def test_documented_python_m_tools_accept_h(module: str) -> None:
    """``-h`` shows the usage, as ``rl-tformers -h`` does (not "No such option" nor a run folder
    named ``-h``)."""
    r = subprocess.run([sys.executable, "-m", module, "-h"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"Usage: python -m {module}" in r.stdout and "Traceback" not in r.stderr


def test_attention_rl_table_names_a_bad_work_dir_without_a_traceback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rl_tformers.bench.attention_rl"]
    r = subprocess.run([*cmd, str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"error: {tmp_path / 'missing'} is not a directory\n")
    r = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"error: no finished runs (folders with checkpoints/) in {tmp_path}\n")
    train(compose(overrides=["agent.kind=toy", "train.steps=1", "train.progress=false"]), tmp_path / "toy")
    r = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"error: {tmp_path / 'toy'} is not a Decision Transformer run (agent.kind='toy'); "
                        "give the WORK_DIR of the RL-scale case\n")


def test_train_refusing_a_kernel_without_memory_keys_lists_the_kernels_that_fit() -> None:
    """The CLI's refusal names the kernels that accept memory keys, so the user sees what fits."""
    r = CliRunner().invoke(app, ["train", "-c", "gtrxl/recall_bc", "backbone.attention.kind=sinkhorn"])
    assert r.exit_code == 2
    assert r.stderr.startswith(
        "error: backbone.memory.kind='xl' needs an attention kernel that accepts memory keys; "
        "backbone.attention.kind='sinkhorn' does not; kernels that do (with backbone.position.kind='xl_relative'): "
        "adaptive_span, fixed, local, local_2d, reference, sdpa, sliding_window, strided"
    ), r.stderr
