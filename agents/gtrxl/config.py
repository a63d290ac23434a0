"""Options of offline GTrXL (``agent.kind=gtrxl``), typed and checked.

:class:`GTrXLAgentConfig` is the ``agent:`` section of a run config; ``rl-tformers agents gtrxl``
lists its fields with their defaults and docs. A bad value is refused with one line naming
``agent.<key>`` (:meth:`~rl_tformers.typed_config.TypedConfig.from_dict`), before any data is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_tformers.agents.common.encoders import EncoderConfig
from rl_tformers.agents.common.encoders.flat import LinearEncoderConfig
from rl_tformers.agents.decision_transformer.config import EarlyExitOptions, KNNOptions

from rl_tformers.typed_config import ConfigFieldError, TypedConfig, option

OBJECTIVES = ("bc", "rcbc", "iql")


@dataclass(frozen=True)
class GTrXLAgentConfig(TypedConfig):
    """``agent:`` of ``agent.kind=gtrxl``; the IQL settings are CORL's for locomotion (Kostrikov et al. 2021).

    Raises (on construction):
        ConfigFieldError: a field of the wrong type or out of range; ``seq_len`` < 2 with
            ``objective=iql`` (the Q heads learn from (t, t + 1) pairs inside the gradient window).
    """

    objective: str = option("bc", "bc, rcbc (return-conditioned BC) or iql", choices=OBJECTIVES)
    window: int = option(0, "W > 0: plain context window of W steps (backbone.memory.kind=none), no memory", ge=0)
    seq_len: int = option(32, "T, gradient window (steps)", ge=1)
    burn_in: int = option(32, "steps that rebuild the memory without gradient before the window", ge=0)
    prev_action: bool = option(False, "feed a_{t-1} as an input")
    prev_reward: bool = option(False, "feed r_{t-1} as an input")
    encoder: EncoderConfig = option(factory=LinearEncoderConfig, doc="observation encoder (its features are "
                                    "the observation part of each step's token)")
    head_hidden: int = option(0, "actor head MLP width (0 = linear)", ge=0)
    deterministic: bool = option(True, "evaluate with the mode of the actor")
    target_return: float | None = option(None, "rcbc: evaluation target in raw units (null: best dataset return)")
    env_id: str | None = option(None, "evaluation environment (null: the dataset's, masked like its pomdp record)")
    env_kwargs: dict | None = option(None, "gym.make keyword arguments of the evaluation environment; null = the "
                                      "dataset's")
    gamma: float = option(0.99, "iql: discount", ge=0, le=1)
    expectile: float = option(0.7, "iql: expectile of the value loss", gt=0, lt=1)
    beta: float = option(3.0, "iql: inverse temperature of the advantage weights", ge=0)
    max_weight: float = option(100.0, "iql: clip of the advantage weights", gt=0)
    tau: float = option(0.005, "iql: Polyak rate of the target critic", gt=0, le=1)
    critic_hidden: int = option(256, "iql: critic MLP width", ge=1)
    share_critic_encoder: bool = option(False, "iql: the critic reads the actor's GTrXL features")
    iql_reward_norm: bool = option(True, "iql: rewards * 1000 / (max return - min return), as IQL does")
    early_exit: EarlyExitOptions = option(factory=EarlyExitOptions, doc="early exit when acting "
                                          "(backbone.depth.kind=early_exit; objectives bc and rcbc)")
    knn: KNNOptions = option(factory=KNNOptions, doc="kNN-LM action memory at evaluation (objectives bc and rcbc)")

    def __post_init__(self) -> None:
        if self.objective == "iql" and self.seq_len < 2:
            raise ConfigFieldError(
                "seq_len", f"={self.seq_len}: IQL learns Q from (t, t+1) pairs inside the gradient window, and a "
                           f"window of one step has none (the Q loss would stay 0); use agent.seq_len >= 2", sep="")
        if self.objective == "iql" and self.early_exit.threshold is not None:
            raise ConfigFieldError("early_exit.threshold", f"={self.early_exit.threshold}: {IQL_NO_EXIT}", sep="")
        if self.objective == "iql" and self.knn.lam > 0:
            raise ConfigFieldError("knn.lam", f"={self.knn.lam}: {IQL_NO_KNN}", sep="")


#: why IQL refuses early exit: its actor is trained at full depth only
IQL_NO_EXIT = ("early exit needs an actor trained on every layer's output, which agent.objective=bc and rcbc train "
               "(with backbone.depth.kind=early_exit); IQL's advantage-weighted actor is trained at full depth only")
#: why IQL refuses the kNN-LM memory: the datastore holds the behaviour policy's actions
IQL_NO_KNN = ("the kNN-LM memory interpolates the actor with the dataset's next actions, which the actor of "
              "agent.objective=bc and rcbc predicts; IQL's actor is advantage-weighted away from them")


@dataclass(frozen=True)
class PPOAgentConfig(TypedConfig):
    """``agent:`` of ``agent.kind=gtrxl_ppo`` (PPO with a GTrXL encoder; CleanRL's ppo_trxl settings).

    Raises (on construction):
        ConfigFieldError: a field of the wrong type or out of range (NaN and infinities included);
            ``n_minibatches`` above the ``n_envs x n_steps`` samples of a rollout (a minibatch
            would be empty).
    """

    env_id: str = option("rl_tformers/PositionOnlyCartPole-v1", "the environment PPO acts in")
    env_kwargs: dict | None = option(factory=dict, doc="gym.make keyword arguments of the environment")
    n_envs: int = option(16, "N vector environments", ge=1)
    n_steps: int = option(128, "S steps per environment and rollout", ge=1)
    n_epochs: int = option(4, "passes over each rollout", ge=1)
    n_minibatches: int = option(4, "minibatches per pass", ge=1)
    gamma: float = option(0.99, "discount", ge=0, le=1)
    gae_lambda: float = option(0.95, "GAE lambda", ge=0, le=1)
    clip_coef: float = option(0.2, "PPO ratio clip", gt=0)
    ent_coef: float = option(0.01, "entropy loss coefficient", ge=0)
    vf_coef: float = option(0.5, "value loss coefficient", ge=0)
    norm_adv: bool = option(True, "normalise the advantages of each minibatch")
    reward_scale: float = option(1.0, "rewards are multiplied by it for learning", gt=0)
    obs_norm: bool = option(True, "running mean/std of flat observations (frozen within a rollout); false: raw "
                            "observations (image observations: scaled by 1/255 in the encoder instead)")
    prev_action: bool = option(False, "feed a_{t-1} as an input")
    prev_reward: bool = option(False, "feed r_{t-1} as an input")
    encoder: EncoderConfig = option(factory=LinearEncoderConfig, doc="observation encoder (its features are "
                                    "the observation part of each step's token)")
    head_hidden: int = option(64, "actor and critic head MLP width (0: linear heads)", ge=0)
    window: int = option(0, "W > 0: no memory (backbone.memory.kind=none); every step re-encodes its episode's "
                            "last W steps, a plain context window (flat observations)", ge=0)
    deterministic: bool = option(True, "evaluation acts with the mode")
    init_checkpoint: str | None = option(None, "fine-tune: an offline gtrxl run directory or checkpoint file")
    critic_warmup: int = option(0, "first rollouts that train only the value head (fine-tuning)", ge=0)

    def __post_init__(self) -> None:
        rows = self.n_envs * self.n_steps
        if self.n_minibatches > rows:
            raise ConfigFieldError(
                "n_minibatches", f"={self.n_minibatches} is more than the agent.n_envs x agent.n_steps = {rows} "
                                 f"samples of a rollout (a minibatch would be empty); use at most {rows}", sep="")

    def check_world_size(self, world_size: int) -> None:
        """Refuse ``norm_adv`` with minibatches of one row over all ``world_size`` processes (their
        advantage has no standard deviation to normalise with: it would be used unnormalised next
        to normalised ones). The smallest minibatch has ``rows // n_minibatches`` rows
        (``np.array_split``); under DDP an update's minibatch is the union of every process's.

        Raises:
            ConfigFieldError: naming ``agent.norm_adv``.
        """
        rows = self.n_envs * self.n_steps
        if self.norm_adv and rows // self.n_minibatches * max(int(world_size), 1) < 2:
            fix = (f"agent.n_minibatches <= {rows // 2}" if rows >= 2
                   else "a rollout of at least 2 samples (agent.n_envs x agent.n_steps >= 2)")
            raise ConfigFieldError(
                "agent.norm_adv", f"=true normalises the advantages of each minibatch by their standard deviation, "
                                  f"but agent.n_minibatches={self.n_minibatches} splits the agent.n_envs x "
                                  f"agent.n_steps = {rows} samples of a rollout into minibatches of one row, whose "
                                  f"advantage has no standard deviation (it would be used unnormalised next to "
                                  f"normalised ones); use {fix} or agent.norm_adv=false", sep="")
