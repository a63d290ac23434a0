"""RL-scale case of ``rl-tformers bench attention --rl-scale``: the Decision Transformer with a long
context, dense SDPA against efficient causal kernels, trained and evaluated in one run.

Case ``dt_long_context`` (issue 7, requirement 5): DT with K = 500 steps (3 tokens per step:
1,500 tokens per window) on a long-horizon dataset (default ``rlt/hopper-v5/expert-v0``: 101
episodes of ~1,000 steps), one short training per attention kind through the shared
:class:`~rl_tformers.runtime.trainer.Trainer` with everything else identical (seed, batches,
model size, optimiser), then an evaluation at the dataset's best return. Per kind it reports

- ``seconds_per_step`` / ``steps_per_s``: the trainer's own update time (``Trainer.elapsed_s``:
  batch transfer, forward, backward, optimiser step; evaluation and checkpoints excluded) over
  all ``steps`` updates, and ``speed_ratio`` = steps/s divided by dense SDPA's in the same run;
- ``normalised_score``: the D4RL-normalised return of ``episodes`` evaluation episodes after
  training (100 * (R - random) / (expert - random), the dataset's reference scores), with
  ``return_mean``, the final ``train_loss`` and ``eval_seconds`` (the evaluation's wall time:
  the DT policy re-encodes its K-step window at every environment step).

The kinds are those given to ``bench attention --kinds`` (SDPA first, always); kinds without a
causal form get a ``skipped`` row (DT's causal mode needs one). Each kind runs at the
``bench_config(1500)`` settings of the layer benchmark (local: blocks of 64 + 64 memory keys,
sliding window 128 keys; Performer: its defaults). The training is short by design (the default,
200 updates of batch 8 with a 2-layer, 64-wide model, is minutes per kind on one CPU thread):
the scores compare kernels at equal compute budget in updates, not converged agents.

With ``timing_rounds`` R > 0, the trained kinds are then also timed round-robin
(:func:`interleaved_update_seconds`: R rounds of ``timing_updates`` updates per kind, median):
``interleaved_seconds_per_step`` and ``interleaved_speed_ratio`` (dense time / kind time), the
ratio to trust on a shared machine whose load drifts between the sequential trainings.

Options (``bench attention --rl-steps N --rl-option key=value ...``): ``steps``, ``batch_size``,
``d_model``, ``n_layers``, ``n_heads``, ``context_len``, ``lr``, ``warmup_steps``,
``episodes``, ``dataset``, ``seed``, ``timing_rounds``, ``timing_updates``, ``dense`` (0: skip
the SDPA baseline, to run kinds in parallel processes), ``work_dir`` (keep the run directories
there; default a temporary directory). :func:`summarise_runs` rebuilds the rows from kept run
directories (``python -m rl_tformers.bench.attention_rl DIR ...``).
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from omegaconf import OmegaConf

from rl_tformers.bench.attention import BASELINE, kind_fields, register_rl_scale_case
from rl_tformers.registry import ATTENTION
from rl_tformers.runtime.checkpoint import find_latest_valid
from rl_tformers.runtime.device import move_to
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import Trainer

CASE = "dt_long_context"

#: defaults of the case (see the module docstring)
DEFAULTS: dict[str, Any] = {
    "dataset": "rlt/hopper-v5/expert-v0",
    "context_len": 500,
    "steps": 200,
    "batch_size": 8,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
    "lr": 1e-3,
    "warmup_steps": 20,
    "episodes": 5,
    "seed": 0,
    "dense": 1,
    "timing_rounds": 0,
    "timing_updates": 2,
}


def _overrides(kind: str, o: dict[str, Any]) -> list[str]:
    tokens = 3 * int(o["context_len"])
    ov = [
        f"dataset.path={o['dataset']}", f"agent.context_len={o['context_len']}", "agent.eval_figure=false",
        f"backbone.d_model={o['d_model']}", f"backbone.n_layers={o['n_layers']}", f"backbone.n_heads={o['n_heads']}",
        "backbone.attn_dropout=0.0",  # kernels without attention dropout (Performer) get the same model
        f"train.steps={o['steps']}", f"train.batch_size={o['batch_size']}", f"train.lr={o['lr']}",
        f"train.warmup_steps={o['warmup_steps']}", "train.progress=false", "train.checkpoint_every=0",
        f"train.log_every={max(1, int(o['steps']) // 4)}", "train.num_workers=0",
        "eval.every=0", "eval.at_end=true", f"eval.episodes={o['episodes']}", f"eval.n_envs={o['episodes']}",
        f"seed={o['seed']}", "device=cpu",
    ]
    ov.append(f"backbone.attention.kind={kind}")
    for key, value in kind_fields(kind, tokens).items():
        if isinstance(value, (tuple, list)):
            value = "[" + ",".join(map(str, value)) + "]"
        ov.append(f"backbone.attention.{key}={value}")
    return ov


def interleaved_update_seconds(trainers: dict[str, Any], rounds: int, updates: int) -> dict[str, float]:
    """Median seconds per update of each trainer, timed round-robin: ``rounds`` times, every
    kind in turn runs ``updates`` updates (``Trainer.update`` on the run's step-indexed batches,
    cyclically; one untimed warm-up update first). A shared machine's load then hits every kind
    alike, unlike kinds trained one after another. The weights change (timing only)."""


    streams = {}
    for kind, tr in trainers.items():
        ds = tr.agent.batches(0)  # step-indexed: the run's own batches again, cyclically
        streams[kind] = (ds[i % len(ds)] for i in itertools.count())
        tr.model.train()
        tr.update(move_to(next(streams[kind]), tr.device))  # warm-up
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(rounds):
        for kind, tr in trainers.items():
            batches = [move_to(next(streams[kind]), tr.device) for _ in range(updates)]
            t0 = time.perf_counter()
            for b in batches:
                tr.update(b)
            times[kind].append((time.perf_counter() - t0) / updates)
    return {k: statistics.median(v) for k, v in times.items()}


def dt_long_context(kinds: list[str], device: str, **options: Any) -> list[dict[str, Any]]:
    """Train and evaluate DT with a K-step context once per kind; rows as in the module docstring.

    Raises:
        ValueError: an unknown option.
    """

    check_options(options)
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    kinds = ([BASELINE] if int(o["dense"]) else []) + [k for k in dict.fromkeys(kinds) if k != BASELINE]
    base = {"case": CASE, "dataset": o["dataset"], "context_len": int(o["context_len"]),
            "tokens": 3 * int(o["context_len"]), "steps": int(o["steps"]), "batch_size": int(o["batch_size"]),
            "model": f"{o['n_layers']} layers x {o['d_model']} wide, {o['n_heads']} heads", "device": device}
    rows: list[dict[str, Any]] = []
    trainers: dict[str, Any] = {}
    tmp = None
    if o.get("work_dir"):
        work = Path(o["work_dir"])
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rl_scale_")
        work = Path(tmp.name)
    try:
        for kind in kinds:
            row: dict[str, Any] = {**base, "kind": kind}
            if not ATTENTION.get(kind).capabilities.causal:
                rows.append({**row, "status": "skipped: no causal form (DT causal mode)"})
                continue
            try:
                cfg = compose("dt/hopper_base", _overrides(kind, o) + [f"device={device}"])
                trainer = Trainer(cfg, work / kind)
                result = trainer.fit()
            except Exception as exc:  # reported, not fatal: the other kinds still run
                rows.append({**row, "status": f"error: {type(exc).__name__}: {exc}"})
                continue
            ev = result.last_eval
            row.update(
                status="ok", seconds_per_step=trainer.elapsed_s / max(result.step, 1),
                steps_per_s=result.step / max(trainer.elapsed_s, 1e-9),
                train_loss=result.last_train.get("train/loss"),
                normalised_score=ev.get("eval/normalized_score"), return_mean=ev.get("eval/return_mean"),
                target_return=ev.get("eval/target"), episodes=int(o["episodes"]),
                eval_seconds=ev.get("eval/time_s"),
            )
            rows.append(row)
            trainers[kind] = trainer
        if int(o["timing_rounds"]) > 0 and trainers:
            med = interleaved_update_seconds(trainers, int(o["timing_rounds"]), int(o["timing_updates"]))
            for r in rows:
                if r["kind"] in med:
                    r["interleaved_seconds_per_step"] = med[r["kind"]]
    finally:
        if tmp is not None:
            tmp.cleanup()
    dense = next((r for r in rows if r["kind"] == BASELINE and r["status"] == "ok"), None)
    for r in rows:
        r["speed_ratio"] = r["steps_per_s"] / dense["steps_per_s"] if dense and r["status"] == "ok" else None
        if dense and "interleaved_seconds_per_step" in r and "interleaved_seconds_per_step" in dense:
            r["interleaved_speed_ratio"] = dense["interleaved_seconds_per_step"] / r["interleaved_seconds_per_step"]
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The case's rows as a Markdown table."""
    head = ("| kind | s / update | updates / s | speed vs dense | interleaved s / update | interleaved speed vs dense "
            "| final train loss | return | normalised score | eval s |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec, suffix=""):
        return "-" if v is None else format(v, spec) + suffix

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['kind']} | {r['status']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['kind']} | {f(r['seconds_per_step'], '.2f')} | {f(r['steps_per_s'], '.3f')} | "
            f"{f(r['speed_ratio'], '.2f', 'x')} | {f(r.get('interleaved_seconds_per_step'), '.2f')} | "
            f"{f(r.get('interleaved_speed_ratio'), '.2f', 'x')} | {f(r['train_loss'], '.4f')} | "
            f"{f(r['return_mean'], '.0f')} | {f(r['normalised_score'], '.1f')} | {f(r.get('eval_seconds'), '.0f')} |"
        )
    return "\n".join(lines)


def summarise_runs(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Rows of finished ``work_dir`` runs (one directory per kind; several ``work_dir`` folders
    may be given): updates/s from the final checkpoint's ``step`` and ``elapsed_s`` (the
    trainer's update time), the final logged train loss, the evaluation at the end from
    ``metrics.jsonl``; speed ratios against the ``sdpa`` run among them.

    Raises:
        ValueError: a run folder inside that is not a Decision Transformer run (named)."""



    rows = []
    for d in run_dirs:
        d = Path(d)
        for run in sorted(p for p in d.iterdir() if (p / "checkpoints").is_dir()):
            state = find_latest_valid(run, quarantine=False).state
            cfg = OmegaConf.create(state["config"])
            if OmegaConf.select(cfg, "agent.kind") != "dt" or OmegaConf.select(cfg, "agent.context_len") is None:
                raise ValueError(f"{run} is not a Decision Transformer run (agent.kind="
                                 f"{OmegaConf.select(cfg, 'agent.kind')!r}); give the WORK_DIR of the RL-scale case")
            recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            ev = next((r for r in reversed(recs) if "eval/normalized_score" in r), {})
            tr = next((r for r in reversed(recs) if "train/loss" in r), {})
            step, elapsed = int(state["step"]), float(state["trainer"]["elapsed_s"])
            rows.append({
                "case": CASE, "kind": str(OmegaConf.select(cfg, "backbone.attention.kind", default=BASELINE)), "dataset": str(cfg.dataset.path),
                "context_len": int(cfg.agent.context_len), "tokens": 3 * int(cfg.agent.context_len), "steps": step,
                "batch_size": int(cfg.train.batch_size), "status": "ok", "seconds_per_step": elapsed / max(step, 1),
                "steps_per_s": step / max(elapsed, 1e-9), "train_loss": tr.get("train/loss"),
                "normalised_score": ev.get("eval/normalized_score"), "return_mean": ev.get("eval/return_mean"),
                "target_return": ev.get("eval/target"), "eval_seconds": ev.get("eval/time_s"), "run_dir": str(run),
            })
    dense = next((r for r in rows if r["kind"] == BASELINE), None)
    for r in rows:
        r["speed_ratio"] = r["steps_per_s"] / dense["steps_per_s"] if dense else None
    return rows


def check_options(options: dict[str, Any]) -> None:
    """Refuse options :func:`dt_long_context` does not know (run before anything is measured).

    Raises:
        ValueError: an unknown option, naming it and the known ones.
    """
    unknown = set(options) - set(DEFAULTS) - {"work_dir"}
    if unknown:
        raise ValueError(f"unknown {CASE} options {sorted(unknown)}; known: {', '.join(sorted(DEFAULTS))}, work_dir")


dt_long_context.check_options = check_options  # type: ignore[attr-defined]
register_rl_scale_case(CASE, dt_long_context, table=markdown_table)


def _table_main(
    work_dirs: list[Path] = typer.Argument(..., help="WORK_DIR of `bench attention --rl-scale` runs (one "
                                                      "run folder per kind inside); several may be given."),
) -> None:
    """Print the Markdown table of finished RL-scale runs (updates/s, loss, normalised score)."""
    for d in work_dirs:
        if not d.is_dir():
            typer.echo(f"error: {d} is not a directory", err=True)
            raise typer.Exit(2)
    try:
        rows = summarise_runs([str(d) for d in work_dirs])
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not rows:
        typer.echo(f"error: no finished runs (folders with checkpoints/) in {', '.join(map(str, work_dirs))}", err=True)
        raise typer.Exit(2)
    typer.echo(markdown_table(rows))


if __name__ == "__main__":  # python -m rl_tformers.bench.attention_rl WORK_DIR [WORK_DIR ...]
    _app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})
    _app.command()(_table_main)
    _app(prog_name="python -m rl_tformers.bench.attention_rl")
