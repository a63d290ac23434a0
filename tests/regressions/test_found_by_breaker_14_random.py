"""Defects found by the fourteenth breaker pass in the attention kinds that carry randomness or
state outside autograd (``performer``, ``rfa``, ``lsh``, ``routing``, ``bigbird``, ``sinkhorn``,
``adaptive_span``) as the agents and the trainer use them.

1. ``routing`` under DDP (``rl-tformers train --nproc 2``): each rank's EMA k-means step averaged
   its own shard, and DDP's buffer broadcast then kept rank 0's centroids, so a 2-process run
   followed rank 0's half of every batch (centroids 0.06 apart from one process on the same
   global batch after 10 toy updates, losses 1e-3 apart where every other kind matches to 1e-6).
   The statistics are now summed over the ranks inside the trainer's DDP forward.
2. ``routing``'s EMA statistics were computed in bf16 under ``train.amp=bf16`` (CPU autocast
   turns the einsums into bf16 matmuls): centroids 2e-3 off the float32 step. Now float32.
3. GTrXL IQL's Polyak target copy never follows the online critic's non-parameter state:
   ``polyak_update`` averages parameters only, so the target encoder's routing centroids stay at
   their initial values forever (its forwards run without autograd, so it never takes an EMA
   step) and, with ``redraw_every``, the trainer redraws the target's Performer / RFA / LSH
   features independently of the online critic's. The target then computes Q through another
   attention function than the one whose weights it averages. ``polyak_update`` now copies the
   buffers.
4. Config validation: ``rfa`` and ``lsh`` accepted a negative ``redraw_every`` (silently never
   redrawn; ``performer`` refused it), ``lsh`` accepted ``max_buckets=0`` (an IndexError from
   ``argmax`` in the first forward) and odd caps (an odd automatic ``n_buckets`` whose last
   bucket the hash cannot reach).
5. The trainer redraws Performer / RFA / LSH features right after update s, before that step's
   checkpoint and evaluation: with the last step (or an evaluation step) a multiple of
   ``redraw_every``, the saved and evaluated model holds features no update trained with (toy:
   final evaluation MSE 2-10x that of the same weights with their trained features). The trainer
   now redraws before the next update's batch, after the checkpoint and evaluation.
6. ``bigbird`` with a large ``attention.seed`` (2**45) failed in its first forward
   ("Overflow when unpacking long long"); the per-draw seed is now reduced mod 2**63.

Toy agent / tiny backbones on the CPU, seconds each (the DDP test starts 2 gloo processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl_tformers import Backbone
from rl_tformers.attention._linear import maybe_redraw_random_features
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.runtime.ddp_helpers import read_metrics, two_ranks

ROUTING_TOY = ["agent.kind=toy", "device=cpu", "train.steps=10", "train.batch_size=8", "train.log_every=5",
               "train.checkpoint_every=10", "train.lr=3e-3", "train.warmup_steps=2", "eval.at_end=false",
               "train.progress=false", "backbone.dropout=0", "backbone.attn_dropout=0",
               "backbone.attention.kind=routing", "backbone.attention.n_clusters=2",
               "backbone.attention.local_window=4", "backbone.attention.cluster_window=4",
               "backbone.attention.seed=0", "backbone.attention.ema_decay=0.5", "backbone.position.kind=none"]
CENTROIDS = "backbone.depth.blocks.0.attn.centroids"


# ------------------------------------------------- 1: routing centroids under DDP
def test_routing_centroids_under_ddp_follow_the_global_batch_and_agree_on_every_rank(tmp_path: Path) -> None:
    single = tmp_path / "single"
    train(compose(None, ROUTING_TOY), single)
    outs = two_ranks(tmp_path, f"""
        from pathlib import Path
        from rl_tformers.runtime import trainer as T
        from rl_tformers.runtime.run_config import compose
        models = []
        fit = T.Trainer.fit

        def recording_fit(self, *args, **kwargs):
            models.append(self.model)
            return fit(self, *args, **kwargs)

        T.Trainer.fit = recording_fit
        T.train(compose(None, {ROUTING_TOY!r}), Path({str(tmp_path / "ddp")!r}))
        out["centroids"] = dict(models[0].named_buffers())[{CENTROIDS!r}].tolist()
    """)
    c0, c1 = (torch.tensor(o["centroids"]) for o in outs)
    assert torch.equal(c0, c1)  # was: rank 1 kept its own last EMA step (DDP broadcasts before forwards only)
    ref = torch.load(single / "checkpoints" / "step_000000010.pt", weights_only=True)["model"][CENTROIDS]
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "step_000000010.pt", weights_only=True)["model"][CENTROIDS]
    assert torch.equal(ddp, c0)
    torch.testing.assert_close(ddp, ref, rtol=0, atol=1e-4)  # was 0.06 apart: rank 0's half batch
    for a, b in zip(read_metrics(single), read_metrics(tmp_path / "ddp"), strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)  # was 1e-3 apart


# ------------------------------------------------- 2: routing EMA statistics in float32 under autocast
def _routing_backbone() -> Backbone:
    return Backbone({"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
                     "attention": {"kind": "routing", "n_clusters": 4, "local_heads": 0, "cluster_window": 4,
                                   "ema_decay": 0.0, "seed": 0}})


def test_routing_ema_step_is_float32_under_bf16_autocast() -> None:
    attn = next(m for m in _routing_backbone().modules() if hasattr(m, "ema_step"))
    g = torch.Generator().manual_seed(0)
    qn = F.normalize(torch.randn(64, 1, 50, 16, generator=g), dim=-1)
    kn = F.normalize(torch.randn(64, 1, 50, 16, generator=g), dim=-1)
    mu = attn.centroids.clone()
    cq = torch.einsum("bhtd,hkd->bhtk", qn, mu).argmax(-1)
    ck = torch.einsum("bhsd,hkd->bhsk", kn, mu).argmax(-1)
    ok = torch.ones(64, 50, dtype=torch.bool)
    attn.ema_step(qn, kn, cq, ck, ok, ok)
    fp32 = attn.centroids.clone()
    assert not torch.equal(fp32, mu)
    attn.centroids.copy_(mu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn.ema_step(qn, kn, cq, ck, ok, ok)
    assert attn.centroids.dtype == torch.float32
    assert torch.equal(attn.centroids, fp32)  # was 1.8e-3 off (bf16 einsums)


# ------------------------------------------------- 3: IQL's target encoder and the online critic's buffers
def _iql_model(attention: dict):
    from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone

    bb = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    bb["position"] = {"kind": "none"}
    bb["attention"] = attention
    torch.manual_seed(0)
    return GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, critic="iql", critic_hidden=8)).train()


def _segment(seed: int):
    from rl_tformers.agents.gtrxl.loss import SegmentBatch

    g = torch.Generator().manual_seed(seed)
    b, n = 3, 10
    return SegmentBatch(
        obs=torch.randn(b, n, 3, generator=g), actions=torch.rand(b, n, 2, generator=g) * 2 - 1,
        rewards=torch.randn(b, n, generator=g), rtg=torch.randn(b, n, generator=g),
        prev_action=torch.zeros(b, n, 2), prev_reward=torch.zeros(b, n),
        terminals=torch.zeros(b, n, dtype=torch.bool), episode_start=torch.zeros(b, n, dtype=torch.bool),
        timesteps=torch.arange(n).expand(b, n).clone(), mask=torch.ones(b, n, dtype=torch.bool), burn_in=2,
    )


@pytest.mark.parametrize("attention", [
    {"kind": "routing", "n_clusters": 2, "local_heads": 0, "cluster_window": 4, "ema_decay": 0.5, "seed": 0},
    {"kind": "performer", "chunk_size": 4, "seed": 0, "redraw_every": 1},
], ids=["routing-centroids", "performer-redrawn-features"])
def test_iql_target_encoder_uses_the_online_critic_s_attention_state(attention: dict) -> None:
    from rl_tformers.agents.gtrxl.loss import iql_loss, polyak_update

    model = _iql_model(attention)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    for step in range(3):  # the agent's update: Polyak step, loss, optimiser step, the trainer's redraw
        polyak_update(model.target, model.critic_target_modules(), 0.005)
        loss, _ = iql_loss(model, model.target, _segment(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        maybe_redraw_random_features(model, step + 1, torch.Generator().manual_seed(step))
    polyak_update(model.target, model.critic_target_modules(), 0.005)  # the next update's Polyak step
    online = dict(model.critic_target_modules()["encoder"].named_buffers())
    target = dict(model.target["encoder"].named_buffers())
    name = next(n for n in online if n.endswith(("centroids", "omega")))
    init = dict(_iql_model(attention).critic_target_modules()["encoder"].named_buffers())[name]
    assert not torch.equal(online[name], init)  # the online critic's attention state moved
    assert torch.equal(target[name], online[name])  # routing: target stuck at init; performer: its own draws


# ------------------------------------------------- 4: validation names the option
@pytest.mark.parametrize(("attention", "option"), [
    ({"kind": "rfa", "redraw_every": -1}, "attention.redraw_every"),
    ({"kind": "lsh", "redraw_every": -2}, "attention.redraw_every"),
    ({"kind": "performer", "redraw_every": -1}, "attention.redraw_every"),
    ({"kind": "lsh", "max_buckets": 0}, "attention.max_buckets"),
    ({"kind": "lsh", "max_buckets": 3}, "attention.max_buckets"),
])
def test_bad_redraw_period_and_bucket_cap_are_refused_naming_the_option(attention: dict, option: str) -> None:
    with pytest.raises(Exception, match=option.replace(".", r"\.") + r".*got " + str(next(iter(
            v for k, v in attention.items() if k != "kind")))):
        Backbone({"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0, "attention": attention})


def test_lsh_bucket_caps_that_remain_valid_still_run() -> None:
    x, pos = torch.randn(2, 12, 16), torch.arange(12).expand(2, 12)
    for cap in (1, 2, 4):
        bb = Backbone({"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0,
                       "attention": {"kind": "lsh", "max_buckets": cap, "bucket_size": 2, "seed": 0}})
        assert torch.isfinite(bb(x, positions=pos).hidden).all()


# ------------------------------------------------- 5: the features a checkpoint / evaluation holds
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
    assert torch.equal(evaluated[5], trained[4])  # was: step 5's evaluation saw the features of update 6
    assert torch.equal(evaluated[10], trained[9])  # was: a fresh draw no update ever used
    assert torch.equal(ckpt[name], trained[9])


def test_bigbird_takes_a_large_seed() -> None:
    """attention.seed=2**45 was accepted by the config, then the first forward failed with
    "Overflow when unpacking long long" (seed * 1_000_003 beyond torch's 64-bit seed range)."""
    cfg = {"d_model": 16, "n_layers": 1, "n_heads": 2, "causal": False, "attn_dropout": 0.0}
    x, pos = torch.randn(1, 12, 16), torch.arange(12)[None]
    torch.manual_seed(0)
    big = Backbone({**cfg, "attention": {"kind": "bigbird", "block": 2, "seed": 2**45}})
    assert torch.isfinite(big(x, positions=pos).hidden).all()
    # seeds below 2^63 keep their pattern: seed 0 gives what it gave before
    attn = next(m for m in Backbone({**cfg, "attention": {"kind": "bigbird", "block": 2}}).modules()
                if hasattr(m, "_random"))
    from rl_tformers.attention.bigbird import random_blocks

    _, starts, blocks, ok = attn._random(0, 12, 0, torch.device("cpu"))
    ref, ref_ok = random_blocks(starts // 2, 6, 0, 1, 2, 0 * 1_000_003 + 7 * 6, torch.device("cpu"))
    assert torch.equal(blocks, ref) and torch.equal(ok, ref_ok)
