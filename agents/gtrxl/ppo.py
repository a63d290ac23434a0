"""Online PPO with the GTrXL model in gymnasium vector environments (``agent.kind=gtrxl_ppo``).

The setting of Parisotto et al. 2019 (there with V-MPO/IMPALA; PPO as in CleanRL's TrXL-PPO
and RLlib's attention nets): N vector environments step together, one token per environment
and step goes through the backbone with its memory, and the policy is trained with the clipped
surrogate of Schulman et al. 2017 plus a value loss and an entropy bonus on the same encoder.

Memory during updates: **stored per rollout step**. At every step the collector records the
backbone state each environment acted with (per layer (N, M, D) memory plus slot positions,
validity and episode ids, after the reset of finished rows). The update recomputes each sample
as one query over exactly that memory, so before the first optimiser step the recomputed
log-probabilities equal the rollout's, up to float rounding (1e-6 tested: the importance ratio
starts at 1); the memory content itself is the rollout's (detached, from the weights at
collection time), as in CleanRL's TrXL-PPO. A segment-based recompute (re-running
whole rollout segments with the new weights) would change the attention pattern between acting
(one token over M slots) and learning (a segment over M + T slots), so the importance ratio
would not start at 1; we do not do it. Cost per sample: O(M) keys per layer; storage
S x N x layers x M x D floats per rollout.

No dropout: the PPO model is built with ``backbone.dropout``, ``attn_dropout`` and
``ffn_dropout`` set to 0 (:func:`without_dropout`; a config or offline checkpoint that sets them
gets a :class:`~rl_tformers.backbone_config.ConfigAdviceWarning`). With dropout the rollout's
log-probabilities and values would come from one dropout mask and their recomputation from
another, so the ratio would not start at 1 and the clip would act on dropout noise; collecting
with dropout off (eval mode) and updating with it on, as some libraries do, leaves the same
mismatch between the acting network and the recomputed one. Huang et al. 2024 ("The N+
implementation details of RLHF with PPO") disable dropout for this reason; CleanRL's PPO
networks have none.

Memory kind: ``xl`` only (a fixed-size FIFO, so the stored per-step memories stack); the
offline agent takes any stateful kind.

Rows whose episode ended are reset before the next step (the backbone state of only those rows
is cleared). Time-limit truncations are bootstrapped with V(final observation), computed with
the memory of the finished episode; terminations are not.

Trainer integration: ``batches()`` is an iterable that collects a rollout with the live model,
then yields ``n_epochs x n_minibatches`` minibatches; one trainer update = one minibatch. So
``train.steps = rollouts x n_epochs x n_minibatches`` and the environment steps are
``rollouts x n_envs x n_steps``.

Resuming (``--resume``) is bit-identical to an uninterrupted run, stopped at any update (inside
a rollout too): weights, ``metrics.jsonl`` values and final state. Besides the run-wide state
(weights, optimiser, RNG states, observation statistics, the ``env_steps``/``rollouts``
counters: :meth:`GTrXLPPO.extra_state`) every checkpoint holds each process's own state
(:meth:`GTrXLPPO.process_state`, the trainer's per-process hook): the N environments, pickled
(gymnasium environments and wrappers by their attributes, so MuJoCo's simulator state and each
environment's random generator carry over; :class:`_EnvPickler`), the vector environment's
autoreset flags, the running episodes (last observation, backbone memory, a_{t-1}, r_{t-1},
step, start flags, return and length so far), the recent episode returns and lengths, and,
when the run stopped after update j of a rollout's U = ``n_epochs x n_minibatches`` (0 < j <
U), that rollout with j. The resumed stream first serves the rollout's last U - j minibatches
(their permutations are a pure function of ``(seed, rollout, epoch)``), then collects the next
rollout from the restored environments; the trainer restores the RNG states just before the
first update, and the saved rollout draws nothing, so the next rollout samples its actions
from the same RNG state as the uninterrupted run. Tested with CartPole, the position-only
tasks (CartPole, Pendulum, Hopper-v5), Recall and Hopper-v5, and under DDP with the same
number of processes, every rank getting back its own environments
(tests/agents/test_gtrxl_ppo_resume.py).

Size: the environments and running episodes of configs/gtrxl/ppo_cartpole.yaml add about
0.16 MB to a checkpoint (2.8 -> 3.0 MB; the backbone memory, N x layers x M x D floats, is
most of it; a MuJoCo environment pickles its model and data, about 1.2 MB each); a rollout in
progress adds about 2.0 MB (the per-step memories, S x N x layers x M x D floats = 16.8 MB, are
stored as the one new slot per step, :func:`fifo_encode`, losslessly). The shipped config
checkpoints every 160 updates, at rollout boundaries, so only a stop (SIGINT/SIGTERM,
``--stop-at``) inside a rollout saves one.

Not exact, and said so by the warning ``--resume`` prints (:meth:`GTrXLPPO.resume_note`):
an environment that cannot be pickled (one holding a lambda, a lock, an open file...; a warning
says so at the first checkpoint), a resume with another number of processes than the
checkpoint's, or a checkpoint written before this state was saved. Then the environments
restart with fresh resets (and empty memory) at the next rollout; a checkpointed rollout in
progress is still finished exactly (from an old checkpoint: a fresh rollout feeds the last U - j updates, and its
``n_envs x n_steps`` steps are counted in ``train/env_steps`` on top of the cut one's). The
environments are unpickled only by ``--resume`` (loading a checkpoint for evaluation or
inference stays ``weights_only``): resume only runs you trust.

Under DDP (``--nproc W``) W processes act as one process with ``W x n_envs`` environments:
every process runs its own ``n_envs`` environments (rank r seeds them after rank r - 1's, the
seeds one process with ``W x n_envs`` environments would give them), collects its own rollout
and trains on every row of its own minibatches (the agent sets ``local_batches``, so the
trainer does not split them again); ``train/env_steps`` counts the steps of every process.
One update's global minibatch is therefore the union of the ranks' minibatches, W x
``n_envs x n_steps / n_minibatches`` rows, and the gradient is exactly that of one process on
that union: the loss terms are means over equal-sized minibatches (every rank splits its
rollout the same way, so DDP's gradient average is the global mean) and the advantages are
normalised with the mean and standard deviation of the whole global minibatch
(:func:`normalize_advantages`, three scalar all-reduces; tested against one process). The
only difference from one process with ``W x n_envs`` environments: each rank draws its
minibatches from its own rollout (a global minibatch takes the same number of rows from
every rank's rollout, not a uniform draw over their union).

Logged (``train/...``): PPO losses, approximate KL, clip fraction, entropy, mean gate values per
layer (``gate/layer{i}_attn|ffn``), attention entropy per layer (nats, at the rollout's last
step), episodic return/length (mean of the episodes finished in the latest rollouts) and
environment steps (``train/env_steps``: the count at the window's last update, not a mean over
the window: the agent's ``latest_logs``).
"""

from __future__ import annotations

import copyreg
import io
import logging
import pickle
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import rl_tformers.envs.memory_tasks  # noqa: F401  (registers the memory tasks with gymnasium)
import torch
from rl_tformers.agents.decision_transformer.model import to_env_action
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy, _plain, model_config_dict
from rl_tformers.agents.gtrxl.config import PPOAgentConfig
from rl_tformers.agents.gtrxl.model import (
    GTrXLConfig,
    GTrXLModel,
    check_causal,
    gate_logs,
    gtrxl_backbone,
    needs_find_unused,
    position_limit,
    record_attention,
)
from torch import Tensor

from rl_tformers.attention.base import attention_entropy
from rl_tformers.backbone_config import ConfigAdviceWarning
from rl_tformers.runtime.agent_registry import register_agent, resume_state
from rl_tformers.runtime.distributed import dist_info
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.loading import register_inference_loader
from rl_tformers.runtime.plugins import check_source_plugins
from rl_tformers.runtime.run_config import ConfigError
from rl_tformers.types import BackboneState, LayerState

log = logging.getLogger(__name__)

OBS_CLIP = 10.0  # normalised observations are clipped to [-10, 10] (as SB3's VecNormalize)
#: format of :meth:`GTrXLPPO.process_state` (a checkpoint of another version restarts the environments)
PROCESS_STATE_VERSION = 1
#: SyncVectorEnv bookkeeping saved with the sub-environments
_VECTOR_FIELDS = ("_autoreset_envs", "_terminations", "_truncations", "_rewards")

#: Registered defaults of ``agent.kind=gtrxl_ppo`` (its ``agent`` section: :class:`PPOAgentConfig`'s)
PPO_DEFAULTS: dict[str, Any] = {
    "agent": PPOAgentConfig().to_dict(),
    "backbone": gtrxl_backbone(d_model=64, n_layers=2, n_heads=4, mem_len=16),
    "train": {
        "lr": 3.0e-4, "weight_decay": 0.0, "grad_clip": 0.5, "warmup_steps": 0, "schedule": "constant",
        "eps": 1.0e-5, "steps": 1600, "log_every": 16,
    },
    "eval": {"every": 0, "episodes": 10, "n_envs": 10},
}


class RunningMeanStd:
    """Mean/variance of a stream of (K, O) batches (parallel Welford; Chan et al. 1979)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = 1e-4

    def update(self, x: np.ndarray) -> None:
        """Merge a batch ``x`` (..., *shape), flattened to (K, *shape), into the statistics."""
        x = np.asarray(x, np.float64).reshape(-1, *self.mean.shape)
        b_mean, b_var, b_n = x.mean(0), x.var(0), x.shape[0]
        delta = b_mean - self.mean
        tot = self.count + b_n
        self.mean = self.mean + delta * b_n / tot
        self.var = (self.var * self.count + b_var * b_n + delta**2 * self.count * b_n / tot) / tot
        self.count = tot

    @property
    def std(self) -> np.ndarray:
        """sqrt(var + 1e-8), the shape of the mean."""
        return np.sqrt(self.var + 1e-8)


def _set_attributes(obj: Any, state: dict[str, Any]) -> None:
    obj.__dict__.update(state)


class _EnvPickler(pickle.Pickler):
    """Pickles every gymnasium environment and wrapper by its attributes (``__dict__``).

    Their own pickling may rebuild a fresh environment instead: gymnasium's ``EzPickle`` (MuJoCo,
    Box2D) stores only the constructor arguments, so an unpickled Hopper-v5 starts over from a
    new reset, with a new random generator. Attribute by attribute, the simulator state (MuJoCo's
    ``MjModel``/``MjData``, which pickle themselves exactly), the wrappers' counters
    (``TimeLimit``'s elapsed steps) and the environment's ``np_random`` carry over as they are.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (gym.Env, gym.utils.EzPickle)) and not isinstance(obj, type) and hasattr(obj, "__dict__"):
            return copyreg.__newobj__, (type(obj),), dict(obj.__dict__), None, None, _set_attributes
        return NotImplemented


def dump_envs(envs: list[gym.Env]) -> bytes:
    """The sub-environments of a vector environment as bytes (:class:`_EnvPickler`).

    Raises:
        Exception: whatever pickling raises for an environment that holds something unpicklable
            (a lambda, a lock, an open file or window...).
    """
    buf = io.BytesIO()
    _EnvPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(list(envs))
    return buf.getvalue()


def load_envs(blob: bytes) -> list[gym.Env]:
    """Inverse of :func:`dump_envs` (unpickling: only for checkpoints of runs you trust)."""
    return pickle.loads(blob)


#: rollout keys that hold each step's FIFO memory, and their slot axis in the (S, N, ...) tensor
_FIFO_KEYS = {"mem": 3, "mem_pos": 2, "mem_valid": 2, "mem_seg": 2}


def _bits(x: Tensor) -> Tensor:
    """``x`` as integers of its size (floats compared bit for bit: -0.0 != 0.0, NaN == itself)."""
    if not x.is_floating_point():
        return x
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def fifo_encode(x: Tensor, dim: int) -> dict[str, Tensor]:
    """Lossless compact form of per-step snapshots of a FIFO memory, (S, N, ...) with slots on ``dim``.

    The XL memory a row acts with at step t + 1 is usually the one of step t shifted by one slot
    plus a new last slot; such rows store only that slot, the others (after a reset, or anything
    else) the whole row. Compared bit for bit, so :func:`fifo_decode` returns ``x`` exactly
    whatever the memory did (up to M times smaller for M slots; measured 16.8 MB -> about 1.9 MB
    for the rollout memory of configs/gtrxl/ppo_cartpole.yaml, M = 16).

    Args:
        x: (S, N, ...) snapshots, S steps of N rows, slots on axis ``dim`` (>= 2).
        dim: the slot axis of ``x``.

    Returns:
        ``{"full": x}`` when S < 2 or there is one slot; else ``first`` (N, ...) = x[0], ``ok``
        (S - 1, N) bool (row n at step t + 1 is row n at step t shifted by one slot), ``new``
        (K, ...) with the slot axis of size 1: the new last slot of the K (step, row) pairs
        where ``ok``, and ``rows`` (R, ...): the R = (S - 1) N - K other rows, whole.
    """
    s, m = x.shape[0], x.shape[dim]
    if s < 2 or m < 2:
        return {"full": x.clone()}
    b = _bits(x)
    ok = (b[1:].narrow(dim, 0, m - 1) == b[:-1].narrow(dim, 1, m - 1)).flatten(2).all(-1)  # (S - 1, N)
    return {"first": x[0].clone(), "ok": ok, "new": x[1:].narrow(dim, m - 1, 1)[ok].clone(), "rows": x[1:][~ok].clone()}


def fifo_decode(enc: Mapping[str, Tensor], dim: int) -> Tensor:
    """Inverse of :func:`fifo_encode` (bit for bit): ``enc`` -> the (S, N, ...) snapshots.

    Steps are rebuilt in order (step t from step t - 1), a loop over the S steps of one rollout
    run once per resume, not in training.
    """
    if "full" in enc:
        return enc["full"].clone()
    first, ok = enc["first"], enc["ok"]
    s, m = ok.shape[0] + 1, first.shape[dim - 1]
    out = first.new_empty((s, *first.shape))
    out[0] = first
    new = first.new_zeros((s - 1, *first.shape[:dim - 1], 1, *first.shape[dim:]))
    new[ok] = enc["new"]
    rows = first.new_zeros((s - 1, *first.shape))
    rows[~ok] = enc["rows"]
    for t in range(1, s):  # each step from the previous one: inherent
        out[t] = torch.cat([out[t - 1].narrow(dim - 1, 1, m - 1), new[t - 1]], dim - 1)
        out[t][~ok[t - 1]] = rows[t - 1][~ok[t - 1]]
    return out


def _state_dict_of(state: BackboneState) -> dict[str, Any]:
    """A :class:`BackboneState` of the ``xl`` memory as plain tensors (CPU)."""
    if any(ls.cache is not None or ls.extra is not None for ls in state.layers):
        raise TypeError("gtrxl_ppo: only the xl memory's LayerState(memory=...) can be checkpointed")
    return {"memory": [None if ls.memory is None else ls.memory.cpu() for ls in state.layers],
            **{k: getattr(state, k).cpu() for k in ("pos", "valid", "seg", "episode", "next_pos")}}


def _state_from_dict(d: Mapping[str, Any], device: torch.device) -> BackboneState:
    return BackboneState(
        layers=[LayerState(memory=None if m is None else m.to(device)) for m in d["memory"]],
        **{k: d[k].to(device) for k in ("pos", "valid", "seg", "episode", "next_pos")},
    )


def compute_gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16).

    Args:
        rewards: (S, N) reward of step t (truncation bootstraps already added).
        values: (S, N) V(s_t) at collection.
        dones: (S, N) bool, the episode ended after step t (s_{t+1} starts a new one).
        last_value: (N,) V(s_S) of the observation after the rollout.
        gamma, lam: discount and GAE lambda.

    Returns:
        advantages (S, N) and returns = advantages + values (S, N).
    """
    s = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(last_value)
    nonterm = (~dones).to(rewards.dtype)
    for t in reversed(range(s)):  # the recursion over rollout steps is inherent
        next_v = last_value if t == s - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_v * nonterm[t] - values[t]
        last = delta + gamma * lam * nonterm[t] * last
        adv[t] = last
    return adv, adv + values


def state_from_rows(mem: Tensor, pos: Tensor, valid: Tensor, seg: Tensor, episode: Tensor, next_pos: Tensor) -> BackboneState:
    """Rebuild a :class:`BackboneState` from stored per-sample tensors.

    Args:
        mem: (B, L, M, D) per-layer memory; pos, valid, seg: (B, M); episode, next_pos: (B,).
    """
    return BackboneState(
        layers=[LayerState(memory=m) for m in mem.unbind(1)],
        pos=pos, valid=valid, seg=seg, episode=episode, next_pos=next_pos,
    )


def normalize_advantages(adv: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantage normalisation of a minibatch: (adv - mean) / (std + eps), (B,) -> (B,).

    ``std`` is the unbiased sample standard deviation (``Tensor.std``, as CleanRL's PPO). With
    one process (or outside a DDP training forward) the statistics are this minibatch's, exactly
    as ``(adv - adv.mean()) / (adv.std() + eps)``; a minibatch of one row is returned unchanged
    (a run's ``agent.norm_adv`` with such minibatches is refused: :meth:`PPOAgentConfig.check_world_size`).
    Inside a DDP training forward (the trainer's
    :class:`~rl_tformers.runtime.distributed.AgentLoss`, where every rank holds a shard of the
    global minibatch) the mean and standard deviation are those of the global minibatch, every
    rank's rows (float64 sums over the ranks: :func:`~rl_tformers.runtime.distributed.shard_mean_total`
    for the count, then two all-reduces, every rank in step), so each rank normalises its rows
    exactly as one process normalises the whole minibatch.
    """
    from rl_tformers.runtime.distributed import is_active, shard_mean_total

    # N / W inside a DDP training forward; None otherwise (no process group: no tensor made at all)
    total = shard_mean_total(adv.new_tensor(float(adv.numel()))) if is_active() else None
    if total is None:
        if adv.numel() <= 1:
            return adv
        return (adv - adv.mean()) / (adv.std() + eps)
    import torch.distributed as dist

    n = round(float(total) * dist.get_world_size())  # N: rows of the global minibatch
    moments = adv.detach().to(torch.float64).sum().reshape(1)
    dist.all_reduce(moments, op=dist.ReduceOp.SUM)
    mean = moments / max(n, 1)
    sq = (adv.detach().to(torch.float64) - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    if n <= 1:
        return adv
    std = (sq / (n - 1)).sqrt()
    return (adv - mean.to(adv.dtype)) / (std.to(adv.dtype) + eps)


def ppo_loss(
    model: GTrXLModel,
    mb: Mapping[str, Tensor],
    *,
    clip_coef: float,
    ent_coef: float,
    vf_coef: float,
    norm_adv: bool,
    critic_only: bool = False,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Clipped-surrogate PPO loss on a minibatch of single steps, each with its stored memory.

    Args:
        model: :class:`GTrXLModel` with ``critic="value"``.
        mb: ``x (B, input_dim)``, ``pos (B,)``, ``mem (B, L, M, D)``, ``mem_pos/mem_valid/mem_seg
            (B, M)``, ``episode (B,)``, ``actions (B, A) or (B,)``, ``logp (B,)``, ``adv (B,)``,
            ``returns (B,)``.
        critic_only: train only the value head, on detached features (the critic warm-up of
            fine-tuning: encoder and actor keep their offline weights).

    Returns:
        (loss, logs): L = L_clip - ent_coef * H + vf_coef * 0.5 (V - R)^2 (Schulman et al. 2017,
        eq. 9); with ``critic_only``, vf_coef * 0.5 (V - R)^2. With ``norm_adv`` the advantages
        are normalised first (:func:`normalize_advantages`).

    Under DDP each rank holds an equal-sized shard of the global minibatch: every term is a mean
    over the shard (so DDP's gradient average is the mean over the global minibatch) and the
    advantages are normalised with the global minibatch's statistics, so W processes compute
    the gradient one process computes on the whole minibatch.
    """
    enc = model.encoder
    state = state_from_rows(mb["mem"], mb["mem_pos"], mb["mem_valid"], mb["mem_seg"], mb["episode"], mb["pos"])
    out = enc(mb["x"][:, None], mb["pos"][:, None], state=state)
    h = out.features[:, 0]  # (B, D)
    logp = model.actor.log_prob(h, mb["actions"])
    entropy = model.actor.entropy(h).mean()
    value = model.state_value(h.detach() if critic_only else h)
    log_ratio = logp - mb["logp"]
    ratio = log_ratio.exp()
    adv = mb["adv"]
    if norm_adv:
        adv = normalize_advantages(adv)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)).mean()
    v_loss = 0.5 * (value - mb["returns"]).pow(2).mean()
    if critic_only:
        loss = vf_coef * v_loss
    else:
        loss = pg - ent_coef * entropy + vf_coef * v_loss + sum(out.aux.values(), torch.zeros((), device=h.device))
    with torch.no_grad():
        logs = {
            "loss_policy": pg.detach(),
            "loss_value": v_loss.detach(),
            "entropy": entropy.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean().detach(),
            "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
        }
        logs.update(gate_logs(out.metrics))
    return loss, logs


#: the backbone's dropout probabilities (``ffn_dropout`` None = ``dropout``), set to 0 for PPO
DROPOUT_KEYS = ("dropout", "attn_dropout", "ffn_dropout")


def without_dropout(backbone: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``backbone`` (a plain backbone config dict) with every dropout probability 0, and the
    settings in effect that were not 0 (``["backbone.dropout=0.1", ...]``; a missing key is
    :class:`~rl_tformers.backbone_config.BackboneConfig`'s default; ``ffn_dropout`` only when set).

    PPO trains the network it acts with: with dropout the rollout's log-probabilities and
    values come from one dropout mask and the update recomputes them under another, so the
    first update's importance ratio is not 1 and the clip acts on dropout noise (the N+
    implementation details of RLHF with PPO, Huang et al. 2024, disable dropout for this
    reason; CleanRL's PPO networks have none). So the PPO model is built with none at all.

    Raises:
        ValueError: the backbone config is invalid (as :class:`~rl_tformers.backbone_config.BackboneConfig`
            says, naming the key), before any value is replaced.
    """
    from rl_tformers.backbone_config import BackboneConfig

    cfg = BackboneConfig.from_dict(backbone, where="backbone")  # validated values in effect
    in_effect = {"dropout": cfg.dropout, "attn_dropout": cfg.attn_dropout}
    if cfg.ffn_dropout is not None:
        in_effect["ffn_dropout"] = cfg.ffn_dropout
    turned_off = [f"backbone.{k}={v:g}" for k, v in in_effect.items() if v > 0]
    return {**backbone, **dict.fromkeys(DROPOUT_KEYS, 0.0)}, turned_off


def fine_tune_backbone_changes(configured: Mapping[str, Any], offline: Mapping[str, Any], path: str) -> list[str]:
    """The ``backbone.*`` settings of the config that fine-tuning ignores.

    PPO fine-tunes the offline encoder itself, so its backbone is the checkpoint's; a configured
    setting that differs (an override such as ``backbone.block.gate=highway``) is not what runs,
    although ``config.yaml`` records it. Dropout probabilities are left out (PPO trains without
    dropout either way).

    Returns:
        ``["backbone.block.gate='highway' (the checkpoint's: 'gru')", ...]``, empty when they agree.
    """
    from rl_tformers.backbone_config import BackboneConfig

    def flat(d: Mapping[str, Any], prefix: str = "backbone") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}.{k}"))
            elif k not in DROPOUT_KEYS:
                out[f"{prefix}.{k}"] = v
        return out

    want = flat(BackboneConfig.from_dict(configured, where="backbone").to_dict())
    have = flat(BackboneConfig.from_dict(offline, where=f"backbone of agent.init_checkpoint={path}").to_dict())
    return [f"{k}={want.get(k)!r} (the checkpoint's: {have.get(k)!r})" for k in sorted(set(want) | set(have))
            if want.get(k) != have.get(k)]


#: agent option -> the GTrXLConfig field a fine-tune takes from the offline checkpoint instead
FINE_TUNE_INPUTS = {"prev_action": "prev_action_input", "prev_reward": "prev_reward_input", "head_hidden": "head_hidden"}


def fine_tune_input_changes(configured: Mapping[str, Any], offline: Mapping[str, Any]) -> list[str]:
    """The ``agent.*`` settings of the config that fine-tuning ignores.

    PPO fine-tunes the offline encoder and actor, so their inputs (``prev_action``,
    ``prev_reward``) and the actor head (``head_hidden``) are the checkpoint's, and the inputs are
    normalised with its observation statistics whatever ``agent.obs_norm`` says; a configured value
    that differs (``head_hidden: 64`` of ``ppo_cartpole.yaml`` over an offline run's 0) is not what
    runs, although ``config.yaml`` records it.

    Args:
        configured: the ``agent`` config.
        offline: the model inputs read from the checkpoint (``prev_action_input``, ...).

    Returns:
        ``["agent.head_hidden=64 (the checkpoint's: 0)", ...]``, empty when they agree.
    """
    out = []
    for key, field_name in FINE_TUNE_INPUTS.items():
        want = int(configured.get(key)) if key == "head_hidden" else bool(configured.get(key))
        have = offline[field_name]
        if want != have:
            out.append(f"agent.{key}={want!r} (the checkpoint's: {have!r})")
    if not configured.get("obs_norm", True):
        out.append("agent.obs_norm=False (the checkpoint's observation statistics normalise the observations)")
    return out


def _spaces(obs_dim: int, act_dim: int, discrete: bool) -> str:
    return f"{obs_dim}-dim observations and " + (f"{act_dim} discrete actions" if discrete
                                                 else f"{act_dim}-dim continuous actions")


def check_offline_spaces(offline: Mapping[str, Any], path: str, env_id: str, obs_dim: int, act_dim: int,
                         discrete: bool, low: np.ndarray | None, high: np.ndarray | None, action_start: int) -> None:
    """Refuse to fine-tune an offline run in an environment whose spaces its encoder and actor do not fit.

    Args:
        offline: the offline checkpoint's ``extra`` (its ``model`` config and dataset statistics).
        path: ``agent.init_checkpoint``.
        env_id: ``agent.env_id``; obs_dim, act_dim, discrete, low, high, action_start: its spaces.

    Raises:
        ValueError: naming both options, when the flat observation size, the kind of action
            (discrete or continuous) or the number of actions / action size differ. (A continuous
            offline actor used to be loaded silently as the logits of a discrete one of the same size;
            other mismatches failed with a list of parameter names.)

    Warns:
        UserWarning: same sizes but other continuous action bounds or another first discrete action:
            the actor's actions (normalised to [-1, 1], or class indices) mean other environment
            actions than in the offline data.
    """
    model = dict(offline.get("model") or {})
    have = tuple(model.get(k, offline.get(k)) for k in ("obs_dim", "act_dim", "discrete"))
    if any(v is None for v in have):
        return  # (no record of the offline spaces: the parameter shapes are checked when they are copied)
    off_obs, off_act, off_discrete = int(have[0]), int(have[1]), bool(have[2])
    off_env = offline.get("env_id") or "its dataset's environment"
    if (off_obs, off_act, off_discrete) != (obs_dim, act_dim, discrete):
        raise ValueError(
            f"agent.init_checkpoint={path} was trained on {off_env} with {_spaces(off_obs, off_act, off_discrete)}, "
            f"but agent.env_id={env_id} has {_spaces(obs_dim, act_dim, discrete)}; PPO fine-tunes that run's encoder "
            f"and actor, which take and give exactly those: set agent.env_id to the offline run's environment (or "
            f"one with the same spaces), or start PPO without agent.init_checkpoint")
    if discrete:
        off_start = int(offline.get("action_start", 0) or 0)
        if off_start != action_start:
            warnings.warn(
                f"agent.init_checkpoint={path}: its actor's class k was action {off_start} + k of {off_env}; in "
                f"agent.env_id={env_id} class k is action {action_start} + k", UserWarning, stacklevel=3)
        return
    off_low, off_high = offline.get("action_low"), offline.get("action_high")
    if off_low is None or off_high is None or low is None or high is None:
        return
    off_low = np.asarray(torch.as_tensor(off_low).cpu(), np.float32).reshape(-1)
    off_high = np.asarray(torch.as_tensor(off_high).cpu(), np.float32).reshape(-1)
    if not (np.array_equal(off_low, low) and np.array_equal(off_high, high)):
        warnings.warn(
            f"agent.init_checkpoint={path}: its actor's actions in [-1, 1] were the bounds [{off_low.tolist()}, "
            f"{off_high.tolist()}] of {off_env}; agent.env_id={env_id} maps them to its bounds [{low.tolist()}, "
            f"{high.tolist()}], so the fine-tuned policy starts from other actions than the offline one",
            UserWarning, stacklevel=3)


class EpisodeLengthError(ConfigError):
    """An episode ran past ``backbone.max_position`` (learned positions) in an environment
    without a time limit: raised at the rollout step that would need the missing table row
    (:meth:`GTrXLPPO._check_positions`). A :class:`~rl_tformers.runtime.run_config.ConfigError`, so
    ``rl-tformers train`` reports it as one ``error:`` line (exit status 2)."""


class GTrXLPPO:
    """PPO-GTrXL (the runtime's ``Trainable``); see the module docstring.

    Args:
        cfg: resolved run config (``agent`` as in :data:`PPO_DEFAULTS`, ``backbone``, ``train``, ``eval``, ``seed``).
        run_dir: run directory (unused).
        device: training device.

    Raises:
        ValueError: rollout or loss options out of range (:class:`PPOAgentConfig`, before any
            environment is made), unsupported spaces (Box observations and Discrete or bounded
            Box actions only), a learned position table without a row for every step up to and
            including the environment's time limit (``backbone.max_position`` <= the limit: the
            final observation of a truncated episode is valued at step ``time limit``), an
            ``agent.init_checkpoint`` trained on other spaces than ``agent.env_id``'s
            (:func:`check_offline_spaces`) or with ``plugins`` this run does not list
            (:func:`~rl_tformers.runtime.plugins.check_source_plugins`).

    Warns:
        ConfigAdviceWarning: the backbone sets a dropout probability; PPO builds its model
            without dropout (:func:`without_dropout`). ``train.amp=bf16`` (the ratio does not start
            at 1); ``backbone.memory.detach=false`` (no effect). Fine-tuning: an agent input or head option
            that differs from the checkpoint's (:func:`fine_tune_input_changes`).
        UserWarning: fine-tuning with a ``backbone.*`` setting that differs from the
            checkpoint's (:func:`fine_tune_backbone_changes`).
    """

    #: Each rank's minibatches are its own share of the global minibatch (the trainer does not
    #: shard them under DDP; see the module docstring).
    local_batches = True
    #: Counters the trainer logs at their latest value, not averaged over its logging window.
    latest_logs = ("env_steps",)

    def __init__(self, cfg: Any, run_dir: Path | None, device: torch.device | str,
                 extra: Mapping[str, Any] | None = None) -> None:
        a = PPOAgentConfig.from_dict({k: v for k, v in _plain(cfg.agent).items() if k != "kind"}, where="agent")
        if extra is None:
            a.check_world_size(dist_info().world_size)
            amp = dict(cfg.get("train") or {}).get("amp", "none")
            if str(getattr(amp, "value", amp)) == "bf16":
                warnings.warn(
                    "gtrxl_ppo with train.amp=bf16: the rollout acts in float32 (the trainer's autocast covers only "
                    "the update) and the update recomputes each sample's log-probability under bfloat16 autocast, so "
                    "PPO's ratio does not start at 1 and the clip acts on rounding noise (first-minibatch "
                    "log-probabilities differed by up to 3e-3 in a 32-wide model; collecting under the same "
                    "autocast by up to 8e-3, as bfloat16 rounding depends on the batch's shape); set "
                    "train.amp=none for ratios that start at 1", ConfigAdviceWarning, stacklevel=2)
        self.cfg, self.a = cfg, a
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.env_id, self.env_kwargs = str(a.env_id), dict(a.env_kwargs or {})
        probe = gym.make(self.env_id, **self.env_kwargs)
        obs_space, act_space = probe.observation_space, probe.action_space
        time_limit = None if probe.spec is None else probe.spec.max_episode_steps
        probe.close()
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(f"gtrxl_ppo: needs a Box observation space, {self.env_id} has {obs_space}")
        self.discrete = isinstance(act_space, gym.spaces.Discrete)
        self.action_start = int(act_space.start) if self.discrete else 0  # env action = class index + start
        self.action_shape: tuple[int, ...] = ()  # one environment's action: () discrete, the Box's shape
        if self.discrete:
            act_dim, self.low, self.high = int(act_space.n), None, None
        elif isinstance(act_space, gym.spaces.Box) and np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all():
            act_dim = int(np.prod(act_space.shape))
            self.action_shape = tuple(int(k) for k in act_space.shape)
            self.low = np.asarray(act_space.low, np.float32).reshape(-1)
            self.high = np.asarray(act_space.high, np.float32).reshape(-1)
        else:
            raise ValueError(f"gtrxl_ppo: needs Discrete or bounded Box actions, {self.env_id} has {act_space}")
        obs_dim = int(np.prod(obs_space.shape))
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.update_obs_stats = bool(a.obs_norm)
        # normalise (and clip to +-OBS_CLIP) the inputs: with running statistics (obs_norm), or with the
        # offline run's when fine-tuning; otherwise the raw observations, never clipped (pixels of 0..255
        # used to be clipped to 10 with obs_norm=false)
        self.normalize_obs = bool(a.obs_norm) or bool(a.init_checkpoint)
        backbone = _plain(cfg.backbone)
        inputs = {"prev_action_input": bool(a.prev_action), "prev_reward_input": bool(a.prev_reward),
                  "head_hidden": int(a.head_hidden)}
        init_state = None
        # a resumed fine-tuning run rebuilds its own model from its checkpoint, never agent.init_checkpoint
        # read again (that run may have been retrained, moved or deleted since)
        resumed = resume_state() if extra is None and a.init_checkpoint else None
        own_model = dict((resumed or {}).get("extra") or {}).get("model")
        if extra is not None:  # inference from a checkpoint: its own model config
            self.model_cfg = GTrXLConfig(**extra["model"])
        elif own_model is not None:
            self.model_cfg = GTrXLConfig(**own_model)
        else:
            if a.init_checkpoint:
                configured = backbone
                init_state, backbone, inputs = self._read_offline(str(a.init_checkpoint))
                check_offline_spaces(init_state.get("extra") or {}, str(a.init_checkpoint), self.env_id, obs_dim,
                                     act_dim, self.discrete, self.low, self.high, self.action_start)
                ignored = fine_tune_backbone_changes(configured, backbone, str(a.init_checkpoint))
                if ignored:
                    warnings.warn(
                        f"agent.init_checkpoint={a.init_checkpoint}: PPO fine-tunes that run's encoder, so it runs the "
                        f"checkpoint's backbone and ignores the config's {'; '.join(ignored)} (config.yaml still "
                        f"records them); to train another backbone online, start PPO without agent.init_checkpoint",
                        UserWarning, stacklevel=2)
                ignored = fine_tune_input_changes(a, inputs)
                if ignored:
                    warnings.warn(
                        f"agent.init_checkpoint={a.init_checkpoint}: PPO fine-tunes that run's encoder and actor, so "
                        f"it builds them with the checkpoint's inputs and actor head and ignores the config's "
                        f"{'; '.join(ignored)} (config.yaml still records them); set them to the checkpoint's values "
                        f"to silence this", ConfigAdviceWarning, stacklevel=2)
            # the backbone PPO will run: the config's, or the offline run's when fine-tuning (whose
            # compressive/kNN memory, or plain window, used to pass and crash the first rollout)
            mem_kind = dict(backbone.get("memory") or {}).get("kind", "none")
            if mem_kind != "xl":
                src = (f"agent.init_checkpoint={a.init_checkpoint} was trained with backbone.memory.kind="
                       f"{mem_kind!r}" if a.init_checkpoint else f"backbone.memory.kind={mem_kind!r}")
                raise ValueError(
                    f"gtrxl_ppo: {src}; PPO stores the memory of every rollout step and needs the fixed-size "
                    f"'xl' memory (offline agent.kind=gtrxl takes any stateful memory kind)"
                )
            backbone, turned_off = without_dropout(backbone)
            if turned_off:
                src = (f" (the backbone of agent.init_checkpoint={a.init_checkpoint})" if a.init_checkpoint else "")
                warnings.warn(
                    f"gtrxl_ppo trains without dropout: {', '.join(turned_off)}{src} set to 0. With dropout the "
                    f"update would recompute each sample's log-probability under another dropout mask than the "
                    f"rollout's, so PPO's ratio would not start at 1 and its clip would act on dropout noise; "
                    f"set {'it' if len(turned_off) == 1 else 'them'} to 0 to silence this", ConfigAdviceWarning,
                    stacklevel=2)
            if dict(backbone.get("memory") or {}).get("detach", True) is False:
                src = (f" (the backbone of agent.init_checkpoint={a.init_checkpoint})" if a.init_checkpoint else "")
                warnings.warn(
                    f"gtrxl_ppo: backbone.memory.detach=false{src} has no effect: the update recomputes each rollout "
                    f"step as one query over the memory that step acted with, stored by the rollout (collected "
                    f"without gradient), so no gradient reaches the memory, as with detach=true", ConfigAdviceWarning,
                    stacklevel=2)
            self.model_cfg = GTrXLConfig(obs_dim=obs_dim, act_dim=act_dim, discrete=self.discrete, backbone=backbone,
                                         critic="value", **inputs)
        self.model = GTrXLModel(self.model_cfg).to(self.device)
        limit = position_limit(self.model)
        #: rows of the learned position table (None: no table); checked at every rollout step
        self.position_limit = limit
        self.time_limit = time_limit
        # positions are episode steps 0..time_limit - 1, and a time-limit truncation bootstraps
        # V(final observation) at step time_limit: the table needs time_limit + 1 rows
        if extra is None and limit is not None and time_limit is not None and time_limit >= limit:
            src = (f" (the table of agent.init_checkpoint={a.init_checkpoint})" if a.init_checkpoint else "")
            raise ValueError(
                f"backbone.max_position={limit}{src} but {self.env_id} episodes run up to {time_limit} steps and "
                f"a truncated episode's final observation is valued at step {time_limit} (the bootstrap of "
                f"time-limit cuts): the positions are episode steps, and backbone.position.kind=learned has no "
                f"table row past step {limit - 1}; set backbone.max_position >= {time_limit + 1} or use a "
                f"relative position kind (xl_relative)")
        if extra is None and limit is not None and time_limit is None and dist_info().is_main:
            log.warning("gtrxl_ppo: %s has no time limit and backbone.position.kind=learned has table rows for "
                        "episode steps 0..%d only (backbone.max_position=%d): an episode that runs longer stops "
                        "the run with an error; agent.env_kwargs.max_episode_steps=%d (or less) cuts the episodes "
                        "there (time-limit truncations, bootstrapped)", self.env_id, limit - 1, limit, limit - 1)
        self.reward_scale = float(a.reward_scale)
        # multiplier of the r_{t-1} input: reward_scale, or the offline run's when fine-tuning (its
        # encoder learned r_{t-1} in those units; agent.reward_scale only scales the learning rewards)
        self.input_reward_mult = self.reward_scale
        if init_state is not None:
            self._load_offline(init_state)
        elif own_model is not None:  # the checkpoint restores the weights and the offline run's statistics
            self.update_obs_stats = False
        if extra is not None:
            self.load_extra_state(extra)
        self.n_envs, self.n_steps = int(a.n_envs), int(a.n_steps)
        #: critic-only updates (agent.critic_warmup) leave the encoder and actor without a gradient, as
        #: some backbones leave parts of theirs (needs_find_unused): under DDP the trainer must let
        #: DistributedDataParallel find them (else the next update fails)
        self.ddp_find_unused = a.critic_warmup > 0 or needs_find_unused(
            self.model.encoder.backbone.config)
        info = dist_info()  # under DDP (torchrun) every process collects its own rollouts
        self.rank, self.world_size = info.rank, info.world_size
        self.envs: gym.vector.VectorEnv | None = None
        self.returns_window: deque[float] = deque(maxlen=20)
        self.lengths_window: deque[float] = deque(maxlen=20)
        self.env_steps = 0  # of this process (each process collects the same number)
        self.rollouts = 0
        #: the rollout the updates are learning from and how many of its minibatches were served
        self._rollout: dict[str, Any] | None = None
        self._served = 0
        #: why a resume is not exact (None: it is); set by load_extra_state / load_process_state
        self._resume_problem: str | None = None
        self._envs_problem_logged = False

    # -- fine-tuning from an offline run ------------------------------------------------------
    def _read_offline(self, path: str) -> tuple[dict, dict, dict]:
        """Checkpoint state, backbone config and input flags of an offline ``gtrxl`` run."""
        import yaml

        from rl_tformers.runtime.checkpoint import find_latest_valid, load_checkpoint

        p = Path(path)
        if not p.exists():
            raise ValueError(
                f"agent.init_checkpoint={path}: no such run directory or checkpoint file; train the offline gtrxl run "
                f"there first (agent.kind=gtrxl, objective bc or iql: e.g. `rl-tformers train -c "
                f"gtrxl/cartpole_positions_bc run_dir={path}` for configs/gtrxl/ppo_cartpole_finetune.yaml)")
        state = find_latest_valid(p).state if p.is_dir() else load_checkpoint(p)
        saved = yaml.safe_load(state["config"])
        sa = saved.get("agent", {})
        if sa.get("kind") != "gtrxl" or sa.get("objective") == "rcbc":
            raise ValueError(f"agent.init_checkpoint={path}: needs an offline gtrxl run with objective bc or iql, "
                             f"got kind={sa.get('kind')!r} objective={sa.get('objective')!r}")
        # its backbone may name kinds of its plugins: this run lists them too (eval, resume)
        check_source_plugins(saved, self.cfg.get("plugins"), f"agent.init_checkpoint={path}")
        inputs = {"prev_action_input": bool(sa.get("prev_action")), "prev_reward_input": bool(sa.get("prev_reward")),
                  "head_hidden": int(sa.get("head_hidden", 0)),
                  # how its encoder read a discrete a_{t-1} at an episode start (zeros, or action 0 before
                  # the field existed): the fine-tuned rollouts feed it the same way
                  "prev_action_zero_at_start": bool(dict(state.get("extra") or {}).get("model", {})
                                                    .get("prev_action_zero_at_start", False))}
        return state, saved["backbone"], inputs

    def _load_offline(self, state: Mapping[str, Any]) -> None:
        """Copy the offline encoder and actor; keep the fresh value head; use its obs statistics and
        its r_{t-1} input multiplier."""
        own = self.model.state_dict()
        take = {k: v for k, v in state["model"].items()
                if (k.startswith("encoder.") or k.startswith("actor.")) and k in own and own[k].shape == v.shape}
        missing = [k for k in own if (k.startswith("encoder.") or k.startswith("actor.")) and k not in take]
        if missing:
            raise ValueError(f"agent.init_checkpoint: the offline model does not match here; missing {missing[:5]}")
        self.model.load_state_dict(take, strict=False)
        ex = state["extra"]
        self.obs_rms.mean = np.asarray(ex["obs_mean"], np.float64)
        self.obs_rms.var = np.asarray(ex["obs_std"], np.float64) ** 2 - 1e-8
        self.update_obs_stats = False  # keep the statistics the encoder was trained with
        self.input_reward_mult = float(ex.get("reward_mult", self.reward_scale))  # and its r_{t-1} units

    # -- rollouts -------------------------------------------------------------------------------
    def _vector_env(self, envs: list[gym.Env] | None = None) -> gym.vector.SyncVectorEnv:
        """The N environments stepped together: new ones, or ``envs`` (restored by a resume)."""
        fns = ([lambda: gym.make(self.env_id, **self.env_kwargs) for _ in range(self.n_envs)] if envs is None
               else [lambda e=e: e for e in envs])
        return gym.vector.SyncVectorEnv(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def _make_envs(self) -> None:
        self.envs = self._vector_env()
        # under DDP each process runs its own N environments: rank r resets them with seeds after rank r - 1's
        first = self.seed * 10_000 + self.rank * self.n_envs
        obs, _ = self.envs.reset(seed=[first + i for i in range(self.n_envs)])
        dev, enc = self.device, self.model.encoder
        self.obs = obs
        self.memory = enc.initial_state(self.n_envs, dev)
        a_shape = (self.n_envs,) if self.discrete else (self.n_envs, self.model_cfg.act_dim)
        self.prev_a = torch.zeros(a_shape, dtype=torch.long if self.discrete else torch.float32, device=dev)
        self.prev_r = torch.zeros(self.n_envs, device=dev)
        self.t = torch.zeros(self.n_envs, dtype=torch.long, device=dev)
        self.start = torch.ones(self.n_envs, dtype=torch.bool, device=dev)
        self.ep_ret = np.zeros(self.n_envs)
        self.ep_len = np.zeros(self.n_envs, dtype=np.int64)

    def _norm_obs(self, obs: np.ndarray) -> Tensor:
        """(N, *obs_shape) raw -> (N, O) float32 inputs: normalised and clipped to +-OBS_CLIP
        (:attr:`normalize_obs`), else the raw values."""
        o = np.asarray(obs, np.float64).reshape(len(obs), -1)
        if self.normalize_obs:
            o = np.clip((o - self.obs_rms.mean) / self.obs_rms.std, -OBS_CLIP, OBS_CLIP)
        return torch.as_tensor(o, dtype=torch.float32, device=self.device)

    def _to_env(self, a: Tensor) -> np.ndarray:
        """(N,) class indices or (N, A) normalised actions -> the environments' actions: (N,) int64
        or (N, *action_shape) float32 within the Box (a (2, 2) Box gets (N, 2, 2), not (N, 4))."""
        if self.discrete:
            return a.cpu().numpy().astype(np.int64) + self.action_start
        low, high = (torch.as_tensor(b, device=a.device) for b in (self.low, self.high))
        env_a = to_env_action(a.clamp(-1.0, 1.0), low, high).cpu().numpy().astype(np.float32)  # (N, A)
        return env_a.reshape(len(env_a), *self.action_shape)

    def _start_prev_a(self, prev_a: Tensor, keep: Tensor) -> Tensor:
        """a_{t-1} input with an episode start's ``keep`` False: zeros (continuous), action 0's index
        (discrete, as PPO from scratch always fed it) or -1, the zero vector, for an encoder built
        with ``prev_action_zero_at_start`` (fine-tuned from an offline run that learned that)."""
        if self.discrete and self.model_cfg.prev_action_zero_at_start:
            return torch.where(keep, prev_a, torch.full_like(prev_a, -1))
        return prev_a * keep.to(prev_a.dtype)

    def _step_inputs(self, obs: np.ndarray, prev_a: Tensor, prev_r: Tensor) -> Tensor:
        return self.model.encoder.inputs(self._norm_obs(obs)[:, None], None, prev_a[:, None], prev_r[:, None])[:, 0]

    def _check_positions(self, pos: Tensor, rows: Tensor | None = None, final: bool = False) -> None:
        """Refuse episode steps past the learned position table, before the forward that would need them.

        Args:
            pos: (N,) the episode step (position) of each environment's next token.
            rows: (N,) bool, the rows that will be run (None: all).
            final: the positions are those of truncated episodes' final observations (the bootstrap).

        Raises:
            EpisodeLengthError: a row's step is ``>= backbone.max_position`` (only possible in an
                environment without a time limit: one with a limit was checked when the agent was
                built). The message names the option, the environment, the step reached and the fix.
        """
        limit = self.position_limit
        if limit is None:
            return
        over = pos >= limit
        if rows is not None:
            over = over & rows
        if not bool(over.any()):  # (one host sync per step; the environments step on the host anyway)
            return
        i = int(over.nonzero()[0, 0])
        step = int(pos[i])
        env = f"environment {i} of {self.n_envs}" + (f" on rank {self.rank}" if self.world_size > 1 else "")
        what = (f"an episode of {self.env_id} ({env}) was truncated by the environment after {step} steps and its "
                f"final observation would be valued at episode step {step} (the bootstrap of truncations)" if final
                else f"an episode of {self.env_id} ({env}) reached episode step {step}")
        limits = ("has no time limit" if self.time_limit is None
                  else f"has a time limit of {self.time_limit} steps")  # (not reached: checked at build)
        msg = (f"gtrxl_ppo: {what} in rollout {self.rollouts + 1}, but backbone.position.kind=learned has table "
               f"rows for episode steps 0..{limit - 1} only (backbone.max_position={limit}) and {self.env_id} "
               f"{limits}. The run stopped before training on this rollout; the checkpoints it wrote are intact "
               f"(--resume continues exactly from the last one, and would meet this episode again). Fix it in a "
               f"new run: agent.env_kwargs.max_episode_steps={limit - 1} (or less: a time limit whose cuts are "
               f"bootstrapped), backbone.max_position > the longest episode, or a relative position kind "
               f"(backbone.position.kind=xl_relative)")
        if self.rank != 0:  # the command line prints rank 0's errors only
            log.error("%s", msg)
        raise EpisodeLengthError(msg)

    @torch.no_grad()
    def collect(self) -> dict[str, Tensor]:
        """One rollout of S steps in N environments with the current weights.

        Returns:
            dict of (S, N, ...) tensors (``x``, ``pos``, ``mem`` (S, N, L, M, D), ``mem_pos``,
            ``mem_valid``, ``mem_seg``, ``episode``, ``actions``, ``logp``, ``values``,
            ``rewards``, ``dones``) plus ``adv``/``returns`` from :func:`compute_gae` and
            ``stats`` (floats for logging).
        """
        if self.envs is None:
            self._make_envs()
        model, enc, dev = self.model, self.model.encoder, self.device
        s_len, n = self.n_steps, self.n_envs
        buf: dict[str, list[Tensor]] = {k: [] for k in (
            "x", "pos", "mem", "mem_pos", "mem_valid", "mem_seg", "episode", "actions", "logp", "values", "rewards",
            "dones")}
        raw_obs = []
        for _ in range(s_len):  # one batched forward per step for all N environments
            start = self.start
            memory = enc.reset_state(self.memory, start)
            keep = (~start).view(-1, *([1] * (self.prev_a.dim() - 1)))
            prev_a = self._start_prev_a(self.prev_a, keep)
            prev_r = self.prev_r * (~start)
            t = self.t * (~start)
            self._check_positions(t)
            x = self._step_inputs(self.obs, prev_a, prev_r)  # (N, input_dim)
            out = enc(x[:, None], t[:, None], state=memory)
            h = out.features[:, 0]
            dist = model.actor.dist(h)
            action = dist.sample()
            logp = dist.log_prob(action) if self.discrete else dist.log_prob(action).sum(-1)
            value = model.state_value(h)
            # the a_{t-1} input is the action the environment took: the sample clamped to [-1, 1]
            # (as GTrXLPolicy.act feeds it); log-probabilities stay those of the unclamped sample
            taken = action if self.discrete else action.clamp(-1.0, 1.0)
            raw_obs.append(self.obs)
            obs, reward, term, trunc, info = self.envs.step(self._to_env(action))
            r = torch.as_tensor(reward, dtype=torch.float32, device=dev) * self.reward_scale
            r_in = torch.as_tensor(reward, dtype=torch.float32, device=dev) * self.input_reward_mult  # r_t input
            trunc_t = torch.as_tensor(trunc & ~term, device=dev)
            if trunc_t.any():  # bootstrap time-limit cuts with V(final obs) and the episode's memory
                final = obs.copy()
                idx = np.flatnonzero(info["_final_obs"])
                final[idx] = np.stack(info["final_obs"][idx])
                self._check_positions(t + 1, trunc_t, final=True)
                a_in = taken.view(n, *self.prev_a.shape[1:]).to(self.prev_a.dtype)
                xf = self._step_inputs(final, a_in, r_in)
                hf = enc(xf[:, None], (t + 1)[:, None], state=out.state).features[:, 0]
                r = r + self.cfg.agent.gamma * model.state_value(hf) * trunc_t
            done = torch.as_tensor(term | trunc, device=dev)
            buf["x"].append(x)
            buf["pos"].append(t)
            buf["mem"].append(torch.stack([ls.memory for ls in memory.layers], 1))  # (N, L, M, D)
            buf["mem_pos"].append(memory.pos)
            buf["mem_valid"].append(memory.valid)
            buf["mem_seg"].append(memory.seg)
            buf["episode"].append(memory.episode)
            buf["actions"].append(action)
            buf["logp"].append(logp)
            buf["values"].append(value)
            buf["rewards"].append(r)
            buf["dones"].append(done)
            # episode bookkeeping (numpy, vectorised over environments)
            self.ep_ret += reward
            self.ep_len += 1
            d = np.asarray(term | trunc)
            self.returns_window.extend(self.ep_ret[d].tolist())
            self.lengths_window.extend(self.ep_len[d].astype(float).tolist())
            self.ep_ret[d] = 0.0
            self.ep_len[d] = 0
            self.memory, self.prev_a, self.prev_r, self.t, self.start = out.state, taken, r_in, t + 1, done
            self.obs = obs
        # bootstrap value of the observation after the rollout
        self._check_positions(self.t * (~self.start))
        memory = enc.reset_state(self.memory, self.start)
        keep = (~self.start).view(-1, *([1] * (self.prev_a.dim() - 1)))
        x = self._step_inputs(self.obs, self._start_prev_a(self.prev_a, keep), self.prev_r * (~self.start))
        with record_attention(enc) as weights:
            last = enc(x[:, None], (self.t * (~self.start))[:, None], state=memory, need_weights=True)
        last_value = model.state_value(last.features[:, 0])
        ro = {k: torch.stack(v) for k, v in buf.items()}
        ro["adv"], ro["returns"] = compute_gae(
            ro["rewards"], ro["values"], ro["dones"], last_value, float(self.a.gamma), float(self.a.gae_lambda))
        self.env_steps += s_len * n
        self.rollouts += 1
        stats = {"env_steps": float(self.env_steps * self.world_size)}  # of every process
        if self.returns_window:
            stats["episodic_return"] = float(np.mean(self.returns_window))
            stats["episodic_length"] = float(np.mean(self.lengths_window))
        for i, w in enumerate(weights):
            stats[f"attention_entropy/layer{i}"] = float(attention_entropy(w))
        ro["stats"] = stats
        if self.update_obs_stats:
            self.obs_rms.update(self._rollout_observations(np.stack(raw_obs)))
        return ro

    def _rollout_observations(self, raw: np.ndarray) -> np.ndarray:
        """The observations the running statistics learn from: (S, N, *obs_shape) -> (S x N, O).

        Under DDP every rank's rollout, gathered in the order one process with ``W x n_envs``
        environments (rank r's after rank r - 1's) would see them: (S, W, N, O) flattened. So every
        rank keeps the same statistics, those of one process (each rank updating with its own
        rollout only made the ranks normalise their inputs differently and checkpoint rank 0's).
        """
        from rl_tformers.runtime.distributed import is_active

        s, n = raw.shape[:2]
        flat = np.asarray(raw, np.float64).reshape(s, n, -1)  # (S, N, O)
        if not is_active():
            return flat.reshape(s * n, -1)
        import torch.distributed as dist

        mine = torch.as_tensor(flat, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        return torch.stack(parts, 1).reshape(-1, flat.shape[-1]).cpu().numpy()  # (S, W, N, O) -> (S W N, O)

    def minibatches(self, ro: Mapping[str, Any], skip: int = 0) -> Iterator[dict[str, Any]]:
        """``n_epochs`` passes over the rollout's S x N samples in ``n_minibatches`` random minibatches.

        The permutation of epoch e is drawn from ``default_rng([seed, rollouts, e])`` (a pure
        function of the rollout's number), so ``skip`` (the first minibatches, already trained on
        before a resume) leaves the rest unchanged.
        """
        total = self.n_steps * self.n_envs
        flat = {k: v.flatten(0, 1) for k, v in ro.items() if isinstance(v, Tensor)}  # (S * N, ...)
        n_mb = int(self.a.n_minibatches)
        served = 0
        for epoch in range(int(self.a.n_epochs)):
            perm = np.random.default_rng([self.seed, self.rollouts, epoch]).permutation(total)
            for idx in np.array_split(perm, n_mb):
                served += 1
                if served <= skip:
                    continue
                ix = torch.as_tensor(idx, device=self.device)
                mb = {k: v[ix] for k, v in flat.items()}
                mb["stats"] = ro["stats"]
                mb["critic_only"] = self.rollouts <= int(self.a.critic_warmup)
                yield mb

    # -- Trainable -----------------------------------------------------------------------------
    @property
    def updates_per_rollout(self) -> int:
        """Updates that learn from one rollout (``n_epochs x n_minibatches``): the trainer redraws
        random attention features (Performer/RFA/LSH ``redraw_every``) only between rollouts."""
        return int(self.a.n_epochs) * int(self.a.n_minibatches)

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]:
        """Endless stream of minibatches; a new rollout every ``n_epochs x n_minibatches`` updates.

        Rollouts start at updates that are multiples of U = ``updates_per_rollout``. Resuming at
        ``start_step`` after update j = ``start_step % U`` of a rollout, the stream first serves
        the last U - j minibatches of the checkpointed rollout (:meth:`load_process_state`), then
        collects the next one from the restored environments: the same minibatches, in the same
        order, as the uninterrupted run. Without a checkpointed rollout (a checkpoint written
        before this was saved) a fresh rollout feeds those U - j updates (see the module docstring).
        """
        skip = int(start_step) % self.updates_per_rollout

        def stream() -> Iterator[dict[str, Any]]:
            if skip:
                saved = self._rollout is not None and self._served == skip
                yield from self._serve(self._rollout if saved else self.collect(), skip)
            while True:
                yield from self._serve(self.collect(), 0)

        return stream()

    def _serve(self, ro: dict[str, Any], skip: int) -> Iterator[dict[str, Any]]:
        """The minibatches of ``ro`` after the first ``skip``, keeping count for :meth:`process_state`."""
        self._rollout, self._served = ro, skip
        for mb in self.minibatches(ro, skip):
            self._served += 1  # counted when handed over: a checkpoint follows the update on it
            yield mb
        self._rollout = None  # (before the next rollout is collected: one rollout in memory)

    def resume_note(self, step: int) -> str | None:
        """The warning ``--resume`` prints when it is not bit-identical (None when it is).

        Exact when the checkpoint holds this process's environments (:meth:`process_state`);
        otherwise one line saying what is restored, what restarts and why.
        """
        problem = self._resume_problem
        if problem is None:
            return None
        u = self.updates_per_rollout
        j = step % u
        note = (f"resume of gtrxl_ppo (on-policy) at step {step} is not bit-identical to an uninterrupted run: "
                f"{problem}. The weights, optimiser, observation statistics and counters "
                f"(env_steps={self.env_steps * self.world_size}, rollouts={self.rollouts}) are restored; the "
                f"environments restart with fresh resets (and empty backbone memory)")
        if not j:
            return note + " and a fresh rollout"
        if self._rollout is not None and self._served == j:
            return note + (f" after updates {step + 1}..{step + u - j}, which learn from the last {u - j} "
                           f"minibatches of the checkpointed rollout {self.rollouts} exactly")
        return note + (f" with a fresh rollout: the run stopped after update {j} of the {u} of rollout "
                       f"{self.rollouts}, so updates {step + 1}..{step + u - j} learn from the last {u - j} "
                       f"minibatches of a fresh rollout and train/env_steps counts the "
                       f"{self.n_steps * self.n_envs * self.world_size} steps of the cut rollout too")

    def loss(self, batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor | float]]:
        """PPO loss of one minibatch (:func:`ppo_loss`) and the latest rollout statistics."""
        mb = {k: v.to(self.device) for k, v in batch.items() if isinstance(v, Tensor)}
        a = self.a
        loss, logs = ppo_loss(self.model, mb, clip_coef=float(a.clip_coef), ent_coef=float(a.ent_coef),
                              vf_coef=float(a.vf_coef), norm_adv=bool(a.norm_adv),
                              critic_only=bool(batch.get("critic_only", False)))
        logs.update(batch.get("stats", {}))
        return loss, logs

    def policy(self, deterministic: bool | None = None) -> GTrXLPolicy:
        """A :class:`GTrXLPolicy` of the current weights and observation statistics;
        ``deterministic`` defaults to ``agent.deterministic``."""
        det = bool(self.a.deterministic) if deterministic is None else deterministic
        norm = self.normalize_obs
        o = self.model_cfg.obs_dim
        return GTrXLPolicy(
            self.model, obs_mean=self.obs_rms.mean if norm else np.zeros(o), obs_std=self.obs_rms.std if norm else np.ones(o),
            action_low=self.low, action_high=self.high, reward_mult=self.input_reward_mult, deterministic=det,
            obs_clip=OBS_CLIP if norm else None,
            action_start=self.action_start, action_shape=None if self.discrete else self.action_shape,
        )

    def make_env(self):
        """Zero-argument factory ``gym.make(env_id, **env_kwargs)`` of the training environment."""
        env_id, kwargs = self.env_id, self.env_kwargs
        return lambda: gym.make(env_id, **kwargs)

    def default_targets(self) -> list[float | None]:
        """``[None]``: PPO is not return-conditioned."""
        return [None]

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean/std return of the deterministic policy over ``eval.episodes`` episodes."""
        was_training = self.model.training
        report = evaluate(self.policy(), self.make_env(), [None], episodes=int(self.cfg.eval.episodes),
                          n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step), env_id=self.env_id)
        self.model.train(was_training)
        return report_logs(report)

    def extra_state(self) -> dict[str, Any]:
        """Observation statistics, step counters (environment steps, rollouts), recent episode
        returns/lengths, reward multiplier, environment and model config for a checkpoint."""
        return {
            "obs_mean": torch.as_tensor(self.obs_rms.mean), "obs_var": torch.as_tensor(self.obs_rms.var),
            "obs_count": float(self.obs_rms.count), "env_steps": int(self.env_steps), "rollouts": int(self.rollouts),
            "recent_returns": [float(x) for x in self.returns_window],
            "recent_lengths": [float(x) for x in self.lengths_window],
            "input_reward_mult": float(self.input_reward_mult),
            "env_id": self.env_id, "env_kwargs": dict(self.env_kwargs), "model": model_config_dict(self.model_cfg),
        }

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore the observation statistics, step counters, reward multiplier and recent
        episode returns/lengths that :meth:`extra_state` saved (``--resume``)."""
        # until load_process_state says otherwise (a checkpoint without it: not exact)
        self._resume_problem = "the checkpoint holds no environment state (written before gtrxl_ppo saved it)"
        self.obs_rms.mean = np.asarray(state["obs_mean"], np.float64)
        self.obs_rms.var = np.asarray(state["obs_var"], np.float64)
        self.obs_rms.count = float(state["obs_count"])
        self.env_steps, self.rollouts = int(state["env_steps"]), int(state["rollouts"])
        self.input_reward_mult = float(state.get("input_reward_mult", self.reward_scale))
        if hasattr(self, "returns_window"):  # (an inference load restores before the windows exist)
            self.returns_window.clear()
            self.returns_window.extend(float(x) for x in state.get("recent_returns", ()))
            self.lengths_window.clear()
            self.lengths_window.extend(float(x) for x in state.get("recent_lengths", ()))

    # -- exact resume: this process's environments, running episodes and rollout -------------------
    def process_state(self) -> dict[str, Any]:
        """This process's running state, saved in every checkpoint (the trainer's per-process hook).

        Holds: the sub-environments of the vector environment, pickled (:func:`dump_envs`, as a
        uint8 tensor, so the checkpoint still loads with ``weights_only=True``; they are unpickled
        only by a resume) with the vector environment's autoreset bookkeeping; the running state
        of the N episodes (last observation, backbone memory, a_{t-1}, r_{t-1}, step, start flags,
        return and length so far); this process's recent episode returns and lengths; and,
        between the first and last update of a rollout, that rollout (every tensor of
        :meth:`collect`) with the number of its minibatches already trained on. An environment
        that cannot be pickled is left out, with the reason (logged once; a resume then restarts
        the environments and says so).
        """
        st: dict[str, Any] = {
            "version": PROCESS_STATE_VERSION, "n_envs": self.n_envs, "env_id": self.env_id,
            "recent_returns": [float(x) for x in self.returns_window],
            "recent_lengths": [float(x) for x in self.lengths_window],
            "started": self.envs is not None, "envs": None, "envs_problem": None, "rollout": None,
        }
        if 0 < self._served < self.updates_per_rollout and self._rollout is not None:
            ro = {k: v.cpu() for k, v in self._rollout.items() if isinstance(v, Tensor)}
            fifo = {k: fifo_encode(ro.pop(k), dim) for k, dim in _FIFO_KEYS.items()}
            st["rollout"] = {"tensors": ro, "fifo": fifo, "stats": dict(self._rollout["stats"]),
                             "served": int(self._served)}
        if self.envs is None:
            return st
        try:
            blob = dump_envs(self.envs.envs)
        except Exception as exc:  # noqa: BLE001 - any environment that does not pickle: say why, keep going
            st["envs_problem"] = f"the environments of {self.env_id} cannot be pickled ({type(exc).__name__}: {exc})"
            if not self._envs_problem_logged and self.rank == 0:
                log.warning("gtrxl_ppo: %s; checkpoints leave them out, so a --resume of this run restarts them "
                            "(not bit-identical)", st["envs_problem"])
                self._envs_problem_logged = True
            return st
        st["envs"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        st["vector"] = {k: torch.from_numpy(np.array(getattr(self.envs, k))) for k in _VECTOR_FIELDS}
        st["running"] = {
            "obs": torch.from_numpy(np.array(self.obs)), "memory": _state_dict_of(self.memory),
            "prev_a": self.prev_a.cpu(), "prev_r": self.prev_r.cpu(), "t": self.t.cpu(), "start": self.start.cpu(),
            "ep_ret": torch.from_numpy(np.array(self.ep_ret)), "ep_len": torch.from_numpy(np.array(self.ep_len)),
        }
        return st

    def load_process_state(self, states: list[Mapping[str, Any]] | None) -> None:
        """Restore this rank's :meth:`process_state` from a checkpoint's list of every rank's.

        Sets :attr:`_resume_problem` (None: the continuation is exact) when the environments
        cannot come back: no state in the checkpoint, another number of processes, another
        format, or environments that could not be pickled or unpickled. The checkpointed
        rollout, if any, is served by :meth:`batches` either way.
        """
        if states is None:
            return  # (load_extra_state set the problem)
        if len(states) != self.world_size:
            self._resume_problem = (f"the checkpoint was written by {len(states)} process(es) and this run has "
                                    f"{self.world_size}, so no process gets the environments it ran")
            return
        st = states[self.rank]
        if st.get("version") != PROCESS_STATE_VERSION or int(st["n_envs"]) != self.n_envs:
            self._resume_problem = (f"the checkpoint's environment state (format {st.get('version')}, "
                                    f"{st.get('n_envs')} environments) does not fit this run")
            return
        self.returns_window.clear()
        self.returns_window.extend(float(x) for x in st["recent_returns"])
        self.lengths_window.clear()
        self.lengths_window.extend(float(x) for x in st["recent_lengths"])
        ro = st.get("rollout")
        if ro is not None:
            tensors = {**ro["tensors"], **{k: fifo_decode(enc, _FIFO_KEYS[k]) for k, enc in ro["fifo"].items()}}
            self._rollout = {**{k: v.to(self.device) for k, v in tensors.items()}, "stats": dict(ro["stats"])}
            self._served = int(ro["served"])
        if not st["started"]:  # saved before the first rollout: the environments start as in a new run
            self._resume_problem = None
            return
        if st["envs"] is None:
            self._resume_problem = st["envs_problem"]
            return
        try:
            envs = load_envs(st["envs"].numpy().tobytes())
            vec = self._vector_env(envs)
        except Exception as exc:  # noqa: BLE001 - e.g. an environment package missing here
            self._resume_problem = f"the checkpointed environments could not be unpickled ({type(exc).__name__}: {exc})"
            return
        for k in _VECTOR_FIELDS:
            setattr(vec, k, st["vector"][k].numpy().copy())
        run, dev = st["running"], self.device
        self.envs = vec
        self.obs = run["obs"].numpy().copy()
        self.memory = _state_from_dict(run["memory"], dev)
        self.prev_a, self.prev_r = run["prev_a"].to(dev), run["prev_r"].to(dev)
        self.t, self.start = run["t"].to(dev), run["start"].to(dev)
        self.ep_ret, self.ep_len = run["ep_ret"].numpy().copy(), run["ep_len"].numpy().copy()
        self._resume_problem = None


def load_ppo_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> GTrXLPPO:
    """A :class:`GTrXLPPO` rebuilt from a checkpoint (no offline checkpoint or rollout needed)."""
    agent = GTrXLPPO(cfg, None, device, extra=state["extra"])
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


register_inference_loader("gtrxl_ppo")(load_ppo_for_inference)


@register_agent(
    "gtrxl_ppo",
    description="GTrXL trained online with PPO in gymnasium vector envs (from scratch or from an offline gtrxl run)",
    defaults=PPO_DEFAULTS,
    config_cls=PPOAgentConfig,
    local_batches=True,  # every rank trains on its own rollout: train.batch_size is not split
    check_backbone=check_causal,
)
def build_gtrxl_ppo(cfg: Any, run_dir: Path, device: torch.device) -> GTrXLPPO:
    """Builder of ``agent.kind=gtrxl_ppo``."""
    return GTrXLPPO(cfg, run_dir, device)
