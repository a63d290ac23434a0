"""The package's import graph: no cycles, imports only in the allowed directions, imports at the top.

The graph is built with ``ast`` from the source files of ``rl_tformers`` (``rl_tformers/``),
``rl_tformers.agents`` (``agents/``) and ``rl_tformers.envs`` (``envs/``); every import counts,
including those written inside functions. ``from pkg import name`` is an edge to the module
``pkg.name`` when that is a module of the package, else to ``pkg``.

Layers and the directions they may import (``cli -> runtime -> backbone``):

- backbone library (``rl_tformers.*`` except ``runtime``, ``cli``, ``bench``): no agents, envs,
  runtime, cli or bench;
- runtime (``rl_tformers.runtime``): no agents, cli or bench (the agent registry finds the
  built-in agents by package name at run time, as it finds plugins);
- envs (``rl_tformers.envs``): no agents, cli or bench, and of the runtime only the utilities
  ``runtime.paths`` and ``runtime.progress``;
- agents (``rl_tformers.agents``): no cli or bench;
- bench (``rl_tformers.bench``): no cli (the ``bench`` command group imports the benchmarks).

Imports inside functions are allowed only for the optional or heavy dependencies in
:data:`DEFERRED_OK`, in ``rl_tformers.cli`` (a command loads its code when it runs, so that
``rl-tformers --help`` stays fast), in the peer benchmark scripts ``rl_tformers.bench._peer_*``
(standalone programs run in another library's environment, d3rlpy's or Hugging Face's, which
import that library where its code is used), or with a comment on the import's line or on the
line above its block of consecutive imports saying why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rl_tformers": ROOT / "rl_tformers", "rl_tformers.agents": ROOT / "agents",
            "rl_tformers.envs": ROOT / "envs"}

#: top-level modules an import inside a function may name without a comment: optional extras
#: and dependencies that cost seconds to import and serve one command or one option
DEFERRED_OK = frozenset({"faiss", "ray", "matplotlib", "tensorboard", "d3rlpy", "transformers", "stable_baselines3",
                         "minari", "h5py", "mujoco"})

#: (importing layer, imported layer) pairs that are refused
FORBIDDEN = {
    ("backbone", "agents"), ("backbone", "envs"), ("backbone", "runtime"), ("backbone", "cli"), ("backbone", "bench"),
    ("runtime", "agents"), ("runtime", "cli"), ("runtime", "bench"),
    ("envs", "agents"), ("envs", "cli"), ("envs", "bench"),
    ("agents", "cli"), ("agents", "bench"), ("bench", "cli"),
}
#: runtime modules envs may use
ENVS_MAY_USE = frozenset({"rl_tformers.runtime.paths", "rl_tformers.runtime.progress"})


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if prefix == "rl_tformers" and parts and parts[0] in ("agents", "envs", "configs"):
                continue  # links or data, not modules of the backbone package
            mods[".".join([prefix, *parts])] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The package module ``name`` (a module or an attribute path) belongs to, or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[tuple[ast.stmt, list[str], bool]]:
    """``(statement, imported names, inside a function)`` for every import of ``module``."""
    is_pkg = path.name == "__init__.py"

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.stmt, list[str], bool]]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                yield child, [a.name for a in child.names], inside
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_pkg else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                subs = [f"{mod}.{a.name}" for a in child.names if f"{mod}.{a.name}" in MODULES]
                yield child, subs if len(subs) == len(child.names) else [mod, *subs], inside
            yield from walk(child, inside)

    yield from walk(ast.parse(path.read_text()), False)


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        out = edges.setdefault(module, set())
        for _, names, _ in _imports(module, path):
            out.update(o for o in map(_owner, names) if o is not None and o != module)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(module: str) -> str:
    """``agents``, ``envs``, ``runtime``, ``cli``, ``bench`` or ``backbone``."""
    for name in ("agents", "envs", "runtime", "cli", "bench"):
        if module == f"rl_tformers.{name}" or module.startswith(f"rl_tformers.{name}."):
            return name
    return "backbone"


def test_the_graph_covers_every_layer() -> None:
    layers = {layer(m) for m in MODULES}
    assert layers == {"agents", "envs", "runtime", "cli", "bench", "backbone"}
    edges = _graph()
    assert "rl_tformers.runtime.protocol" in edges["rl_tformers.runtime.evaluation"]


def test_there_is_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles (each line: the modules of one cycle):\n" + "\n".join(
        ", ".join(c) for c in cycles)


def test_the_cycle_finder_reports_the_modules_of_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_go_only_in_the_allowed_directions() -> None:
    bad = []
    for module, targets in _graph().items():
        for target in sorted(targets):
            pair = (layer(module), layer(target))
            if pair in FORBIDDEN or (pair == ("envs", "runtime") and target not in ENVS_MAY_USE):
                bad.append(f"{module} -> {target}")
    assert bad == []


def test_imports_inside_functions_are_optional_dependencies_or_say_why() -> None:
    bad = []
    for module, path in MODULES.items():
        if layer(module) == "cli" or module.startswith("rl_tformers.bench._peer_"):
            continue
        lines = path.read_text().splitlines()
        for stmt, names, inside in _imports(module, path):
            if not inside:
                continue
            top = names[0].split(".")[0] if names else ""
            above = stmt.lineno - 2  # the line above the block of consecutive imports it belongs to
            while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
                above -= 1
            prev = lines[above].strip() if above >= 0 else ""
            if top in DEFERRED_OK or "#" in lines[stmt.lineno - 1] or prev.startswith("#"):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{stmt.lineno}: {names[0]}")
    assert bad == [], f"{len(bad)} imports inside functions without a reason:\n" + "\n".join(bad)
