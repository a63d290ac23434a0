"""The agents' typed ``agent:`` sections (agents/<agent>/config.py, rl_tformers.typed_config):
exact error lines through ``compose``, defaults, saved configs and ``rl-tformers agents``."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf
from rl_tformers.agents.bc.config import BCAgentConfig
from rl_tformers.agents.decision_transformer.config import DTAgentConfig, KNNOptions, ODTAgentConfig
from rl_tformers.agents.gtrxl.config import GTrXLAgentConfig, PPOAgentConfig
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.agent_registry import get_agent
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.typed_config import ConfigFieldError, format_fields

CONFIGS = {"dt": DTAgentConfig, "odt": ODTAgentConfig, "bc": BCAgentConfig, "gtrxl": GTrXLAgentConfig,
           "gtrxl_ppo": PPOAgentConfig}


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as exc:
        compose(None, list(overrides))
    return str(exc.value)


def test_unknown_key_is_refused_with_did_you_mean() -> None:
    assert _refused("agent.kind=bc", "agent.top_fracton=0.5") == (
        "agent.top_fracton: unknown key; did you mean agent.top_fraction? "
        "(keys of agent: hidden, dropout, top_fraction, normalize_obs, encoder, env_id, env_kwargs)")


def test_wrong_type_is_refused_naming_the_key() -> None:
    assert _refused("agent.kind=dt", "agent.context_len=2.5") == "agent.context_len must be an integer >= 1, got 2.5 (float)"
    assert _refused("agent.kind=gtrxl", "agent.prev_action=maybe") == (
        "agent.prev_action must be true or false, got 'maybe' (str)")


def test_an_integer_too_large_for_a_float_field_is_refused_naming_the_key() -> None:
    big = "1" + "0" * 400  # beyond the largest float: math.isfinite raises OverflowError on it
    assert _refused("agent.kind=dt", f"agent.target_entropy={big}") == (
        f"agent.target_entropy must be a finite number or null, got {big} (int)")


def test_a_list_given_for_a_nested_section_is_refused_naming_the_section(tmp_path) -> None:
    f = tmp_path / "knn.yaml"
    f.write_text("agent:\n  kind: dt\n  knn: [1, 2]\n")
    with pytest.raises(ConfigError) as exc:
        compose(f)
    assert str(exc.value) == (f"agent.knn must be a mapping (keys: lam, k, temperature, max_entries, metric), "
                              f"got [1, 2] [{f}]")
    assert _refused("agent.kind=bc", "agent.hidden={a: 1}") == "agent.hidden must be a list, got {'a': 1} [command line]"


def test_out_of_range_is_refused_naming_the_key() -> None:
    assert _refused("agent.kind=gtrxl_ppo", "agent.gamma=1.5") == "agent.gamma must be a number in [0, 1], got 1.5"
    assert _refused("agent.kind=dt", "agent.knn.metric=cosine") == "agent.knn.metric must be one of 'l2', 'ip', got 'cosine'"


def test_nested_section_typo_names_the_full_dotted_key() -> None:
    assert _refused("agent.kind=dt", "agent.early_exit.treshold=0.5") == (
        "agent.early_exit.treshold: unknown key; did you mean agent.early_exit.threshold? "
        "(keys of agent.early_exit: scheme, tol, heldout_frac, threshold, delta, epsilon, windows)")
    assert _refused("agent.kind=odt", "agent.online.bufer_size=3") == (
        "agent.online.bufer_size: unknown key; did you mean agent.online.buffer_size? "
        "(keys of agent.online: buffer_size, rollouts_per_round, updates_per_round, target_return, n_envs)")


def test_cross_field_rule_is_one_line_naming_the_key() -> None:
    assert _refused("agent.kind=dt", "agent.context_len=4", "agent.eval_context_len=5") == (
        "agent.eval_context_len must be at most agent.context_len=4 (the steps of context read when acting) "
        "or null (all K), got 5")


def test_gaussian_log_std_bounds_keep_the_variance_a_normal_float32() -> None:
    assert _refused("agent.kind=odt", "agent.log_std_min=-50") == "agent.log_std_min must be a number in [-40, 40], got -50"
    assert _refused("agent.kind=odt", "agent.log_std_max=.inf") == (
        "agent.log_std_max must be a number in [-40, 40], got inf (float)")
    assert _refused("agent.kind=dt", "agent.log_std_min=3") == (
        "agent.log_std_max must be above agent.log_std_min=3 (the gaussian head's log standard deviation lies "
        "between them), got 2")


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_every_numeric_agent_option_declares_its_range_or_any_finite_value(kind: str) -> None:
    """Every int/float option of an agent has bounds, except those any finite number fits (targets in raw
    return units, a target entropy)."""
    any_finite = {"targets", "target_entropy", "target_return"}

    def unbounded(cls: type) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            hint = str(f.type)
            section = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if section is not None and dataclasses.is_dataclass(section):
                out += unbounded(type(section))
            elif any(t in hint for t in ("int", "float")) and not (set(f.metadata) & {"ge", "gt", "le", "lt"}):
                out += [] if f.name in any_finite else [f.name]
        return out

    assert unbounded(CONFIGS[kind]) == []


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_every_agent_kind_registers_its_config_and_its_defaults(kind: str) -> None:
    entry = get_agent(kind)
    cls = CONFIGS[kind]
    assert entry.config_cls is cls
    assert entry.defaults["agent"] == {"kind": kind, **cls().to_dict()}
    assert cls.from_dict(cls().to_dict()) == cls()  # the dict form reads back
    assert all(f.metadata.get("doc") for f in dataclasses.fields(cls))  # every field has its one-line doc
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().env_id = "x"  # type: ignore[misc]


def test_a_saved_run_config_composes_and_reads_back() -> None:
    """A run's config.yaml (every agent key written out) is a start layer of compose; its section is
    the same typed config."""
    cfg = compose("dt/cartpole_demo", ["agent.knn.k=8", "agent.targets=[100,50]"])
    again = compose(start=yaml.safe_load(OmegaConf.to_yaml(cfg)))
    options = get_agent("dt").agent_options(OmegaConf.to_container(again.agent))
    assert options.knn == KNNOptions(k=8) and options.targets == (100.0, 50.0)


def test_direct_construction_checks_fields_too() -> None:
    with pytest.raises(ConfigFieldError, match=r"^k must be an integer >= 1, got 0$"):
        KNNOptions(k=0)
    assert KNNOptions(k=3).replace(temperature=2).temperature == 2


def test_agents_command_lists_each_field_with_default_and_doc() -> None:
    r = CliRunner().invoke(app, ["agents", "dt"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "dt: Decision Transformer (Chen et al. 2021) on any backbone"
    assert "  agent.knn.k = 16                       neighbours per query (an integer >= 1)" in lines
    assert "  agent.encoder.features = 512           kind nature_cnn: units of the last fully connected layer (the " \
           "feature size F) (an integer >= 1)" in lines
    assert [ln.split(" = ")[0].strip() for ln in lines if "agent.encoder.kind" in ln] == ["agent.encoder.kind"]
    assert len(lines) == 1 + len(format_fields(DTAgentConfig))


def test_agents_command_refuses_an_unknown_kind() -> None:
    r = CliRunner().invoke(app, ["agents", "nope"])
    assert r.exit_code == 2 and "agent.kind='nope' is not registered" in r.output
