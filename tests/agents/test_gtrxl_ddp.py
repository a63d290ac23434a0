"""GTrXL under DDP (``--nproc 2``, gloo on CPU): the offline losses divide by the global count
of real steps, so 2 processes train like one process on the same global batch; PPO normalises
its advantages with the statistics of the whole minibatch (every rank's rows).

Multi-process tests start 2 gloo processes on the CPU (``--nproc 2`` or two plain processes
joined through ``MASTER_ADDR``/``MASTER_PORT``); each tiny run takes a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tests.runtime.ddp_helpers import read_metrics, train_cli, two_ranks


def _write_h5(path: Path) -> Path:
    """CartPole-shaped D4RL file of 40 steps in episodes of 3..9 steps (terminals and a time limit).

    Windows of 1 + 4 + 8 steps starting in the last 12 steps run past the end of the data (padding),
    so the two halves of a batch of 8 hold different numbers of real steps (and of IQL pairs).
    """
    n = 40
    rng = np.random.default_rng(0)
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    terminals[[2, 8, 13, 22, 26, 35]] = True
    timeouts[[17, n - 1]] = True
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=(rng.normal(size=(n, 4)) * 0.05).astype(np.float32))
        f.create_dataset("actions", data=rng.integers(0, 2, n).astype(np.int64))
        f.create_dataset("rewards", data=rng.uniform(0.5, 1.5, n).astype(np.float32))
        f.create_dataset("terminals", data=terminals)
        f.create_dataset("timeouts", data=timeouts)
        f.attrs["env_id"] = "CartPole-v1"
    return path


OFFLINE = [
    "agent.kind=gtrxl",
    "agent.seq_len=8",
    "agent.burn_in=4",
    "train.steps=10",
    "train.batch_size=8",
    "train.log_every=5",
    "train.warmup_steps=1",
    "train.checkpoint_every=10",
    "backbone.d_model=16",
    "backbone.n_layers=1",
    "backbone.n_heads=2",
    "backbone.memory.mem_len=4",
    "agent.critic_hidden=16",
    "eval.every=0",
    "eval.at_end=false",
    "train.progress=false",
    "--device",
    "cpu",
]
KEYS = {
    "bc": ("train/loss", "train/loss_bc", "train/accuracy", "train/grad_norm"),
    "iql": (
        "train/loss",
        "train/loss_value",
        "train/loss_q",
        "train/loss_actor",
        "iql/v_mean",
        "iql/q_mean",
        "iql/adv_mean",
        "iql/weight_mean",
        "train/grad_norm",
    ),
}


@pytest.mark.parametrize("objective", ["bc", "iql"])
def test_gtrxl_offline_on_two_processes_equals_one_process_with_the_same_global_batch(
    tmp_path: Path, objective: str
) -> None:
    # windows that run past the end of the 40-step dataset are padded, unevenly across the two
    # shards of each batch of 8: the mean of the shards' means over real steps (and over IQL's
    # usable (t, t + 1) pairs), before the fix, put the logged losses 0.5-4% and the weights up
    # to 2e-3 away from one process's; now within 5e-7 relative and 6e-6
    h5 = _write_h5(tmp_path / "d.hdf5")
    args = [f"agent.objective={objective}", f"dataset.path={h5}", *OFFLINE]
    one, two = tmp_path / "one", tmp_path / "two"
    r = train_cli(*args, "--run-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_cli("--nproc", "2", *args, "--run-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]
    ma, mb = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == [5, 10]
    for a, b in zip(ma, mb, strict=True):
        for key in KEYS[objective]:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)
    a = torch.load(one / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    for k in a:  # Adam turns float-rounding differences of near-zero gradients into ~5e-6 steps
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=5e-5, msg=k)


def test_ppo_on_two_processes_computes_the_gradient_of_one_process_on_the_whole_minibatch(
    tmp_path: Path,
) -> None:
    # each rank holds half of a minibatch of 8 rows whose advantages differ in mean and spread
    # between the halves: normalising each shard with its own mean/std (before the fix) gave
    # another gradient than one process normalising all 8 rows
    outs = two_ranks(
        tmp_path,
        """
        from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
        from rl_tformers.agents.gtrxl.ppo_update import normalize_advantages, ppo_loss
        from rl_tformers.runtime.distributed import shard_batch, wrap_ddp

        torch.manual_seed(0)
        cfg = GTrXLConfig(obs_dim=3, act_dim=2, critic="value",
                          backbone=gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4))
        model = GTrXLModel(cfg)
        g = torch.Generator().manual_seed(1)
        b, enc = 8, model.encoder
        with torch.no_grad():  # a memory of 4 valid slots per row, as a rollout stores it
            warm = enc(torch.randn(b, 4, cfg.input_dim, generator=g), torch.arange(4).expand(b, 4),
                       state=enc.initial_state(b))
        st = warm.state
        mb = {"x": torch.randn(b, cfg.input_dim, generator=g), "pos": torch.full((b,), 4),
              "mem": torch.stack([ls.memory for ls in st.layers], 1), "mem_pos": st.pos, "mem_valid": st.valid,
              "mem_seg": st.seg, "episode": st.episode,
              "actions": torch.rand(b, 2, generator=g) * 1.6 - 0.8, "logp": torch.randn(b, generator=g) - 2.0,
              "adv": torch.cat([torch.randn(4, generator=g) + 2.0, 3.0 * torch.randn(4, generator=g) - 1.0]),
              "returns": torch.randn(b, generator=g)}
        kw = dict(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=True)

        # one process, the whole minibatch (outside a DDP forward: no collective)
        loss, _ = ppo_loss(model, mb, **kw)
        model.zero_grad()
        loss.backward()
        one = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out["one_loss"] = float(loss)
        out["one_adv"] = normalize_advantages(mb["adv"]).tolist()

        class Agent:  # what the trainer wraps: agent.model and agent.loss(batch)
            def __init__(self, m):
                self.model = m

            def loss(self, batch):
                out["adv"] = normalize_advantages(batch["adv"]).tolist()
                return ppo_loss(self.model, batch, **kw)

        model.zero_grad()
        ddp = wrap_ddp(Agent(model), torch.device("cpu"))
        loss, _ = ddp(shard_batch(mb, rank, 2))
        loss.backward()
        out["loss"] = float(loss)
        out["grad_diff"] = max(float((p.grad - one[n]).abs().max()) for n, p in model.named_parameters() if n in one)
        out["grad_scale"] = max(float(v.abs().max()) for v in one.values())
    """,
    )
    one_adv = outs[0]["one_adv"]
    assert outs[0]["adv"] + outs[1]["adv"] == pytest.approx(one_adv, rel=1e-6, abs=1e-6)
    assert sum(one_adv) == pytest.approx(0.0, abs=1e-5) and np.std(one_adv, ddof=1) == pytest.approx(
        1.0, rel=1e-6
    )
    assert (outs[0]["loss"] + outs[1]["loss"]) / 2 == pytest.approx(outs[0]["one_loss"], rel=1e-6)
    for o in outs:  # every rank ends with the one-process gradient (float rounding only)
        assert o["grad_scale"] > 1e-3 and o["grad_diff"] < 1e-6 * o["grad_scale"] + 1e-8, o


def test_ppo_on_two_processes_trains_on_every_row_of_each_ranks_minibatches(tmp_path: Path) -> None:
    """W processes act as one with W x n_envs environments: each rank's loss sees all
    n_envs x n_steps / n_minibatches rows of its own minibatch (not cut in W again by the
    trainer, which would teach each rank from 1/W of its own rollout), and the ranks' rollouts differ."""
    outs = two_ranks(tmp_path, f"""
        from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
        from rl_tformers.runtime.run_config import compose
        from rl_tformers.runtime.trainer import train
        torch.set_num_threads(1)
        rows, obs = [], []
        loss = GTrXLPPO.loss
        def recording_loss(self, batch):
            rows.append(int(batch["x"].shape[0]))
            obs.append(float(batch["x"].double().sum()))
            return loss(self, batch)
        GTrXLPPO.loss = recording_loss
        cfg = compose("gtrxl/ppo_cartpole", ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
                      "agent.n_envs=2", "agent.n_steps=9", "agent.n_epochs=1", "agent.n_minibatches=2",
                      "train.steps=2", "train.log_every=1", "eval.at_end=false", "eval.every=0",
                      "train.progress=false", "device=cpu"])
        train(cfg, {str(tmp_path / "run")!r})
        out = {{"rows": rows, "obs": obs}}
    """)
    assert [o["rows"] for o in outs] == [[9, 9], [9, 9]]  # 2 x 9 rows in 2 minibatches, none cut again
    assert outs[0]["obs"] != outs[1]["obs"]  # each rank learns from its own rollout
    m = read_metrics(tmp_path / "run")
    assert [x["train/env_steps"] for x in m] == [36.0, 36.0]  # 2 processes x 2 environments x 9 steps
