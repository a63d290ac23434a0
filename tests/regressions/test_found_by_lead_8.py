"""Defects the lead found in session 8, each pinned by a test."""

from __future__ import annotations

import json
import warnings

import h5py
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

runner = CliRunner()
DROPOUT_ADVICE = ("attention kind 'performer' forms no attention probabilities, so attn_dropout=0.1 is not applied "
                  "to it (residual and feed-forward dropout still are); set attn_dropout=0 to say so and silence "
                  "this warning")


def _advice(caught) -> list[str]:
    return [str(w.message) for w in caught if "forms no attention probabilities" in str(w.message)]


@pytest.fixture(scope="module")
def performer_run(tmp_path_factory):
    """A 2-update DT with Performer attention (the DT's default attn_dropout=0.1) on Recall-d2
    (every episode 34 steps), and the warnings its training gave."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    root = tmp_path_factory.mktemp("lead8")
    data = save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), root / "recall-d2.hdf5")
    cfg = compose(overrides=[
        "agent.kind=dt", f"dataset.path={data}", "agent.max_ep_len=40", "agent.context_len=4", "agent.targets=[1]",
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.attention.kind=performer", "train.steps=2",
        "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "eval.at_end=false", "device=cpu",
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, root / "run")
    return root / "run", _advice(caught)


# -- 1. `eval --json` wrote the counts of `extra` as floats (act_calls 34.0, steps 34.0) -------------
def test_eval_json_writes_every_count_as_an_integer(performer_run):
    run_dir, _ = performer_run
    r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "3", "--envs", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    x = out["extra"]
    # one act call (one DT forward pass) per step of the 3 environments, all episodes 34 steps
    assert (x["act_calls"], x["steps"], x["step"]) == (34, 34, 2)
    assert '"act_calls": 34,' in r.stdout and '"steps": 34,' in r.stdout
    assert all(type(v) is int for v in (x["act_calls"], x["steps"], x["step"], out["episodes"], out["n_envs"],
                                         out["seed"]))
    res = out["results"][0]
    assert res["lengths"] == [34, 34, 34] and res["seeds"] == [0, 1, 2]
    assert all(type(v) is int for v in res["lengths"] + res["seeds"])
    assert all(type(v) is float for v in [*res["returns"], res["return_mean"], res["return_std"],
                                           x["act_ms_per_step"], x["forward_ms_per_step"]])


# -- 2. the Performer attn_dropout advice came again at every eval / plot of the trained run ---------
def test_the_attention_dropout_advice_is_given_in_training_not_when_the_run_is_loaded(performer_run):
    from rl_tformers.runtime.agent_registry import build_agent
    from rl_tformers.runtime.loading import load_run

    run_dir, trained = performer_run
    assert trained == [DROPOUT_ADVICE]  # training says it, once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(run_dir)
        r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "1", "--envs", "1"])
    assert r.exit_code == 0, r.output
    assert run.cfg.backbone.attention.kind == "performer"
    assert _advice(caught) == [] and "attn_dropout" not in r.output
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = compose(start=yaml.safe_load((run_dir / "config.yaml").read_text()))
        build_agent(resumed, run_dir, "cpu")  # building for training (as a resume does) still advises
    assert _advice(caught) == [DROPOUT_ADVICE]
    # a UserWarning of its own category, the one load_run silences
    from rl_tformers.backbone_config import ConfigAdviceWarning

    assert [w.category for w in caught if str(w.message) == DROPOUT_ADVICE] == [ConfigAdviceWarning]
    assert issubclass(ConfigAdviceWarning, UserWarning)


# -- 3. `bench eval --mem-lens 1000000000` died in the allocator with a traceback ---------------------
def test_bench_eval_refuses_a_memory_length_that_cannot_fit(monkeypatch):
    from rl_tformers.bench import eval as be

    def tripwire(*args, **kwargs):
        raise AssertionError("part 2 ran")

    monkeypatch.setattr(be, "memory_step_cost", tripwire)
    monkeypatch.setattr(be, "device_memory_bytes", lambda device: 16 * 2**30, raising=False)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", "--memory-kinds", "xl", "--mem-lens", "32,1000000000"])
    assert r.exit_code == 2, r.output
    assert r.stderr == (
        "error: --mem-lens: M = 1000000000 needs about 1.49e+12 GiB in part 2 (re-encoding M + 1 tokens forms about "
        "10 float32 score tensors of --mem-envs 10 x 4 heads x (M + 1)^2), more than the 16.00 GiB of this machine; "
        "the largest M that fits is 3274 (keep M to the memory length an agent would use, e.g. up to its episode "
        "length)\n")
    assert "Traceback" not in r.output
    # the limit is the estimate's: 3274 fits in 16 GiB, 3275 does not; the defaults (up to 512) need 0.33 GiB
    s = be.Settings(memory_kinds=("xl",), mem_lens=(3274,), skip_rollouts=True)
    assert be.part2_bytes(3274, s) <= 16 * 2**30 < be.part2_bytes(3275, s)
    s.check_memory(16 * 2**30)
    assert be.part2_bytes(512, be.Settings()) == 4 * 10 * (10 * 4 * 513**2 + (512 + 50 + 1) * 128)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", "--mem-lens", "4", "--mem-steps", str(10**12)])
    assert r.exit_code == 2 and r.stderr == (
        "error: --mem-steps 1000000000000: part 2 keeps all M + 1000000000000 input tokens of --mem-envs 10 "
        "environments in memory, more than the 16.00 GiB of this machine; lower --mem-steps\n")


# -- 4. `collect --recipe-steps 5` built a medium-replay set without its random shard -----------------
def test_collect_refuses_recipe_steps_that_leave_a_shard_empty(tmp_path, monkeypatch):
    from rl_tformers.envs import collect as C
    from rl_tformers.envs import recipes as R

    def tripwire(*args, **kwargs):
        raise AssertionError("a recipe was built")

    monkeypatch.setattr(C, "build_recipe", tripwire)
    expected = ("error: --recipe-steps must be >= 6, got {} (the medium-replay recipes split it into 5 shards of "
                "10-25 %, each of at least 1 step)\n")
    for n in ("5", "1"):
        r = runner.invoke(app, ["collect", "--recipe", "hopper-medium-replay", "--recipe-steps", n,
                                "--root", str(tmp_path / "data"), "--no-progress"])
        assert (r.exit_code, r.stderr) == (1, expected.format(n)), r.output
        r = runner.invoke(app, ["collect", "--list-recipes", "--recipe-steps", n])
        assert (r.exit_code, r.stderr, r.stdout) == (1, expected.format(n), "")
    assert not (tmp_path / "data").exists()
    assert R.MIN_STEPS == 6
    with pytest.raises(ValueError, match=r"^hopper-medium-replay: steps must be >= 6 \(its 5 shards take 10-25 % "
                                          r"of them each, and none may be empty\), got 5$"):
        R.make_recipe("hopper", "medium-replay", steps=5)
    assert [s.steps for s in R.make_recipe("hopper", "medium-replay", steps=6).shards] == [1, 1, 1, 2, 2]
    assert [s.steps for s in R.make_recipe("hopper", "random", steps=6).shards] == [6]


# -- 5. `dataset info` did not compare the data with the environment it names ----------------------
def _hdf5(path, obs_dim: int, env_id: str = "CartPole-v1"):
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((6, obs_dim), np.float32)
        f["actions"] = np.array([0, 1, 0, 1, 0, 1], np.int64)
        f["rewards"] = np.ones(6, np.float32)
        f["terminals"] = np.array([0, 0, 1, 0, 0, 1], bool)
        f.attrs["env_id"] = env_id
    return path


def test_dataset_info_warns_when_the_data_does_not_match_its_environment(tmp_path):
    bad = _hdf5(tmp_path / "bad.hdf5", 3)
    for extra in ([], ["--json"]):
        r = runner.invoke(app, ["dataset", "info", str(bad), *extra])
        assert r.exit_code == 0, r.output
        assert r.stderr == (
            "warning: the dataset does not match its environment CartPole-v1: observations of shape (3,) per step "
            "in the data, of shape (4,) in the environment; training on it needs agent.env_id set to the "
            "environment the data came from\n")
    assert json.loads(r.stdout)["observation_shape"] == [3]  # --json: stdout is still one JSON object
    # a dataset that fits its environment, or one whose environment cannot be made here: no warning
    for path in (_hdf5(tmp_path / "good.hdf5", 4), _hdf5(tmp_path / "unknown.hdf5", 3, env_id="NoSuchEnv-v0")):
        r = runner.invoke(app, ["dataset", "info", str(path)])
        assert (r.exit_code, r.stderr) == (0, ""), r.output


# -- 6. --print-config showed `memory: {kind: compressive}`, not what compressive is built with -------
def test_print_config_shows_each_slot_with_its_kinds_defaults(tmp_path):
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "backbone.memory.kind=compressive", "--print-config"])
    assert r.exit_code == 0, r.output
    bb = yaml.safe_load(r.stdout)["backbone"]
    assert bb["memory"] == {"kind": "compressive", "mem_len": 32, "compressed_len": 32, "rate": 3,
                            "compression": "conv", "loss": "attention", "loss_weight": 1.0}
    assert bb["attention"] == {"kind": "sdpa"} and bb["depth"] == {"kind": "fixed"}
    assert bb["block"] == {"kind": "gated", "gate": "gru", "gate_bias": 2.0, "relu": True}
    assert bb["position"] == {"kind": "xl_relative", "base": 10000.0}
    assert (bb["d_model"], bb["max_position"], bb["d_ff"]) == (64, 4096, None)
    # bc builds no backbone: its section is shown as it is
    r = runner.invoke(app, ["train", "-c", "bc/hopper_medium", "--print-config"])
    assert r.exit_code == 0 and yaml.safe_load(r.stdout)["backbone"] == {}


def test_config_yaml_keeps_the_fields_set_and_resume_prints_the_built_backbone(tmp_path):
    run = tmp_path / "run"
    args = ["-c", "toy", "train.steps=2", "train.warmup_steps=1", "train.progress=false", "eval.every=0",
            "device=cpu"]
    r = runner.invoke(app, ["train", *args, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    saved = yaml.safe_load((run / "config.yaml").read_text())["backbone"]
    assert saved == {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.1,
                     "position": {"kind": "learned"}, "max_position": 64}  # what was set, as before
    r = runner.invoke(app, ["train", "--resume", str(run), "--print-config"])
    assert r.exit_code == 0, r.output
    shown = yaml.safe_load(r.stdout)["backbone"]
    assert shown["position"] == {"kind": "learned", "per_layer": False}
    assert shown["attention"] == {"kind": "sdpa"} and shown["memory"] == {"kind": "none"}
    # the run resumes (config.yaml and the checkpoint's config compare equal, as before)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3", "train.progress=false"])
    assert r.exit_code == 0 and "done: 3 steps" in r.output, r.output


def test_a_recipe_dataset_not_built_yet_gets_its_recipe_not_a_typo_hint(tmp_path, monkeypatch) -> None:
    """Fresh user: training on the not-yet-built position-only Hopper set said "did you mean
    'rlt/hopper-v5/medium-v0'?" (the full-observation set, the wrong one) and a collect command
    that failed from a clone without ``--policies``."""
    from rl_tformers.envs.loaders import load_minari
    from rl_tformers.envs.recipes import all_recipes

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "no_policies_here"))
    built = tmp_path / "root" / "rlt/hopper-v5/medium-v0" / "data"
    built.mkdir(parents=True)
    (built / "metadata.json").write_text("{}")
    recipe = next(r for r in all_recipes().values() if r.dataset_id == "rlt/hopper-v5/medium-positions-v0")
    with pytest.raises(FileNotFoundError) as exc:
        load_minari(recipe.dataset_id, root=tmp_path / "root")
    msg = str(exc.value)
    assert "did you mean" not in msg
    assert f"`rl-tformers collect --recipe {recipe.name} --policies DIR (the folder of the pretrained SB3 agents)`" in msg
    (tmp_path / "policies").mkdir()
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "policies"))  # found: no --policies hint
    with pytest.raises(FileNotFoundError, match=rf"build it \(`rl-tformers collect --recipe {recipe.name}`\)"):
        load_minari(recipe.dataset_id, root=tmp_path / "root")
