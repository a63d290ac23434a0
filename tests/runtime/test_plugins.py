"""Plugins: a user's own module registers an attention kind (or an agent) and every command that
builds a run imports it first (``plugins:`` in the config, installed entry points, ``backbones
--plugin``). The plugin is docs/backbone.md's worked example, QK-norm attention (Henry et al. 2020)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rl_tformers.runtime.plugins as plugins
from rl_tformers.cli import app
from rl_tformers.registry import REGISTRIES
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_cartpole_h5
from tests.regressions.test_found_by_breaker_13_tools import TINY

REPO = Path(__file__).resolve().parents[2]



def _docs_plugin() -> str:
    """The worked example of docs/backbone.md ("Your own kind"), so the documented plugin is the tested one."""
    text = (REPO / "docs" / "backbone.md").read_text()
    section = text[text.index("## Your own kind (plugins)"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    return code[:code.index("```")]


PLUGIN = _docs_plugin()


def drop_plugins_and_kind(run_dir: Path, name: str, kind: str) -> None:
    """Rewrite ``run_dir``'s checkpoints as a run whose attention ``kind`` came from an entry
    point not installed here: ``plugins: []`` in their config, ``kind`` unregistered."""
    from rl_tformers.runtime.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

    for _, path in list_checkpoints(run_dir):
        state = load_checkpoint(path)
        state["config"] = state["config"].replace(f"plugins:\n- {name}\n", "plugins: []\n")
        path.unlink()
        save_checkpoint(run_dir, state)
    REGISTRIES["attention"]._entries.pop(kind)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``(module name, kind, folder)`` of a fresh plugin file in its own folder; the registry and
    the module cache are restored afterwards (other tests see only the built-in kinds)."""
    name = f"qknorm_{uuid.uuid4().hex[:8]}"
    kind = f"qk_norm_{name[-8:]}"
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / f"{name}.py").write_text(PLUGIN.replace('"qk_norm"', repr(kind)))
    saved = {slot: dict(reg._entries) for slot, reg in REGISTRIES.items()}
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name, kind, folder
    for slot, entries in saved.items():
        REGISTRIES[slot]._entries.clear()
        REGISTRIES[slot]._entries.update(entries)
    sys.modules.pop(name, None)


def test_plugin_names_are_checked() -> None:
    assert plugins.check_plugin_names(None) == []
    assert plugins.check_plugin_names(["a.b", "c", "a.b"]) == ["a.b", "c"]
    with pytest.raises(ConfigError, match=r"^plugins must be a list of Python module names"):
        plugins.check_plugin_names("my_attn")
    with pytest.raises(ConfigError, match=r"^plugins\[1\]='my_attn.py' is not a dotted Python module name; give "
                                          r"the module's name, not its file"):
        plugins.check_plugin_names(["ok", "my_attn.py"])
    with pytest.raises(ConfigError, match=r"^plugins\[0\]=3 is not a dotted Python module name$"):
        plugins.check_plugin_names([3])


def test_a_missing_or_failing_plugin_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='no_such_plugin_x': no module named 'no_such_plugin_x' "
                                          rf"\(looked in the current directory {tmp_path}"):
        plugins.load_plugins(["no_such_plugin_x"])
    (tmp_path / "broken_plugin_x.py").write_text("import math\nraise RuntimeError('bad plugin')\n")
    (tmp_path / "needs_dep_x.py").write_text("import not_installed_dependency_x\n")
    try:
        with pytest.raises(ConfigError, match=r"^plugins\[0\]='broken_plugin_x' failed to import: RuntimeError: "
                                              r"bad plugin \(.*broken_plugin_x.py:2\)"):
            plugins.load_plugins(["broken_plugin_x"])
        with pytest.raises(ConfigError, match=r"^plugins\[0\]='needs_dep_x' failed to import: ModuleNotFoundError: "
                                              r"No module named 'not_installed_dependency_x'"):
            plugins.load_plugins(["needs_dep_x"])
    finally:
        sys.modules.pop("broken_plugin_x", None)
        sys.modules.pop("needs_dep_x", None)


def test_compose_imports_the_plugins_before_checking_the_backbone(plugin, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    name, kind, folder = plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    over = [f"dataset.path={data}", *TINY, f"backbone.attention.kind={kind}"]
    monkeypatch.chdir(tmp_path)  # the plugin's folder is not where the command runs
    with pytest.raises(ConfigError, match=rf"backbone.attention.kind='{kind}': unknown attention kind .*a kind of "
                                          rf"your own registers when its module is listed in plugins\)$"):
        compose("dt/cartpole_demo", over)
    monkeypatch.chdir(folder)  # next to the module, as `python -m` would find it
    cfg = compose("dt/cartpole_demo", [*over, f"plugins=[{name}]"])
    assert list(cfg.plugins) == [name] and cfg.backbone.attention.kind == kind
    assert compose("dt/cartpole_demo", over) is not None  # registered now (one import per process)


def test_a_run_with_a_plugin_kind_trains_and_evaluates_in_a_fresh_process(plugin, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The run records ``plugins``: ``eval`` in a new process (another working directory) imports the
    module from PYTHONPATH, and says which module it could not find without it."""
    name, kind, folder = plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    monkeypatch.chdir(folder)
    run_dir = tmp_path / "run"
    cfg = compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY, f"backbone.attention.kind={kind}",
                                       f"plugins=[{name}]"])
    train(cfg, run_dir)
    assert f"plugins:\n- {name}\n" in (run_dir / "config.yaml").read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rl_tformers.cli", "eval", str(run_dir), "--episodes", "1", "--envs", "1",
           "--out", str(tmp_path / "ev.json")]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((tmp_path / "ev.json").read_text())["results"]
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert f"plugins (of the checkpoint's config)[0]='{name}': no module named '{name}'" in res.stderr


def test_backbones_lists_the_kinds_of_a_plugin(plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    name, kind, folder = plugin
    monkeypatch.chdir(folder)
    res = CliRunner().invoke(app, ["backbones", "--json", "--slot", "attention", "--plugin", name])
    assert res.exit_code == 0, res.output
    entry = {e["kind"]: e for e in json.loads(res.output)}[kind]
    assert entry["paper"] == "Henry et al. 2020, Query-Key Normalization for Transformers"
    assert entry["capabilities"]["exact"] is False
    assert entry["fields"] == {"g_init": 4.0}
    res = CliRunner().invoke(app, ["backbones", "--plugin", "no_such_plugin_y"])
    assert res.exit_code == 2 and "no module named 'no_such_plugin_y'" in res.output


def _fake_distribution(site: Path, module: str, body: str) -> None:
    """An installed package (``*.dist-info`` on sys.path) declaring a rl_tformers.plugins entry point."""
    (site / f"{module}.py").write_text(body)
    info = site / f"{module}_dist-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rl_tformers.plugins]\n{module} = {module}\n")


def test_installed_entry_points_are_imported_and_a_broken_one_only_warns(plugin, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    name, kind, folder = plugin
    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(site, name, (folder / f"{name}.py").read_text())
    _fake_distribution(site, f"broken_{name}", "raise ImportError('missing build')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plugins.load_plugins()
        assert kind in REGISTRIES["attention"]
        msgs = [str(w.message) for w in caught if issubclass(w.category, plugins.PluginWarning)]
        assert len(msgs) == 1 and msgs[0].startswith(f"rl_tformers.plugins entry point 'broken_{name}' "
                                                     f"(broken_{name}) of broken_{name}-dist failed to import "
                                                     f"and is skipped: ImportError: missing build")
    finally:
        sys.modules.pop(f"broken_{name}", None)


def test_a_run_whose_kind_is_not_registered_here_is_refused_by_name(plugin, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose kind came from an unlisted plugin (an entry point of a package not installed
    here): eval said nothing useful (a RegistryError traceback); now one line names the kind."""
    from rl_tformers.runtime.loading import load_run


    name, kind, folder = plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    monkeypatch.chdir(folder)
    run_dir = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY, f"backbone.attention.kind={kind}",
                                       f"plugins=[{name}]"]), run_dir)
    drop_plugins_and_kind(run_dir, name, kind)
    sys.modules.pop(name)
    with pytest.raises(ConfigError, match=rf"^the run {run_dir} cannot be rebuilt here: backbone.attention.kind="
                                          rf"'{kind}': unknown attention kind \(registered: adaptive_span, "):
        load_run(run_dir)
