"""Package discovery for the repository layout of the design card.

``agents/``, ``envs/`` and ``configs/`` sit at the top level of the repository but are
installed as ``rl_tformers.agents``, ``rl_tformers.envs`` and ``rl_tformers.configs``
(see ``package-dir`` in pyproject.toml), so ``import rl_tformers.agents`` is the only
spelling and nothing named plain ``agents`` or ``envs`` lands in site-packages.
Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["rl_tformers", "rl_tformers.*"])
for top in ("agents", "envs", "configs"):
    packages.append(f"rl_tformers.{top}")
    packages += [f"rl_tformers.{name}" for name in find_packages(include=[f"{top}.*"])]

setup(packages=packages)
