"""Environment checkpointing of PPO-GTrXL: each process's environments, running episodes and rollout.

A checkpoint holds, per process (the trainer's per-process hook, :func:`process_state`): the
sub-environments of the vector environment, pickled attribute by attribute (:class:`_EnvPickler`,
so MuJoCo's simulator state and each environment's random generator carry over), the vector
environment's autoreset flags, the running episodes (last observation, backbone memory, a_{t-1},
r_{t-1}, step, start flags, return and length so far), the recent episode returns and lengths,
and a rollout in progress with the number of its minibatches already served (its per-step FIFO
memories stored losslessly as the new slot per step: :func:`fifo_encode`). Unpickling
environments is only for checkpoints of runs you trust (``--resume``).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rl_tformers.agents.gtrxl.rollout import RolloutCollector
from torch import Tensor

from rl_tformers.types import BackboneState, LayerState

#: format of :func:`process_state` (a checkpoint of another version restarts the environments)
PROCESS_STATE_VERSION = 1
#: SyncVectorEnv bookkeeping saved with the sub-environments
_VECTOR_FIELDS = ("_autoreset_envs", "_terminations", "_truncations", "_rewards")


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


def process_state(col: RolloutCollector, rollout: Mapping[str, Any] | None, served: int) -> dict[str, Any]:
    """One process's running state for a checkpoint.

    Args:
        col: the process's collector (environments, running episodes, recent episodes).
        rollout: the rollout in progress (None: at a rollout boundary); saved with ``served``, the
            number of its minibatches already trained on.

    Returns:
        a dict of tensors and plain values (loads with ``weights_only=True``): ``version``,
        ``n_envs``, ``env_id``, recent returns/lengths, ``started``, ``envs`` (the pickled
        sub-environments as a uint8 tensor, or None with the reason in ``envs_problem`` when they
        cannot be pickled), ``rollout``, and once started ``vector`` and ``running``.
    """
    st: dict[str, Any] = {
        "version": PROCESS_STATE_VERSION, "n_envs": col.n_envs, "env_id": col.spec.env_id,
        "recent_returns": [float(x) for x in col.returns_window],
        "recent_lengths": [float(x) for x in col.lengths_window],
        "started": col.envs is not None, "envs": None, "envs_problem": None, "rollout": None,
    }
    if rollout is not None:
        ro = {k: v.cpu() for k, v in rollout.items() if isinstance(v, Tensor)}
        fifo = {k: fifo_encode(ro.pop(k), dim) for k, dim in _FIFO_KEYS.items()}
        st["rollout"] = {"tensors": ro, "fifo": fifo, "stats": dict(rollout["stats"]), "served": int(served)}
    if col.envs is None:
        return st
    try:
        blob = dump_envs(col.envs.envs)
    except Exception as exc:  # noqa: BLE001 - any environment that does not pickle: say why, keep going
        st["envs_problem"] = f"the environments of {col.spec.env_id} cannot be pickled ({type(exc).__name__}: {exc})"
        return st
    st["envs"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    st["vector"] = {k: torch.from_numpy(np.array(getattr(col.envs, k))) for k in _VECTOR_FIELDS}
    st["running"] = {
        "obs": torch.from_numpy(np.array(col.obs)), "memory": _state_dict_of(col.memory),
        "prev_a": col.prev_a.cpu(), "prev_r": col.prev_r.cpu(), "t": col.t.cpu(), "start": col.start.cpu(),
        "ep_ret": torch.from_numpy(np.array(col.ep_ret)), "ep_len": torch.from_numpy(np.array(col.ep_len)),
    }
    return st


def format_problem(st: Mapping[str, Any], n_envs: int) -> str | None:
    """Why a :func:`process_state` does not fit a run of ``n_envs`` environments (None: it fits)."""
    if st.get("version") != PROCESS_STATE_VERSION or int(st["n_envs"]) != n_envs:
        return (f"the checkpoint's environment state (format {st.get('version')}, "
                f"{st.get('n_envs')} environments) does not fit this run")
    return None


def saved_rollout(st: Mapping[str, Any], device: torch.device) -> tuple[dict[str, Any] | None, int]:
    """The rollout in progress of a :func:`process_state` on ``device`` and its served minibatches
    ((None, 0) when it stopped at a rollout boundary)."""
    ro = st.get("rollout")
    if ro is None:
        return None, 0
    tensors = {**ro["tensors"], **{k: fifo_decode(enc, _FIFO_KEYS[k]) for k, enc in ro["fifo"].items()}}
    return {**{k: v.to(device) for k, v in tensors.items()}, "stats": dict(ro["stats"])}, int(ro["served"])


def restore_process_state(col: RolloutCollector, st: Mapping[str, Any]) -> str | None:
    """Put a :func:`process_state`'s recent episodes, environments and running episodes into ``col``.

    Returns:
        None when the continuation is exact; else why not (environments that could not be
        pickled when saved, or not unpickled here), leaving ``col``'s environments unstarted.
    """
    col.returns_window.clear()
    col.returns_window.extend(float(x) for x in st["recent_returns"])
    col.lengths_window.clear()
    col.lengths_window.extend(float(x) for x in st["recent_lengths"])
    if not st["started"]:  # saved before the first rollout: the environments start as in a new run
        return None
    if st["envs"] is None:
        return st["envs_problem"]
    try:
        envs = load_envs(st["envs"].numpy().tobytes())
        vec = col.vector_env(envs)
    except Exception as exc:  # noqa: BLE001 - e.g. an environment package missing here
        return f"the checkpointed environments could not be unpickled ({type(exc).__name__}: {exc})"
    for k in _VECTOR_FIELDS:
        setattr(vec, k, st["vector"][k].numpy().copy())
    run, dev = st["running"], col.device
    col.envs = vec
    col.obs = run["obs"].numpy().copy()
    col.memory = _state_from_dict(run["memory"], dev)
    col.prev_a, col.prev_r = run["prev_a"].to(dev), run["prev_r"].to(dev)
    col.t, col.start = run["t"].to(dev), run["start"].to(dev)
    col.ep_ret, col.ep_len = run["ep_ret"].numpy().copy(), run["ep_len"].numpy().copy()
    return None


def resume_note(problem: str, step: int, u: int, *, resumes_rollout: bool, env_steps: int, rollouts: int,
                rollout_steps: int) -> str:
    """The warning of a resume at ``step`` that is not bit-identical, because of ``problem``.

    Args:
        problem: why the environments cannot come back.
        step: the update the run resumes after; ``u``: updates per rollout.
        resumes_rollout: the checkpoint holds the rollout of a resume inside one (it is finished exactly).
        env_steps, rollouts: the restored counters (environment steps of every process).
        rollout_steps: environment steps of one rollout of every process.
    """
    j = step % u
    note = (f"resume of gtrxl_ppo (on-policy) at step {step} is not bit-identical to an uninterrupted run: "
            f"{problem}. The weights, optimiser, observation statistics and counters "
            f"(env_steps={env_steps}, rollouts={rollouts}) are restored; the "
            f"environments restart with fresh resets (and empty backbone memory)")
    if not j:
        return note + " and a fresh rollout"
    if resumes_rollout:
        return note + (f" after updates {step + 1}..{step + u - j}, which learn from the last {u - j} "
                       f"minibatches of the checkpointed rollout {rollouts} exactly")
    return note + (f" with a fresh rollout: the run stopped after update {j} of the {u} of rollout "
                   f"{rollouts}, so updates {step + 1}..{step + u - j} learn from the last {u - j} "
                   f"minibatches of a fresh rollout and train/env_steps counts the "
                   f"{rollout_steps} steps of the cut rollout too")
