"""Run configuration: a typed schema, YAML files, dotted overrides, one resolved result.

A run is described by one config tree (OmegaConf ``DictConfig``)::

    seed: 0                    # seeds python/numpy/torch; environments derive theirs from it
    device: auto               # auto | cpu | cuda | cuda:N | mps
    cpu_matmul: auto           # float32 nn.Linear products on the CPU: mkl | onednn (auto: resolved
                               # here for this machine; rl_tformers.runtime.cpu_matmul)
    run_dir: null              # null: runs/<config name>-<YYYYmmdd-HHMMSS>
    plugins: []                # your modules registering kinds/agents (rl_tformers.runtime.plugins)
    agent: {kind: dt, ...}     # registered agent kind + its own options
    backbone: {...}            # rl_tformers.backbone_config.BackboneConfig fields and slots
    dataset: {...}             # read by the agent / data layer
    train: {...}               # TrainConfig below: optimiser, schedule, logging, checkpoints
    eval: {...}                # EvalConfig below

Layers, later ones win:

1. the schema (:class:`RunConfig`, typed: a wrong type or an unknown key is an error naming
   its dotted path);
2. ``configs/defaults.yaml`` (the same values, with comments: the place to read them);
3. the defaults the agent kind registered (``register_agent(kind, defaults=...)``);
4. the config file given with ``--config`` (a path, or a name inside the ``rl_tformers.configs``
   package such as ``dt/hopper_medium``), after the files its ``_base_`` key lists;
5. ``key=value`` overrides from the command line (values parsed as YAML: ``train.lr=3e-4``,
   ``train.betas=[0.9,0.95]``, ``run_dir=null``).

Sections: ``dataset`` is checked against :class:`DatasetConfig` (an unknown key or a wrong
type is an error naming its dotted path; the schema's defaults are not filled in); ``agent`` is
closed when the agent kind registered defaults for it (then an unknown ``agent.x`` is an
error), open otherwise; ``backbone`` is checked by ``BackboneConfig.from_dict`` and
``rl_tformers.backbone.check_compatible``. ``${...}`` interpolations are resolved once, at
the end, so the run directory's ``config.yaml`` holds plain values only.

Why OmegaConf (and Typer for the command line): OmegaConf merges YAML layers with dotted
overrides, checks them against a typed dataclass schema and resolves interpolations, in one
small, widely used library; Hydra adds a launcher and a working-directory policy we do not
want, tyro/jsonargparse put the schema in function signatures, which fits poorly with
agent-specific sections that register themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rl_tformers.backbone import check_compatible
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.registry import REGISTRIES, SLOTS, RegistryError
from rl_tformers.runtime.agent_registry import AgentEntry, available_agents, get_agent
from rl_tformers.runtime.cpu_matmul import resolve_cpu_matmul
from rl_tformers.runtime.device import resolve_device
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.plugins import check_backbone_kinds, check_plugin_names, load_plugins
from rl_tformers.runtime.seeding import MAX_SEED
from rl_tformers.typed_config import option, range_words

BASE_KEY = "_base_"
DEFAULTS_NAME = "defaults.yaml"


class Schedule(str, Enum):
    """Learning-rate schedules (see :mod:`rl_tformers.runtime.optim`)."""

    constant = "constant"
    linear_warmup = "linear_warmup"
    warmup_cosine = "warmup_cosine"


class Amp(str, Enum):
    """Mixed precision: ``none`` (float32) or ``bf16`` (bfloat16 autocast)."""

    none = "none"
    bf16 = "bf16"


@dataclass
class TrainConfig:
    """``train:`` section.

    Attributes:
        steps: optimiser updates in the run (N).
        batch_size: samples per update (agents read it to build their batches).
        lr: peak learning rate.
        weight_decay: AdamW decoupled weight decay of the decayed group (weight matrices).
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        grad_clip: max global L2 norm of the gradients; ``null`` or 0 disables clipping
            (the norm is still measured and logged).
        schedule: ``constant`` | ``linear_warmup`` | ``warmup_cosine``.
        warmup_steps: linear warmup length W, in updates.
        min_lr_ratio: final lr / peak lr of ``warmup_cosine``.
        amp: ``none`` | ``bf16`` (autocast of forward and loss, on CPU and CUDA alike).
        compile: ``torch.compile`` the model (in place; checkpoints are unaffected; on CPU and
            CUDA alike).
        cuda_graphs: capture the model's forward and backward in CUDA graphs
            (``torch.compile(mode="reduce-overhead")``: replays cut the per-kernel launch cost of
            small models; implies ``compile``). CUDA only: refused on another device.
        deterministic: ask torch for deterministic kernels (slower on GPU).
        num_workers: DataLoader worker processes for step-indexed datasets (0: main process).
        data_on_device: hold the dataset as tensors on the run's device and draw each DT window /
            GTrXL segment batch there by indexing them (only the batch's row indices cross from
            the host; the same batches as the host path, bit for bit). For agents whose batches
            come from a window or segment sampler (the offline agents); excludes
            ``num_workers`` > 0. On CPU it runs the same code on host tensors.
        log_every: write scalars (means over the window) every this many updates.
        checkpoint_every: save a checkpoint every this many updates (0: only at the end and on
            interruption).
        keep_last: keep this many newest checkpoints.
        progress: show a progress bar with ETA (on a terminal; a plain line every 10 s or 5% of the run otherwise).
        ddp_find_unused: multi-process runs only: let DistributedDataParallel look for
            parameters without a gradient in each update (needed when some parameters are unused
            in some updates; costs a graph traversal per update).
    """

    steps: int = option(1000, ge=1)
    batch_size: int = option(64, ge=1)
    lr: float = option(1.0e-4, gt=0)
    weight_decay: float = option(1.0e-4, ge=0)
    betas: list[float] = option(factory=lambda: [0.9, 0.999], ge=0, lt=1)
    eps: float = option(1.0e-8, gt=0)
    grad_clip: float | None = option(0.25, ge=0)
    schedule: Schedule = Schedule.warmup_cosine
    warmup_steps: int = option(100, ge=0)
    min_lr_ratio: float = option(0.1, ge=0, le=1)
    amp: Amp = Amp.none
    compile: bool = False
    cuda_graphs: bool = False
    deterministic: bool = False
    num_workers: int = option(0, ge=0)
    data_on_device: bool = False
    log_every: int = option(10, ge=1)
    checkpoint_every: int = option(1000, ge=0)
    keep_last: int = option(3, ge=1)
    progress: bool = True
    ddp_find_unused: bool = False


@dataclass
class EvalConfig:
    """``eval:`` section (the trainer reads ``every`` and ``at_end``; agents read the rest).

    Attributes:
        every: call the agent's ``evaluate`` every this many updates (0: never during training).
        at_end: also evaluate after the last update.
        episodes: evaluation episodes per call (>= 1).
        n_envs: parallel environments (gymnasium vector env) for evaluation (>= 1).
    """

    every: int = option(0, ge=0)
    at_end: bool = True
    episodes: int = option(10, ge=1)
    n_envs: int = option(5, ge=1)


@dataclass
class ScriptedDatasetConfig:
    """``dataset.scripted:`` a dataset generated on the spot by a scripted behaviour policy
    (GTrXL memory tasks, :func:`rl_tformers.envs.memory_tasks.scripted_dataset`).

    Attributes:
        task: memory task (``recall``...). episodes: episodes to generate. epsilon: probability
        of a random action. seed: generator seed (null: the run's ``seed``). delay: recall delay.
    """

    task: str = "recall"
    episodes: int = option(1000, ge=1)
    epsilon: float = option(0.2, ge=0, le=1)
    seed: int | None = option(None, ge=0, le=MAX_SEED)
    delay: int = option(8, ge=1)


@dataclass
class DatasetConfig:
    """``dataset:`` section, read by the offline agents (:mod:`rl_tformers.agents.common.offline`).

    Used to *check* the section (unknown keys, types), not to fill it: only the keys a config
    sets appear in the resolved config, so a saved config composed again compares equal to itself.

    Attributes:
        path: Minari id (``rlt/hopper-v5/medium-v0``), Minari dataset folder or D4RL .hdf5 file.
        root: data root searched first for Minari ids (null: ``$RL_TFORMERS_DATA``, else
            Minari's own root, ``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets``).
        download: let Minari download an id that is not found locally (needs network).
        lazy: HDF5 files only: read observation/action windows from disk.
        flatten_observations: flatten Dict/Tuple observation spaces of Minari datasets
            (``gymnasium.spaces.flatten_space``); without it they are refused.
        env_id: HDF5 files only: the gymnasium task the data came from (e.g. ``Hopper-v5``),
            whose action space bounds continuous actions. Null: the file's ``env_id``
            attribute, else a task recognised from the file name (``hopper-medium-v2.hdf5``).
        scripted: generate the data instead (:class:`ScriptedDatasetConfig`; GTrXL agents).
        build: the shell command that creates the file at ``path`` (e.g. ``python -m
            rl_tformers.envs.memory_tasks recall ... --out data/memory/recall-d8.hdf5``); never
            run, only shown in the error when that file is missing (and only when the command
            names ``path``, so an overridden path does not get another file's recipe).
    """

    path: str | None = None
    root: str | None = None
    download: bool = False
    lazy: bool = False
    flatten_observations: bool = False
    env_id: str | None = None
    scripted: ScriptedDatasetConfig | None = None
    build: str | None = None


@dataclass
class _DatasetSection:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)


@dataclass
class RunConfig:
    """The whole config tree (see the module docstring)."""

    seed: int = option(0, ge=0, le=MAX_SEED)
    device: str = "auto"
    cpu_matmul: str = "auto"
    run_dir: str | None = None
    plugins: list[str] = field(default_factory=list)
    agent: dict[str, Any] = field(default_factory=lambda: {"kind": "???"})
    backbone: dict[str, Any] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


#: Keys that may change when a run is resumed (prefix match). Everything else must stay as it
#: was, or the resumed run would not continue the same trajectory. ``dataset.path`` /
#: ``dataset.root`` say where the data are, not what they are: a run started on a relative path
#: resumes from another working directory with the file's absolute path, or after the data
#: moved; the offline agents refuse data whose statistics differ from the checkpoint's
#: (``DatasetInfo.data_differences``: layout, observation mean/std, returns, number of steps and
#: mean action or action frequencies), so another dataset cannot slip in this way.
RESUMABLE_KEYS = (
    "cpu_matmul",
    "plugins",  # imported modules only: a kind the run uses must still be registered to build it
    "dataset.path",
    "dataset.root",
    "train.steps",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_last",
    "train.progress",
    "train.num_workers",
    "train.data_on_device",  # the same batches either way
    "train.compile",
    "train.cuda_graphs",
    "train.ddp_find_unused",
    "eval",
    "device",
    "run_dir",
)


# -- finding config files ---------------------------------------------------------------------------

def configs_root() -> Path:
    """Directory of the ``rl_tformers.configs`` package (the repository's ``configs/``)."""
    return Path(str(importlib.resources.files("rl_tformers.configs")))


def available_configs() -> list[str]:
    """Names accepted by ``--config`` (paths relative to the configs package, without ``.yaml``)."""
    root = configs_root()
    names = [p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")]
    return sorted(n for n in names if n != Path(DEFAULTS_NAME).stem)


def resolve_config_path(name: str | os.PathLike, relative_to: Path | None = None) -> Path:
    """Find a config file.

    Tried in order: ``name`` relative to ``relative_to`` (for ``_base_`` entries), ``name`` as a
    path (also with ``.yaml`` appended), then ``name`` inside the configs package.

    Raises:
        ConfigError: if nothing matches; the message suggests close names.
    """
    raw = str(name)
    candidates: list[Path] = []
    for base in ([relative_to] if relative_to is not None else []) + [None]:
        p = Path(raw) if base is None else base / raw
        candidates += [p, p.with_name(p.name + ".yaml")]
    root = configs_root()
    candidates += [root / raw, root / f"{raw}.yaml"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = available_configs()
    close = difflib.get_close_matches(raw.removesuffix(".yaml"), known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"config {raw!r} not found (not a file, and not a name in {root}){hint}\n"
        f"available: {', '.join(known) if known else '(none)'}"
    )


def config_display_name(path: Path) -> str:
    """``dt/hopper_medium`` for a packaged config, the file stem otherwise."""
    try:
        return path.resolve().relative_to(configs_root()).with_suffix("").as_posix()
    except ValueError:
        return path.stem


@dataclass(frozen=True)
class ConfigSummary:
    """One shipped config as ``rl-tformers configs`` lists it.

    Attributes:
        name: the ``--config`` name (``dt/hopper_medium``).
        agent: its ``agent.kind`` (with its ``_base_`` files), ``-`` when it sets none.
        data: what it trains on: ``dataset.path``, ``scripted TASK`` for generated data, ``online
            ENV_ID`` for an agent that acts in ``agent.env_id`` without a dataset, else ``-``.
        description: the first sentence of the file's header comment (:func:`config_header`).
        path: the file.
    """

    name: str
    agent: str
    data: str
    description: str
    path: Path

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "agent": self.agent, "data": self.data, "description": self.description,
                "path": str(self.path)}


#: The end of a sentence: a full stop before a capital (or ``%``, ``(``) or the end of the text,
#: not the one of "et al." or "e.g.".
_SENTENCE_END = re.compile(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\.(?=\s+[A-Z%(]|\s*$)")


def config_header(path: Path) -> str:
    """The prose of a config file's header comment, on one line: the ``#`` lines before its first
    key, up to an empty comment line or an indented one (a command, ``#   rl-tformers ...``)."""
    lines = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if not text.strip() or text.startswith("   "):
            break
        lines.append(text.strip())
    return " ".join(lines)


def config_summary(name: str) -> ConfigSummary:
    """The :class:`ConfigSummary` of the config ``name`` (a packaged name or a path), read with
    its ``_base_`` files; the description is the first sentence of the file's own header.

    Raises:
        ConfigError: the config is not found or cannot be read (:func:`load_yaml`).
    """
    path = resolve_config_path(name)
    node = OmegaConf.to_container(load_yaml(path), resolve=False)
    agent = node.get("agent") if isinstance(node.get("agent"), dict) else {}
    dataset = node.get("dataset") if isinstance(node.get("dataset"), dict) else {}
    if dataset.get("path"):
        data = str(dataset["path"])
    elif isinstance(dataset.get("scripted"), dict):
        data = f"scripted {dataset['scripted'].get('task', ScriptedDatasetConfig.task)}"
    elif agent.get("env_id"):
        data = f"online {agent['env_id']}"
    else:
        data = "-"
    header = config_header(path)
    first = _SENTENCE_END.search(header)
    description = header[:first.end()] if first else header
    return ConfigSummary(name=config_display_name(path), agent=str(agent.get("kind") or "-"), data=data,
                         description=description, path=path)


def load_yaml(path: Path, _stack: tuple[Path, ...] = ()) -> DictConfig:
    """Load one YAML config file, merged over the files its ``_base_`` key names (recursively).

    ``_base_`` is a name or a list of names resolved like ``--config`` but first relative to
    the including file's directory; later bases win over earlier ones, the file over all.

    Raises:
        ConfigError: naming the file for a YAML error, a non-mapping file, a bad ``_base_`` or
            a cycle of bases.
    """
    path = path.resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise ConfigError(f"{path}: _base_ cycle: {chain}")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - YAML scanner/parser errors have many types
        raise ConfigError(f"{path}: cannot parse YAML: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: a config file must be a mapping at the top level")
    bases = node.pop(BASE_KEY, None)
    if bases is None:
        return node
    if isinstance(bases, str):
        bases = [bases]
    elif not isinstance(bases, ListConfig) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: {BASE_KEY} must be a config name or a list of names")
    layers = [load_yaml(resolve_config_path(b, relative_to=path.parent), (*_stack, path)) for b in bases]
    return OmegaConf.merge(*layers, node)


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``["train.lr=3e-4", "backbone.attention.kind=performer"]`` -> a nested DictConfig.

    Raises:
        ConfigError: for an item without ``=`` or with an empty key.
    """
    items = list(overrides or ())
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. train.steps=1000){config_name_hint(item)}")
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override: {exc}") from exc
    except yaml.YAMLError as exc:  # a value that is not YAML, e.g. {lam:[1]} (YAML needs "lam: [1]")
        bad = next((item for item in items if not _parses(item)), ", ".join(items))
        problem = str(getattr(exc, "problem", None) or exc).strip().splitlines()[0]
        raise ConfigError(f"override {bad!r}: the value is not YAML ({problem})") from exc


def config_name_hint(item: str) -> str:
    """``; a config is given with -c: -c dt/hopper_medium`` when ``item`` (an override without
    ``=``) names a config file or resembles a packaged config's name (``hopper-medium``), else ''."""
    try:
        path = resolve_config_path(item)
    except ConfigError:
        path = None
    if path is not None:
        return f"; a config is given with -c: -c {item}"
    names = available_configs()
    wanted = item.strip().removesuffix(".yaml").replace("-", "_")
    by_leaf = [n for n in names if n.rsplit("/", 1)[-1] == wanted.rsplit("/", 1)[-1]]
    leaves = {n.rsplit("/", 1)[-1] for n in names}
    close = by_leaf or difflib.get_close_matches(wanted, names, n=2) or [
        n for leaf in difflib.get_close_matches(wanted, sorted(leaves), n=1) for n in names
        if n.rsplit("/", 1)[-1] == leaf]
    if not close:
        return ""
    return f"; a config is given with -c: {' or '.join(f'-c {n}' for n in close)}"


def _parses(item: str) -> bool:
    try:
        OmegaConf.from_dotlist([item])
    except (OmegaConfBaseException, yaml.YAMLError):
        return False
    return True


# -- composing -------------------------------------------------------------------------------------

def _defaults_layer() -> DictConfig:
    path = configs_root() / DEFAULTS_NAME
    return load_yaml(path) if path.is_file() else OmegaConf.create({})


def _keys_at(schema: DictConfig, dotted: str) -> list[str]:
    node: Any = schema
    for part in [p for p in dotted.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return []
        node = node[part]
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _translate(exc: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    full = str(getattr(exc, "full_key", "") or "")
    msg = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
    if isinstance(exc, ConfigKeyError) and full:
        parent, _, leaf = full.rpartition(".")
        keys = _keys_at(schema, parent)
        close = difflib.get_close_matches(leaf, keys, n=1)
        hint = f"; did you mean {(parent + '.' if parent else '') + close[0]}?" if close else ""
        where = f"{parent}" if parent else "the top level"
        return ConfigError(f"{full}: unknown key{hint} (keys of {where}: {', '.join(keys)}) [{source}]")
    return ConfigError(f"{full or '<config>'}: {_type_problem(msg) or msg} [{source}]")


#: How a value of each type OmegaConf names in its messages is described to the user.
_TYPE_WORDS = {"Integer": "an integer", "int": "an integer", "Float": "a number", "float": "a number",
               "Boolean": "true or false", "bool": "true or false", "String": "a string", "str": "a string",
               "ListConfig": "a list", "list": "a list", "DictConfig": "a mapping", "dict": "a mapping"}

#: OmegaConf's messages for a value of the wrong type, and their parts.
_TYPE_MESSAGES = (
    re.compile(r"^Value '(?P<value>.*)' of type '(?P<got>\w+)' could not be converted to (?P<want>\w+)$"),
    re.compile(r"^Value '(?P<value>.*)' is not a valid (?P<want>bool) \(type (?P<got>\w+)\)$"),
    re.compile(r"^Incompatible value '(?P<value>None)' for field of type '(?P<want>\w+)'$"),
    re.compile(r"^Cannot convert '(?P<got>\w+)' to (?P<want>string): '(?P<value>.*)'$"),
    re.compile(r"^Invalid value assigned: (?P<got>AnyNode) is not a (?P<want>ListConfig), .*$"),
)


def _type_problem(msg: str) -> str | None:
    """OmegaConf's message for a value of the wrong type as ``expected an integer, got 'abc'``;
    None for any other message."""
    for pattern in _TYPE_MESSAGES:
        m = pattern.match(msg)
        if m is None:
            continue
        parts = m.groupdict()
        want = _TYPE_WORDS.get(parts["want"], "a string" if parts["want"] == "string" else parts["want"])
        value, got = parts.get("value"), parts.get("got")
        if value == "None":
            return f"expected {want}, got null (this key takes no null)"
        if got == "AnyNode":
            return f"expected {want}, got a single value (write a list: [a, b])"
        if got in ("ListConfig", "DictConfig"):
            return f"expected {want}, got {_TYPE_WORDS[got]} {value}"
        return f"expected {want}, got {value!r}" if got in (None, "str") else f"expected {want}, got {value}"
    return None


def _merge_checked(base: DictConfig, layer: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as exc:
        raise _translate(exc, base, source) from exc
    except TypeError as exc:  # OmegaConf names no key when a list meets a mapping
        clash = _container_clash(base, layer)
        if clash is None:
            raise
        raise ConfigError(f"{clash} [{source}]") from exc


def _container_clash(base: Any, layer: Any, prefix: str = "") -> str | None:
    """Where ``layer`` puts a list on a mapping of ``base`` or a mapping on a list: ``"agent.knn
    must be a mapping (keys: lam, k, ...), got [1, 2]"``; None if it does not."""
    if not isinstance(base, DictConfig) or not isinstance(layer, DictConfig):
        return None
    for key in layer.keys():
        if key not in base:
            continue
        old, new, full = base._get_node(key), layer._get_node(key), f"{prefix}{key}"
        if isinstance(new, (DictConfig, ListConfig)) and new._is_none():
            continue
        if isinstance(old, DictConfig) and isinstance(new, ListConfig):
            keys = ", ".join(str(k) for k in old.keys())
            return f"{full} must be a mapping (keys: {keys}), got {OmegaConf.to_container(new)}"
        if isinstance(old, ListConfig) and isinstance(new, DictConfig):
            return f"{full} must be a list, got {OmegaConf.to_container(new)}"
        found = _container_clash(old, new, f"{full}.")
        if found is not None:
            return found
    return None


def _drop_replaced_slots(cfg: DictConfig, layer: Any, source: str = "") -> None:
    """A layer that changes a backbone slot's ``kind`` replaces the slot: the fields of the
    previous kind (e.g. GTrXL's default ``memory: {kind: xl, detach: true}``) do not carry over
    to the new kind, which starts from its own defaults plus the layer's fields.

    On the command line (``source == "command line"``) the dropped fields that the new kind
    also has are named in a warning: ``backbone.memory.kind=compressive`` over a config file's
    ``memory: {kind: xl, mem_len: 16, detach: true}`` does not keep ``mem_len: 16`` (compressive
    takes its own default), which a user would otherwise not see; ``detach``, a field
    compressive does not have, is dropped without a word (there is nothing to give again)."""

    bb = layer.get("backbone") if isinstance(layer, (DictConfig, Mapping)) else None
    if not isinstance(bb, (DictConfig, Mapping)):
        return
    for slot in SLOTS:
        new, old = bb.get(slot), cfg.backbone.get(slot)
        if (isinstance(new, (DictConfig, Mapping)) and "kind" in new and isinstance(old, (DictConfig, Mapping))
                and old.get("kind") != new.get("kind")):
            kind = new.get("kind")
            takes = set(REGISTRIES[slot].get(kind).fields()) if kind in REGISTRIES[slot] else None
            dropped = {k: v for k, v in old.items() if k != "kind" and k not in new and (takes is None or k in takes)}
            if dropped and source == "command line":
                fields = ", ".join(f"{k}={v}" for k, v in dropped.items())
                warnings.warn(f"backbone.{slot}.kind: {old.get('kind')!r} -> {new.get('kind')!r} replaces the slot; "
                              f"the fields set for {old.get('kind')!r} are dropped ({fields}) and "
                              f"{new.get('kind')!r} takes its own defaults; give them again "
                              f"(backbone.{slot}.KEY=VALUE) to set them", UserWarning, stacklevel=2)
            cfg.backbone[slot] = {"kind": new["kind"]}


def _check_dataset_layer(layer: Any, source: str) -> None:
    """Check a layer's ``dataset:`` section against :class:`DatasetConfig` (unknown key with a
    'did you mean', wrong type), naming the dotted key and ``source``.

    Raises:
        ConfigError: as :func:`_translate` words it.
    """
    if not isinstance(layer, DictConfig) or "dataset" not in layer:
        return
    section = layer.get("dataset")
    if section is None:
        return
    # scripted filled in so that a message about dataset.scripted.* can list its keys
    schema = OmegaConf.structured(_DatasetSection(DatasetConfig(scripted=ScriptedDatasetConfig())))
    try:
        OmegaConf.merge(schema, OmegaConf.create({"dataset": section}))
    except OmegaConfBaseException as exc:
        raise _translate(exc, schema, source) from exc


def _agent_kind(user: DictConfig) -> str:
    agent = user.get("agent")
    if agent is not None and not isinstance(agent, DictConfig):
        raise ConfigError(f"agent must be a mapping with a kind key (e.g. agent: {{kind: dt}}), got "
                          f"{_plain_value(agent)!r}; registered kinds: {', '.join(available_agents())}")
    kind = agent.get("kind") if isinstance(agent, DictConfig) and not OmegaConf.is_missing(agent, "kind") else None
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"agent.kind must be the name of a registered kind ({', '.join(available_agents())}), "
                          f"got {_plain_value(kind)!r}")
    if kind is None:
        raise ConfigError(
            f"agent.kind is required (set it in the config file or as agent.kind=...); "
            f"registered kinds: {', '.join(available_agents())}"
        )
    return kind


def _plain_value(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _plugins_of(user: DictConfig) -> list:
    """The user layers' ``plugins`` value, read before the schema checks it (it must be imported
    first: it may register the agent kind and backbone kinds the rest is checked against)."""
    value = user.get("plugins")
    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value, resolve=False)
    return check_plugin_names(value, "plugins")


def compose(
    config: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    start: Mapping[str, Any] | DictConfig | None = None,
) -> DictConfig:
    """Build the full, validated, resolved run config (layers in the module docstring).

    Args:
        config: a YAML path or a packaged config name (``dt/hopper_medium``), or None.
        overrides: dotted ``key=value`` strings.
        start: a complete config (e.g. a checkpoint's) used instead of ``config`` as layer 4.

    Returns:
        A read-only DictConfig. ``cfg.train.schedule`` and ``cfg.train.amp`` are :class:`Enum`
        members (``.value`` is the string); everything else is plain YAML data.

    Raises:
        ConfigError: unknown key or wrong type (naming the dotted path), missing
            ``agent.kind``, unknown agent kind (listing the registered ones), invalid backbone
            (naming the backbone field), unresolvable interpolation, file not found, a value
            out of range (e.g. ``train.steps``, ``eval.episodes`` or ``eval.n_envs`` < 1; named),
            a ``plugins`` module that is not found or fails to import (named).
    """
    user_layers = _user_layers(config, overrides, start)
    user = OmegaConf.create({})
    for layer, source in user_layers:  # a list meeting a mapping is named (backbone.layers.1.x=... over a list)
        user = _merge_checked(user, layer, source)

    plugin_names = _plugins_of(user)  # null counts as empty, repeats are dropped (what is recorded)
    load_plugins(plugin_names, "plugins")  # before the agent and the backbone kinds are looked up
    for layer, _ in user_layers:
        if "plugins" in layer and layer.plugins is None:  # `plugins:` left empty in a YAML file, plugins=null
            layer.plugins = []
    kind = _agent_kind(user)
    entry = get_agent(kind)  # raises UnknownAgentError (a ConfigError) listing registered kinds

    cfg = _defaults_of(kind, entry)
    for layer, source in user_layers:
        if source != "saved config":  # a saved run's config was checked when the run started
            _check_dataset_layer(layer, source)
        _drop_replaced_slots(cfg, layer, source)
        cfg = _merge_checked(cfg, layer, source)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise _translate(exc, cfg, "interpolation") from exc
    if "plugins" in user:
        cfg.plugins = plugin_names
    _validate_values(cfg, entry)
    _check_agent_section(cfg, entry)
    try:  # auto -> the library this machine runs, measured on the checked config's shapes and
        # recorded in the run's config (resume keeps it)
        cfg.cpu_matmul = resolve_cpu_matmul(cfg.cpu_matmul, cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _user_layers(config: str | os.PathLike | None, overrides: Sequence[str],
                 start: Mapping[str, Any] | DictConfig | None) -> list[tuple[Any, str]]:
    """The user's layers of :func:`compose` with their sources, in merge order: the config file
    (or the starting config, ``"saved config"``), then the overrides (``"command line"``).

    Raises:
        ConfigError: both ``config`` and ``start`` given, a config not found, bad overrides.
    """
    if config is not None and start is not None:
        raise ConfigError("give either a config file or a starting config, not both")
    user_layers: list[tuple[Any, str]] = []
    if config is not None:
        path = resolve_config_path(config)
        user_layers.append((load_yaml(path), str(path)))
    elif start is not None:
        saved = OmegaConf.create(start if isinstance(start, DictConfig) else dict(start))
        user_layers.append((saved, "saved config"))
    if overrides:
        user_layers.append((parse_overrides(overrides), "command line"))
    return user_layers


def _defaults_of(kind: str, entry: AgentEntry) -> DictConfig:
    """The layers below the user's: the schema, ``defaults.yaml`` and the agent kind's registered
    defaults, with the sections the user may add keys to left open (``agent`` only when the
    kind checks it with a typed config or declares no keys)."""
    cfg = OmegaConf.structured(RunConfig)
    cfg = _merge_checked(cfg, _defaults_layer(), str(configs_root() / DEFAULTS_NAME))
    if entry.defaults:
        cfg = _merge_checked(cfg, OmegaConf.create(dict(entry.defaults)), f"defaults of agent {kind!r}")
    # a kind with a typed config checks its section after the merge (unknown keys included);
    # one that declares its keys with registered defaults only gets a closed section
    agent_closed = bool(entry.defaults and "agent" in entry.defaults) and entry.config_cls is None
    OmegaConf.set_struct(cfg.agent, agent_closed)
    for key in FREE_FORM_AGENT_KEYS:  # closed agent sections keep these open (a struct flag is inherited)
        if isinstance(cfg.agent.get(key), DictConfig):
            OmegaConf.set_struct(cfg.agent[key], False)
    OmegaConf.set_struct(cfg.dataset, False)
    OmegaConf.set_struct(cfg.backbone, False)
    return cfg


def _check_agent_section(cfg: DictConfig, entry: AgentEntry) -> None:
    """Check the resolved ``agent`` section with the kind's typed config, or else against the
    types of its registered defaults.

    Raises:
        ConfigError: the typed config refuses a value (its message names the option).
    """
    if entry.config_cls is not None:
        try:
            entry.agent_options(OmegaConf.to_container(cfg.agent, resolve=True))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    elif entry.defaults and isinstance(entry.defaults.get("agent"), Mapping):
        _check_agent_types(OmegaConf.to_container(cfg.agent, resolve=True), entry.defaults["agent"], "agent")


def _check_agent_types(values: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> None:
    """Refuse agent options whose value has another type than the agent's default for them.

    The agent section is plain YAML (its defaults are a dict, not a schema), so without this an
    ``agent.burn_in=1.5`` would be truncated to 1, ``agent.window=true`` would become 1 and
    ``agent.prev_action=maybe`` True, silently. An integer default takes an integer
    (not a boolean), a boolean default a boolean, a float default a finite number (not a
    boolean); options whose default is ``None``, a string or a list are the agent's to check.

    Raises:
        ConfigError: naming the dotted option, the value and the type it needs.
    """

    for key, default in defaults.items():
        if key not in values:
            continue
        value, name = values[key], f"{where}.{key}"
        if isinstance(default, Mapping):
            if isinstance(value, Mapping):
                _check_agent_types(value, default, name)
            elif value is not None:
                raise ConfigError(f"{name} must be a mapping of options ({', '.join(map(str, default))}), got {value!r}")
            continue
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")


def _check_device_options(t: DictConfig, device_type: str, device: str) -> None:
    """Refuse the ``train`` options that do not apply to the run's device or to each other."""
    if t.cuda_graphs and device_type != "cuda":
        raise ConfigError(f"train.cuda_graphs=true captures the update in CUDA graphs and needs a CUDA device, "
                          f"but device={device} is {device_type}; set train.cuda_graphs=false")
    if t.data_on_device and t.num_workers > 0:
        raise ConfigError(f"train.data_on_device=true draws batches on the device in the training process; "
                          f"train.num_workers={t.num_workers} would start DataLoader workers for nothing: "
                          f"set train.num_workers=0")


#: Agent options whose value is a free-form mapping passed on to another library (keyword
#: arguments of ``gymnasium.make``): any key is accepted inside them, even in a closed section.
FREE_FORM_AGENT_KEYS = ("env_kwargs",)


def _validate_values(cfg: DictConfig, entry=None) -> None:

    t = cfg.train
    _check_ranges(RunConfig, {"seed": cfg.seed}, "")
    if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):  # NaN is in no range
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {list(t.betas)}")
    _check_ranges(TrainConfig, t, "train.")
    _check_ranges(EvalConfig, cfg.eval, "eval.")
    scripted = cfg.dataset.get("scripted") if isinstance(cfg.dataset, DictConfig) else None
    if isinstance(scripted, DictConfig):
        _check_ranges(ScriptedDatasetConfig, scripted, "dataset.scripted.")
    if t.lr * t.weight_decay >= 1.0:
        raise ConfigError(f"train.weight_decay={t.weight_decay:g} with train.lr={t.lr:g}: AdamW multiplies the "
                          f"decayed weights by 1 - lr * weight_decay = {1.0 - t.lr * t.weight_decay:g} every update, "
                          f"which zeroes or flips them; lr * weight_decay must be < 1")
    try:
        device = resolve_device(cfg.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    _check_device_options(t, device.type, str(cfg.device))

    backbone = OmegaConf.to_container(cfg.backbone, resolve=True)
    check_backbone_kinds(backbone)
    try:
        bb = BackboneConfig.from_dict(backbone)
    except (RegistryError, ValueError, TypeError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("backbone") else f"backbone: {msg}") from exc
    if entry is not None and entry.check_backbone is not None:  # the agent's own refusals and advice first
        try:
            entry.check_backbone(bb)
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from exc
    try:
        check_compatible(bb)
    except (RegistryError, ValueError, TypeError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("backbone") else f"backbone: {msg}") from exc


def _check_ranges(cls: type, values: Any, prefix: str) -> None:
    """Hold every numeric field of the section ``values`` to the bounds its ``cls`` field declares
    (:func:`~rl_tformers.typed_config.option`'s ``ge``/``gt``/``le``/``lt``); a float must also be
    finite (``train.lr=inf``, ``train.eps=.nan``). A list's items are held to them (``train.betas``);
    null passes (``train.grad_clip=null``).

    Raises:
        ConfigError: ``"train.eps must be a finite number > 0, got 0.0"``, ``"train.steps must be
            >= 1, got 0"``, or the seed's range (the one ``torch.manual_seed`` takes).
    """
    for f in dataclasses.fields(cls):
        rng = range_words(f.metadata)
        if not rng or f.name not in values:
            continue
        value, key = values[f.name], prefix + f.name
        items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
        for v in items:
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            ok = (math.isfinite(v) if isinstance(v, float) else True) and (
                ("ge" not in f.metadata or v >= f.metadata["ge"]) and ("gt" not in f.metadata or v > f.metadata["gt"])
                and ("le" not in f.metadata or v <= f.metadata["le"]) and ("lt" not in f.metadata or v < f.metadata["lt"]))
            if ok:
                continue
            shown = list(value) if len(items) > 1 or not isinstance(v, type(value)) else value
            if f.name == "seed":
                raise ConfigError(f"{key} must be an integer in [0, 2**64 - 1] (the range torch.manual_seed takes), "
                                  f"got {shown}")
            kind = "a finite number " if "float" in str(f.type) else ""
            raise ConfigError(f"{key} must be {kind}{rng}, got {shown}")


def check_resume_changes(saved: DictConfig, new: DictConfig) -> list[str]:
    """Differences between a run's saved config and the config it is resumed with.

    Values are compared as the run uses them: a backbone slot field set on one side only
    (``backbone.attention.orthogonal=true`` over a Performer run that left it unset) takes the
    default of the slot's kind on the other side, and any other key missing on one side (a run
    saved before the option existed) takes the value composing that side gives it
    (:func:`with_defaults`), so setting a field to the value the run already used is no change.

    Returns:
        ``["train.steps: 1000 -> 2000", ...]`` for keys in :data:`RESUMABLE_KEYS`.

    Raises:
        ConfigError: if any other key differs (the run would not continue the same trajectory);
            the message names every such key.
    """
    changes, refused = [], []
    for key, before, after in config_value_differences(to_container(saved), to_container(new)):
        line = f"{key}: {before} -> {after}"
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
            changes.append(line)
        else:
            refused.append(line)
    if refused:
        raise ConfigError(
            "these keys cannot change when resuming (the run would no longer continue exactly; start a new "
            "run instead):\n  " + ";\n  ".join(refused) + f".\nKeys that may change: {', '.join(RESUMABLE_KEYS)}"
        )
    return changes


_NO_DEFAULT = object()


def with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a run's saved config, as a plain dict) with every key it lacks set as
    :func:`compose` sets it today: the defaults of options added after the run was saved. A new
    option's default keeps the behaviour the code had before the option existed, so the filled
    config describes what the saved run ran. A config that no longer composes is returned as it is.
    """
    try:
        return to_container(compose(start=config))
    except ConfigError:
        return dict(config)


def config_value_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[(dotted key, value in a, value in b), ...]`` for every key whose value differs, as the
    runs use them: a backbone slot field set on one side only takes its kind's default on the
    other; any other key missing on one side takes the value :func:`with_defaults` gives it
    there; a key still missing shows as ``<unset>``. ``a`` and ``b`` are plain nested dicts."""
    fa, fb = flatten(a), flatten(b)
    filled: dict[str, dict[str, Any]] = {}

    def value(flat: dict[str, Any], side: str, source: Mapping[str, Any], key: str) -> Any:
        if key in flat:
            return flat[key]
        default = _slot_field_default(key, fa, fb)
        if default is not _NO_DEFAULT:
            return default
        if side not in filled:
            filled[side] = flatten(with_defaults(source))
        return filled[side].get(key, "<unset>")

    out = []
    for key in sorted(set(fa) | set(fb)):
        before, after = value(fa, "a", a, key), value(fb, "b", b, key)
        if before != after:
            out.append((key, before, after))
    return out


def _slot_field_default(key: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> Any:
    """The default of ``backbone.<slot>.<field>`` when both flat configs ``a`` and ``b`` use
    the same kind in that slot (set, or the slot's default kind) and that kind has the field;
    ``_NO_DEFAULT`` otherwise (not a slot field, the kinds differ, an unknown kind or field)."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "backbone" or parts[2] == "kind":
        return _NO_DEFAULT


    slot, name = parts[1], parts[2]
    if slot not in SLOTS:
        return _NO_DEFAULT
    default_kind = next(f.default_factory().kind for f in dataclasses.fields(BackboneConfig)  # type: ignore[misc]
                        if f.name == slot)
    kind = a.get(f"backbone.{slot}.kind", default_kind)
    if kind != b.get(f"backbone.{slot}.kind", default_kind) or kind not in REGISTRIES[slot]:
        return _NO_DEFAULT
    return REGISTRIES[slot].get(str(kind)).fields().get(name, _NO_DEFAULT)


# -- output ------------------------------------------------------------------------------------------

def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict (enums as their string values)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text (what ``config.yaml`` and checkpoints store)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_container(cfg)))


def display_yaml(cfg: DictConfig) -> str:
    """The resolved config as ``rl-tformers train --print-config`` shows it.

    :func:`to_yaml`, with the ``backbone`` section as it will be built: every
    :class:`~rl_tformers.backbone_config.BackboneConfig` field, and in each slot every field of the chosen
    kind with its default (``memory: {kind: compressive}`` shows ``mem_len``, ``compressed_len``,
    ``rate``...). Only for agent kinds that build a backbone (they register backbone defaults;
    ``bc``'s unused section stays as it is). ``config.yaml`` and checkpoints keep the fields
    that were set (:func:`to_yaml`): resume and sweeps compare a saved config with a newly
    composed one, which then differ in what was set only, not in the slot defaults of the
    build that composes them.
    """
    data = to_container(cfg)
    if "backbone" in get_agent(str(cfg.agent.kind)).defaults:
        data["backbone"] = BackboneConfig.from_dict(data["backbone"]).to_dict()
    return OmegaConf.to_yaml(OmegaConf.create(data))


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}``; lists stay values, empty dicts vanish."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def default_run_dir(cfg: DictConfig, config_name: str | None = None, root: str | os.PathLike = "runs") -> Path:
    """``runs/<config name or agent kind>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... if taken)."""
    stem = (config_name or str(cfg.agent.kind)).replace("/", "-")
    base = Path(root) / f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


def schema_defaults() -> dict[str, Any]:
    """The schema's default values as a plain dict (``configs/defaults.yaml`` mirrors it)."""
    return to_container(OmegaConf.structured(RunConfig))


__all__ = [
    "Amp", "ConfigError", "DatasetConfig", "EvalConfig", "RESUMABLE_KEYS", "RunConfig", "Schedule",
    "ScriptedDatasetConfig", "TrainConfig",
    "available_configs", "check_backbone_kinds", "check_resume_changes", "compose", "config_display_name", "configs_root",
    "default_run_dir", "display_yaml", "flatten", "load_yaml", "parse_overrides", "resolve_config_path", "schema_defaults",
    "to_container", "to_yaml",
]
