"""The agent registry, and the members of :class:`~rl_tformers.runtime.protocol.Trainable` the trainer drives.

An agent kind registers a *builder*; the trainer calls it once per run::

    from rl_tformers.runtime.agent_registry import register_agent

    @register_agent("dt", description="Decision Transformer (Chen et al. 2021)",
                    defaults={"agent": {"context_len": 20}, "train": {"lr": 1e-4}})
    def build(cfg: DictConfig, run_dir: Path, device: torch.device) -> DTAgent:
        ...

``cfg`` is the full, resolved, read-only run config (``cfg.agent``, ``cfg.backbone``,
``cfg.dataset``, ``cfg.train.batch_size``, ``cfg.seed``...); ``run_dir`` is where the run writes
(the agent may put files there, e.g. evaluation videos); ``device`` is the training device.
``defaults`` (optional) is a partial config merged under the user's config: its ``agent``
section also declares the agent's keys, so an unknown ``agent.x`` becomes an error.

Registration happens on import. :func:`discover_agents` imports the built-in ``toy`` agent
and, for every sub-package ``rl_tformers.agents.<name>``, the package and its ``agent``
module if present: put ``@register_agent`` in ``agents/<name>/agent.py``.

The protocol (required)
-----------------------
``model: torch.nn.Module``
    Everything the optimiser trains. The trainer moves it to the device, switches
    ``train()``/``eval()``, checkpoints ``model.state_dict()`` and may compile it in place.
``loss(batch) -> (loss, logs)``
    ``loss``: 0-dim float tensor to minimise (mean over the batch, auxiliary losses
    included). ``logs``: ``Mapping[str, float | 0-dim Tensor]`` of extra scalars, averaged over
    the logging window (the keys in ``latest_logs``: their latest value) and written as
    ``train/<key>``. Runs under autocast when ``train.amp=bf16``; must not call ``backward``
    or step anything.
``batches(start_step) -> Dataset | Iterable``
    The batches for updates ``start_step, start_step + 1, ...``. Either

    - a step-indexed ``torch.utils.data.Dataset`` (preferred): ``ds[s]`` returns the whole
      batch for update ``s`` (tensors/arrays in dicts, lists or tuples, on CPU), drawn from its
      own generator such as ``np.random.default_rng([cfg.seed, s])``. The trainer reads it
      with a DataLoader (``train.num_workers`` workers, ``batch_size=None``); or
    - an iterable whose first item is the batch for ``start_step``.

    Either way the batch for step ``s`` must be a pure function of ``(cfg.seed, s)``: this is
    what makes ``--resume`` and ``num_workers > 0`` give identical batches. Never draw batches
    from the global RNGs (those drive dropout and are restored on resume).

The protocol (optional methods, detected with ``getattr``)
----------------------------------------------------------
``param_groups() -> list[dict]``
    AdamW groups: ``{"params": [...], "weight_decay": float?, "lr_scale": float?, "name": str?}``.
    Default: :func:`rl_tformers.runtime.optim.default_param_groups` (no decay on biases,
    norms, embeddings).
``evaluate(step) -> Mapping[str, float | Tensor | matplotlib Figure]``
    Called every ``eval.every`` updates and at the end, with the model in ``eval()`` mode,
    under ``torch.no_grad()`` and with the global RNGs isolated (evaluation never changes the
    training trajectory). Scalars go to TensorBoard as ``eval/<key>`` (a key containing ``/``
    is used as is), figures as images. Evaluate with :func:`rl_tformers.runtime.evaluation.evaluate`
    seeded with :func:`~rl_tformers.runtime.evaluation.eval_seed` and return
    :func:`~rl_tformers.runtime.evaluation.report_logs` of the report (the one key convention).
``local_batches: bool``
    Under DDP the trainer normally cuts every batch into the W ranks' shards
    (:func:`~rl_tformers.runtime.distributed.shard_source`). An agent whose ``batches`` already
    yields this rank's own part of the global batch (on-policy agents: each rank collects its
    own rollout, so W processes act like one with W times the environments) sets this to True
    and the trainer feeds its batches unchanged. Default False. Such a kind registers with
    ``register_agent(..., local_batches=True)`` too, so that ``train.batch_size`` (which it does not
    split) is not required to divide by the number of processes before the agent is built.
``updates_per_rollout: int``
    On-policy agents: how many consecutive updates learn from one rollout (PPO: epochs x
    minibatches). The trainer then redraws random attention features (``redraw_every`` of
    ``performer``/``rfa``/``lsh``) only at multiples of it, never between a rollout and its
    updates. Default 1 (offline agents: a redraw may follow any update).
``ddp_find_unused: bool``
    True when some updates leave parameters without a gradient (PPO's critic warm-up trains
    the value head alone): under DDP the trainer then wraps the model with
    ``find_unused_parameters=True``, as ``train.ddp_find_unused=true`` does (without it the
    update after such an update fails). Default False.
``latest_logs: Collection[str]``
    Keys of ``loss``'s ``logs`` that are counters or running totals (PPO: ``env_steps``):
    instead of the window's mean the trainer logs the value of the latest update that logged
    the key (under DDP the mean over the ranks of each rank's latest value, so a counter that
    already counts every process, as PPO's does, is logged as is). Keys are named as in
    ``logs`` (``train/`` is added the same way). Default: none (every key is averaged).
``resolved_options() -> Mapping[str, Any]``
    The effective values of the agent's options that its build resolved (``"auto"`` chosen from
    the data, a null default filled in), by dotted key: ``{"agent.reward_scale": 1000.0,
    "agent.align": "start"}``. The trainer records them with its own (device, threads) at the top
    of ``config.yaml``, in the first log line and in the TensorBoard hparams
    (:mod:`rl_tformers.runtime.resolved`). Default: none.
``resume_note(step) -> str | None``
    Agents whose ``--resume`` is not bit-identical to an uninterrupted run (e.g. an on-policy
    agent whose environments could not be checkpointed) return one line saying what is and is
    not restored; the trainer logs it as a warning when it resumes (rank 0). None: nothing to say.
``process_state() -> dict`` / ``load_process_state(states: list[dict] | None) -> None``
    State that belongs to one process, not to the run (on-policy agents: the environments, the
    running episodes, the rollout being trained on). Every checkpoint saves each rank's
    ``process_state()`` (gathered under DDP; the same types as ``extra_state``) as
    ``trainer.process_ranks``; on resume the agent gets the whole list (after
    ``load_extra_state``, before ``batches``), or None from a checkpoint without it, and
    picks its rank's entry (a list of another length: a different number of processes).
``extra_state() -> dict`` / ``load_extra_state(state: dict) -> None``
    Non-parameter state to checkpoint (observation mean/std, reward scale, ...): tensors,
    numbers, strings, ``None`` and lists/tuples/dicts of them only (anything else is refused
    at save time, because checkpoints are loaded with ``weights_only=True``).

Resuming: what a builder may read
---------------------------------
On ``--resume`` the trainer calls the builder first and hands the checkpoint to the agent
after it (weights, ``load_extra_state``, ``load_process_state``). A builder whose model depends
on something outside the config (a fine-tuning agent that takes its model options from another
run) can call :func:`resume_state` while it builds: the verified checkpoint dict being resumed,
or None for a new run, so that it rebuilds the run's own model from its ``extra_state`` instead
of reading that other run again. Builders that ignore it are unchanged.

Registration flags
------------------
``local_batches=True`` (see above) and ``single_process=True``: the kind trains in one process
only (its state, e.g. a replay buffer filled by its own rollouts, is not shared between
processes); ``rl-tformers train --nproc N`` with N > 1 is refused before any process starts
(:func:`rl_tformers.runtime.trainer.check_world_size`).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import pkgutil
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.protocol import AgentBuilder, Trainable


class UnknownAgentError(ConfigError):
    """``agent.kind`` names no registered agent; the message lists the registered kinds."""


class AgentBuildError(ConfigError):
    """The agent cannot be built from this config and data: a bad ``agent.*`` option, a dataset
    that is missing or malformed, a backbone the agent cannot use, an unknown environment...

    Raised by :func:`build_agent` (and :func:`agent_build_errors`) in place of the
    ``ValueError`` (which includes ``DatasetError`` and ``IncompatibleConfig``) or
    ``FileNotFoundError`` the builder raised, with the same message (which names the option,
    field, episode or file at fault); the original is its ``__cause__``. Being a
    :class:`ConfigError`, the command line reports it as ``error: ...`` with exit status 2.
    """


#: what a builder raises for unusable input (config values, data files): ValueError covers
#: ConfigError, DatasetError, IncompatibleConfig and the agents' option checks
BUILD_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def agent_build_errors() -> Iterator[None]:
    """Inside the block, :data:`BUILD_ERRORS` become :class:`AgentBuildError` (same message).

    Used around the agent's construction and its first ``batches()`` call: the phase where
    the config and the data are checked, before anything is trained or written.
    """
    try:
        yield
    except AgentBuildError:
        raise
    except BUILD_ERRORS as exc:
        raise AgentBuildError(str(exc)) from exc


@dataclass(frozen=True)
class AgentEntry:
    """One registered agent kind.

    Attributes:
        kind: the ``agent.kind`` string.
        builder: ``builder(cfg, run_dir, device) -> Trainable``.
        description: one line for listings.
        defaults: partial config merged under the user's config (may be empty).
        local_batches: the kind's agents set ``local_batches`` (each rank yields its own share
            of the global batch, e.g. an on-policy agent's own rollout), so ``train.batch_size``
            is not the batch split over the processes and need not divide by their number.
        check_backbone: ``check_backbone(backbone_cfg)`` raises ``ValueError`` (naming the
            option) for a valid backbone this agent cannot use; called by ``compose`` before the
            generic compatibility check, so the agent's own advice comes first.
        single_process: the kind trains in one process only: more than one (``--nproc N``,
            N > 1) is refused before any process starts.
        config_cls: the frozen dataclass of the kind's ``agent:`` section
            (a :class:`~rl_tformers.typed_config.TypedConfig`), or None for a kind that declares
            its keys with ``defaults["agent"]`` only. With it, ``compose`` checks the section with
            ``config_cls.from_dict(section, where="agent")`` and the section's defaults are the
            class's; ``rl-tformers agents KIND`` lists its fields.
    """

    kind: str
    builder: AgentBuilder
    description: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    local_batches: bool = False
    check_backbone: Callable[[Any], None] | None = None
    single_process: bool = False
    config_cls: type | None = None

    def agent_options(self, section: Mapping[str, Any]) -> Any:
        """The typed options of a plain ``agent:`` section (its ``kind`` key aside).

        Raises:
            ConfigFieldError: (a ValueError) one line naming ``agent.<key>``.
            TypeError: the kind registered no ``config_cls``.
        """
        if self.config_cls is None:
            raise TypeError(f"agent kind {self.kind!r} registered no config class")
        return self.config_cls.from_dict({k: v for k, v in section.items() if k != "kind"}, where="agent")


_AGENTS: dict[str, AgentEntry] = {}
_IMPORT_FAILURES: dict[str, str] = {}
_discovered = False


def register_agent(
    kind: str, *, description: str = "", defaults: Mapping[str, Any] | None = None, local_batches: bool = False,
    check_backbone: Callable[[Any], None] | None = None, single_process: bool = False,
    config_cls: type | None = None,
) -> Callable[[AgentBuilder], AgentBuilder]:
    """Decorator registering ``builder`` under ``kind``.

    Args:
        kind: the ``agent.kind`` value (non-empty, no spaces).
        description: one line shown by ``rl-tformers train --help``/error messages.
        defaults: partial run config (``{"agent": {...}, "train": {...}, ...}``) applied under
            the user's config; its ``agent`` keys become the closed set of valid ``agent.*``.
        local_batches: the agents it builds set ``local_batches = True`` (see the module
            docstring): ``train.batch_size`` is then not checked against the number of processes.
        check_backbone: see :class:`AgentEntry`.
        single_process: the kind trains in one process only (see :class:`AgentEntry`).
        config_cls: the typed ``agent:`` section (see :class:`AgentEntry`); the section's
            defaults are ``config_cls().to_dict()`` (a ``defaults["agent"]`` must equal them).

    Raises:
        ValueError: for an empty kind, a defaults section that is not a mapping, or a kind
            already registered by another builder.
    """
    if not kind or any(c.isspace() for c in kind):
        raise ValueError(f"agent kind must be a non-empty word, got {kind!r}")
    defaults = dict(defaults or {})
    for section, value in defaults.items():
        if section in ("agent", "backbone", "dataset", "train", "eval") and not isinstance(value, Mapping):
            raise ValueError(f"register_agent({kind!r}): defaults[{section!r}] must be a mapping")
    if "agent" in defaults and defaults["agent"].get("kind", kind) != kind:
        raise ValueError(f"register_agent({kind!r}): defaults.agent.kind must be {kind!r}")
    if config_cls is not None:
        generated = config_cls().to_dict()
        given = {k: v for k, v in defaults.get("agent", {}).items() if k != "kind"}
        if given and given != generated:
            raise ValueError(f"register_agent({kind!r}): defaults['agent'] differs from config_cls's defaults; "
                             f"leave it out (the agent defaults come from config_cls)")
        defaults["agent"] = generated

    def deco(builder: AgentBuilder) -> AgentBuilder:
        old = _AGENTS.get(kind)
        same = old is not None and getattr(old.builder, "__qualname__", None) == getattr(builder, "__qualname__", 0) \
            and getattr(old.builder, "__module__", None) == getattr(builder, "__module__", 0)
        if old is not None and not same:
            raise ValueError(f"agent kind {kind!r} is already registered by {old.builder.__module__}")
        agent_defaults = {**defaults}
        if "agent" in agent_defaults:
            agent_defaults["agent"] = {"kind": kind, **agent_defaults["agent"]}
        _AGENTS[kind] = AgentEntry(kind=kind, builder=builder, description=description, defaults=agent_defaults,
                                   local_batches=bool(local_batches), check_backbone=check_backbone,
                                   single_process=bool(single_process), config_cls=config_cls)
        return builder

    return deco


def discover_agents() -> None:
    """Import the built-in toy agent and every ``rl_tformers.agents.<name>[.agent]`` module once.

    A module that fails to import is remembered (see :func:`import_failures`) rather than
    raised, so a broken agent does not stop the others; asking for its kind then reports the
    import error.
    """
    global _discovered
    if _discovered:
        return
    _discovered = True
    importlib.import_module("rl_tformers.runtime.toy")
    try:
        pkg = importlib.import_module("rl_tformers.agents")
    except ModuleNotFoundError:  # pragma: no cover - the agents package is part of the install
        return
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or not info.ispkg:
            continue
        for name in (f"rl_tformers.agents.{info.name}", f"rl_tformers.agents.{info.name}.agent"):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name == name:
                    continue  # no agent.py in this package (yet)
                _IMPORT_FAILURES[name] = _short_trace(exc)
            except Exception as exc:  # noqa: BLE001 - report any import-time failure by module
                _IMPORT_FAILURES[name] = _short_trace(exc)


def _short_trace(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def import_failures() -> dict[str, str]:
    """Agent modules that failed to import during discovery: ``{module: "Error: message (file:line)"}``."""
    discover_agents()
    return dict(_IMPORT_FAILURES)


def available_agents() -> list[str]:
    """Registered agent kinds, sorted."""
    discover_agents()
    return sorted(_AGENTS)


def get_agent(kind: str) -> AgentEntry:
    """The entry registered under ``kind``.

    Raises:
        UnknownAgentError: listing the registered kinds (and agent modules that failed to
            import, which may be why ``kind`` is missing).
    """
    discover_agents()
    if kind in _AGENTS:
        return _AGENTS[kind]
    close = difflib.get_close_matches(str(kind), sorted(_AGENTS), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    msg = (f"agent.kind={kind!r} is not registered; {hint}registered kinds: {', '.join(sorted(_AGENTS)) or '(none)'} "
           f"(an agent of your own registers when its module is listed in plugins)")
    if _IMPORT_FAILURES:
        msg += "\nagent modules that failed to import:\n" + "\n".join(f"  {m}: {e}" for m, e in _IMPORT_FAILURES.items())
    raise UnknownAgentError(msg)


def check_trainable(obj: Any, kind: str) -> Trainable:
    """Verify a builder's result has the required members.

    Raises:
        TypeError: naming the agent kind and every missing or wrongly typed member.
    """
    problems = []
    if not isinstance(getattr(obj, "model", None), nn.Module):
        problems.append("model (a torch.nn.Module)")
    for name in ("loss", "batches"):
        if not callable(getattr(obj, name, None)):
            problems.append(f"{name}() method")
    if callable(getattr(obj, "extra_state", None)) != callable(getattr(obj, "load_extra_state", None)):
        problems.append("extra_state() and load_extra_state() must be defined together")
    if problems:
        raise TypeError(f"agent {kind!r}: the builder returned {type(obj).__name__}, which lacks: {'; '.join(problems)}")
    return obj


#: the checkpoint being resumed while a builder runs (:func:`resume_state`)
_RESUME_STATE: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("resume_state", default=None)


def resume_state() -> Mapping[str, Any] | None:
    """The verified checkpoint dict (:func:`~rl_tformers.runtime.checkpoint.load_checkpoint`) that the
    agent being built will be resumed from, or None (a new run, a check, inference, or outside a
    builder). Only valid while :func:`build_agent` runs the builder; see the module docstring."""
    return _RESUME_STATE.get()


def build_agent(
    cfg: Any, run_dir: Path, device: torch.device, resume_from: Mapping[str, Any] | None = None,
) -> Trainable:
    """Build the agent named by ``cfg.agent.kind`` and check it implements :class:`Trainable`.

    Args:
        cfg, run_dir, device: passed to the builder.
        resume_from: the checkpoint dict the trainer will load into the agent after it is built
            (``--resume``); the builder can read it with :func:`resume_state`.

    Raises:
        AgentBuildError: the builder refused the config or the data (see :data:`BUILD_ERRORS`).
        TypeError: the builder's result is not a :class:`Trainable`.
    """
    kind = str(cfg.agent.kind)
    token = _RESUME_STATE.set(resume_from)
    try:
        with agent_build_errors():
            agent = get_agent(kind).builder(cfg, Path(run_dir), device)
    finally:
        _RESUME_STATE.reset(token)
    return check_trainable(agent, kind)
