"""Every command the README and docs/*.md show runs as written.

Every shell block is run by bash with every external command replaced by a recorder, so loops,
variables and continuation lines expand as a user's shell would expand them; each recorded
``rl-tformers`` call must parse with the CLI's own Typer app (its options exist) and every
``train``/``sweep`` config must compose. Scripts and ``python -m`` modules named exist; flags,
config names and config keys named in the prose exist; the runtime schema table and error
examples are what the config check says. Nothing here trains or evaluates.
"""

from __future__ import annotations

import itertools
import re
import shutil

import pytest
import typer

from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.bench.crosscheck import build_parser as crosscheck_parser
from rl_tformers.cli import app
from rl_tformers.runtime.agent_registry import available_agents
from rl_tformers.runtime.run_config import (
    ConfigError,
    DatasetConfig,
    EvalConfig,
    TrainConfig,
    available_configs,
    compose,
    flatten,
    resolve_config_path,
    to_container,
)
from tests.docs.markdown import (
    DOCS,
    README_PATH,
    REPO,
    doc_commands,
    fenced_blocks,
    inline_code,
    prose,
    recorded_commands,
)
from tests.scripts import script_module

ROOT_CMD = typer.main.get_command(app)

# -- the CLI -------------------------------------------------------------------------------------
def cli_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``rl-tformers`` (also behind ``torchrun ... -m rl_tformers.cli``)."""
    if argv[0] == "rl-tformers":
        return argv[1:]
    if "rl_tformers.cli" in argv:
        return argv[argv.index("rl_tformers.cli") + 1 :]
    return None


def resolve(args: list[str]):
    cmd, path = ROOT_CMD, []
    while hasattr(cmd, "commands") and args and args[0] in cmd.commands:
        cmd = cmd.commands[args[0]]
        path.append(args.pop(0))
    return cmd, path, args


def options_of(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}


def check_invocation(args: list[str]) -> str | None:
    """None when ``rl-tformers ARGS`` parses and its config composes, else what is wrong."""
    cmd, path, rest = resolve(list(args))
    if hasattr(cmd, "commands"):
        return f"{' '.join(path) or 'rl-tformers'}: no subcommand {rest[:1]} (have {sorted(cmd.commands)})"
    try:
        ctx = cmd.make_context(" ".join(path), list(rest))
    except Exception as exc:  # click's UsageError family (unknown option, missing argument...)
        if type(exc).__name__ == "Exit":  # an eager option such as --list-recipes
            return None
        return f"{type(exc).__name__}: {exc}"
    p = ctx.params
    try:
        if path == ["train"] and not p.get("resume") and not p.get("list_agents"):
            compose(p.get("config"), list(p.get("overrides") or ()))
        if path == ["sweep"]:
            grid = [g.split("=", 1) for g in p.get("grid") or ()]
            for point in itertools.product(*[[f"{k}={v}" for v in vs.split(",")] for k, vs in grid]):
                compose(p.get("config"), [*(p.get("overrides") or ()), *point])
    except ConfigError as exc:
        return f"config: {str(exc).splitlines()[0]}"
    return None


# -- 1. shell blocks -----------------------------------------------------------------------------
@pytest.fixture
def docs_plugin(tmp_path, monkeypatch):
    """The documented plugin module (docs/backbone.md's ``my_attn.py``) importable as ``my_attn``,
    as it is for the user who saved it, so the commands that list it in ``plugins`` compose; the
    registries and the module cache are restored afterwards."""
    import sys

    from rl_tformers.registry import REGISTRIES

    text = (REPO / "docs" / "backbone.md").read_text()
    section = text[text.index("## Your own kind (plugins)"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    assert code.startswith("# my_attn.py"), "docs/backbone.md: the worked plugin example moved"
    (tmp_path / "my_attn.py").write_text(code[:code.index("```")])
    saved = {slot: dict(reg._entries) for slot, reg in REGISTRIES.items()}
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    yield
    for slot, entries in saved.items():
        REGISTRIES[slot]._entries.clear()
        REGISTRIES[slot]._entries.update(entries)
    sys.modules.pop("my_attn", None)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to expand the shell blocks")
def test_every_rl_tformers_call_in_a_shell_block_parses_and_its_config_composes(tmp_path_factory, docs_plugin) -> None:
    calls = [(where, args) for where, argv in doc_commands(tmp_path_factory) if (args := cli_argv(argv))]
    assert len(calls) > 100  # the harvest works (loops expand to one call per iteration)
    bad, seen = [], set()
    for where, args in calls:
        if tuple(args) in seen:
            continue
        seen.add(tuple(args))
        if problem := check_invocation(args):
            bad.append(f"{where}: rl-tformers {' '.join(args)}\n    -> {problem}")
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to expand the shell blocks")
def test_every_rl_tformers_call_in_the_readme_parses_and_its_config_composes(tmp_path_factory, docs_plugin) -> None:
    """The README's walkthrough, swaps, results and performance commands, one by one."""
    calls = [(where, args) for where, argv in doc_commands(tmp_path_factory, [README_PATH]) if (args := cli_argv(argv))]
    commands = {args[0] for _, args in calls}
    assert len(calls) >= 15 and {"collect", "train", "eval", "plot", "sweep", "backbones", "bench"} <= commands
    bad = [f"{where}: rl-tformers {' '.join(args)}\n    -> {p}" for where, args in calls if (p := check_invocation(args))]
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to expand the shell blocks")
def test_scripts_and_python_modules_named_in_shell_blocks_exist(tmp_path_factory) -> None:
    import importlib.util

    bad = []
    for path in DOCS:
        for script in set(re.findall(r"(?<![\w./-])(scripts/[\w-]+\.\w+)", path.read_text())):
            if not (REPO / script).is_file():
                bad.append(f"{path.name}: {script} does not exist")
    for where, argv in doc_commands(tmp_path_factory):
        if argv[0] in ("python", "python3") and len(argv) > 2 and argv[1] == "-m":
            if importlib.util.find_spec(argv[2]) is None:
                bad.append(f"{where}: python -m {argv[2]}: no such module")
    assert not bad, "\n".join(bad)


def test_the_recorder_sees_loops_variables_and_continuation_lines(tmp_path) -> None:
    body = 'S="train.steps=4 seed=1"\nfor L in a_b c; do l=${L//_/-}\n  rl-tformers train -c x/$L $S \\\n    --run-dir r/$l\ndone'
    assert recorded_commands(body, tmp_path) == [
        ["rl-tformers", "train", "-c", "x/a_b", "train.steps=4", "seed=1", "--run-dir", "r/a-b"],
        ["rl-tformers", "train", "-c", "x/c", "train.steps=4", "seed=1", "--run-dir", "r/c"],
    ]
    assert check_invocation(["train", "-c", "dt/hopper_medium", "train.lrr=1"]).startswith(
        "config: train.lrr"
    )
    assert "No such option" in check_invocation(["eval", "RUN", "--episode", "3"])
    assert "not found" in check_invocation(["train", "-c", "dt/hopper_mediun"])


# -- 2. prose: flags, config names, config keys --------------------------------------------------
def test_flags_in_inline_rl_tformers_commands_exist() -> None:
    bad = []
    for path in DOCS:
        for span in inline_code(path):
            if not span.startswith("rl-tformers"):
                continue
            toks = span.replace("[", " ").replace("]", " ").replace("|", " ").split()[1:]
            cmd, _, rest = resolve(toks)
            opts = options_of(cmd) | {"--help", "-h"}
            for tok in rest:
                if tok.startswith("-") and tok.split("=")[0] not in opts:
                    bad.append(f"{path.name}: `{span}`: {tok.split('=')[0]}")
    assert not bad, "\n".join(bad)


def test_every_long_flag_in_prose_belongs_to_some_command() -> None:
    known = {"--logdir", "--nnodes", "--rdzv-endpoint", "--head", "--address"}  # tensorboard, torchrun, ray

    def walk(cmd):
        if hasattr(cmd, "commands"):
            for sub in cmd.commands.values():
                yield from walk(sub)
        else:
            yield from options_of(cmd)

    # python -m rl_tformers.bench.crosscheck, a documented command outside the rl-tformers tree
    crosscheck = {o for a in crosscheck_parser()._actions for o in a.option_strings if o.startswith("--")}
    # python scripts/dt_forward_malloc.py and scripts/loss_ab.py, the other documented argparse commands
    forward = {o for name in ("dt_forward_malloc", "loss_ab")
               for a in script_module(name).build_parser()._actions for o in a.option_strings if o.startswith("--")}
    known |= set(walk(ROOT_CMD)) | {"--help"} | crosscheck | forward
    bad = [
        f"{p.name}: {f}"
        for p in DOCS
        for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", prose(p))
        if f not in known
    ]
    assert not bad, "\n".join(sorted(set(bad)))


def test_config_names_in_prose_resolve() -> None:
    bad = []
    for path in DOCS:
        for span in inline_code(path):
            for name in re.findall(r"(?:^|\s)((?:dt|bc|gtrxl)/[a-z0-9_]+|memory/recall\w+)(?=$|\s)", span):
                try:
                    resolve_config_path(name)
                except ConfigError:
                    bad.append(f"{path.name}: `{span}`")
    # the README's shipped-config pattern: {dt,bc}/{task}_{level} and bc/..._top10
    for task, level in itertools.product(
        ("hopper", "walker2d", "halfcheetah"), ("medium", "medium_replay", "medium_expert")
    ):
        for name in (f"dt/{task}_{level}", f"bc/{task}_{level}", f"bc/{task}_{level}_top10"):
            try:
                resolve_config_path(name)
            except ConfigError:
                bad.append(f"README shipped configs: {name}")
    assert not bad, "\n".join(bad)


def _composed_keys() -> set[str]:
    keys: set[str] = set()
    for kind in available_agents():
        keys |= set(flatten(to_container(compose(None, [f"agent.kind={kind}"]))))
    for name in available_configs():
        keys |= set(flatten(to_container(compose(name))))
    return {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 2)}


#: Dotted names in the docs that are not config keys: typos shown on purpose, a method, a file name.
NOT_KEYS = {"train.lrr", "backbone.block.gat", "backbone.reset_state", "eval.json"}


def test_config_keys_named_in_prose_exist() -> None:
    known = _composed_keys()
    # sections whose keys a config may leave out (checked against their schemas) or that depend on the kind
    known |= {f"dataset.{k}" for k in DatasetConfig.__dataclass_fields__}
    known |= {f"backbone.{k}" for k in BackboneConfig.__dataclass_fields__}  # scalars a config may leave out
    known |= {f"backbone.{slot}.kind" for slot in ("attention", "position", "memory", "block", "depth")}
    known |= {f"backbone.{slot}" for slot in ("attention", "position", "memory", "block", "depth")}
    from rl_tformers.registry import REGISTRIES, SLOTS

    # any registered kind's field (a doc may name the field of a kind no shipped config uses)
    known |= {f"backbone.{slot}.{name}" for slot in SLOTS for e in REGISTRIES[slot] for name in e.fields()}
    from rl_tformers.agents.common.encoders import ENCODERS

    known |= {f"agent.encoder.{name}" for e in ENCODERS for name in e.fields()}  # any observation encoder's field
    bad = []
    for path in DOCS:
        for key in re.findall(
            r"(?<![\w./-])((?:agent|backbone|dataset|train|eval)\.[a-z_]\w*(?:\.[a-z_]\w*)*)", prose(path)
        ):
            if key not in known and key not in NOT_KEYS and not key.endswith((".py", ".json", ".md")):
                bad.append(f"{path.name}: {key}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_runtime_schema_table_lists_the_schema_fields() -> None:
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", (REPO / "docs/runtime.md").read_text(), re.M)
    }
    for section, schema in (("train", TrainConfig), ("eval", EvalConfig), ("dataset", DatasetConfig)):
        named = set(re.findall(r"`(\w+)`", rows[section]))
        missing = set(schema.__dataclass_fields__) - named
        assert not missing, f"docs/runtime.md schema row `{section}` misses {sorted(missing)}"


def test_runtime_error_examples_are_what_the_config_check_says() -> None:
    block = next(b for _, lang, b in fenced_blocks(REPO / "docs/runtime.md") if b.startswith("error: "))
    cases = {  # the key each shown error names -> the config and override that produce it
        "train.lrr": ("toy", ["train.lrr=1"]),
        "agent.kind": (None, ["agent.kind=dtt"]),
        "backbone.attention.kind": ("toy", ["backbone.attention.kind=perfomer"]),
    }
    for line in block.splitlines():
        shown = line.removeprefix("error: ")
        config, overrides = cases[shown.split(":")[0].split("=")[0]]
        with pytest.raises(ConfigError) as exc:
            compose(config, overrides)
        # the doc shortens long lists with '...': compare the text up to the first one
        assert str(exc.value).startswith(shown.split("...")[0].rstrip(" (,")), (shown, str(exc.value))


def test_medium_rows_config_equals_the_task_config() -> None:
    """docs/results.md: `-c dt/hopper_medium dataset.path=rlt/$t-v5/medium-v0` resolves to the same config."""
    for algo, task in itertools.product(("dt", "bc"), ("walker2d", "halfcheetah")):
        a = to_container(compose(f"{algo}/{task}_medium"))
        b = to_container(compose(f"{algo}/hopper_medium", [f"dataset.path=rlt/{task}-v5/medium-v1"]))
        assert a == b, (algo, task)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to expand the shell blocks")
def test_no_readme_train_or_sweep_config_warns(tmp_path_factory, docs_plugin) -> None:
    """Every `train` / `sweep` config the README shows composes without a Python warning (a slot
    swap that drops fields, ...) and without a warning of the trainer's config check."""
    import warnings

    from rl_tformers.runtime.trainer import config_warnings

    calls = [args for _, argv in doc_commands(tmp_path_factory, [README_PATH]) if (args := cli_argv(argv))]
    checked, noisy = 0, []
    for args in calls:
        cmd, path, rest = resolve(list(args))
        if path not in (["train"], ["sweep"]):
            continue
        p = cmd.make_context(" ".join(path), list(rest)).params
        if p.get("resume") or p.get("list_agents"):
            continue
        grid = [g.split("=", 1) for g in p.get("grid") or ()]
        for point in itertools.product(*[[f"{k}={v}" for v in vs.split(",")] for k, vs in grid]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cfg = compose(p.get("config"), [*(p.get("overrides") or ()), *point])
            said = [str(w.message) for w in caught] + config_warnings(cfg)
            checked += 1
            if said:
                noisy.append(f"rl-tformers {' '.join(args)}: {said}")
    assert checked >= 10 and not noisy, "\n".join(noisy)
