"""Config composition: layers, typed schema, error messages naming the dotted key, _base_ files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl_tformers.runtime.agent_registry import UnknownAgentError
from rl_tformers.runtime.run_config import (
    ConfigError,
    EvalConfig,
    TrainConfig,
    available_configs,
    check_resume_changes,
    compose,
    config_value_differences,
    configs_root,
    flatten,
    parse_overrides,
    resolve_config_path,
    schema_defaults,
    to_container,
    to_yaml,
)
from rl_tformers.typed_config import range_words


def test_defaults_yaml_mirrors_the_schema() -> None:
    on_disk = to_container(OmegaConf.load(configs_root() / "defaults.yaml"))
    assert on_disk == schema_defaults()


def test_layers_in_order(tmp_path: Path) -> None:
    cfg = compose(None, ["agent.kind=toy"])
    assert cfg.train.steps == 1000  # defaults.yaml
    assert cfg.train.batch_size == 16 and cfg.backbone.d_model == 16  # toy's registered defaults
    f = tmp_path / "c.yaml"
    f.write_text("agent: {kind: toy}\ntrain: {batch_size: 7, steps: 3}\n")
    cfg = compose(f, ["train.steps=5", "train.betas=[0.8,0.9]", "dataset.lazy=true"])
    assert (cfg.train.batch_size, cfg.train.steps, list(cfg.train.betas)) == (7, 5, [0.8, 0.9])
    assert cfg.dataset == {"lazy": True}  # checked against DatasetConfig, whose defaults are not filled in
    with pytest.raises(ConfigError, match=r"dataset\.anything: unknown key"):
        compose(f, ["dataset.anything.goes=1"])
    assert cfg.train.schedule.value == "warmup_cosine" and cfg.train.amp.value == "none"
    with pytest.raises(Exception):  # noqa: B017 - omegaconf's ReadonlyConfigError
        cfg.train.steps = 1


def test_packaged_config_by_name() -> None:
    assert "toy" in available_configs() and "defaults" not in available_configs()
    assert resolve_config_path("toy") == (configs_root() / "toy.yaml").resolve()
    cfg = compose("toy")
    assert cfg.agent.kind == "toy" and cfg.train.steps == 300
    with pytest.raises(ConfigError, match=r"config 'toyy' not found.*did you mean toy\?"):
        compose("toyy")


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.lrr=1", r"train\.lrr: unknown key; did you mean train\.lr\?"),
        ("trian.steps=1", r"trian: unknown key; did you mean train\?"),
        ("train.steps=abc", r"^train\.steps: expected an integer, got 'abc' \[command line\]$"),
        ("train.amp=fp16", r"train\.amp: Invalid value 'fp16', expected one of \[none, bf16\]"),
        ("train.schedule=step", r"train\.schedule: Invalid value 'step'"),
        ("agent.bogus=1", r"agent\.bogus: unknown key"),  # toy declares its agent keys
        ("backbone.attention.kind=nope", r"backbone\.attention"),
        ("backbone.widht=3", r"backbone\.widht"),
        ("train.steps=0", r"train\.steps must be >= 1"),
        ("train.betas=[0.9]", r"train\.betas must be two numbers"),
        ("device=tpu", r"device='tpu'"),
        ("eval.every=-1", r"eval\.every must be >= 0"),
        ("backbone=[1]", r"^backbone must be a mapping \(keys: d_model, .*\), got \[1\] \[command line\]$"),
        ("train.betas={a: 1}", r"^train\.betas must be a list, got \{'a': 1\} \[command line\]$"),
        ("train.lr={a:[1]}", r"^override 'train\.lr=\{a:\[1\]\}': the value is not YAML \(found unexpected ':'\)$"),
    ],
)
def test_bad_overrides_name_the_dotted_key(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        compose(None, ["agent.kind=toy", override])


def test_unknown_key_in_a_file_names_key_and_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("agent: {kind: toy}\ntrain:\n  warmup: 3\n")
    with pytest.raises(ConfigError, match=r"train\.warmup: unknown key; did you mean train\.warmup_steps\?.*bad\.yaml"):
        compose(f)


def test_unknown_agent_lists_registered_kinds() -> None:
    with pytest.raises(UnknownAgentError, match=r"agent\.kind='nope' is not registered; registered kinds: .*toy"):
        compose(None, ["agent.kind=nope"])
    with pytest.raises(ConfigError, match=r"agent\.kind is required.*toy"):
        compose(None, ["train.steps=3"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("agent=5", "agent must be a mapping with a kind key (e.g. agent: {kind: dt}), got 5; registered kinds: "),
        ("agent=[toy]", "agent must be a mapping with a kind key (e.g. agent: {kind: dt}), got ['toy']; registered "
                        "kinds: "),
        ("agent.kind=5", "agent.kind must be the name of a registered kind ("),
        ("agent.kind=[toy]", "agent.kind must be the name of a registered kind ("),
    ],
)
def test_an_agent_kind_of_the_wrong_type_is_named_not_called_missing(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        compose(None, [override])
    assert str(exc.value).startswith(expected), str(exc.value)
    assert "toy" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=abc", "train.steps: expected an integer, got 'abc' [command line]"),
        ("train.steps=1.5", "train.steps: expected an integer, got 1.5 [command line]"),
        ("train.steps=null", "train.steps: expected an integer, got null (this key takes no null) [command line]"),
        ("train.lr=fast", "train.lr: expected a number, got 'fast' [command line]"),
        ("train.progress=maybe", "train.progress: expected true or false, got 'maybe' [command line]"),
        ("train.betas=x", "train.betas: expected a list, got a single value (write a list: [a, b]) [command line]"),
        ("train.betas=[a,b]", "train.betas[0]: expected a number, got 'a' [command line]"),
        ("device=[1]", "device: expected a string, got a list [1] [command line]"),
        ("train.steps=[1]", "train.steps: expected an integer, got a list [1] [command line]"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_key_and_the_type_it_takes(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        compose(None, ["agent.kind=toy", override])
    assert str(exc.value) == expected


@pytest.mark.parametrize(
    ("item", "hint"),
    [
        ("hopper-medium", "; a config is given with -c: -c bc/hopper_medium or -c dt/hopper_medium"),
        ("dt/hopper_medium", "; a config is given with -c: -c dt/hopper_medium"),
        ("recall_bc", "; a config is given with -c: -c gtrxl/recall_bc"),
        ("hoper_medum", "; a config is given with -c: -c dt/hopper_medium or -c bc/hopper_medium"),
        ("xyzzy", ""),
    ],
)
def test_a_config_name_given_as_an_override_gets_a_hint_to_add_c(item: str, hint: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_overrides([item])
    assert str(exc.value) == f"override {item!r} is not KEY=VALUE (e.g. train.steps=1000){hint}"


def test_override_syntax() -> None:
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        parse_overrides(["train.steps"])
    assert parse_overrides(["a.b=null", "c=[1,2]"]) == {"a": {"b": None}, "c": [1, 2]}


def test_interpolation_is_resolved() -> None:
    cfg = compose(None, ["agent.kind=toy", "train.warmup_steps=${train.log_every}", "train.log_every=7"])
    assert cfg.train.warmup_steps == 7
    assert "${" not in to_yaml(cfg)
    with pytest.raises(ConfigError, match="interpolation"):
        compose(None, ["agent.kind=toy", "train.warmup_steps=${train.nothing}"])


def test_base_files(tmp_path: Path) -> None:
    (tmp_path / "common.yaml").write_text("agent: {kind: toy}\ntrain: {steps: 11, lr: 0.5}\n")
    (tmp_path / "child.yaml").write_text("_base_: common\ntrain: {lr: 0.25}\n")
    cfg = compose(tmp_path / "child.yaml")
    assert (cfg.train.steps, cfg.train.lr) == (11, 0.25)
    (tmp_path / "a.yaml").write_text("_base_: b.yaml\n")
    (tmp_path / "b.yaml").write_text("_base_: a.yaml\n")
    with pytest.raises(ConfigError, match="_base_ cycle"):
        compose(tmp_path / "a.yaml")


def test_yaml_round_trip() -> None:
    cfg = compose("toy", ["train.grad_clip=null"])
    again = compose(start=OmegaConf.create(to_yaml(cfg)))
    assert to_container(again) == to_container(cfg)


def test_resume_changes_whitelist() -> None:
    a = compose(None, ["agent.kind=toy"])
    b = compose(None, ["agent.kind=toy", "train.steps=2000", "eval.every=5", "device=cpu"])
    assert check_resume_changes(a, b) == ["device: auto -> cpu", "eval.every: 0 -> 5", "train.steps: 1000 -> 2000"]
    c = compose(None, ["agent.kind=toy", "backbone.n_layers=2", "train.lr=1"])
    with pytest.raises(ConfigError, match=r"(?s)backbone\.n_layers: 1 -> 2.*train\.lr: 0\.0001 -> 1"):
        check_resume_changes(a, c)


def test_a_key_the_saved_config_lacks_compares_at_its_default_on_resume() -> None:
    """A run saved before an option existed resumes: the missing key takes the value composing
    gives it (the option's default); a non-default value for it is still refused."""
    a = to_container(compose(None, ["agent.kind=toy"]))
    del a["train"]["lr"], a["train"]["amp"]
    saved = OmegaConf.create(a)
    assert check_resume_changes(saved, compose(start=a)) == []
    assert check_resume_changes(saved, compose(None, ["agent.kind=toy", "train.steps=2000"])) == \
        ["train.steps: 1000 -> 2000"]
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.0001 -> 1\.0"):
        check_resume_changes(saved, compose(None, ["agent.kind=toy", "train.lr=1"]))
    assert config_value_differences({"train": {"lr": 1.0}}, {"train": {"lr": 1.0, "unknown": 3}}) == \
        [("train.unknown", "<unset>", 3)]


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": {}}) == {"a.b": 1, "a.c": [1, 2], "d": None}


def test_env_kwargs_take_any_key_in_a_closed_agent_section():
    # gtrxl_ppo closes its agent section; its env_kwargs default {} inherited the struct flag, so
    # agent.env_kwargs={max_episode_steps: 10} was refused as an unknown key
    from rl_tformers.runtime.run_config import ConfigError, compose

    cfg = compose("gtrxl/ppo_cartpole", overrides=["agent.env_kwargs={max_episode_steps: 10}"])
    assert dict(cfg.agent.env_kwargs) == {"max_episode_steps": 10}
    with pytest.raises(ConfigError, match="agent.no_such_option: unknown key"):
        compose("gtrxl/ppo_cartpole", overrides=["agent.no_such_option=1"])


def test_a_command_line_kind_change_names_the_slot_fields_it_drops(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "backbone.memory.kind=compressive", "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning")]
    assert lines == [
        "warning: backbone.memory.kind: 'xl' -> 'compressive' replaces the slot; the fields set for 'xl' are "
        "dropped (mem_len=16) and 'compressive' takes its own defaults; give them again "
        "(backbone.memory.KEY=VALUE) to set them"]  # (xl's detach=True: compressive has no such field)
    # fields given with the new kind are not dropped, and a field the new kind lacks is not named
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "backbone.memory={kind: compressive, mem_len: 16}", "--print-config"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # a field of the old kind that the new kind has too is named (knn has mem_len, not detach)
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "backbone.memory.kind=knn", "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0 and "are dropped (mem_len=16) and 'knn'" in r.stderr, r.stderr
    # a config file's own slot over the agent's defaults (no command line change): no warning
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "-c", "gtrxl/hopper_positions_bc",
                        "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


# ------------------------------------------------------------------- typos get a suggestion
@pytest.mark.parametrize("override, expected", [
    ("backbone.attention.knd=sdpa", "backbone.attention.knd: unknown key: attention kind 'sdpa' (the default: "
                                    "backbone.attention.kind is not set) has no field 'knd'; did you mean "
                                    "backbone.attention.kind?"),
    ("backbone.attention.window=4", "backbone.attention.window: unknown key: attention kind 'sdpa' (the default: "
                                    "backbone.attention.kind is not set) has no field 'window'; set "
                                    "backbone.attention.kind to a kind that has it"),
    ("backbone.dmodel=32", "backbone.dmodel: unknown backbone field; did you mean backbone.d_model?"),
])
def test_backbone_typos_name_the_key_and_suggest(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=toy", override])
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=inf", "train.lr must be a finite number > 0, got inf"),
        ("train.lr=.nan", "train.lr must be a finite number > 0, got nan"),
        ("train.eps=0", "train.eps must be a finite number > 0, got 0.0"),
        ("train.eps=-1e-8", "train.eps must be a finite number > 0, got -1e-08"),
        ("train.weight_decay=inf", "train.weight_decay must be a finite number >= 0, got inf"),
        ("train.grad_clip=inf", "train.grad_clip must be a finite number >= 0, got inf"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be a finite number in [0, 1], got 1.5"),
        ("train.betas=[0.9,1.0]", "train.betas must be two numbers in [0, 1), got [0.9, 1.0]"),
        ("train.betas=[.nan,0.9]", "train.betas must be two numbers in [0, 1), got [nan, 0.9]"),
        ("train.batch_size=0", "train.batch_size must be >= 1, got 0"),
        ("train.warmup_steps=-1", "train.warmup_steps must be >= 0, got -1"),
        ("train.num_workers=-1", "train.num_workers must be >= 0, got -1"),
        ("train.checkpoint_every=-5", "train.checkpoint_every must be >= 0, got -5"),
        ("train.keep_last=0", "train.keep_last must be >= 1, got 0"),
        ("eval.n_envs=0", "eval.n_envs must be >= 1, got 0"),
        ("seed=-1", "seed must be an integer in [0, 2**64 - 1] (the range torch.manual_seed takes), got -1"),
        ("dataset.scripted.epsilon=1.5", "dataset.scripted.epsilon must be a finite number in [0, 1], got 1.5"),
        ("dataset.scripted.episodes=0", "dataset.scripted.episodes must be >= 1, got 0"),
        ("dataset.scripted.seed=-3", "dataset.scripted.seed must be an integer in [0, 2**64 - 1] (the range "
                                     "torch.manual_seed takes), got -3"),
    ],
)
def test_numeric_options_outside_their_range_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=toy", override])
    assert str(info.value) == message


def test_a_weight_decay_that_zeroes_the_weights_every_update_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=toy", "train.lr=2.0", "train.weight_decay=0.5"])
    assert str(info.value) == ("train.weight_decay=0.5 with train.lr=2: AdamW multiplies the decayed weights by "
                               "1 - lr * weight_decay = 0 every update, which zeroes or flips them; lr * weight_decay "
                               "must be < 1")
    cfg = compose(None, ["agent.kind=toy", "train.lr=1.0", "train.weight_decay=0.99", "train.grad_clip=null"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.grad_clip) == (1.0, 0.99, None)


def test_every_numeric_train_and_eval_option_declares_its_range() -> None:
    unbounded = [f.name for cls in (TrainConfig, EvalConfig) for f in dataclasses.fields(cls)
                 if any(t in str(f.type) for t in ("int", "float")) and not range_words(f.metadata)]
    assert unbounded == []
