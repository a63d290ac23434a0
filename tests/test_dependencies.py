"""Every dependency in pyproject.toml is used: imported by the package or its tests (or, for the
few that are tools or named by string, used where they say)."""

from __future__ import annotations

import ast
import re
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("rl_tformers", "agents", "envs", "tests", "scripts")

#: dependencies used without an import statement, and the text in the file that uses them
NOT_IMPORTED = {
    "ruff": ("Makefile", "ruff check"),  # the linter of `make lint`
    "pytest-timeout": ("pyproject.toml", "timeout = "),  # a pytest plugin configured in pyproject.toml
    "sb3-contrib": ("envs/policies.py", '("sb3_contrib", '),  # imported by name from the algorithm table
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> dict[str, str]:
    """Normalised distribution name -> where pyproject.toml lists it (main or an extra)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for where, reqs in {"dependencies": project["dependencies"], **{
            f"[{k}]": v for k, v in project.get("optional-dependencies", {}).items()}}.items():
        for r in reqs:
            out.setdefault(_norm(re.match(r"[A-Za-z0-9_.-]+", r).group()), where)
    return out


def _imported_modules() -> set[str]:
    names = set()
    for folder in SOURCES:
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def test_every_dependency_is_imported_or_used_where_it_says():
    modules: dict[str, set[str]] = {}
    for module, dists in packages_distributions().items():
        for d in dists:
            modules.setdefault(_norm(d), set()).add(module)
    imported = _imported_modules()
    unused = []
    for dist, where in _requirements().items():
        if dist in NOT_IMPORTED:
            path, text = NOT_IMPORTED[dist]
            assert text in (ROOT / path).read_text(), f"{dist}: {text!r} not in {path}"
            continue
        # an extra that is not installed here (ray): its import name is its distribution name
        if not (modules.get(dist, {dist.replace("-", "_")}) & imported):
            unused.append(f"{dist} ({where})")
    assert unused == [], f"listed in pyproject.toml but never imported: {unused}"
