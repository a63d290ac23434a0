"""Benchmark: evaluation throughput (``rl-tformers bench eval``).

1. **Batched vs one-environment-at-a-time** (:mod:`rl_tformers.bench._eval_rollouts`). The same
   policy (a checkpoint given with ``--run``, or, without one, a small DT, 64 dims and 2 layers,
   trained ``--train-updates`` updates on ``--dataset`` inside the benchmark, so that its
   episodes run long) plays the same episodes (episode j is reset with seed ``seed + j``) with
   one environment (one forward pass per environment step, which is how the reference DT code
   evaluates) and with each N of ``--n-envs`` vector environments (one batched forward pass per
   step; environments past their quota are not stepped). Reported per N: environment steps per
   second, their ratio to one at a time, milliseconds per loop step, the mean return; the run
   fails (exit 1) when an N played other episodes (lengths, or returns beyond 1e-6 relative).
   With three or more N the milliseconds per loop step are fitted against N (``--plot`` draws
   them). ``--profile`` splits each evaluation's wall time into the policy forward, building the
   context tensors, environment stepping, action decoding and bookkeeping
   (:mod:`rl_tformers.runtime.eval_profile`), and profiles an untrained DT, BC and GTrXL on
   Hopper and CartPole the same way.
2. **Memory backbones: per-step cost.** For a Transformer-XL stack (pre-norm blocks) and GTrXL
   (gated blocks), both with XL memory of M slots and relative positions, the forward cost of
   one environment step for N environments: (a) *with memory*: one new token per environment
   attends to itself and the M cached hidden states (what ``GTrXLPolicy.act`` does, O(M) per
   step); (b) *re-encoding*: the last M + 1 tokens are run through the same stack without
   memory (what a memoryless transformer must do to see the same span, O(M^2) attention and
   O(M) feed-forward per step). Reported per M in ``--mem-lens``: milliseconds per step of
   each and their ratio.

Command: ``rl-tformers bench eval --episodes 100 --n-envs 10,50 --profile --out bench_eval.json``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import typer

from rl_tformers import Backbone
from rl_tformers.agents.gtrxl.model import gtrxl_backbone
from rl_tformers.bench._eval_policies import (
    PROFILE_AGENTS,
    PROFILE_ENVS,
    BenchPolicy,
    train_small_dt,
    untrained,
)
from rl_tformers.bench._eval_rollouts import DifferentEpisodes, compare, growth, plot_growth, rollout
from rl_tformers.bench.options import check_device, check_out, first_repeat, run_checked
from rl_tformers.bench.train import DEFAULT_DATASET, machine_info
from rl_tformers.runtime.agent_registry import AgentBuildError, UnknownAgentError
from rl_tformers.runtime.checkpoint import CheckpointError
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.loading import load_run

MEMORY_KINDS = ("xl", "gtrxl")
#: vector environments of part 1: gymnasium's SyncVectorEnv (stepped environment by environment,
#: only the running ones) or AsyncVectorEnv (one process per environment, every one stepped)
VECTORS = ("sync", "async")
#: float32 (N, heads, M + 1, M + 1) score-sized tensors counted at the peak of part 2 (measured on
#: CPU, both kinds, N = 10, 4 heads: the peak grew by 8.5-9.4 of them at M = 1024 and 2048):
#: :func:`part2_bytes` estimates the peak with it, and an M whose estimate exceeds the device's
#: memory is refused before anything runs.
SCORE_TENSORS_AT_PEAK = 10


@dataclass
class Settings:
    """Benchmark settings (times in seconds)."""

    run: str | None = None
    plugins: tuple[str, ...] = ()  # modules of the run's plugins the user names (--plugin)
    dataset: str = DEFAULT_DATASET
    episodes: int = 10
    n_envs: tuple[int, ...] | int = (10,)
    train_updates: int = 300
    profile: bool = False
    vector: str = "sync"
    plot: str | None = None
    max_episode_steps: int | None = None
    seed: int = 0
    threads: int = 1
    device: str = "cpu"
    memory_kinds: tuple[str, ...] = ("xl", "gtrxl")
    mem_lens: tuple[int, ...] = (32, 128, 512)
    mem_envs: int = 10
    mem_steps: int = 50
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    skip_rollouts: bool = False

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: ``--episodes``, ``--threads``, ``--mem-envs``, ``--mem-steps`` or a
                ``--mem-lens`` entry below 1, ``--n-envs`` below 2 or above ``--episodes`` (with
                part 1), ``--max-episode-steps``
                below 1 (leave it out for no cap), an unknown or repeated ``--memory-kinds`` entry,
                a repeated ``--mem-lens`` entry, no ``--mem-lens`` while part 2 runs, both parts
                skipped, an unavailable ``--device``, or a ``--mem-lens`` entry (or ``--mem-steps``)
                whose part 2 would not fit in the device's memory (:meth:`check_memory`).
        """
        if isinstance(self.n_envs, int):
            self.n_envs = (self.n_envs,)
        if not self.n_envs:
            raise ValueError("--n-envs: give at least one number of environments, e.g. 10 or 1,10,50,100")
        for option, value, lo in (("--episodes", self.episodes, 1), ("--n-envs", min(self.n_envs), 1),
                                  ("--threads", self.threads, 1), ("--mem-envs", self.mem_envs, 1),
                                  ("--mem-steps", self.mem_steps, 1), ("--train-updates", self.train_updates, 0)):
            if int(value) < lo:
                raise ValueError(f"{option} must be >= {lo}, got {value}")
        if self.vector not in VECTORS:
            raise ValueError(f"--vector: unknown kind {self.vector!r}; use {' or '.join(VECTORS)}")
        if self.max_episode_steps is not None and int(self.max_episode_steps) < 1:
            raise ValueError(f"--max-episode-steps must be >= 1, got {self.max_episode_steps} "
                             f"(leave the option out to keep the environment's own limit)")
        bad = [k for k in self.memory_kinds if k not in MEMORY_KINDS]
        if bad:
            raise ValueError(f"--memory-kinds: unknown kind {bad[0]!r}; use a comma-separated subset of "
                             f"{','.join(MEMORY_KINDS)} (empty: skip part 2)")
        if self.memory_kinds and not self.mem_lens:
            raise ValueError("--mem-lens: give at least one memory length M (e.g. 32,128), or skip part 2 with "
                             "--memory-kinds ''")
        small = [m for m in self.mem_lens if int(m) < 1]
        if small:
            raise ValueError(f"--mem-lens: every memory length must be >= 1, got {small[0]}")
        if self.skip_rollouts and not self.memory_kinds:
            raise ValueError("nothing to measure: --skip-rollouts skips part 1 and --memory-kinds '' skips part 2")

        if not self.skip_rollouts and max(self.n_envs) > int(self.episodes):
            raise ValueError(f"--n-envs {max(self.n_envs)} is more than --episodes {self.episodes}: every environment "
                             f"plays whole episodes, so at most {self.episodes} would run; use --n-envs <= "
                             f"{self.episodes} or more --episodes")
        for option, values in (("--memory-kinds", self.memory_kinds), ("--mem-lens", self.mem_lens),
                               ("--n-envs", self.n_envs)):
            if (twice := first_repeat(values)) is not None:
                raise ValueError(f"{option}: {twice!r} is given twice")
        check_device(self.device)
        if self.memory_kinds:
            self.check_memory(device_memory_bytes(self.device))

    def check_memory(self, available: int) -> None:
        """Refuse a ``--mem-lens`` entry M whose part 2 would not fit in ``available`` bytes.

        Raises:
            ValueError: naming ``--mem-lens``, the estimate (:func:`part2_bytes`), the memory and
                the largest M that fits (or ``--mem-steps`` when not even M = 1 fits).
        """
        m = max(int(v) for v in self.mem_lens)
        need = part2_bytes(m, self)
        if need <= available:
            return
        where = (f"more than the {_gib(available)} GiB of "
                 f"{'this machine' if torch.device(self.device).type == 'cpu' else self.device}")
        if part2_bytes(1, self) > available:
            raise ValueError(f"--mem-steps {self.mem_steps}: part 2 keeps all M + {self.mem_steps} input tokens of "
                             f"--mem-envs {self.mem_envs} environments in memory, {where}; lower --mem-steps")
        lo, hi = 1, m  # part2_bytes(lo) fits, part2_bytes(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if part2_bytes(mid, self) <= available else (lo, mid)
        raise ValueError(
            f"--mem-lens: M = {m} needs about {_gib(need)} GiB in part 2 (re-encoding M + 1 tokens forms "
            f"about {SCORE_TENSORS_AT_PEAK} float32 score tensors of --mem-envs {self.mem_envs} x {self.n_heads} "
            f"heads x (M + 1)^2), {where}; the largest M that fits is {lo} (keep M to the memory length an agent "
            f"would use, e.g. up to its episode length)")


def part2_bytes(mem_len: int, s: Settings) -> int:
    """Estimated peak bytes of part 2 for memory length M = ``mem_len``: the input tokens
    (N x (M + steps + 1) x D float32) and :data:`SCORE_TENSORS_AT_PEAK` score tensors of
    N x heads x (M + 1)^2 float32 (re-encoding M + 1 tokens; the O(M^2) term)."""
    n, m = int(s.mem_envs), int(mem_len)
    scores = SCORE_TENSORS_AT_PEAK * int(s.n_heads) * (m + 1) ** 2
    return 4 * n * (scores + (m + int(s.mem_steps) + 1) * int(s.d_model))


def _gib(n: int) -> str:
    v = n / 2**30
    return f"{v:.2f}" if v < 1e5 else f"{v:.3g}"


def device_memory_bytes(device: str) -> int:
    """Total memory of ``device``: the GPU's for ``cuda``, the machine's physical memory for ``cpu``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)

    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


@dataclass
class Result:
    settings: Settings
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    rollout_ratio: float | None = None
    growth: dict[str, Any] | None = None
    profile: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "machine": self.machine, "rollouts": self.rollouts,
                "batched_over_sequential": self.rollout_ratio, "growth": self.growth, "profile": self.profile,
                "memory": self.memory, "notes": self.notes}


# -- 1. batched vs sequential ---------------------------------------------------------------------

def load_agent(s: Settings, log: Callable[[str], None] = lambda m: None) -> BenchPolicy:
    """The policy of part 1: ``--run`` (any agent kind), else a small DT trained
    ``--train-updates`` updates on ``--dataset`` (:func:`train_small_dt`; 0: untrained)."""
    if s.run:
        loaded = load_run(s.run, device=s.device, plugins=s.plugins)
        agent = loaded.agent
        return BenchPolicy(agent.policy(), agent.make_env(), agent.default_targets()[0],
                           f"{loaded.kind} checkpoint {loaded.checkpoint} (step {loaded.step})")
    return train_small_dt(s.dataset, s.train_updates, s.seed, s.device, log)


def profile_cases(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The profile of one evaluation (``--episodes`` episodes on the first ``--n-envs``) of an
    untrained DT, BC and GTrXL on Hopper and on CartPole (:func:`untrained`)."""
    rows = []
    for env_id in PROFILE_ENVS:
        for kind in PROFILE_AGENTS:
            bp = untrained(kind, env_id, s.seed, s.device)
            row = rollout(bp, s.n_envs[0], s.episodes, s.seed, max_episode_steps=s.max_episode_steps, profile=True)
            row.update(agent=kind, env=env_id, policy=bp.what)
            rows.append(row)
            sp = row["split"]
            log(f"profile {kind} on {env_id}: forward {sp['forward_frac']:.0%}, context {sp['context_frac']:.0%}, "
                f"env {sp['env_frac']:.0%}, decode {sp['decode_frac']:.0%}, bookkeeping {sp['bookkeeping_frac']:.0%}")
    return rows


# -- 2. memory vs re-encoding ---------------------------------------------------------------------

def memory_backbone(kind: str, mem_len: int, s: Settings):
    """A Transformer-XL (``xl``: pre-norm blocks) or GTrXL (``gtrxl``: gated blocks) stack with
    XL memory of ``mem_len`` slots and relative positions, in eval mode on ``s.device``."""

    cfg = gtrxl_backbone(d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads, mem_len=mem_len)
    if kind == "xl":
        cfg["block"] = {"kind": "pre_norm"}
    elif kind != "gtrxl":
        raise ValueError(f"memory kind {kind!r}: use xl or gtrxl")
    cfg["max_position"] = max(4096, 4 * mem_len)
    return Backbone(cfg).to(s.device).eval()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def memory_step_cost(kind: str, mem_len: int, s: Settings) -> dict[str, Any]:
    """Milliseconds per environment step (N = ``s.mem_envs``) with memory vs re-encoding M + 1 tokens."""
    dev = torch.device(s.device)
    torch.manual_seed(s.seed)
    bb = memory_backbone(kind, mem_len, s)
    n, d, steps = s.mem_envs, s.d_model, s.mem_steps
    total = mem_len + steps
    x = torch.randn(n, total + 1, d, device=dev)  # one embedded token per environment step
    pos = torch.arange(total + 1, device=dev).expand(n, -1)
    # (a) with memory: warm the memory to M slots, then time one-token steps
    state = bb.initial_state(n, dev)
    out = bb(x[:, :mem_len], positions=pos[:, :mem_len], state=state)
    state = out.state
    _sync(dev)
    t0 = time.perf_counter()
    for t in range(mem_len, total):
        out = bb(x[:, t:t + 1], positions=pos[:, t:t + 1], state=state)  # (N, 1, D)
        state = out.state
    _sync(dev)
    mem_ms = (time.perf_counter() - t0) / steps * 1e3
    # (b) re-encoding the last M + 1 tokens every step, no memory
    _sync(dev)
    t0 = time.perf_counter()
    for t in range(mem_len, total):
        lo = t - mem_len
        bb(x[:, lo:t + 1], positions=pos[:, lo:t + 1] - lo)  # (N, M + 1, D)
    _sync(dev)
    re_ms = (time.perf_counter() - t0) / steps * 1e3
    return {"kind": kind, "mem_len": mem_len, "n_envs": n, "memory_ms_per_step": mem_ms,
            "reencode_ms_per_step": re_ms, "reencode_over_memory": re_ms / mem_ms}


# -- the benchmark --------------------------------------------------------------------------------

def run(s: Settings, log: Callable[[str], None] | None = None) -> Result:
    """Run both parts (see the module docstring).

    Raises:
        ValueError: bad settings (:meth:`Settings.check`), before anything is measured.
    """
    s.check()
    log = log or (lambda m: None)
    if s.device == "cpu":
        torch.set_num_threads(s.threads)
    res = Result(settings=s, machine=machine_info(torch.device(s.device)))
    if not s.skip_rollouts:
        res.machine["loadavg_start"] = list(os.getloadavg())
        bp = load_agent(s, log)
        res.notes.append(f"policy: {bp.what}")
        res.rollouts = compare(bp, s.n_envs, s.episodes, s.seed, max_episode_steps=s.max_episode_steps,
                               vector=s.vector, profile=s.profile, log=log)
        if len(res.rollouts) > 1:
            res.rollout_ratio = res.rollouts[0]["over_sequential"]
        res.growth = growth(res.rollouts)
        if res.growth is not None and s.plot:
            plot_growth(res.growth, res.rollouts, s.plot, f"bench eval: {bp.what}; {s.episodes} episodes")
        if s.profile:
            res.profile = profile_cases(s, log)
        res.machine["loadavg_end"] = list(os.getloadavg())
    for kind in s.memory_kinds:
        for m in s.mem_lens:
            row = memory_step_cost(kind, m, s)
            res.memory.append(row)
            log(f"{kind} M={m}: memory {row['memory_ms_per_step']:.2f} ms/step, re-encode "
                f"{row['reencode_ms_per_step']:.2f} ms/step ({row['reencode_over_memory']:.1f}x)")
    return res


def markdown(res: Result) -> str:
    lines = []
    if res.rollouts:
        m = res.machine
        lines += [f"*load average at start {_load(m.get('loadavg_start'))}, at end {_load(m.get('loadavg_end'))}; "
                  f"{res.notes[0] if res.notes else ''}*", ""]
        prof = "split" in res.rollouts[0]
        lines += ["| evaluation | envs | episodes | env steps | seconds | env steps/s | / sequential | ms per loop step "
                  "| mean return |" + (" policy share |" if prof else ""),
                  "|---|---|---|---|---|---|---|---|---|" + ("---|" if prof else "")]
        lines += [rollout_line(r) for r in res.rollouts]
        lines.append("")
        if res.rollout_ratio is not None:
            lines += [f"batched / sequential: {res.rollout_ratio:.2f}x", ""]
        if res.growth is not None:
            g = res.growth
            lines += [f"ms per loop step ~ {g['a_ms']:.2f} + {g['b_ms_per_env']:.3f} N (R^2 {g['r2']:.3f}); log-log "
                      f"slope between N = {g['n'][-2]} and {g['n'][-1]}: {g['loglog_slope']:.2f}", ""]
    if res.profile:
        lines += ["| agent | env | envs | episodes | env steps | seconds | forward | context | env step | decode | "
                  "bookkeeping |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [profile_line(r) for r in res.profile]
        lines.append("")
    if res.memory:
        lines += ["| backbone | M | envs | with memory (ms/step) | re-encode M+1 (ms/step) | re-encode / memory |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['mem_len']} | {r['n_envs']} | {r['memory_ms_per_step']:.2f} | "
                  f"{r['reencode_ms_per_step']:.2f} | {r['reencode_over_memory']:.1f}x |" for r in res.memory]
    return "\n".join(lines)


def rollout_line(r: dict[str, Any]) -> str:
    """One row of the throughput table (with the policy's share of the wall time when profiled)."""
    share = (f" {r['split']['forward_frac'] + r['split']['context_frac'] + r['split']['decode_frac']:.0%} |"
             if "split" in r else "")
    return (f"| {r['mode']} | {r['n_envs']} | {r['episodes']} | {r['env_steps']} | {r['seconds']:.1f} | "
            f"{r['env_steps_per_s']:.0f} | {r['over_sequential']:.2f}x | {r['ms_per_loop_step']:.2f} | "
            f"{r['return_mean']:.1f} |" + share)


def profile_line(r: dict[str, Any]) -> str:
    """One row of the profile table: each part's share of the evaluation's wall time."""
    sp = r["split"]
    parts = " | ".join(f"{sp[f'{k}_frac']:.0%}" for k in ("forward", "context", "env", "decode", "bookkeeping"))
    return (f"| {r['agent']} | {r['env']} | {r['n_envs']} | {r['episodes']} | {r['env_steps']} | {r['seconds']:.2f} | "
            f"{parts} |")


def _load(values: Any) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "?"


def _ints(text: str, option: str = "--mem-lens") -> tuple[int, ...]:
    """``"32,128"`` -> ``(32, 128)``; blank items are skipped.

    Raises:
        ValueError: an item that is not an integer (the message names ``option`` and the item).
    """
    out = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            out.append(int(x))
        except ValueError:
            raise ValueError(f"{option}: {x.strip()!r} is not an integer (expected e.g. 32,128,512)") from None
    return tuple(out)


def _run_or_exit_1(s: Settings, log: Callable[[str], None]) -> Result:
    """:func:`run`; other episodes in the batched mode than one at a time are a failure of the
    computation: one ``error:`` line and exit 1."""
    try:
        return run(s, log)
    except DifferentEpisodes as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def register(bench_app) -> None:
    """Add the ``eval`` command to the ``bench`` Typer group."""

    def eval_(
        run_dir: str = typer.Option(None, "--run", help="Run directory of a trained agent (default: a small DT "
                                                        "trained --train-updates updates on --dataset)."),
        dataset: str = typer.Option(DEFAULT_DATASET, help="Dataset the default DT trains on (its env and statistics)."),
        train_updates: int = typer.Option(300, help="Updates of the default DT (64 dims, 2 layers), >= 0 (0: "
                                                    "untrained, short episodes)."),
        episodes: int = typer.Option(10, min=1, help="Episodes (the same seeds in every mode)."),
        n_envs: str = typer.Option("10", help="Vector environments of the batched mode, comma-separated (e.g. "
                                              "1,10,50,100: with 3 or more, the growth with N is fitted)."),
        profile: bool = typer.Option(False, "--profile", help="Split each evaluation's wall time (forward, context, "
                                                             "env step, decode, bookkeeping), and profile an "
                                                             "untrained DT, BC and GTrXL on Hopper and CartPole."),
        vector: str = typer.Option("sync", help="Vector environment of the batched mode: sync (running envs "
                                                "stepped one by one) or async (a process per env)."),
        plot: str = typer.Option(None, "--plot", help="Write the growth plot (ms per loop step and env steps/s "
                                                     "against N) to this file."),
        max_episode_steps: int = typer.Option(None, min=1, help="Cap episode length at this many steps, >= 1 "
                                                               "(shorter runs; default: the environment's own "
                                                               "limit)."),
        threads: int = typer.Option(1, min=1, help="torch intra-op threads (CPU)."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        memory_kinds: str = typer.Option("xl,gtrxl", help="Memory backbones of part 2, comma-separated subset of "
                                                          "xl,gtrxl (empty: skip part 2)."),
        mem_lens: str = typer.Option("32,128,512", help="Memory lengths M of part 2 (integers >= 1; an M whose "
                                                       "estimated memory exceeds the device's is refused)."),
        mem_envs: int = typer.Option(10, min=1, help="Environments N of part 2."),
        mem_steps: int = typer.Option(50, min=1, help="Timed steps per (backbone, M) of part 2."),
        skip_rollouts: bool = typer.Option(False, "--skip-rollouts", help="Only part 2."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
        plugin: list[str] = typer.Option([], "--plugin", metavar="MODULE",
                                         help="With --run: import this module (repeatable); a module the run's "
                                              "plugins list is imported only when named here (it runs that "
                                              "module's code) or installed as an entry point."),
    ) -> None:
        """Env steps/s of batched vs one-env-at-a-time evaluation; memory vs re-encoding cost per step."""
        check_out(plot, "--plot", "bench_eval.png")
        run_checked(lambda: Settings(run=run_dir, plugins=tuple(plugin), dataset=dataset, episodes=episodes,
                                     n_envs=_ints(n_envs, "--n-envs"), train_updates=train_updates, profile=profile,
                                     vector=vector, plot=plot,
                                     max_episode_steps=max_episode_steps, threads=threads, device=device,
                                     memory_kinds=tuple(k.strip() for k in memory_kinds.split(",") if k.strip()),
                                     mem_lens=_ints(mem_lens), mem_envs=mem_envs, mem_steps=mem_steps,
                                     skip_rollouts=skip_rollouts),
                    _run_or_exit_1, markdown, out=out, as_json=as_json,
                    # loading the policy, before any timing; a ValueError: the run cannot play these
                    # episodes (a DT's agent.max_ep_len below the environment's), as `eval` refuses it
                    load_errors=(AgentBuildError, CheckpointError, UnknownAgentError, ConfigError, ValueError),
                    source=f"{'--run' if run_dir else '--dataset'} {run_dir or dataset}")

    bench_app.command("eval")(eval_)
