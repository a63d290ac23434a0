"""Observation encoders: the slot that turns one environment observation into a feature vector.

Every agent reads observations through one registered encoder (``agent.encoder``, a tagged
config ``{kind: ..., **fields}`` like the backbone's slots): the Decision Transformer's state
token, BC's MLP input and GTrXL's step token all start with ``encoder(obs) -> (..., F)``, and the
agent's own embedding (a linear layer to the model width, or BC's MLP) reads the F features.

Kinds (``rl-tformers agents dt`` lists them; one module each):

- ``linear`` (:mod:`.flat`): the flat observation itself, O features; the agent's linear
  embedding reads it (the path of vector tasks, the default);
- ``mlp`` (:mod:`.flat`): a ReLU MLP on the flat observation;
- ``nature_cnn`` (:mod:`.nature_cnn`): Mnih et al. 2015's three-layer CNN on pixel frames;
- ``impala_cnn`` (:mod:`.impala_cnn`): Espeholt et al. 2018's residual CNN on pixel frames.

Why here, in ``rl_tformers.agents.common``, and not beside the backbone slots in
``rl_tformers/``: the backbone library maps embeddings to hidden states and knows nothing of
environments, while an encoder reads an environment's observation space (uint8 pixel frames
stacked on the channel axis, the 1/255 scaling, the refusal of an image space with a flat kind
and the reverse), which is RL-specific; and it serves several agents, which is what
``agents/common`` holds. The registry machinery (:class:`~rl_tformers.registry.Registry`) and
typed fields (:mod:`rl_tformers.typed_config`) are the backbone's, reused.

Importing this package registers every kind (each module registers itself on import).
"""

from rl_tformers.agents.common.encoders.base import (
    ENCODERS,
    EncoderCapabilities,
    EncoderConfig,
    ObservationEncoder,
    check_observations,
    is_image,
    observation_layout,
)

from rl_tformers._discover import import_submodules

import_submodules(__name__)

__all__ = ["ENCODERS", "EncoderCapabilities", "EncoderConfig", "ObservationEncoder", "check_observations",
           "is_image", "observation_layout"]
