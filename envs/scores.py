"""Normalised scores: ``100 * (R - ref_min) / (ref_max - ref_min)`` (D4RL, Fu et al. 2020).

Reference returns, in order of precedence:

1. the dataset's own Minari metadata ``ref_min_score`` / ``ref_max_score`` (when both exist);
2. the D4RL reference returns of the task family (random / expert policy returns of the D4RL
   paper's MuJoCo tasks), matched from an env id or dataset id: ``Hopper-v5``, ``Hopper-v3``,
   ``hopper-medium-v2``, ``mujoco/hopper/medium-v0`` and ``rlt/hopper-v5/medium-v0`` all map to
   ``hopper``;
3. for an Atari game (``ALE/Breakout-v5``, ``BreakoutNoFrameskip-v4``): the random and human
   scores of :data:`ATARI_REF_SCORES`, so the normalised score is the human- (DT: "gamer-")
   normalised score of the Atari literature;
4. nothing: :func:`reference_scores` returns ``None`` and :func:`normalized_score` returns
   ``None`` instead of inventing a number (MinAtar has no agreed references).

Note the scale: Minari's own ``get_normalized_score`` returns fractions (0..1); this module
returns D4RL's percentages (0..100), the unit every offline-RL table reports.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

#: D4RL reference returns (random policy, expert policy), raw reward units, per task family.
#: Source: D4RL ``infos.py`` (REF_MIN_SCORE / REF_MAX_SCORE), as listed in ../shared/policies/README.md.
D4RL_REF_SCORES: dict[str, tuple[float, float]] = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}


#: Atari reference returns (random policy, human), raw game score per episode, per game. Random:
#: Mnih et al. 2015 (Nature DQN, Extended Data Table 2); human: the professional tester's score of
#: Nair et al. 2015, as tabulated by Wang et al. 2016 (dueling DQN) and used for the
#: human-normalised scores of Agarwal et al. 2020 (An Optimistic Perspective on Offline RL, the
#: DQN-replay data) and the "gamer-normalised" scores of Hafner et al. 2020 that the Decision
#: Transformer (Chen et al. 2021, Table 1) reports: 100 = the human score, 0 = random play.
ATARI_REF_SCORES: dict[str, tuple[float, float]] = {
    "breakout": (1.7, 30.5),
    "pong": (-20.7, 14.6),
    "qbert": (163.9, 13455.0),
    "seaquest": (68.4, 42054.7),
    "asterix": (210.0, 8503.3),
    "spaceinvaders": (148.0, 1668.7),
    "freeway": (0.0, 29.6),
}


def atari_game(name: str | None) -> str | None:
    """The :data:`ATARI_REF_SCORES` game of an Atari env id or dataset id, or ``None``.

    ``"ALE/Breakout-v5"`` -> ``"breakout"``, ``"SpaceInvadersNoFrameskip-v4"`` ->
    ``"spaceinvaders"``, ``"rlt/ale-pong/dqn-replay-v1"`` -> ``"pong"``; a MinAtar id
    (``"MinAtar/Breakout-v1"``, whose scores are on another scale) -> ``None``.
    """
    if not name:
        return None
    parts = re.split(r"[/\\]", str(name).lower())
    if "minatar" in parts or any(p.startswith("minatar-") for p in parts):
        return None
    for part in parts:
        game = re.split(r"[-_.:]", re.sub(r"^ale-", "", part), maxsplit=1)[0]
        game = re.sub(r"(noframeskip|deterministic)$", "", game)
        atari_like = "ale" in parts or part.startswith("ale-") or re.search(r"noframeskip|deterministic|-v[45]$", part)
        if game in ATARI_REF_SCORES and atari_like:
            return game
    return None


def task_family(name: str | None) -> str | None:
    """D4RL task family of an env id or dataset id, or ``None``.

    Matches a path component or the leading word of the last component: ``"Hopper-v5"`` ->
    ``"hopper"``, ``"halfcheetah-medium-expert-v2"`` -> ``"halfcheetah"``,
    ``"mujoco/walker2d/expert-v0"`` -> ``"walker2d"``, ``"CartPole-v1"`` -> ``None``.
    """
    if not name:
        return None
    for part in re.split(r"[/\\]", str(name).lower()):
        head = re.split(r"[-_.:]", part, maxsplit=1)[0]
        if head in D4RL_REF_SCORES:
            return head
    return None


def _last_component(location: str | None) -> str | None:
    """The last component of a path (``/runs/hopper_x/pendulum.hdf5`` -> ``pendulum.hdf5``), or
    ``location`` itself when it is not an existing path (a Minari id such as
    ``mujoco/hopper/medium-v0``, matched component by component)."""
    if not location:
        return None

    p = Path(location).expanduser()
    if p.exists():
        return (p.parent.name if p.name == "data" else p.name) or None  # a Minari folder's data/
    return location


def reference_scores(x: Any) -> tuple[float, float] | None:
    """``(ref_min, ref_max)`` for an env id / dataset id string, an :class:`EpisodeDataset` or a
    ``minari.MinariDataset``; ``None`` when neither the dataset nor D4RL has references.

    For an :class:`EpisodeDataset` without its own references, the task family is that of its
    ``env_id`` when it has one (whatever the file is called or where it is stored); else that of
    its ``dataset_id``, else of its file or folder name (never of a parent folder's name)."""
    names: list[str | None] = []
    if hasattr(x, "metadata") and hasattr(x.metadata, "ref_min_score"):  # an EpisodeDataset
        m = x.metadata
        if m.ref_min_score is not None and m.ref_max_score is not None:
            return float(m.ref_min_score), float(m.ref_max_score)
        # the environment decides the task when it is known (a Pendulum-v1 file stored under a
        # folder named hopper_runs/ is not Hopper); else the dataset id, else the file or
        # folder's own name (a parent folder's name says nothing about the data)
        names = [m.env_id] if m.env_id else [m.dataset_id, _last_component(m.location)]
    elif hasattr(x, "storage") and hasattr(x, "spec"):  # minari.MinariDataset
        meta = x.storage.metadata
        if meta.get("ref_min_score") is not None and meta.get("ref_max_score") is not None:
            return float(meta["ref_min_score"]), float(meta["ref_max_score"])
        env_spec = x.env_spec
        names = [getattr(env_spec, "id", None), x.spec.dataset_id]
    elif isinstance(x, str):
        names = [x]
    else:
        raise TypeError(f"expected an env id, dataset id, EpisodeDataset or MinariDataset, got {type(x).__name__}")
    for name in names:
        fam = task_family(name)
        if fam is not None:
            return D4RL_REF_SCORES[fam]
        game = atari_game(name)
        if game is not None:
            return ATARI_REF_SCORES[game]
    return None


def normalized_score(x: Any, returns: float | np.ndarray) -> float | np.ndarray | None:
    """D4RL normalised score in percent: ``100 * (R - ref_min) / (ref_max - ref_min)``.

    Args:
        x: env id, dataset id, :class:`EpisodeDataset` or ``minari.MinariDataset`` (see
            :func:`reference_scores` for the lookup order).
        returns: undiscounted episode return(s) in raw reward units; scalar or array.

    Returns:
        Same shape as ``returns`` (a Python float for a scalar), or ``None`` when no reference
        returns exist for ``x``.
    """
    refs = reference_scores(x)
    if refs is None:
        return None
    lo, hi = refs
    out = 100.0 * (np.asarray(returns, dtype=np.float64) - lo) / (hi - lo)
    return float(out) if out.ndim == 0 else out
