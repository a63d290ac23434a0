"""The trainer redraws random attention features (Performer / RFA / LSH ``redraw_every``) between
updates, on a schedule that depends only on (seed, step), so interrupted runs resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import assert_same_weights, model_state, toy_cfg

from rl_tformers.attention._linear import maybe_redraw_random_features
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.seeding import derive_seed
from rl_tformers.runtime.trainer import Trainer, resume, train

#: a toy run whose backbone is a 2-layer Performer (dropout on: the RNG state matters on resume)
PERFORMER = ("backbone.attention.kind=performer", "backbone.attention.chunk_size=4", "backbone.attention.seed=0",
             "backbone.attn_dropout=0.0", "backbone.n_layers=2")


def _seen_features(trainer: Trainer, name: str = "omega") -> list[list[torch.Tensor]]:
    """Wrap the agent's loss to record, at every update's forward, each layer's random buffer."""
    mods = [m for m in trainer.model.modules() if hasattr(m, name)]
    assert len(mods) == 2
    seen: list[list[torch.Tensor]] = []
    loss = trainer.agent.loss

    def recording(batch):
        seen.append([getattr(m, name).clone() for m in mods])
        return loss(batch)

    trainer.agent.loss = recording
    return seen


def _groups(seen: list[list[torch.Tensor]]) -> list[list[int]]:
    """Update indices grouped by runs of identical features (all layers)."""
    out = [[0]]
    for s in range(1, len(seen)):
        same = all(torch.equal(a, b) for a, b in zip(seen[s], seen[s - 1]))
        (out[-1].append(s) if same else out.append([s]))
    return out


def test_features_change_at_the_redraw_interval_only(run_dir: Path) -> None:
    cfg = toy_cfg(*PERFORMER, "backbone.attention.redraw_every=3", "train.steps=10")
    tr = Trainer(cfg, run_dir)
    first = tr._random_feature_modules[0]
    seen = _seen_features(tr)
    tr.fit()
    # the forward of update s sees the features after s completed updates: redraws after 3, 6, 9
    assert _groups(seen) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    # each redraw is a pure function of (seed, step): layer 0 draws first from the step's generator
    gen = torch.Generator().manual_seed(derive_seed(int(cfg.seed), "redraw", 3))
    assert torch.equal(seen[3][0], first._draw(gen))
    assert not torch.equal(seen[3][1], seen[3][0])  # the layers get different draws


def test_no_redraw_without_a_schedule(run_dir: Path) -> None:
    tr = Trainer(toy_cfg(*PERFORMER, "train.steps=6"), run_dir)
    seen = _seen_features(tr)
    tr.fit()
    assert _groups(seen) == [list(range(6))]


def test_on_policy_agents_redraw_only_between_rollouts(run_dir: Path) -> None:
    """``updates_per_rollout`` U = 4, redraw_every = 6: due steps 6, 12, 18 are taken at the next
    rollout boundary (8, 12, 20) and never inside a block of U updates."""
    tr = Trainer(toy_cfg(*PERFORMER, "backbone.attention.redraw_every=6", "train.steps=24"), run_dir)
    tr.agent.updates_per_rollout = 4
    seen = _seen_features(tr)
    tr.fit()
    assert _groups(seen) == [list(range(8)), list(range(8, 12)), list(range(12, 20)), list(range(20, 24))]


@pytest.mark.parametrize(("step", "since", "due"), [(3, 2, 1), (4, 3, 0), (8, 4, 1), (4, 0, 0), (12, 8, 1), (16, 12, 0)])
def test_maybe_redraw_catches_up_since(step: int, since: int, due: int) -> None:
    tr_cfg = {"d_model": 8, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
              "attention": {"kind": "performer", "redraw_every": 6 if since % 4 == 0 else 3}}
    from rl_tformers import Backbone

    assert maybe_redraw_random_features(Backbone(tr_cfg), step, since=since) == due


@pytest.mark.parametrize("kind", ["performer", "rfa", "lsh"])
def test_resume_with_redraws_is_bit_identical(tmp_path: Path, kind: str) -> None:
    """N updates in one run == a run stopped at 7 (between redraws at 6 and 9) and resumed."""
    over = [f"backbone.attention.kind={kind}", "backbone.attention.seed=0", "backbone.attn_dropout=0.0",
            "backbone.n_layers=2", "backbone.attention.redraw_every=3", "train.steps=20"]
    over += {"performer": ["backbone.attention.chunk_size=4"], "rfa": ["backbone.attention.chunk_size=4"],
             "lsh": ["backbone.attention.bucket_size=4", "backbone.position.kind=none"]}[kind]
    cfg = toy_cfg(*over)
    assert cfg.backbone.dropout > 0
    full, split = tmp_path / "full", tmp_path / "split"
    train(cfg, full)
    train(cfg, split, stop_at=7)
    resume(split)
    a, b = model_state(full, 20), model_state(split, 20)
    assert_same_weights(a, b)
    buf = {"performer": "omega", "rfa": "eps_dirs", "lsh": "rotations"}[kind]
    first = model_state(split, 7)
    keys = [k for k in a if k.endswith(buf)]
    assert len(keys) == 2 and all(not torch.equal(a[k], first[k]) for k in keys)  # redraws did happen


# ------------------------------------------------- the features a checkpoint / evaluation holds
def test_checkpoints_and_evaluations_hold_the_features_their_weights_were_trained_with(tmp_path: Path) -> None:
    """redraw_every=5, 10 updates, evaluations every 5: the evaluation of step 5 and 10, and the
    checkpoint of step 10, must use the random features of update 5 and 10 (measured on the toy
    task with 400 updates and redraw_every=100: the final model's evaluation MSE was 2-10x that of
    the same weights with the features they were trained with)."""
    from rl_tformers.runtime import toy
    from rl_tformers.runtime.trainer import Trainer

    cfg = compose(None, ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=10",
                         "train.batch_size=4", "train.warmup_steps=2", "train.log_every=5", "train.checkpoint_every=5",
                         "backbone.attention.kind=performer", "backbone.attention.chunk_size=4",
                         "backbone.attention.seed=0", "backbone.attention.redraw_every=5", "backbone.attn_dropout=0",
                         "eval.every=5", "eval.at_end=true"])
    tr = Trainer(cfg, tmp_path / "run")
    layer = tr._random_feature_modules[0]
    trained: list[torch.Tensor] = []  # features of update s (index s - 1)
    evaluated: dict[int, torch.Tensor] = {}
    loss, evaluate = tr.agent.loss, toy.ToyAgent.evaluate

    def recording_loss(batch):
        trained.append(layer.omega.clone())
        return loss(batch)

    def recording_evaluate(step):
        evaluated[step] = layer.omega.clone()
        return evaluate(tr.agent, step)

    tr.agent.loss, tr.agent.evaluate = recording_loss, recording_evaluate
    tr.fit()
    assert not torch.equal(trained[4], trained[5])  # the redraw between updates 5 and 6 did happen
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    name = next(k for k in ckpt if k.endswith("omega"))
    assert torch.equal(evaluated[5], trained[4])  # not step 5's evaluation saw the features of update 6
    assert torch.equal(evaluated[10], trained[9])  # not a fresh draw no update ever used
    assert torch.equal(ckpt[name], trained[9])
