"""rl-tformers collect / dataset (rl_tformers.cli.data): dataset ids, roots, help."""

from __future__ import annotations

import io
import logging
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def test_a_missing_minari_id_names_the_options_that_point_at_an_existing_root(tmp_path: Path, monkeypatch) -> None:
    """The error for an id that is not in the data root names the knobs of both roots, not only
    how to build or download it: a user whose datasets already exist in another folder (another
    clone's data/minari) needs `dataset.root=`."""
    from rl_tformers.envs.loaders import load_minari

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as exc:
        load_minari("rlt/hopper-v5/medium-v0", root=tmp_path / "root")
    msg = str(exc.value)
    assert (f"not found in the data root {tmp_path / 'root'} (dataset.root=DIR for train/sweep, --root DIR for "
            f"collect/dataset, else $RL_TFORMERS_DATA) nor in Minari's root {tmp_path / 'minari_home'} "
            f"($MINARI_DATASETS_PATH)") in msg
    assert "rl-tformers collect --recipe hopper-medium" in msg  # building it is still offered


def test_collect_writes_to_minaris_own_root_by_default(tmp_path: Path, monkeypatch) -> None:
    """Without --root (and $RL_TFORMERS_DATA) a dataset goes where Minari keeps its datasets
    ($MINARI_DATASETS_PATH), not under the current folder, and Minari lists it; --root still
    names another folder."""
    import minari

    home = tmp_path / "minari_home"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(home))
    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--episodes", "2", "--dataset-id", "test/cp-v0",
                            "--no-progress"])
    assert r.exit_code == 0, r.output
    assert (home / "test" / "cp-v0" / "data" / "metadata.json").is_file()
    assert not (tmp_path / "work" / "data").exists()
    assert "test/cp-v0" in minari.list_local_datasets()
    r = runner.invoke(app, ["dataset", "info", "test/cp-v0", "--json"])
    assert r.exit_code == 0 and '"episodes": 2' in r.stdout, r.output
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--episodes", "1", "--dataset-id", "test/cp-v0",
                            "--root", str(tmp_path / "mine"), "--no-progress"])
    assert r.exit_code == 0 and (tmp_path / "mine" / "test" / "cp-v0" / "data" / "metadata.json").is_file()


def test_a_missing_id_names_minaris_root_once_when_it_is_the_data_root(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.envs.loaders import load_minari

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as exc:
        load_minari("test/none-v0")
    assert str(exc.value).startswith(
        f"Minari dataset 'test/none-v0' not found in Minari's root {tmp_path / 'minari_home'} ($MINARI_DATASETS_PATH; "
        "another data root: dataset.root=DIR for train/sweep, --root DIR for collect/dataset, else $RL_TFORMERS_DATA)")


def _cartpole_minari(root: Path) -> None:
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--policy", "random", "--episodes", "8",
                            "--dataset-id", "test/cartpole-v0", "--root", str(root), "--no-progress"])
    assert r.exit_code == 0, r.output


def test_resuming_a_minari_id_run_without_its_root_says_to_pass_dataset_root(tmp_path: Path, monkeypatch) -> None:
    """A run trained on a Minari id found through $MINARI_DATASETS_PATH, resumed without it, is
    told to pass the data root (dataset.root=, which resume accepts), not an absolute path (an id
    is no path); that override resumes the run."""
    root = tmp_path / "minari"
    _cartpole_minari(root)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RL_TFORMERS_DATA", raising=False)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", "dataset.path=test/cartpole-v0", "train.steps=1",
                            "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3",
                            "eval.at_end=false", "train.progress=false", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "elsewhere"))
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=2"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert (f"the run's dataset.path=test/cartpole-v0 is read as a Minari id from the data root {tmp_path / 'elsewhere'}, "
            "then from Minari's root: name the data root that holds it, e.g. --resume RUN dataset.root=/abs/data/root"
            ) in out, out
    assert "is relative and is read from the current folder" not in out
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=2", f"dataset.root={root}"])
    assert r.exit_code == 0, r.output


def test_the_hint_for_a_relative_hdf5_path_is_unchanged() -> None:
    """The Minari-id hint does not replace the one for a relative .hdf5 file."""
    from omegaconf import OmegaConf

    from rl_tformers.runtime.trainer import _relative_data_hint

    hint = _relative_data_hint(OmegaConf.create({"dataset": {"path": "no/such/cp.hdf5", "root": None}}))
    assert "dataset.path=no/such/cp.hdf5 is relative and is read from the current folder" in hint
    assert _relative_data_hint(OmegaConf.create({"dataset": {"path": "/abs/cp.hdf5", "root": None}})) == ""


def test_a_stopped_run_ends_its_output_with_the_continue_line(tmp_path: Path, monkeypatch) -> None:
    """After a SIGINT during `rl-tformers train` the last line is "stopped at step 199 by SIGINT;
    ...; continue with: ...": the progress report is closed before the stop is announced (no
    progress line such as `train: 199/300 steps (66%), ..., about 17s left` after it)."""
    from rl_tformers.runtime import trainer as trainer_mod
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import GracefulInterrupt, Trainer

    run = tmp_path / "run"
    cfg = compose(None, ["agent.kind=toy", "device=cpu", "train.progress=true", "train.steps=20",
                         "train.batch_size=4", "train.log_every=2", "train.checkpoint_every=100",
                         "eval.at_end=false", f"run_dir={run}"])
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = logging.StreamHandler(err)
    log = logging.getLogger("rl_tformers")
    log.addHandler(handler)
    before = log.level
    log.setLevel(logging.INFO)
    try:
        trainer = Trainer(trainer_mod._with_run_dir(cfg, run), run)
        stop = GracefulInterrupt(announce=True)
        loss, calls = trainer.agent.loss, {"n": 0}

        def loss_then_stop(batch):
            calls["n"] += 1
            if calls["n"] == 5:
                stop.signum = signal.SIGINT  # what the handler sets on a first Ctrl-C
            return loss(batch)

        trainer.agent.loss = loss_then_stop
        with stop:
            result = trainer.fit(interrupt=stop)
    finally:
        log.removeHandler(handler)
        log.setLevel(before)
    assert result.interrupted == signal.SIGINT and result.step == 5
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    assert any(x.startswith("train: 5/20 steps") for x in lines), lines
    assert lines[-1].startswith("stopped at step 5 by SIGINT; checkpoint "), lines
    assert lines[-1].endswith(f"continue with: rl-tformers train --resume {run}"), lines


def test_collect_help_gives_the_policies_default_the_readme_gives() -> None:
    """`collect --help` gives the --policies default the command uses: $RL_TFORMERS_POLICIES, then
    $RL_TFORMERS_SHARED, then ../shared/policies (README, `policies_dir`)."""
    import inspect

    from rl_tformers.cli.data import collect

    text = inspect.signature(collect).parameters["policies"].default.help
    assert "$RL_TFORMERS_POLICIES" in text and "policies/ in $RL_TFORMERS_SHARED" in text and "../shared/policies" in text
    r = runner.invoke(app, ["collect", "--help"], terminal_width=80)  # no name cut to "$RL_TFORMERS_POLICIE…"
    assert "$RL_TFORMERS_POLICIES" in r.output and "$RL_TFORMERS_SHARED" in r.output, r.output


@pytest.mark.filterwarnings("ignore:.*(eval_env|env_spec).*:UserWarning")  # a dataset without an environment
@pytest.mark.parametrize("damage", ["object header", "compressed chunk", "minari episode"])
def test_dataset_info_of_a_damaged_file_is_one_error_line_and_exit_2(tmp_path: Path, damage: str) -> None:
    import minari
    from minari.data_collector import EpisodeBuffer
    from rl_tformers.envs.loaders import minari_root

    from tests.datafiles import corrupt_chunk, flip_object_header, write_compressed_copy, write_d4rl_h5

    if damage == "minari episode":
        import gymnasium as gym
        import numpy as np

        bufs = [EpisodeBuffer(id=i, observations=np.zeros((4, 2)), actions=np.zeros((3, 1), np.float32),
                              rewards=[1.0] * 3, terminations=[False, False, True], truncations=[False] * 3)
                for i in range(3)]
        with minari_root(tmp_path):
            md = minari.create_dataset_from_buffers(
                "test/info-v0", bufs, observation_space=gym.spaces.Box(-1, 1, (2,)),
                action_space=gym.spaces.Box(-1, 1, (1,)), algorithm_name="t", author="t", author_email="t",
                code_permalink="t", description="t")
        target = md.spec.data_path
        path = flip_object_header(Path(target) / "main_data.hdf5", "episode_2/observations")
        field, reason, tail = ("observations", "KeyError: Unable to synchronously open object (bad object header "
                               "version number)", " (episode 2)")
    elif damage == "object header":
        target = path = flip_object_header(write_d4rl_h5(tmp_path / "d.hdf5", n=300), "actions")
        field, reason, tail = "actions", ("KeyError: Unable to synchronously open object (bad object header "
                                          "version number)"), ""
    else:
        target = path = corrupt_chunk(write_compressed_copy(write_d4rl_h5(tmp_path / "p.hdf5", n=3000),
                                                            tmp_path / "gz.hdf5"), "rewards", 3)
        field, reason, tail = "rewards", ("OSError: Can't synchronously read data (filter returned failure during "
                                          "read)"), ""
    res = CliRunner().invoke(app, ["dataset", "info", str(target)])
    assert res.exit_code == 2 and (res.exception is None or isinstance(res.exception, SystemExit))
    assert res.output.strip().splitlines() == [
        f"error: {path}: cannot read {field!r}: the file is damaged ({reason}); re-create or re-download it{tail}"]


# ------------------------------------------------------------------- collect --memory-task
def test_collect_memory_task_writes_the_scripted_dataset_the_configs_train_on(tmp_path: Path) -> None:
    """`collect --memory-task recall --delay D` writes the same episodes as
    memory_tasks.scripted_dataset (the data of configs/memory/*), readable by every agent."""
    import numpy as np
    from rl_tformers.envs.loaders import load_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    out = tmp_path / "memory" / "recall-d4.hdf5"
    r = runner.invoke(app, ["collect", "--memory-task", "recall", "--delay", "4", "--episodes", "6", "--seed", "3",
                            "--hdf5", str(out)])
    assert r.exit_code == 0, r.output
    ds, ref = load_d4rl_hdf5(out), scripted_dataset("recall", 6, epsilon=0.2, seed=3, delay=4)
    assert (ds.num_episodes, ds.num_steps) == (6, 6 * 36)
    assert np.array_equal(ds.actions, ref.actions) and np.array_equal(ds.rewards, ref.rewards)
    assert ds.metadata.env_id == "rl_tformers.envs.memory_tasks:rl_tformers/Recall-d4-v0"
    assert r.stdout.startswith("Recall-d4-v0-scripted: 6 episodes, 216 steps, return ") and str(out) in r.stdout
    again = runner.invoke(app, ["collect", "--memory-task", "recall", "--delay", "4", "--episodes", "6",
                                "--hdf5", str(out)])
    assert (again.exit_code, again.stderr) == (2, f"error: --hdf5 {out} already exists; pass overwrite=True (CLI: "
                                                  f"--overwrite) to replace it, or choose another file\n")


@pytest.mark.parametrize(("args", "error"), [
    (["--memory-task", "pong", "--hdf5", "x.hdf5"], "--memory-task 'pong' is not a memory task; choose recall or cartpole"),
    (["--delay", "8", "--hdf5", "x.hdf5"], "--delay needs --memory-task recall"),
    (["--memory-task", "recall", "--delay", "3", "--hdf5", "x.hdf5"],
     "--delay 3: the recall task is registered with d in 1, 2, 4, 8, 16, 32, 64"),
    (["--memory-task", "cartpole", "--delay", "8", "--hdf5", "x.hdf5"],
     "--delay is the recall task's; --memory-task cartpole has none"),
    (["--memory-task", "recall"], "--memory-task writes one D4RL-layout file: give it with --hdf5 FILE (e.g. --hdf5 "
                                  "data/memory/recall-d8.hdf5)"),
    (["--memory-task", "recall", "--episodes", "0", "--hdf5", "x.hdf5"], "--episodes must be >= 1, got 0"),
    (["--memory-task", "recall", "--epsilon", "1.5", "--hdf5", "x.hdf5"],
     "--epsilon must be a probability in [0, 1], got 1.5"),
    (["--memory-task", "recall", "--env", "CartPole-v1", "--noise", "0.1", "--hdf5", "x.hdf5"],
     "--env, --noise: not used with --memory-task (it writes the scripted behaviour's episodes to --hdf5 FILE; its "
     "options are --episodes, --epsilon, --seed, --delay for recall and --overwrite)"),
])
def test_collect_memory_task_refuses_bad_options_in_one_line(tmp_path: Path, monkeypatch, args, error) -> None:
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["collect", *args])
    assert (r.exit_code, r.stderr) == (2, f"error: {error}\n")
    assert list(tmp_path.iterdir()) == []


def test_collect_knows_the_registered_recall_delays() -> None:
    from rl_tformers.envs import memory_tasks

    from rl_tformers.cli.data import RECALL_DELAYS

    assert RECALL_DELAYS == memory_tasks.RECALL_DELAYS
