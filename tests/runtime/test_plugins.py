"""Plugins: a user's own module registers an attention kind (or an agent) and every command that
builds a run imports it first (``plugins:`` in the config, installed entry points, ``backbones
--plugin``); a run that is opened (``eval``, ``plot``, ``--resume``, ``load_run``) imports a module
it lists only when the user names it, and no module is ever imported from the current directory.
The plugin is docs/backbone.md's worked example, QK-norm attention (Henry et al. 2020)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import rl_tformers.runtime.plugins as plugins
from rl_tformers.cli import app
from rl_tformers.registry import REGISTRIES
from rl_tformers.runtime import agent_registry as agent_registry
from rl_tformers.runtime.agent_registry import AgentBuildError
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_cartpole_h5
from tests.runs import TINY_DT_OVERRIDES

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
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='no_such_plugin_x': no module named 'no_such_plugin_x' "
                                          rf"\(looked on sys.path, not in the current directory {os.getcwd()}"):
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
    over = [f"dataset.path={data}", *TINY_DT_OVERRIDES, f"backbone.attention.kind={kind}"]
    monkeypatch.chdir(tmp_path)  # the plugin's folder is not where the command runs
    with pytest.raises(ConfigError, match=rf"backbone.attention.kind='{kind}': unknown attention kind .*a kind of "
                                          rf"your own registers when its module is listed in plugins\)$"):
        compose("dt/cartpole_demo", over)
    monkeypatch.syspath_prepend(str(folder))  # its folder on PYTHONPATH
    cfg = compose("dt/cartpole_demo", [*over, f"plugins=[{name}]"])
    assert list(cfg.plugins) == [name] and cfg.backbone.attention.kind == kind
    assert compose("dt/cartpole_demo", over) is not None  # registered now (one import per process)


def test_a_run_with_a_plugin_kind_trains_and_evaluates_in_a_fresh_process(plugin, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The run records ``plugins``: ``eval --plugin`` in a new process imports the module from
    PYTHONPATH; without ``--plugin`` it is not imported, and without PYTHONPATH it is not found,
    even in the current directory."""
    name, kind, folder = plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    monkeypatch.syspath_prepend(str(folder))
    run_dir = tmp_path / "run"
    cfg = compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT_OVERRIDES, f"backbone.attention.kind={kind}",
                                       f"plugins=[{name}]"])
    train(cfg, run_dir)
    assert f"plugins:\n- {name}\n" in (run_dir / "config.yaml").read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rl_tformers.cli", "eval", str(run_dir), "--episodes", "1", "--envs", "1",
           "--out", str(tmp_path / "ev.json"), "--plugin", name]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((tmp_path / "ev.json").read_text())["results"]
    res = subprocess.run(cmd[:-2], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: plugins (of the checkpoint's config)[0]='{name}' is not imported: a run's plugins are code, imported "
        f"only when you name them (--plugin {name}, if you trust that module) or install them as a "
        f"rl_tformers.plugins entry point")
    env["PYTHONPATH"] = str(REPO)  # `python -m` puts the current directory (the plugin's folder) on sys.path
    res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert f"error: --plugin[0]='{name}': no module named '{name}' (looked on sys.path, not in the current " in res.stderr


def test_backbones_lists_the_kinds_of_a_plugin(plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    name, kind, folder = plugin
    monkeypatch.syspath_prepend(str(folder))
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
    here): eval says in one line which kind is missing (not a RegistryError traceback)."""
    from rl_tformers.runtime.loading import load_run


    name, kind, folder = plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    monkeypatch.syspath_prepend(str(folder))
    run_dir = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT_OVERRIDES, f"backbone.attention.kind={kind}",
                                       f"plugins=[{name}]"]), run_dir)
    drop_plugins_and_kind(run_dir, name, kind)
    sys.modules.pop(name)
    with pytest.raises(ConfigError, match=rf"^the run {run_dir} cannot be rebuilt here: backbone.attention.kind="
                                          rf"'{kind}': unknown attention kind \(registered: adaptive_span, "):
        load_run(run_dir)


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def clean_registries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Restore the backbone kinds, agents, inference loaders, sys.path and the module cache (only
    the modules added) after the test; the test's plugin files go in ``tmp_path / "plugins"``."""
    from rl_tformers.runtime import loading

    agent_registry.discover_agents()  # the built-in agents belong to what is restored
    saved = {slot: dict(reg._entries) for slot, reg in REGISTRIES.items()}
    saved_agents, saved_loaders = dict(agent_registry._AGENTS), dict(loading._INFERENCE_LOADERS)
    modules = set(sys.modules)
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "plugins"
    folder.mkdir()
    yield folder
    for slot, entries in saved.items():
        REGISTRIES[slot]._entries.clear()
        REGISTRIES[slot]._entries.update(entries)
    agent_registry._AGENTS.clear()
    agent_registry._AGENTS.update(saved_agents)
    loading._INFERENCE_LOADERS.clear()
    loading._INFERENCE_LOADERS.update(saved_loaders)
    for name in set(sys.modules) - modules:
        if name.startswith(("half_", "pkg_", "dense_", "ep_", "collide_", "shadow_")):
            sys.modules.pop(name, None)


# -- an agent kind taken by a built-in -----------------------------------------------------------------
def test_a_plugin_agent_named_like_a_builtin_one_is_refused_in_a_fresh_process(tmp_path: Path) -> None:
    """In a new process ``compose`` imports the plugins before the agents are discovered: the
    plugin's ``dt`` replaced the Decision Transformer (its module then failed to import, unseen)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "collide_dt.py").write_text(
        "from rl_tformers.runtime.agent_registry import register_agent\n\n"
        "@register_agent('dt', description='not the Decision Transformer')\n"
        "def build(cfg, run_dir, device):\n    raise RuntimeError('the plugin builder ran')\n")
    code = ("from rl_tformers.runtime.run_config import compose, ConfigError\n"
            "try:\n    compose('toy', ['plugins=[collide_dt]'])\nexcept ConfigError as e:\n    print('refused:', e)\n"
            "from rl_tformers.runtime.agent_registry import get_agent\nprint('dt:', get_agent('dt').description)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "mods"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == (f"refused: plugins[0]='collide_dt' failed to import: ValueError: agent kind 'dt' is already "
                        f"registered by rl_tformers.agents.decision_transformer.agent ({tmp_path / 'mods' / 'collide_dt.py'}:3)")
    assert lines[1] == "dt: Decision Transformer (Chen et al. 2021) on any backbone"


def test_a_backbone_kind_taken_by_a_builtin_names_the_plugins_line(clean_registries: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    name = _unique("collide")
    (clean_registries / f"{name}.py").write_text(
        "from dataclasses import dataclass\n"
        "from rl_tformers.attention.base import AttentionConfig\n"
        "from rl_tformers.registry import ATTENTION\n\n"
        "@ATTENTION.register('sdpa', description='mine', paper='-')\n"
        "@dataclass(frozen=True)\n"
        "class Mine(AttentionConfig):\n    pass\n")
    monkeypatch.syspath_prepend(str(clean_registries))
    with pytest.raises(ConfigError) as err:
        plugins.load_plugins([name])
    assert str(err.value) == (f"plugins[0]={name!r} failed to import: RegistryError: attention kind 'sdpa' is already "
                              f"registered by rl_tformers.attention.sdpa.SDPAConfig "
                              f"({clean_registries / f'{name}.py'}:5)")
    assert REGISTRIES["attention"].get("sdpa").config_cls.__module__ == "rl_tformers.attention.sdpa"


# -- a plugin failing halfway --------------------------------------------------------------------------
HALF = """\
from dataclasses import dataclass

from rl_tformers.runtime.loading import register_inference_loader
from rl_tformers.attention.base import AttentionConfig
from rl_tformers.registry import ATTENTION, POSITION
from rl_tformers.position.base import PositionConfig
from rl_tformers.runtime.agent_registry import register_agent


@ATTENTION.register("{kind}", description="registered before the error", paper="-")
@dataclass(frozen=True)
class HalfAttention(AttentionConfig):
    pass


@POSITION.register("{kind}", description="registered before the error", paper="-")
@dataclass(frozen=True)
class HalfPosition(PositionConfig):
    pass


@register_agent("{kind}", description="registered before the error")
def build(cfg, run_dir, device):
    raise AssertionError


register_inference_loader("{kind}")(build)
raise RuntimeError("half way")
"""


def _nothing_of(kind: str) -> None:
    from rl_tformers.runtime.loading import _INFERENCE_LOADERS

    assert kind not in REGISTRIES["attention"] and kind not in REGISTRIES["position"]
    assert kind not in agent_registry._AGENTS and kind not in _INFERENCE_LOADERS


def test_a_plugin_failing_halfway_leaves_nothing_registered_and_fails_the_same_way_again(
        clean_registries: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _unique("half")
    kind = f"k_{name}"
    (clean_registries / f"{name}.py").write_text(HALF.format(kind=kind))
    monkeypatch.syspath_prepend(str(clean_registries))
    expected = (f"plugins[0]={name!r} failed to import: RuntimeError: half way "
                f"({clean_registries / f'{name}.py'}:28)")
    for _ in range(2):  # the second import ran the module again (not "already registered by <name>")
        with pytest.raises(ConfigError) as err:
            plugins.load_plugins([name])
        assert str(err.value) == expected
        _nothing_of(kind)
        assert name not in sys.modules
    # once fixed, the same process imports it and its kinds register
    (clean_registries / f"{name}.py").write_text(HALF.format(kind=kind).replace('raise RuntimeError("half way")\n', ""))
    assert plugins.load_plugins([name]) == [name]
    assert kind in REGISTRIES["attention"] and kind in agent_registry._AGENTS


def test_a_package_plugin_failing_in_a_submodule_forgets_the_package(clean_registries: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``pkg/__init__.py`` registers a kind and imports ``pkg.sub``, which fails: the package's kind
    is unregistered and ``pkg`` is forgotten, so a later import runs it again and registers the
    kind (a cached ``pkg`` would not)."""
    pkg = _unique("pkg")
    kind = f"k_{pkg}"
    (clean_registries / pkg).mkdir()
    (clean_registries / pkg / "__init__.py").write_text(
        HALF.format(kind=kind).replace('raise RuntimeError("half way")\n', f"from {pkg} import sub  # noqa\n"))
    (clean_registries / pkg / "sub.py").write_text("raise ImportError('sub is broken')\n")
    monkeypatch.syspath_prepend(str(clean_registries))
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='{pkg}.sub' failed to import: ImportError: sub is broken "):
        plugins.load_plugins([f"{pkg}.sub"])
    _nothing_of(kind)
    assert pkg not in sys.modules and f"{pkg}.sub" not in sys.modules
    (clean_registries / pkg / "sub.py").write_text("VALUE = 1\n")
    assert plugins.load_plugins([f"{pkg}.sub"]) == [f"{pkg}.sub"]
    assert kind in REGISTRIES["attention"] and sys.modules[f"{pkg}.sub"].VALUE == 1


def test_a_broken_entry_point_is_skipped_with_nothing_of_it_registered(clean_registries: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    name = _unique("ep_half")
    kind = f"k_{name}"
    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(site, name, HALF.format(kind=kind))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugins.load_plugins()
    msgs = [str(w.message) for w in caught if issubclass(w.category, plugins.PluginWarning)]
    assert msgs == [f"rl_tformers.plugins entry point {name!r} ({name}) of {name}-dist failed to import and is "
                    f"skipped: RuntimeError: half way ({site / f'{name}.py'}:28)"]
    _nothing_of(kind)
    res = CliRunner().invoke(app, ["backbones", "--json", "--slot", "attention"])
    assert res.exit_code == 0 and kind not in {e["kind"] for e in json.loads(res.stdout)}


# -- the current directory on sys.path ----------------------------------------------------------------
def test_a_plugin_is_never_imported_from_the_current_directory(clean_registries: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A module file in the current directory (also when ``""`` or its path is on sys.path, as
    under ``python -m``) is not imported as a plugin; sys.path is as before afterwards, and a
    module installed on sys.path is imported by the same name."""
    plugin = _unique("shadow_plugin")
    marker = tmp_path / "imported"
    (clean_registries / f"{plugin}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    sys.path[:] = ["", str(clean_registries), *sys.path]
    monkeypatch.chdir(clean_registries)
    before = list(sys.path)
    with pytest.raises(ConfigError, match=rf"^plugins\[0\]='{plugin}': no module named '{plugin}' \(looked on "
                                          rf"sys.path, not in the current directory {clean_registries};"):
        compose("toy", ["train.steps=1", f"plugins=[{plugin}]"])
    assert not marker.exists() and sys.path == before
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{plugin}.py").write_text("WHERE = 'installed'\n")
    sys.path.append(str(site))
    compose("toy", ["train.steps=1", f"plugins=[{plugin}]"])
    assert sys.modules[plugin].WHERE == "installed" and not marker.exists()


# -- fine-tuning a run trained with plugins -------------------------------------------------------------
DENSE = """\
from dataclasses import dataclass

from rl_tformers.attention.base import AttentionConfig
from rl_tformers.attention.sdpa import DenseAttention
from rl_tformers.registry import ATTENTION, Capabilities


@ATTENTION.register("{kind}", description="dense attention of a plugin", paper="-",
                    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True))
@dataclass(frozen=True)
class DenseConfig(AttentionConfig):
    def build(self, ctx, position):
        return DenseAttention(ctx, position)
"""


@pytest.fixture
def dense_plugin(clean_registries: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, Path]:
    """``(module, kind, folder)`` of a plugin registering a dense attention kind, imported from
    ``folder`` on sys.path."""
    name = _unique("dense")
    kind = f"k_{name}"
    (clean_registries / f"{name}.py").write_text(DENSE.format(kind=kind))
    monkeypatch.syspath_prepend(str(clean_registries))
    return name, kind, clean_registries


TINY_BB = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1"]


ENV = ["agent.max_ep_len=30", "agent.env_kwargs={max_episode_steps: 25}"]


QUIET = ["train.progress=false", "device=cpu", "eval.every=0", "eval.at_end=false", "train.warmup_steps=1"]


ONLINE = ["agent.kind=odt", "train.steps=2", "train.batch_size=8", "train.checkpoint_every=0", "agent.targets=[-100]",
          "agent.online.updates_per_round=2", "agent.online.rollouts_per_round=1", "agent.online.n_envs=1",
          "agent.online.buffer_size=10", "agent.online.target_return=-50", *ENV]


def _needs_plugins(option: str, offline: Path, name: str) -> str:
    """The refusal of a fine-tuning run whose source run ``offline`` used the plugin ``name``."""
    return (f"{option}={offline} was trained with plugins=['{name}']: this run rebuilds that run's model, so "
            f"list {name} in its plugins too (plugins=[{name}]), which records them for eval, plot and --resume")


@pytest.mark.filterwarnings("ignore:agent.init_:UserWarning")  # the config's backbone is not used
def test_online_dt_fine_tuning_needs_the_plugins_of_the_offline_run(dense_plugin, tmp_path: Path) -> None:
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    from rl_tformers.runtime.loading import load_run
    from tests.pendulum import random_pendulum_dataset

    name, kind, _ = dense_plugin
    data = save_d4rl_hdf5(random_pendulum_dataset([30, 18, 25, 22]), tmp_path / "pendulum.hdf5")
    offline = tmp_path / "dt"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_BB, "train.steps=2", "train.batch_size=8",
                                       "agent.targets=[-100]", "agent.head=gaussian", *ENV, *QUIET,
                                       f"plugins=[{name}]", f"backbone.attention.kind={kind}"]), offline)
    over = [f"dataset.path={data}", f"agent.init_from={offline}", *TINY_BB, *ONLINE, *QUIET]
    with pytest.raises(AgentBuildError) as err:
        train(compose("dt/cartpole_demo", over), tmp_path / "odt-without")
    assert str(err.value) == _needs_plugins("agent.init_from", offline, name)
    run = tmp_path / "odt"
    train(compose("dt/cartpole_demo", [*over, f"plugins=[{name}]"]), run)
    assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == [name]
    loaded = load_run(run)
    assert loaded.kind == "odt" and list(loaded.cfg.plugins) == [name]
    assert loaded.agent.model.backbone.config.attention.kind == kind  # the offline run's backbone
    # a kind no module registers here (the offline run's entry point is not installed): named
    drop_plugins_and_kind(offline, name, kind)
    with pytest.raises(AgentBuildError) as err:
        train(compose("dt/cartpole_demo", over), tmp_path / "odt-unknown")
    assert str(err.value).startswith(f"agent.init_from={offline}: that run cannot be rebuilt here: "
                                     f"backbone.attention.kind='{kind}': unknown attention kind (registered: ")


@pytest.mark.filterwarnings("ignore:agent.init_:UserWarning")  # the config's backbone is not used
def test_ppo_fine_tuning_needs_the_plugins_of_the_offline_run(dense_plugin, tmp_path: Path) -> None:
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    name, kind, _ = dense_plugin
    data = save_d4rl_hdf5(scripted_dataset("cartpole", 3, seed=0), tmp_path / "cartpole-positions.hdf5")
    bb = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    offline = tmp_path / "gtrxl"
    train(compose("gtrxl/cartpole_positions_bc", [f"dataset.path={data}", *bb, "agent.seq_len=4", "agent.burn_in=4",
                                                  "train.steps=2", "train.batch_size=4", *QUIET, f"plugins=[{name}]",
                                                  f"backbone.attention.kind={kind}"]), offline)
    over = [f"agent.init_checkpoint={offline}", "agent.n_envs=2", "agent.n_steps=8", "agent.n_epochs=1",
            "agent.n_minibatches=2", "agent.critic_warmup=0", *bb, "train.steps=2", *QUIET]
    with pytest.raises(AgentBuildError) as err:
        train(compose("gtrxl/ppo_cartpole_finetune", over), tmp_path / "ppo-without")
    assert str(err.value) == _needs_plugins("agent.init_checkpoint", offline, name)
    run = tmp_path / "ppo"
    train(compose("gtrxl/ppo_cartpole_finetune", [*over, f"plugins=[{name}]"]), run)
    assert yaml.safe_load((run / "config.yaml").read_text())["plugins"] == [name]


# -- train --list-agents and installed plugins ----------------------------------------------------------
def test_list_agents_lists_the_agents_of_installed_plugins(clean_registries: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    name = _unique("ep_agent")
    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(site, name, "from rl_tformers.runtime.agent_registry import register_agent\n\n"
                                   f"@register_agent({name!r}, description='an installed agent')\n"
                                   "def build(cfg, run_dir, device):\n    raise AssertionError\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    res = CliRunner().invoke(app, ["train", "--list-agents"])
    assert res.exit_code == 0, res.output
    assert f"{name:16s} an installed agent" in res.stdout.splitlines()


# -- plugins as a mapping ---------------------------------------------------------------------------------
def test_plugins_given_as_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        compose("toy", ["plugins={a: 1}"])
    assert str(err.value) == ("plugins must be a list of Python module names (e.g. plugins=[my_attn]), "
                              "got {'a': 1}")


def test_a_run_trained_with_a_plugin_cannot_rebuild_itself_without_it(tmp_path: Path, dense_plugin,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Held: a moved plugin is named by ``eval`` (this test guards the loader's order: plugins first)."""
    from rl_tformers.runtime.loading import load_run

    name, kind, folder = dense_plugin
    data = write_cartpole_h5(tmp_path / "cp.hdf5")
    run = tmp_path / "bc"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_BB, "agent.context_len=5", "train.steps=2",
                                       "train.batch_size=4", "agent.targets=[10]", *QUIET, f"plugins=[{name}]",
                                       f"backbone.attention.kind={kind}"]), run)
    (folder / f"{name}.py").rename(folder / "moved.py")
    REGISTRIES["attention"]._entries.pop(kind)
    sys.modules.pop(name)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_run(run, checkpoint=run / "checkpoints" / "step_000000002.pt", plugins=[name])
    assert str(err.value) == (f"--plugin[0]={name!r}: no module named {name!r} (looked on sys.path, not in the "
                              f"current directory {tmp_path}; install it or add its folder to PYTHONPATH)")


# ------------------------------------------------- null, repeats, resume
def test_null_plugins_count_as_empty_repeats_are_recorded_once_and_a_resume_may_list_plugins(tmp_path: Path) -> None:
    from rl_tformers.runtime.trainer import resume

    toy = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=2", "train.batch_size=4",
           "train.warmup_steps=1", "train.log_every=1", "eval.at_end=false"]
    assert list(compose(None, [*toy, "plugins=null"]).plugins) == []
    (tmp_path / "cfg.yaml").write_text("agent: {kind: toy}\nplugins:\n")
    assert list(compose(tmp_path / "cfg.yaml").plugins) == []
    assert list(compose(None, [*toy, "plugins=[json,json]"]).plugins) == ["json"]
    train(compose(None, toy), tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = resume(tmp_path / "run", ["train.steps=3", "plugins=[json]"])
    assert res.step == 3
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["plugins"] == ["json"]
