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

(return, D4RL-normalised score). Each ``steps`` = whole episodes until at least that many
steps. Two versions of every recipe, the version being the ``-vN`` of its dataset id:

**Version 1** (the default; D4RL's construction, Fu et al. 2020, section 5):

* ``random``: uniform random actions, 1M steps.
* ``medium``: the medium agent *sampling* its actions (a SAC agent draws from its squashed
  Gaussian, as D4RL's datasets do; ARS's linear policy has no distribution and acts as it is:
  :data:`SAMPLING_ALGOS`), 1M steps.
* ``expert``: the expert agent, sampling likewise, 1M steps.
* ``medium-expert``: the medium shard followed by the expert shard, 2M steps.
* ``medium-replay``: the replay buffer of a SAC agent trained from scratch until its
  deterministic evaluation return (5 episodes every 5k steps) reaches the medium agent's
  return (:data:`MEDIUM_RETURNS`), at most ``steps`` environment steps.

**Version 0** (100k steps per shard, every agent deterministic):

* ``random``, ``medium``, ``expert``: 100k steps each; ``medium-expert`` 200k.
* ``medium-replay``: *not* a replay buffer, a curriculum of the medium agent under decreasing
  corruption that spans the returns a training run passes through: random actions 10k, then
  epsilon/noise (0.5/0.5) 20k, (0.3/0.3) 20k, (0.1/0.2) 25k, (0/0.1) 25k.

Each level has a ``-positions`` variant (``pomdp positions``): the same rollouts (same seeds,
same returns) with only joint positions recorded, the memory benchmark for GTrXL.

**Pixel recipes** (version 1 only; the ``atari`` extra): the DQN-replay analogue (Agarwal et al.
2020 recorded every transition a DQN saw while it trained, with its epsilon-greedy
exploration; the Decision Transformer's Atari data is a slice of it). ``minatar-breakout-dqn-replay``
trains SB3's DQN on MinAtar Breakout (Young and Tian 2019) with MinAtar's own DQN settings
(:data:`MINATAR_DQN`: a 3x3 convolution of 16 channels, a 100k replay buffer, epsilon 1 -> 0.1
over the first 100k steps, one update every 4 steps) for :data:`PIXEL_STEPS` steps and records every
training transition, frames as uint8 (``rlt/minatar-breakout/dqn-replay-v1``).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rl_tformers.envs.dataset import META_KEY

#: recipe task -> gymnasium id
TASKS = {"hopper": "Hopper-v5", "walker2d": "Walker2d-v5", "halfcheetah": "HalfCheetah-v5"}
#: task -> (medium algorithm, expert algorithm) under ../shared/policies/<algo>/<Env>-v3/
LEVEL_POLICIES = {
    "hopper": ("sac", "ars"),
    "walker2d": ("ars", "sac"),
    "halfcheetah": ("ars", "sac"),
}
LEVELS = ("random", "medium", "expert", "medium-replay", "medium-expert")
#: pixel recipe task -> gymnasium id (:mod:`rl_tformers.envs.pixels`)
PIXEL_TASKS = {"minatar-breakout": "MinAtar/Breakout-v1"}
#: the levels of a pixel task: the training replay of a DQN
PIXEL_LEVELS = ("dqn-replay",)
#: base size of a pixel recipe (its DQN's training steps) when ``--recipe-steps`` is not given
PIXEL_STEPS = 250_000
#: the DQN settings of Young and Tian 2019 (MinAtar, section 4 and their ``dqn.py``), in SB3's
#: names: replay 100k, batch 32, discount 0.99, target network every 1000 steps, learning
#: starts after 5000 steps, epsilon 1.0 -> 0.1 over the first 100k steps (``exploration_fraction``
#: = 100k / steps, :func:`train_kwargs`); Adam at 2.5e-4 (their RMSProp's rate). One update every 4
#: steps (Mnih et al. 2015's rate; MinAtar's DQN updates every step, 4x the compute: an update
#: costs about 20 ms on a loaded 2-core CPU, 2 hours for 300k steps). The network is
#: :func:`~rl_tformers.envs.policies.minatar_extractor_class`'s.
MINATAR_DQN = {"buffer_size": 100_000, "batch_size": 32, "gamma": 0.99, "target_update_interval": 1_000,
               "learning_starts": 5_000, "train_freq": 4, "gradient_steps": 1, "exploration_initial_eps": 1.0,
               "exploration_final_eps": 0.1, "learning_rate": 2.5e-4}
#: steps over which MINATAR_DQN's epsilon decays
MINATAR_EPS_STEPS = 100_000
#: recipe versions (the ``-vN`` of the dataset ids); :data:`DEFAULT_VERSION` is D4RL's construction
VERSIONS = (0, 1)
DEFAULT_VERSION = 1
#: base size (``--recipe-steps``) of each version: D4RL's 1M steps per policy; 100k in version 0
VERSION_STEPS = {0: 100_000, 1: 1_000_000}
DEFAULT_STEPS = VERSION_STEPS[DEFAULT_VERSION]
#: task -> the medium agent's return (deterministic, 3 episodes of the ``*-v5`` task, measured in
#: ``../shared/policies/README.md``): version 1's medium-replay trains SAC until it reaches this
MEDIUM_RETURNS = {"hopper": 1096.0, "walker2d": 986.0, "halfcheetah": 4922.0}
#: algorithms whose policy is a distribution to sample from (ARS's linear policy is not)
SAMPLING_ALGOS = frozenset({"sac", "ppo", "a2c", "td3", "tqc"})
#: version 1 medium-replay: evaluate the training agent every this many steps, over this many episodes
REPLAY_EVAL_EVERY = 5_000
REPLAY_EVAL_EPISODES = 5
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
    """One behaviour of a recipe.

    Attributes:
        policy: ``"random"`` or an algorithm folder name of the behaviour policies (``sac``...);
            with ``train`` the algorithm trained from scratch.
        steps: environment steps (whole episodes until at least this many); with ``train`` the
            most training steps.
        epsilon, noise: corruption of the agent's actions (:class:`~rl_tformers.envs.policies.NoisyPolicy`).
        stochastic: the agent samples its actions from its distribution instead of taking the mode.
        train: record the training transitions of ``policy`` (its replay buffer) instead of
            rolling out a pretrained agent.
        until_return: with ``train``, stop once the deterministic evaluation return reaches this.
    """

    policy: str
    steps: int
    epsilon: float = 0.0
    noise: float = 0.0
    stochastic: bool = False
    train: bool = False
    until_return: float | None = None


@dataclass(frozen=True)
class Recipe:
    """How to collect one dataset (:func:`make_recipe`).

    Attributes:
        name: ``<task>-<level>[-positions]``.
        task: a key of :data:`TASKS`; level: one of :data:`LEVELS`.
        positions: observations masked to joint positions (a POMDP variant).
        shards: the behaviours, collected in order.
    """

    name: str
    task: str
    level: str
    positions: bool
    shards: tuple[Shard, ...]
    #: the base size it was made with (``--recipe-steps``; recorded in the dataset's metadata)
    base_steps: int = DEFAULT_STEPS
    #: the recipe version (:data:`VERSIONS`), the ``-vN`` of :attr:`dataset_id`
    version: int = DEFAULT_VERSION

    @property
    def env_id(self) -> str:
        """Gymnasium id of the task (e.g. ``Hopper-v5``, ``MinAtar/Breakout-v1``)."""
        return TASKS[self.task] if self.task in TASKS else PIXEL_TASKS[self.task]

    @property
    def pixels(self) -> bool:
        """A pixel task (:data:`PIXEL_TASKS`)."""
        return self.task in PIXEL_TASKS

    @property
    def dataset_id(self) -> str:
        """Minari id: ``rlt/<task>-v5/<level>[-positions]-v<version>``; a pixel task's
        ``rlt/<task>/<level>-v<version>``."""
        if self.pixels:
            return f"rlt/{self.task}/{self.level}-v{self.version}"
        suffix = "-positions" if self.positions else ""
        return f"rlt/{self.task}-v5/{self.level}{suffix}-v{self.version}"

    @property
    def steps(self) -> int:
        """Environment steps of the whole recipe (sum over its shards)."""
        return sum(s.steps for s in self.shards)

    def describe(self) -> str:
        """One line: each shard's behaviour, modifiers and size, joined by `` + ``."""
        parts = []
        for s in self.shards:
            if s.train and s.until_return is None:
                parts.append(f"{s.policy} training replay with its exploration ({steps_text(s.steps)})")
                continue
            if s.train:
                parts.append(f"{s.policy} training replay until return {s.until_return:g} "
                             f"(at most {steps_text(s.steps)})")
                continue
            p = "random actions" if s.policy == "random" else f"{s.policy}"
            mods = ([f"eps {s.epsilon:g}"] * (s.epsilon > 0 and s.policy != "random") + [f"noise {s.noise:g}"] * (s.noise > 0)
                    + ["sampled"] * (s.stochastic and s.policy != "random"))
            parts.append(f"{p}{' (' + ', '.join(mods) + ')' if mods else ''} {steps_text(s.steps)}")
        return " + ".join(parts) + (", positions only" if self.positions else "")


def steps_text(n: int) -> str:
    """``2M``, ``100k``, ``1.25k`` or ``6``: a size as :meth:`Recipe.describe` and the CLI write it."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000:
        return f"{n // 1000}k" if n % 1000 == 0 else f"{n / 1000:g}k"
    return str(n)


def _level_shards_v1(task: str, level: str, steps: int) -> tuple[Shard, ...]:
    medium, expert = LEVEL_POLICIES[task]
    if level == "random":
        return (Shard("random", steps),)
    if level == "medium":
        return (Shard(medium, steps, stochastic=medium in SAMPLING_ALGOS),)
    if level == "expert":
        return (Shard(expert, steps, stochastic=expert in SAMPLING_ALGOS),)
    if level == "medium-expert":
        return (Shard(medium, steps, stochastic=medium in SAMPLING_ALGOS),
                Shard(expert, steps, stochastic=expert in SAMPLING_ALGOS))
    if level == "medium-replay":
        return (Shard("sac", steps, train=True, until_return=MEDIUM_RETURNS[task]),)
    raise ValueError(f"unknown level {level!r}; levels: {', '.join(LEVELS)}")


def _level_shards(task: str, level: str, steps: int, version: int = DEFAULT_VERSION) -> tuple[Shard, ...]:
    if version == 1:
        return _level_shards_v1(task, level, steps)
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


def make_recipe(task: str, level: str, *, positions: bool = False, steps: int | None = None,
                version: int = DEFAULT_VERSION) -> Recipe:
    """A recipe for ``task`` (hopper, walker2d, halfcheetah) and ``level`` (see :data:`LEVELS`)
    in ``version`` (:data:`VERSIONS`), with base size ``steps`` (default :data:`VERSION_STEPS`).

    Raises:
        ValueError: an unknown task, level or version, or (version 0 medium-replay) ``steps`` <
            :data:`MIN_STEPS`.
    """
    if task not in TASKS and task not in PIXEL_TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join([*TASKS, *PIXEL_TASKS])}")
    if version not in VERSIONS:
        raise ValueError(f"unknown recipe version {version!r}; versions: {', '.join(map(str, VERSIONS))}")
    if task in PIXEL_TASKS:
        return _pixel_recipe(task, level, positions=positions, steps=steps, version=version)
    steps = VERSION_STEPS[version] if steps is None else int(steps)
    suffix = "-positions" if positions else ""
    return Recipe(f"{task}-{level}{suffix}", task, level, positions, _level_shards(task, level, steps, version), steps,
                  version)


def _pixel_recipe(task: str, level: str, *, positions: bool, steps: int | None, version: int) -> Recipe:
    """A pixel task's recipe (version 1): the training replay of a DQN, :data:`PIXEL_STEPS` steps by default.

    Raises:
        ValueError: an unknown level, ``positions``, or version 0.
    """
    if level not in PIXEL_LEVELS:
        raise ValueError(f"unknown level {level!r} of the pixel task {task}; levels: {', '.join(PIXEL_LEVELS)}")
    if positions or version != 1:
        raise ValueError(f"the pixel task {task} has no -positions variant and only recipe version 1")
    steps = PIXEL_STEPS if steps is None else int(steps)
    return Recipe(f"{task}-{level}", task, level, False, (Shard("dqn", steps, train=True),), steps, version)


def train_kwargs(recipe: Recipe, shard: Shard) -> dict:
    """The SB3 settings of a recipe's training shard: :data:`MINATAR_DQN` for a pixel task (its
    epsilon decaying over the first :data:`MINATAR_EPS_STEPS` steps of ``shard.steps``), else none
    (SB3's defaults)."""
    if not (recipe.pixels and shard.train):
        return {}
    return {**MINATAR_DQN, "exploration_fraction": min(1.0, MINATAR_EPS_STEPS / max(shard.steps, 1))}


def all_recipes(steps: int | None = None, version: int = DEFAULT_VERSION) -> dict[str, Recipe]:
    """Every recipe of ``version`` by name: ``<task>-<level>[-positions]``, 30 MuJoCo ones, and in
    version 1 the pixel ones (:data:`PIXEL_TASKS` x :data:`PIXEL_LEVELS`)."""
    out = {}
    for task in TASKS:
        for level in LEVELS:
            for pos in (False, True):
                r = make_recipe(task, level, positions=pos, steps=steps, version=version)
                out[r.name] = r
    if version == 1:
        for task in PIXEL_TASKS:
            for level in PIXEL_LEVELS:
                r = make_recipe(task, level, steps=steps, version=version)
                out[r.name] = r
    return out


def recipe_of_dataset(dataset_id: str) -> Recipe | None:
    """The recipe (of any version, at its default size) whose dataset id is ``dataset_id``, or ``None``."""
    return next((r for v in VERSIONS for r in all_recipes(version=v).values() if r.dataset_id == dataset_id), None)


def match_recipes(patterns: list[str], steps: int | None = None, version: int = DEFAULT_VERSION) -> list[Recipe]:
    """Recipes whose names match any of ``patterns`` (exact names or shell globs, e.g. ``hopper-*``).

    Raises:
        ValueError: a pattern matches nothing (the message names the closest recipe name, if
            any, and lists the recipes).
    """
    recipes = all_recipes(steps, version)
    out: list[Recipe] = []
    for pat in patterns:
        hits = [r for name, r in recipes.items() if fnmatch.fnmatchcase(name, pat)]
        if not hits:
            close = difflib.get_close_matches(pat, list(recipes), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"no recipe matches {pat!r}; {hint}recipes: {', '.join(recipes)}")
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


def shard_record(recipe: Recipe, s: Shard) -> dict:
    """What a build of ``recipe`` records of shard ``s`` in its metadata (its ``behaviours``)."""
    if s.train:
        return {"policy": f"{s.policy} training", "epsilon": 0.0, "noise": 0.0, "steps": s.steps,
                "until_return": s.until_return}
    policy = "random" if s.policy == "random" else f"{s.policy}/{recipe.env_id.rsplit('-v', 1)[0]}-v3"
    out = {"policy": policy, "epsilon": s.epsilon, "noise": s.noise, "steps": s.steps}
    return {**out, "stochastic": True} if s.stochastic else out


def build_record(folder: str | os.PathLike) -> dict | None:
    """The rl-tformers record (``metadata.json`` key ``rl_tformers``) of the Minari dataset in
    ``folder``: what it was built with. ``None`` when it has none or cannot be read."""
    try:
        own = json.loads((Path(folder) / "data" / "metadata.json").read_text()).get(META_KEY)
        if isinstance(own, str):
            own = json.loads(own)
    except (OSError, ValueError, AttributeError):
        return None
    return own if isinstance(own, dict) else None


def _shard_keys(behaviours) -> list[tuple] | None:
    """``(policy, epsilon, noise, steps)`` of recorded behaviours (``None`` when malformed)."""
    if not isinstance(behaviours, list) or not all(isinstance(b, dict) for b in behaviours):
        return None
    return [(*(b.get(k) for k in ("policy", "epsilon", "noise", "steps")), bool(b.get("stochastic", False)),
             b.get("until_return")) for b in behaviours]


def _shards_text(keys: list[tuple]) -> str:
    parts = []
    for policy, eps, noise, steps, stochastic, until in keys:
        if until is not None:
            parts.append(f"{policy} replay until return {until:g} (at most {steps_text(steps) if isinstance(steps, int) else '?'})")
            continue
        p = "random actions" if policy == "random" else str(policy) + (" sampled" if stochastic else "")
        mods = [f"eps {eps:g}"] * bool(isinstance(eps, (int, float)) and eps > 0 and policy != "random") \
            + [f"noise {noise:g}"] * bool(isinstance(noise, (int, float)) and noise > 0)
        size = steps_text(steps) if isinstance(steps, int) else "? steps"
        parts.append(f"{p}{' (' + ', '.join(mods) + ')' if mods else ''} {size}")
    return " + ".join(parts)


@dataclass(frozen=True)
class ExistingBuild:
    """A dataset already at a recipe's id, compared with the build asked for (``collect --recipe
    ... --skip-existing`` keeps it only when :attr:`same`).

    What defines a recipe dataset is what its metadata records: the recipe, the seed, the
    observations (``-positions``) and each shard's policy, epsilon, noise and size.
    """

    recipe: Recipe
    steps: int  #: the base size asked (``--recipe-steps``)
    seed: int  #: the seed asked (``--seed``)
    path: Path
    record: dict | None  #: :func:`build_record` of the dataset

    @property
    def recorded(self) -> bool:
        """Whether the dataset records how it was built (one that does not cannot be compared)."""
        return self.record is not None

    def _asked_keys(self, steps: int | None = None) -> list[tuple]:
        r = self.recipe if steps is None else make_recipe(self.recipe.task, self.recipe.level,
                                                          positions=self.recipe.positions, steps=steps,
                                                          version=self.recipe.version)
        return _shard_keys([shard_record(r, s) for s in r.shards])

    def built_steps(self) -> int | None:
        """The ``--recipe-steps`` whose shards are exactly the recorded ones, or ``None``."""
        rec = self.record or {}
        keys = _shard_keys(rec.get("behaviours"))
        if rec.get("recipe") != self.recipe.name or not keys:
            return None
        sizes = [k[3] for k in keys if isinstance(k[3], int) and not isinstance(k[3], bool)]
        if len(sizes) != len(keys):
            return None
        told = rec.get("recipe_steps")  # absent from a dataset built without the record: inferred from the shards
        if isinstance(told, int) and not isinstance(told, bool) and told >= MIN_STEPS and self._asked_keys(told) == keys:
            return told
        # medium-replay: the shards are rounded fractions of the base, so nearby sizes may give the
        # same shards (48 and 50); the roundest of them is the likeliest to have been typed
        fits = {n for c in {*sizes, sum(sizes)} for n in range(max(MIN_STEPS, c - 3), c + 4)
                if self._asked_keys(n) == keys}
        return min(fits, key=lambda n: (-len(str(n)) + len(str(n).rstrip("0")), -n)) if fits else None

    def differences(self) -> list[tuple[str, str]]:
        """``(built with, asked)`` for each thing that differs; empty when the build is the one asked."""
        rec = self.record
        if rec is None:
            return []
        if rec.get("recipe") != self.recipe.name:
            built = (f"recipe {rec['recipe']}" if isinstance(rec.get("recipe"), str)
                     else f"no recipe ({rec.get('algorithm') or 'rl-tformers collect'})")
            return [(built, f"recipe {self.recipe.name}")]
        out = []
        built_version = rec.get("recipe_version", 0)  # a build that records no version is a version 0 one
        if built_version != self.recipe.version:
            out.append((f"--recipe-version {built_version}", f"--recipe-version {self.recipe.version}"))
        keys = _shard_keys(rec.get("behaviours"))
        if keys != self._asked_keys():
            n = self.built_steps()
            asked = _shards_text(self._asked_keys())
            if n is not None:
                out.append((f"--recipe-steps {n} ({_shards_text(keys)})", f"--recipe-steps {self.steps} ({asked})"))
            else:
                out.append((_shards_text(keys) if keys else "no shard record", asked))
        if rec.get("seed") != self.seed:
            out.append((f"--seed {rec.get('seed')}", f"--seed {self.seed}"))
        pomdp = rec.get("pomdp")
        kind = pomdp.get("kind") if isinstance(pomdp, dict) else pomdp
        if kind != ("positions" if self.recipe.positions else None):
            out.append((f"observations {kind or 'full'}", f"observations {'positions' if self.recipe.positions else 'full'}"))
        return out

    @property
    def same(self) -> bool:
        """Built by this recipe with the same size, seed, policies and observations."""
        return self.recorded and not self.differences()

    def matching_options(self) -> list[str] | None:
        """Options (``--recipe-steps N``, ``--seed S``) under which the asked build is this one's,
        or ``None`` when none can (another recipe, other policies or noise)."""
        rec = self.record or {}
        if rec.get("recipe") != self.recipe.name or rec.get("recipe_version", 0) != self.recipe.version:
            return None
        opts = []
        if _shard_keys(rec.get("behaviours")) != self._asked_keys():
            n = self.built_steps()
            if n is None:
                return None
            opts.append(f"--recipe-steps {n}")
        seed = rec.get("seed")
        if seed != self.seed:
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                return None
            opts.append(f"--seed {seed}")
        pomdp = rec.get("pomdp")
        if (pomdp.get("kind") if isinstance(pomdp, dict) else pomdp) != ("positions" if self.recipe.positions else None):
            return None
        return opts

    def explain(self) -> str:
        """``built with ...; asked: ...`` (empty when :attr:`same` or not :attr:`recorded`)."""
        diff = self.differences()
        if not diff:
            return ""
        return f"built with {', '.join(b for b, _ in diff)}; asked: {', '.join(a for _, a in diff)}"


def existing_build(recipe: Recipe, folder: str | os.PathLike, *, steps: int = DEFAULT_STEPS,
                   seed: int = 0) -> ExistingBuild:
    """Compare the dataset in ``folder`` with a build of ``recipe`` at ``steps`` and ``seed``."""
    return ExistingBuild(recipe, int(steps), int(seed), Path(folder), build_record(folder))
