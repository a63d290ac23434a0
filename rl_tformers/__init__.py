"""rl-tformers backbone library: every attention, positional, memory and adaptive-computation
variant of "The Transformer Family v2.0" (Weng 2023) behind one interface.

    >>> from rl_tformers import Backbone
    >>> bb = Backbone({"d_model": 64, "n_layers": 2, "n_heads": 4,
    ...                "attention": {"kind": "sdpa"}, "position": {"kind": "rotary"}})

Nothing RL-specific lives here; the agents are in ``rl_tformers.agents`` and datasets and
environments in ``rl_tformers.envs``.
"""

__version__ = "0.1.0"

# Register every component (each slot package imports its modules).
from rl_tformers import attention, blocks, depth, memory, position  # noqa: E402,F401
from rl_tformers.backbone import Backbone, IncompatibleConfig  # noqa: E402
from rl_tformers.backbone_config import BackboneConfig  # noqa: E402
from rl_tformers.types import BackboneOutput, BackboneState  # noqa: E402

__all__ = ["Backbone", "BackboneConfig", "BackboneOutput", "BackboneState", "IncompatibleConfig", "__version__"]
