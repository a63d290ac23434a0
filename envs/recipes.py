"""D4RL-style dataset recipes for Hopper-v5, Walker2d-v5 and HalfCheetah-v5.

Built from the pretrained SB3 agents in ``../shared/policies/`` (RL Zoo, trained on ``*-v3``,
run in ``*-v5``). Per task, from the returns measured in that folder's README:

========== ================ ================= =========================================
task       medium           expert            why
========== ================ ================= =========================================
Hopper     sac (1096, 34)   ars (3289, 102)   sac is nearest D4RL's medium level (~1/3
                                              of expert); ars matches D4RL's expert
Walker2d   ars (986, 21)    sac (3901, 85)    sac is the only strong agent; ars is the
                                              better of the two weak ones (a2c: 688)
HalfCheetah ars (4922, 42)  sac (9431, 78)    ars scores what D4RL's halfcheetah-medium
                                              scores (~42 normalised); sac is the best
========== ================ ================= =========================================

(return, D4RL-normalised score). Levels, each ``steps`` = whole episodes until at least that
many steps (D4RL used 1M; the defaults here are sized for a 2-core machine):

* ``random``: uniform random actions, 100k steps.
* ``medium``: the medium agent, deterministic, 100k steps.
* ``expert``: the expert agent, deterministic, 100k steps.
* ``medium-expert``: the medium shard followed by the expert shard (200k steps), as in D4RL.
* ``medium-replay``: *not* a replay buffer (training SAC to medium level takes ~20 min per 100k
  steps here): a curriculum of the medium agent under decreasing corruption that spans the
  returns a training run passes through: random actions 10k, then epsilon/noise
  (0.5/0.5) 20k, (0.3/0.3) 20k, (0.1/0.2) 25k, (0/0.1) 25k. A true replay set comes from
  ``rl-tformers collect --train sac --train-steps N --replay-dataset-id ...``.

Each level has a ``-positions`` variant (``pomdp positions``): the same rollouts (same seeds,
same returns) with only joint positions recorded, the memory benchmark for GTrXL.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym

#: recipe task -> gymnasium id
TASKS = {"hopper": "Hopper-v5", "walker2d": "Walker2d-v5", "halfcheetah": "HalfCheetah-v5"}
#: task -> (medium algorithm, expert algorithm) under ../shared/policies/<algo>/<Env>-v3/
LEVEL_POLICIES = {
    "hopper": ("sac", "ars"),
    "walker2d": ("ars", "sac"),
    "halfcheetah": ("ars", "sac"),
}
LEVELS = ("random", "medium", "expert", "medium-replay", "medium-expert")
DEFAULT_STEPS = 100_000
#: medium-replay curriculum: (fraction of the steps, epsilon, noise std); fraction of random shard first.
MEDIUM_REPLAY_SCHEDULE = ((0.10, 1.0, 0.0), (0.20, 0.5, 0.5), (0.20, 0.3, 0.3), (0.25, 0.1, 0.2), (0.25, 0.0, 0.1))


def _shard_steps(frac: float, steps: int) -> int:
    return int(round(frac * steps))


def _min_steps() -> int:
    """The smallest base size whose medium-replay shards all get at least one step (6: the 10 %
    random shard of 5 steps rounds to 0)."""
    n = 1
    while any(_shard_steps(frac, n) < 1 for frac, _, _ in MEDIUM_REPLAY_SCHEDULE):
        n += 1
    return n


#: smallest ``steps`` of :func:`make_recipe` (``rl-tformers collect --recipe-steps``): below it a
#: medium-replay shard would be empty (that part of the curriculum missing from the dataset).
MIN_STEPS = _min_steps()


@dataclass(frozen=True)
class Shard:
    """One behaviour of a recipe: ``policy`` is ``"random"`` or an algorithm folder name."""

    policy: str
    steps: int
    epsilon: float = 0.0
    noise: float = 0.0


@dataclass(frozen=True)
class Recipe:
    name: str
    task: str
    level: str
    positions: bool
    shards: tuple[Shard, ...]

    @property
    def env_id(self) -> str:
        return TASKS[self.task]

    @property
    def dataset_id(self) -> str:
        """Minari id: ``rlt/<task>-v5/<level>[-positions]-v0``."""
        suffix = "-positions" if self.positions else ""
        return f"rlt/{self.task}-v5/{self.level}{suffix}-v0"

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.shards)

    def describe(self) -> str:
        parts = []
        for s in self.shards:
            p = "random actions" if s.policy == "random" else f"{s.policy}"
            mods = [f"eps {s.epsilon:g}"] * (s.epsilon > 0 and s.policy != "random") + [f"noise {s.noise:g}"] * (s.noise > 0)
            parts.append(f"{p}{' (' + ', '.join(mods) + ')' if mods else ''} {s.steps // 1000}k")
        return " + ".join(parts) + (", positions only" if self.positions else "")


def _level_shards(task: str, level: str, steps: int) -> tuple[Shard, ...]:
    medium, expert = LEVEL_POLICIES[task]
    if level == "random":
        return (Shard("random", steps),)
    if level == "medium":
        return (Shard(medium, steps),)
    if level == "expert":
        return (Shard(expert, steps),)
    if level == "medium-expert":
        return (Shard(medium, steps), Shard(expert, steps))
    if level == "medium-replay":
        out = []
        if steps < MIN_STEPS:
            raise ValueError(f"{task}-{level}: steps must be >= {MIN_STEPS} (its {len(MEDIUM_REPLAY_SCHEDULE)} "
                             f"shards take 10-25 % of them each, and none may be empty), got {steps}")
        for frac, eps, noise in MEDIUM_REPLAY_SCHEDULE:
            n = _shard_steps(frac, steps)
            out.append(Shard("random", n) if eps >= 1.0 else Shard(medium, n, epsilon=eps, noise=noise))
        return tuple(out)
    raise ValueError(f"unknown level {level!r}; levels: {', '.join(LEVELS)}")


def make_recipe(task: str, level: str, *, positions: bool = False, steps: int = DEFAULT_STEPS) -> Recipe:
    """A recipe for ``task`` (hopper, walker2d, halfcheetah) and ``level`` (see :data:`LEVELS`)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    suffix = "-positions" if positions else ""
    return Recipe(f"{task}-{level}{suffix}", task, level, positions, _level_shards(task, level, steps))


def all_recipes(steps: int = DEFAULT_STEPS) -> dict[str, Recipe]:
    """Every recipe by name: ``<task>-<level>[-positions]``, 30 in all."""
    out = {}
    for task in TASKS:
        for level in LEVELS:
            for pos in (False, True):
                r = make_recipe(task, level, positions=pos, steps=steps)
                out[r.name] = r
    return out


def match_recipes(patterns: list[str], steps: int = DEFAULT_STEPS) -> list[Recipe]:
    """Recipes whose names match any of ``patterns`` (exact names or shell globs, e.g. ``hopper-*``).

    Raises:
        ValueError: a pattern matches nothing (the message lists the recipes).
    """
    recipes = all_recipes(steps)
    out: list[Recipe] = []
    for pat in patterns:
        hits = [r for name, r in recipes.items() if fnmatch.fnmatchcase(name, pat)]
        if not hits:
            raise ValueError(f"no recipe matches {pat!r}; recipes: {', '.join(recipes)}")
        out.extend(h for h in hits if h not in out)
    return out


def policies_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Folder of the pretrained behaviour policies (``<algo>/<Env>-v3/model.zip``).

    ``explicit``, else ``$RL_TFORMERS_POLICIES``, else ``$RL_TFORMERS_SHARED/policies`` (the
    shared folder the tests also use), else ``../shared/policies`` next to the current
    directory or to the repository.

    Raises:
        FileNotFoundError: none of those exists (the message lists each place looked in once).
    """
    cands: list[Path] = []
    if explicit is not None:
        cands.append(Path(explicit).expanduser())
    elif os.environ.get("RL_TFORMERS_POLICIES"):
        cands.append(Path(os.environ["RL_TFORMERS_POLICIES"]).expanduser())
    elif os.environ.get("RL_TFORMERS_SHARED"):
        cands.append(Path(os.environ["RL_TFORMERS_SHARED"]).expanduser() / "policies")
    else:
        for c in (Path.cwd().parent / "shared" / "policies",
                  Path(__file__).resolve().parents[1].parent / "shared" / "policies"):
            if c.resolve() not in [x.resolve() for x in cands]:
                cands.append(c)
    for c in cands:
        if c.is_dir():
            return c
    raise FileNotFoundError(f"behaviour policies not found (looked in {', '.join(map(str, cands))}); "
                            "pass --policies DIR or set RL_TFORMERS_POLICIES (the policies folder) or "
                            "RL_TFORMERS_SHARED (the shared folder holding policies/)")


def policy_path(algo: str, env_id: str, policies: str | os.PathLike | None = None) -> Path:
    """``<policies>/<algo>/<Env>-v3/model.zip`` for a ``*-v5`` env id."""
    name = env_id.rsplit("-v", 1)[0]
    return policies_dir(policies) / algo / f"{name}-v3" / "model.zip"


def build_recipe(recipe: Recipe, *, seed: int = 0, root=None, policies=None, hdf5=None, overwrite: bool = False,
                 progress: bool = True):
    """Collect one recipe into ``<root>/<recipe.dataset_id>``; returns a :class:`CollectResult`."""
    from rl_tformers.envs.collect import Behaviour, collect
    from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, load_sb3_policy
    from rl_tformers.envs.pomdp import pomdp_record

    env = gym.make(recipe.env_id)
    loaded: dict[str, object] = {}
    behaviours = []
    for i, s in enumerate(recipe.shards):
        shard_seed = seed * 1000 + i + 1
        if s.policy == "random":
            pol = RandomPolicy(env.action_space, seed=shard_seed)
            info = {"policy": "random"}
        else:
            if s.policy not in loaded:
                loaded[s.policy] = load_sb3_policy(policy_path(s.policy, recipe.env_id, policies), env, algo=s.policy)
            pol = loaded[s.policy]
            info = {"policy": f"{s.policy}/{recipe.env_id.rsplit('-v', 1)[0]}-v3"}
            if s.epsilon > 0 or s.noise > 0:
                pol = NoisyPolicy(pol, env.action_space, noise_std=s.noise, epsilon=s.epsilon, seed=shard_seed)
        info.update(epsilon=s.epsilon, noise=s.noise, steps=s.steps)
        behaviours.append(Behaviour(pol, steps=s.steps, label=info["policy"], info=info))
    pomdp = pomdp_record(env, "positions") if recipe.positions else None
    return collect(recipe.env_id, behaviours, dataset_id=recipe.dataset_id, seed=seed, pomdp=pomdp, root=root,
                   hdf5=hdf5, overwrite=overwrite, progress=progress,
                   description=f"rl-tformers recipe {recipe.name}: {recipe.describe()}",
                   record={"recipe": recipe.name, "algorithm": f"recipe {recipe.name}"})
