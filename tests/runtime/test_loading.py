"""Loading a run for evaluation never runs code the run holds: a module its ``plugins`` list is
imported only when named (``--plugin``, ``load_run(plugins=...)``) and never from the current
directory; a checkpoint holding a pickled object is refused before anything is unpickled."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rl_tformers.cli import app
from rl_tformers.runtime.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.loading import load_run
from tests.runs import assert_clean_exit, runner

PAYLOAD = "payload_plugin_x"


def _listing_plugin(run: Path, dst: Path) -> Path:
    """A copy of ``run`` whose checkpoints' config lists ``plugins: [payload_plugin_x]``."""
    shutil.copytree(run, dst)
    for _, path in list_checkpoints(dst):
        state = load_checkpoint(path)
        assert "plugins: []\n" in state["config"]
        state["config"] = state["config"].replace("plugins: []\n", f"plugins:\n- {PAYLOAD}\n")
        path.unlink()
        save_checkpoint(dst, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    (dst / "config.yaml").unlink()  # config.yaml is a copy; the checkpoint's config is what counts
    return dst


@pytest.fixture
def received(tiny_dt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``(run, marker)``: a run listing a plugin whose module sits in the current directory (and
    ``""`` on sys.path, as under ``python -m``); importing that module would write ``marker``."""
    run = _listing_plugin(tiny_dt_run, tmp_path / "received")
    marker = tmp_path / "the-plugin-ran"
    (tmp_path / f"{PAYLOAD}.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    yield run, marker
    sys.modules.pop(PAYLOAD, None)


def test_load_run_imports_no_plugin_the_run_lists(received) -> None:
    run, marker = received
    with pytest.raises(ConfigError) as err:
        load_run(run)
    assert str(err.value) == (
        f"plugins (of the checkpoint's config)[0]='{PAYLOAD}' is not imported: a run's plugins are code, imported "
        f"only when you name them (--plugin {PAYLOAD}, if you trust that module) or install them as a "
        f"rl_tformers.plugins entry point")
    assert not marker.exists()


def test_a_named_plugin_is_still_not_imported_from_the_current_directory(received) -> None:
    run, marker = received
    with pytest.raises(ConfigError, match=rf"^--plugin\[0\]='{PAYLOAD}': no module named '{PAYLOAD}' \(looked on "
                                          rf"sys.path, not in the current directory "):
        load_run(run, plugins=[PAYLOAD])
    assert not marker.exists()


@pytest.mark.parametrize("command", [
    ["eval", "RUN", "--episodes", "1", "--envs", "1"],
    ["plot", "RUN", "--out", "fig.png", "--no-tensorboard"],
    ["eval", "RUN", "--plugin", PAYLOAD],
    ["train", "--resume", "RUN"],
    ["train", "--resume", "RUN", "--plugin", PAYLOAD],
    ["bench", "eval", "--run", "RUN", "--episodes", "1", "--n-envs", "1", "--memory-kinds", ""],
], ids=["eval", "plot", "eval --plugin", "train --resume", "train --resume --plugin", "bench eval"])
def test_commands_opening_a_run_run_none_of_its_plugins(received, command: list[str]) -> None:
    run, marker = received
    res = runner.invoke(app, [str(run) if a == "RUN" else a for a in command])
    assert_clean_exit(res, 2)
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and PAYLOAD in last
    assert not marker.exists()


class WritesAFile:
    """A pickle payload: unpickling it writes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('unpickled')",)


def test_a_checkpoint_holding_a_pickled_object_is_refused_unread(tiny_dt_run: Path, tmp_path: Path) -> None:
    """A checkpoint (valid digest and all) whose extra state holds an object that writes a file
    when unpickled: ``load_run`` and ``eval`` refuse it naming the file, and nothing is written."""
    run = tmp_path / "run"
    shutil.copytree(tiny_dt_run, run)
    marker = tmp_path / "the-checkpoint-ran"
    (_, path), = list_checkpoints(run)
    state = torch.load(path, weights_only=True)
    state["extra"]["payload"] = WritesAFile(marker)
    torch.save(state, path)  # torch.save pickles the object; its digest field is not even checked first
    assert str(marker).encode() in path.read_bytes()  # the payload is in the file
    with pytest.raises(CheckpointError) as err:
        load_run(run, checkpoint=path)
    assert str(err.value) == (f"{path}: cannot be loaded safely (not a torch file, or it holds objects other than "
                              f"tensors and plain containers, which weights_only loading refuses)")
    res = runner.invoke(app, ["eval", str(run), "--checkpoint", str(path)])
    assert_clean_exit(res, 2)
    assert not marker.exists()


def test_an_environment_id_naming_a_module_is_not_made_unless_named(received, tiny_dt_run: Path,
                                                                     tmp_path: Path) -> None:
    """gymnasium's ``module:EnvId`` imports ``module`` when the environment is made: a run whose
    env_id names one is refused (the module file in the current directory never runs)."""
    _, marker = received
    run = tmp_path / "env-module"
    shutil.copytree(tiny_dt_run, run)
    (_, path), = list_checkpoints(run)
    state = load_checkpoint(path)
    state["extra"]["env_id"] = f"{PAYLOAD}:CartPole-v1"
    path.unlink()
    save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    with pytest.raises(ConfigError) as err:
        load_run(run)
    assert str(err.value) == (f"extra (of the checkpoint).env_id='{PAYLOAD}:CartPole-v1' names the module "
                              f"'{PAYLOAD}', which making the environment imports: a run's modules are imported "
                              f"only when you name them (--plugin {PAYLOAD}, if you trust it)")
    assert not marker.exists()


def test_resume_in_python_imports_only_the_plugins_it_is_given(received, tmp_path: Path) -> None:
    """``trainer.resume`` (and ``load_resume_config``) refuse a run's unnamed plugin as the CLI
    does; one named in a ``plugins=[...]`` override counts as named (here it is then not found:
    never from the current directory)."""
    from rl_tformers.runtime.trainer import load_resume_config, resume

    run, marker = received
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='{PAYLOAD}' is not imported: a run's plugins are code"):
        resume(run)
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='{PAYLOAD}': no module named '{PAYLOAD}' \(looked on "
                                          rf"sys.path, not in the current directory"):
        load_resume_config(run, [f"plugins=[{PAYLOAD}]"])
    assert not marker.exists()


def test_resume_refuses_an_environment_id_naming_a_module(received, tiny_dt_run: Path, tmp_path: Path) -> None:
    from rl_tformers.runtime.trainer import load_resume_config

    _, marker = received
    run = tmp_path / "env-module-resume"
    shutil.copytree(tiny_dt_run, run)
    (_, path), = list_checkpoints(run)
    state = load_checkpoint(path)
    assert state["config"].count("  env_id: null\n") == 1
    state["config"] = state["config"].replace("  env_id: null\n", f"  env_id: {PAYLOAD}:CartPole-v1\n")
    path.unlink()
    save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    (run / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=rf"^agent.env_id='{PAYLOAD}:CartPole-v1' names the module '{PAYLOAD}', "
                                          rf"which making the environment imports"):
        load_resume_config(run)
    res = runner.invoke(app, ["train", "--resume", str(run)])
    assert_clean_exit(res, 2)
    assert not marker.exists()


def test_a_run_saved_before_cpu_matmul_existed_loads_and_evaluates_with_mkl(tiny_dt_run: Path, tmp_path: Path) -> None:
    """A run whose config has no ``cpu_matmul`` key (saved by a build without the option) loads
    with PyTorch's default library, MKL, and ``eval`` plays its episodes."""
    run = tmp_path / "run"
    shutil.copytree(tiny_dt_run, run)
    for _, path in list_checkpoints(run):
        state = torch.load(path, weights_only=True)
        cfg = yaml.safe_load(state["config"])
        cfg.pop("cpu_matmul")
        state["config"] = yaml.safe_dump(cfg)
        save_checkpoint(run, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    loaded = load_run(run)
    assert "cpu_matmul" not in loaded.cfg
    assert not any(type(m).__name__ == "OneDNNLinear" for m in loaded.agent.model.modules())
    res = runner.invoke(app, ["eval", str(run), "--episodes", "1", "--envs", "1"])
    assert_clean_exit(res, 0)
