"""Command line of the data layer: ``rl-tformers collect`` and ``rl-tformers dataset info``."""

from __future__ import annotations

import contextlib
import json
import math
import signal
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


def collect(
    env: str = typer.Option(None, "--env", help="gymnasium id, e.g. Hopper-v5 (not needed with --recipe)."),
    policy: str = typer.Option("random", "--policy", help="'random' or an SB3/sb3-contrib save file (model.zip)."),
    algo: str = typer.Option(None, "--algo", help="Algorithm of --policy (sac, ppo, ars, ...); detected when omitted."),
    obs_norm: str = typer.Option("auto", "--obs-norm",
                                 help="'auto' (obs_norm.npz next to the zip if present), 'none', or a .npz path."),
    train: str = typer.Option(None, "--train", help="Train an SB3 agent on the spot (sac, ppo, ...) and roll it out."),
    train_steps: int = typer.Option(100_000, "--train-steps", help="Environment steps of --train."),
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
    recipe_steps: int = typer.Option(None, "--recipe-steps", help="Override the recipes' base size (default 100000, at least 6)."),
    policies: Path = typer.Option(None, "--policies", help="Folder of pretrained policies for recipes (default: $RL_TFORMERS_POLICIES "
                                                                "else policies/ in $RL_TFORMERS_SHARED else ../shared/policies next "
                                                                "to the current folder or to the repository)."),
    list_recipes: bool = typer.Option(False, "--list-recipes", help="List the recipes and exit."),
    memory_task: str = typer.Option(None, "--memory-task",
                                    help="Write a memory task's dataset to --hdf5 FILE instead: recall (repeat the "
                                         "symbol shown --delay steps ago; oracle answers) or cartpole (position-only "
                                         "CartPole; a linear controller on the full state), with --epsilon random "
                                         "actions; --episodes (default 2000), --seed."),
    delay: int = typer.Option(None, "--delay", help=f"With --memory-task recall: the delay d, one of "
                                                     f"{', '.join(map(str, RECALL_DELAYS))} (default 8)."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace an existing dataset of the same id (and an existing --hdf5 file)."),
    skip_existing: bool = typer.Option(False, "--skip-existing",
                                       help="With --recipe: build only the recipes whose dataset does not exist yet (an "
                                            "existing one built with another size, seed or policies is refused)."),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Show progress on stderr: a bar on a terminal, else a plain line every 30 s."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """``rl-tformers collect``; its help text is :data:`COLLECT_HELP`."""
    if list_recipes:
        return _list_recipes(recipe_steps)
    with _collect_session():
        _collect(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
                 pomdp, obs_indices, seed, dataset_id, root, hdf5, recipe, recipe_steps, policies, memory_task, delay,
                 overwrite, skip_existing, progress, as_json)


def _list_recipes(recipe_steps: int | None) -> None:
    """``collect --list-recipes``: one line per recipe (name, dataset id, description)."""
    from rl_tformers.envs import recipes as R

    _check_recipe_steps(recipe_steps)
    recipes = list(R.all_recipes(recipe_steps or R.DEFAULT_STEPS).values())
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


def _collect(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
             pomdp, obs_indices, seed, dataset_id, root, hdf5, recipe, recipe_steps, policies, memory_task, delay,
             overwrite, skip_existing, progress, as_json) -> None:
    """A memory task's dataset (``--memory-task`` / ``--delay``), else recipes or a single collection."""
    if memory_task is not None or delay is not None:
        _collect_memory_task(memory_task, delay, episodes, epsilon, seed, hdf5, overwrite, as_json, {
            "--env": env is not None, "--policy": policy != "random", "--algo": algo is not None,
            "--obs-norm": obs_norm != "auto", "--train": train is not None,
            "--train-steps": train_steps != 100_000, "--replay-dataset-id": replay_dataset_id is not None,
            "--steps": steps is not None, "--noise": noise != 0.0, "--pomdp": pomdp != "none",
            "--obs-indices": obs_indices is not None, "--dataset-id": dataset_id is not None,
            "--root": root is not None, "--recipe": bool(recipe), "--recipe-steps": recipe_steps is not None,
            "--policies": policies is not None, "--skip-existing": skip_existing})
        return
    _run_collect(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes, noise,
                 0.0 if epsilon is None else epsilon, pomdp, obs_indices, seed, dataset_id, root, hdf5, recipe,
                 recipe_steps, policies, overwrite, skip_existing, progress, as_json)


def _run_collect(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
                 pomdp, obs_indices, seed, dataset_id, root, hdf5, recipe, recipe_steps, policies, overwrite,
                 skip_existing, progress, as_json) -> None:
    from rl_tformers.envs.dataset import DatasetError

    try:
        if skip_existing and not recipe:
            _fail("--skip-existing works with --recipe only")
        if seed < 0:
            _fail(f"--seed must be >= 0 (it seeds the episode resets), got {seed}")
        if recipe:
            # options of a single collection: a recipe sets them itself, they would be ignored
            ignored = [name for name, given in (
                ("--env", env is not None), ("--policy", policy != "random"), ("--algo", algo is not None),
                ("--obs-norm", obs_norm != "auto"), ("--train", train is not None),
                ("--train-steps", train_steps != 100_000), ("--replay-dataset-id", replay_dataset_id is not None),
                ("--steps", steps is not None), ("--episodes", episodes is not None), ("--noise", noise != 0.0),
                ("--epsilon", epsilon != 0.0), ("--pomdp", pomdp != "none"), ("--obs-indices", obs_indices is not None),
                ("--dataset-id", dataset_id is not None)) if given]
            if ignored:
                _fail(f"{', '.join(ignored)}: not used with --recipe (each recipe sets its environment, policies, "
                      "noise, size and dataset id; see --list-recipes); use --recipe-steps for the size, or leave "
                      "--recipe out to collect with these options")
            _build_recipes(recipe, recipe_steps, seed, root, policies, hdf5, overwrite, skip_existing, progress,
                           as_json)
        else:
            if recipe_steps is not None:
                _fail("--recipe-steps needs --recipe (use --steps or --episodes for a single collection)")
            for res in _collect_one(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes,
                                    noise, epsilon, pomdp, obs_indices, seed, dataset_id, root, hdf5, overwrite,
                                    progress):
                _report_collected(res, as_json)
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


def _build_recipes(recipe, recipe_steps, seed, root, policies, hdf5, overwrite, skip_existing, progress,
                   as_json) -> None:
    """``collect --recipe``: check every matching recipe's dataset (and ``--hdf5`` file) against
    what exists before anything is built, then build them in order, reporting each."""
    from rl_tformers.envs import collect as C
    from rl_tformers.envs import recipes as R
    from rl_tformers.envs.collect import dataset_folder

    _check_recipe_steps(recipe_steps)
    if overwrite and skip_existing:
        _fail("--overwrite and --skip-existing exclude each other: choose one")
    if hdf5 is not None and Path(hdf5).expanduser().exists() and not Path(hdf5).expanduser().is_dir():
        _fail(f"--hdf5 {hdf5} is a file; with --recipe it is the folder that receives <recipe>.hdf5")
    todo = R.match_recipes(list(recipe), recipe_steps or R.DEFAULT_STEPS)
    # an existing dataset is compared with the build asked (recipe, size, seed, policies):
    # --skip-existing keeps only the same build, never a small --recipe-steps set in place of the full one
    existing = {r.name: R.existing_build(r, dataset_folder(r.dataset_id, root),
                                         steps=recipe_steps or R.DEFAULT_STEPS, seed=seed)
                for r in todo if dataset_folder(r.dataset_id, root).exists()}
    if existing and not (overwrite or skip_existing):
        ids = ", ".join(r.dataset_id + (f" [{existing[r.name].explain()}]" if existing[r.name].explain() else "")
                        for r in todo if r.name in existing)
        _fail(f"{len(existing)} of the {len(todo)} recipe datasets already "
              f"{'exists' if len(existing) == 1 else 'exist'} under "
              f"{dataset_folder('', root)}: {ids}; nothing was built. Pass --skip-existing to build only the "
              f"missing ones (it keeps only a dataset built as asked), or --overwrite to rebuild them")
    if skip_existing:
        _check_skipped_builds([e for e in existing.values() if e.recorded and not e.same])
    if hdf5 is not None and not overwrite:
        clash = [str(Path(hdf5).expanduser() / f"{r.name}.hdf5") for r in todo
                 if not (skip_existing and r.name in existing)
                 and (Path(hdf5).expanduser() / f"{r.name}.hdf5").exists()]
        if clash:
            _fail(f"--hdf5 {hdf5}: {', '.join(clash)} already "
                  f"{'exists' if len(clash) == 1 else 'exist'}; nothing was built. Pass --overwrite to "
                  "replace them, or choose another --hdf5 folder")
    for r in todo:
        if skip_existing and r.name in existing:
            typer.echo(_skipped_line(existing[r.name], as_json))
            continue
        h = None if hdf5 is None else Path(hdf5) / f"{r.name}.hdf5"
        _report_collected(C.build_recipe(r, seed=seed, root=root, policies=policies, hdf5=h, overwrite=overwrite,
                                         progress=progress), as_json)


def _collect_memory_task(task: str | None, delay: int | None, episodes: int | None, epsilon: float | None,
                         seed: int, hdf5: Path | None, overwrite: bool, as_json: bool, given: dict[str, bool]) -> None:
    """``collect --memory-task TASK``: a scripted dataset of a memory task
    (:func:`rl_tformers.envs.memory_tasks.scripted_dataset`) written as one D4RL-layout file.

    ``given`` maps the options a memory task does not use to whether they were given; any given
    one is refused, as are a missing ``--hdf5``, an unknown task, ``--delay`` without recall or
    outside :data:`~rl_tformers.envs.memory_tasks.RECALL_DELAYS`, and counts out of range.
    """
    from rl_tformers.envs.collect import check_hdf5_target
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    if task is None:
        _fail("--delay needs --memory-task recall")
    if task not in MEMORY_TASKS:
        _fail(f"--memory-task {task!r} is not a memory task; choose {' or '.join(MEMORY_TASKS)}")
    unused = [name for name, was_given in given.items() if was_given]
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


def _collect_one(env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
                 pomdp, obs_indices, seed, dataset_id, root, hdf5, overwrite, progress):
    """A single collection (no ``--recipe``): check the options, then roll out the behaviour
    policy (after ``--train`` trains it); returns the collection results (the training replay
    set first, when asked for)."""
    import gymnasium as gym

    from rl_tformers.envs.collect import Behaviour, check_hdf5_target, check_recordable, collect

    steps = _checked_collect_options(env, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
                                     dataset_id)
    check_hdf5_target(hdf5, overwrite)  # before the (long) rollouts, not after them
    if train and replay_dataset_id and hdf5 is not None:
        check_hdf5_target(Path(hdf5).with_name(Path(hdf5).stem + "-replay.hdf5"), overwrite)
    try:
        genv = gym.make(env)
    except (gym.error.Error, ModuleNotFoundError) as exc:  # unknown id or module:, missing dependency, deprecated
        raise typer.BadParameter(f"cannot make environment {env!r}: {exc}", param_hint="--env") from None
    try:
        check_recordable(genv)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None
    record = _record_option(genv, pomdp, obs_indices)
    results = []
    info: dict = {"noise": noise, "epsilon": epsilon}
    pol, label = _behaviour_policy(genv, env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, seed,
                                   record, root, hdf5, overwrite, progress, info, results)
    if (steps or 0) == 0 and (episodes or 0) == 0:
        return results  # only the training replay was asked for
    suffix = "" if record is None else f"-{record['kind'] if record['kind'] == 'positions' else 'masked'}"
    # "module:EnvId" (gymnasium's form for a user's own env): ':' is not allowed in a Minari id
    dataset_id = dataset_id or f"rlt/{env.rpartition(':')[2].lower()}/{label}{suffix}-v0"
    results.append(collect(env, [Behaviour(pol, steps=steps, episodes=episodes, label=info["policy"], info=info)],
                           dataset_id=dataset_id, seed=seed, pomdp=record, root=root, hdf5=hdf5, overwrite=overwrite,
                           progress=progress, description=f"rl-tformers collect: {info['policy']} on {env}",
                           record={"algorithm": info["policy"]}))
    return results


def _checked_collect_options(env, train, train_steps, replay_dataset_id, steps, episodes, noise, epsilon,
                             dataset_id) -> int | None:
    """The checks of a single collection's options (``typer.BadParameter`` naming the option);
    returns ``--steps`` with its default (10000, or 0 for a replay set only)."""
    if env is None:
        raise typer.BadParameter("give --env (or --recipe)", param_hint="--env")
    if steps is not None and episodes is not None:
        raise typer.BadParameter("give --steps or --episodes, not both", param_hint="--steps")
    if steps is None and episodes is None:
        steps = 0 if (train and replay_dataset_id) else 10_000
    if replay_dataset_id and not train:
        raise typer.BadParameter("--replay-dataset-id needs --train", param_hint="--replay-dataset-id")
    if steps is not None and steps < 0 or episodes is not None and episodes < 0:
        name, value = ("--steps", steps) if steps is not None else ("--episodes", episodes)
        raise typer.BadParameter(f"{name} must be >= 0, got {value}", param_hint=name)
    if not (math.isfinite(noise) and noise >= 0):
        raise typer.BadParameter(f"--noise must be a finite number >= 0 (a std in units of half the action range), "
                                 f"got {noise}", param_hint="--noise")
    if not 0.0 <= epsilon <= 1.0:  # NaN fails too
        raise typer.BadParameter(f"--epsilon must be a probability in [0, 1], got {epsilon}", param_hint="--epsilon")
    if train and train_steps < 1:
        raise typer.BadParameter(f"--train-steps must be >= 1, got {train_steps}", param_hint="--train-steps")
    if dataset_id is not None or replay_dataset_id:
        from rl_tformers.envs.collect import check_dataset_id

        for option, value in (("--dataset-id", dataset_id), ("--replay-dataset-id", replay_dataset_id)):
            if value is not None:
                try:
                    check_dataset_id(value, option)
                except ValueError as exc:
                    raise typer.BadParameter(str(exc), param_hint=option) from None
    if (steps or 0) == 0 and (episodes or 0) == 0 and not (train and replay_dataset_id):
        raise typer.BadParameter(f"{'--steps' if steps is not None else '--episodes'} 0 collects nothing; give a "
                                 "positive number (0 is meant for --train with --replay-dataset-id only)",
                                 param_hint="--steps/--episodes")
    return steps


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


def _behaviour_policy(genv, env, policy, algo, obs_norm, train, train_steps, replay_dataset_id, seed, record, root,
                      hdf5, overwrite, progress, info: dict, results: list):
    """The behaviour policy and its label in the dataset id: trained on the spot (``--train``;
    its replay set, when asked for, is appended to ``results``), random, or an SB3 file; with
    ``--noise`` / ``--epsilon`` applied. ``info["policy"]`` records which."""
    from rl_tformers.envs.collect import train_and_record
    from rl_tformers.envs.policies import NoisyPolicy, RandomPolicy, load_sb3_policy

    if train:
        pol, replay = train_and_record(train, env, train_steps, seed=seed, replay_dataset_id=replay_dataset_id,
                                       pomdp=record, root=root, overwrite=overwrite, progress=progress,
                                       hdf5=None if (hdf5 is None or not replay_dataset_id) else
                                       Path(hdf5).with_name(Path(hdf5).stem + "-replay.hdf5"))
        if replay is not None:
            results.append(replay)
        label = f"{train}-trained"
        info["policy"] = f"{train} trained {train_steps} steps"
    elif policy == "random":
        pol, label = RandomPolicy(genv.action_space, seed=seed), "random"
        info["policy"] = "random"
    else:
        norm = None if obs_norm.lower() in ("none", "false", "off") else obs_norm
        pol = load_sb3_policy(policy, genv, algo=algo, obs_norm=norm)
        label = pol.name.split(":", 1)[0]
        info["policy"] = str(policy)
    if info["noise"] > 0 or info["epsilon"] > 0:
        pol = NoisyPolicy(pol, genv.action_space, noise_std=info["noise"], epsilon=info["epsilon"], seed=seed + 1)
    return pol, label


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
