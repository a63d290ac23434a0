"""``rl-tformers sweep``: grid parsing and expansion, local parallel runs, skip/resume on re-run,
results table and plot, failed runs, and the Ray launcher (through a stand-in module, and on a
real local Ray instance in the slow suite)."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import h5py
import numpy as np
import pytest
from runtime_helpers import toy_cfg
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import sweep as sw
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.runs import tripwire


def test_grid_and_seed_parsing() -> None:
    assert sw.split_values("a, b,[1,2],{k: 1, j: 2}") == ["a", "b", "[1,2]", "{k: 1, j: 2}"]
    assert sw.parse_grid(["backbone.attention.kind=sdpa,performer", "train.betas=[0.9,0.95],[0.9,0.99]"]) == {
        "backbone.attention.kind": ["sdpa", "performer"], "train.betas": ["[0.9,0.95]", "[0.9,0.99]"]}
    assert sw.parse_seeds("0,1,2") == [0, 1, 2] and sw.parse_seeds("3-5,9") == [3, 4, 5, 9]
    for bad in (["novalue"], ["k="], ["seed=1,2"], ["a=1", "a=2"]):
        with pytest.raises(sw.SweepError):
            sw.parse_grid(bad)
    for bad in ("x", "1,1", ""):
        with pytest.raises(sw.SweepError):
            sw.parse_seeds(bad)


def test_expand_is_the_cartesian_product_times_seeds(tmp_path: Path) -> None:
    grid = {"backbone.attention.kind": ["sdpa", "performer"], "train.lr": ["1e-4", "3e-4"]}
    runs = sw.expand(grid, [0, 1, 2], tmp_path, ["train.steps=5"])
    assert len(runs) == 12 and len({r.run_dir for r in runs}) == 12
    r = runs[3]  # second point (sdpa, 3e-4), first seed
    assert r.name == "kind=sdpa__lr=3e-4/seed0" and r.run_dir == tmp_path / r.name
    assert r.overrides == ("train.steps=5", "backbone.attention.kind=sdpa", "train.lr=3e-4", "seed=0")
    assert r.point_label == "backbone.attention.kind=sdpa, train.lr=3e-4"
    # keys whose last part clashes keep their full dotted name in the folder
    clash = sw.expand({"a.kind": ["x"], "b.kind": ["y"]}, [0], tmp_path)
    assert clash[0].name == "a.kind=x__b.kind=y/seed0"
    assert sw.expand({}, [7], tmp_path)[0].name == "base/seed7"


def test_run_state_and_command(tmp_path: Path) -> None:
    run = sw.expand({"backbone.n_layers": ["1"]}, [0], tmp_path)[0]
    assert sw.run_state(run.run_dir) == "new"
    cmd = sw.train_command(run, "toy", "new", device="cpu")
    assert cmd[:4] == [sys.executable, "-m", "rl_tformers.cli", "train"]
    assert cmd[4:] == ["--run-dir", str(run.run_dir), "--config", "toy", "--device", "cpu",
                       "backbone.n_layers=1", "seed=0", "train.progress=false"]
    train(toy_cfg("train.steps=10"), run.run_dir, stop_at=5)
    assert sw.run_state(run.run_dir) == "partial"
    assert sw.train_command(run, "toy", "partial")[4:6] == ["--resume", str(run.run_dir)]
    train(toy_cfg("train.steps=10"), tmp_path / "done")
    assert sw.run_state(tmp_path / "done") == "complete"


def test_local_sweep_runs_in_parallel_collects_and_skips_on_rerun(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    common = ["agent.kind=toy", "train.steps=10", "train.log_every=5", "train.checkpoint_every=0", "eval.at_end=true"]
    messages: list[str] = []
    res = sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0, 1], out, common, jobs=2, threads=1,
                   device="cpu", echo=messages.append)
    assert [r["status"] for r in res.rows] == ["ok"] * 4
    assert res.metric == "eval/return"  # the toy agent's evaluation scalar
    with open(out / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [t["run"] for t in table] == ["n_layers=1/seed0", "n_layers=1/seed1", "n_layers=2/seed0", "n_layers=2/seed1"]
    assert all(t["step"] == "10" for t in table)
    by_point = {s["point"]: s for s in res.summary}
    vals = [float(t["eval/return"]) for t in table[:2]]
    assert by_point["backbone.n_layers=1"]["mean"] == pytest.approx(statistics.fmean(vals))
    assert by_point["backbone.n_layers=1"]["std"] == pytest.approx(statistics.stdev(vals))
    assert by_point["backbone.n_layers=2"]["n"] == 2
    assert json.loads((out / "results.json").read_text())["summary"][0]["point"] == "backbone.n_layers=1"
    assert "| backbone.n_layers=2 |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 0 and (out / "logs" / "n_layers=2_seed1.log").exists()
    again = sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0, 1], out, common, echo=messages.append)
    assert [r["status"] for r in again.rows] == ["skipped"] * 4
    assert [s["mean"] for s in again.summary] == [s["mean"] for s in res.summary]


def test_failed_runs_are_reported_with_their_log(tmp_path: Path) -> None:
    run = sw.expand({}, [0], tmp_path)[0]
    cmd = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    outcomes = sw.run_local([(run, cmd)], jobs=1, threads=1, log_dir=tmp_path / "logs", echo=lambda m: None)
    o = outcomes[run.name]
    assert (o.status, o.returncode) == ("failed", 3) and "boom" in o.log
    res = sw.write_results(tmp_path, [run], outcomes)
    assert res.rows[0]["status"] == "failed" and res.metric is None
    assert json.loads((tmp_path / "results.json").read_text())["failed"][run.name]["returncode"] == 3


def test_cli_reports_bad_grid_and_missing_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_tformers.cli import app

    r = CliRunner().invoke(app, ["sweep", "-c", "toy", "--grid", "seed=1,2", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--seeds" in r.output
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    r = CliRunner().invoke(app, ["sweep", "-c", "toy", "--grid", "train.lr=1e-3", "--launcher", "ray",
                                 "--out", str(tmp_path)])
    assert r.exit_code == 2 and "pip install 'ray[default]'" in r.output
    assert not any(tmp_path.iterdir())  # refused before any run started


def test_ray_launcher_submits_one_task_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict = {"remote": [], "init": []}

    class Ref:
        def __init__(self, value):
            self.value = value

    def remote(**resources):
        calls["remote"].append(resources)

        def wrap(fn):
            return types.SimpleNamespace(remote=lambda *a: Ref(fn(*a)))
        return wrap

    def wait(refs, num_returns, timeout):  # Ray's: the refs done within timeout (here: all), the rest
        calls["wait"].append((len(refs), num_returns, timeout))
        return list(refs), []

    calls["wait"] = []
    fake = types.SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: calls["init"].append(kw),
                                 remote=remote, get=lambda ref: ref.value, wait=wait)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RL_TFORMERS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    runs = sw.expand({"x": ["1", "2"]}, [0], Path("sweep"))  # relative, as --out sweep
    show = "import os; print(os.getcwd(), os.environ['RL_TFORMERS_CACHE_DIR'], os.environ['OMP_NUM_THREADS'])"
    cmds = [(r, [sys.executable, "-c", f"{show}; print({i})"]) for i, r in enumerate(runs)]
    out = sw.run_ray(cmds, threads=2, gpus_per_run=0.5, log_dir=Path("sweep/logs"), echo=lambda m: None)
    assert calls["init"] == [{"address": None}] and calls["remote"] == [{"num_cpus": 2, "num_gpus": 0.5}]
    assert [o.status for o in out.values()] == ["ok", "ok"] and "1" in out[runs[1].name].log
    assert f"{tmp_path} {tmp_path / 'cache'} 2\n" in out[runs[0].name].log  # the sweep's folder and variables
    assert (tmp_path / "sweep" / "logs" / "x=1_seed0.log").is_file()
    assert calls["wait"] == [(2, 2, 0.5)]
    calls["init"].clear()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    sw.run_ray(cmds[:1], threads=1, gpus_per_run=0, log_dir=Path("sweep/logs"), echo=lambda m: None,
               address="10.0.0.1:6379")
    sw.run_ray(cmds[:1], threads=1, gpus_per_run=0, log_dir=Path("sweep/logs"), echo=lambda m: None)
    assert calls["init"] == [{"address": "10.0.0.1:6379"}, {"address": "10.0.0.2:6379"}]


@pytest.mark.slow
def test_a_sweep_on_a_real_ray_instance_gives_the_local_launcher_s_results(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """2 configs x 2 seeds through ``--launcher ray --ray-address`` on a Ray instance this test
    starts on the loopback address (and stops) give the runs of the local launcher, final
    metrics equal to the last digit. The sweep runs in another folder than Ray's workers, with
    a relative ``--out``: each run's ``train`` runs in the sweep's folder."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray: pip install 'rl-tformers[ray]'")
    # Ray binds the loopback address only with its multi-node mode off (else it resolves
    # 127.0.0.1 to the node's reachable address); set before ray is imported, and on the module
    # where an earlier test imported it
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import ray._private.ray_constants as ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "ray")  # the folder of Ray's workers
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                   _node_ip_address="127.0.0.1")
    try:
        address = ctx.address_info["gcs_address"]
        assert address.startswith("127.0.0.1:")
        cli = Path(sys.executable).parent / "rl-tformers"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        got = {}
        for launcher, how in (("local", ["--jobs", "2"]), ("ray", ["--launcher", "ray", "--ray-address", address])):
            r = subprocess.run([str(cli), "sweep", "-c", "toy", "--grid", "train.lr=1e-3,3e-3", "--seeds", "0-1",
                                "--threads", "1", *how, "--out", f"sweep-{launcher}", "train.steps=20",
                                "train.warmup_steps=5"],
                               capture_output=True, text=True, timeout=900, cwd=tmp_path / "work", env=env)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            rows = json.loads((tmp_path / "work" / f"sweep-{launcher}" / "results.json").read_text())["runs"]
            got[launcher] = {row["run"]: (row["status"], row["step"], row["train/loss"], row["eval/return"])
                             for row in rows}
        assert address in r.stderr  # the ray sweep joined this instance (Ray's "Connecting to ... at ADDRESS")
    finally:
        ray.shutdown()
    assert sorted(got["ray"]) == ["lr=1e-3/seed0", "lr=1e-3/seed1", "lr=3e-3/seed0", "lr=3e-3/seed1"]
    assert all(v[:2] == ("ok", 20) for v in got["ray"].values())
    assert got["ray"] == got["local"]
    logs = tmp_path / "work" / "sweep-ray" / "logs"
    assert len(list(logs.glob("*.parts.jsonl"))) == 4 and not (tmp_path / "ray" / "sweep-ray").exists()


# ------------------------------------------------- sweep: a diverged run's final NaN is not hidden
def test_sweep_results_report_a_final_non_finite_value_not_an_earlier_finite_one(tmp_path) -> None:
    import json
    import math

    from rl_tformers.runtime.sweep import RunOutcome, expand, last_scalars, write_results

    runs = expand({"train.lr": ["1e-3"]}, [0, 1], tmp_path / "sw")
    for seed, run in enumerate(runs):
        run.run_dir.mkdir(parents=True)
        final = {"step": 10, "train/loss": None, "eval/return": None} if seed == 0 else \
            {"step": 10, "train/loss": 0.4, "eval/return": 20.0}  # (null: how metrics.jsonl writes NaN / inf)
        records = [{"step": 5, "time": 1.0, "train/loss": 0.5, "eval/return": 10.0}, final]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    scalars = last_scalars(runs[0].run_dir)
    assert scalars["step"] == 10.0 and math.isnan(scalars["train/loss"]) and math.isnan(scalars["eval/return"])
    warned: list[str] = []
    res = write_results(tmp_path / "sw", runs, {r.name: RunOutcome("ok", 0) for r in runs}, warn=warned.append)
    assert math.isnan(res.rows[0]["eval/return"]) and math.isnan(res.rows[0]["train/loss"])  # were 10.0 and 0.5
    (point,) = res.summary
    assert (point["n"], point["of"], point["mean"], point["std"]) == (1, 2, 20.0, None)  # not n=2, mean 15.0
    saved = json.loads((tmp_path / "sw" / "results.json").read_text())  # strict JSON: NaN as null
    assert saved["runs"][0]["eval/return"] is None and saved["runs"][1]["eval/return"] == 20.0
    assert "| lr=1e-3/seed0 | 0 | ok | 10 | 0 | nan | nan |" in (tmp_path / "sw" / "results.md").read_text()
    assert warned == []
    # every completed run diverged: said so, not "only runs that did not complete logged it"
    res = write_results(tmp_path / "sw", runs[:1], {runs[0].name: RunOutcome("ok", 0)}, warn=warned.append)
    assert res.summary[0]["mean"] is None and not (tmp_path / "sw" / "results.png").exists()
    assert warned == ["warning: eval/return: its final value is NaN or infinite in every completed run that "
                      "logged it (diverged?); no summary values and no plot"]


# ------------------------------------------------- sweep: a run's seconds over all its parts
def test_sweep_seconds_are_the_total_over_a_run_s_parts(tmp_path) -> None:
    """A run resumed by a second sweep reports the wall time of all its parts (not only the
    second part's, nor 0 for a skipped run): each part's time goes to ``logs/<run>.parts.jsonl``
    and the row sums them; a run that starts anew (its directory deleted, or never made) counts anew."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sw"
    (run,) = sw.expand({}, [0], out)
    logs = out / "logs"
    sleep = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    first = sw.run_local([(run, sleep)], jobs=1, threads=1, log_dir=logs, echo=lambda m: None)[run.name]
    second = sw.run_local([(run, sleep)], jobs=1, threads=1, log_dir=logs, echo=lambda m: None)[run.name]
    res = sw.write_results(out, [run], {run.name: second}, warn=lambda m: None)
    assert res.rows[0]["seconds"] == round(first.seconds + second.seconds, 2)  # not round(second.seconds, 2)
    assert res.rows[0]["seconds"] >= 0.6
    assert sw.part_seconds(logs / "base_seed0.log") == [first.seconds, second.seconds]
    skipped = sw.write_results(out, [run], {run.name: sw.RunOutcome("skipped", 0)}, warn=lambda m: None)
    assert skipped.rows[0]["seconds"] == res.rows[0]["seconds"]  # not 0.0
    # the run directory does not exist (the stand-ins made none): the sweep trains it anew, from 0 s
    common = ["agent.kind=toy", "train.steps=2", "train.log_every=1", "eval.at_end=false"]
    real = sw.sweep(None, {}, [0], out, common, device="cpu", echo=lambda m: None)
    (part,) = sw.part_seconds(logs / "base_seed0.log")
    assert real.rows[0]["status"] == "ok" and real.rows[0]["seconds"] == round(part, 2)


# ------------------------------------------- --grid with a quoted value holding a comma
def test_grid_keeps_a_quoted_value_with_a_comma_whole() -> None:
    """Grid values are YAML; a quoted string is one value, yet ``--grid
    dataset.path='a,b.hdf5',c.hdf5`` gives three values ``'a``, ``b.hdf5'`` and ``c.hdf5``
    (brackets and braces are respected, quotes are not): a path or any string holding a comma
    cannot be swept."""
    from rl_tformers.runtime.sweep import parse_grid

    assert parse_grid(["dataset.path='a,b.hdf5',c.hdf5"]) == {"dataset.path": ["'a,b.hdf5'", "c.hdf5"]}
    assert parse_grid(['dataset.path="a,b.hdf5",c.hdf5']) == {"dataset.path": ['"a,b.hdf5"', "c.hdf5"]}


# ------------------------------------------- a sweep rerun cannot retry a run that failed early
def test_sweep_rerun_retries_a_run_that_failed_before_its_first_checkpoint(tmp_path: Path) -> None:
    """A run that fails before its first checkpoint (here: it diverges at update 2) leaves
    config.yaml and metrics.jsonl in its directory. Running the same sweep again takes it for
    a ``partial`` run and starts ``train --resume``, which fails at once with ``error: no
    checkpoint in .../checkpoints``: the run is never retried (sweep --help: "Running the same
    command again ... resumes unfinished ones"), and the new failure hides the real one."""
    import json

    from rl_tformers.runtime.sweep import sweep

    out = tmp_path / "sw"
    common = ["train.steps=4", "train.warmup_steps=1", "train.log_every=1", "eval.every=0", "eval.at_end=false",
              "train.checkpoint_every=0", "train.weight_decay=0"]  # lr * weight_decay < 1 is checked at compose
    kwargs = dict(jobs=1, threads=1, device="cpu", echo=lambda m: None)
    first = sweep("toy", {"train.lr": ["1e300"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in first.rows] == ["failed"]
    second = sweep("toy", {"train.lr": ["1e300"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in second.rows] == ["failed"]
    log = json.loads((out / "results.json").read_text())["failed"]["lr=1e300/seed0"]["log"]
    assert "no checkpoint" not in log, log
    assert "non-finite" in log, log


# ------------------------------------------- --grid with an unbalanced bracket or quote
@pytest.mark.parametrize("item, what", [("train.betas=[0.9,0.95", "unclosed '['"),
                                        ("dataset.path='a,b.hdf5,c.hdf5", "unclosed ' quote"),
                                        ("train.betas=0.9]", "']' closes no bracket")])
def test_grid_with_an_unbalanced_bracket_or_quote_is_refused_naming_the_key(item: str, what: str) -> None:
    """``[0.9,0.95`` is refused, naming the grid key (read as one value holding everything after
    the bracket it would give a run with a config nobody asked for, or a confusing compose error)."""
    from rl_tformers.runtime.sweep import SweepError, parse_grid

    key = item.partition("=")[0]
    with pytest.raises(SweepError) as info:
        parse_grid([item])
    assert str(info.value).startswith(f"--grid {key}: {what}"), str(info.value)
    assert parse_grid(["agent.note=it's,b"]) == {"agent.note": ["it's", "b"]}  # an apostrophe is not a quote


def _sweep(*args: str):
    return CliRunner().invoke(app, ["sweep", "-c", "toy", *args])


def test_sweep_override_without_equals_is_refused_not_a_traceback(tmp_path: Path) -> None:
    """``rl-tformers sweep ... train.steps`` (no ``=VALUE``) says what is wrong, as
    ``rl-tformers train`` does, not an IndexError traceback from check_overrides."""
    out = tmp_path / "sw"
    for item in ("train.steps", "=5"):
        res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), item)
        assert res.exit_code == 2, res.output
        assert res.output == f"error: override {item!r} is not KEY=VALUE (e.g. train.steps=1000)\n"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "hopper-medium")  # a config name without -c
    assert (res.exit_code, res.output) == (2, "error: override 'hopper-medium' is not KEY=VALUE (e.g. "
                                              "train.steps=1000); a config is given with -c: -c bc/hopper_medium "
                                              "or -c dt/hopper_medium\n")
    assert not out.exists()


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (
            "step",
            "--metric step: that is a column the sweep writes for each run, not a scalar the runs log; ",
        ),
        (
            "seed",
            "--metric seed: that is a column the sweep writes for each run, not a scalar the runs log; ",
        ),
        ("train.lr", "--metric train.lr: that is a grid key, not a scalar the runs log; "),
        ("", "--metric '' is empty; "),
    ],
)
def test_sweep_refuses_a_metric_that_no_run_logs_before_running(
    tmp_path: Path, metric: str, message: str
) -> None:
    """``--metric step`` (a metric no run logs) is refused before any run starts, not after the
    whole sweep with a warning blaming the runs ("its final value is NaN or infinite in every
    completed run ... (diverged?)"); ``--metric ''`` is refused, not taken as the default metric."""
    out = tmp_path / "sw"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "--metric", metric, "train.steps=2")
    assert res.exit_code == 2, res.output
    hint = "give a scalar the runs log, e.g. eval/return_mean or train/loss (default: the evaluation score, else "
    tail = "train/loss), or leave --metric out" if not metric else "train/loss)"
    assert res.output == f"error: {message}{hint}{tail}\n"
    assert not out.exists()


def test_sweep_refuses_grid_keys_inside_each_other() -> None:
    """``--grid train.lr=... --grid 'train={lr: ...}'`` is refused naming both keys: the later key
    would replace the earlier one's values in every run (a confusing 'the values mean the same
    once parsed', or, with other fields, a grid that is not the one asked for)."""
    from rl_tformers.runtime.sweep import SweepError, parse_grid

    with pytest.raises(SweepError) as e:
        parse_grid(["train.lr=1e-3,3e-3", "train={lr: 0.1}"])
    assert str(e.value) == (
        "--grid train.lr=... and --grid train=... set the same option (train.lr is inside train): in every "
        "run one would replace the other's value; sweep one of them"
    )
    with pytest.raises(SweepError, match=r"\(backbone.position.kind is inside backbone.position\)"):
        parse_grid(["backbone.position={kind: alibi}", "backbone.position.kind=rotary,none"])
    assert list(parse_grid(["train.lr=1e-3", "train.lr_min=1", "backbone.n_layers=1"])) == [
        "train.lr",
        "train.lr_min",
        "backbone.n_layers",
    ]  # a shared prefix that is not a dotted parent is fine


def test_sweep_refuses_run_names_longer_than_the_file_system_takes(tmp_path: Path) -> None:
    """A long grid value (a list, a dict, a long number) names run folders and logs longer than 255
    bytes: refused before running, not an ``OSError: File name too long`` traceback."""
    from rl_tformers.runtime.sweep import SweepError, expand

    out = tmp_path / "sw"
    value = "0." + "1" * 240
    res = _sweep("--grid", f"train.lr={value},0.2", "--out", str(out), "train.steps=2")
    assert res.exit_code == 2, res.output
    log = f"lr={value}_seed0.parts.jsonl"
    assert res.output == (
        f"error: --grid: the point (train.lr={value}) names its runs' files after its values, and its log "
        f"logs/{log[:60]}...{log[-17:]} would be 263 bytes long, more than the 255 bytes a file name may have "
        f"here; give shorter values (or sweep fewer keys at once)\n"
    )
    assert not out.exists()
    ok = "0." + "1" * 232  # lr=<234 characters>_seed0.parts.jsonl: 255 bytes
    assert len(expand({"train.lr": [ok]}, [0], out)) == 1
    with pytest.raises(SweepError, match="256 bytes long"):
        expand({"train.lr": [ok]}, [10], out)  # the longest seed counts


def test_sweep_out_problems_are_errors_not_tracebacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--out ""`` (an unset shell variable) is refused, not read as '.' (a sweep into the
    current folder); an --out name too long for the file system is an error line, not an OSError
    traceback."""
    monkeypatch.chdir(tmp_path)
    res = _sweep("--grid", "train.lr=1e-3", "--out", "", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert (
        res.output
        == "error: --out '' is empty; give the sweep folder (or leave --out out for runs/sweep-<time>)\n"
    )
    long = tmp_path / ("x" * 300)
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(long), "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == f"error: --out {long}: File name too long\n"
    assert list(tmp_path.iterdir()) == []


def test_sweep_refuses_gpus_per_run_that_would_be_ignored(tmp_path: Path) -> None:
    """``--gpus-per-run 1`` with the local launcher is refused (only Ray's num_gpus reads it)."""
    out = tmp_path / "sw"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "--gpus-per-run", "1", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == (
        "error: --gpus-per-run 1 is for --launcher ray (Ray's num_gpus per run); local runs take their device "
        "from --device (e.g. --device cuda, shared by the --jobs runs); drop --gpus-per-run, or add --launcher "
        "ray\n"
    )
    from rl_tformers.runtime.sweep import SweepError, sweep

    with pytest.raises(SweepError, match=r"^--gpus-per-run inf: give a finite number >= 0"):
        sweep("toy", {}, [0], out, launcher="ray", gpus_per_run=float("inf"))
    assert not out.exists()


def test_sweep_refuses_a_ray_address_with_the_local_launcher(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "--ray-address", "127.0.0.1:6379", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == ("error: --ray-address 127.0.0.1:6379 is for --launcher ray; add --launcher ray, or drop "
                          "--ray-address\n")
    assert not out.exists()


def test_sweep_warns_about_completed_runs_that_did_not_log_the_summary_metric(tmp_path: Path) -> None:
    """A grid over datasets with and without reference returns: eval/normalized_score is the
    summary's metric, but the completed runs of the point without references never log it, and
    their point read ``0/2`` seeds with no word why (as if its runs had failed). The table holds
    exactly each run's last logged values."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sw"
    runs = sw.expand({"dataset.path": ["hopper", "cartpole"]}, [0, 1], out)
    logged = {
        "path=hopper/seed0": {"eval/normalized_score": 41.5, "eval/return_mean": 1300.25},
        "path=hopper/seed1": {"eval/normalized_score": 43.5, "eval/return_mean": 1370.75},
        "path=cartpole/seed0": {"eval/return_mean": 200.0},
        "path=cartpole/seed1": {"eval/return_mean": 250.0},
    }
    for run in runs:
        run.run_dir.mkdir(parents=True)
        lines = [
            {"step": 5, "time": 1.0, "train/loss": 2.0, "eval/return_mean": -1.0},
            {"step": 10, "time": 2.0, "train/loss": 0.5, **logged[run.name]},
        ]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    warnings: list[str] = []
    outcomes = {run.name: sw.RunOutcome("ok", 0, 3.0) for run in runs}
    res = sw.write_results(out, runs, outcomes, warn=warnings.append)
    assert res.metric == "eval/normalized_score"
    assert warnings == [
        "warning: eval/normalized_score: 2 completed runs did not log it (path=cartpole/seed0, path=cartpole/seed1); "
        "their grid points count only the runs that did (the seeds column)"
    ]
    assert [(s["point"], s["n"], s["of"], s["mean"]) for s in res.summary] == [
        ("dataset.path=hopper", 2, 2, 42.5),
        ("dataset.path=cartpole", 0, 2, None),
    ]
    table = json.loads((out / "results.json").read_text())["runs"]
    for row in table:
        assert row["step"] == 10 and row["train/loss"] == 0.5 and row["seconds"] == 3.0
        assert {k: row[k] for k in logged[row["run"]]} == logged[row["run"]]
        assert ("eval/normalized_score" in row) == ("hopper" in row["run"])


runner = CliRunner()


# ------------------------------------------------------- run / sweep directory that is a file
def test_run_dir_or_sweep_out_that_is_a_file_is_a_clean_error(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("hi\n")
    for run_dir, where in ((afile, f"{afile} is a file"), (afile / "sub", f"{afile} (a folder above it) is a file")):
        r = runner.invoke(app, ["train", "-c", "toy", "--run-dir", str(run_dir), "train.steps=2", "--device", "cpu"])
        assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
        assert f"error: --run-dir {run_dir}: {where}; pick another --run-dir" in r.output
    r = runner.invoke(app, ["sweep", "-c", "toy", "--out", str(afile), "train.steps=2", "--device", "cpu"])
    assert r.exit_code == 2 and f"error: --out {afile}: {afile} is a file" in r.output, r.output
    assert afile.read_text() == "hi\n"


@pytest.mark.parametrize("text, says", [
    ("99999999999999999999", "seed 99999999999999999999 is out of range"),
    ("1-0", "the range 1-0 is reversed"),
    ("0,,1", "an empty item"),
    ("0,1,", "an empty item"),
    ("-1", "seed -1 is out of range"),
    ("0-5000", "at most 1000"),
])
def test_sweep_seeds_are_checked(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(sw.SweepError, match=says):
        sw.parse_seeds(text)
    r = runner.invoke(app, ["sweep", "-c", "toy", "--seeds", text, "--out", str(tmp_path / "sw"), "train.steps=2"])
    assert r.exit_code == 2 and says in r.output and not (tmp_path / "sw").exists()
    assert sw.parse_seeds(f"{2**64 - 1}") == [2**64 - 1] and sw.parse_seeds(" 0-2, 7") == [0, 1, 2, 7]


def test_sweep_grid_with_an_empty_value_is_refused() -> None:
    from rl_tformers.runtime.sweep import SweepError, parse_grid

    for item in ("train.lr=1e-3,,3e-3", "train.lr=1e-3,"):
        with pytest.raises(SweepError, match="empty value"):
            parse_grid([item])
    assert parse_grid(["agent.hidden=[64,64],[32]"]) == {"agent.hidden": ["[64,64]", "[32]"]}


TOY = ["agent.kind=toy", "train.steps=2", "train.batch_size=4", "eval.every=0"]


# ------------------------------------------------ the summary averaged runs that did not finish
def test_sweep_summary_counts_only_completed_runs(tmp_path: Path) -> None:
    runs = sw.expand({"train.lr": ["1e-3"]}, [0, 1, 2, 3], tmp_path)
    values = [1.0, 2.0, 50.0, 70.0]  # seeds 2 and 3: intermediate evaluations of unfinished runs
    for run, v in zip(runs, values):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "eval/return": v}) + "\n")
    statuses = ["ok", "skipped", "stopped", "failed"]
    outcomes = {r.name: sw.RunOutcome(s, 0) for r, s in zip(runs, statuses)}
    res = sw.write_results(tmp_path, runs, outcomes, warn=tripwire)
    (s,) = res.summary
    assert (s["n"], s["of"], s["mean"], s["std"]) == (2, 4, 1.5, pytest.approx(0.7071067811865476))
    assert "| train.lr=1e-3 | 1.5 | 0.7071 | 2/4 |" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["n"] == 2
    assert [r["eval/return"] for r in res.rows] == values  # every row keeps its own last values

    warned: list[str] = []
    outcomes = {r.name: sw.RunOutcome("stopped", 130) for r in runs}
    res = sw.write_results(tmp_path, runs, outcomes, warn=warned.append)
    assert res.summary[0]["mean"] is None and res.summary[0]["n"] == 0
    assert warned == ["warning: eval/return: only runs that did not complete logged it; the summary and plot "
                      "count completed runs only"]
    assert not (tmp_path / "results.png").exists()


# ------------------------------------------- two spellings of one value trained the same config
@pytest.mark.parametrize("grid", [{"train.lr": ["1e-3", "0.001"]}, {"backbone.n_layers": ["1", "+1"]}])
def test_sweep_refuses_grid_values_with_the_same_config(tmp_path: Path, grid: dict) -> None:
    a, b = (f"{k}={v}" for k in grid for v in grid[k])
    with pytest.raises(sw.SweepError, match=re.escape(f"the points ({a}) and ({b}) give the same config")):
        sw.sweep(None, grid, [0, 1], tmp_path / "s", TOY, echo=tripwire)
    assert not (tmp_path / "s").exists()


# --------------------------------------------- overrides the sweep replaced without a word
@pytest.mark.parametrize(("grid", "override", "says"), [
    ({}, "seed=5", "override 'seed=5': the sweep sets each run's seed from --seeds"),
    ({}, "run_dir=elsewhere", "override 'run_dir=elsewhere': the sweep puts each run in OUT/<point>/seed<k>"),
    ({"train.lr": ["1e-3", "2e-3"]}, "train.lr=0.1", "override 'train.lr=0.1' and --grid train.lr=... set the same"),
    ({"train.lr": ["1e-3", "2e-3"]}, "train.lr=1e-3", "override 'train.lr=1e-3' and --grid train.lr=... set the same"),
    ({"backbone.position.kind": ["rotary", "learned"]}, "backbone.position={kind: alibi}",
     "override 'backbone.position={kind: alibi}' and --grid backbone.position.kind=... set the same"),
])
def test_sweep_refuses_an_override_each_run_would_replace(tmp_path: Path, grid: dict, override: str,
                                                          says: str) -> None:
    r = runner.invoke(app, ["sweep", "--out", str(tmp_path / "s"), *[f"--grid={k}={','.join(v)}" for k, v in
                                                                    grid.items()], "--seeds", "0,1", *TOY, override])
    assert r.exit_code == 2 and f"error: {says}" in r.output, r.output
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------- two sweeps trained in one folder at once
def test_a_second_sweep_in_the_same_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "s"
    monkeypatch.setattr(sw, "run_local", tripwire)
    with sw._SweepLock(out):  # the first sweep, running
        with pytest.raises(sw.SweepError, match=rf"--out {out}: another sweep \(pid \d+\) is running in this folder"):
            sw.sweep(None, {}, [0], out, TOY, echo=tripwire)
        assert sorted(p.name for p in out.iterdir()) == [".sweep.lock"]  # nothing started
    assert not out.exists()  # the first one created the folder and wrote nothing: removed
    # once the first sweep is gone, the second proceeds (here: up to the runs, which are stubbed out)
    monkeypatch.setattr(sw, "run_local", lambda todo, *a, **k: {run.name: sw.RunOutcome("ok", 0) for run, _ in todo})
    res = sw.sweep(None, {}, [0], out, TOY, echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["ok"] and (out / "results.csv").is_file()


def test_sweep_prints_the_runs_config_warnings_and_one_seed_has_no_std(tmp_path: Path) -> None:
    """A sweep whose train.steps is below the shipped warm-up trains nothing useful: the
    trainer's warning reaches the console, not only OUT/logs/<run>.log. A single seed's std is
    none (not 0, a measured zero spread). A rerun of a stopped run keeps its log's first part."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sweep"
    common = ["agent.kind=toy", "train.steps=6", "train.warmup_steps=50", "train.log_every=3",
              "train.checkpoint_every=0", "eval.at_end=true"]
    messages: list[str] = []
    res = sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0], out, common, jobs=1, threads=1,
                   device="cpu", echo=messages.append)
    warns = [m for m in messages if m.startswith("warning: train.warmup_steps=50 >= train.steps=6")]
    assert len(warns) == 1 and warns[0].endswith("(every run)"), messages
    assert [s["std"] for s in res.summary] == [None, None]
    assert "| backbone.n_layers=1 |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["summary"][0]["std"] is None
    # the log of a run is appended to, not replaced, when the sweep runs it again
    log = out / "logs" / f"{sw._slug('n_layers=1/seed0')}.log"
    first = log.read_text()
    assert first.startswith("$ ")
    import shutil

    shutil.rmtree(out / "n_layers=1" / "seed0")
    sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0], out, common, jobs=1, threads=1, device="cpu",
             echo=messages.append)
    assert log.read_text().startswith(first) and log.read_text().count("$ ") == 2


TINY_DT_SWEEP = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.log_every=1",
           "train.checkpoint_every=0", "eval.at_end=false", "backbone.d_model=16", "backbone.n_layers=1",
           "agent.context_len=4"]


def _write_cartpole_30(path: Path, n: int = 30) -> Path:
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


# ------------------------------------------------------------------ bad grid points, all at once
def test_sweep_names_every_bad_grid_point_before_any_run_starts(tmp_path: Path) -> None:
    """The user's grid: a kernel without a causal form (refused by the backbone check when the
    config is composed) and ``backbone.causal=false`` under the DT's causal mode (refused by the
    DT when it is built). The sweep names both before any run starts (not only the first point
    that does not compose, with the sdpa/causal=false point left to fail in its run)."""
    data = _write_cartpole_30(tmp_path / "d.hdf5")
    out = tmp_path / "sweep"
    with pytest.raises(sw.SweepError) as err:
        sw.sweep("dt/cartpole_demo", {"backbone.attention.kind": ["sdpa", "linformer"],
                                      "backbone.causal": ["true", "false"]},
                 [0], out, [f"dataset.path={data}", *TINY_DT_SWEEP], device="cpu", echo=lambda m: None)
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
    and one point whose dataset does not exist: the command exits with status 2 before starting
    anything, naming both points (not: the good point trains and the two others fail in their
    runs with exit status 1)."""
    data = _write_cartpole_30(tmp_path / "d.hdf5")
    missing = tmp_path / "missing.hdf5"
    out = tmp_path / "sweep"
    r = runner.invoke(app, ["sweep", "-c", "dt/cartpole_demo", "--grid", "backbone.causal=true,false",
                            "--grid", f"dataset.path={data},{missing}", "--seeds", "0,1", "--out", str(out),
                            "--device", "cpu", *TINY_DT_SWEEP])
    assert r.exit_code == 2, r.output
    assert "error: 3 of 4 grid points cannot run; nothing was started:" in r.output
    assert f"/seed* (backbone.causal=true, dataset.path={missing}): dataset.path: no such HDF5 file: {missing}\n" in r.output
    assert (f"/seed* (backbone.causal=false, dataset.path={data}): agent.mode=causal needs backbone.causal=true"
            in r.output)
    assert f"/seed* (backbone.causal=false, dataset.path={missing}): dataset.path: no such HDF5 file: {missing}\n" in r.output
    assert f"(backbone.causal=true, dataset.path={data}):" not in r.output
    assert not out.exists()


def test_agents_are_built_only_for_points_with_a_run_to_do(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent check runs once per grid point (not per seed), and not at all when every run of
    the sweep is complete (a rerun that only writes the results builds nothing)."""
    built: list[int] = []
    real = sw.check_agent
    monkeypatch.setattr(sw, "check_agent", lambda cfg, *a, **k: (built.append(int(cfg.seed)), real(cfg))[1])
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


# ------------------------------------------------------------------------- run folder names
def test_run_folders_name_keys_by_their_shortest_distinct_suffix(tmp_path: Path) -> None:
    names = [r.name for r in sw.expand({"backbone.attention.kind": ["sdpa"], "backbone.position.kind": ["none"]},
                                       [0], tmp_path)]
    assert names == ["attention.kind=sdpa__position.kind=none/seed0"]  # not backbone.attention.kind=...
    assert [r.name for r in sw.expand({"backbone.attention.kind": ["sdpa"]}, [0], tmp_path)] == ["kind=sdpa/seed0"]
    assert sw.short_keys(["x.a.kind", "y.a.kind", "train.lr"]) == {"x.a.kind": "x.a.kind", "y.a.kind": "y.a.kind",
                                                                   "train.lr": "lr"}


# ------------------------------------------------------------------------------- --seed range
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


def test_sweep_precheck_builds_only_points_with_a_run_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_tformers.runtime.sweep as sw

    out = tmp_path / "sw"
    common = ["train.steps=4", "train.warmup_steps=1", "train.log_every=1", "eval.every=0", "eval.at_end=false",
              "train.checkpoint_every=2"]
    kwargs = dict(jobs=1, threads=1, device="cpu", echo=lambda m: None)
    first = sw.sweep("toy", {"train.lr": ["1e-3"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in first.rows] == ["ok"]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and p.name != "logs"]
    ckpts = sorted((run_dir / "seed0" / "checkpoints").glob("step_*.pt"))
    assert [c.name for c in ckpts] == ["step_000000002.pt", "step_000000004.pt"]
    ckpts[-1].unlink()  # as if stopped after update 2
    assert sw.run_state(run_dir / "seed0") == "partial"

    checked: list[dict] = []
    real = sw.check_points

    def recording(points):
        checked.append(dict(points))
        return real(points)

    monkeypatch.setattr(sw, "check_points", recording)
    second = sw.sweep("toy", {"train.lr": ["1e-3"]}, [0], out, common, **kwargs)  # to resume
    assert [r["status"] for r in second.rows] == ["ok"]
    assert checked in ([], [{}])  # nothing built: each --resume rebuilds its run from its checkpoint
    assert sw.run_state(run_dir / "seed0") == "complete"


TOY_4_STEPS = ["agent.kind=toy", "train.steps=4", "train.batch_size=4", "backbone.n_layers=1", "train.log_every=2",
       "train.checkpoint_every=0", "train.warmup_steps=1", "eval.every=0"]


def _train_as_sweep_would(run: sw.SweepRun) -> None:
    """Train ``run`` in this process with exactly the config the sweep would give it."""
    train(compose(None, [*run.overrides, "device=cpu", "train.progress=false"]), run.run_dir)


# ------------------------------------------------------------------- 1, 5: sweep rerun rules
def test_sweep_rerun_with_another_config_is_refused_naming_run_and_keys(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    grid = {"backbone.n_layers": ["1"]}
    run = sw.expand(grid, [0], out, [*TOY_4_STEPS, "eval.at_end=false"])[0]
    _train_as_sweep_would(run)
    res = sw.sweep(None, grid, [0], out, [*TOY_4_STEPS, "eval.at_end=false"], device="cpu", echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["skipped"]  # the same config: complete, skipped
    with pytest.raises(sw.SweepError) as info:
        sw.sweep(None, grid, [0], out, [*TOY_4_STEPS, "eval.at_end=false", "train.steps=6"], device="cpu",
                 echo=lambda m: None)
    msg = str(info.value)
    assert f"{run.run_dir} holds a complete run with another config" in msg
    assert "train.steps: 4 (stored) -> 6 (requested)" in msg


def test_sweep_resumes_an_unfinished_run_only_with_its_own_config(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    run = sw.expand({}, [0], out, [*TOY_4_STEPS, "eval.at_end=false", "train.steps=8"])[0]
    train(compose(None, [*run.overrides, "device=cpu", "train.progress=false"]), run.run_dir, stop_at=4)
    assert sw.run_state(run.run_dir) == "partial"
    with pytest.raises(sw.SweepError, match=r"holds a partial run with another config:\n    train.lr: "):
        sw.sweep(None, {}, [0], out, [*TOY_4_STEPS, "eval.at_end=false", "train.steps=8", "train.lr=0.01"], device="cpu",
                 echo=lambda m: None)
    assert sw.train_command(run, None, "partial", "cpu")[4:] == [
        "--resume", str(run.run_dir), "device=cpu", "train.progress=false"]


def test_sweep_resumes_a_run_with_plugins_naming_them_to_the_resume(tmp_path: Path, monkeypatch) -> None:
    """A resumed run imports only the plugins named on its command line: the sweep names its
    config's plugins with --plugin, so its unfinished run resumes and completes."""
    mods = tmp_path / "mods"
    mods.mkdir()
    name = "sweep_resume_plugin_x"
    (mods / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "sweep"
    over = [*TOY_4_STEPS, "eval.at_end=false", "train.steps=8", f"plugins=[{name}]"]
    run = sw.expand({}, [0], out, over)[0]
    try:
        train(compose(None, [*run.overrides, "device=cpu", "train.progress=false"]), run.run_dir, stop_at=4)
        assert sw.train_command(run, None, "partial", "cpu", plugins=[name])[4:] == [
            "--resume", str(run.run_dir), "--plugin", name, "device=cpu", "train.progress=false"]
        sys.modules.pop(name)  # the resume's own process imports it, named
        res = sw.sweep(None, {}, [0], out, over, device="cpu", echo=lambda m: None)
    finally:
        sys.modules.pop(name, None)
    assert [r["status"] for r in res.rows] == ["ok"] and sw.run_state(run.run_dir) == "complete"


def test_sweep_run_without_its_final_evaluation_is_not_complete(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime import toy

    out = tmp_path / "sweep"
    run = sw.expand({}, [0], out, [*TOY_4_STEPS, "eval.at_end=true"])[0]

    def boom(self, step):
        raise RuntimeError("evaluation environment broke")

    monkeypatch.setattr(toy.ToyAgent, "evaluate", boom)
    with pytest.raises(RuntimeError, match="evaluation environment broke"):
        _train_as_sweep_would(run)
    assert sw.run_state(run.run_dir) == "unevaluated"
    lines: list[str] = []
    res = sw.sweep(None, {}, [0], out, [*TOY_4_STEPS, "eval.at_end=true"], device="cpu", echo=lines.append)
    assert [r["status"] for r in res.rows] == ["incomplete"]
    assert any(ln.startswith("incomplete base/seed0") and "has no final evaluation" in ln for ln in lines)
    assert not any("skipped" in ln for ln in lines)
    assert any("no run logged an evaluation metric" in ln for ln in lines)


# ------------------------------------------------------------------- 8, 11 and grid validation
def test_sweep_refuses_grid_values_that_share_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match="map to the same run directory 'betas=_0.9_0.95' \\(a duplicate value"):
        sw.expand(sw.parse_grid(["train.betas=[0.9,0.95],[0.9, 0.95]"]), [0], tmp_path)
    with pytest.raises(sw.SweepError, match="value '1e-3' is given twice"):
        sw.parse_grid(["train.lr=1e-3,1e-3"])


def test_sweep_checks_every_grid_point_before_starting(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match=r"n_layrs=1/seed0 .*did you mean backbone.n_layers"):
        sw.sweep(None, {"backbone.n_layrs": ["1"]}, [0], tmp_path / "s", TOY_4_STEPS, echo=lambda m: None)
    assert not (tmp_path / "s").exists()


def test_sweep_results_metric_warnings_and_stale_plot(tmp_path: Path) -> None:
    runs = sw.expand({"train.lr": ["1e-3", "3e-3"]}, [0], tmp_path)
    for i, run in enumerate(runs):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "train/loss": 1.0 + i}) + "\n")
    outcomes = {r.name: sw.RunOutcome("ok", 0) for r in runs}
    warned: list[str] = []
    res = sw.write_results(tmp_path, runs, outcomes, warn=warned.append)
    assert res.metric == "train/loss" and (tmp_path / "results.png").is_file()
    assert warned == ["warning: no run logged an evaluation metric (eval.at_end=false, eval.every=0, or the "
                      "evaluations failed); the summary and plot use train/loss"]
    header = next(ln for ln in (tmp_path / "results.md").read_text().splitlines() if ln.startswith("| run |"))
    assert header == "| run | seed | status | step | seconds | train/loss |"
    warned.clear()
    res = sw.write_results(tmp_path, runs, outcomes, metric="eval/nonexistent", warn=warned.append)
    assert warned == ["warning: --metric eval/nonexistent: no run logged it (logged: train/loss); "
                      "no summary values and no plot"]
    assert not (tmp_path / "results.png").exists()
    assert str(tmp_path / "results.png") not in res.files


# ------------------------------------------------------------------- signals reach the runs
_CHILD = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def handler(signum, frame):
    out.write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
pathlib.Path(sys.argv[2]).write_text("ready")
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sweep_forwards_sigterm_and_sighup_to_its_runs(tmp_path: Path, sig: int) -> None:
    runs = sw.expand({"train.lr": ["1", "2"]}, [0], tmp_path)
    cmds = [(r, [sys.executable, "-c", _CHILD, str(tmp_path / f"got{i}"), str(tmp_path / f"ready{i}")])
            for i, r in enumerate(runs)]

    def kill_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    outcomes = sw.run_local(cmds, jobs=1, threads=1, log_dir=tmp_path / "logs", echo=lambda m: None)
    killer.join()
    assert sw.stop_signal() == sig
    assert (tmp_path / "got0").read_text() == str(int(signal.SIGTERM))  # SIGHUP arrives as SIGTERM
    assert outcomes[runs[0].name].status == "stopped" and outcomes[runs[0].name].returncode == 143
    assert outcomes[runs[1].name].status == "not run" and not (tmp_path / "ready1").exists()
    assert signal.getsignal(sig) is not None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sweep_markdown_escapes_a_pipe_in_a_grid_value():
    from rl_tformers.runtime.sweep import markdown

    rows = [{"run": "k=a|b/seed0", "seed": 0, "status": "ok", "step": 5, "seconds": 1.0, "train/loss": 0.5}]
    summary = [{"point": "k=a|b", "mean": 0.5, "std": 0.0, "n": 1, "of": 1}]
    text = markdown(rows, summary, "train/loss")
    assert "| k=a\\|b | 0.5 | 0 | 1/1 |" in text
    assert "| k=a\\|b/seed0 | 0 | ok | 5 | 1 | 0.5 |" in text
    assert all(line.count("|") - line.count("\\|") == 5 for line in text.splitlines()[2:4])


def test_sweep_default_threads_keep_the_users_omp_num_threads():
    import os

    from rl_tformers.runtime.sweep import default_threads

    assert default_threads(2, {"OMP_NUM_THREADS": "1"}) == 1
    assert default_threads(1, {"OMP_NUM_THREADS": " 3 "}) == 3
    cores = os.cpu_count() or 1
    for bad in ({}, {"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "x"}):
        assert default_threads(2, bad) == max(1, cores // 2)


def test_a_local_sweep_prints_progress_while_its_runs_go(tmp_path: Path) -> None:
    """A progress line every 10 s of the (fake) clock while runs go, naming each running run's
    last logged step, then one line per run as it ends. The clock moves only once the first run
    has logged its step, and stops at 125 s, when the runs are let finish."""
    runs = sw.expand({"x": ["1", "2"]}, [0], tmp_path)
    go = tmp_path / "go"
    child = ("import json, pathlib, sys, time\n"
             "d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)\n"
             "(d / 'metrics.jsonl').write_text(json.dumps({'step': 7}) + '\\n')\n"
             "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)\n")
    cmds = [(r, [sys.executable, "-c", child, str(r.run_dir), str(go)]) for r in runs]

    class Clock:
        t = 100.0

        def __call__(self) -> float:
            if self.t < 125 and (runs[0].run_dir / "metrics.jsonl").exists():
                self.t += 1
            if self.t >= 125:
                go.touch()
            return self.t

    said: list[str] = []
    out = sw.run_local(cmds, jobs=1, threads=1, log_dir=tmp_path / "logs", echo=said.append, clock=Clock(),
                       poll_s=0.01)
    assert [o.status for o in out.values()] == ["ok", "ok"]
    assert said[:2] == [f"sweep: 0/2 runs (0%), elapsed {s}s, running: {runs[0].name} at step 7" for s in (10, 20)]
    assert [ln.split(" (")[0] for ln in said[2:]] == [f"ok      {runs[0].name}", f"ok      {runs[1].name}"]


def test_a_stored_run_without_a_newer_option_is_the_same_config() -> None:
    """A run stored before an option existed matches a request that leaves the option at its
    default, and differs from one that sets it to something else."""
    from rl_tformers.runtime.run_config import to_container

    requested = to_container(compose(None, ["agent.kind=toy"]))
    stored = to_container(compose(None, ["agent.kind=toy"]))
    del stored["train"]["amp"]
    assert sw.config_differences(stored, requested) == []
    other = to_container(compose(None, ["agent.kind=toy", "train.amp=bf16"]))
    assert sw.config_differences(stored, other) == ["train.amp: none (stored) -> bf16 (requested)"]


def test_sweep_refuses_a_ray_address_where_nothing_listens_before_starting_ray(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "sw"
    res = _sweep("--out", str(out), "--launcher", "ray", "--ray-address", f"127.0.0.1:{port}", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --ray-address 127.0.0.1:{port}: nothing answers there within 10 s (")
    assert res.output.endswith(f"); start the cluster's head (ray start --head --port {port}) or give its address\n")
    assert res.output.count("\n") == 1 and not out.exists()


@pytest.mark.parametrize("address", ["notaport", "127.0.0.1:99999", "127.0.0.1:", ":6379", "10.0.0.1:63a"])
def test_sweep_refuses_a_ray_address_that_is_not_host_and_port_before_starting_ray(tmp_path: Path,
                                                                                  address: str) -> None:
    out = tmp_path / "sw"
    res = _sweep("--out", str(out), "--launcher", "ray", "--ray-address", address, "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: --ray-address {address!r}: give the cluster head as HOST:PORT (e.g. "
                          "10.0.0.1:6379, the port from 1 to 65535), ray://HOST:PORT, or auto\n")
    assert not out.exists()
