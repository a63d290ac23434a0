"""Deployment: a trained policy as a standalone policy folder with TorchScript and ONNX graphs.

- :class:`~rl_tformers.agents.export.policy.Policy` (also ``rl_tformers.Policy``): ``Policy.load(DIR)
  .act(obs, state)`` on a policy folder, eagerly or through its exported graphs;
- :func:`~rl_tformers.agents.export.exporters.export_run`: ``rl-tformers export RUN_DIR --format
  torchscript|onnx --out DIR``;
- :mod:`~rl_tformers.agents.export.folder`: the folder's files; :mod:`~rl_tformers.agents.export.graphs`:
  the acting graphs; :mod:`~rl_tformers.agents.export.runtime`: the state kept between steps.

The folder format, the graphs' inputs and outputs and which backbone kinds export to which
format are in docs/deployment.md.
"""

from rl_tformers.agents.export.exporters import FORMATS, ExportRefused, export_run
from rl_tformers.agents.export.folder import PolicyFolderError
from rl_tformers.agents.export.policy import Policy

__all__ = ["FORMATS", "ExportRefused", "Policy", "PolicyFolderError", "export_run"]
