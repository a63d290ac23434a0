"""Online Decision Transformer fine-tuning (Zheng, Zhang & Grover 2022, "Online Decision
Transformer", ICML; ``agent.kind=odt``).

Starts from an offline DT run trained with the stochastic head (``agent.head=gaussian``:
tanh-squashed Gaussian, learned entropy temperature, :func:`~.loss.dt_loss`) and goes on training
it on its own rollouts. Read top to bottom, a run is::

    state   = checkpoint of agent.init_from (a dt run dir or checkpoint file)  # weights, obs stats, reward scale
    buffer  = top agent.online.buffer_size episodes of dataset.path by return  # whole trajectories, FIFO
    round r (before update r * U, U = agent.online.updates_per_round):
        episodes = agent.online.rollouts_per_round complete episodes of the *sampled* policy,
                   conditioned on agent.online.target_return (g_online; null: t + |t| of the evaluation
                   target t, i.e. 2t when t >= 0), batched over
                   agent.online.n_envs vector environments, seeded derive_seed(seed, "online", r)
        buffer.add(episodes)        # each new trajectory replaces the oldest one once full
                                    # (rollouts_per_round=0: no episodes, the offline-continuation control)
    batch s = WindowSampler(buffer).sample(B, default_rng([seed, s]))  # the DT's windows
    loss    = dt_loss(model, to_model_batch(batch))                   # NLL - temperature * entropy

**Hindsight return relabelling** (paper, section 4.1): a stored trajectory keeps its achieved
rewards only; its returns-to-go are computed from them by the data layer's
:func:`~rl_tformers.envs.trajectory.returns_to_go` (through the sampler, as for the offline data
and as the evaluation's ``R_{t+1} = R_t - r_t`` reproduces), never from the target it was
conditioned on.

**Buffer** (:class:`TrajectoryBuffer`): the offline episodes are ranked by return (equal
returns: the earlier dataset episode ranks higher) and the best ``buffer_size`` are kept; the
FIFO order runs from the worst kept to the best, so online trajectories replace the worst
offline ones first (as the official code's ``ReplayBuffer``), then the oldest online ones.
Windows are drawn as the DT draws them: a trajectory with probability proportional to its
length, K = the offline run's ``agent.context_len``, the same alignment, padding and mask.

**Acting**: :class:`~.policy.DTPolicy` with ``sample=True`` (one batched forward pass per step for
all environments; the action is ``tanh(mean + std * eps)`` with ``eps`` from a dedicated
``torch.Generator`` seeded with the round's seed) in ``eval()`` mode under ``no_grad``; the
model goes back to ``train()`` for the updates. An episode is cut (truncated) at the offline
run's ``agent.max_ep_len`` steps (the timestep embedding has no later entry). Episode j of a
round runs in environment j mod N with reset seed ``derive_seed(seed, "online", r) % 2**31 + j``
(the evaluation's unbiased scheme). Evaluation and ``rl-tformers eval`` act with the mean, as
the DT does.

**Resume** is bit-identical to an uninterrupted run, stopped anywhere: the batch for update s is a
pure function of ``(seed, s, buffer)``, the buffer (offline episodes by dataset index, online
ones as arrays) is saved in every checkpoint (:meth:`ODTAgent.process_state`) and the round and
environment-step counters in ``extra_state``; a round is a pure function of the weights and its
seed, so a run resumed at a round boundary collects the same episodes. A resume needs the same
dataset (checked: the buffer's offline episodes must have their saved returns), but not the
offline run: the agent is rebuilt from the checkpoint alone (model options and backbone saved in
``extra.odt``, data statistics, weights; the builder gets the checkpoint through
:func:`rl_tformers.runtime.agent_registry.resume_state`), so ``agent.init_from`` may since have been
retrained, moved or deleted, or be a relative path that does not resolve from the resume's folder.

**Checks up front** (when the agent is built, before anything is trained): a dataset episode
longer than the offline run's ``agent.max_ep_len`` is refused by its dataset index, and an
evaluation environment whose time limit exceeds it is warned about (:func:`warn_time_limit`).

**Offline-continuation control** (``agent.online.rollouts_per_round=0``): every round collects
nothing, so the run trains the same model with the same objective, optimiser and schedule on the
same buffer (the top ``buffer_size`` offline episodes) and never acts except in evaluation: what
fine-tuning gains over simply training longer is the difference between the two runs. No
exploration environment is built; ``env_steps`` stays 0.

Cannot: run under DDP (``--nproc > 1`` is refused before any process starts: the kind registers
with ``single_process=True``), fine-tune a deterministic-head or discrete-action run, or update
the temperature with its own optimiser (it is a model parameter trained by the shared AdamW, as
in the offline phase). The acting context can be shorter than K (``agent.eval_context_len``, as
the paper does on Hopper), in rollouts and evaluation alike.

Logged (``train/...``, their latest value, not a window mean): ``env_steps`` (online steps so
far), ``online_return`` / ``online_length`` (mean achieved return / length of the latest
round's episodes, raw reward units / steps), ``rounds``, ``buffer_trajectories``,
``buffer_steps``; plus :func:`~.loss.dt_loss`'s ``nll``, ``entropy`` (nats) and ``temperature``.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import yaml
from omegaconf import OmegaConf
from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset, plain
from rl_tformers.agents.decision_transformer.agent import (
    DT_DEFAULTS,
    DTAgent,
    to_model_batch,
    warn_time_limit,
)
from rl_tformers.agents.decision_transformer.config import DTAgentConfig, ODTAgentConfig
from rl_tformers.agents.decision_transformer.loss import dt_loss
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.samplers import WindowSampler
from rl_tformers.envs.trajectory import ObsStats
from torch import Tensor

from rl_tformers.backbone_config import BackboneConfig, ConfigAdviceWarning
from rl_tformers.runtime.agent_registry import register_agent, resume_state
from rl_tformers.runtime.checkpoint import CheckpointError, find_latest_valid, load_checkpoint
from rl_tformers.runtime.distributed import dist_info
from rl_tformers.runtime.evaluation import run_episodes, with_raw_reward
from rl_tformers.runtime.loading import register_inference_loader
from rl_tformers.runtime.plugins import check_source_plugins
from rl_tformers.runtime.seeding import derive_seed

log = logging.getLogger(__name__)

#: format of :meth:`TrajectoryBuffer.state_dict` (another one is refused on resume)
BUFFER_STATE_VERSION = 1

#: Registered defaults of ``agent.kind=odt`` (its ``agent`` section: :class:`ODTAgentConfig`'s)
ODT_DEFAULTS: dict[str, Any] = {"agent": ODTAgentConfig().to_dict(), "backbone": copy.deepcopy(DT_DEFAULTS["backbone"])}
ODT_DEFAULTS["train"] = {
    "batch_size": 64, "lr": 1.0e-4, "weight_decay": 5.0e-4, "grad_clip": 0.25,
    "schedule": "constant", "warmup_steps": 0, "steps": 3000,
}
ODT_DEFAULTS["eval"] = {"episodes": 10, "n_envs": 10}

#: ``agent.*`` options that fine-tuning takes from the offline run (its model and data statistics)
OFFLINE_AGENT_KEYS = (
    "context_len", "max_ep_len", "mode", "align", "head", "embed_dropout", "embed_init", "log_std_min",
    "log_std_max", "init_temperature", "target_entropy", "reward_scale", "normalize_obs", "env_id", "env_kwargs",
    "encoder",
)


#: the DT's default options (a saved run's config without one of the offline keys takes it)
DT_OPTIONS = DTAgentConfig()


def offline_default(key: str) -> Any:
    """The DT's default of offline option ``key`` as a saved config holds it (a typed sub-config,
    such as ``encoder``, as its ``{"kind": ..., **fields}`` dict)."""
    value = getattr(DT_OPTIONS, key)
    return value.to_dict() if hasattr(value, "to_dict") else value


def default_online_target(t: float) -> float:
    """g_online when ``agent.online.target_return`` is null: ``t + |t|`` for the evaluation target ``t``.

    That is ``2 t`` for ``t >= 0`` (the paper's Hopper: 7200 = 2 x 3600) and 0 for ``t < 0``, so
    exploration is never conditioned *below* the evaluation target (``2 t`` would be, for a
    negative return such as Pendulum's). Raw reward units. Examples: 3600 -> 7200, -100 -> 0.
    """
    t = float(t)
    return t + abs(t)


def read_offline_run(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Checkpoint and config of the offline DT run that ``agent.init_from`` names.

    Args:
        path: a run directory (its newest valid checkpoint) or a checkpoint file.

    Returns:
        ``(state, config)``: the verified checkpoint dict and its run config as plain dicts.

    Raises:
        ValueError: naming ``agent.init_from``: no such path, no valid checkpoint, a run of
            another agent kind than ``dt``, a run on discrete actions, or one trained with
            another head than ``agent.head=gaussian``.
    """


    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"agent.init_from={path}: no such run directory or checkpoint file; train the offline Decision "
            f"Transformer there first with the stochastic head, e.g. `rl-tformers train -c dt/hopper_medium "
            f"agent.head=gaussian --run-dir {path}`")
    try:
        state = find_latest_valid(p).state if p.is_dir() else load_checkpoint(p)
    except CheckpointError as exc:
        raise ValueError(f"agent.init_from={path}: {exc}") from exc
    saved = yaml.safe_load(state["config"])
    sa = saved.get("agent") or {}
    if sa.get("kind") != "dt":
        raise ValueError(f"agent.init_from={path}: Online DT fine-tunes an offline Decision Transformer run "
                         f"(agent.kind=dt), got agent.kind={sa.get('kind')!r}")
    extra = state.get("extra") or {}
    if bool(extra.get("discrete")):
        raise ValueError(
            f"agent.init_from={path}: that run's actions are discrete (dataset.path={extra.get('dataset')}); "
            f"Online DT explores with draws of the tanh-squashed Gaussian head (agent.head=gaussian), which "
            f"needs continuous (Box) actions")
    head = sa.get("head", "deterministic")
    if head != "gaussian":
        raise ValueError(
            f"agent.init_from={path} was trained with agent.head={head!r}; Online DT fine-tunes the stochastic "
            f"head: train the offline run with agent.head=gaussian (e.g. `rl-tformers train -c dt/hopper_medium "
            f"agent.head=gaussian`)")
    return state, saved


def _flat(d: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}.{k}"))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def fine_tune_changes(configured: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The ``agent.*`` model/data options and ``backbone.*`` settings of the config that
    fine-tuning ignores because it takes them from the offline run.

    Args:
        configured: the run config (plain dict: ``agent``, ``backbone``).
        saved: the offline run's config (plain dict).

    Returns:
        ``["agent.context_len=10 (the checkpoint's: 20)", "backbone.d_model=64 (...: 128)", ...]``,
        empty when they agree.
    """

    ca, sa = configured.get("agent") or {}, saved.get("agent") or {}
    out = []
    for k in OFFLINE_AGENT_KEYS:
        want, have = ca.get(k), sa.get(k, offline_default(k))
        if want != have:
            out.append(f"agent.{k}={want!r} (the checkpoint's: {have!r})")
    want_b = _flat(BackboneConfig.from_dict(configured.get("backbone") or {}, where="backbone").to_dict(), "backbone")
    have_b = _flat(BackboneConfig.from_dict(saved.get("backbone") or {}, where="backbone of agent.init_from").to_dict(),
                   "backbone")
    out += [f"{k}={want_b.get(k)!r} (the checkpoint's: {have_b.get(k)!r})" for k in sorted(set(want_b) | set(have_b))
            if want_b.get(k) != have_b.get(k)]
    return out


def effective_config(cfg: Any, agent_keys: Mapping[str, Any], backbone: Mapping[str, Any]) -> Any:
    """The run config with the offline run's model/data options and backbone (what the DT is built from)."""

    c = plain(cfg) if not isinstance(cfg, dict) else copy.deepcopy(cfg)
    c["agent"].update(copy.deepcopy(dict(agent_keys)))
    c["backbone"] = copy.deepcopy(dict(backbone))
    out = OmegaConf.create(c)
    OmegaConf.set_readonly(out, True)
    return out


# -- the replay buffer --------------------------------------------------------------------------

def top_episodes(returns: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` best episodes by return, in FIFO order (worst kept first, best last).

    Ranking: return, then dataset position (of equal returns the earlier episode ranks higher, so
    it is kept at the cut and is replaced later).

    Args:
        returns: (E,) episode returns.
        n: how many to keep (all when ``n >= E``).

    Returns:
        (min(n, E),) int64 episode indices, ascending in rank. Example: returns ``[5, 9, 5, 1]``,
        n = 3 -> ``[2, 0, 1]``.
    """
    r = np.asarray(returns, np.float64)
    order = np.lexsort((-np.arange(r.size), r))  # ascending return; equal returns: later index first
    return order[max(0, r.size - int(n)):].astype(np.int64)


class TrajectoryBuffer:
    """FIFO replay buffer of whole trajectories (Online DT, section 4.1).

    Entries are offline episodes (by their index in ``dataset``; their arrays are read once) or
    online ones (arrays). :meth:`dataset` is the buffer as an :class:`EpisodeDataset` in FIFO
    order (oldest first), which the DT's :class:`~rl_tformers.envs.samplers.WindowSampler` samples
    and whose returns-to-go it computes from the stored rewards (hindsight relabelling).

    Args:
        dataset: the offline dataset.
        capacity: most trajectories held (``agent.online.buffer_size``).

    An online episode is a dict: ``observations (L, *obs_shape)``, ``actions (L, *act_shape)``
    (environment units), ``rewards (L,)`` float64 raw, ``terminated`` bool (else truncated).
    """

    def __init__(self, dataset: EpisodeDataset, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"agent.online.buffer_size must be >= 1, got {capacity}")
        self.offline = dataset
        self.capacity = int(capacity)
        self.obs_dtype = np.dtype(dataset.observations.dtype)
        self.act_dtype = np.dtype(dataset.actions.dtype)
        self._offline_cache: dict[int, tuple[np.ndarray, ...]] = {}
        #: (source, value): ("offline", dataset index) or ("online", episode dict), oldest first
        self.entries: deque[tuple[str, Any]] = deque()
        for i in top_episodes(dataset.episode_returns, self.capacity).tolist():
            self.entries.append(("offline", int(i)))
        self._ds: EpisodeDataset | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, episodes: Sequence[Mapping[str, Any]]) -> None:
        """Append ``episodes`` (newest last); once full, each one replaces the oldest entry."""
        for ep in episodes:
            self.entries.append(("online", self._online(ep)))
            while len(self.entries) > self.capacity:
                source, value = self.entries.popleft()
                if source == "offline":
                    self._offline_cache.pop(value, None)
        self._ds = None

    def _online(self, ep: Mapping[str, Any]) -> dict[str, Any]:
        d = self.offline
        obs = np.asarray(ep["observations"], self.obs_dtype).reshape(-1, *d.observation_shape)
        act = np.asarray(ep["actions"], self.act_dtype).reshape(-1, *d.action_shape)
        rew = np.asarray(ep["rewards"], np.float64).reshape(-1)
        if not (obs.shape[0] == act.shape[0] == rew.shape[0] >= 1):
            raise ValueError(f"TrajectoryBuffer: an episode needs L >= 1 observations, actions and rewards, got "
                             f"{obs.shape[0]}, {act.shape[0]}, {rew.shape[0]}")
        return {"observations": obs, "actions": act, "rewards": rew, "terminated": bool(ep["terminated"])}

    def _arrays(self, source: str, value: Any) -> tuple[np.ndarray, ...]:
        """(obs, actions, rewards, terminations, truncations) of one entry."""
        if source == "online":
            n = value["rewards"].shape[0]
            last = np.eye(1, n, n - 1, dtype=bool)[0]
            return (value["observations"], value["actions"], value["rewards"],
                    last & value["terminated"], last & (not value["terminated"]))
        if value not in self._offline_cache:
            e = self.offline.episode(value)
            self._offline_cache[value] = (np.asarray(e.observations, self.obs_dtype), np.asarray(e.actions, self.act_dtype),
                                          np.asarray(e.rewards, np.float64), np.asarray(e.terminations, bool),
                                          np.asarray(e.truncations, bool))
        return self._offline_cache[value]

    @property
    def num_steps(self) -> int:
        """Steps over every trajectory held."""
        return self.dataset().num_steps

    def dataset(self) -> EpisodeDataset:
        """The buffer as an :class:`EpisodeDataset`, oldest trajectory first (rebuilt after a change)."""
        if self._ds is None:
            parts = [self._arrays(s, v) for s, v in self.entries]
            lengths = np.array([p[2].shape[0] for p in parts], np.int64)
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
            d = self.offline
            self._ds = EpisodeDataset(
                *(np.concatenate([p[k] for p in parts]) for k in range(5)), starts, lengths,
                observation_space=d.observation_space, action_space=d.action_space, metadata=d.metadata,
                validate=False)  # offline rows were validated by the loader, online ones checked when collected
        return self._ds

    def returns(self) -> np.ndarray:
        """(len,) undiscounted return of each trajectory, oldest first (raw units)."""
        return self.dataset().episode_returns

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Checkpoint-safe state: the FIFO order (dataset index, or -1 for the next online episode),
        the online episodes' arrays concatenated, and the offline entries' returns (checked on load).

        Every tensor is a fresh row-major copy (also when empty: no offline entry left, or no
        online one yet): ``order (len,)`` int64, ``offline_returns (offline entries,)`` float64,
        ``online.observations (steps, *obs_shape)``, ``online.actions (steps, *act_shape)``,
        ``online.rewards (steps,)`` float64, ``online.lengths (online entries,)`` int64,
        ``online.terminated (online entries,)`` bool.
        """
        order, online = [], []
        for source, value in self.entries:
            order.append(value if source == "offline" else -1)
            if source == "online":
                online.append(value)
        offline_idx = np.asarray([v for s, v in self.entries if s == "offline"], np.int64)

        def t(a: np.ndarray) -> Tensor:  # a fresh row-major tensor: no view of the buffer, no odd strides
            src = torch.from_numpy(np.asarray(a))  # (an empty fancy index has stride 0 in NumPy)
            return torch.empty(src.shape, dtype=src.dtype).copy_(src)

        def cat(key: str, dtype, shape) -> Tensor:
            if not online:
                return t(np.zeros((0, *shape), dtype))
            return t(np.concatenate([e[key] for e in online]))

        d = self.offline
        return {
            "version": BUFFER_STATE_VERSION, "capacity": self.capacity,
            "order": t(np.asarray(order, np.int64)),
            "dataset_episodes": int(d.num_episodes),
            "offline_returns": t(np.asarray(d.episode_returns[offline_idx], np.float64)),
            "online": {
                "observations": cat("observations", self.obs_dtype, d.observation_shape),
                "actions": cat("actions", self.act_dtype, d.action_shape),
                "rewards": cat("rewards", np.float64, ()),
                "lengths": t(np.asarray([e["rewards"].shape[0] for e in online], np.int64)),
                "terminated": t(np.asarray([e["terminated"] for e in online], bool)),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], where: str | None = None) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: another format, or a dataset whose episodes are not those the buffer was
                filled from (episode count, or the return of an offline entry, differs); the message
                names ``where`` (``dataset.path``).
        """
        if int(state.get("version", -1)) != BUFFER_STATE_VERSION:
            raise ValueError(f"the checkpoint's replay buffer has format {state.get('version')!r}; this version "
                             f"reads {BUFFER_STATE_VERSION}")
        d = self.offline
        order = state["order"].numpy()
        idx = order[order >= 0]
        same = int(state["dataset_episodes"]) == d.num_episodes and (idx < d.num_episodes).all()
        if same:
            same = np.array_equal(d.episode_returns[idx], state["offline_returns"].numpy())
        if not same:
            raise ValueError(
                f"the dataset {where} is not the one this run's replay buffer was filled from (its episodes or "
                f"their returns differ from the checkpoint's); resume with the original data")
        on = state["online"]
        lengths = on["lengths"].numpy()
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        obs, act, rew, term = (on["observations"].numpy(), on["actions"].numpy(), on["rewards"].numpy(),
                               on["terminated"].numpy())
        online = iter(range(lengths.size))
        self.entries = deque()
        for v in order.tolist():
            if v >= 0:
                self.entries.append(("offline", int(v)))
            else:
                k = next(online)
                a, b = bounds[k], bounds[k + 1]
                self.entries.append(("online", {"observations": obs[a:b].copy(), "actions": act[a:b].copy(),
                                                "rewards": rew[a:b].copy(), "terminated": bool(term[k])}))
        self.capacity = int(state["capacity"])
        self._ds = None


# -- rollouts -----------------------------------------------------------------------------------

def collect_episodes(
    policy: DTPolicy, envs: gym.vector.VectorEnv, episodes: int, seed: int, target: float, max_ep_len: int,
) -> list[dict[str, Any]]:
    """``episodes`` complete episodes of ``policy`` in the N environments of ``envs``.

    The evaluation's loop (:func:`~rl_tformers.runtime.evaluation.run_episodes`), recording
    the trajectories: one ``policy.act`` call (one batched forward pass) per step for all N
    environments; episode j runs in environment j mod N with reset seed ``seed + j``; an
    environment past its quota keeps stepping with its context restarted at every step, results
    discarded. An episode is cut (truncated) after ``max_ep_len`` steps.

    Args:
        policy: acts in raw units (a sampling :class:`DTPolicy` for exploration).
        envs: a vector environment with autoreset disabled whose environments carry the raw reward
            in ``info`` (:func:`~rl_tformers.runtime.evaluation.with_raw_reward`).
        episodes: how many to collect.
        seed: base reset seed (episode j: ``seed + j``).
        target: return-to-go the episodes are conditioned on (raw units).
        max_ep_len: steps after which an episode is cut.

    Returns:
        ``episodes`` dicts in episode order: ``observations (L, *obs_shape)`` (the observation
        before each action), ``actions (L, *act_shape)`` (environment units), ``rewards (L,)``
        float64 (the environment's own rewards), ``terminated`` (False: truncated or cut).

    Raises:
        NonFiniteError: (a ValueError) a NaN/inf action or reward, naming the episode, its reset
            seed and the step.
        RuntimeError: the raw reward is missing from ``info``.
    """

    rec = run_episodes(policy, envs, target, episodes, seed, record_trajectories=True, max_steps=max_ep_len,
                       who="online rollout")
    return [{"observations": rec.observations[j], "actions": rec.actions[j], "rewards": rec.rewards[j],
             "terminated": bool(rec.terminated[j])} for j in range(episodes)]


def check_episode_lengths(ds: EpisodeDataset, max_ep_len: int, where: str | None, init_from: str) -> None:
    """Refuse dataset episodes longer than the offline run's ``agent.max_ep_len`` (the timestep
    embedding the fine-tuned model keeps), up front and by dataset index.

    Raises:
        DatasetError: (a ValueError) naming ``dataset.path``, the first such episode by its
            dataset index, its length, and the offline run's ``agent.max_ep_len``.
    """

    try:
        ds.check_max_ep_len(max_ep_len, "agent.max_ep_len")
    except DatasetError as exc:
        e = int(exc.episode)
        raise DatasetError(
            f"dataset.path={where}: episode {e} has {int(ds.lengths[e])} steps, more than agent.max_ep_len="
            f"{max_ep_len} of the offline run (agent.init_from={init_from}): Online DT keeps that run's timestep "
            f"embedding, which has no entry for step {max_ep_len} (the odt config's agent.max_ep_len is not "
            f"used); train the offline run with agent.max_ep_len >= {int(ds.lengths.max())}, or fine-tune on "
            f"data without longer episodes", field="lengths", episode=e, step=max_ep_len) from None


def check_fine_tune_data(ds: EpisodeDataset, info: DatasetInfo, where: str | None) -> None:
    """Refuse data of another layout than the offline run's; warn when it is other data."""
    obs_dim = int(np.prod(ds.observation_shape))
    act_dim = int(np.prod(ds.action_shape)) if not ds.discrete_actions else -1
    if ds.discrete_actions or obs_dim != info.obs_dim or act_dim != info.act_dim:
        raise ValueError(
            f"dataset.path={where}: observations of {obs_dim} values and actions {ds.action_space}, but the "
            f"offline run of agent.init_from was trained on {info.obs_dim} and {info.act_dim} continuous values "
            f"({info.dataset}); fine-tune on data of the same task")
    if info.num_steps is not None and (ds.num_steps != info.num_steps
                                       or float(ds.episode_returns.max()) != info.return_max):
        log.warning("dataset.path=%s is not the data the offline run was trained on (%s): Online DT keeps that "
                    "run's observation statistics and reward scale", where, info.dataset)


# -- the agent ----------------------------------------------------------------------------------

class ODTAgent(DTAgent):
    """Online DT fine-tuning of an offline gaussian-head DT run (the runtime's ``Trainable``).

    Args:
        cfg: resolved run config (``agent`` as in :data:`ODT_DEFAULTS`, ``dataset``, ``train``,
            ``eval``, ``seed``); the model, its data statistics and the backbone are the offline
            run's (``agent.init_from``).
        run_dir: run directory (unused).
        device: training device.
        dataset: an already loaded offline dataset (tests); default: ``cfg.dataset``.

    On ``--resume`` (the builder runs inside :func:`~rl_tformers.runtime.agent_registry.build_agent` with
    the checkpoint to resume, :func:`~rl_tformers.runtime.agent_registry.resume_state`) the agent is
    built from the checkpoint alone: the model options and backbone saved in ``extra.odt``
    (those of the offline run when this run started), the data statistics of ``extra`` and the
    checkpoint's weights. ``agent.init_from`` is not read again: the offline run may since have
    been retrained, moved or deleted, or be a relative path that does not resolve from the
    folder of the resume.

    Raises:
        ValueError: ``agent.init_from`` missing or not a gaussian-head continuous-action dt run
            (:func:`read_offline_run`; new runs only), an offline run trained with ``plugins``
            this run does not list (:func:`~rl_tformers.runtime.plugins.check_source_plugins`;
            new runs only), ``agent.online`` not a mapping or an
            ``agent.online.*`` value out of range, a dataset whose observation or action layout
            differs from the offline run's, a dataset episode longer than the offline run's
            ``agent.max_ep_len`` (a ``DatasetError`` naming the episode), an exploration target
            beyond the model's return embedding (:meth:`DTPolicy.check_targets`), more than one
            process (``--nproc``), or a resumed checkpoint without ``extra.odt``.

    Warns:
        ConfigAdviceWarning: the config's model/data options or backbone differ from the offline
            run's (:func:`fine_tune_changes`), which fine-tuning uses instead.
        (log) the evaluation environment's time limit exceeds the offline run's
            ``agent.max_ep_len`` with ``agent.timestep_overflow=error`` (:func:`warn_time_limit`).
    """

    targets_option = "agent.targets"
    #: per-round counters: logged at their latest value, not averaged over the logging window
    latest_logs = ("env_steps", "online_return", "online_length", "rounds", "buffer_trajectories", "buffer_steps")

    def __init__(self, cfg: Any, run_dir: Path | None, device: torch.device | str,
                 dataset: EpisodeDataset | None = None) -> None:

        a = ODTAgentConfig.from_dict({k: v for k, v in plain(cfg.agent).items() if k != "kind"}, where="agent")
        online = a.online
        world = dist_info().world_size
        if world > 1:
            raise ValueError(f"agent.kind=odt runs in one process (its rollouts and replay buffer are not shared "
                             f"between processes); this run has {world} (--nproc {world}): use --nproc 1")
        if not a.init_from:
            raise ValueError("agent.init_from is required: the offline Decision Transformer run (directory or "
                             "checkpoint file) to fine-tune, trained with agent.head=gaussian")
        self.init_from = a.init_from
        state, saved, src = self._starting_state(cfg)
        configured = plain(cfg)
        changes = fine_tune_changes(configured, saved)
        if changes:
            warnings.warn(
                f"{src} with its data statistics, so these settings of the config are not used, the checkpoint's "
                f"are: {'; '.join(changes)} (config.yaml still records the config's); set them to the checkpoint's "
                f"values to silence this",
                ConfigAdviceWarning,
                stacklevel=2)
        info = DatasetInfo.from_extra(state["extra"])
        where = plain(cfg.dataset).get("path")
        if dataset is None:
            dataset = load_offline_dataset(plain(cfg.dataset))
        check_fine_tune_data(dataset, info, where)
        check_episode_lengths(dataset, int(self.offline_agent["max_ep_len"]), where, self.init_from)
        super().__init__(effective_config(configured, self.offline_agent, self.offline_backbone), run_dir, device,
                         dataset=dataset, info=info, options=a.replace(where="agent.init_from", **self.offline_agent))
        if self.options.timestep_overflow == "error":
            warn_time_limit(info, self.model_cfg.max_ep_len, offline_run=self.init_from)
        self.model.load_state_dict(state["model"])  # the offline weights (resume: the checkpoint's, loaded again)
        self.online = online
        self.updates_per_round = online.updates_per_round
        self.rollouts_per_round = online.rollouts_per_round
        self.n_envs = min(online.n_envs, self.rollouts_per_round)
        t = online.target_return
        #: g_online, raw units (null: t + |t| of the evaluation target t, :func:`default_online_target`)
        self.online_target = default_online_target(self.default_targets()[0]) if t is None else float(t)
        self.policy().check_targets([self.online_target], "agent.online.target_return")
        if self.config_targets is not None:
            self.policy().check_targets(self.config_targets, "agent.targets")  # the loaded weights' limit
        self.model.train()
        self.buffer = TrajectoryBuffer(dataset, online.buffer_size)
        self.rounds = 0  # rounds collected
        self.env_steps = 0  # online environment steps collected
        self.last_returns: list[float] = []  # returns / lengths of the latest round's episodes
        self.last_lengths: list[int] = []
        self._envs: gym.vector.VectorEnv | None = None
        self._sampler = None

    def _starting_state(self, cfg: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], str]:
        """The checkpoint this run starts from: the offline run's (a new run) or this run's own
        (``--resume``, which never reads ``agent.init_from`` again). Sets :attr:`offline_agent`
        and :attr:`offline_backbone`, the offline model's options.

        Returns:
            (checkpoint state, the offline run's config (``agent`` and ``backbone``), where the
            model comes from, for messages).

        Raises:
            ValueError: the offline run lists plugins this run does not, or a resumed checkpoint
                that was not written by ``agent.kind=odt``.
        """
        resumed = resume_state()
        if resumed is None:  # a new run: the offline run's checkpoint
            state, saved = read_offline_run(self.init_from)
            # its backbone may name kinds of its plugins: this run lists them too (eval, resume)
            check_source_plugins(saved, cfg.get("plugins"), f"agent.init_from={self.init_from}")
            sa = saved.get("agent") or {}
            self.offline_agent = {k: copy.deepcopy(sa.get(k, offline_default(k))) for k in OFFLINE_AGENT_KEYS}
            self.offline_backbone = dict(saved.get("backbone") or {})
            src = f"agent.init_from={self.init_from}: Online DT fine-tunes that run's model"
        else:  # --resume: this run's own checkpoint holds everything (agent.init_from is not read)
            state = resumed
            odt = (state.get("extra") or {}).get("odt")
            if not isinstance(odt, Mapping) or not isinstance(odt.get("agent"), Mapping) \
                    or not isinstance(odt.get("backbone"), Mapping):
                raise ValueError("--resume: the checkpoint holds no Online DT model options (extra.odt.agent / "
                                 "extra.odt.backbone); it was not written by agent.kind=odt and cannot be resumed as one")
            self.offline_agent = {k: copy.deepcopy(odt["agent"].get(k, offline_default(k)))
                                  for k in OFFLINE_AGENT_KEYS}
            self.offline_backbone = copy.deepcopy(dict(odt["backbone"]))
            saved = {"agent": self.offline_agent, "backbone": self.offline_backbone}
            src = (f"resume: Online DT fine-tunes the model this run started from (agent.init_from={self.init_from}, "
                   f"as saved in its checkpoint)")
        return state, saved, src

    # -- Trainable -------------------------------------------------------------------------------
    @property
    def updates_per_rollout(self) -> int:
        """Updates that learn from one round's buffer (``agent.online.updates_per_round``): the trainer
        redraws random attention features only between rounds."""
        return self.updates_per_round

    def _make_sampler(self):

        data = self.buffer.dataset()
        shape = data.observation_shape
        stats = ObsStats(self.info.obs_mean.reshape(shape), self.info.obs_std.reshape(shape))
        return WindowSampler(data, self.model_cfg.context_len, align=self.align, reward_scale=self.info.reward_scale,
                             obs_stats=stats, max_ep_len=self.model_cfg.max_ep_len)

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]:
        """Endless stream of batches; round r is collected before update ``r * U``.

        Batch s = ``WindowSampler(buffer).sample(train.batch_size, default_rng([seed, s]))``
        with the statistics of the latest round (``stats``). Resuming inside round r (the
        checkpoint's buffer already holds it) continues sampling; at a boundary it collects
        round r from the restored weights and seed, the same episodes as the uninterrupted run.

        Raises:
            ValueError: the checkpoint's round counter does not fit ``start_step`` (a resume with
                another ``agent.online.updates_per_round``); the environment cannot be built.
        """
        u, s0 = self.updates_per_round, int(start_step)
        need = s0 // u + (s0 % u > 0)  # rounds collected before update s0
        if self.rounds != need:
            raise ValueError(f"agent.online.updates_per_round={u}: update {s0} follows {need} rounds, but the run "
                             f"has collected {self.rounds}; resume with the run's own agent.online.updates_per_round")
        if self.rollouts_per_round:
            self._vector_env()  # build errors now, before the run directory is written
        self._sampler = self._make_sampler()
        bsz = int(self.cfg.train.batch_size)

        def stream() -> Iterator[dict[str, Any]]:
            s = s0
            while True:
                if s % u == 0:
                    self.collect_round()
                raw = self._sampler.sample(bsz, np.random.default_rng([self.seed, s]))
                batch: dict[str, Any] = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in raw.items()}
                batch["stats"] = self.round_stats()
                yield batch
                s += 1

        return stream()

    def loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """:func:`dt_loss` on one buffer batch, plus the latest round's statistics."""
        tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
        loss, logs = dt_loss(self.model, to_model_batch(tensors, self.info))
        logs.update(batch.get("stats") or {})
        return loss, logs

    def round_stats(self) -> dict[str, float]:
        """What the latest round and the buffer look like (floats for logging; see the module docstring)."""
        out = {"env_steps": float(self.env_steps), "rounds": float(self.rounds),
               "buffer_trajectories": float(len(self.buffer)), "buffer_steps": float(self.buffer.num_steps)}
        if self.last_returns:
            out["online_return"] = float(np.mean(self.last_returns))
            out["online_length"] = float(np.mean(self.last_lengths))
        return out

    # -- rollouts --------------------------------------------------------------------------------
    def _vector_env(self) -> gym.vector.VectorEnv:
        """The N exploration environments (built once; every round resets them with its seeds)."""
        if self._envs is None:
            make = self.make_env()
            self._envs = gym.vector.SyncVectorEnv([lambda: with_raw_reward(make()) for _ in range(self.n_envs)],
                                                  autoreset_mode=gym.vector.AutoresetMode.DISABLED)
        return self._envs

    def round_seed(self, r: int) -> int:
        """Seed of round r: reset seeds ``seed + j`` and the action noise (31 bits)."""

        return derive_seed(self.seed, "online", int(r)) % (2**31)

    def collect_round(self) -> list[dict[str, Any]]:
        """Collect round ``self.rounds`` with the sampled policy, add it to the buffer, count it.

        The model acts in ``eval()`` mode under ``no_grad`` and goes back to its mode after; the
        action noise comes from a ``torch.Generator`` seeded with :meth:`round_seed` (the global
        generators are not touched).

        With ``agent.online.rollouts_per_round=0`` (the offline-continuation control) the round
        collects nothing: only the round counter moves, the buffer and sampler stay as they are.

        Returns:
            the round's episodes (:func:`collect_episodes`; empty for the control).
        """
        if self.rollouts_per_round == 0:
            self.rounds += 1
            return []
        seed = self.round_seed(self.rounds)
        dev = next(self.model.parameters()).device
        gen = torch.Generator(device=dev).manual_seed(seed)
        was = self.model.training
        try:
            with torch.no_grad():
                policy = self.policy(sample=True, generator=gen)  # (puts the model in eval mode)
                episodes = collect_episodes(policy, self._vector_env(), self.rollouts_per_round, seed,
                                            self.online_target, self.model_cfg.max_ep_len)
        finally:
            self.model.train(was)
        self.buffer.add(episodes)
        self.rounds += 1
        self.last_lengths = [int(e["rewards"].shape[0]) for e in episodes]
        self.last_returns = [math.fsum(e["rewards"].tolist()) for e in episodes]
        self.env_steps += sum(self.last_lengths)
        self._sampler = self._make_sampler()
        return episodes

    # -- checkpoint state ------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """The DT's dataset statistics, the offline model options and backbone (inference rebuilds
        the model from them), and the online counters."""
        out = super().extra_state()
        out["odt"] = {
            "agent": copy.deepcopy(self.offline_agent), "backbone": copy.deepcopy(self.offline_backbone),
            "init_from": self.init_from, "rounds": int(self.rounds), "env_steps": int(self.env_steps),
            "last_returns": [float(x) for x in self.last_returns], "last_lengths": [int(x) for x in self.last_lengths],
        }
        return out

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Statistics (:meth:`DTAgent.load_extra_state`) and online counters of a checkpoint (``--resume``)."""
        super().load_extra_state(state)
        o = state["odt"]
        self.rounds, self.env_steps = int(o["rounds"]), int(o["env_steps"])
        self.last_returns = [float(x) for x in o["last_returns"]]
        self.last_lengths = [int(x) for x in o["last_lengths"]]

    def process_state(self) -> dict[str, Any]:
        """The replay buffer (:meth:`TrajectoryBuffer.state_dict`), saved in every checkpoint."""
        return {"buffer": self.buffer.state_dict()}

    def load_process_state(self, states: list[Mapping[str, Any]] | None) -> None:
        """Restore the replay buffer of a checkpoint (one process).

        Raises:
            ValueError: the checkpoint holds no buffer, or one of other data (see
                :meth:`TrajectoryBuffer.load_state_dict`).
        """
        if not states or "buffer" not in states[0]:
            raise ValueError("the checkpoint holds no Online DT replay buffer; it cannot be resumed as agent.kind=odt")
        self.buffer.load_state_dict(states[0]["buffer"], plain(self.cfg.dataset).get("path"))


def load_odt_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> DTAgent:
    """The fine-tuned DT of an ``odt`` run as a :class:`DTAgent` (no offline run or dataset needed;
    evaluation acts with the Gaussian's mean, as the DT does)."""
    odt = state["extra"]["odt"]
    eff = effective_config(plain(cfg), odt["agent"], odt["backbone"])
    options = ODTAgentConfig.from_dict({k: v for k, v in plain(eff.agent).items() if k != "kind"}, where="agent")
    agent = DTAgent(eff, None, device, info=DatasetInfo.from_extra(state["extra"]), options=options)
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


register_inference_loader("odt")(load_odt_for_inference)


@register_agent("odt", description="Online Decision Transformer fine-tuning (Zheng et al. 2022) of a gaussian-head dt run",
                defaults=ODT_DEFAULTS, single_process=True, config_cls=ODTAgentConfig)
def build_odt(cfg: Any, run_dir: Path, device: torch.device) -> ODTAgent:
    """Builder of ``agent.kind=odt``."""
    return ODTAgent(cfg, run_dir, device)
