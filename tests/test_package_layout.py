"""The package imports from a source checkout without being installed.

``agents/``, ``envs/`` and ``configs/`` sit at the top level of the repository and an install maps
them to ``rl_tformers.agents`` / ``.envs`` / ``.configs``; ``rl_tformers/__init__.py`` maps the same
names when the package is imported straight from the checkout (``PYTHONPATH=<checkout>``), e.g. on
a machine that receives only the working tree and its dependencies' wheels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs under -I (no PYTHON* variables, no user site, no script folder on sys.path) with this
# interpreter's sys.path (where the dependencies are, PYTHONPATH included) passed explicitly and,
# before any import of the package, drops every trace of an installed copy: the finders of an
# editable install ("__editable__..." modules, set up by .pth files) and any sys.path entry holding
# an installed rl_tformers. Only the checkout, put first on sys.path, can then provide it.
PROBE = r"""
import importlib.resources, importlib.util, json, os, sys
repo, parent_path = sys.argv[1], json.loads(sys.argv[2])
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", type(f).__module__).startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path[:] = [p for p in parent_path if p and not os.path.isdir(os.path.join(p, "rl_tformers"))]
sys.path.insert(0, repo)
sys.path_importer_cache.clear()
import rl_tformers.agents, rl_tformers.envs, rl_tformers.configs
import rl_tformers.agents.decision_transformer.agent
import rl_tformers.envs.dataset
print(json.dumps({
    "rl_tformers": rl_tformers.__file__,
    "agents": rl_tformers.agents.__file__,
    "envs": rl_tformers.envs.__file__,
    "configs": rl_tformers.configs.__file__,
    "dt_agent": rl_tformers.agents.decision_transformer.agent.__file__,
    "envs_dataset": rl_tformers.envs.dataset.__file__,
    "configs_files": str(importlib.resources.files("rl_tformers.configs")),
    "others": {name: importlib.util.find_spec("rl_tformers." + name) is not None
               for name in ("tests", "setup", "scripts", "docs")},
}))
"""


def test_source_checkout_maps_agents_envs_configs() -> None:
    r = subprocess.run([sys.executable, "-I", "-c", PROBE, str(REPO), json.dumps(sys.path)], capture_output=True, text=True,
                       cwd=REPO / "tests", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {
        "rl_tformers": str(REPO / "rl_tformers" / "__init__.py"),
        "agents": str(REPO / "agents" / "__init__.py"),
        "envs": str(REPO / "envs" / "__init__.py"),
        "configs": str(REPO / "configs" / "__init__.py"),
        "dt_agent": str(REPO / "agents" / "decision_transformer" / "agent.py"),
        "envs_dataset": str(REPO / "envs" / "dataset.py"),
        "configs_files": str(REPO / "configs"),
        "others": {"tests": False, "setup": False, "scripts": False, "docs": False},
    }


def test_test_file_names_are_unique_across_folders() -> None:
    """The test folders are not packages, so pytest imports each file under its base name: two
    files of one name in different folders stop the whole suite at collection."""
    from collections import Counter

    names = Counter(p.name for p in Path(__file__).resolve().parent.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]
