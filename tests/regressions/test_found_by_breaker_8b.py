"""Defects found by breaker 8, second part (PPO dropout and learned positions, cross-attention
kinds, sweep wall times).

1. PPO-GTrXL with dropout (``backbone.dropout`` / ``attn_dropout`` > 0) collected its rollouts
   in train mode: the stored log-probabilities and values came from one dropout mask and the
   update recomputed them under another, so the first update's ratio was not 1 (log-probabilities
   off by up to 0.01 with dropout 0.3 in a 16-wide model), against the docstring. PPO now builds
   its model without dropout (as the N+ implementation details of RLHF with PPO, Huang et al.
   2024, and CleanRL's networks) and warns when the config sets it.
2. PPO-GTrXL with ``backbone.position.kind=learned`` in an environment without a time limit
   checked nothing: an episode longer than ``backbone.max_position`` crashed mid-rollout with the
   position table's raw error. The environment without a limit is now warned about when PPO
   starts, and the rollout step that would need a missing row stops the run with a ConfigError
   (one ``error:`` line) naming the option, the environment, the step and the fixes; the run's
   checkpoints stay intact and ``--resume`` continues exactly from the last one.
3. A Linformer cross-attention whose source is longer than its ``max_len`` said
   ``attention.max_len`` (the self-attention option) instead of ``cross_attention.max_len``.
4. ``cross_attention.kind=blockwise`` was accepted, but its blocks were cut over the padded
   source length, so source padding changed the outputs of the real targets (by up to 0.5 with
   three pad tokens). Blockwise attention pairs query block i with key block pi(i) *of the same
   sequence*; there is no such correspondence across two sequences, so it is now refused as
   cross-attention (``Capabilities.cross_attention=False``), like the other key-index patterns.
5. ``rl-tformers sweep``: the ``seconds`` column of a resumed run was its last part's wall time
   only (and 0 for a skipped one); it is now the total over the run's parts.

Every test is tiny (a 16-wide model, a few rollout steps, sleeping stand-in commands, one toy
training process).
"""

from __future__ import annotations

import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train


# ------------------------------------------------- 1. PPO trains without dropout: the ratio starts at 1
def _ppo_with(dropout: float):
    from omegaconf import OmegaConf
    from rl_tformers.agents.gtrxl.model import gtrxl_backbone
    from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO

    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 2, "n_steps": 8, "n_epochs": 1, "n_minibatches": 1})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4, dropout=dropout)
    torch.manual_seed(0)
    return GTrXLPPO(cfg, None, torch.device("cpu"))


def test_ppo_with_dropout_configured_recomputes_the_rollout_s_log_probabilities() -> None:
    """The first update of a rollout must see the log-probabilities and values the rollout stored
    (ratio 1), in train mode as the trainer runs it. With dropout 0.3 they differed by 0.0099;
    now the model has no dropout at all, the config's is warned about, and they agree to float
    rounding (the rollout ran N rows per forward, the update all S x N at once)."""
    from rl_tformers.agents.gtrxl.ppo import state_from_rows

    from rl_tformers.backbone_config import ConfigAdviceWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ppo = _ppo_with(0.3)
    ppo.model.train()  # as in the trainer's loop, for the rollout and the update
    ro = ppo.collect()
    mb = next(ppo.minibatches(ro))
    assert mb["x"].shape[0] == 16  # the whole rollout: S x N = 8 x 2
    m = {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}
    st = state_from_rows(m["mem"], m["mem_pos"], m["mem_valid"], m["mem_seg"], m["episode"], m["pos"])
    h = ppo.model.encoder(m["x"][:, None], m["pos"][:, None], state=st).features[:, 0]
    torch.testing.assert_close(ppo.model.actor.log_prob(h, m["actions"]), m["logp"], atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.model.state_value(h), m["values"], atol=1e-6, rtol=0)
    _, logs = ppo.loss(mb)
    assert abs(logs["approx_kl"]) < 1e-7 and logs["clipfrac"] == 0.0
    assert all(m.p == 0.0 for m in ppo.model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(m.dropout_p == 0.0 for m in ppo.model.modules() if hasattr(m, "dropout_p"))
    assert ppo.model_cfg.backbone["dropout"] == ppo.model_cfg.backbone["attn_dropout"] == 0.0
    advice = [str(w.message) for w in said if issubclass(w.category, ConfigAdviceWarning)]
    assert len(advice) == 1 and advice[0].startswith(
        "gtrxl_ppo trains without dropout: backbone.dropout=0.3, backbone.attn_dropout=0.3 set to 0. ")
    with warnings.catch_warnings():  # a config without dropout (the default) is not warned about
        warnings.simplefilter("error", ConfigAdviceWarning)
        _ppo_with(0.0)


# ------------------------------------------------- 2. PPO: learned positions, no time limit
class _EndlessEnv(gym.Env):
    """Episodes that never end (and no TimeLimit: registered without max_episode_steps)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), 1.0, False, False, {}


ENDLESS = "rl_tformers_breaker8b/Endless-v0"
if ENDLESS not in gym.registry:
    gym.register(ENDLESS, entry_point=_EndlessEnv)

# one update per rollout of 6 steps: rollout 3 covers episode steps 12..17, past a 16-row table
ENDLESS_PPO = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=6", "agent.n_epochs=1",
               "agent.n_minibatches=1", "train.steps=4", "train.checkpoint_every=1", "train.progress=false",
               "train.log_every=1", "eval.at_end=false", "eval.every=0", "device=cpu", "backbone.d_model=16",
               "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4", f"agent.env_id={ENDLESS}",
               "backbone.position.kind=learned", "backbone.max_position=16"]


def test_ppo_learned_positions_without_a_time_limit_stop_with_a_clear_error_and_stay_resumable(tmp_path) -> None:
    """Was: "position.learned: positions must lie in [0, 16) but got [16, 16]" from inside the
    rollout. Now a ConfigError (the command line's one ``error:`` line) at the step that would need
    row 16, naming the option, the environment, the step and the fixes; the checkpoints of the
    updates before that rollout are intact and a resume continues from them exactly (to the same
    step of the same episode). The time limit the message suggests is checked before training
    when it is too long, and trains when it fits."""
    from rl_tformers.runtime import checkpoint as ckpt
    from rl_tformers.runtime.agent_registry import AgentBuildError
    from rl_tformers.runtime.run_config import ConfigError

    run = tmp_path / "endless"
    with pytest.raises(ConfigError) as err:  # (was a plain ValueError from the position table)
        train(compose(overrides=ENDLESS_PPO), run)
    msg = str(err.value)
    assert type(err.value).__name__ == "EpisodeLengthError"
    assert msg.startswith(f"gtrxl_ppo: an episode of {ENDLESS} (environment 0 of 2) reached episode step 16 in "
                          f"rollout 3, but backbone.position.kind=learned has table rows for episode steps 0..15 "
                          f"only (backbone.max_position=16) and {ENDLESS} has no time limit. ")
    assert "the checkpoints it wrote are intact" in msg
    assert msg.endswith("Fix it in a new run: agent.env_kwargs.max_episode_steps=15 (or less: a time limit whose "
                        "cuts are bootstrapped), backbone.max_position > the longest episode, or a relative "
                        "position kind (backbone.position.kind=xl_relative)")
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 1]  # the two rollouts trained before
    with pytest.raises(ConfigError) as again:  # exact continuation: the same episode, the same step
        resume(run)
    assert str(again.value) == msg
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 1]
    # the suggested time limit: one too long is refused before anything is written, one that fits trains
    with pytest.raises(AgentBuildError, match=r"backbone\.max_position=16 but .* episodes run up to 16 steps"):
        train(compose(overrides=[*ENDLESS_PPO, "agent.env_kwargs={max_episode_steps: 16}"]), tmp_path / "sixteen")
    assert not (tmp_path / "sixteen").exists()
    state = train(compose(overrides=[*ENDLESS_PPO, "agent.env_kwargs={max_episode_steps: 15}"]), tmp_path / "fifteen")
    assert state.step == 4


# ------------------------------------------------- 3. Linformer: the cross-attention's max_len
def test_linformer_cross_attention_names_its_own_max_len() -> None:
    """A 12-token source over a cross-attention Linformer with max_len=8 said
    "12 keys exceed attention.max_len=8": the encoder-decoder has no such option there."""
    from rl_tformers.encoder_decoder import EncoderDecoder

    stack = {"d_model": 16, "n_heads": 2, "n_layers": 1}
    model = EncoderDecoder({"encoder": stack, "decoder": stack,
                            "cross_attention": {"kind": "linformer", "k": 4, "max_len": 8}})
    with pytest.raises(ValueError) as err:
        model(torch.randn(1, 12, 16), torch.randn(1, 3, 16))
    assert str(err.value) == ("attention kind 'linformer': 12 keys exceed cross_attention.max_len=8 "
                              "(E and F have a fixed length)")
    # the encoder's own Linformer names the encoder's option
    model = EncoderDecoder({"encoder": {**stack, "attention": {"kind": "linformer", "k": 4, "max_len": 8}},
                            "decoder": stack, "cross_attention": {"kind": "linformer", "k": 4, "max_len": 16}})
    with pytest.raises(ValueError) as err:
        model(torch.randn(1, 12, 16), torch.randn(1, 3, 16))
    assert str(err.value) == ("attention kind 'linformer': 12 keys exceed encoder.attention.max_len=8 "
                              "(E and F have a fixed length)")
    model(torch.randn(1, 8, 16), torch.randn(1, 3, 16))  # within both: runs


# ------------------------------------------------- 4. blockwise: no cross-attention
def test_blockwise_is_refused_as_cross_attention() -> None:
    """Accepted before, and source padding changed the real targets' outputs (three trailing pad
    tokens on a 6-token source moved them by 0.46: blocks of ceil(S / n) cut over the padded S).
    Refused now when the config is built, naming the option and the kinds that work; blockwise
    self-attention in the encoder is unchanged."""
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoder
    from rl_tformers.registry import ATTENTION

    assert ATTENTION.get("blockwise").capabilities.cross_attention is False
    with pytest.raises(IncompatibleConfig) as err:
        EncoderDecoder({"cross_attention": {"kind": "blockwise", "n_blocks": 3}})
    assert str(err.value).startswith("cross_attention.kind='blockwise' cannot attend to another sequence: ")
    assert str(err.value).endswith("use one of linformer, performer, reference, rfa, sdpa")
    stack = {"d_model": 16, "n_heads": 2, "n_layers": 1}
    model = EncoderDecoder({"encoder": {**stack, "attention": {"kind": "blockwise", "n_blocks": 3}}, "decoder": stack})
    assert model(torch.randn(1, 6, 16), torch.randn(1, 9, 16)).hidden.shape == (1, 9, 16)


# ------------------------------------------------- 5. sweep: a run's seconds over all its parts
def test_sweep_seconds_are_the_total_over_a_run_s_parts(tmp_path) -> None:
    """A run resumed by a second sweep reported only the second part's wall time (a skipped run
    0). Each part's time now goes to ``logs/<run>.parts.jsonl`` and the row sums them; a run that
    starts anew (its directory deleted, or never made) counts anew."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sw"
    (run,) = sw.expand({}, [0], out)
    logs = out / "logs"
    sleep = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    first = sw.run_local([(run, sleep)], jobs=1, threads=1, log_dir=logs, echo=lambda m: None)[run.name]
    second = sw.run_local([(run, sleep)], jobs=1, threads=1, log_dir=logs, echo=lambda m: None)[run.name]
    res = sw.write_results(out, [run], {run.name: second}, warn=lambda m: None)
    assert res.rows[0]["seconds"] == round(first.seconds + second.seconds, 2)  # was round(second.seconds, 2)
    assert res.rows[0]["seconds"] >= 0.6
    assert sw.part_seconds(logs / "base_seed0.log") == [first.seconds, second.seconds]
    skipped = sw.write_results(out, [run], {run.name: sw.RunOutcome("skipped", 0)}, warn=lambda m: None)
    assert skipped.rows[0]["seconds"] == res.rows[0]["seconds"]  # was 0.0
    # the run directory does not exist (the stand-ins made none): the sweep trains it anew, from 0 s
    common = ["agent.kind=toy", "train.steps=2", "train.log_every=1", "eval.at_end=false"]
    real = sw.sweep(None, {}, [0], out, common, device="cpu", echo=lambda m: None)
    (part,) = sw.part_seconds(logs / "base_seed0.log")
    assert real.rows[0]["status"] == "ok" and real.rows[0]["seconds"] == round(part, 2)
