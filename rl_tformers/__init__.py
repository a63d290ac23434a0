"""rl-tformers backbone library: every attention, positional, memory and adaptive-computation
variant of "The Transformer Family v2.0" (Weng 2023) behind one interface.

    >>> from rl_tformers import Backbone
    >>> bb = Backbone({"d_model": 64, "n_layers": 2, "n_heads": 4,
    ...                "attention": {"kind": "sdpa"}, "position": {"kind": "rotary"}})

Nothing RL-specific lives here; the agents are in ``rl_tformers.agents`` and datasets and
environments in ``rl_tformers.envs``.
"""

__version__ = "0.1.0"


def _map_checkout_packages() -> None:
    """Make ``rl_tformers.agents``, ``.envs`` and ``.configs`` importable from a source checkout.

    The repository keeps ``agents/``, ``envs/`` and ``configs/`` at its top level; an install
    maps them to ``rl_tformers.agents`` / ``.envs`` / ``.configs`` (``package-dir`` in
    pyproject.toml). Run from the checkout without installing it (``PYTHONPATH=<checkout>``, as
    on a machine that only receives the working tree), those names would not exist, so when the
    folder beside this package holds them, a finder placed *last* on ``sys.meta_path`` maps
    exactly these three names to those folders: the files an install maps, and nothing else of
    the checkout (``tests``, ``setup.py``...) under ``rl_tformers``. An install's own finder comes
    first and wins; on an installed copy (no such folders beside it) nothing is added.
    """
    # standard library only, at the one place it is needed: this runs while the package is imported
    import sys
    from importlib.util import spec_from_file_location
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {f"{__name__}.{top}": root / top for top in ("agents", "envs", "configs")}
    if not all((d / "__init__.py").is_file() for d in folders.values()):
        return
    if any(getattr(f, "rl_tformers_checkout", False) for f in sys.meta_path):
        return

    class CheckoutFinder:
        rl_tformers_checkout = True

        @staticmethod
        def find_spec(fullname, path=None, target=None):
            folder = folders.get(fullname)
            if folder is None:
                return None
            return spec_from_file_location(fullname, folder / "__init__.py",
                                           submodule_search_locations=[str(folder)])

    sys.meta_path.append(CheckoutFinder())


_map_checkout_packages()

# Register every component (each slot package imports its modules).
from rl_tformers import attention, blocks, depth, memory, position  # noqa: E402,F401
from rl_tformers.backbone import Backbone, IncompatibleConfig  # noqa: E402
from rl_tformers.backbone_config import BackboneConfig  # noqa: E402
from rl_tformers.types import BackboneOutput, BackboneState  # noqa: E402


def __getattr__(name: str):
    """``rl_tformers.Policy``: the deployed policy of a policy folder
    (:class:`rl_tformers.agents.export.Policy`, docs/deployment.md), imported on first use. It
    rebuilds the agents' models, so the backbone library finds it by package name at run time,
    as the runtime finds the agents."""
    if name == "Policy":
        import importlib  # standard library, at the one place it is needed (a lazy attribute)

        return importlib.import_module("rl_tformers.agents.export").Policy
    raise AttributeError(f"module 'rl_tformers' has no attribute {name!r}")


__all__ = ["Backbone", "BackboneConfig", "BackboneOutput", "BackboneState", "IncompatibleConfig", "__version__"]
