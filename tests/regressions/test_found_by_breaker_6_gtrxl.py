"""Defects found by breaker 6 in the GTrXL agents (offline and PPO), the encoder-decoder and the
memory / POMDP tasks; each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.model import gtrxl_backbone
from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
from rl_tformers.agents.gtrxl.rollout import RunningMeanStd
from rl_tformers.envs.memory_tasks import RecallEnv
from rl_tformers.envs.pomdp import ObservationMaskWrapper

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from rl_tformers.registry import RegistryError
from tests.runtime.ddp_helpers import two_ranks


class MatrixActionEnv(gym.Env):
    """A Box(2, 2) action; the observation echoes the action it received (flattened)."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (2, 2), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        action = np.asarray(action)
        if action.shape != (2, 2):
            raise AssertionError(f"MatrixActionEnv got an action of shape {action.shape}")
        self.t += 1
        return action.reshape(-1).astype(np.float32), 0.0, False, self.t >= 5, {}


class PixelEnv(gym.Env):
    """uint8 observations of 0..255 (an image of 2 x 2 pixels), 3 actions."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, (2, 2), np.uint8)
        self.action_space = spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([[0, 50], [200, 255]], np.uint8), {}

    def step(self, action):
        return np.array([[0, 50], [200, 255]], np.uint8), 0.0, False, False, {}


for _id, _cls in (("breaker6/MatrixAction-v0", MatrixActionEnv), ("breaker6/Pixels-v0", PixelEnv)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_cls)


def _ppo(**agent) -> GTrXLPPO:
    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 2, "n_steps": 6, "n_minibatches": 1, **agent})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    return GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


# ------------------------------------------------- 1. Box actions of more than one axis
def test_ppo_and_its_policy_send_box_actions_in_the_environments_shape() -> None:
    """A Box(2, 2) action space got flat (4,) actions from the rollout and the evaluation policy."""
    torch.manual_seed(0)
    ppo = _ppo(env_id="breaker6/MatrixAction-v0")
    ro = ppo.collector.collect()  # raised in the environment: "got an action of shape (4,)"
    assert ro["actions"].shape == (6, 2, 4)
    env_a = ppo.spec.to_env(ro["actions"][0])
    assert env_a.shape == (2, 2, 2) and env_a.dtype == np.float32
    np.testing.assert_allclose(env_a.reshape(2, 4), ro["actions"][0].clamp(-1, 1).numpy(), rtol=0, atol=1e-6)
    policy = ppo.policy()
    actions, _ = policy.act(np.zeros((3, 4), np.float32), policy.initial_state(3), np.ones(3, bool))
    assert actions.shape == (3, 2, 2)


# ------------------------------------------------- 2. a_{t-1} input: the clamped action, as GTrXLPolicy feeds it
def test_ppo_previous_action_input_is_the_action_the_environment_took() -> None:
    """The rollout fed the unclamped Gaussian sample (4.5) as a_{t-1} while the environment got
    1.0 and GTrXLPolicy feeds the clamped 1.0: the rollout policy was not the evaluated one."""
    env_id = "rl_tformers/PositionOnlyPendulum-v1"
    torch.manual_seed(0)
    ppo = _ppo(env_id=env_id, n_envs=2, n_steps=12, prev_action=True, prev_reward=True, reward_scale=0.5)
    ppo.model.actor.log_std.data.fill_(0.5)
    policy = ppo.policy(deterministic=False)  # the statistics the rollout normalises with
    torch.manual_seed(1)
    ro = ppo.collector.collect()
    assert ro["actions"].abs().max() > 1.0  # samples beyond the bounds happen
    assert not ro["dones"].any()  # no reset in 12 steps: a_{t-1} is the previous step's action
    prev_in = ro["x"][1:, :, 2]  # inputs [obs (2) ; a_{t-1} (1) ; r_{t-1} (1)]
    assert torch.equal(prev_in, ro["actions"][:-1, :, 0].clamp(-1.0, 1.0))
    # GTrXLPolicy (sampling, same generator) takes exactly the rollout's actions
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(2)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=[0, 1])
    state, start, last = policy.initial_state(2), np.ones(2, bool), None
    torch.manual_seed(1)
    for t in range(12):
        a, state = policy.act(obs, state, start, last)
        np.testing.assert_allclose(a, ppo.spec.to_env(ro["actions"][t]), rtol=0, atol=1e-5)
        obs, last, term, trunc, _ = envs.step(a)
        start = term | trunc


# ------------------------------------------------- 3. DDP: one set of observation statistics
def test_ppo_ranks_keep_the_observation_statistics_of_all_ranks(tmp_path: Path) -> None:
    """Each rank updated its running mean/std with its own rollout only: the ranks normalised
    their inputs differently and only rank 0's statistics reached the checkpoint."""
    outs = two_ranks(tmp_path, """
        import numpy as np
        from omegaconf import OmegaConf
        from rl_tformers.agents.gtrxl.model import gtrxl_backbone
        from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
        cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
        cfg.agent.update({"n_envs": 2, "n_steps": 5, "n_minibatches": 1})
        cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
        torch.manual_seed(0)
        ppo = GTrXLPPO.for_training(cfg, None, "cpu")
        seen = []
        gather = ppo.collector.rollout_observations
        ppo.collector.rollout_observations = lambda raw: (seen.append(np.asarray(raw).tolist()), gather(raw))[1]
        ppo.collector.collect()
        out.update(mean=ppo.obs_rms.mean.tolist(), var=ppo.obs_rms.var.tolist(), count=ppo.obs_rms.count,
                   own=seen[0])
    """)
    own = [np.asarray(o["own"], np.float64) for o in outs]  # each rank's (S, N, O) observations
    assert not np.array_equal(own[0], own[1])
    expected = RunningMeanStd((2,))
    expected.update(np.stack(own, 1).reshape(-1, 2))  # one process with 4 envs: (S, W, N, O)
    for o in outs:
        assert o["count"] == expected.count == 20 + 1e-4
        np.testing.assert_array_equal(o["mean"], expected.mean)
        np.testing.assert_array_equal(o["var"], expected.var)


# ------------------------------------------------- 4. options that poison or silently change training
@pytest.mark.parametrize("option, value, message", [
    ("ent_coef", float("nan"), "agent.ent_coef must be a number >= 0, got nan (float)"),
    ("vf_coef", -1.0, "agent.vf_coef must be a number >= 0, got -1.0"),
    ("reward_scale", 0.0, "agent.reward_scale must be a number > 0, got 0.0"),
    ("reward_scale", "abc", "agent.reward_scale must be a number > 0, got 'abc' (str)"),
    ("head_hidden", -3, "agent.head_hidden must be an integer >= 0, got -3"),
])
def test_ppo_refuses_bad_loss_and_scale_options(monkeypatch, option, value, message) -> None:
    """ent_coef=nan trained on a NaN loss, vf_coef < 0 ascended the value error, reward_scale=0
    zeroed every reward, head_hidden < 0 silently gave linear heads."""
    monkeypatch.setattr(gym, "make", lambda *a, **k: pytest.fail("an environment was made before the check"))
    with pytest.raises(ValueError) as info:
        _ppo(**{option: value})
    assert str(info.value) == message


# ------------------------------------------------- 5. obs_norm=false: raw observations, not clipped to 10
def test_ppo_without_observation_normalisation_feeds_the_raw_observations() -> None:
    ppo = _ppo(env_id="breaker6/Pixels-v0", obs_norm=False)
    ro = ppo.collector.collect()
    assert ro["x"][0, 0].tolist() == [0.0, 50.0, 200.0, 255.0]  # was [0, 10, 10, 10]
    policy = ppo.policy()
    assert policy.obs_clip is None and policy.obs_mean.tolist() == [0.0] * 4 and policy.obs_std.tolist() == [1.0] * 4
    assert _ppo(env_id="breaker6/Pixels-v0").policy().obs_clip == 10.0  # obs_norm=true still clips


# ------------------------------------------------- 6. fine-tuning an offline run whose memory PPO cannot store
def test_ppo_fine_tuning_refuses_an_offline_run_without_xl_memory(tmp_path: Path) -> None:
    """An offline run with compressive memory passed and crashed the first rollout ("stack
    expects each tensor to be equal size")."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=2, seed=0), data)
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}", "train.steps=1",
        "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu",
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.kind=compressive",
    ]), tmp_path / "offline")
    cfg = compose(overrides=["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0",
                             f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=1", "agent.n_steps=4",
                             "agent.n_minibatches=1", "device=cpu"])
    with pytest.raises(ValueError, match=r"was trained with backbone\.memory\.kind='compressive'; PPO stores"):
        GTrXLPPO.for_training(cfg, None, "cpu")


# ------------------------------------------------- 7. encoder-decoder shapes and decoder kinds
def _encdec() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder({"encoder": {"d_model": 16, "n_layers": 1, "n_heads": 2},
                           "decoder": {"d_model": 16, "n_layers": 1, "n_heads": 2}}).eval()


@pytest.mark.parametrize("kwargs, message", [
    ({"memory": (1, 5, 16)}, "memory (the encoder output) must be (2, S, 16) for tgt of shape (2, 4, 16), got (1, 5, 16)"),
    ({"memory": (2, 5, 8)}, "memory (the encoder output) must be (2, S, 16)"),
    ({"src_mask": (1, 5)}, "src_mask must be (2, 5) (B, S), got (1, 5)"),
    ({"src_mask": (2, 6)}, "src_mask must be (2, 5) (B, S), got (2, 6)"),
    ({"tgt_mask": (4,)}, "tgt_mask must be (2, 4) (B, T), got (4,)"),
    ({"tgt_pos": (2, 5)}, "tgt_pos must be (2, 4) (B, T), got (2, 5)"),
    ({"src_pos": (1, 5)}, "src_pos must be (2, 5) (B, S), got (1, 5)"),
])
def test_encoder_decoder_decode_refuses_mismatched_shapes(kwargs, message) -> None:
    """A memory or source mask of batch 1 was broadcast over the batch silently; other
    mismatches failed deep in the kernels without naming the argument."""
    m = _encdec()
    tgt = torch.randn(2, 4, 16)
    mem = torch.randn(*kwargs.pop("memory", (2, 5, 16)))
    args = {}
    for name, shape in kwargs.items():
        args[name] = torch.ones(shape, dtype=torch.bool) if "mask" in name else torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError) as info:
        m.decode(tgt, mem, **args)
    assert message in str(info.value)


def test_encoder_decoder_forward_refuses_different_batch_sizes() -> None:
    with pytest.raises(ValueError, match=r"src \(3, 5, 16\) and tgt \(2, 4, 16\) must have the same batch size"):
        _encdec()(torch.randn(3, 5, 16), torch.randn(2, 4, 16))


@pytest.mark.parametrize("kind", ["longformer", "bigbird", "blockwise", "linformer"])
def test_causal_decoder_refuses_a_kernel_without_a_causal_form(kind) -> None:
    """The decoder stack is no Backbone, so nothing checked it: longformer/bigbird/blockwise ran
    in a causal decoder (a form their registry entry says they lack) and linformer failed only
    at the first forward, naming backbone.causal."""
    with pytest.raises(IncompatibleConfig) as info:
        EncoderDecoderConfig.from_dict({"decoder": {"attention": {"kind": kind}}})
    msg = str(info.value)
    assert msg.startswith(f"decoder.attention.kind={kind!r} has no causal form; set decoder.causal=false")
    assert "backbone." not in msg and "Decision Transformer" not in msg


def test_encoder_decoder_field_errors_name_the_encoder_or_decoder() -> None:
    with pytest.raises(RegistryError, match=r"^decoder\.attention\.window: unknown key"):
        EncoderDecoderConfig.from_dict({"decoder": {"attention": {"kind": "local", "window": 3}}})
    with pytest.raises(RegistryError, match=r"^encoder\.n_layer: unknown backbone field"):
        EncoderDecoderConfig.from_dict({"encoder": {"n_layer": 3}})


# ------------------------------------------------- 8. memory / POMDP task arguments
@pytest.mark.parametrize("kwargs, message", [
    ({"delay": 2.0}, "Recall: delay must be an integer, got 2.0 (float)"),
    ({"delay": True}, "Recall: delay must be an integer, got True (bool)"),
    ({"length": "10"}, "Recall: length must be an integer, got '10' (str)"),
])
def test_recall_refuses_arguments_that_are_not_integers(kwargs, message) -> None:
    """delay=2.0 (a YAML float) built an env that crashed at its first scored step with numpy's
    "only integers ... are valid indices"; delay=True silently meant 1."""
    with pytest.raises(ValueError) as info:
        RecallEnv(**kwargs)
    assert str(info.value) == message
    env = RecallEnv(delay=np.int64(2), n_symbols=3, length=5)  # numpy integers are integers
    env.reset(seed=0)
    assert env.step(0)[1] == 0.0 and env.delay == 2


@pytest.mark.parametrize("indices, message", [
    ([False, True, True], "got a boolean mask [False, True, True]"),
    ([0.5, 2], "observation indices must be integers, got [0.5, 2.0]"),
])
def test_observation_mask_refuses_boolean_masks_and_fractional_indices(indices, message) -> None:
    """[False, True, True] was read as indices [0, 1, 1] / [True, False] as [1, 0] (every entry
    kept, reordered); 0.5 silently became index 0."""
    env = gym.make("CartPole-v1")
    with pytest.raises(ValueError) as info:
        ObservationMaskWrapper(env, indices)
    assert message in str(info.value)
    assert ObservationMaskWrapper(env, [2.0, 0]).indices.tolist() == [2, 0]  # whole floats are indices


# ------------------------------------------------- 9. fine-tuning: r_{t-1} in the offline run's units
def test_ppo_fine_tuning_feeds_the_previous_reward_in_the_offline_units(tmp_path: Path) -> None:
    """The offline encoder learned r_{t-1} as raw / 10 (the recall data's reward scale); PPO fed
    it raw * agent.reward_scale (10x larger here), off the distribution it was trained on."""
    from rl_tformers.runtime.loading import load_run
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", "agent.prev_reward=true", f"dataset.path={data}",
        "train.steps=1", "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false",
        "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4",
    ]), tmp_path / "offline")
    offline = load_run(tmp_path / "offline")
    mult = offline.extra["reward_mult"]
    assert mult == 0.1  # 1 / the recall data's reward scale (10)
    cfg = compose(overrides=["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0",
                             f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=2", "agent.n_steps=12",
                             "agent.n_minibatches=1", "agent.reward_scale=1.0", "device=cpu"])
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(cfg, None, "cpu")
    ro = ppo.collector.collect()
    prev_r = ro["x"][1:, :, -1]  # inputs [obs (4) ; r_{t-1}]
    assert (ro["rewards"] == 1.0).any() and not ro["dones"].any()
    assert torch.equal(prev_r, ro["rewards"][:-1] * torch.tensor(mult, dtype=torch.float32))
    assert ppo.policy().reward_mult == mult
    assert ppo.extra_state()["input_reward_mult"] == mult  # and a reloaded policy keeps it
