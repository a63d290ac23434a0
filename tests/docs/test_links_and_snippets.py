"""Links, anchors and code snippets of the README and docs/*.md: every relative link and anchor
resolves, every YAML block is a valid backbone config, every Python block parses and its imports
and keyword arguments exist, and the examples' printed values are what the code prints."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from tests.docs.markdown import DOCS, REPO, fenced_blocks, prose


# -- links and anchors ------------------------------------------------------------------------
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


# -- YAML and Python snippets -----------------------------------------------------------------
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
