"""Environment checkpointing of PPO-GTrXL: each process's environments, running episodes and rollout.

A checkpoint holds, per process (the trainer's per-process hook, :func:`process_state`): the
sub-environments of the vector environment as plain data (:func:`env_snapshot`: each wrapper's
and the environment's attributes, their numpy random generators' states and MuJoCo's
integration state), restored onto new environments made from the run's id and kwargs
(:func:`restore_env`), the vector environment's autoreset flags, the running episodes (last observation, backbone memory, a_{t-1},
r_{t-1}, step, start flags, return and length so far), the recent episode returns and lengths,
and a rollout in progress with the number of its minibatches already served (its per-step FIFO
memories stored losslessly as the new slot per step: :func:`fifo_encode`).

Nothing of it is unpickled by default. An environment holding state that is not plain data (a
Box2D world, an object of the environment's own classes) cannot be restored so; its checkpoint
also holds the environments pickled attribute by attribute (:class:`_EnvPickler`), which a
resume unpickles only when asked to (``--unsafe-unpickle-envs``,
:func:`~rl_tformers.runtime.checkpoint.allow_unpickling`): unpickling runs whatever code the
checkpoint names, so it is for runs you made or trust. Otherwise those environments restart
with fresh resets, and the resume says why.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
import types
from collections import deque
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rl_tformers.agents.gtrxl.ppo_update import (
    PIXEL_KEY,
    STORE_KEYS,
    compressive_layout,
    pad_memory,
    store_rows,
    unpad_memory,
)
from rl_tformers.agents.gtrxl.rollout import RolloutCollector
from torch import Tensor

from rl_tformers.memory.spalm import SpalmStore
from rl_tformers.runtime.checkpoint import unpickling_allowed
from rl_tformers.types import BackboneState, LayerState

#: format of :func:`process_state` (a checkpoint of another version restarts the environments;
#: version 1 held the pickled environments only)
PROCESS_STATE_VERSION = 2
#: the versions :func:`restore_process_state` reads
_READ_VERSIONS = (1, 2)
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
    """Inverse of :func:`dump_envs`: unpickling runs whatever code ``blob`` names, so it is only
    for checkpoints of runs you trust (called only inside
    :func:`~rl_tformers.runtime.checkpoint.allow_unpickling`).

    Raises:
        PermissionError: outside :func:`~rl_tformers.runtime.checkpoint.allow_unpickling`.
    """
    if not unpickling_allowed():
        raise PermissionError("unpickling the checkpointed environments was not allowed")
    return pickle.loads(blob)  # noqa: S301 - the caller opted in (--unsafe-unpickle-envs)


# -- environments as plain data: restored without unpickling ------------------------------------------------
#: attributes a new environment gets from its constructor (``gym.make(env_id, **env_kwargs)``): not saved
_CONSTRUCTED = frozenset({"env", "spec", "_saved_kwargs", "_ezpickle_args", "_ezpickle_kwargs"})


class _NotPlain(Exception):
    """A value that is not plain data (its type's name is the message)."""


def _structural(value: Any) -> bool:
    """Objects a new environment builds the same from its id and kwargs: spaces, specs, code
    (functions, classes, modules), MuJoCo's model and renderer (state lives in ``MjData``)."""
    if isinstance(value, (gym.Space, gym.envs.registration.EnvSpec, type, types.ModuleType, types.FunctionType,
                          types.MethodType, types.BuiltinFunctionType, functools.partial)):
        return True
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    return name in ("mujoco._structs.MjModel",
                    "gymnasium.envs.mujoco.mujoco_rendering.MujocoRenderer")


def _encode(value: Any) -> Any:
    """``value`` as tensors, numbers, strings, None, lists and dicts (``weights_only`` loads them).

    Raises:
        _NotPlain: ``value`` holds an object that is none of these, an array, a numpy scalar, a
            tuple, a deque, a numpy random generator or MuJoCo's ``MjData``.
    """
    if value is None or isinstance(value, (bool, int, float, str)) and type(value) in (bool, int, float, str):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise _NotPlain(f"{type(value).__name__} of Python objects")
        return {"~": "array", "scalar": isinstance(value, np.generic), "dtype": arr.dtype.str,
                "shape": list(arr.shape), "bytes": torch.frombuffer(bytearray(arr.tobytes()), dtype=torch.uint8)
                if arr.nbytes else torch.zeros(0, dtype=torch.uint8)}
    if type(value) in (list, tuple):
        return {"~": type(value).__name__, "items": [_encode(v) for v in value]}
    if type(value) is dict:
        return {"~": "dict", "items": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if type(value) is deque:
        return {"~": "deque", "items": [_encode(v) for v in value], "maxlen": value.maxlen}
    if isinstance(value, np.random.Generator):
        return {"~": "generator", "state": _encode(value.bit_generator.state)}
    if isinstance(value, np.random.RandomState):
        return {"~": "random_state", "state": _encode(value.get_state(legacy=False))}
    if f"{type(value).__module__}.{type(value).__qualname__}" == "mujoco._structs.MjData":
        import mujoco  # noqa: PLC0415 - optional: only an environment holding MjData has it

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        state = np.empty(mujoco.mj_stateSize(value.model, spec), np.float64)
        mujoco.mj_getState(value.model, value, state, spec)
        return {"~": "mjdata", "state": torch.from_numpy(state)}
    raise _NotPlain(type(value).__name__)


def _decode(enc: Any, current: Any) -> Any:
    """Inverse of :func:`_encode`; ``current`` is the new environment's value (MuJoCo's ``MjData``
    is set in place, so whatever shares it, e.g. the renderer, sees the restored state)."""
    if not isinstance(enc, dict):
        return enc
    tag = enc["~"]
    if tag == "array":
        arr = np.frombuffer(enc["bytes"].numpy().tobytes(), dtype=np.dtype(enc["dtype"])).reshape(enc["shape"]).copy()
        return arr[()] if enc["scalar"] else arr
    if tag in ("list", "tuple"):
        items = [_decode(v, None) for v in enc["items"]]
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        return {_decode(k, None): _decode(v, None) for k, v in enc["items"]}
    if tag == "deque":
        return deque((_decode(v, None) for v in enc["items"]), maxlen=enc["maxlen"])
    if tag == "generator":
        state = _decode(enc["state"], None)
        gen = np.random.Generator(_bit_generator(state["bit_generator"])())
        gen.bit_generator.state = state
        return gen
    if tag == "random_state":
        rs = np.random.RandomState()
        rs.set_state(_decode(enc["state"], None))
        return rs
    if tag == "mjdata":
        import mujoco  # noqa: PLC0415 - optional: only an environment holding MjData has it

        if f"{type(current).__module__}.{type(current).__qualname__}" != "mujoco._structs.MjData":
            raise TypeError("a saved MuJoCo state for an attribute that is not MjData in the new environment")
        mujoco.mj_setState(current.model, current, enc["state"].numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)
        return current
    raise ValueError(f"unknown saved value {tag!r}")


def _bit_generator(name: str) -> type:
    """numpy's bit generator class ``name`` (PCG64, MT19937, Philox, SFC64, PCG64DXSM) only."""
    if name not in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"):
        raise ValueError(f"unknown numpy bit generator {name!r}")
    return getattr(np.random, name)


def _layers(env: gym.Env) -> list[Any]:
    """The wrappers of ``env``, outermost first, then the base environment."""
    layers = [env]
    while isinstance(layers[-1], gym.Wrapper):
        layers.append(layers[-1].env)
    return layers


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def env_snapshot(env: gym.Env) -> tuple[list[dict[str, Any]], list[str]]:
    """Every layer's state (wrappers, then the base environment) as plain data.

    Saved per layer: its type's name and every attribute that is plain data (numbers, strings,
    arrays, containers of them, numpy random generators, MuJoCo's integration state,
    ``mj_getState``); skipped: what the constructor builds the same (spaces, the spec, MuJoCo's
    model, functions). Restored by :func:`restore_env` onto ``gym.make(env_id, **env_kwargs)``.

    Returns:
        ``(layers, missing)``: ``missing`` names each attribute that is none of these
        (``LunarLander.world (b2World)``): only unpickling restores it.
    """
    out: list[dict[str, Any]] = []
    missing: list[str] = []
    for layer in _layers(env):
        attrs: dict[str, Any] = {}
        for name, value in vars(layer).items():
            if name in _CONSTRUCTED or _structural(value):
                continue
            try:
                attrs[name] = _encode(value)
            except _NotPlain as exc:
                missing.append(f"{type(layer).__qualname__}.{name} ({exc})")
        out.append({"type": _type_name(layer), "attrs": attrs})
    return out, missing


def restore_env(env: gym.Env, layers: list[Mapping[str, Any]]) -> None:
    """Set an :func:`env_snapshot` on the new environment ``env`` (made from the same id and kwargs).

    Only plain data is set (nothing of the checkpoint is run as code); attributes the
    constructor builds (:data:`_CONSTRUCTED`) and dunder names are never set. ``env`` is reset
    first (seed 0), so that each attribute a reset gives a value holds one to compare with: a
    saved value must be of the same kind (:func:`_kind`: array, number, string, list, ...) and an
    array of the same dtype and shape, or ``None`` where either holds ``None``.

    Raises:
        ValueError: ``env``'s layers are not the snapshot's (other wrappers or environment
            classes), or the snapshot names an attribute it never holds, holds a value no
            :func:`env_snapshot` writes (an unknown numpy bit generator...), or a value of
            another kind, dtype or shape than the new environment's (naming the attribute).
    """
    mine = _layers(env)
    if [_type_name(x) for x in mine] != [str(x["type"]) for x in layers]:
        raise ValueError(f"the environment is made of {[_type_name(x) for x in mine]} here and of "
                         f"{[str(x['type']) for x in layers]} in the checkpoint")
    env.reset(seed=0)
    for layer, saved in zip(mine, layers):
        for name, enc in saved["attrs"].items():
            if not isinstance(name, str) or name.startswith("__") or name in _CONSTRUCTED:
                raise ValueError(f"{type(layer).__qualname__}: the checkpoint sets the attribute {name!r}, which a "
                                 f"snapshot never holds")
            current = layer.__dict__.get(name)
            value = _decode(enc, current)
            _check_same_kind(value, current, f"{type(layer).__qualname__}.{name}")
            layer.__dict__[name] = value


def _kind(value: Any) -> str:
    """What a saved value is, for :func:`_check_same_kind` (Python and NumPy numbers alike)."""
    if isinstance(value, (bool, int, float, np.generic)):
        return "number"
    return type(value).__name__


def _check_same_kind(value: Any, current: Any, where: str) -> None:
    """Refuse a restored ``value`` of another kind than the new environment's ``current``
    (arrays: another dtype or shape); either being ``None`` passes.

    Raises:
        ValueError: naming ``where`` and both kinds.
    """
    if value is None or current is None:
        return
    if _kind(value) != _kind(current):
        raise ValueError(f"{where}: the checkpoint holds a {_kind(value)} where the environment holds a "
                         f"{_kind(current)}")
    if isinstance(current, np.ndarray) and (value.dtype != current.dtype or value.shape != current.shape):
        raise ValueError(f"{where}: the checkpoint holds a {value.dtype} array of shape {value.shape} where the "
                         f"environment holds {current.dtype} {current.shape}")


#: rollout keys that hold each step's FIFO memory, and their slot axis in the (S, N, ...) tensor
_FIFO_KEYS = {"mem": 3, "mem_pos": 2, "mem_valid": 2, "mem_seg": 2}
#: the same for the plain window of ``agent.window`` (it shifts by one slot per step too)
_WINDOW_FIFO_KEYS = {"window_x": 2, "window_pos": 2, "window_valid": 2}


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


def _state_dict_of(state: BackboneState | Mapping[str, Tensor]) -> dict[str, Any]:
    """A :class:`BackboneState` of the ``xl`` or ``spalm`` memory as plain tensors (CPU); the
    SPALM long-term store under ``store`` (:func:`store_rows`' keys); a plain window (a dict of
    :data:`_WINDOW_FIFO_KEYS` tensors) under ``window``."""
    if isinstance(state, Mapping):
        return {"window": {k: state[k].cpu() for k in _WINDOW_FIFO_KEYS}}
    store = store_rows(state)
    if any(ls.cache is not None for ls in state.layers) or any(ls.extra is not None for ls in state.layers[:-1]) \
            or (state.layers[-1].extra is not None and not store):
        raise TypeError("gtrxl_ppo: only the xl memory's LayerState(memory=...) and the spalm store can be checkpointed")
    out = {"memory": [None if ls.memory is None else ls.memory.cpu() for ls in state.layers],
           **{k: getattr(state, k).cpu() for k in ("pos", "valid", "seg", "episode", "next_pos")}}
    if store:
        out["store"] = {k: v.cpu() for k, v in store.items()}
    return out


def _running_memory(col: RolloutCollector, memory: Any) -> dict[str, Any]:
    """The running memory of a checkpoint: ``memory`` (:func:`_state_dict_of`); a compressive
    memory at its full width (:func:`pad_memory`: the same layout at every step) with the slots it
    holds, ``memory_slots`` (a () long tensor), to cut it back exactly."""
    enc = col.model.encoder
    if not enc.stateful or compressive_layout(enc) is None:
        return {"memory": _state_dict_of(memory)}
    return {"memory": _state_dict_of(pad_memory(enc, memory)), "memory_slots": torch.tensor(memory.pos.shape[1])}


def _state_from_dict(d: Mapping[str, Any], device: torch.device) -> BackboneState | dict[str, Tensor]:
    if "window" in d:
        return {k: d["window"][k].to(device) for k in _WINDOW_FIFO_KEYS}
    st = BackboneState(
        layers=[LayerState(memory=None if m is None else m.to(device)) for m in d["memory"]],
        **{k: d[k].to(device) for k in ("pos", "valid", "seg", "episode", "next_pos")},
    )
    if "store" in d:  # ltm_keys -> SpalmStore.keys, ...
        st.layers[-1].extra = SpalmStore(**{k.removeprefix("ltm_"): v.to(device) for k, v in d["store"].items()})
    return st


def process_state(col: RolloutCollector, rollout: Mapping[str, Any] | None, served: int) -> dict[str, Any]:
    """One process's running state for a checkpoint.

    Args:
        col: the process's collector (environments, running episodes, recent episodes).
        rollout: the rollout in progress (None: at a rollout boundary); saved with ``served``, the
            number of its minibatches already trained on.

    Returns:
        a dict of tensors and plain values (loads with ``weights_only=True``): ``version``,
        ``n_envs``, ``env_id``, recent returns/lengths, ``started``, ``env_states`` (each
        sub-environment's :func:`env_snapshot`), ``envs_problem`` (None, or the attributes that
        only unpickling restores), ``envs`` (only then: the sub-environments pickled, a uint8
        tensor, or None with the reason in ``envs_problem`` when they cannot be pickled either),
        ``rollout``, and once started ``vector`` and ``running``.
    """
    st: dict[str, Any] = {
        "version": PROCESS_STATE_VERSION, "n_envs": col.n_envs, "env_id": col.spec.env_id,
        "recent_returns": [float(x) for x in col.returns_window],
        "recent_lengths": [float(x) for x in col.lengths_window],
        "started": col.envs is not None, "env_states": None, "envs": None, "envs_problem": None, "rollout": None,
    }
    if rollout is not None:
        ro = {k: v.cpu() for k, v in rollout.items() if isinstance(v, Tensor)}
        fifo = {k: fifo_encode(ro.pop(k), dim) for k, dim in {**_FIFO_KEYS, **_WINDOW_FIFO_KEYS}.items() if k in ro}
        st["rollout"] = {"tensors": ro, "fifo": fifo, "stats": dict(rollout["stats"]), "served": int(served)}
    if col.envs is None:
        return st
    snapshots = [env_snapshot(e) for e in col.envs.envs]
    missing = sorted({m for _, miss in snapshots for m in miss})
    st["env_states"] = [layers for layers, _ in snapshots]
    if missing:
        st["envs_problem"] = (f"the environments of {col.spec.env_id} hold state that is not plain data "
                              f"({', '.join(missing)})")
        try:
            st["envs"] = torch.frombuffer(bytearray(dump_envs(col.envs.envs)), dtype=torch.uint8)
        except Exception as exc:  # noqa: BLE001 - any environment that does not pickle: say why, keep going
            st["envs_problem"] = (f"the environments of {col.spec.env_id} hold state that is not plain data "
                                  f"({', '.join(missing)}) and cannot be pickled ({type(exc).__name__}: {exc})")
    st["vector"] = {k: torch.from_numpy(np.array(getattr(col.envs, k))) for k in _VECTOR_FIELDS}
    st["running"] = {
        "obs": torch.from_numpy(np.array(col.obs)), **_running_memory(col, col.memory),
        "prev_a": col.prev_a.cpu(), "prev_r": col.prev_r.cpu(), "t": col.t.cpu(), "start": col.start.cpu(),
        "ep_ret": torch.from_numpy(np.array(col.ep_ret)), "ep_len": torch.from_numpy(np.array(col.ep_len)),
    }
    return st


def format_problem(st: Mapping[str, Any], n_envs: int) -> str | None:
    """Why a :func:`process_state` does not fit a run of ``n_envs`` environments (None: it fits)."""
    if st.get("version") not in _READ_VERSIONS or int(st["n_envs"]) != n_envs:
        return (f"the checkpoint's environment state (format {st.get('version')}, "
                f"{st.get('n_envs')} environments) does not fit this run")
    return None


#: the (S, N, ...) tensors of a rollout besides its FIFO memories (RolloutCollector.collect);
#: ``episode`` only with a backbone memory
_ROLLOUT_KEYS = ("x", "pos", "actions", "logp", "values", "rewards", "dones", "adv", "returns")


def saved_rollout(st: Mapping[str, Any], device: torch.device, *, steps: int, n_envs: int,
                  updates: int, window: bool = False) -> tuple[dict[str, Any] | None, int]:
    """The rollout in progress of a :func:`process_state` on ``device`` and its served minibatches
    ((None, 0) when it stopped at a rollout boundary).

    Args:
        steps, n_envs: S and N of this run's rollouts; updates: its updates per rollout U.
        window: the run is in the plain-window mode (the rollout holds windows, not memories).

    Raises:
        ValueError: the saved rollout lacks a tensor or a FIFO memory, holds one whose first two
            dimensions are not (S, N), statistics that are not numbers, or a served count outside
            [1, U) (naming the value).
    """
    ro = st.get("rollout")
    if ro is None:
        return None, 0
    served = ro.get("served") if isinstance(ro, Mapping) else None
    if isinstance(served, bool) or not isinstance(served, int) or not 1 <= served < updates:
        raise ValueError(f"rollout.served={served!r} is not a count in [1, {updates})")
    try:
        stats = {str(k): float(v) for k, v in dict(ro["stats"]).items()}
        fifo = {k: fifo_decode(ro["fifo"][k], dim) for k, dim in (_WINDOW_FIFO_KEYS if window else _FIFO_KEYS).items()}
        keys = _ROLLOUT_KEYS if window else (*_ROLLOUT_KEYS, "episode")
        tensors = {**{k: ro["tensors"][k] for k in keys}, **fifo,
                   **{k: ro["tensors"][k] for k in (*STORE_KEYS, PIXEL_KEY) if k in ro["tensors"]}}
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as exc:
        raise ValueError(f"the saved rollout is incomplete or malformed ({type(exc).__name__}: {exc})") from exc
    for k, v in tensors.items():
        if not isinstance(v, Tensor) or tuple(v.shape[:2]) != (steps, n_envs):
            shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"rollout.{k}: {shape}, expected ({steps}, {n_envs}, ...)")
    return {**{k: v.to(device) for k, v in tensors.items()}, "stats": stats}, served


def checked_rollout(st: Mapping[str, Any], col: RolloutCollector,
                    updates: int) -> tuple[dict[str, Any] | None, int, str | None]:
    """:func:`saved_rollout` for ``col``'s run (S steps, N environments, on its device) with
    ``updates`` updates per rollout: ``(rollout, served, None)``, or ``(None, 0, why)`` when the
    saved rollout does not fit."""
    try:
        return (*saved_rollout(st, col.device, steps=col.n_steps, n_envs=col.n_envs, updates=updates,
                               window=not col.model.encoder.stateful), None)
    except ValueError as exc:
        return None, 0, f"the checkpoint's rollout in progress does not fit this run ({exc})"


def restore_process_state(col: RolloutCollector, st: Mapping[str, Any]) -> str | None:
    """Put a :func:`process_state`'s recent episodes, environments and running episodes into ``col``.

    The environments are made anew (``gym.make(env_id, **env_kwargs)``) and given their saved
    state (:func:`restore_env`). Where that state is incomplete (``envs_problem``), the pickled
    environments are loaded instead, only inside
    :func:`~rl_tformers.runtime.checkpoint.allow_unpickling`.

    Returns:
        None when the continuation is exact; else why not (environments whose state could not be
        saved, or not restored here, or that only unpickling restores and it was not allowed),
        leaving ``col``'s environments unstarted.
    """
    try:
        recent = [[float(x) for x in st[k]] for k in ("recent_returns", "recent_lengths")]
    except (KeyError, TypeError, ValueError) as exc:
        return f"the checkpoint's recent episodes are not numbers ({type(exc).__name__}: {exc})"
    col.returns_window.clear()
    col.returns_window.extend(recent[0])
    col.lengths_window.clear()
    col.lengths_window.extend(recent[1])
    if not st.get("started"):  # saved before the first rollout: the environments start as in a new run
        return None
    problem = st.get("envs_problem")
    if problem is None and st.get("env_states") is not None:
        try:
            envs = [col.spec.make() for _ in range(col.n_envs)]
            for env, layers in zip(envs, st["env_states"]):
                restore_env(env, layers)
            vec = col.vector_env(envs)
        except Exception as exc:  # noqa: BLE001 - e.g. another version of the environment's package here
            return f"the checkpointed environments could not be restored ({type(exc).__name__}: {exc})"
    elif st.get("envs") is None:
        return problem or "the checkpoint holds no environment state"
    elif not unpickling_allowed():
        return (f"{problem or 'the checkpoint holds its environments pickled only'}: only unpickling restores "
                f"them, which runs code stored in the checkpoint; resume with --unsafe-unpickle-envs to do it, "
                f"for a run you trust")
    else:
        try:
            envs = load_envs(st["envs"].numpy().tobytes())
            vec = col.vector_env(envs)
        except Exception as exc:  # noqa: BLE001 - e.g. an environment package missing here
            return f"the checkpointed environments could not be unpickled ({type(exc).__name__}: {exc})"
    problem = running_problem(col, vec, st)
    if problem is not None:
        return f"the checkpoint's running episodes do not fit this run ({problem})"
    for k in _VECTOR_FIELDS:
        setattr(vec, k, st["vector"][k].numpy().copy())
    run, dev = st["running"], col.device
    col.envs = vec
    col.obs = run["obs"].numpy().copy()
    col.memory = _state_from_dict(run["memory"], dev)
    if "memory_slots" in run:  # a compressive memory, saved at its full width
        col.memory = unpad_memory(col.model.encoder, col.memory, int(run["memory_slots"]))
    col.prev_a, col.prev_r = run["prev_a"].to(dev), run["prev_r"].to(dev)
    col.t, col.start = run["t"].to(dev), run["start"].to(dev)
    col.ep_ret, col.ep_len = run["ep_ret"].numpy().copy(), run["ep_len"].numpy().copy()
    return None


def running_problem(col: RolloutCollector, vec: gym.vector.SyncVectorEnv, st: Mapping[str, Any]) -> str | None:
    """Why the ``vector`` and ``running`` parts of a :func:`process_state` do not fit ``col``'s
    run (None: they fit): a missing key, a value that is not a tensor, or a tensor of another
    dtype or shape than the vector environment's flags and
    :meth:`~RolloutCollector.blank_running` give (N environments, the observation space, the
    encoder's memory), or a negative step or episode length.
    """
    space = vec.observation_space
    blank = col.blank_running(np.zeros(space.shape, space.dtype), "cpu")
    want = {"vector": {k: torch.from_numpy(np.array(getattr(vec, k))) for k in _VECTOR_FIELDS},
            "running": {**{k: torch.as_tensor(v) for k, v in blank.items() if k != "memory"},
                        **_running_memory(col, blank["memory"])}}
    problem = _layout_problem(st, want, "")
    layout = compressive_layout(col.model.encoder)
    if problem is None and layout is not None and not layout[0] <= int(st["running"]["memory_slots"]) <= layout[1]:
        return f"running.memory_slots={int(st['running']['memory_slots'])} is not in [{layout[0]}, {layout[1]}]"
    if problem is None:
        run = st["running"]
        for k in ("t", "ep_len"):
            if bool((run[k] < 0).any()):
                return f"running.{k} holds a negative count"
    return problem


def _layout_problem(value: Any, want: Any, where: str) -> str | None:
    """The first key of ``want`` (nested dicts and lists of tensors) that ``value`` lacks or holds
    with another type, dtype or shape, as a message (None: same layout)."""
    if isinstance(want, Tensor):
        if not isinstance(value, Tensor):
            return f"{where}: {type(value).__name__}, expected a tensor"
        if value.dtype != want.dtype or tuple(value.shape) != tuple(want.shape):
            return f"{where}: {value.dtype} {tuple(value.shape)}, expected {want.dtype} {tuple(want.shape)}"
        return None
    if isinstance(want, Mapping):
        if not isinstance(value, Mapping):
            return f"{where or 'the state'}: {type(value).__name__}, expected a dict"
        for k, w in want.items():
            key = f"{where}.{k}" if where else k
            if k not in value:
                return f"{key}: missing"
            problem = _layout_problem(value[k], w, key)
            if problem is not None:
                return problem
        return None
    if isinstance(want, list):
        if not isinstance(value, list) or len(value) != len(want):
            return f"{where}: expected a list of {len(want)}"
        return next((p for p in (_layout_problem(v, w, f"{where}[{i}]") for i, (v, w) in enumerate(zip(value, want)))
                     if p is not None), None)
    if want is None:
        return None if value is None else f"{where}: expected None"
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
