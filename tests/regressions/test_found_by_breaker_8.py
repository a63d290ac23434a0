"""Defects found by breaker 8 (GTrXL PPO, DDP, encoder-decoder, reversible blocks, plot, sweep).

1. PPO-GTrXL with ``backbone.position.kind=learned`` and ``backbone.max_position`` equal to the
   environment's time limit was accepted, then died at the first time-limit truncation: its
   bootstrap values the final observation at step ``time limit``, one past the table.
2. PPO-GTrXL in an environment with a scalar Box action space (``shape=()``) collected its
   rollouts with scalar actions but evaluated (``eval.every``, ``rl-tformers eval``) with (1,)
   arrays: ``policy()`` passed the empty action shape as "no shape", so the policy fell back to
   flat (N, A) actions the environment's space does not contain.
3. ``rl-tformers train -c gtrxl/ppo_cartpole --nproc 3`` was refused before starting with
   "train.batch_size=64 is the global batch and must be divisible by the 3 processes": PPO
   never reads ``train.batch_size`` (each rank trains on minibatches of its own rollout), so
   every process count works; the check now skips agent kinds registered with ``local_batches``.
4. A reversible backbone with ``recompute=true`` (the default) returned
   ``output_hidden_states`` computed inside its autograd Function under no_grad: detached, so
   a loss on per-layer outputs (deep supervision, probes) got no gradient at all ("element 0 of
   tensors does not require grad") or, added to the main loss, silently none from those terms;
   ``recompute=false`` backpropagated through them. They are now outputs of the Function.
5. The encoder-decoder accepted ``cross_attention.kind`` = ``local``, ``local_2d``, ``strided``,
   ``fixed``, ``sliding_window`` and ``adaptive_span`` (declared ``cross_attention``), whose
   patterns put query i at key index S - T + i (the last T keys): with more target than source
   tokens the first targets read no source at all (e.g. ``fixed``, S = 3, T = 9: six of the nine
   targets; ``local``, S = 3, T = 40: five), silently a zero cross-attention output. They are now
   refused when the config is built, like ``bigbird``/``longformer``; every kind still accepted
   lets every target read every real source token for S < T and S > T.
6. ``rl-tformers sweep`` read each run's last scalars from ``metrics.jsonl`` skipping ``null``,
   which is how a NaN or infinite value is written: a run whose loss and final evaluation
   diverged to NaN was reported with its last *finite* loss and an *intermediate* evaluation,
   and that stale evaluation was averaged into the grid point's summary as if final.
7. ``rl-tformers train --nproc N`` on CUDA (``device=cuda``, or ``auto`` with a GPU) with more
   processes than GPUs started all N ranks; those without a GPU died in ``rank_device`` with a
   traceback and torchrun's failure line. The launcher now refuses it before starting anything,
   with one ``error:`` line naming ``--nproc`` and the GPU count (exit status 2).
8. ``backbone.block.kind=reversible`` (recompute, the default) with an attention kind that returns
   an auxiliary loss (``adaptive_span``'s L1 span penalty, ``routing`` with a commitment loss)
   passed every config check, created the run directory, then died at the first update with a
   RuntimeError traceback ("... cannot backpropagate; set backbone.block.recompute=false"), and
   the half-made run directory then blocked the same ``--run-dir``. The auxiliary losses are now
   outputs of the reversible function and backpropagate through its recomputation: gradients
   equal ``recompute=false``.
9. PPO fine-tuning with a critic warm-up (``agent.critic_warmup``, as in the shipped
   ``gtrxl/ppo_cartpole_finetune``) under ``--nproc 2`` died at the second update: the critic-only
   updates leave the encoder and actor without a gradient, and DistributedDataParallel (built
   with ``find_unused_parameters=False``) raised "Expected to have finished reduction in the prior
   iteration". The agent now says so (``ddp_find_unused``) and the trainer lets DDP find them;
   the warm-up leaves encoder and actor untouched, as in one process (weight decay included).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

SHORT = "rl_tformers_breaker8/ShortCartPole-v1"  # time limit 10: a truncation in every rollout below
if SHORT not in gym.registry:
    gym.register(SHORT, entry_point=CartPoleEnv, max_episode_steps=10)

PPO_TINY = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=12", "agent.n_epochs=1", "agent.n_minibatches=1",
            "train.steps=2", "train.progress=false", "train.log_every=1", "eval.at_end=false", "eval.every=0",
            "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
            "backbone.memory.mem_len=4", f"agent.env_id={SHORT}"]


# ------------------------------------------------- 1. PPO: learned positions and the truncation bootstrap
def test_ppo_learned_positions_need_a_row_for_the_bootstrapped_final_observation(tmp_path) -> None:
    """max_position == time limit passed the check and crashed at the first truncation
    ("position.learned: positions must lie in [0, 10) but got [10, 10]"); now refused up front,
    naming the option and the size it needs; time limit + 1 rows train."""
    from rl_tformers.runtime.agent_registry import AgentBuildError

    learned = ["backbone.position.kind=learned"]
    with pytest.raises(AgentBuildError, match=r"backbone\.max_position=10 but .* episodes run up to 10 steps .*"
                                              r"set backbone\.max_position >= 11"):
        train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=10"]), tmp_path / "ten")
    state = train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=11"]), tmp_path / "eleven")
    assert state.step == 2


# ------------------------------------------------- 2. PPO: a scalar Box action space
class _ScalarActionEnv(gym.Env):
    """Box(-2, 2, shape=()) actions; refuses any action its space does not contain."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        if not self.action_space.contains(np.asarray(action, np.float32)):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.t += 1
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), float(action), self.t >= 4, False, {}


SCALAR = "rl_tformers_breaker8/ScalarAction-v0"
if SCALAR not in gym.registry:
    gym.register(SCALAR, entry_point=_ScalarActionEnv, max_episode_steps=6)


def test_ppo_with_a_scalar_box_action_evaluates_with_scalar_actions() -> None:
    from omegaconf import OmegaConf
    from rl_tformers.agents.gtrxl.model import gtrxl_backbone
    from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO

    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"env_id": SCALAR, "n_envs": 2, "n_steps": 6, "n_minibatches": 2})
    cfg.eval.update({"episodes": 2, "n_envs": 2})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    torch.manual_seed(0)
    ppo = GTrXLPPO(cfg, None, torch.device("cpu"))
    ppo.collect()  # (the rollout already stepped with scalar actions)
    policy = ppo.policy()
    actions, _ = policy.act(np.zeros((2, 3), np.float32), policy.initial_state(2), np.ones(2, bool))
    assert actions.shape == (2,) and actions.dtype == np.float32
    assert all(ppo.envs.single_action_space.contains(np.asarray(a)) for a in actions)
    report = ppo.evaluate(0)  # raised "action array([...]) is not in Box(-2.0, 2.0, (), float32)"
    assert set(report) == {"eval/return_mean", "eval/return_std"} and np.isfinite(report["eval/return_mean"])


# ------------------------------------------------- 3. DDP: PPO does not split train.batch_size
def test_ppo_under_any_process_count_is_not_refused_for_the_unused_batch_size() -> None:
    from rl_tformers.runtime.agent_registry import get_agent
    from rl_tformers.runtime.run_config import ConfigError
    from rl_tformers.runtime.trainer import check_world_size

    assert get_agent("gtrxl_ppo").local_batches is True
    ppo = compose("gtrxl/ppo_cartpole", ["train.batch_size=64"])
    for nproc in (1, 2, 3, 5, 7):
        check_world_size(ppo, nproc)  # raised ConfigError for 3, 5 and 7
    dt = compose(overrides=["agent.kind=dt", "train.batch_size=64"])  # agents that do split the batch: still refused
    assert get_agent("dt").local_batches is False
    with pytest.raises(ConfigError, match=r"train\.batch_size=64 is the global batch and must be divisible by the 3 "):
        check_world_size(dt, 3)
    check_world_size(dt, 4)


# ------------------------------------------------- 4. reversible: per-layer outputs carry gradients
def test_reversible_hidden_states_backpropagate_as_without_recompute() -> None:
    from rl_tformers import Backbone

    def grads(recompute: bool, layers: tuple[int, ...]):
        torch.manual_seed(0)
        bb = Backbone({"d_model": 16, "n_layers": 3, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.1,
                       "position": {"kind": "learned", "per_layer": True},
                       "block": {"kind": "reversible", "recompute": recompute}}).double().train()
        x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[1, 5:] = False
        torch.manual_seed(4)  # the same dropout masks in both runs
        out = bb(x, mask=mask, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and all(h.requires_grad for h in out.hidden_states)
        g = torch.Generator().manual_seed(2)
        loss = sum((out.hidden_states[i] * torch.randn(2, 7, 16, dtype=torch.float64, generator=g)).sum()
                   for i in layers)
        if not layers:
            loss = (out.hidden * torch.randn(2, 7, 16, dtype=torch.float64, generator=g)).sum()
        loss.backward()
        return x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in bb.named_parameters()}

    for layers in ((0,), (1,), (0, 1, 2), ()):
        (gx, gp), (hx, hp) = grads(True, layers), grads(False, layers)
        assert gx.abs().sum() > 0 and sum(g.abs().sum() for g in gp.values()) > 0
        torch.testing.assert_close(gx, hx, atol=1e-10, rtol=0)
        for name in gp:
            torch.testing.assert_close(gp[name], hp[name], atol=1e-10, rtol=0, msg=name)


# ------------------------------------------------- 5. encoder-decoder: no target left without a source
@pytest.mark.parametrize("kind", ["local", "local_2d", "strided", "fixed", "sliding_window", "adaptive_span"])
def test_key_index_patterns_are_refused_as_cross_attention(kind) -> None:
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    with pytest.raises(IncompatibleConfig, match=rf"cross_attention\.kind='{kind}' cannot attend to another sequence: "
                                                 r"its queries must be the last T of its S keys"):
        EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})


def test_every_accepted_cross_attention_kind_lets_every_target_read_the_source() -> None:
    from rl_tformers.encoder_decoder import EncoderDecoder
    from rl_tformers.registry import ATTENTION

    small = {"d_model": 16, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    accepted = [e.kind for e in ATTENTION if e.capabilities.cross_attention and e.capabilities.bidirectional]
    assert "sdpa" in accepted and "local" not in accepted
    for kind in accepted:
        torch.manual_seed(0)
        model = EncoderDecoder({"encoder": small, "decoder": small, "cross_attention": {"kind": kind}}).eval()
        for s_len, t_len in ((3, 9), (1, 4), (9, 3)):
            tgt = torch.randn(1, t_len, 16, generator=torch.Generator().manual_seed(1))
            memory = torch.randn(1, s_len, 16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
            hidden, _, _ = model.decode(tgt, memory)  # the encoder output directly: what cross-attention reads
            for t in range(t_len):
                (g,) = torch.autograd.grad((hidden[0, t] * torch.arange(16.0)).sum(), memory, retain_graph=True)
                reads = int((g[0].abs().sum(-1) > 0).sum())
                assert reads == s_len, (kind, s_len, t_len, t, reads)  # e.g. local: 0 for the first targets


# ------------------------------------------------- 6. sweep: a diverged run's final NaN is not hidden
def test_sweep_results_report_a_final_non_finite_value_not_an_earlier_finite_one(tmp_path) -> None:
    import json
    import math

    from rl_tformers.runtime.sweep import RunOutcome, expand, last_scalars, write_results

    runs = expand({"train.lr": ["1e-3"]}, [0, 1], tmp_path / "sw")
    for seed, run in enumerate(runs):
        run.run_dir.mkdir(parents=True)
        final = {"step": 10, "train/loss": None, "eval/return": None} if seed == 0 else \
            {"step": 10, "train/loss": 0.4, "eval/return": 20.0}  # (null: how metrics.jsonl writes NaN / inf)
        records = [{"step": 5, "time": 1.0, "train/loss": 0.5, "eval/return": 10.0}, final]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    scalars = last_scalars(runs[0].run_dir)
    assert scalars["step"] == 10.0 and math.isnan(scalars["train/loss"]) and math.isnan(scalars["eval/return"])
    warned: list[str] = []
    res = write_results(tmp_path / "sw", runs, {r.name: RunOutcome("ok", 0) for r in runs}, warn=warned.append)
    assert math.isnan(res.rows[0]["eval/return"]) and math.isnan(res.rows[0]["train/loss"])  # were 10.0 and 0.5
    (point,) = res.summary
    assert (point["n"], point["of"], point["mean"], point["std"]) == (1, 2, 20.0, None)  # was n=2, mean 15.0
    saved = json.loads((tmp_path / "sw" / "results.json").read_text())  # strict JSON: NaN as null
    assert saved["runs"][0]["eval/return"] is None and saved["runs"][1]["eval/return"] == 20.0
    assert "| lr=1e-3/seed0 | 0 | ok | 10 | 0 | nan | nan |" in (tmp_path / "sw" / "results.md").read_text()
    assert warned == []
    # every completed run diverged: said so, not "only runs that did not complete logged it"
    res = write_results(tmp_path / "sw", runs[:1], {runs[0].name: RunOutcome("ok", 0)}, warn=warned.append)
    assert res.summary[0]["mean"] is None and not (tmp_path / "sw" / "results.png").exists()
    assert warned == ["warning: eval/return: its final value is NaN or infinite in every completed run that "
                      "logged it (diverged?); no summary values and no plot"]


# ------------------------------------------------- 7. DDP: more CUDA processes than GPUs
@pytest.mark.parametrize("device", ["cuda", "auto"], ids=["explicit-gpu", "auto-with-a-gpu"])
def test_nproc_beyond_the_gpu_count_is_refused_before_any_process_starts(tmp_path, monkeypatch, device) -> None:
    from typer.testing import CliRunner

    from rl_tformers.cli import app
    from rl_tformers.cli import train as commands

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started: list[list[str]] = []
    monkeypatch.setattr(commands, "_run_torchrun", lambda cmd, *a, **k: started.append(cmd) or 0)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "toy", "--nproc", "2", "--run-dir", str(run), f"device={device}"])
    assert r.exit_code == 2, r.output
    assert f"error: --nproc 2: device='{device}' runs one process per GPU (rank r on cuda:r) and this machine has " \
           "1 CUDA device(s); use --nproc <= 1, or device=cpu (gloo) for more processes" in r.output
    assert started == [] and not run.exists()
    r = CliRunner().invoke(app, ["train", "-c", "toy", "--nproc", "2", "--run-dir", str(run), "device=cpu"])
    assert r.exit_code == 0, r.output  # gloo: any number of processes (the launch itself is stubbed here)
    assert len(started) == 1 and "--nproc-per-node=2" in started[0]


# ------------------------------------------------- 8. reversible: auxiliary attention losses backpropagate
@pytest.mark.parametrize("attention", [
    {"kind": "adaptive_span", "max_span": 6, "loss_coef": 0.01},
    {"kind": "adaptive_span", "max_span": 6, "loss_coef": 0.01, "dynamic": True},
    {"kind": "routing", "n_clusters": 2, "local_window": 4, "cluster_window": 4, "commitment_weight": 0.5,
     "ema_decay": 0.9},
], ids=["span-static", "span-dynamic", "routing-commitment"])
def test_reversible_recompute_backpropagates_auxiliary_attention_losses(attention) -> None:
    from rl_tformers import Backbone

    def run(recompute: bool, use_aux: bool):
        torch.manual_seed(0)
        bb = Backbone({"d_model": 16, "n_layers": 3, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.0,
                       "causal": False, "position": {"kind": "learned", "per_layer": True}, "attention": attention,
                       "block": {"kind": "reversible", "recompute": recompute}}).double().train()
        x = torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        mask = torch.ones(2, 12, dtype=torch.bool)
        mask[1, 9:] = False
        torch.manual_seed(4)  # the same dropout masks in both runs
        out = bb(x, mask=mask)  # raised RuntimeError here with recompute=true
        assert len(out.aux) == 1 and all(v.requires_grad for v in out.aux.values())
        loss = (out.hidden * torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))).sum()
        if use_aux:
            loss = loss + 100 * sum(out.aux.values())
        loss.backward()
        params = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in bb.named_parameters()}
        buffers = {n: b.clone() for n, b in bb.named_buffers()}
        return {k: v.detach() for k, v in out.aux.items()}, x.grad, params, buffers

    for use_aux in (True, False):
        (aux, gx, gp, buf), (aux0, hx, hp, buf0) = run(True, use_aux), run(False, use_aux)
        assert aux.keys() == aux0.keys() and all(torch.equal(aux[k], aux0[k]) for k in aux)
        torch.testing.assert_close(gx, hx, atol=1e-10, rtol=0)
        for name in gp:
            torch.testing.assert_close(gp[name], hp[name], atol=1e-10, rtol=0, msg=name)
        for name in buf:  # routing's EMA centroids: one update per step either way
            torch.testing.assert_close(buf[name], buf0[name], atol=1e-12, rtol=0, msg=name)


# ------------------------------------------------- 9. DDP: PPO critic warm-up
def test_ppo_critic_warmup_trains_under_two_processes(tmp_path) -> None:
    from rl_tformers.runtime.checkpoint import load_checkpoint
    from tests.runtime.ddp_helpers import read_metrics, train_cli

    args = ["-c", "gtrxl/ppo_cartpole", "agent.critic_warmup=1", "agent.n_envs=2", "agent.n_steps=8",
            "agent.n_epochs=1", "agent.n_minibatches=2", "backbone.d_model=16", "backbone.n_layers=1",
            "backbone.n_heads=2", "backbone.memory.mem_len=4", "eval.at_end=false", "eval.every=0",
            "train.log_every=1", "train.progress=false", "train.weight_decay=0.1", "train.checkpoint_every=2",
            "train.steps=4"]  # 2 updates per rollout: rollout 1 trains the value head only, rollout 2 everything
    two, one = tmp_path / "two", tmp_path / "one"
    r = train_cli("--nproc", "2", *args, "--run-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]  # was: rank 1 ... "Expected to have finished reduction"
    assert [m["step"] for m in read_metrics(two)] == [1, 2, 3, 4]
    r = train_cli(*args, "train.steps=2", "--run-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    ddp, single = (load_checkpoint(run / "checkpoints" / "step_000000002.pt")["model"] for run in (two, one))
    for name in ddp:  # after the warm-up: encoder and actor untouched (no decay either), as in one process
        if not name.startswith("value."):
            assert torch.equal(ddp[name], single[name]), name
    end = load_checkpoint(two / "checkpoints" / "step_000000004.pt")["model"]
    assert not torch.equal(end["actor.net.0.weight"], ddp["actor.net.0.weight"])  # then the actor trains
