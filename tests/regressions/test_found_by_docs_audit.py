"""What the documentation audit checks mechanically: the README and docs/*.md stay executable.

Every shell block is run by bash with every external command replaced by a recorder, so loops,
variables and continuation lines expand as a user's shell would expand them; each recorded
``rl-tformers`` call must parse with the CLI's own Typer app (its options exist) and every
``train``/``sweep`` config must compose. Links and anchors resolve, prose flags and config keys
exist, YAML and Python snippets are valid (configs build, imports and keyword arguments exist),
the README feature table lists the registered kinds, and the performance numbers of the README
and docs/performance.md equal the JSON files in docs/performance/ they are copied from.

Nothing here trains or evaluates; the whole file runs in about ten seconds on 2 busy cores.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

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

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PERF = REPO / "docs" / "performance"
ROOT_CMD = typer.main.get_command(app)
BASH = shutil.which("bash") or "/bin/bash"

FENCE_OPEN = re.compile(r"^(\s*)```(\w*)\s*$")
FENCE_CLOSE = re.compile(r"^\s*```\s*$")


# -- markdown ------------------------------------------------------------------------------------
def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, body) of every fenced block, indented ones too."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, j, body = m.group(1), m.group(2), i + 1, []
        while j < len(lines) and not FENCE_CLOSE.match(lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append((i + 1, lang, "\n".join(body)))
        i = j + 1
    return out


def prose(path: Path) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"(?ms)^\s*```.*?^\s*```[ \t]*$", "", path.read_text())


def inline_code(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(path).replace("\n", " "))


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    out = []
    for line, lang, body in fenced_blocks(path):
        first = next((ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
        if lang == "bash" or (lang == "" and first.startswith(("rl-tformers ", "python "))):
            out.append((line, body))
    return out


# bash runs the block with an empty PATH: every external command (rl-tformers, python, make...)
# lands in command_not_found_handle, which records its expanded argv instead of running it.
_RECORDER = (
    'command_not_found_handle() { printf \'%s\\0\' "$@" >> "$LOG"; printf \'\\n\' >> "$LOG"; return 0; }\n'
)


def recorded_commands(body: str, tmp: Path) -> list[list[str]]:
    log = tmp / "argv.log"
    log.write_bytes(b"")
    env = {"PATH": str(tmp / "no-bin"), "LOG": str(log), "HOME": str(tmp)}
    subprocess.run([BASH, "-c", _RECORDER + body], cwd=tmp, env=env, capture_output=True, timeout=60)
    return [c.split("\0") for c in log.read_text().split("\0\n") if c.strip()]


_SHELL_CACHE: dict[str, list[list[str]]] = {}


def doc_commands(tmp_path_factory) -> list[tuple[str, list[str]]]:
    """(``file:line``, argv) of every external command the docs' shell blocks run."""
    out = []
    for path in DOCS:
        for line, body in shell_blocks(path):
            if body not in _SHELL_CACHE:
                _SHELL_CACHE[body] = recorded_commands(body, tmp_path_factory.mktemp("sh"))
            out += [(f"{path.relative_to(REPO)}:{line}", argv) for argv in _SHELL_CACHE[body]]
    return out


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

    known |= set(walk(ROOT_CMD)) | {"--help"}
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
    known |= {f"dataset.{k}" for k in DatasetConfig.__dataclass_fields__} | {"backbone.ffn_chunks"}
    known |= {f"backbone.{slot}.kind" for slot in ("attention", "position", "memory", "block", "depth")}
    known |= {f"backbone.{slot}" for slot in ("attention", "position", "memory", "block", "depth")}
    from rl_tformers.registry import REGISTRIES, SLOTS

    # any registered kind's field (a doc may name the field of a kind no shipped config uses)
    known |= {f"backbone.{slot}.{name}" for slot in SLOTS for e in REGISTRIES[slot] for name in e.fields()}
    bad = []
    for path in DOCS:
        for key in re.findall(
            r"(?<![\w./-])((?:agent|backbone|dataset|train|eval)\.[a-z_]\w*(?:\.[a-z_]\w*)*)", prose(path)
        ):
            if key not in known and key not in NOT_KEYS and not key.endswith((".py", ".json")):
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
    """README: `-c dt/hopper_medium dataset.path=rlt/$t-v5/medium-v0` resolves to the same config."""
    for algo, task in itertools.product(("dt", "bc"), ("walker2d", "halfcheetah")):
        a = to_container(compose(f"{algo}/{task}_medium"))
        b = to_container(compose(f"{algo}/hopper_medium", [f"dataset.path=rlt/{task}-v5/medium-v0"]))
        assert a == b, (algo, task)


# -- 3. links and anchors ------------------------------------------------------------------------
def github_anchors(path: Path) -> set[str]:
    seen: dict[str, int] = defaultdict(int)
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose(path), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def test_relative_links_and_anchors_resolve() -> None:
    bad, n = [], 0
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            n += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                bad.append(f"{path.name}: ({target}): no file {dest.relative_to(REPO)}")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest):
                bad.append(f"{path.name}: ({target}): no heading #{anchor} in {dest.name}")
    assert n > 20 and not bad, "\n".join(bad)


# -- 4. feature table = registry -----------------------------------------------------------------
def registered_kinds() -> dict[str, set[str]]:
    r = CliRunner().invoke(app, ["backbones", "--json"])
    assert r.exit_code == 0, r.output
    kinds: dict[str, set[str]] = defaultdict(set)
    for entry in json.loads(r.output):
        kinds[entry["slot"]].add(entry["kind"])
    return kinds


def test_readme_feature_table_lists_every_registered_kind_and_nothing_else() -> None:
    readme = (REPO / "README.md").read_text()
    kinds = registered_kinds()
    for label, slot in (
        ("Attention", "attention"),
        ("Positions", "position"),
        ("Memory", "memory"),
        ("Blocks", "block"),
        ("Depth", "depth"),
    ):
        m = re.search(rf"^\| \*\*{label}\*\* \((\d+)[^)]*\) \| (.*) \|$", readme, re.M)
        assert m, label
        listed = set(re.findall(r"`(\w+)`", m.group(2)))
        assert listed == kinds[slot], (label, sorted(listed ^ kinds[slot]))
        assert int(m.group(1)) == len(kinds[slot]), label


def test_dt_mode_table_matches_the_attention_capabilities() -> None:
    r = CliRunner().invoke(app, ["backbones", "--json", "--slot", "attention"])
    causal = {e["kind"]: e["capabilities"]["causal"] for e in json.loads(r.output)}
    text = (REPO / "docs/dt.md").read_text()
    with_causal = set(re.search(r"^\| `causal` \(([^)]*)\)", text, re.M).group(1).split(", "))
    without = set(re.search(r"^\| no causal form \(([^)]*)\)", text, re.M).group(1).split(", "))
    assert with_causal == {k for k, c in causal.items() if c}
    assert without == {k for k, c in causal.items() if not c}


# -- 5. README numbers = the JSON they are copied from -------------------------------------------
def _load(name: str) -> dict:
    return json.loads((PERF / name).read_text())


def _rate(d: dict, impl: str, mode: str) -> dict:
    return next(r for r in d["rows"] if r["impl"] == impl and r["mode"] == mode)


def _ratio(d: dict, mode: str, impl: str, vs: str) -> float:
    return next(r["ratio"] for r in d["ratios"] if (r["mode"], r["impl"], r["vs"]) == (mode, impl, vs))


def readme_performance_claims() -> list[str]:
    q, t2, t1 = (
        _load("bench_train_t1_quiet.json"),
        _load("bench_train_t2_quiet.json"),
        _load("bench_train_t1.json"),
    )
    early, prof = _load("bench_train_t1_quiet_earlier.json"), _load("profile_ours_quiet.json")
    ev, data, ddp = _load("bench_eval.json"), _load("bench_data.json"), _load("ddp_throughput_quiet.json")
    ours, d3 = _rate(q, "ours", "e2e"), _rate(q, "d3rlpy", "e2e")
    peak = q["peak_gflops"]["fp32"]
    peers_mfu = [
        _rate(q, "d3rlpy", "e2e")["mfu"],
        _rate(q, "d3rlpy", "model")["mfu"],
        _rate(q, "hf", "model")["mfu"],
    ]
    matmul = prof["categories"]["matmul"]
    mem = {(m["kind"], m["mem_len"]): m["reencode_over_memory"] for m in ev["memory"]}
    win, seg = data["samplers"]
    eager, lazy = data["load"]
    u = ddp["updates_per_s"]
    return [
        f"load {q['machine']['loadavg_1_5_15'][0]:.2f} at the start, {q['machine']['loadavg_1_5_15_end'][0]:.2f} at the end",
        f"| **ours / d3rlpy** | **{_ratio(q, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({ours['steps_per_s']:.2f} vs "
        f"{d3['steps_per_s']:.2f}/s) | **{_ratio(q, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours / Hugging Face | – | {_ratio(q, 'model', 'ours', 'hf'):.2f}x |",
        f"| ours + bf16 autocast / d3rlpy | **{_ratio(q, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x** | "
        f"{_ratio(q, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"| ours + `torch.compile` / ours | {_ratio(q, 'e2e', 'ours+compile', 'ours'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+compile', 'ours'):.2f}x |",
        f"ours / d3rlpy **{_ratio(t2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({_rate(t2, 'ours', 'e2e')['steps_per_s']:.2f} vs "
        f"{_rate(t2, 'd3rlpy', 'e2e')['steps_per_s']:.2f}/s), ours / Hugging Face {_ratio(t2, 'model', 'ours', 'hf'):.2f}x",
        f"{d3['flops_per_step'] / 1e9:.2f} → {ours['flops_per_step'] / 1e9:.2f} GFLOP per update",
        f"**MFU: {ours['mfu']:.0%}** ({ours['flops_per_step'] / 1e9:.2f} GFLOP x {ours['steps_per_s']:.2f}/s = "
        f"{ours['gflops_per_s']:.1f} GFLOP/s against a 1-thread fp32 matmul peak\nof {peak:.1f} GFLOP/s",
        f"the peers {round(100 * min(peers_mfu))}-{max(peers_mfu):.0%} of the same peak on their {d3['flops_per_step'] / 1e9:.2f}\nGFLOP",
        f"ours would be {ours['steps_per_s'] * d3['flops_per_step'] / 1e9 / peak:.0%} counted at the peers' FLOPs",
        f"MFU is {ours['mfu']:.0%}, not 50%",
        f"About {matmul['share']:.0%} of an update is the same MKL GEMMs the\npeers use, at about "
        f"{ours['flops_per_step'] / 1e9 / (matmul['ms'] / 1e3) / peak:.0%} of the peak",
        f"dropout random numbers: {prof['categories']['dropout RNG']['share']:.0%} alone",
        f"we would be at most {_ratio(q, 'e2e', 'ours', 'd3rlpy') / matmul['share']:.1f}x d3rlpy",
        f"({_ratio(early, 'e2e', 'ours', 'd3rlpy'):.2f}x / {_ratio(early, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x / MFU "
        f"{_rate(early, 'ours', 'e2e')['mfu']:.0%} quiet, {_ratio(t1, 'e2e', 'ours', 'd3rlpy'):.2f}x /\n"
        f"{_ratio(t1, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x under load {t1['machine']['loadavg_1_5_15'][0]:.0f})",
        f"**{ev['batched_over_sequential']:.2f}x** env\nsteps/s",
        f"**{mem[('xl', 32)]:.1f}x at M = 32 to {min(mem[('xl', 512)], mem[('gtrxl', 512)]):.0f}-"
        f"{max(mem[('xl', 512)], mem[('gtrxl', 512)]):.0f}x at M = 512**",
        f"the window sampler delivers {win['sampler_samples_per_s']:,.0f} samples/s and the segment sampler "
        f"{seg['sampler_samples_per_s']:,.0f}, against\n{win['training_samples_per_s']:.0f} and "
        f"{seg['training_samples_per_s']:.0f} consumed by training (**>{min(win['headroom'], seg['headroom']) // 10 * 10:.0f}x headroom**)",
        f"loads and validates in\n{eager['load_s']:.2f} s ({lazy['load_s']:.2f} s lazily)",
        f"trains at {u['p1t1']:.2f} updates/s in one\n1-thread process, {u['p1t2']:.2f} with 2 threads and "
        f"**{u['p2t1']:.2f} with `--nproc 2`** ({ddp['ratio_to_p1t1']['p2t1']:.2f}x;",
    ]


def amd_performance_claims() -> list[str]:
    """The README's numbers of the AMD EPYC host (oneDNN GEMMs through ``cpu_matmul: auto``)."""
    q, t2, prof = _load("bench_train_t1_amd.json"), _load("bench_train_t2_amd.json"), _load("profile_ours_amd.json")
    o, d3 = _rate(q, "ours", "e2e"), _rate(q, "d3rlpy", "e2e")
    peak, mkl_peak = q["peak_gflops"]["fp32"], max(q["peak_gflops_by_size"]["fp32"].values())
    peers = [_rate(q, "d3rlpy", "e2e")["mfu"], _rate(q, "d3rlpy", "model")["mfu"], _rate(q, "hf", "model")["mfu"]]
    mm, ops = prof["categories"]["matmul"], dict(prof["top_ops"])
    e2e = _ratio(q, "e2e", "ours", "d3rlpy")
    return [
        f"load {q['machine']['loadavg_1_5_15'][0]:.2f} at the start, {q['machine']['loadavg_1_5_15_end'][0]:.2f} at the end; "
        f"`docs/performance/bench_train_t1_amd.json`",
        f"| **ours / d3rlpy** | **{e2e:.2f}x** ({o['steps_per_s']:.2f} vs {d3['steps_per_s']:.2f}/s) | "
        f"**{_ratio(q, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours / Hugging Face | – | {_ratio(q, 'model', 'ours', 'hf'):.2f}x |",
        f"| ours with PyTorch's MKL GEMMs (`cpu_matmul=mkl`) / d3rlpy | {_ratio(q, 'e2e', 'ours+mkl', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+mkl', 'd3rlpy'):.2f}x |",
        f"| ours + bf16 autocast / d3rlpy | {_ratio(q, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"| ours + `torch.compile` / ours | {_ratio(q, 'e2e', 'ours+compile', 'ours'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+compile', 'ours'):.2f}x |",
        f"ours / d3rlpy **{_ratio(t2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({_rate(t2, 'ours', 'e2e')['steps_per_s']:.2f} vs "
        f"{_rate(t2, 'd3rlpy', 'e2e')['steps_per_s']:.2f}/s), ours / Hugging Face {_ratio(t2, 'model', 'ours', 'hf'):.2f}x",
        f"Most of the step from {_ratio(q, 'e2e', 'ours+mkl', 'd3rlpy'):.2f}x to {e2e:.2f}x",
        f"(1-thread SGEMM {mkl_peak:.0f} GFLOP/s here)", f"reaches {peak:.1f} GFLOP/s (`rl-tformers bench gemm`",
        f"**MFU: {o['mfu']:.0%}** (11.91 GFLOP x {o['steps_per_s']:.2f}/s = {o['gflops_per_s']:.1f} GFLOP/s against a "
        f"1-thread fp32 matmul peak of {peak:.1f} GFLOP/s",
        f"the peers {round(100 * min(peers))}-{max(peers):.0%} of the same peak; ours would be "
        f"{o['steps_per_s'] * d3['flops_per_step'] / 1e9 / peak:.0%} counted at the peers' FLOPs",
        f"1.5x d3rlpy met in fp32 ({e2e:.2f}x); MFU {o['mfu']:.0%}, not 50%.",
        f"the GEMMs take {mm['share']:.0%} of an update and run at "
        f"{o['flops_per_step'] / 1e9 / (mm['ms'] / 1e3) / peak:.0%} of the peak",
        f"dropout random numbers ({prof['categories']['dropout RNG']['share']:.0%})",
        f"{ops['aten::copy_']:.0f} of {prof['profiled_ms_per_update']:.0f} ms per update",
    ]


def test_readme_amd_performance_numbers_equal_their_json() -> None:
    readme = _flat((REPO / "README.md").read_text())
    missing = "\n".join(claim for claim in amd_performance_claims() if _flat(claim) not in readme)
    assert not missing, f"README text not found (numbers differ from docs/performance/*_amd.json):\n{missing}"


def _flat(s: str) -> str:
    return re.sub(r"\s+", " ", s)


def test_readme_performance_numbers_equal_their_json() -> None:
    readme = _flat((REPO / "README.md").read_text())
    missing = "\n".join(claim for claim in readme_performance_claims() if _flat(claim) not in readme)
    assert not missing, f"README text not found (numbers differ from docs/performance/*.json):\n{missing}"


def test_performance_profile_table_equals_its_json() -> None:
    before, after = _load("profile_ours_before.json")["categories"], _load("profile_ours.json")["categories"]
    rows = {  # table row -> profiler categories summed
        "matmul (`mm`, `addmm`, `bmm`, `baddbmm`)": ["matmul"],
        "elementwise (ReLU and its backward, adds, dropout/mask multiplies)": ["elementwise"],
        "dropout random numbers (`bernoulli_`)": ["dropout RNG"],
        "other (copies, views, Python)": ["other"],
        "bias copies inside `addmm`": ["addmm bias copy"],
        "LayerNorm": ["norm"],
        "reductions, softmax": ["reduction", "softmax"],
        "AdamW (fused)": ["optimizer"],
    }
    text = (REPO / "docs/performance.md").read_text()
    for row, cats in rows.items():
        b = sum(before[c]["share"] for c in cats)
        ms = sum(after[c]["ms"] for c in cats)
        a = sum(after[c]["share"] for c in cats)
        a_txt = f"{a:.1%}" if a < 0.01 else f"{a:.0%}"
        expected = f"| {row} | {b:.0%} | {ms:.0f} | {a_txt} |"
        assert expected in text, expected


def test_data_md_dataset_info_example_is_the_command_s_output() -> None:
    from rl_tformers.envs.loaders import load_dataset

    dataset = "rlt/hopper-v5/medium-positions-v0"
    try:
        load_dataset(dataset, root=REPO / "data" / "minari", validate=False)
    except Exception:  # noqa: BLE001 - data/ is built locally (rl-tformers collect), not shipped
        pytest.skip(f"{dataset} is not built here (rl-tformers collect --recipe hopper-medium-positions)")
    shown = next(json.loads(b) for _, lang, b in fenced_blocks(REPO / "docs/data.md") if lang == "json")
    r = CliRunner().invoke(
        app, ["dataset", "info", dataset, "--json", "--root", str(REPO / "data" / "minari")]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == shown


# -- 6. YAML and Python snippets -----------------------------------------------------------------
def test_yaml_blocks_are_valid_backbone_configs() -> None:
    """Every YAML block loads (no duplicate keys) and its ``backbone:`` builds; the commented
    alternatives (``# attention: {...}``) are valid slot configs too."""
    import yaml
    from omegaconf import OmegaConf

    from rl_tformers import Backbone
    from rl_tformers.backbone_config import BackboneConfig

    n = 0
    for path in DOCS:
        for line, lang, body in fenced_blocks(path):
            if lang != "yaml":
                continue
            n += 1
            backbone = OmegaConf.to_container(OmegaConf.create(body))["backbone"]
            Backbone(BackboneConfig.from_dict(backbone, where=f"{path.name}:{line}: backbone"))
            for alt in re.findall(
                r"^\s*# ((?:backbone|attention|position|memory|block|depth): \{.*\})", body, re.M
            ):
                layer = yaml.safe_load(alt)
                BackboneConfig.from_dict(
                    {**backbone, **layer.get("backbone", layer)}, where=f"{path.name}: {alt}"
                )
    assert n >= 5


def test_python_blocks_parse_and_their_imports_and_keywords_exist() -> None:
    import ast
    import importlib
    import inspect

    bad, n = [], 0
    for path in DOCS:
        for line, lang, body in fenced_blocks(path):
            if lang != "python":
                continue
            n += 1
            tree = ast.parse(body, filename=f"{path.name}:{line}")
            names = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rl_tformers"):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        if not hasattr(module, alias.name):
                            bad.append(
                                f"{path.name}:{line}: from {node.module} import {alias.name}: no such name"
                            )
                        else:
                            names[alias.asname or alias.name] = getattr(module, alias.name)
            for node in ast.walk(tree):  # keyword arguments of calls to what the block imports
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                    try:
                        inspect.signature(names[node.func.id]).bind_partial(
                            *[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg}
                        )
                    except TypeError as exc:
                        bad.append(f"{path.name}:{line}: {ast.unparse(node)[:80]}: {exc}")
    assert n >= 6 and not bad, "\n".join(bad)


def test_data_md_trajectory_examples_print_what_the_comments_say() -> None:
    from rl_tformers.envs.trajectory import next_return_to_go, returns_to_go

    text = (REPO / "docs/data.md").read_text()
    assert "returns_to_go([1, 2, 3, 4, 5])             # [15, 14, 12, 9, 5]" in text
    assert returns_to_go([1, 2, 3, 4, 5]).tolist() == [15, 14, 12, 9, 5]
    assert "returns_to_go([1, 1, 1], gamma=0.5)        # [1.75, 1.5, 1.0]" in text
    assert returns_to_go([1, 1, 1], gamma=0.5).tolist() == [1.75, 1.5, 1.0]
    assert (
        "next_return_to_go(15.0, 1.0)               # 14.0" in text and next_return_to_go(15.0, 1.0) == 14.0
    )


def performance_md_claims() -> list[str]:
    out = []
    for name, bold_mfu, hf_note in (
        ("bench_train_t1_quiet.json", True, " (model)"),
        ("bench_train_t1.json", False, ""),
    ):
        d = _load(name)

        def row(impl, d=d):
            e2e, model = _rate(d, impl, "e2e") if impl != "hf" else None, _rate(d, impl, "model")
            return e2e, model, f"{model['flops_per_step'] / 1e9:.2f}"

        e, m, gf = row("ours")
        mfu = f"**{e['mfu']:.0%}**" if bold_mfu else f"{e['mfu']:.0%}"
        out.append(
            f"| **ours** (shipped `dt/hopper_medium`) | **{e['steps_per_s']:.2f}** | **{m['steps_per_s']:.2f}** | {gf} | {mfu} |"
        )
        for impl, label, peak in (("ours+bf16", "ours + `train.amp=bf16`", " of the bf16 peak"),
                                  ("ours+compile", "ours + `train.compile=true`", ""),
                                  ("d3rlpy", "d3rlpy 2.8.1", "")):
            e, m, gf = row(impl)
            out.append(f"| {label} | {e['steps_per_s']:.2f} | {m['steps_per_s']:.2f} | {gf} | {e['mfu']:.0%}{peak} |")
        _, m, gf = row("hf")
        out.append(f"| Hugging Face 5.24 | – | {m['steps_per_s']:.2f} | {gf} | {m['mfu']:.0%}{hf_note} |")
    ev, data, ddp = _load("bench_eval.json"), _load("bench_data.json"), _load("ddp_throughput_quiet.json")
    for r in ev["rollouts"]:
        out.append(
            f"| {r['n_envs']} | {r['env_steps']} | {r['seconds']:.1f} | {r['env_steps_per_s']:.0f} | {r['return_mean']:.1f} |"
        )
    names = {"xl": "Transformer-XL (pre-norm)", "gtrxl": "GTrXL (gated)"}
    for m in ev["memory"]:
        out.append(
            f"| {names[m['kind']]} | {m['mem_len']} | {m['memory_ms_per_step']:.2f} | "
            f"{m['reencode_ms_per_step']:.2f} | {m['reencode_over_memory']:.1f}x |"
        )
    for s in data["samplers"]:
        out.append(
            f"| {s['sampler_samples_per_s']:,.0f} | {s['training_samples_per_s']:.0f} | {s['headroom']:.0f}x |"
        )
    for r in data["load"]:
        out.append(f"| {r['load_s']:.2f} s | {r['first_batch_s']:.2f} s |")
    u, x = ddp["updates_per_s"], ddp["ratio_to_p1t1"]
    out += [
        f"| one process, 1 thread | {u['p1t1']:.2f} | 1 |",
        f"| one process, 2 threads (`OMP_NUM_THREADS=2`) | {u['p1t2']:.2f} | {x['p1t2']:.2f}x |",
        f"| **{u['p2t1']:.2f}** | **{x['p2t1']:.2f}x** |",
    ]
    return out


def test_performance_md_tables_equal_their_json() -> None:
    text = (REPO / "docs/performance.md").read_text()
    missing = "\n".join(claim for claim in performance_md_claims() if claim not in text)
    assert not missing, f"docs/performance.md rows not found (numbers differ from their JSON):\n{missing}"


# --- code defects the audit found in the documented `python -m` tools ---------------------------


@pytest.mark.parametrize("module", ["rl_tformers.bench.attention_rl", "rl_tformers.envs.memory_tasks"])
def test_documented_python_m_tools_accept_h(module: str) -> None:
    """``-h`` printed "No such option: -h" (memory_tasks) or a FileNotFoundError traceback for a
    run folder named ``--help`` (attention_rl); both now show usage like ``rl-tformers -h``."""
    import sys

    r = subprocess.run([sys.executable, "-m", module, "-h"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"Usage: python -m {module}" in r.stdout and "Traceback" not in r.stderr


def test_attention_rl_table_names_a_bad_work_dir_without_a_traceback(tmp_path: Path) -> None:
    import sys

    from rl_tformers.runtime.trainer import train

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
    """The list of fitting kernels was only in the Python builder's message, which the CLI never
    reached (the general compatibility check refused first, naming no alternative)."""
    r = CliRunner().invoke(app, ["train", "-c", "gtrxl/recall_bc", "backbone.attention.kind=sinkhorn"])
    assert r.exit_code == 2
    assert r.stderr.startswith(
        "error: backbone.memory.kind='xl' needs an attention kernel that accepts memory keys; "
        "backbone.attention.kind='sinkhorn' does not; kernels that do (with backbone.position.kind='xl_relative'): "
        "adaptive_span, fixed, local, local_2d, reference, sdpa, sliding_window, strided"
    ), r.stderr
