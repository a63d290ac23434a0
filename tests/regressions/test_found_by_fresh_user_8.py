"""Defects found by the fresh-user pass of session 8 (sweeps, progress output, --help).

1. ``rl-tformers sweep`` found a bad grid point only when its run started: the configs were
   composed first but the sweep stopped at the first one that did not compose, and a point whose
   config composed but whose agent refuses it (a causal DT on a bidirectional backbone, a
   missing dataset) failed in its own run, after the runs before it had trained. Every point is
   now composed and its agent built (as ``rl-tformers train`` does before training, on the CPU)
   before any run starts, and one error names every bad point and why.
2. The tqdm progress bar of ``train`` and ``collect`` wrote carriage-return fragments into a log
   file (``nohup ... > log``); without a terminal there is now a plain line every 30 s and one
   at the end.
3. Sweep run folders named a single grid key by its last part (``kind=none``) but two keys
   sharing their last part by their whole dotted keys (``backbone.attention.kind=sdpa__
   backbone.position.kind=none``); every key is now named by its shortest dotted suffix no
   other grid key shares, and a folder of the earlier naming still resumes.
4. ``--help`` showed ``--seed`` as ``[0<=x<=18446744073709551615]`` and refused a larger seed
   with that number; it now reads ``At most 2**64-1``.

Tiny datasets are written into ``tmp_path``; nothing here reads ``data/``.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import sweep as sw
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

runner = CliRunner()

TINY_DT = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.log_every=1",
           "train.checkpoint_every=0", "eval.at_end=false", "backbone.d_model=16", "backbone.n_layers=1",
           "agent.context_len=4"]


def _write_h5(path: Path, n: int = 30) -> Path:
    """A CartPole-shaped D4RL-layout file: three episodes of 10 steps."""
    rng = np.random.default_rng(0)
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    terminals[[9, 19]] = True
    timeouts[n - 1] = True
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=(rng.normal(size=(n, 4)) * 0.05).astype(np.float32))
        f.create_dataset("actions", data=rng.integers(0, 2, n).astype(np.int64))
        f.create_dataset("rewards", data=np.ones(n, np.float32))
        f.create_dataset("terminals", data=terminals)
        f.create_dataset("timeouts", data=timeouts)
        f.attrs["env_id"] = "CartPole-v1"
    return path


def _flat(text: str) -> str:
    """CLI output with rich's box characters removed and whitespace collapsed (wrapping apart)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


# ------------------------------------------------------------------ 1. bad grid points, all at once
def test_sweep_names_every_bad_grid_point_before_any_run_starts(tmp_path: Path) -> None:
    """The user's grid: a kernel without a causal form (refused by the backbone check when the
    config is composed) and ``backbone.causal=false`` under the DT's causal mode (refused by the
    DT when it is built). Before, the sweep stopped at the first point that did not compose and
    named only it; the sdpa/causal=false point would have started and failed in its run."""
    data = _write_h5(tmp_path / "d.hdf5")
    out = tmp_path / "sweep"
    with pytest.raises(sw.SweepError) as err:
        sw.sweep("dt/cartpole_demo", {"backbone.attention.kind": ["sdpa", "linformer"],
                                      "backbone.causal": ["true", "false"]},
                 [0], out, [f"dataset.path={data}", *TINY_DT], device="cpu", echo=lambda m: None)
    lines = str(err.value).splitlines()
    assert lines[0] == "3 of 4 grid points cannot run; nothing was started:"
    assert lines[1].startswith("  kind=sdpa__causal=false/seed0 (backbone.attention.kind=sdpa, backbone.causal=false): "
                               "agent.mode=causal needs backbone.causal=true")
    assert lines[2].startswith("  kind=linformer__causal=true/seed0 (backbone.attention.kind=linformer, "
                               "backbone.causal=true): backbone.attention.kind='linformer' has no causal form")
    assert lines[3].startswith("  kind=linformer__causal=false/seed0 (backbone.attention.kind=linformer, "
                               "backbone.causal=false): agent.mode=causal needs")
    assert lines[4] == "fix or drop those values, then run the same command again" and len(lines) == 5
    assert not out.exists()  # nothing started, no folder left behind


def test_an_agent_refusal_alone_stops_the_sweep_before_any_run(tmp_path: Path) -> None:
    """A grid whose every config composes, one point of which the DT refuses when it is built,
    and one point whose dataset does not exist: before, the good point trained and the two others
    failed in their runs (exit status 1); now the command exits with status 2 before starting
    anything, naming both points."""
    data = _write_h5(tmp_path / "d.hdf5")
    missing = tmp_path / "missing.hdf5"
    out = tmp_path / "sweep"
    r = runner.invoke(app, ["sweep", "-c", "dt/cartpole_demo", "--grid", "backbone.causal=true,false",
                            "--grid", f"dataset.path={data},{missing}", "--seeds", "0,1", "--out", str(out),
                            "--device", "cpu", *TINY_DT])
    assert r.exit_code == 2, r.output
    assert "error: 3 of 4 grid points cannot run; nothing was started:" in r.output
    assert f"/seed* (backbone.causal=true, dataset.path={missing}): no such HDF5 file: {missing}\n" in r.output
    assert (f"/seed* (backbone.causal=false, dataset.path={data}): agent.mode=causal needs backbone.causal=true"
            in r.output)
    assert f"/seed* (backbone.causal=false, dataset.path={missing}): no such HDF5 file: {missing}\n" in r.output
    assert f"(backbone.causal=true, dataset.path={data}):" not in r.output
    assert not out.exists()


def test_agents_are_built_only_for_points_with_a_run_to_do(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent check runs once per grid point (not per seed), and not at all when every run of
    the sweep is complete (a rerun that only writes the results builds nothing)."""
    from rl_tformers.runtime import trainer as trainer_mod

    built: list[int] = []
    real = trainer_mod.check_agent
    monkeypatch.setattr(trainer_mod, "check_agent", lambda cfg, *a, **k: (built.append(int(cfg.seed)), real(cfg))[1])
    common = ["agent.kind=toy", "train.steps=2", "train.log_every=1", "train.checkpoint_every=0", "eval.at_end=false"]
    out = tmp_path / "sweep"
    res = sw.sweep(None, {"backbone.n_layers": ["1"]}, [0, 1], out, common, jobs=2, device="cpu", echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["ok"] * 2 and built == [0]  # one point, two seeds: built once
    res = sw.sweep(None, {"backbone.n_layers": ["1"]}, [0, 1], out, common, jobs=2, device="cpu", echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["skipped"] * 2 and built == [0]


def test_warnings_of_building_the_agents_reach_the_sweep_console() -> None:
    """PPO turns a configured dropout off with a warning when it is built; the sweep's check
    collects it with the grid point (the run's own log is not on the sweep's console)."""
    cfg = compose(None, ["agent.kind=gtrxl_ppo", "agent.env_id=CartPole-v1", "agent.n_envs=1", "agent.n_steps=4", "agent.n_minibatches=2",
                         "backbone.d_model=16", "backbone.n_layers=1", "backbone.dropout=0.1", "device=cpu"])
    bad, warned = sw.check_points({"backbone.dropout=0.1": cfg})
    assert bad == {}
    assert [(m.split(":")[0], labels) for m, labels in warned.items()] == [
        ("gtrxl_ppo trains without dropout", ["backbone.dropout=0.1"])]


# ---------------------------------------------------------------------- 2. progress without a tty
def test_train_progress_without_a_terminal_is_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr is not a terminal under pytest's capture, as in ``nohup rl-tformers train > log``.
    Before, tqdm's redraws (``\\r``) went there; now each line is a plain line."""
    cfg = compose(None, ["agent.kind=toy", "device=cpu", "train.steps=6", "train.log_every=3",
                         "train.warmup_steps=1", "eval.at_end=false", "train.progress=true"])
    train(cfg, tmp_path / "short")  # shorter than the interval: one line, at the end
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: ")]
    assert len(lines) == 1 and lines[0].startswith("train: 6/6 steps (100%), ") and "loss=" in lines[0]

    from rl_tformers.runtime import progress as progress_mod

    monkeypatch.setattr(progress_mod, "PLAIN_INTERVAL_S", 0.0)  # a long run: a line at every interval
    train(cfg, tmp_path / "long")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: ")]
    assert [ln.split(" steps")[0] for ln in lines] == [f"train: {k}/6" for k in range(1, 7)]
    assert "about " in lines[0] and " left" in lines[0] and "left" not in lines[-1]

    train(compose(None, ["agent.kind=toy", "device=cpu", "train.steps=2", "eval.at_end=false",
                         "train.progress=false"]), tmp_path / "quiet")
    assert "train: " not in capsys.readouterr().err


def test_a_terminal_keeps_the_bar() -> None:
    from rl_tformers.runtime import progress as progress_mod

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    bar = progress_mod.progress_bar(10, desc="train", file=Tty())
    assert isinstance(bar, tqdm)
    bar.close()
    plain = progress_mod.progress_bar(10, desc="train", file=io.StringIO())
    assert isinstance(plain, progress_mod.PlainProgress) and not plain.disable


def test_collect_progress_without_a_terminal_is_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from rl_tformers.envs.collect import Behaviour, collect
    from rl_tformers.envs.policies import RandomPolicy

    env = gym.make("CartPole-v1")
    collect("CartPole-v1", [Behaviour(RandomPolicy(env.action_space, seed=0), episodes=2)],
            dataset_id="t/cartpole/random-v0", root=tmp_path, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("t/cartpole/random-v0: ")]
    assert len(lines) == 1 and re.match(r"t/cartpole/random-v0: \d+ steps, ", lines[0]) and "episodes=2" in lines[0]


# ------------------------------------------------------------------------- 3. run folder names
def test_run_folders_name_keys_by_their_shortest_distinct_suffix_and_old_sweeps_resume(tmp_path: Path) -> None:
    names = [r.name for r in sw.expand({"backbone.attention.kind": ["sdpa"], "backbone.position.kind": ["none"]},
                                       [0], tmp_path)]
    assert names == ["attention.kind=sdpa__position.kind=none/seed0"]  # was backbone.attention.kind=...
    assert [r.name for r in sw.expand({"backbone.attention.kind": ["sdpa"]}, [0], tmp_path)] == ["kind=sdpa/seed0"]
    assert sw.short_keys(["x.a.kind", "y.a.kind", "train.lr"]) == {"x.a.kind": "x.a.kind", "y.a.kind": "y.a.kind",
                                                                   "train.lr": "lr"}

    # a sweep started with the earlier naming resumes into its folders
    out = tmp_path / "sweep"
    grid = {"backbone.attention.kind": ["sdpa"], "backbone.position.kind": ["learned"]}
    common = ["agent.kind=toy", "train.steps=2", "train.log_every=1", "train.checkpoint_every=0", "eval.at_end=false"]
    sw.sweep(None, grid, [0], out, common, device="cpu", echo=lambda m: None)
    new, old = "attention.kind=sdpa__position.kind=learned", "backbone.attention.kind=sdpa__backbone.position.kind=learned"
    (out / new).rename(out / old)  # as the earlier naming left it, logs included
    for log in (out / "logs").glob(f"{new}_seed0*"):
        log.rename(log.with_name(log.name.replace(new, old)))
    messages: list[str] = []
    res = sw.sweep(None, grid, [0], out, common, device="cpu", echo=messages.append)
    assert [(r["run"], r["status"]) for r in res.rows] == [(f"{old}/seed0", "skipped")]
    assert not (out / new).exists() and res.rows[0]["seconds"] > 0  # its parts ledger was found too
    assert f"skipped {old}/seed0 (complete)" in messages


# ------------------------------------------------------------------------------- 4. --seed range
def test_seed_range_is_readable_in_help_and_errors(tmp_path: Path) -> None:
    from rl_tformers.cli import readable_int

    assert (readable_int(2**64 - 1), readable_int(2**32), readable_int(1000)) == ("2**64-1", "2**32", "1000")
    for command in ("eval", "plot"):
        r = runner.invoke(app, [command, "--help"])
        text = _flat(r.output)
        assert r.exit_code == 0 and "18446744073709551615" not in text, text
        assert re.search(r"--seed .*\[x>=0\].* At most 2\*\*64-1\.", text), text
    r = runner.invoke(app, ["eval", str(tmp_path / "run"), "--seed", str(2**64)])
    assert r.exit_code == 2
    assert ("Invalid value for '--seed': 18446744073709551616 is larger than 2**64-1 = 18446744073709551615, the "
            "largest value --seed takes" in _flat(r.output)), r.output
    r = runner.invoke(app, ["eval", str(tmp_path / "run"), "--seed", str(2**64 - 1)])  # the largest is accepted
    assert r.exit_code == 2 and "does not exist" in r.output and "--seed" not in r.output
    r = runner.invoke(app, ["eval", str(tmp_path / "run"), "--seed", "-1"])
    assert r.exit_code == 2 and "--seed" in r.output


def test_plain_progress_line_says_when_its_logged_values_are_from_an_earlier_step() -> None:
    """Fresh user: the last line after SIGTERM at step 143 showed loss and lr of the step-100 log
    as if they were current."""
    import io

    from rl_tformers.runtime.progress import PlainProgress

    bar = PlainProgress(200, desc="train", unit="step", file=io.StringIO())
    bar.n = 100
    bar.set_postfix(loss="1.12", lr="1.00e-03")
    assert bar.line(bar._t0 + 10).endswith("loss=1.12, lr=1.00e-03")
    bar.n = 143
    assert bar.line(bar._t0 + 14).endswith("loss=1.12, lr=1.00e-03 (as of step 100)")
