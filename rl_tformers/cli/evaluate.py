"""``rl-tformers eval``, ``rl-tformers plot`` and ``rl-tformers demo``.

``eval`` and ``plot`` work for any agent kind whose run directory was written by
``rl-tformers train`` (see :mod:`rl_tformers.runtime.loading`): DT, BC/%BC, GTrXL.
Heavy imports happen inside the commands, so ``rl-tformers --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import typer

from rl_tformers.cli.errors import fail
from rl_tformers.runtime.paths import SEPARATORS, blocking_file, directory_ending
from rl_tformers.runtime.protocol import policy_options

EVAL_HELP = """Evaluate a trained run at one or more target returns in its environment.

Gymnasium vector envs, one batched forward pass per step. Exactly --episodes episodes per target return: episode j runs in env j % N with reset seed SEED + j, the same seeds for every target. Returns are raw (the environment's own reward, whatever wrappers scale it), with the D4RL-normalised score when reference returns exist.

Target returns whose scaled return-to-go (target / the run's reward scale) would overflow the model's float32 return embedding are refused up front (the error gives the model's limit), and an evaluation that meets a non-finite action or reward stops with an error naming the target, episode and step: no NaN reaches the environment or the output. --json and --out write strict JSON (no NaN).

Examples:

  rl-tformers eval runs/dt-hopper --targets 3600,1800 --episodes 10

  rl-tformers eval runs/bc-hopper --json
"""

PLOT_HELP = """Plot achieved vs target return over a sweep of targets (return conditioning).

The Decision Transformer paper's figure 4, with y = x, the targets within the dataset's returns shaded, its best and mean return and the spread over episodes, plus per-episode traces of remaining return-to-go vs cumulative reward. Also logged to the run's TensorBoard files as an image (RUN_DIR must then be a directory, also with --checkpoint; --no-tensorboard writes only --out). --out is checked before anything is evaluated; targets beyond what the model's float32 return embedding takes are refused up front, and a non-finite action or reward stops the evaluation with an error (as in `rl-tformers eval`). The policy is the one `rl-tformers eval RUN_DIR` evaluates without options: a DT run's agent.early_exit.threshold and agent.knn.* apply. --from-json FILE plots a saved `eval --out` file: the figure carries (and TensorBoard logs it at) the step of the checkpoint that file evaluated, and a file evaluating another environment, agent kind or run than RUN_DIR is refused.

Examples:

  rl-tformers plot runs/dt-hopper --out hopper.png

  rl-tformers plot runs/dt-hopper --out hopper.png --targets 500,1000,2000,3000,3600 --episodes 5
"""


_fail = fail


#: help of ``--plugin`` on the commands that open a run
PLUGIN_HELP = ("Import this module (repeatable) before the run is rebuilt: a module the run's plugins list is "
               "imported only when named here (it runs that module's code) or installed as an entry point; "
               "never from the current directory.")


def _load(run_dir: Path, device: str, checkpoint: Path | None, plugins: list[str] | None = None):
    from rl_tformers.runtime.agent_registry import UnknownAgentError
    from rl_tformers.runtime.checkpoint import CheckpointError
    from rl_tformers.runtime.device import resolve_device
    from rl_tformers.runtime.loading import load_run

    try:
        return load_run(run_dir, resolve_device(device), checkpoint, plugins=plugins or ())
    except (CheckpointError, UnknownAgentError, TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None


def _check_out_file(text: str | None, option: str = "--out") -> Path | None:
    """The output file ``text`` names (``~`` expanded), or None when not given; refused when it
    cannot be written: empty, naming a directory (an existing one, or text ending in a path
    separator or in ``.`` / ``..``: a ``Path`` option would drop the ``/`` of ``ev.json/`` and
    write a file ``ev.json``), or under a parent that is a file. Checked before any evaluation,
    so nothing is computed for nothing."""
    if text is None:
        return None
    if not text.strip():
        raise _fail(f"{option} {text!r} is empty; give a file name, e.g. eval.json")
    if directory_ending(text) is not None:
        raise _fail(f"{option} {text} names a directory; give a file name, e.g. "
                    f"{Path(text.rstrip(SEPARATORS) or text).expanduser() / 'eval.json'}")
    out = Path(text).expanduser()
    if out.is_dir():
        raise _fail(f"{option} {out} is a directory; give a file name, e.g. {out / 'eval.json'}")
    parent = blocking_file(out)
    if parent is not None:
        raise _fail(f"{option} {out}: {parent} is a file, not a directory")
    return out


def _check_targets(run, targets: list, option: str) -> None:
    """Refuse targets the agent's policy cannot take (a DT: beyond its float32 RTG embedding),
    naming ``option``; agents without a ``check_targets`` accept any finite target."""
    check = getattr(run.agent.policy(), "check_targets", None)
    if check is None:
        return
    try:
        check(targets, option=option)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _refuse_repeated_targets(text: str, tlist: list[float], why: str) -> None:
    """Refuse ``--targets`` (``text``, parsed as ``tlist``) that names one target twice
    (``100,1e2``, ``0,-0``), naming the items; ``why`` says what a target is to the command."""
    from rl_tformers.runtime.evaluation import repeated_target

    twice = repeated_target(tlist)
    if twice is None:
        return
    i, j = twice
    items = [part.strip() for part in text.split(",")]
    spelled = "" if items[i] == items[j] else f": {items[i]} and {items[j]} are the same number"
    raise _fail(f"--targets {text}: the target {tlist[i]:g} is given twice (items {i + 1} and {j + 1}{spelled}); "
                f"give each target once: {why}")


def _threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


def _count(n: int, noun: str) -> str:
    """``1 episode``, ``10 episodes``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _set_context_len(run, context_len: int | None) -> None:
    """``--context-len``: the DT acts on the last ``context_len`` steps (``agent.eval_context_len``)."""
    if context_len is None:
        return
    if not hasattr(run.agent, "eval_context_len"):
        raise _fail(f"agent {run.kind!r} has no --context-len option (Decision Transformer runs only)")
    k = int(run.agent.model_cfg.context_len)
    try:  # the agent's typed options hold it to agent.eval_context_len's range
        run.agent.eval_context_len = run.agent.options.replace(eval_context_len=context_len).acting_context
    except ValueError:
        raise _fail(f"--context-len {context_len}: this run's context holds K = {k} steps (agent.context_len); "
                    f"give 1..{k}") from None


def _policy(run, timestep_overflow: str | None):
    """The run's policy; ``--timestep-overflow`` only for an agent whose ``policy()`` takes it
    (:func:`~rl_tformers.runtime.protocol.policy_options`)."""
    if timestep_overflow is None:
        return run.agent.policy()
    if "timestep_overflow" not in policy_options(run.agent):
        raise _fail(f"agent {run.kind!r} has no timestep_overflow option")
    return run.agent.policy(timestep_overflow=timestep_overflow)


def _normalizer(run):
    info = getattr(run.agent, "info", None)
    if info is not None and hasattr(info, "normalizer"):
        return info.normalizer()
    from rl_tformers.envs.scores import normalized_score

    env_id = run.env_id
    return (lambda r: normalized_score(env_id, r)) if env_id else None


@contextlib.contextmanager
def _episodes_progress(desc: str, total: int, enabled: bool = True):
    """Progress of an evaluation on stderr, counted in episodes: a bar on a terminal, else a
    plain line every 10 s or 5% of the episodes (:func:`~rl_tformers.runtime.progress.progress_bar`);
    closed (its last line printed) before the results are."""
    from rl_tformers.runtime.progress import progress_bar

    bar = progress_bar(total, desc=desc, unit="episode", enabled=enabled, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def _random_return(run) -> float | None:
    """The random policy's return in the run's environment (the lower D4RL reference of its
    normalised score: the dataset's own, else its task family's), or None when unknown."""
    info = getattr(run.agent, "info", None)
    if info is not None and hasattr(info, "normalizer"):
        ref = getattr(info, "ref_min", None)
        return None if ref is None else float(ref)
    from rl_tformers.envs.scores import reference_scores

    refs = reference_scores(run.env_id) if run.env_id else None
    return None if refs is None else float(refs[0])


def outside_data_note(targets: list, best: float | None, worst: float | None) -> str | None:
    """A one-line note on the targets far outside the training data's returns: above its best
    or below its worst by more than the data's own range (``best - worst``; any target above the
    best or below the worst when every episode has the same return), or None. The agent has seen
    no episode near such a target."""
    if best is None or worst is None:
        return None
    spread = max(best - worst, 0.0)
    far = [t for t in targets if t is not None and (t > best + spread or t < worst - spread)]
    if not far:
        return None
    which = ", ".join(f"{t:g}" for t in far)
    return (f"note: target{'s' if len(far) > 1 else ''} {which} lie{'' if len(far) > 1 else 's'} outside the training "
            f"data (its best episode return is {best:g}, its worst {worst:g})")


def eval_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory written by rl-tformers train."),
    targets: str = typer.Option(None, "--targets", help="Comma-separated target returns, raw units (default: the run's)."),
    episodes: int = typer.Option(10, "--episodes", min=1, help="Episodes per target."),
    envs: int = typer.Option(10, "--envs", min=1, help="Parallel environments."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**64 - 1, help="Base reset seed: episode j uses SEED + j."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as strict JSON (no NaN tokens)."),
    out: str = typer.Option(None, "--out", help="Also write the JSON (with per-step rewards) to this file "
                                                "(not a directory)."),
    device: str = typer.Option("cpu", "--device", help="auto | cpu | cuda | cuda:N | mps."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A specific checkpoint file (default: newest valid)."),
    timestep_overflow: str = typer.Option(None, "--timestep-overflow",
                                          help="DT: error | clamp for episode steps >= agent.max_ep_len."),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."),
    early_exit: str = typer.Option(None, "--early-exit",
                                   help="DT or offline GTrXL whose backbone.depth.kind is early_exit: 'calibrate' (held-out episodes), "
                                        "a threshold, or 'none' (default: the threshold in agent.early_exit)."),
    knn_lambda: float = typer.Option(None, "--knn-lambda", min=0.0, max=1.0,
                                     help="DT, offline GTrXL: kNN-LM weight of a datastore built from the training dataset "
                                          "(default: agent.knn.lam; 0 = off)."),
    knn_k: int = typer.Option(None, "--knn-k", min=1, help="DT, offline GTrXL: neighbours per decision (default agent.knn.k)."),
    knn_max_entries: int = typer.Option(None, "--knn-max-entries", min=1,
                                        help="DT, offline GTrXL: datastore size cap (default agent.knn.max_entries)."),
    context_len: int = typer.Option(None, "--context-len", min=1,
                                    help="DT: act on the last N steps of the context, at most its K (default: "
                                         "the run's agent.eval_context_len, else K; Online DT uses 5 on Hopper)."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE", help=PLUGIN_HELP),
) -> None:
    """``rl-tformers eval``; its help text is :data:`EVAL_HELP`."""
    from rl_tformers.runtime.evaluation import parse_targets, strict_json

    try:
        tlist = parse_targets(targets)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--targets: "), param_hint="--targets") from None
    if tlist is not None:
        _refuse_repeated_targets(targets, tlist, "each is evaluated on the same episodes (reset seeds)")
    out = _check_out_file(out)
    _check_early_exit(early_exit)
    _threads(threads)
    run = _load(run_dir, device, checkpoint, plugin)
    _set_context_len(run, context_len)
    tlist = _eval_targets(run, tlist)
    options = {"early_exit": early_exit, "knn_lambda": knn_lambda, "knn_k": knn_k, "knn_max_entries": knn_max_entries}
    report = _evaluate_run(run, run_dir, tlist, options, timestep_overflow, episodes=episodes, envs=envs, seed=seed,
                           record_rewards=out is not None, progress=not as_json)
    note = outside_data_note(tlist, run.dataset_return_max, run.dataset_return_min)
    if note is not None and not as_json:  # with the results (a failed evaluation ends with its error alone)
        typer.echo(note, err=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(strict_json(report.to_dict(with_rewards=True), indent=1))
    if as_json:
        typer.echo(strict_json(report.to_dict(), indent=2))
        return
    _print_eval(run, run_dir, report, episodes, seed)


def _eval_targets(run, tlist: list[float] | None) -> list:
    """The targets ``eval`` evaluates: ``--targets`` (``tlist``) or the run's default ones,
    checked against the run (:func:`_check_targets`); a run that is not return-conditioned
    takes no ``--targets``."""
    conditioned = run.agent.default_targets() != [None]
    if tlist is None:
        tlist = run.agent.default_targets()
        if conditioned:
            key = getattr(run.agent, "targets_option", "agent.targets")
            _check_targets(run, tlist, f"{key} (the run's default targets; give --targets)")
    elif not conditioned:
        raise _fail(f"agent {run.kind!r} is not return-conditioned; drop --targets")
    else:
        _check_targets(run, tlist, "--targets")
    return tlist


def _evaluate_run(run, run_dir: Path, tlist: list, options: dict, timestep_overflow: str | None, *, episodes: int,
                  envs: int, seed: int, record_rewards: bool, progress: bool):
    """Evaluate the run's policy (with the inference ``options`` of ``--early-exit`` /
    ``--knn-*``) on ``tlist``; returns the :class:`~rl_tformers.runtime.evaluation.EvalReport`
    with ``extra``: the run, checkpoint, step, kind, the policy's timing and the inference
    setup. A ``ValueError`` of the evaluation exits 2 after one ``error:`` line."""
    from rl_tformers.runtime.evaluation import evaluate
    from rl_tformers.runtime.timing import TimedPolicy

    setup = getattr(run.agent, "inference_setup", None)
    if setup is None and any(v is not None for v in options.values()):
        raise _fail(f"agent {run.kind!r} has no --early-exit / --knn-* options")
    try:
        inference = setup(**options) if setup is not None else {}
        policy = TimedPolicy(_policy(run, timestep_overflow))
        with _episodes_progress("eval", len(tlist) * episodes, enabled=progress) as bar:
            report = evaluate(
                policy, run.agent.make_env(), tlist, episodes=episodes, n_envs=envs,
                seed=seed, record_rewards=record_rewards, normalize=_normalizer(run), env_id=run.env_id,
                progress=bar,
            )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    # absolute paths: `plot --from-json` run from another folder must find the same run
    report.extra = {"run_dir": str(Path(run_dir).resolve()), "checkpoint": str(Path(run.checkpoint).resolve()),
                    "step": run.step, "kind": run.kind,
                    **policy.stats(), **inference}
    acting = getattr(run.agent, "eval_context_len", None)  # --context-len or the run's agent.eval_context_len
    if acting is not None:
        report.extra["context_len"] = acting
    return report


def _print_eval(run, run_dir: Path, report, episodes: int, seed: int) -> None:
    """``eval``'s console output: the run and settings, one line per target, the acting cost."""
    from rl_tformers.runtime.plots import summary_lines

    acting = getattr(run.agent, "eval_context_len", None)
    typer.echo(f"{run.kind} run {run_dir} (step {run.step}) on {run.env_id}: {_count(episodes, 'episode')} per "
               f"target, {_count(report.n_envs, 'env')}, seeds {seed}..{seed + episodes - 1}"
               + (f", acting on the last {_count(acting, 'step')} of the context" if acting else "")
               + f", {report.seconds:.1f} s")
    for line in summary_lines(report.results):
        typer.echo("  " + line)
    x = report.extra
    cost = (f"  {x['act_ms_per_step']:.2f} ms per act call (one batched step of {_count(report.n_envs, 'env')})"
            if "act_ms_per_step" in x else "")
    if "exit_mean_layer" in x:
        cost += f"; mean exit layer {x['exit_mean_layer']:.2f}"
    ee = x.get("early_exit")
    if isinstance(ee, dict) and "threshold" in ee:
        how = (f"calibrated (delta {ee['delta']}, epsilon {ee['epsilon']}, {ee['n']} held-out windows)"
               if "delta" in ee else "given")
        thr = "none passed: full model" if ee["threshold"] is None else f"{ee['threshold']:g}"
        cost += f"; early-exit threshold {thr} ({how})"
    if "knn" in x:
        cost += f"; kNN-LM lambda {x['knn']['lam']} over {x['knn']['entries']} entries"
    if cost:
        typer.echo(cost)


def _check_early_exit(value: str | None) -> None:
    """``--early-exit`` given as a number must be finite and >= 0 (``none`` is the full model;
    every confidence lies in [0, 1], and ``depth.threshold`` refuses a negative one too)."""
    if value is None:
        return
    try:
        thr = float(value)
    except ValueError:
        return  # 'calibrate' / 'none' / a typo: the agent's inference_setup names it
    if not math.isfinite(thr) or thr < 0:
        raise _fail(f"--early-exit {value}: the threshold must be a finite number >= 0 "
                    f"(use --early-exit none for the full model)")


def _read_eval_json(path: Path) -> tuple[list, dict]:
    """The per-target results of an ``rl-tformers eval --out`` file, and its other fields
    (``env_id``, ``extra`` with the run, checkpoint, step and agent kind evaluated).

    Raises:
        typer.Exit: (code 2, after an ``error: --from-json FILE: ...`` line) the file cannot be
            read, is not JSON, or is not an object with a ``results`` list of per-target
            results (``target_return`` and ``returns`` each).
    """
    from rl_tformers.runtime.evaluation import TargetResult

    expected = "expected the JSON object written by `rl-tformers eval RUN_DIR --out FILE`"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise _fail(f"--from-json {path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(f"--from-json {path}: not valid JSON ({exc}); {expected}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        got = type(data).__name__ if not isinstance(data, dict) else "an object without a 'results' list"
        raise _fail(f"--from-json {path}: got {got}; {expected} (with a 'results' list)")
    out = []
    for i, d in enumerate(data["results"]):
        try:
            out.append(TargetResult.from_dict(d))
        except (KeyError, TypeError, ValueError) as exc:
            raise _fail(f"--from-json {path}: results[{i}] is not a per-target result (needs target_return "
                        f"and returns; {type(exc).__name__}: {exc}); {expected}") from None
    if not out:
        raise _fail(f"--from-json {path}: 'results' is empty; {expected}")
    return out, {k: v for k, v in data.items() if k != "results"}


def _saved_step(meta: dict) -> int | None:
    """The checkpoint step an ``eval --out`` file records (``extra.step``), if any."""
    step = meta.get("extra", {}).get("step") if isinstance(meta.get("extra"), dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    if not 0 <= step < 2**63:  # an update count (TensorBoard takes int64 steps)
        raise _fail(f"--from-json: extra.step={step} is not an update count (an integer in [0, 2**63)); "
                    f"fix or remove it in the file")
    return step


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _check_saved_matches(path: Path, meta: dict, run, run_dir: Path) -> None:
    """Refuse a saved evaluation of another environment, agent kind or run than ``run_dir``:
    its figure would carry the run's title and dataset lines and land in its TensorBoard files.
    Fields the file does not have (a hand-written file) are not checked; the run it names is
    another run only when that directory exists, is not ``run_dir`` and the checkpoint it names
    is not inside ``run_dir``."""
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    where = f" (run {extra['run_dir']})" if isinstance(extra.get("run_dir"), str) else ""
    ours = f"{run_dir} is a {run.kind} run on {run.env_id}"
    fix = "plot it with the run it evaluated, or drop --from-json to evaluate this run"
    env_id = meta.get("env_id")
    if isinstance(env_id, str) and run.env_id is not None and env_id != run.env_id:
        raise _fail(f"--from-json {path} is an evaluation on {env_id}{where}, but {ours}; {fix}")
    kind = extra.get("kind")
    if isinstance(kind, str) and kind != run.kind:
        raise _fail(f"--from-json {path} is an evaluation of a {kind} agent{where}, but {ours}; {fix}")
    other, ckpt = extra.get("run_dir"), extra.get("checkpoint")
    # a relative path (files written before eval recorded absolute ones) means nothing from another folder
    if not isinstance(other, str) or not Path(other).is_absolute() or not Path(other).is_dir() or not run_dir.is_dir():
        return
    if Path(other).resolve() == run_dir.resolve():
        return
    if isinstance(ckpt, str) and Path(ckpt).is_absolute() and Path(ckpt).is_file() and _inside(Path(ckpt), run_dir):
        return
    raise _fail(f"--from-json {path} is an evaluation of the run {other}, but RUN_DIR is {run_dir}; {fix}")


#: Most targets of ``plot``'s default sweep (``--n-targets``): a typo such as 6000000 would
#: otherwise build the list and run millions of evaluations before anything is said.
MAX_TARGETS = 1000


def plot_cmd(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="Run directory written by rl-tformers train."),
    out: str = typer.Option(..., "--out", help="Image file to write; its extension picks the format (.png, "
                                                ".pdf, .svg, ...), none: .png is added (the path printed is "
                                                "the file written); a directory is refused."),
    targets: str = typer.Option(None, "--targets",
                                help="Comma-separated targets, each once (default: from the random policy's "
                                     "return where known, else the dataset's worst, to 20% of that span beyond "
                                     "the dataset's best)."),
    n_targets: int = typer.Option(6, "--n-targets", min=2, max=MAX_TARGETS, help="Targets in the default sweep."),
    episodes: int = typer.Option(5, "--episodes", min=1, help="Episodes per target."),
    envs: int = typer.Option(10, "--envs", min=1, help="Parallel environments."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**64 - 1, help="Base reset seed."),
    from_json: Path = typer.Option(None, "--from-json", help="Plot a saved `eval --out` file instead of evaluating "
                                                             "(--targets, --n-targets, --episodes, --envs, --seed "
                                                             "and --context-len do not apply)."),
    tensorboard: bool = typer.Option(True, "--tensorboard/--no-tensorboard", help="Also log the figure to RUN_DIR."),
    device: str = typer.Option("cpu", "--device", help="auto | cpu | cuda | cuda:N | mps."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A specific checkpoint file (default: newest valid)."),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."),
    context_len: int = typer.Option(None, "--context-len", min=1,
                                    help="DT: act on the last N steps of the context (as eval --context-len)."),
    plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE", help=PLUGIN_HELP),
) -> None:
    """``rl-tformers plot``; its help text is :data:`PLOT_HELP`."""
    out_path = _check_plot_options(ctx, run_dir, out, checkpoint, tensorboard, from_json)
    saved = _read_eval_json(from_json) if from_json is not None else None  # before the run is loaded
    _threads(threads)
    run = _load(run_dir, device, checkpoint, plugin)
    if saved is not None:  # the evaluation's checkpoint step, not the run's newest
        results, step = _saved_results(from_json, saved, run, run_dir)
    else:
        _set_context_len(run, context_len)
        results, step = _plot_evaluation(run, targets, n_targets, episodes=episodes, envs=envs, seed=seed), run.step
    _write_plot(run, run_dir, results, step, out_path, tensorboard)


def _check_plot_options(ctx: typer.Context, run_dir: Path, out: str, checkpoint: Path | None, tensorboard: bool,
                        from_json: Path | None) -> Path:
    """``plot``'s checks before anything is read or evaluated; returns the image path of ``--out``."""
    from rl_tformers.runtime.plots import figure_path

    try:  # before anything is evaluated; a str, not a Path, which would drop a trailing '/'
        out_path = figure_path(out)
    except ValueError as exc:
        raise _fail(f"--out {exc}") from None
    if tensorboard and not run_dir.is_dir():  # only possible with --checkpoint (else _load says it)
        if checkpoint is not None:
            what = "is not a directory" if run_dir.exists() else "does not exist"
            raise _fail(f"{run_dir} {what}: the figure is logged to RUN_DIR's TensorBoard files; give the run "
                        f"directory of --checkpoint {checkpoint}, or --no-tensorboard")
    if tensorboard and checkpoint is not None and checkpoint.is_file() and not _inside(checkpoint, run_dir):
        # another run's model would be logged into RUN_DIR's TensorBoard files, as its own
        raise _fail(f"--checkpoint {checkpoint} is not inside RUN_DIR {run_dir}: the figure is logged to RUN_DIR's "
                    f"TensorBoard files; give the run directory that holds the checkpoint, or --no-tensorboard")
    if from_json is not None:
        unused = [f"--{name.replace('_', '-')}" for name in ("targets", "n_targets", "episodes", "envs", "seed",
                                                              "context_len")
                  if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"]
        if unused:
            raise _fail(f"--from-json {from_json} plots a saved evaluation: {', '.join(unused)} would be ignored; "
                        f"drop {'them' if len(unused) > 1 else 'it'}, or drop --from-json to evaluate")
    return out_path


def _saved_results(from_json: Path, saved: tuple[list, dict], run, run_dir: Path) -> tuple[list, int | None]:
    """The per-target results of a saved evaluation (``--from-json``) and the checkpoint step it
    records, after checking that it is an evaluation of this run with each target once."""
    from rl_tformers.runtime.plots import repeated_target

    results, meta = saved
    _check_saved_matches(from_json, meta, run, run_dir)
    step = _saved_step(meta)
    twice = repeated_target([r.target_return for r in results if r.target_return is not None])
    if twice is not None:
        with_target = [k for k, r in enumerate(results) if r.target_return is not None]
        i, j = with_target[twice[0]], with_target[twice[1]]
        raise _fail(f"--from-json {from_json}: results[{i}] and results[{j}] both have target_return "
                    f"{results[i].target_return:g}; a plot has one point per target (evaluate each target "
                    f"once: `rl-tformers eval RUN_DIR --targets ...` with distinct targets)")
    return results, step


def _plot_evaluation(run, targets: str | None, n_targets: int, *, episodes: int, envs: int, seed: int) -> list:
    """Evaluate the run on ``--targets`` or the default sweep of ``n_targets`` (from its dataset's
    returns) with its own evaluation options; prints one line per target; returns the results."""
    from rl_tformers.runtime.evaluation import evaluate, parse_targets
    from rl_tformers.runtime.plots import default_sweep, summary_lines

    if run.agent.default_targets() == [None]:
        raise _fail(f"agent {run.kind!r} is not return-conditioned: there is nothing to sweep")
    try:
        tlist = parse_targets(targets)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--targets: "), param_hint="--targets") from None
    if tlist is None:
        dmax, dmin = run.dataset_return_max, run.dataset_return_min
        if dmax is None or dmin is None:
            raise _fail("the run stores no dataset_return_max/min; give --targets")
        tlist = default_sweep(dmax, dmin, n_targets, random_return=_random_return(run))
        _check_targets(run, tlist, "the default sweep (from the run's dataset returns; give --targets)")
    else:
        _refuse_repeated_targets(targets, tlist, "each is one point of the plot")
        _check_targets(run, tlist, "--targets")
    try:
        # the run's own evaluation options (agent.early_exit.threshold, agent.knn.*), as
        # `rl-tformers eval RUN` without --early-exit / --knn-*: the same policy is plotted
        setup = getattr(run.agent, "inference_setup", None)
        if setup is not None:
            setup()
        with _episodes_progress("plot", len(tlist) * episodes) as bar:
            report = evaluate(
                run.agent.policy(), run.agent.make_env(), tlist, episodes=episodes, n_envs=envs, seed=seed,
                record_rewards=True, normalize=_normalizer(run), env_id=run.env_id, progress=bar,
            )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    for line in summary_lines(report.results):
        typer.echo("  " + line)
    return report.results


def _write_plot(run, run_dir: Path, results: list, step: int | None, out_path: Path, tensorboard: bool) -> None:
    """Draw the return-conditioning figure of ``results``, log it to the run's TensorBoard files
    (``tensorboard``) and write it to ``out_path``."""
    from rl_tformers.runtime.plots import log_figure, plot_return_conditioning, save_figure

    try:
        fig = plot_return_conditioning(results, dataset_max=run.dataset_return_max,
                                       dataset_mean=run.dataset_return_mean, dataset_min=run.dataset_return_min,
                                       title=f"{run.kind} on {run.env_id}"
                                             + ("" if step is None else f" (step {step})"))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if tensorboard:  # a saved evaluation that records no step: logged at the run's step
        # a second plot at the same step gets a tag of its own (log_figure): no image is replaced
        log_figure(run_dir, "plot/return_conditioning", fig, run.step if step is None else step)
    try:
        path = save_figure(fig, out_path)
    except OSError as exc:  # checked up front; the disk filled up, a folder was removed meanwhile, ...
        raise _fail(f"--out {out_path}: cannot write it ({exc.strerror or exc})") from None
    typer.echo(f"wrote {path}")


def demo_cmd(
    out_dir: Path = typer.Option(None, "--out-dir", help="Run directory (default runs/demo-<time>)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Training updates (default: the demo config's 2000)."),
    episodes: int = typer.Option(None, "--episodes", min=1, help="Dataset episodes (default 300)."),
    eval_episodes: int = typer.Option(10, "--eval-episodes", min=1, help="Evaluation episodes per target."),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."),
    device: str = typer.Option("cpu", "--device", help="auto | cpu | cuda | cuda:N | mps."),
) -> None:
    """Quick start: build data, train a Decision Transformer, evaluate and plot (minutes on 2 CPU cores).

    Builds a CartPole-v1 dataset with a scripted controller, trains a DT on it, evaluates it at several target returns and writes the return-conditioning plot; prints where the run and the plot are.
    """
    from rl_tformers.agents.common.demo import run_demo

    if out_dir is not None:  # before the dataset is built: the run directory must be one
        target = Path(out_dir).expanduser()
        if target.exists() and not target.is_dir():
            raise _fail(f"--out-dir {out_dir} is a file; give the run directory to create (e.g. runs/demo)")
        above = blocking_file(target)
        if above is not None:
            raise _fail(f"--out-dir {out_dir}: {above} is a file, not a directory")
    try:
        result = run_demo(out_dir=out_dir, steps=steps, n_episodes=episodes, eval_episodes=eval_episodes,
                          threads=threads, device=device, echo=typer.echo)
    except InterruptedError as exc:
        typer.echo(f"demo interrupted: {exc}", err=True)
        raise typer.Exit(130) from None
    except FileExistsError as exc:  # the run directory already holds a run
        raise _fail(str(exc)) from None
    typer.echo(f"\nrun directory: {result.run_dir}\nplot:          {result.plot}\n"
               f"evaluation:    {result.eval_json}\ntotal time:    {result.seconds:.0f} s")


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``plot`` and ``demo`` to the ``rl-tformers`` app."""
    app.command("eval", help=EVAL_HELP)(eval_cmd)
    app.command("plot", help=PLOT_HELP)(plot_cmd)
    app.command("demo")(demo_cmd)
