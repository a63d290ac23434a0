"""Fine-tuning PPO-GTrXL from an offline ``gtrxl`` run (``agent.init_checkpoint``).

PPO fine-tunes the offline encoder and actor (a fresh value head is trained; ``agent.critic_warmup``
rollouts train it alone). The offline run fixes the backbone, the encoder's inputs, the actor head,
the observation statistics and the r_{t-1} units; this module reads that run
(:func:`read_offline`), refuses environments whose spaces do not fit it
(:func:`check_offline_spaces`), warns about configured settings that are replaced
(:func:`warn_ignored_settings`) and copies the weights and statistics (:func:`load_offline`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rl_tformers.agents.gtrxl.config import PPOAgentConfig
from rl_tformers.agents.gtrxl.model import GTrXLModel
from rl_tformers.agents.gtrxl.rollout import RolloutCollector, RunningMeanStd

from rl_tformers.backbone_config import BackboneConfig, ConfigAdviceWarning
from rl_tformers.runtime.checkpoint import find_latest_valid, load_checkpoint
from rl_tformers.runtime.plugins import check_source_plugins

#: the backbone's dropout probabilities (``ffn_dropout`` None = ``dropout``), set to 0 for PPO
DROPOUT_KEYS = ("dropout", "attn_dropout", "ffn_dropout")


def fine_tune_backbone_changes(configured: Mapping[str, Any], offline: Mapping[str, Any], path: str) -> list[str]:
    """The ``backbone.*`` settings of the config that fine-tuning ignores.

    PPO fine-tunes the offline encoder itself, so its backbone is the checkpoint's; a configured
    setting that differs (an override such as ``backbone.block.gate=highway``) is not what runs,
    although ``config.yaml`` records it. Dropout probabilities are left out (PPO trains without
    dropout either way).

    Returns:
        ``["backbone.block.gate='highway' (the checkpoint's: 'gru')", ...]``, empty when they agree.
    """
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


def fine_tune_input_changes(configured: PPOAgentConfig, offline: Mapping[str, Any]) -> list[str]:
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
        want = int(getattr(configured, key)) if key == "head_hidden" else bool(getattr(configured, key))
        have = offline[field_name]
        if want != have:
            out.append(f"agent.{key}={want!r} (the checkpoint's: {have!r})")
    if not configured.obs_norm:
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
            (discrete or continuous) or the number of actions / action size differ (a continuous
            offline actor has the shape of the logits of a discrete one of the same size, so the
            weights alone would load).

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
                f"agent.env_id={env_id} class k is action {action_start} + k", UserWarning, stacklevel=4)
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
            UserWarning, stacklevel=4)


def read_offline(path: str, plugins: Any) -> tuple[dict, dict, dict]:
    """Checkpoint state, backbone config and input flags of an offline ``gtrxl`` run.

    Args:
        path: ``agent.init_checkpoint`` (a run directory or a checkpoint file).
        plugins: this run's ``plugins`` (the offline run's must be among them).

    Raises:
        ValueError: no such path, not an offline gtrxl run of objective bc or iql, or plugins missing.
    """
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
    check_source_plugins(saved, plugins, f"agent.init_checkpoint={path}")
    inputs = {"prev_action_input": bool(sa.get("prev_action")), "prev_reward_input": bool(sa.get("prev_reward")),
              "head_hidden": int(sa.get("head_hidden", 0)),
              # how its encoder read a discrete a_{t-1} at an episode start (zeros, or action 0 before
              # the field existed): the fine-tuned rollouts feed it the same way
              "prev_action_zero_at_start": bool(dict(state.get("extra") or {}).get("model", {})
                                                .get("prev_action_zero_at_start", False)),
              # its observation encoder (linear before the field existed), fine-tuned as it is
              "encoder": dict(state.get("extra") or {}).get("model", {}).get("encoder")}
    return state, saved["backbone"], inputs


def warn_ignored_settings(a: PPOAgentConfig, configured: Mapping[str, Any], backbone: Mapping[str, Any],
                            inputs: Mapping[str, Any]) -> None:
    """Warn about the config's backbone and agent settings that fine-tuning replaces with the checkpoint's."""
    ignored = fine_tune_backbone_changes(configured, backbone, str(a.init_checkpoint))
    if ignored:
        warnings.warn(
            f"agent.init_checkpoint={a.init_checkpoint}: PPO fine-tunes that run's encoder, so it runs the "
            f"checkpoint's backbone and ignores the config's {'; '.join(ignored)} (config.yaml still "
            f"records them); to train another backbone online, start PPO without agent.init_checkpoint",
            UserWarning, stacklevel=4)
    ignored = fine_tune_input_changes(a, inputs)
    if ignored:
        warnings.warn(
            f"agent.init_checkpoint={a.init_checkpoint}: PPO fine-tunes that run's encoder and actor, so "
            f"it builds them with the checkpoint's inputs and actor head and ignores the config's "
            f"{'; '.join(ignored)} (config.yaml still records them); set them to the checkpoint's values "
            f"to silence this", ConfigAdviceWarning, stacklevel=4)


def load_offline(model: GTrXLModel, obs_rms: RunningMeanStd, collector: RolloutCollector,
                 state: Mapping[str, Any]) -> None:
    """Copy the offline encoder and actor into ``model`` (its fresh value head kept); take the
    offline run's observation statistics (frozen) and r_{t-1} input multiplier.

    Raises:
        ValueError: an encoder or actor parameter of ``model`` missing from the offline one.
    """
    own = model.state_dict()
    take = {k: v for k, v in state["model"].items()
            if (k.startswith("encoder.") or k.startswith("actor.")) and k in own and own[k].shape == v.shape}
    missing = [k for k in own if (k.startswith("encoder.") or k.startswith("actor.")) and k not in take]
    if missing:
        raise ValueError(f"agent.init_checkpoint: the offline model does not match here; missing {missing[:5]}")
    model.load_state_dict(take, strict=False)
    ex = state["extra"]
    obs_rms.mean = np.asarray(ex["obs_mean"], np.float64)
    obs_rms.var = np.asarray(ex["obs_std"], np.float64) ** 2 - 1e-8
    collector.update_obs_stats = False  # keep the statistics the encoder was trained with
    collector.input_reward_mult = float(ex.get("reward_mult", collector.reward_scale))  # and its r_{t-1} units
