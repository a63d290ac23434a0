"""``rl-tformers bench decoding``: the cost of one decoding step as the stream grows.

Step-by-step decoding with a state (memory kind ``none``) should cost what the attention kind
claims at any step: O(window) for the bounded-cache kinds (``local``, ``sliding_window``), O(1)
for the linear kinds (``performer``, ``rfa``). The state keeps only the key slots a layer still
reads (:meth:`~rl_tformers.attention.base.AttentionModule.cache_keeps`). The baseline, measured
in the same run, is the untrimmed bookkeeping that grows by one slot per token (the behaviour
before the trim; :func:`rl_tformers.memory.none.keys_kept` patched to keep every slot).

For each kind and each stream length n in ``steps``, a state holding n past tokens is built
(fed in chunks), then one single-token step from it is timed; all (mode, n) cases of a kind
are timed round-robin (:func:`~rl_tformers.runtime.timing.interleaved_timing`), so load
changes hit them alike. Reported: median milliseconds per step, the ratio of the longest to
the shortest stream, the state's key slots, and the largest difference between the trimmed
and untrimmed step outputs (they must agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import typer

from rl_tformers import Backbone
from rl_tformers.bench.options import check_out, emit_result, fail
from rl_tformers.memory import none as none_memory
from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.timing import interleaved_timing

#: the benchmarked kinds: attention config and the position kind it runs with
KINDS: dict[str, tuple[dict[str, Any], str]] = {
    "sliding_window": ({"kind": "sliding_window", "window": 32}, "alibi"),
    "local": ({"kind": "local", "block": 32, "memory": 32}, "alibi"),
    "performer": ({"kind": "performer"}, "rotary"),
    "rfa": ({"kind": "rfa"}, "rotary"),
    "rfa_gated": ({"kind": "rfa", "gate": True}, "rotary"),
}


@contextmanager
def _untrimmed(on: bool):
    """Inside the block, memory ``none`` keeps every key slot (the baseline) when ``on``."""

    real = none_memory.keys_kept
    if on:
        none_memory.keys_kept = lambda blocks: None
    try:
        yield
    finally:
        none_memory.keys_kept = real


def _step(bb, tok: torch.Tensor, state, untrimmed: bool) -> Callable[[], Any]:
    """One timed decoding step of ``tok`` (1, 1, D) from ``state``."""
    def f() -> Any:
        with _untrimmed(untrimmed):
            return bb(tok, state=state)
    return f


def check_options(kinds: Sequence[str], steps: Sequence[int], repeats: int) -> None:
    """Raises ValueError naming the option: an unknown kind, fewer than 2 or non-increasing
    ``steps`` (each >= 1), ``repeats`` < 1."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"--kinds: {', '.join(bad) or 'none given'}; choose from {', '.join(KINDS)}")
    if len(steps) < 2 or any(s < 1 for s in steps) or list(steps) != sorted(set(steps)):
        raise ValueError(f"--steps must be at least 2 increasing stream lengths >= 1, got {list(steps)}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")


def run(kinds: Sequence[str] = tuple(KINDS), steps: Sequence[int] = (100, 20000), repeats: int = 200,
        d_model: int = 64, n_heads: int = 4, chunk: int = 500, log: Callable[[str], None] | None = None) -> dict:
    """Time one decoding step after ``steps`` past tokens, trimmed vs untrimmed (module docstring).

    Args:
        kinds: names of :data:`KINDS`.
        steps: stream lengths n (tokens already decoded), increasing.
        repeats: timed rounds per kind (after 5 warm-up rounds).
        d_model, n_heads: the 1-layer backbone (batch 1, float32, CPU unless torch's default
            device says otherwise).
        chunk: tokens per call when building a state of n tokens.
        log: progress lines (one per kind).

    Returns:
        ``{"steps": [...], "rows": [{"kind", "mode" ("trimmed" | "untrimmed"), "slots" {n: key
        slots the state holds}, "ms" {n: median ms per step}, "ratio" (last n / first n),
        "max_abs_diff" (trimmed vs untrimmed output of the timed step, trimmed rows only)}],
        "machine"}`` (:func:`~rl_tformers.runtime.host.host_description`).

    Raises:
        ValueError: bad options (:func:`check_options`).
    """

    check_options(kinds, steps, repeats)
    rows = []
    n_max = max(steps)
    for name in kinds:
        attention, position = KINDS[name]
        torch.manual_seed(0)
        bb = Backbone({"d_model": d_model, "n_layers": 1, "n_heads": n_heads, "dropout": 0.0, "attn_dropout": 0.0,
                       "max_position": n_max + 2, "attention": attention, "position": {"kind": position},
                       "memory": {"kind": "none"}}).eval()
        x = torch.randn(1, n_max + 1, d_model)
        tok = x[:, n_max:]
        states, outs = {}, {}
        with torch.inference_mode():
            for untrimmed in (False, True):
                with _untrimmed(untrimmed):
                    for n in steps:
                        st = bb.initial_state(1)
                        for t in range(0, n, chunk):
                            st = bb(x[:, t:min(n, t + chunk)], state=st).state
                        states[(untrimmed, n)] = st
                        outs[(untrimmed, n)] = bb(tok, state=st).hidden

            timing = interleaved_timing({key: _step(bb, tok, st, key[0]) for key, st in states.items()}, repeats=repeats)
        for untrimmed in (False, True):
            ms = {n: timing[(untrimmed, n)]["median_ms"] for n in steps}
            row = {"kind": name, "mode": "untrimmed" if untrimmed else "trimmed",
                   "slots": {n: int(states[(untrimmed, n)].pos.shape[1]) for n in steps},
                   "ms": ms, "ratio": ms[steps[-1]] / ms[steps[0]]}
            if not untrimmed:
                row["max_abs_diff"] = max(float((outs[(False, n)] - outs[(True, n)]).abs().max()) for n in steps)
            rows.append(row)
        if log:
            log(f"{name}: done")
    return {"steps": list(steps), "repeats": repeats, "d_model": d_model, "n_heads": n_heads,
            "threads": torch.get_num_threads(), "rows": rows, "machine": host_description("cpu")}


def markdown(res: dict) -> str:
    """The result as a markdown table (one row per kind and mode)."""
    s = res["steps"]
    head = "| kind | mode | " + " | ".join(f"ms/step at {n}" for n in s) + f" | {s[-1]} / {s[0]} | slots at {s[-1]} | max abs diff |"
    lines = [head, "|" + "---|" * (len(s) + 5)]
    for r in res["rows"]:
        lines.append(f"| `{r['kind']}` | {r['mode']} | " + " | ".join(f"{r['ms'][n]:.3f}" for n in s)
                     + f" | {r['ratio']:.2f}x | {r['slots'][s[-1]]} | "
                     + (f"{r['max_abs_diff']:.1e} |" if "max_abs_diff" in r else "(baseline) |"))
    return "\n".join(lines)


def register(bench_app) -> None:
    """Hook into a Typer group: ``bench decoding``."""

    def decoding(
        kinds: str = typer.Option("all", help="Comma-separated kinds, or all: " + ", ".join(KINDS) + "."),
        steps: str = typer.Option("100,20000", help="Comma-separated stream lengths (tokens already decoded)."),
        repeats: int = typer.Option(200, help="Timed rounds per kind."),
        threads: int = typer.Option(1, min=1, help="torch CPU threads."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        out: str | None = typer.Option(None, help="Also write the JSON to this file."),
    ) -> None:
        """Cost of one decoding step as the stream grows: trimmed state vs untrimmed bookkeeping."""

        try:
            kind_list = list(KINDS) if kinds.strip() == "all" else [k.strip() for k in kinds.split(",") if k.strip()]
            try:
                step_list = [int(v) for v in steps.split(",")]
            except ValueError:
                raise ValueError(f"--steps must be comma-separated integers, got {steps!r}") from None
            check_options(kind_list, step_list, repeats)
        except ValueError as exc:
            fail(str(exc))
        check_out(out)
        torch.set_num_threads(threads)
        res = run(kind_list, step_list, repeats, log=lambda m: typer.echo(m, err=True))
        emit_result(res, markdown(res), out=out, as_json=as_json)

    bench_app.command("decoding")(decoding)
