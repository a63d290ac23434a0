"""The examples docs/*.md show are what the code prints or does: the plain progress line, sweep
folder names, the padding sides of DT windows, when the compressive memory runs its compressor,
the attention-dropout advice's warning class, the recipe sizes, the test counts the attention
docs quote, and the returns-to-go examples."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.cli import app
from tests.docs.markdown import DOCS_DIR, REPO, flat

DOCS = DOCS_DIR


def test_data_md_recipe_steps_minimum_and_hopper_suite_size_are_the_recipes() -> None:
    from rl_tformers.envs import recipes as R

    text = flat((DOCS_DIR / "data.md").read_text())
    assert f"`--recipe-steps N` builds any recipe with N steps instead (N >= {R.MIN_STEPS}:" in text
    hopper = [r for name, r in R.all_recipes(version=0).items() if name.startswith("hopper-")]
    total = sum(r.steps for r in hopper)
    assert R.VERSION_STEPS[0] == 100_000 and total == 1_200_000
    assert "The full version 0 Hopper suite (100k steps per policy, 1.2M steps in all)" in text


def test_runtime_md_plain_progress_line_is_what_the_trainer_prints() -> None:
    from rl_tformers.runtime.progress import PlainProgress

    shown = re.search(r"\(`(train: [^`]+)`;", flat((DOCS / "runtime.md").read_text())).group(1)
    bar = PlainProgress(5000, desc="train", unit="step")
    bar.n = 1200
    # the trainer's postfix formats (runtime/trainer.py): loss .4g, lr .2e
    bar.set_postfix(loss=f"{0.0312:.4g}", lr=f"{1e-4:.2e}", refresh=False)
    assert bar.line(bar._t0 + 29.06) == shown


def test_runtime_md_sweep_folder_names_are_what_expand_gives(tmp_path: Path) -> None:
    from rl_tformers.runtime.sweep import expand

    text = flat((DOCS / "runtime.md").read_text())

    def folders(grid: dict[str, list[str]], out: Path = tmp_path) -> list[str]:
        return [r.name.split("/")[0] for r in expand(grid, [0], out)]

    cases = [
        ({"backbone.attention.kind": ["sdpa"]}, "kind=sdpa"),
        ({"backbone.attention.kind": ["sdpa"], "backbone.position.kind": ["none"]},
         "attention.kind=sdpa__position.kind=none"),
        ({"backbone.n_layers": ["1"], "train.lr": ["1e-3"]}, "n_layers=1__lr=1e-3"),
    ]
    for grid, name in cases:
        assert f"`{name}`" in text, name
        assert folders(grid) == [name]
    assert "backbone.attention.kind=sdpa__backbone.position.kind=none" not in text  # no other naming
    # the refusal example's folder names
    grid = {"backbone.attention.kind": ["sdpa", "linformer"], "backbone.causal": ["true", "false"]}
    names = folders(grid)
    shown = re.findall(r"^  (\S+)/seed\* \(", (DOCS / "runtime.md").read_text(), re.M)
    assert len(shown) == 3 and set(shown) <= set(names), (shown, names)


def test_data_md_padding_sides_of_dt_windows_are_the_sampler_s() -> None:
    """Start-aligned windows of an episode shorter than K are padded on the right (step t at
    slot t, as the policy acts), end-aligned ones on the left."""
    from rl_tformers.envs.dataset import EpisodeDataset
    from rl_tformers.envs.samplers import WindowSampler

    assert 'padding right for "start", left for "end"' in (DOCS / "data.md").read_text()
    obs = np.arange(3, dtype=np.float32)[:, None]
    ds = EpisodeDataset.from_flags(obs, np.zeros((3, 1), np.float32), np.ones(3), [0, 0, 1],
                                   action_space=gym.spaces.Box(-1, 1, (1,), np.float32))
    rng = np.random.default_rng(0)
    start = WindowSampler(ds, context_len=5, align="start").sample(8, rng)
    assert (start["mask"] == np.array([True] * 3 + [False] * 2)).all()
    assert (start["timesteps"][:, :3] == np.arange(3)).all()  # step t at slot t
    end = WindowSampler(ds, context_len=5, align="end").sample(16, rng)
    assert end["mask"][:, -1].all() and not end["mask"][:, :2].any()  # real steps last


def test_compressive_memory_runs_its_compressor_only_when_a_row_forms_a_group() -> None:
    """memory_adaptive.md: acting one step at a time, the compressor runs every c steps once the
    FIFO holds m_m + c slots, and is skipped otherwise (never on empty groups)."""
    from rl_tformers import Backbone

    assert "skips the compressor" in flat((DOCS / "memory_adaptive.md").read_text())
    torch.manual_seed(0)
    bb = Backbone({"d_model": 8, "n_heads": 2, "n_layers": 1, "dropout": 0.0, "attn_dropout": 0.0,
                   "position": {"kind": "xl_relative"},
                   "memory": {"kind": "compressive", "mem_len": 2, "compressed_len": 2, "rate": 2}}).eval()
    calls: list[int] = []
    step = 0
    bb.memory.compressors[0].register_forward_hook(lambda *_: calls.append(step))
    state = bb.initial_state(batch=2)
    with torch.no_grad():
        for step in range(1, 9):
            out = bb(torch.randn(2, 1, 8), positions=torch.full((2, 1), step - 1), state=state)
            state = out.state
    assert calls == [4, 6, 8]


def test_attention_dropout_advice_is_a_config_advice_warning() -> None:
    """attention_kernel.md names the warning class (a UserWarning that loading a trained run
    silences)."""
    from rl_tformers import Backbone
    from rl_tformers.backbone_config import ConfigAdviceWarning

    assert "`rl_tformers.backbone_config.ConfigAdviceWarning`" in (DOCS / "attention_kernel.md").read_text()
    assert issubclass(ConfigAdviceWarning, UserWarning)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        Backbone({"d_model": 8, "n_heads": 2, "n_layers": 1, "attn_dropout": 0.1,
                  "attention": {"kind": "performer"}})
    assert [w.category for w in got if "attn_dropout" in str(w.message)] == [ConfigAdviceWarning]


def test_test_counts_quoted_in_the_attention_docs_are_the_suites() -> None:
    """attention_sparse.md and attention_kernel.md quote how many tests check them."""
    import subprocess
    import sys

    def collected(*args: str) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        return [ln for ln in r.stdout.splitlines() if "::" in ln]

    sparse = int(re.search(r"`tests/attention/test_sparse_patterns\.py` \((\d+) tests\)",
                           (DOCS / "attention_sparse.md").read_text()).group(1))
    kernel_doc = flat((DOCS / "attention_kernel.md").read_text())
    m = re.search(r"`tests/attention/test_kernel_attention\.py` \((\d+) checks\) and the contract suite "
                  r"\(`tests/contracts/`, (\d+) checks for these kinds\)", kernel_doc)
    assert m, "attention_kernel.md: the test counts moved"
    assert len(collected("tests/attention/test_sparse_patterns.py")) == sparse
    assert len(collected("tests/attention/test_kernel_attention.py")) == int(m.group(1))
    kinds = re.compile(r"[\[:-](lsh|routing|linformer|rfa|performer|sinkhorn)[\]-]")
    assert sum(1 for t in collected("tests/contracts") if kinds.search(t)) == int(m.group(2))


def test_data_md_trajectory_examples_print_what_the_comments_say() -> None:
    from rl_tformers.envs.trajectory import next_return_to_go, returns_to_go

    text = (REPO / "docs/data.md").read_text()
    assert "returns_to_go([1, 2, 3, 4, 5])             # [15, 14, 12, 9, 5]" in text
    assert returns_to_go([1, 2, 3, 4, 5]).tolist() == [15, 14, 12, 9, 5]
    assert "returns_to_go([1, 1, 1], gamma=0.5)        # [1.75, 1.5, 1.0]" in text
    assert returns_to_go([1, 1, 1], gamma=0.5).tolist() == [1.75, 1.5, 1.0]
    assert (
        "next_return_to_go(15.0, 1.0)               # 14.0" in text and next_return_to_go(15.0, 1.0) == 14.0
    )


def test_backbone_doc_type_check_example_gives_the_message_it_quotes() -> None:
    doc = (DOCS_DIR / "backbone.md").read_text()
    m = re.search(r"`(\w+)` with `(\w+): ([0-9.]+)`: \"\.\.\. (\w+) must be an integer, got ([0-9.]+) \(float\)\"", doc)
    assert m, "the example of the field type check is no longer in docs/backbone.md"
    kind, field, value, quoted_field, quoted_value = m.groups()
    with pytest.raises(Exception) as info:
        BackboneConfig.from_dict({"attention": {"kind": kind, field: float(value)}})
    assert f"{quoted_field} must be an integer, got {quoted_value} (float)" in str(info.value), str(info.value)


def test_gtrxl_known_limits_do_not_contradict_the_default_knn_retrieval() -> None:
    """kNN memory's default `retrieval: steps` makes acting one step at a time equal the training
    forward (docs/memory_adaptive.md), so a "Known limits" bullet of docs/gtrxl.md that says acting
    does not equal the segment computation must name the `segments` rule it is about."""
    text = (DOCS_DIR / "gtrxl.md").read_text()
    known = text[text.index("## Known limits"):]
    bullets = [b for b in known.split("\n- ") if "memory.kind=knn" in b]
    for b in bullets:
        assert "does not equal" not in b or "segments" in b, b


def test_train_help_and_docs_say_ppo_resume_is_exact() -> None:
    r = CliRunner().invoke(app, ["train", "--help"], terminal_width=400)
    text = " ".join(r.output.split())
    assert "on-policy PPO too: its environments are checkpointed" in text
    docs = (DOCS_DIR / "runtime.md").read_text()
    assert "`gtrxl_ppo` checkpoints its environments" in " ".join(docs.split())
