"""Command line of the data layer: ``rl-tformers collect`` and ``rl-tformers dataset info``."""

from __future__ import annotations

import contextlib
import json
import math
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from rl_tformers.cli.errors import fail
from rl_tformers.runtime.paths import blocking_file

#: ``collect --memory-task`` choices (:func:`rl_tformers.envs.memory_tasks.scripted_dataset`).
MEMORY_TASKS = ("recall", "cartpole")
#: Delays of the registered recall variants (``rl_tformers.envs.memory_tasks.RECALL_DELAYS``,
#: checked equal in tests; repeated here so that ``--help`` imports no gymnasium).
RECALL_DELAYS = (1, 2, 4, 8, 16, 32, 64)

#: ``rl-tformers collect --help``.
COLLECT_HELP = """Roll out a behaviour policy and write a Minari dataset.

\b
Examples:
  rl-tformers collect --env Hopper-v5 --policy random --steps 10000
  rl-tformers collect --env Hopper-v5 --policy ../shared/policies/sac/Hopper-v3/model.zip --episodes 10 --noise 0.1
  rl-tformers collect --env Hopper-v5 --train sac --train-steps 50000 --steps 10000 --replay-dataset-id rlt/hopper-v5/sac-replay-v0
  rl-tformers collect --env popgym-RepeatPreviousEasy-v0 --policy runs/gtrxl/popgym_repeat_previous --episodes 500
  rl-tformers collect --recipe 'hopper-*'
  rl-tformers collect --recipe 'hopper-*' --skip-existing     (finish an interrupted suite)
  rl-tformers collect --memory-task recall --delay 8 --hdf5 data/memory/recall-d8.hdf5

With several recipes, existing datasets are checked before anything is built: without --overwrite or --skip-existing the command stops at once, naming them; --skip-existing keeps only a dataset built as asked (same recipe, --recipe-steps, --seed), and refuses the others."""

dataset_app = typer.Typer(help="Inspect offline datasets (Minari ids, Minari folders, D4RL .hdf5 files).",
                          no_args_is_help=True)


def _fail(message: str) -> None:
    """Bad input (an option, a dataset, a file): one ``error: message`` line, exit status 2."""
    raise fail(message)


def _check_recipe_steps(recipe_steps: int | None) -> None:
    """Refuse a ``--recipe-steps`` below :data:`rl_tformers.envs.recipes.MIN_STEPS`: the
    medium-replay recipes split it into shards of 10-25 %, and a smaller size leaves one empty."""
    from rl_tformers.envs import recipes as R

    if recipe_steps is not None and recipe_steps < R.MIN_STEPS:
        _fail(f"--recipe-steps must be >= {R.MIN_STEPS}, got {recipe_steps} (the medium-replay recipes split it "
              f"into {len(R.MEDIUM_REPLAY_SCHEDULE)} shards of 10-25 %, each of at least 1 step)")


def _check_dataset_arg(dataset: str) -> None:
    if not dataset.strip():
        _fail("DATASET is empty; give a Minari dataset id, folder or .hdf5 file")


def _parse_indices(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--obs-indices") from None


@dataclass(frozen=True)
class CollectArgs:
    """The options of one ``rl-tformers collect`` call (each field is the option of its name)."""

    env: str | None = None
    policy: str = "random"
    algo: str | None = None
    stochastic: bool = False
    obs_norm: str = "auto"
    train: str | None = None
    train_steps: int = 100_000
    until_return: float | None = None
    replay_dataset_id: str | None = None
    steps: int | None = None
    episodes: int | None = None
    noise: float = 0.0
    epsilon: float | None = None
    pomdp: str = "none"
    obs_indices: str | None = None
    seed: int = 0
    dataset_id: str | None = None
    root: Path | None = None
    hdf5: Path | None = None
    recipe: tuple[str, ...] = ()
    recipe_steps: int | None = None
    recipe_version: int = 1
    policies: Path | None = None
    memory_task: str | None = None
    delay: int | None = None
    overwrite: bool = False
    skip_existing: bool = False
    progress: bool = True
    as_json: bool = False

    def given(self, *names: str) -> list[str]:
        """The options among ``names`` (field names) given a value other than their default, as ``--option``."""
        defaults = CollectArgs()
        return ["--" + n.replace("_", "-") for n in names if getattr(self, n) != getattr(defaults, n)]


#: options of a single collection, which a recipe sets itself
SINGLE_OPTIONS = ("env", "policy", "algo", "stochastic", "obs_norm", "train", "train_steps", "until_return",
                  "replay_dataset_id", "steps", "episodes", "noise", "epsilon", "pomdp", "obs_indices", "dataset_id")


# the longer option declarations of `collect`
_UNTIL_RETURN = typer.Option(None, "--until-return",
                                             help="With --train: stop once the agent's deterministic evaluation return "
                                                  "(5 episodes every 5000 steps) reaches this (D4RL's medium-replay: "
                                                  "training up to the medium agent's return).")
_RECIPE_VERSION = typer.Option(1, "--recipe-version",
                                       help="1: D4RL's construction (sampled actions, 1M steps per policy, a real "
                                            "SAC replay buffer for medium-replay); 0: deterministic agents, 100k "
                                            "steps, a corruption curriculum for medium-replay. The -vN of the ids.")
_MEMORY_TASK = typer.Option(None, "--memory-task",
                                    help="Write a memory task's dataset to --hdf5 FILE instead: recall (repeat the "
                                         "symbol shown --delay steps ago; oracle answers) or cartpole (position-only "
                                         "CartPole; a linear controller on the full state), with --epsilon random "
                                         "actions; --episodes (default 2000), --seed.")
_POLICIES = typer.Option(None, "--policies", help="Folder of pretrained policies for recipes (default: $RL_TFORMERS_POLICIES "
                                                                "else policies/ in $RL_TFORMERS_SHARED else ../shared/policies next "
                                                                "to the current folder or to the repository).")
_STOCHASTIC = typer.Option(False, "--stochastic",
                                    help="--policy samples its actions from its distribution (as D4RL's datasets do) "
                                         "instead of taking the most likely one.")


def collect(
    env: str = typer.Option(None, "--env", help="gymnasium id, e.g. Hopper-v5 (not needed with --recipe)."),
    policy: str = typer.Option("random", "--policy", help="'random', an SB3/sb3-contrib save file (model.zip), or "
                                                          "the run directory of an rl-tformers train run (its newest "
                                                          "checkpoint acts, as in rl-tformers eval)."),
    algo: str = typer.Option(None, "--algo", help="Algorithm of --policy (sac, ppo, ars, ...); detected when omitted."),
    stochastic: bool = _STOCHASTIC,
    obs_norm: str = typer.Option("auto", "--obs-norm",
                                 help="'auto' (obs_norm.npz next to the zip if present), 'none', or a .npz path."),
    train: str = typer.Option(None, "--train", help="Train an SB3 agent on the spot (sac, ppo, ...) and roll it out."),
    train_steps: int = typer.Option(100_000, "--train-steps",
                                    help="Environment steps of --train (the most, with --until-return)."),
    until_return: float = _UNTIL_RETURN,
    replay_dataset_id: str = typer.Option(None, "--replay-dataset-id",
                                          help="With --train: also write every training transition (SAC: its "
                                               "replay buffer) as this Minari dataset (a medium-replay set)."),
    steps: int = typer.Option(None, "--steps", help="Collect whole episodes until at least this many steps (default 10000 when neither --steps nor --episodes is given; 0 with --train and --replay-dataset-id: the replay set only)."),
    episodes: int = typer.Option(None, "--episodes", help="Collect exactly this many episodes."),
    noise: float = typer.Option(0.0, "--noise", help="Gaussian action noise std (units of half the action range), clipped to the space."),
    epsilon: float = typer.Option(None, "--epsilon",
                                  help="Probability of a uniform random action at each step (default 0; 0.2 with "
                                       "--memory-task)."),
    pomdp: str = typer.Option("none", "--pomdp", help="Record partial observations: none, positions (MuJoCo qpos only)."),
    obs_indices: str = typer.Option(None, "--obs-indices", help="Record only these observation indices (e.g. '0,1,2')."),
    seed: int = typer.Option(0, "--seed", help="Seed of episode resets, noise and random actions."),
    dataset_id: str = typer.Option(None, "--dataset-id", help="Minari id to write (default rlt/ENV/POLICY-v0, e.g. rlt/hopper-v5/sac-v0 for a SAC policy on Hopper-v5)."),
    root: Path = typer.Option(None, "--root", help="Data root (default $RL_TFORMERS_DATA, else Minari's own root: $MINARI_DATASETS_PATH or ~/.minari/datasets)."),
    hdf5: Path = typer.Option(None, "--hdf5", help="Also write a D4RL-layout HDF5 file (a folder with --recipe)."),
    recipe: list[str] = typer.Option(None, "--recipe", help="Build recipe(s) by name or glob (hopper-medium, 'hopper-*')."),
    recipe_steps: int = typer.Option(None, "--recipe-steps", help="Override the recipes' base size (default 1000000 in "
                                                                   "version 1, 100000 in version 0; at least 6)."),
    recipe_version: int = _RECIPE_VERSION,
    policies: Path = _POLICIES,
    list_recipes: bool = typer.Option(False, "--list-recipes", help="List the recipes and exit."),
    memory_task: str = _MEMORY_TASK,
    delay: int = typer.Option(None, "--delay", help=f"With --memory-task recall: the delay d, one of "
                                                     f"{', '.join(map(str, RECALL_DELAYS))} (default 8)."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace an existing dataset of the same id (and an existing --hdf5 file)."),
    skip_existing: bool = typer.Option(False, "--skip-existing",
                                       help="With --recipe: build only the recipes whose dataset does not exist yet (an "
                                            "existing one built with another size, seed or policies is refused)."),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Show progress on stderr: a bar on a terminal, else a plain line every 10 s "
                                       "or 5% of the steps."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """``rl-tformers collect``; its help text is :data:`COLLECT_HELP`."""
    a = CollectArgs(env, policy, algo, stochastic, obs_norm, train, train_steps, until_return, replay_dataset_id,
                    steps, episodes, noise, epsilon, pomdp, obs_indices, seed, dataset_id, root, hdf5,
                    tuple(recipe or ()), recipe_steps, recipe_version, policies, memory_task, delay, overwrite,
                    skip_existing, progress, as_json)
    _check_recipe_version(a)
    if list_recipes:
        return _list_recipes(recipe_steps, recipe_version)
    with _collect_session():
        _collect(a)


def _check_recipe_version(a: CollectArgs) -> None:
    from rl_tformers.envs import recipes as R

    if a.recipe_version not in R.VERSIONS:
        _fail(f"--recipe-version {a.recipe_version}: the recipe versions are {', '.join(map(str, R.VERSIONS))}")


def _list_recipes(recipe_steps: int | None, version: int) -> None:
    """``collect --list-recipes``: one line per recipe (name, dataset id, description)."""
    from rl_tformers.envs import recipes as R

    _check_recipe_steps(recipe_steps)
    recipes = list(R.all_recipes(recipe_steps, version).values())
    w_name, w_id = max(len(r.name) for r in recipes), max(len(r.dataset_id) for r in recipes)
    for r in recipes:  # columns as wide as the longest name and id
        typer.echo(f"{r.name:{w_name}s}  {r.dataset_id:{w_id}s}  {r.describe()}")


@contextlib.contextmanager
def _collect_session():
    """The block of a collection: torch on one thread (restored after), and SIGINT/SIGTERM
    (:func:`rl_tformers.envs.stopping.stop_signals`) end it with one line and exit status
    128 + the signal's number, leaving no half-written dataset."""
    import torch

    from rl_tformers.envs.stopping import stop_signals

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one small MLP per step: threads only add overhead (and nondeterminism)
    received: list[int] = []
    try:
        with stop_signals() as received:
            yield
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        typer.echo(f"interrupted ({signal.Signals(signum).name}): no half-written dataset is left; datasets reported "
                   "above are complete", err=True)
        raise typer.Exit(128 + int(signum)) from None
    finally:
        torch.set_num_threads(threads)


def _collect(a: CollectArgs) -> None:
    """A memory task's dataset (``--memory-task`` / ``--delay``), else recipes or a single collection."""
    if a.memory_task is not None or a.delay is not None:
        unused = a.given(*(n for n in SINGLE_OPTIONS if n not in ("episodes", "epsilon")), "root", "recipe",
                         "recipe_steps", "recipe_version", "policies", "skip_existing")
        _collect_memory_task(a.memory_task, a.delay, a.episodes, a.epsilon, a.seed, a.hdf5, a.overwrite, a.as_json,
                             unused)
        return
    _run_collect(a)


def _run_collect(a: CollectArgs) -> None:
    from rl_tformers.envs.dataset import DatasetError

    try:
        if a.skip_existing and not a.recipe:
            _fail("--skip-existing works with --recipe only")
        if a.seed < 0:
            _fail(f"--seed must be >= 0 (it seeds the episode resets), got {a.seed}")
        if a.recipe:
            # options of a single collection: a recipe sets them itself, they would be ignored
            ignored = a.given(*SINGLE_OPTIONS)
            if ignored:
                _fail(f"{', '.join(ignored)}: not used with --recipe (each recipe sets its environment, policies, "
                      "how they act, noise, size and dataset id; see --list-recipes); use --recipe-steps for the "
                      "size, or leave --recipe out to collect with these options")
            _build_recipes(a)
        else:
            for name in a.given("recipe_steps", "recipe_version"):
                _fail(f"{name} needs --recipe (use --steps or --episodes for a single collection)")
            for res in _collect_one(replace(a, epsilon=0.0 if a.epsilon is None else a.epsilon)):
                _report_collected(res, a.as_json)
    except (DatasetError, FileExistsError, FileNotFoundError, ValueError) as exc:
        _fail(str(exc))


def _report_collected(res, as_json: bool) -> None:
    """One line (or JSON object) per dataset written: its id, size, returns and path."""
    s = res.summary()
    if as_json:
        typer.echo(json.dumps(s))
    else:
        typer.echo(f"{s['dataset_id']}: {s['episodes']} episodes, {s['steps']} steps, return "
                   f"{s['return_mean']:.1f} ± {s['return_std']:.1f} -> {s['path']}"
                   + (f" (+ {s['hdf5']})" if s["hdf5"] else ""))


def _build_recipes(a: CollectArgs) -> None:
    """``collect --recipe``: check every matching recipe's dataset (and ``--hdf5`` file) against
    what exists before anything is built, then build them in order, reporting each."""
    from rl_tformers.envs import collect as C
    from rl_tformers.envs import recipes as R
    from rl_tformers.envs.collect import dataset_folder

    _check_recipe_steps(a.recipe_steps)
    if a.overwrite and a.skip_existing:
        _fail("--overwrite and --skip-existing exclude each other: choose one")
    hdf5 = a.hdf5
    if hdf5 is not None and Path(hdf5).expanduser().exists() and not Path(hdf5).expanduser().is_dir():
        _fail(f"--hdf5 {hdf5} is a file; with --recipe it is the folder that receives <recipe>.hdf5")
    todo = R.match_recipes(list(a.recipe), a.recipe_steps, a.recipe_version)
    # an existing dataset is compared with the build asked (recipe, version, size, seed, policies):
    # --skip-existing keeps only the same build, never a small --recipe-steps set in place of the full one
    existing = {r.name: R.existing_build(r, dataset_folder(r.dataset_id, a.root), steps=r.base_steps, seed=a.seed)
                for r in todo if dataset_folder(r.dataset_id, a.root).exists()}
    if existing and not (a.overwrite or a.skip_existing):
        ids = ", ".join(r.dataset_id + (f" [{existing[r.name].explain()}]" if existing[r.name].explain() else "")
                        for r in todo if r.name in existing)
        _fail(f"{len(existing)} of the {len(todo)} recipe datasets already "
              f"{'exists' if len(existing) == 1 else 'exist'} under "
              f"{dataset_folder('', a.root)}: {ids}; nothing was built. Pass --skip-existing to build only the "
              f"missing ones (it keeps only a dataset built as asked), or --overwrite to rebuild them")
    if a.skip_existing:
        _check_skipped_builds([e for e in existing.values() if e.recorded and not e.same])
    if hdf5 is not None and not a.overwrite:
        clash = [str(Path(hdf5).expanduser() / f"{r.name}.hdf5") for r in todo
                 if not (a.skip_existing and r.name in existing)
                 and (Path(hdf5).expanduser() / f"{r.name}.hdf5").exists()]
        if clash:
            _fail(f"--hdf5 {hdf5}: {', '.join(clash)} already "
                  f"{'exists' if len(clash) == 1 else 'exist'}; nothing was built. Pass --overwrite to "
                  "replace them, or choose another --hdf5 folder")
    for r in todo:
        if a.skip_existing and r.name in existing:
            typer.echo(_skipped_line(existing[r.name], a.as_json))
            continue
        h = None if hdf5 is None else Path(hdf5) / f"{r.name}.hdf5"
        _report_collected(C.build_recipe(r, seed=a.seed, root=a.root, policies=a.policies, hdf5=h,
                                         overwrite=a.overwrite, progress=a.progress), a.as_json)


def _collect_memory_task(task: str | None, delay: int | None, episodes: int | None, epsilon: float | None,
                         seed: int, hdf5: Path | None, overwrite: bool, as_json: bool, unused: list[str]) -> None:
    """``collect --memory-task TASK``: a scripted dataset of a memory task
    (:func:`rl_tformers.envs.memory_tasks.scripted_dataset`) written as one D4RL-layout file.

    ``unused`` lists the options given that a memory task does not use; any is refused, as are
    a missing ``--hdf5``, an unknown task, ``--delay`` without recall or
    outside :data:`~rl_tformers.envs.memory_tasks.RECALL_DELAYS`, and counts out of range.
    """
    from rl_tformers.envs.collect import check_hdf5_target
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    if task is None:
        _fail("--delay needs --memory-task recall")
    if task not in MEMORY_TASKS:
        _fail(f"--memory-task {task!r} is not a memory task; choose {' or '.join(MEMORY_TASKS)}")
    if unused:
        _fail(f"{', '.join(unused)}: not used with --memory-task (it writes the scripted behaviour's episodes to "
              f"--hdf5 FILE; its options are --episodes, --epsilon, --seed, --delay for recall and --overwrite)")
    if delay is not None and task != "recall":
        _fail(f"--delay is the recall task's; --memory-task {task} has none")
    if delay is not None and delay not in RECALL_DELAYS:
        _fail(f"--delay {delay}: the recall task is registered with d in {', '.join(map(str, RECALL_DELAYS))}")
    if episodes is not None and episodes < 1:
        _fail(f"--episodes must be >= 1, got {episodes}")
    if epsilon is not None and not 0.0 <= epsilon <= 1.0:  # NaN fails too
        _fail(f"--epsilon must be a probability in [0, 1], got {epsilon}")
    if seed < 0:
        _fail(f"--seed must be >= 0 (it seeds the episode resets), got {seed}")
    if hdf5 is None:
        example = f"data/memory/recall-d{delay or 8}.hdf5" if task == "recall" else "data/memory/cartpole-positions.hdf5"
        _fail(f"--memory-task writes one D4RL-layout file: give it with --hdf5 FILE (e.g. --hdf5 {example})")
    try:
        check_hdf5_target(hdf5, overwrite)
    except (FileExistsError, ValueError) as exc:
        _fail(str(exc))
    ds = scripted_dataset(task, 2000 if episodes is None else episodes, seed=seed, delay=8 if delay is None else delay,
                          epsilon=0.2 if epsilon is None else epsilon)
    path = save_d4rl_hdf5(ds, hdf5)
    r = ds.episode_returns
    summary = {"dataset_id": ds.metadata.dataset_id, "env_id": ds.metadata.env_id, "episodes": ds.num_episodes,
               "steps": ds.num_steps, "return_mean": float(r.mean()), "return_std": float(r.std()), "path": str(path)}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(f"{summary['dataset_id']}: {ds.num_episodes} episodes, {ds.num_steps} steps, return "
                   f"{summary['return_mean']:.1f} ± {summary['return_std']:.1f} -> {path} (env {ds.metadata.env_id})")


def _check_skipped_builds(differing: list) -> None:
    """Refuse ``--skip-existing`` before anything is built when an existing recipe dataset records
    another build than the one asked (:class:`rl_tformers.envs.recipes.ExistingBuild`)."""
    if not differing:
        return
    lines = []
    for e in differing:
        opts = e.matching_options()
        keep = f", or {' '.join(opts)} to keep it" if opts else ""
        lines.append(f"  {e.recipe.dataset_id} at {e.path}: {e.explain()} (--overwrite to rebuild it{keep})")
    matches = {tuple(e.matching_options() or ()) for e in differing}
    together = next(iter(matches)) if len(matches) == 1 and () not in matches else ()
    one = len(differing) == 1
    _fail(f"--skip-existing keeps only a dataset built by the same recipe with the same size, seed and policies; "
          f"{len(differing)} existing {'dataset was' if one else 'datasets were'} built otherwise (as recorded in "
          f"{'its' if one else 'their'} metadata), so nothing was built:\n" + "\n".join(lines) + "\n"
          f"Pass --overwrite to rebuild {'it' if one else 'them'} as asked"
          + (f", or {' '.join(together)} to build the missing ones like {'it' if one else 'them'}" if together else "")
          + (" (a --recipe-steps set is written under the recipe's own dataset id, whatever its size)"
             if any(e.built_steps() not in (None, e.steps) for e in differing) else ""))


def _skipped_line(e, as_json: bool) -> str:
    """The line of a dataset ``--skip-existing`` keeps: built as asked, or not recorded (said so)."""
    note = None if e.recorded else ("its metadata records no rl-tformers build (not a recipe's dataset, or unreadable): "
                                    "kept unchecked; --overwrite rebuilds it")
    if as_json:
        return json.dumps({"dataset_id": e.recipe.dataset_id, "skipped": "exists", "path": str(e.path),
                           **({"note": note} if note else {"recipe_steps": e.steps, "seed": e.seed})})
    built = f"built as asked (--recipe-steps {e.steps}, --seed {e.seed})" if note is None else note
    return f"{e.recipe.dataset_id}: exists at {e.path}, {built}, skipped"


def _collect_one(a: CollectArgs):
    """A single collection (no ``--recipe``): check the options, then roll out the behaviour
    policy (after ``--train`` trains it); returns the collection results (the training replay
    set first, when asked for)."""
    import gymnasium as gym

    from rl_tformers.envs.collect import Behaviour, check_hdf5_target, check_recordable, collect

    steps = _checked_collect_options(a)
    check_hdf5_target(a.hdf5, a.overwrite)  # before the (long) rollouts, not after them
    if a.train and a.replay_dataset_id and a.hdf5 is not None:
        check_hdf5_target(Path(a.hdf5).with_name(Path(a.hdf5).stem + "-replay.hdf5"), a.overwrite)
    from rl_tformers.envs.environments import MissingExtraError, make_task

    try:
        genv = make_task(a.env)  # pixel ids with their preprocessing, as collected
    except MissingExtraError as exc:  # an Atari, MinAtar or POPGym id without its extra
        raise fail(f"--env: {exc}") from None
    except (gym.error.Error, ModuleNotFoundError) as exc:  # unknown id or module:, missing dependency, deprecated
        raise typer.BadParameter(f"cannot make environment {a.env!r}: {exc}", param_hint="--env") from None
    try:
        check_recordable(genv)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None
    record = _record_option(genv, a.pomdp, a.obs_indices)
    results = []
    info: dict = {"noise": a.noise, "epsilon": a.epsilon, **({"stochastic": True} if a.stochastic else {})}
    pol, label = _behaviour_policy(genv, a, record, info, results)
    if (steps or 0) == 0 and (a.episodes or 0) == 0:
        return results  # only the training replay was asked for
    suffix = "" if record is None else f"-{record['kind'] if record['kind'] == 'positions' else 'masked'}"
    # "module:EnvId" (gymnasium's form for a user's own env): ':' is not allowed in a Minari id; a
    # namespaced id's '/' (ALE/Breakout-v5) becomes '-': rlt/ale-breakout-v5/random-v0
    dataset_id = a.dataset_id or f"rlt/{a.env.rpartition(':')[2].lower().replace('/', '-')}/{label}{suffix}-v0"
    results.append(collect(a.env, [Behaviour(pol, steps=steps, episodes=a.episodes, label=info["policy"], info=info)],
                           dataset_id=dataset_id, seed=a.seed, pomdp=record, root=a.root, hdf5=a.hdf5,
                           overwrite=a.overwrite, progress=a.progress,
                           description=f"rl-tformers collect: {info['policy']} on {a.env}",
                           record={"algorithm": info["policy"]}))
    return results


def _checked_collect_options(a: CollectArgs) -> int | None:
    """The checks of a single collection's options (``typer.BadParameter`` naming the option);
    returns ``--steps`` with its default (10000, or 0 for a replay set only)."""
    steps, episodes, train = a.steps, a.episodes, a.train
    if a.env is None:
        raise typer.BadParameter("give --env (or --recipe)", param_hint="--env")
    if steps is not None and episodes is not None:
        raise typer.BadParameter("give --steps or --episodes, not both", param_hint="--steps")
    if steps is None and episodes is None:
        steps = 0 if (train and a.replay_dataset_id) else 10_000
    for option, needs in (("replay_dataset_id", "train"), ("until_return", "train")):
        if getattr(a, option) is not None and not getattr(a, needs):
            name = "--" + option.replace("_", "-")
            raise typer.BadParameter(f"{name} needs --train", param_hint=name)
    if a.stochastic and (train or a.policy == "random"):
        raise typer.BadParameter("--stochastic samples the actions of a --policy save file (random actions and "
                                 "--train have no mode to replace)", param_hint="--stochastic")
    if a.until_return is not None and not math.isfinite(a.until_return):
        raise typer.BadParameter(f"--until-return must be a finite return, got {a.until_return}",
                                 param_hint="--until-return")
    if steps is not None and steps < 0 or episodes is not None and episodes < 0:
        name, value = ("--steps", steps) if steps is not None else ("--episodes", episodes)
        raise typer.BadParameter(f"{name} must be >= 0, got {value}", param_hint=name)
    if not (math.isfinite(a.noise) and a.noise >= 0):
        raise typer.BadParameter(f"--noise must be a finite number >= 0 (a std in units of half the action range), "
                                 f"got {a.noise}", param_hint="--noise")
    if not 0.0 <= a.epsilon <= 1.0:  # NaN fails too
        raise typer.BadParameter(f"--epsilon must be a probability in [0, 1], got {a.epsilon}", param_hint="--epsilon")
    if train and a.train_steps < 1:
        raise typer.BadParameter(f"--train-steps must be >= 1, got {a.train_steps}", param_hint="--train-steps")
    _check_collect_ids(a)
    if (steps or 0) == 0 and (episodes or 0) == 0 and not (train and a.replay_dataset_id):
        raise typer.BadParameter(f"{'--steps' if steps is not None else '--episodes'} 0 collects nothing; give a "
                                 "positive number (0 is meant for --train with --replay-dataset-id only)",
                                 param_hint="--steps/--episodes")
    return steps


def _check_collect_ids(a: CollectArgs) -> None:
    """``--dataset-id`` and ``--replay-dataset-id`` are well-formed Minari ids."""
    if a.dataset_id is None and not a.replay_dataset_id:
        return
    from rl_tformers.envs.collect import check_dataset_id

    for option, value in (("--dataset-id", a.dataset_id), ("--replay-dataset-id", a.replay_dataset_id)):
        if value is not None:
            try:
                check_dataset_id(value, option)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=option) from None


def _record_option(genv, pomdp: str, obs_indices: str | None):
    """What is recorded of the observations: None (all), ``--obs-indices`` or ``--pomdp positions``
    (:func:`rl_tformers.envs.pomdp.pomdp_record`)."""
    from rl_tformers.envs.pomdp import pomdp_record

    if obs_indices is not None:
        if pomdp not in ("none", "mask"):
            raise typer.BadParameter("--obs-indices and --pomdp positions exclude each other", param_hint="--obs-indices")
        return pomdp_record(genv, "mask", _parse_indices(obs_indices))
    if pomdp == "positions":
        return pomdp_record(genv, "positions")
    if pomdp != "none":
        raise typer.BadParameter(f"unknown --pomdp {pomdp!r}; choose none or positions (or use --obs-indices)",
                                 param_hint="--pomdp")
    return None


def _behaviour_policy(genv, a: CollectArgs, record, info: dict, results: list):
    """The behaviour policy and its label in the dataset id: trained on the spot (``--train``;
    its replay set, when asked for, is appended to ``results``), random, or an SB3 file
    (sampling with ``--stochastic``); with ``--noise`` / ``--epsilon`` applied. ``info["policy"]``
    records which."""
    from rl_tformers.envs.collect import train_and_record
    from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, load_sb3_policy

    if a.train:
        hdf5 = None if (a.hdf5 is None or not a.replay_dataset_id) else \
            Path(a.hdf5).with_name(Path(a.hdf5).stem + "-replay.hdf5")
        pol, replay = train_and_record(a.train, a.env, a.train_steps, seed=a.seed,
                                       replay_dataset_id=a.replay_dataset_id, pomdp=record, root=a.root,
                                       overwrite=a.overwrite, progress=a.progress, hdf5=hdf5,
                                       until_return=a.until_return)
        if replay is not None:
            results.append(replay)
        label = f"{a.train}-trained"
        info["policy"] = f"{a.train} trained {pol.model.num_timesteps} steps"
    elif a.policy == "random":
        pol, label = RandomPolicy(genv.action_space, seed=a.seed), "random"
        info["policy"] = "random"
    elif Path(a.policy).is_dir():
        pol, label = _run_policy(a, genv)
        info["policy"] = pol.name
    else:
        norm = None if a.obs_norm.lower() in ("none", "false", "off") else a.obs_norm
        pol = load_sb3_policy(a.policy, genv, algo=a.algo, obs_norm=norm, deterministic=not a.stochastic,
                              seed=a.seed + 2)
        label = pol.name.split(":", 1)[0]
        info["policy"] = str(a.policy)
    if info["noise"] > 0 or info["epsilon"] > 0:
        pol = NoisyPolicy(pol, genv.action_space, noise_std=info["noise"], epsilon=info["epsilon"], seed=a.seed + 1)
    return pol, label


def _run_policy(a: CollectArgs, genv):
    """The newest checkpoint of the run directory ``--policy`` as a behaviour policy (the mode of
    its actions, sampled with ``--stochastic``; a return-conditioned run asks for its default
    target) and its label in the dataset id (the run's agent kind). Refused (exit 2) when it is no
    loadable run, trained on another task than ``--env``, or (a run whose data named no task) on
    observations or actions of another shape than ``genv``'s."""
    import torch  # the run's model acts (heavy: imported by this branch only)

    from rl_tformers.envs.collect import RunPolicy
    from rl_tformers.runtime.agent_registry import UnknownAgentError
    from rl_tformers.runtime.checkpoint import CheckpointError
    from rl_tformers.runtime.loading import load_run

    for option, value in (("--algo", a.algo), ("--obs-norm", None if a.obs_norm == "auto" else a.obs_norm)):
        if value is not None:
            raise fail(f"{option} {value}: applies to an SB3 save file; the run directory --policy {a.policy} "
                       f"holds its agent kind and observation statistics in its checkpoint")
    try:
        run = load_run(a.policy, "cpu")
    except (CheckpointError, UnknownAgentError, TypeError, ValueError) as exc:
        raise fail(f"--policy {a.policy}: {' '.join(str(exc).split())}") from None
    run_env = run.extra.get("env_id") or run.cfg.agent.get("env_id")
    if run_env is not None and str(run_env) != a.env:
        raise fail(f"--policy {a.policy} was trained on {run_env}, not on --env {a.env}")
    mismatch = _run_space_mismatch(run.extra, genv)
    if mismatch:
        raise fail(f"--policy {a.policy} was trained on {mismatch}; it cannot act in --env {a.env}")
    try:
        policy = run.agent.policy(deterministic=not a.stochastic) if a.stochastic else run.agent.policy()
    except TypeError:
        raise fail(f"--stochastic: the {run.kind} run {a.policy} has no sampled policy") from None
    torch.manual_seed(a.seed + 2)  # a sampled policy draws from torch's generator
    target = run.agent.default_targets()[0]
    name = f"{run.kind} run {a.policy} (step {run.step})"
    return RunPolicy(policy, target, name=name), run.kind.replace("_", "-")


def _run_space_mismatch(extra: dict, genv) -> str | None:
    """How the observations and actions a run was trained on (its checkpoint's ``obs_shape``,
    ``discrete`` and ``act_dim``, where recorded) differ from ``genv``'s spaces, or None."""
    import gymnasium as gym

    obs_shape = extra.get("obs_shape")
    env_obs = tuple(genv.observation_space.shape or ())
    if obs_shape is not None and tuple(int(v) for v in obs_shape) != env_obs:
        return f"observations of shape {tuple(int(v) for v in obs_shape)}, the environment's are {env_obs}"
    space, discrete, act_dim = genv.action_space, extra.get("discrete"), extra.get("act_dim")
    if discrete is None or act_dim is None:
        return None
    if isinstance(space, gym.spaces.Discrete):
        env_discrete, env_dim = True, int(space.n)
    else:
        env_discrete, env_dim = False, math.prod(space.shape or ())
    if bool(discrete) != env_discrete or int(act_dim) != env_dim:
        def kind(d: bool, n: int) -> str:
            return f"{n} discrete actions" if d else f"{n} continuous action values"
        return f"{kind(bool(discrete), int(act_dim))}, the environment has {kind(env_discrete, env_dim)}"
    return None


@dataset_app.command("info")
def info(
    dataset: str = typer.Argument(..., help="Minari id, Minari dataset folder or D4RL .hdf5 file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    download: bool = typer.Option(False, "--download", help="Download a Minari id that is not found locally."),
    flatten_observations: bool = typer.Option(False, "--flatten-observations",
                                              help="Flatten Dict/Tuple observations (gymnasium flatten_space)."),
    root: Path = typer.Option(None, "--root", help="Data root searched first for Minari ids."),
    max_ep_len: int = typer.Option(None, "--max-ep-len", min=1, help="Also refuse episodes longer than this."),
) -> None:
    """Validate a dataset and print its statistics (exit 2 with the validation error on stderr if it is bad).

    A dataset whose env_id names an environment that can be made here is also compared with it: a per-step observation shape or action space that does not match is a warning line on stderr.
    """
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    _check_dataset_arg(dataset)
    try:
        ds = load_dataset(dataset, download=download, flatten_observations=flatten_observations, root=root,
                          max_ep_len=max_ep_len, lazy=True)
    except (DatasetError, FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
    s = ds.summary()
    mismatch = _env_mismatch(ds, flatten_observations)
    if as_json:
        typer.echo(json.dumps(s, indent=2))  # one object, indented as eval --json prints its report
    else:
        width = max(len(k) for k in s)
        for k, v in s.items():
            if isinstance(v, float):
                v = f"{v:.4f}"
            typer.echo(f"{k:<{width}}  {v}")
    if mismatch:
        typer.echo(f"warning: {mismatch}", err=True)


def _env_mismatch(ds, flatten_observations: bool = False) -> str | None:
    """How the environment ``ds`` names (``env_id``, made with its ``env_kwargs`` and POMDP mask,
    flattened like ``--flatten-observations``) does not fit its per-step observations or actions,
    or None: it fits, the dataset names none, or it cannot be made here (not registered,
    dependencies missing), so there is nothing to compare with."""
    import gymnasium as gym

    from rl_tformers.envs import memory_tasks  # noqa: F401 - registers the project's own tasks
    from rl_tformers.envs.loaders import names_unimported_module
    from rl_tformers.envs.pomdp import make_env

    meta = ds.metadata
    if not meta.env_id or names_unimported_module(str(meta.env_id)):
        return None  # a "module:EnvId" whose module the dataset (not the user) names is not imported
    try:
        env = make_env(str(meta.env_id), dict(meta.pomdp) if meta.pomdp else None,
                       **dict(meta.extra.get("env_kwargs") or {}))
        if flatten_observations and not isinstance(env.observation_space, gym.spaces.Box):
            env = gym.wrappers.FlattenObservation(env)
    except Exception:  # noqa: BLE001 - an environment that cannot be made here is not checked
        return None
    try:
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    problems = []
    shape = tuple(ds.observation_shape)
    if not isinstance(obs_space, gym.spaces.Box) or tuple(obs_space.shape) != shape:
        theirs = (f"of shape {tuple(obs_space.shape)}" if isinstance(obs_space, gym.spaces.Box)
                  else f"in {obs_space} (not a Box)")
        problems.append(f"observations of shape {shape} per step in the data, {theirs} in the environment")
    if isinstance(act_space, gym.spaces.Discrete) != ds.discrete_actions or (
            isinstance(act_space, gym.spaces.Box) and tuple(act_space.shape) != tuple(ds.action_shape)) or (
            ds.discrete_actions and int(act_space.start) != int(ds.action_space.start)):
        problems.append(f"actions in {ds.action_space} in the data, in {act_space} in the environment")
    if not problems:
        return None
    return (f"the dataset does not match its environment {meta.env_id}: {'; '.join(problems)}; training on it "
            f"needs agent.env_id set to the environment the data came from")


@dataset_app.command("export")
def export(
    dataset: str = typer.Argument(..., help="Minari id, Minari dataset folder or D4RL .hdf5 file."),
    out: Path = typer.Argument(..., help="D4RL-layout .hdf5 file to write."),
    download: bool = typer.Option(False, "--download", help="Download a Minari id that is not found locally."),
    flatten_observations: bool = typer.Option(False, "--flatten-observations",
                                              help="Flatten Dict/Tuple observations (gymnasium flatten_space)."),
    root: Path = typer.Option(None, "--root", help="Data root searched first for Minari ids."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
) -> None:
    """Validate a dataset and write it as one flat D4RL-layout HDF5 file (fast to reload, lazy-loadable)."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset, save_d4rl_hdf5

    _check_dataset_arg(dataset)
    if out.expanduser().is_dir():  # before reading the dataset
        _fail(f"{out} is a directory; OUT is the .hdf5 file to write (e.g. {out / 'dataset.hdf5'})")
    if out.expanduser().exists() and not overwrite:
        _fail(f"OUT {out} already exists; pass --overwrite to replace it, or choose another file")
    above = blocking_file(out)
    if above is not None:
        _fail(f"OUT {out}: {above} is a file, not a directory")
    try:
        ds = load_dataset(dataset, download=download, flatten_observations=flatten_observations, root=root)
    except (DatasetError, FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
    try:
        path = save_d4rl_hdf5(ds, out)
    except OSError as exc:  # a parent that is a file, no permission, disk full...
        _fail(f"cannot write {out}: {exc}")
    typer.echo(f"{dataset}: {ds.num_episodes} episodes, {ds.num_steps} steps -> {path}")


def register(app: typer.Typer) -> None:
    """Add ``collect`` and the ``dataset`` command group to the ``rl-tformers`` app."""
    app.command("collect", help=COLLECT_HELP)(collect)
    app.add_typer(dataset_app, name="dataset")
