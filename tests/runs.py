"""Tiny Decision Transformer runs shared by the tests of several components (imported as
``tests.runs``; the fixtures are registered in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_cartpole_h5, write_d4rl_h5

runner = CliRunner()

#: ``rl-tformers train`` arguments of a 2-update DT on CPU without evaluations.
TINY_DT = ["train.steps=2", "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1",
           "agent.context_len=4", "eval.every=0", "eval.at_end=false", "train.progress=false", "--device", "cpu"]

#: config overrides of a 2-update DT on CPU without evaluations, targets [10].
TINY_DT_OVERRIDES = [
    "backbone.d_model=16",
    "backbone.n_heads=1",
    "backbone.n_layers=1",
    "agent.context_len=5",
    "train.steps=2",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.progress=false",
    "device=cpu",
    "eval.every=0",
    "eval.at_end=false",
    "agent.targets=[10]",
    "backbone.dropout=0.0",
]


def train_dt(*args: str):
    """``rl-tformers train -c dt/cartpole_demo ARGS`` with :data:`TINY_DT`; the CliRunner result."""
    return runner.invoke(app, ["train", "-c", "dt/cartpole_demo", *args, *TINY_DT])


def assert_clean_exit(r, code: int) -> None:
    """The command ended with ``code`` through typer (an ``error: ...`` line), not a traceback."""
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == code, r.output


def tripwire(*args, **kwargs):
    """A stand-in for an expensive function that a refusal must come before."""
    raise AssertionError("the expensive part ran before the bad input was refused")


@pytest.fixture(scope="module")
def tiny_dt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-update Decision Transformer run (module-wide: the tests only read it)."""
    root = tmp_path_factory.mktemp("dt")
    path = write_cartpole_h5(root / "cp.hdf5")
    run_dir = root / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_DT_OVERRIDES]), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def cartpole_dt_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny CartPole file (discrete actions)."""
    tmp = tmp_path_factory.mktemp("cartpole_dt")
    h5 = write_d4rl_h5(tmp / "cartpole.hdf5")
    r = train_dt(f"dataset.path={h5}", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


@pytest.fixture(scope="module")
def pendulum_dt_run(tmp_path_factory) -> Path:
    """A DT trained for 2 updates on a tiny Pendulum-shaped file (continuous actions)."""
    tmp = tmp_path_factory.mktemp("pendulum_dt")
    h5 = write_d4rl_h5(tmp / "pendulum.hdf5", obs_dim=3, env_id="Pendulum-v1", discrete=False)
    r = train_dt(f"dataset.path={h5}", "agent.max_ep_len=200", "--run-dir", str(tmp / "dt"))
    assert r.exit_code == 0, r.output
    return tmp / "dt"


@pytest.fixture
def no_evaluation(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make any evaluation fail the test: a refusal must come before anything is evaluated."""
    import rl_tformers.runtime.evaluation as evaluation

    calls: list = []

    def evaluate(*args, **kwargs):
        calls.append(args)
        raise AssertionError("evaluated although the command should have been refused first")

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    return calls
