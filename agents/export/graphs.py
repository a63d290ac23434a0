"""The acting graphs of a policy folder: one traceable ``nn.Module`` per agent family.

Each graph carries everything between the environment and the model: observation
normalisation, the scaling of returns-to-go and rewards, and the mapping of the model's action
to the environment's space (continuous actions to the Box bounds, discrete class indices plus
``Discrete.start``). Inputs and outputs are plain tensors, so the same module runs eagerly
(:class:`~rl_tformers.agents.export.policy.Policy` with ``backend="eager"``), traced to
TorchScript and exported to ONNX (:mod:`~rl_tformers.agents.export.exporters`).

- :class:`BCGraph` ``(observations) -> (action,)``.
- :class:`DTGraph` ``(returns_to_go, observations, actions, timesteps, mask) -> (action,
  context_action)``: the Decision Transformer over its context window of K steps (Chen et al.
  2021, algorithm 1); the window is kept between steps by
  :class:`~rl_tformers.agents.export.runtime.DTContext`.
- :class:`GTrXLGraph` ``(observations, episode_start, last_reward, target_return, *memory) ->
  (action, *new_memory)``: one GTrXL step (Parisotto et al. 2019) with its memory as explicit
  tensors: the return-to-go, previous action and step index of each row followed by the
  backbone's state (:func:`flatten_state`), cleared where ``episode_start``.

N is the batch (environments); O the flat observation size, A the action size (or number of
discrete actions), K the context length.
"""

from __future__ import annotations

from typing import Any

import torch
from rl_tformers.agents.bc.model import BCModel
from rl_tformers.agents.decision_transformer.context import acting_context_mask
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, to_env_action
from rl_tformers.agents.gtrxl.model import GTrXLModel
from torch import Tensor, nn

from rl_tformers.types import BackboneState


def flatten_state(state: Any) -> list[Tensor]:
    """The tensors of a backbone state (:class:`~rl_tformers.types.BackboneState`, or a tuple of
    window tensors) in a fixed order: dataclass fields in declaration order, lists in order."""
    out: list[Tensor] = []
    if isinstance(state, BackboneState):
        state.map_tensors(lambda t: out.append(t) or t)
    else:
        out.extend(state)
    return out


def unflatten_state(template: Any, tensors: list[Tensor] | tuple[Tensor, ...]) -> Any:
    """A state shaped like ``template`` holding ``tensors`` (inverse of :func:`flatten_state`);
    the non-tensor fields (``key_offset``, ``None`` entries) are the template's."""
    it = iter(tensors)
    if isinstance(template, BackboneState):
        return template.map_tensors(lambda _t: next(it))
    return tuple(next(it) for _ in template)


class _Actions(nn.Module):
    """Model actions to environment actions: class index + ``action_start`` (discrete), or
    :func:`~rl_tformers.agents.decision_transformer.model.to_env_action` of a normalised action in
    [-1, 1] to the Box bounds (continuous), (N, A) float32."""

    def __init__(self, discrete: bool, action_start: int, low: Any, high: Any) -> None:
        super().__init__()
        self.discrete, self.action_start = bool(discrete), int(action_start)
        for name, bound in (("low", low), ("high", high)):  # one tensor each (a traced module shares none)
            self.register_buffer(name, torch.zeros(0) if discrete else torch.as_tensor(bound, dtype=torch.float32).reshape(-1))

    def forward(self, a: Tensor) -> Tensor:
        if self.discrete:
            return a.long() + self.action_start
        return to_env_action(a, self.low, self.high).float()


class _Normalise(nn.Module):
    """``(obs - mean) / std`` in float32, then clipped to ``[-clip, clip]`` when ``clip`` is set."""

    def __init__(self, mean: Any, std: Any, clip: float | None = None) -> None:
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(-1))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(-1))
        self.clip = None if clip is None else float(clip)

    def forward(self, obs: Tensor) -> Tensor:
        o = (obs - self.mean) / self.std
        return o if self.clip is None else o.clamp(-self.clip, self.clip)


class BCGraph(nn.Module):
    """Behaviour cloning: ``observations`` (N, O) float32 raw -> ``action`` (N, A) float32 in the
    Box, or (N,) int64 environment actions."""

    def __init__(self, model: BCModel, acting: dict[str, Any]) -> None:
        super().__init__()
        self.model = model.eval()
        self.normalise = _Normalise(acting["obs_mean"], acting["obs_std"])
        self.to_env = _Actions(model.cfg.discrete, acting["action_start"], acting["action_low"], acting["action_high"])

    def forward(self, observations: Tensor) -> tuple[Tensor]:
        y = self.model(self.normalise(observations))  # (N, A) in [-1, 1], or (N, n) logits
        return (self.to_env(y.argmax(-1) if self.model.cfg.discrete else y),)


class DTGraph(nn.Module):
    """The Decision Transformer over a context window (the layout of
    :mod:`~rl_tformers.agents.decision_transformer.context`).

    Inputs: ``returns_to_go`` (N, K) float64 remaining return in raw reward units;
    ``observations`` (N, K, O) float32 raw; ``actions`` (N, K, A) float32 in [-1, 1] or (N, K)
    int64 class indices (the ``context_action`` outputs of earlier steps; anything at the
    deciding step); ``timesteps`` (N, K) int64 episode steps; ``mask`` (N, K) bool, True = real
    step. The deciding step is each row's last real slot. Padded slots are zeroed here, as the
    in-package context does.

    Outputs: ``action`` (N, A) float32 in the Box or (N,) int64 environment action;
    ``context_action`` the model's action (normalised, or class index) to write into the window.
    """

    def __init__(self, model: DecisionTransformer, acting: dict[str, Any]) -> None:
        super().__init__()
        self.model = model.eval()
        self.normalise = _Normalise(acting["obs_mean"], acting["obs_std"])
        self.to_env = _Actions(model.cfg.discrete, acting["action_start"], acting["action_low"], acting["action_high"])
        self.rtg_scale = float(acting["rtg_scale"])
        self.context_steps = acting["context_steps"]
        self.causal = model.cfg.mode == "causal"
        self.register_buffer("slots", torch.arange(model.cfg.context_len), persistent=False)

    def forward(self, returns_to_go: Tensor, observations: Tensor, actions: Tensor, timesteps: Tensor,
                mask: Tensor) -> tuple[Tensor, Tensor]:
        mask = mask.bool()
        obs = torch.where(mask.unsqueeze(-1), self.normalise(observations), torch.zeros_like(observations))
        rtg = torch.where(mask, (returns_to_go / self.rtg_scale).float(), torch.zeros_like(observations[..., 0]))
        slot = torch.where(mask, self.slots, torch.full_like(self.slots, -1)).amax(-1)  # (N,) the last real slot
        out = self.model(obs, actions, rtg, timesteps, acting_context_mask(mask, slot, self.context_steps))
        if not self.causal:  # last_action mode: one prediction, the last step's
            a = out.action[:, -1]
        elif self.model.cfg.discrete:
            a = out.action.gather(1, slot[:, None]).squeeze(1)  # (N,)
        else:
            idx = slot.view(-1, 1, 1).expand(-1, 1, out.action.shape[-1])  # (N, 1, A)
            a = out.action.gather(1, idx).squeeze(1)  # (N, A)
        return self.to_env(a), a


class GTrXLGraph(nn.Module):
    """One GTrXL step of N environments with explicit memory.

    Inputs: ``observations`` (N, O) float32 raw; ``episode_start`` (N,) bool; ``last_reward``
    (N,) float64 raw reward of the previous step (ignored where a row starts); ``target_return``
    (N,) float64 raw units (return-conditioned models; anything otherwise); ``memory``: the
    return-to-go (N,) float64, previous action ((N, A) float32 or (N,) int64, -1 before the
    first), step index (N,) int64, then the backbone state's tensors (:func:`flatten_state`) or,
    with a plain window (``window`` W > 0), its inputs (N, W, input_dim), steps (N, W) and
    validity (N, W).

    Outputs: ``action`` (N, A) float32 in the Box or (N,) int64, then the new memory (same
    order, shapes and dtypes). The actor's mode is the action (deterministic acting).
    """

    def __init__(self, model: GTrXLModel, acting: dict[str, Any], template: Any) -> None:
        super().__init__()
        self.model = model.eval()
        self.normalise = _Normalise(acting["obs_mean"], acting["obs_std"], acting["obs_clip"])
        self.to_env = _Actions(model.cfg.discrete, acting["action_start"], acting["action_low"], acting["action_high"])
        self.rtg_scale, self.reward_mult = float(acting["rtg_scale"]), float(acting["reward_mult"])
        self.template = template

    def forward(self, observations: Tensor, episode_start: Tensor, last_reward: Tensor, target_return: Tensor,
                *memory: Tensor) -> tuple[Tensor, ...]:
        enc, start = self.model.encoder, episode_start.bool()
        rtg_prev, prev_a, t = memory[0], memory[1], memory[2]
        r = torch.where(start, torch.zeros_like(last_reward), last_reward)  # (N,) float64
        rtg = torch.where(start, target_return, rtg_prev - r)  # R_t = R_{t-1} - r_{t-1}
        t = torch.where(start, torch.zeros_like(t), t)
        if self.model.cfg.discrete:  # no previous action at a start: -1
            prev_a = torch.where(start, torch.full_like(prev_a, -1), prev_a)
        else:
            prev_a = prev_a * (~start).view(-1, 1).to(prev_a.dtype)
        x = enc.inputs(self.normalise(observations)[:, None], (rtg / self.rtg_scale).float()[:, None],
                       prev_a[:, None], (r.float() * self.reward_mult)[:, None])  # (N, 1, input_dim)
        h, new_state = self._features(x, t, start, list(memory[3:]))
        a = self.model.actor.mode(h)
        if not self.model.cfg.discrete:
            a = a.clamp(-1.0, 1.0)
        return (self.to_env(a), rtg, a, t + 1, *flatten_state(new_state))

    def _features(self, x: Tensor, t: Tensor, start: Tensor, tensors: list[Tensor]) -> tuple[Tensor, Any]:
        """(N, D) features of the new step and the next backbone state (or window tensors)."""
        enc = self.model.encoder
        if enc.stateful:
            state = enc.reset_state(unflatten_state(self.template, tensors), start)
            out = enc(x, t[:, None], state=state)
            return out.features[:, 0], out.state
        win_x, win_pos, win_valid = tensors  # (N, W, input_dim), (N, W), (N, W)
        keep = (~start)[:, None]  # (N, 1): a starting row forgets its window
        win_x = torch.cat([win_x[:, 1:], x], 1)
        win_pos = torch.cat([win_pos[:, 1:], t[:, None]], 1)
        win_valid = torch.cat([win_valid[:, 1:] & keep, torch.ones_like(keep)], 1)
        out = enc(win_x, win_pos, mask=win_valid)
        return out.features[:, -1], (win_x, win_pos, win_valid)
