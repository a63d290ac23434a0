"""Defects found by swap breaker 9 (the backbone swap path: one override on DT / GTrXL runs).

1. Offline GTrXL (``agent.kind=gtrxl``) accepted ``backbone.causal=false``: ``build_backbone``
   (agents/gtrxl/model.py) never looks at ``causal``, so training segments ran bidirectional
   attention and each step's action was trained from features that saw the *later* steps of its
   window (their observations, a_{t}, r_{t} as next-step inputs), while acting runs one token at a
   time and never sees the future. Measured: changing step 4's input of a 5-step segment moved the
   features of steps 0..3 by 1e-2 (random 16-wide model). A causal DT on a non-causal kernel is
   refused; GTrXL should refuse it too (or always build a causal stack).
2. The generic refusal of a non-causal kernel (``backbone.attention.kind=bigbird``...) tells a
   GTrXL user to "set backbone.causal=false", which is the leaking configuration of 1: GTrXL has
   no ``last_action`` mode, so the advice should name the kernels it can use instead.
3. GTrXL with ``backbone.depth.kind=early_exit`` under ``--nproc 2`` died at the second update with
   DDP's "Expected to have finished reduction in the prior iteration ... Parameter indices which did
   not receive grad: 27 28" traceback: GTrXL trains at full depth and passes no exit head, so the
   depth kind's ``exit_classifier`` never gets a gradient, and the agent does not ask the trainer
   for ``find_unused_parameters`` (as PPO's critic warm-up does, docs/runtime.md: "an agent that
   knows it asks for it itself"). ``train.ddp_find_unused=true`` works around it.
4. GTrXL with ``backbone.memory.kind=compressive`` and a FIFO that the burn-in + window do not
   overflow (the kind's default ``mem_len=32`` with ``seq_len + burn_in <= 32``, e.g. the README's
   ``gtrxl/hopper_positions_bc backbone.memory.kind=compressive``) under ``--nproc 2`` aborted with
   gloo's "Received data size doesn't match expected size. 7604 vs 8 ... collective mismatch" and
   ``rank 1 was killed by SIGABRT``: the compressor runs only in updates where some window crosses
   an episode boundary (data-dependent, so one rank reduces gradients while the other does not).
5. An unknown slot field with the default kind (``backbone.attention.window=3``) says "set
   backbone.attention.kind to a kind that has it (rl-tformers backbones lists them)", but
   ``rl-tformers backbones`` (table and ``--json``) lists slot, kind, description, paper and
   capabilities only: no kind's fields, so the hint leads nowhere.
6. ``rl-tformers train --resume RUN train.steps=N backbone.attention.orthogonal=true`` (Performer's
   default value, unset in the run's config) is refused with "these keys cannot change when
   resuming (the run would no longer continue exactly ...): backbone.attention.orthogonal: <unset>
   -> True", although the built backbone is identical (``backbone.position.kind=none``, also the
   default, is accepted).
7. docs/backbone.md's example of the field type check, "`local` with `block_size: 2.5`: '... block_size
   must be an integer, got 2.5 (float)'", names a field ``local`` does not have (its fields are
   ``block`` and ``memory``): that config gives "unknown key ... did you mean backbone.attention.block?".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import ConfigError, compose

runner = CliRunner()


def _gtrxl(path: Path, *extra: str) -> list[str]:
    return ["agent.kind=gtrxl", "agent.objective=bc", f"dataset.path={path}", "agent.seq_len=4", "agent.burn_in=2",
            "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "train.batch_size=4",
            "train.steps=2", "train.warmup_steps=1", "train.progress=false", "eval.at_end=false", "eval.every=0",
            "device=cpu", *extra]


def _build(overrides: list[str], tmp_path: Path):
    from rl_tformers.runtime.agent_registry import build_agent

    return build_agent(compose(overrides=overrides), tmp_path / "run", torch.device("cpu"))


# -- 1. offline GTrXL trained with bidirectional attention (future steps leak into each action) ----
def test_gtrxl_refuses_or_ignores_a_non_causal_backbone(tmp_path, cartpole_h5) -> None:
    from rl_tformers.runtime.agent_registry import AgentBuildError

    data = cartpole_h5(tmp_path / "cp.h5")
    try:
        agent = _build(_gtrxl(data, "backbone.causal=false"), tmp_path)
    except (AgentBuildError, ConfigError) as exc:  # the fix may refuse it, naming the option
        assert "backbone.causal" in str(exc), str(exc)
        return
    # ... or build a causal stack anyway: step t's features must not depend on steps > t
    enc = agent.model.encoder
    enc.eval()
    torch.manual_seed(0)
    x = torch.randn(1, 5, enc.cfg.input_dim)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        h1 = enc(x, pos, state=enc.initial_state(1)).features
        x2 = x.clone()
        x2[0, 4] += 10.0
        h2 = enc(x2, pos, state=enc.initial_state(1)).features
    leak = (h1[0, :4] - h2[0, :4]).abs().max().item()
    assert leak == 0.0, f"steps 0..3 changed by {leak:.2e} when only step 4's input changed (future leak)"


# -- 2. GTrXL's refusal of a non-causal kernel advises the leaking backbone.causal=false -------------
def test_gtrxl_refusal_of_a_non_causal_kernel_does_not_advise_causal_false(tmp_path, cartpole_h5) -> None:
    from rl_tformers.runtime.agent_registry import AgentBuildError

    data = cartpole_h5(tmp_path / "cp.h5")
    with pytest.raises((AgentBuildError, ConfigError)) as info:
        _build(_gtrxl(data, "backbone.attention.kind=bigbird"), tmp_path)
    msg = str(info.value)
    assert "bigbird" in msg
    assert "set backbone.causal=false" not in msg, msg  # GTrXL has no last_action mode: that config leaks


# -- 3./4. GTrXL parameters without a gradient under DDP (early_exit, compressive) -------------------
@pytest.mark.filterwarnings("ignore:backbone.memory.kind")  # xl's mem_len/detach dropped: wanted here
@pytest.mark.parametrize("swap", [
    ["backbone.depth.kind=early_exit"],
    ["backbone.memory.kind=compressive"],  # default mem_len=32 > burn_in + seq_len: compresses only at episode ends
], ids=["early_exit", "compressive"])
def test_gtrxl_asks_ddp_to_find_parameters_that_some_updates_leave_without_gradient(tmp_path, cartpole_h5, swap):
    """DistributedDataParallel (find_unused_parameters=False, the default) needs every trainable
    parameter to get a gradient in every update, else ``--nproc 2`` dies at the next update (or, when
    only one rank skips them, gloo aborts on a collective mismatch). An agent that leaves some without
    one must ask for ``ddp_find_unused`` itself (docs/runtime.md), as PPO's critic warm-up does."""
    data = cartpole_h5(tmp_path / "cp.h5")
    agent = _build(_gtrxl(data, "train.steps=3", *swap), tmp_path)
    batches = iter(agent.batches(0))
    unused: set[str] = set()
    for _ in range(3):
        agent.model.zero_grad(set_to_none=True)
        loss, _logs = agent.loss(next(batches))
        loss.backward()
        unused |= {n for n, p in agent.model.named_parameters() if p.requires_grad and p.grad is None}
    if unused:
        assert getattr(agent, "ddp_find_unused", False), (
            f"{swap}: parameters {sorted(unused)} got no gradient in some updates, but the agent does not ask "
            f"for ddp_find_unused: rl-tformers train --nproc 2 crashes")


# -- 5. the hint "rl-tformers backbones lists them" points to a command that lists no fields --------
def test_unknown_field_hint_leads_to_the_kinds_that_have_it() -> None:
    with pytest.raises(ConfigError) as info:
        compose(overrides=["agent.kind=dt", "backbone.attention.window=3"])
    msg = str(info.value)
    assert "backbone.attention.window" in msg
    if "sliding_window" in msg:  # the message itself names a kind with a `window` field
        return
    assert "rl-tformers backbones" in msg
    r = runner.invoke(app, ["backbones", "--slot", "attention", "--json"])
    assert r.exit_code == 0, r.output
    entry = next(e for e in json.loads(r.stdout) if e["kind"] == "sliding_window")
    listed = json.dumps({k: v for k, v in entry.items() if k not in ("description", "paper", "kind", "slot")})
    assert "window" in listed, f"the error sends the user to `rl-tformers backbones`, which lists no fields: {entry}"


# -- 6. resume refuses a kind's field set to the value the run already used --------------------------
def test_resume_accepts_a_slot_field_given_its_default_value(tmp_path, cartpole_h5) -> None:
    data = cartpole_h5(tmp_path / "cp.h5")
    run = tmp_path / "run"
    base = ["-c", "dt/cartpole_demo", f"dataset.path={data}", "train.steps=2", "train.batch_size=4",
            "train.warmup_steps=1", "train.progress=false", "backbone.d_model=16", "backbone.n_layers=1",
            "backbone.attn_dropout=0", "agent.context_len=3", "agent.max_ep_len=20", "eval.at_end=false",
            "device=cpu", "backbone.attention.kind=performer"]
    r = runner.invoke(app, ["train", *base, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    # Performer's default is orthogonal=true: the resumed run builds exactly the same backbone
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3", "backbone.attention.orthogonal=true"])
    assert r.exit_code == 0, r.output  # was: "backbone.attention.orthogonal: <unset> -> True" cannot change


# -- 7. docs/backbone.md's type-check example uses a field the kind does not have --------------------
def test_backbone_doc_type_check_example_gives_the_message_it_quotes() -> None:
    import re

    from rl_tformers.backbone_config import BackboneConfig

    doc = (Path(__file__).resolve().parents[2] / "docs" / "backbone.md").read_text()
    m = re.search(r"`(\w+)` with `(\w+): ([0-9.]+)`: \"\.\.\. (\w+) must be an integer, got ([0-9.]+) \(float\)\"", doc)
    assert m, "the example of the field type check is no longer in docs/backbone.md"
    kind, field, value, quoted_field, quoted_value = m.groups()
    with pytest.raises(Exception) as info:
        BackboneConfig.from_dict({"attention": {"kind": kind, field: float(value)}})
    assert f"{quoted_field} must be an integer, got {quoted_value} (float)" in str(info.value), str(info.value)
