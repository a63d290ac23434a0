"""What the eighth documentation audit found stale after the day's changes, checked so that it
cannot go stale silently again: capability lists and tables in the docs equal the registry
(cross-attention refusals, sparse/kernel/memory capability tables, the README's capability
names), counts and minimums quoted in the README equal the code (compression functions,
``--recipe-steps``, the Hopper suite's size), and the examples the docs show are what the code
prints or does (the plain progress line, sweep folder names, the padding side of DT windows,
when the compressive memory runs its compressor, the attention-dropout advice's warning class),
the test counts the attention docs quote are the suites', and the results tables' mean ± std
cells are their per-seed values' (with the standard-deviation convention each table states).

Nothing here trains, evaluates or reads data/; the whole file runs in a few seconds.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rl_tformers.registry import REGISTRIES, Capabilities

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _caps(slot: str) -> dict[str, Capabilities]:
    return {e.kind: e.capabilities for e in REGISTRIES[slot]}


def _table(text: str, header_start: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[i + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]])
    return rows


def _yes(cell: str) -> bool:
    """``yes``, ``yes (...)``, ``yes: (S, z)``, ``**yes**`` -> True; ``no``, ``**no**``, ``-`` -> False."""
    m = re.match(r"\**(yes|no|-)\b|\**(-)$", cell.strip())
    assert m, cell
    return (m.group(1) or m.group(2)) == "yes"


# -- capability lists --------------------------------------------------------------------------
def test_backbone_md_lists_exactly_the_kinds_the_encoder_decoder_refuses_as_cross_attention() -> None:
    """backbone.md named sinkhorn and the last-T-keys kinds; the key-index patterns and
    ``blockwise`` were added to the refusals today. The paragraph must name every kind refused,
    and the config must refuse each and accept the others."""
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    text = _flat((DOCS / "backbone.md").read_text())
    m = re.search(r"\(capability `cross_attention`\);(.*?)are refused when the config is built", text)
    assert m, "backbone.md: the cross-attention paragraph moved"
    named = set(re.findall(r"`(\w+)`", m.group(1)))
    caps = _caps("attention")
    refused = {k for k, c in caps.items() if not (c.cross_attention and c.bidirectional)}
    assert named == refused, sorted(named ^ refused)
    for kind in caps:
        if kind in refused:
            with pytest.raises(IncompatibleConfig, match="cross_attention.kind"):
                EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})
        else:
            EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})


@pytest.mark.parametrize(
    ("doc", "header", "columns"),
    [
        ("attention_sparse.md", "| kind | paper | pattern",
         {"causal": 3, "bidirectional": 4, "memory": 5, "incremental": 6}),
        ("attention_kernel.md", "| kind | paper (where) |",
         {"causal": 2, "bidirectional": 3, "memory": 4, "incremental": 5}),
    ],
)
def test_attention_capability_tables_equal_the_registry(doc: str, header: str, columns: dict[str, int]) -> None:
    caps = _caps("attention")
    rows = _table((DOCS / doc).read_text(), header)
    assert len(rows) >= 6
    for row in rows:
        kind = row[0].strip("`")
        for flag, col in columns.items():
            assert _yes(row[col]) == getattr(caps[kind], flag), f"{doc}: {kind} {flag} column says {row[col]!r}"


def test_memory_adaptive_capability_table_equals_the_registry() -> None:
    rows = _table((DOCS / "memory_adaptive.md").read_text(), "| kind | stateful | memory keys |")
    caps = {**_caps("memory"), **_caps("depth")}
    assert {r[0].strip("`") for r in rows} == {"xl", "compressive", "knn", "universal", "early_exit"}
    for row in rows:
        c = caps[row[0].strip("`")]
        shown = (_yes(row[1]), _yes(row[2]), _yes(row[3]), _yes(row[4]))
        assert shown == (c.stateful, c.memory, c.incremental, c.exact_chunking), (row[0], shown)


def test_readme_names_every_capability_flag() -> None:
    m = re.search(r"`rl-tformers backbones` lists its capabilities \(([^)]*)\)", _flat(README))
    assert m, "README: the capability list moved"
    named = [s.strip() for s in m.group(1).split(",")]
    assert named == [f.name for f in dataclasses.fields(Capabilities)]


# -- counts and minimums quoted in the README ----------------------------------------------------
def test_compression_functions_in_the_readme_and_memory_adaptive_md_are_the_code_s() -> None:
    from rl_tformers.memory.compressive import COMPRESSIONS

    n = int(re.search(r"`compressive` \((\d+) compression functions", README).group(1))
    assert n == len(COMPRESSIONS)
    bullet = re.search(r"- \*\*f_c\*\* \(sec\. 3\.1\):(.*?)\n- \*\*Losses", (DOCS / "memory_adaptive.md").read_text(),
                       re.S).group(1)
    listed = {w for w in re.findall(r"`(\w+)`", bullet) if w in COMPRESSIONS}
    assert listed == set(COMPRESSIONS), sorted(set(COMPRESSIONS) - listed)


def test_readme_recipe_steps_minimum_and_hopper_suite_size_are_the_recipes() -> None:
    from rl_tformers.envs import recipes as R

    text = _flat(README)
    assert f"`--recipe-steps N` builds any recipe with N steps instead (N >= {R.MIN_STEPS}:" in text
    hopper = [r for name, r in R.all_recipes(R.DEFAULT_STEPS).items() if name.startswith("hopper-")]
    total = sum(r.steps for r in hopper)
    assert R.DEFAULT_STEPS == 100_000 and total == 1_200_000
    assert "The full Hopper suite (100k steps per policy, 1.2M steps in all)" in text


def test_dt_md_demo_note_repeats_the_readme_s_measured_returns() -> None:
    """dt.md's demo transcript predates the short-window layout change; its note quotes the
    README's re-measured returns, which must stay the same numbers."""
    readme = re.search(r"The agent hits every target: ([\d., and]+?) for targets", _flat(README)).group(1)
    values = re.findall(r"\d+\.\d", readme)
    assert len(values) == 6
    note = re.search(r"so the demo now prints the returns given in the README: ([\d., ]+)\)",
                     (DOCS / "dt.md").read_text()).group(1)
    assert re.findall(r"\d+\.\d", note) == values


# -- examples the docs show ----------------------------------------------------------------------
def test_runtime_md_plain_progress_line_is_what_the_trainer_prints() -> None:
    from rl_tformers.runtime.progress import PlainProgress

    shown = re.search(r"\(`(train: [^`]+)`;", _flat((DOCS / "runtime.md").read_text())).group(1)
    bar = PlainProgress(5000, desc="train", unit="step")
    bar.n = 1200
    # the trainer's postfix formats (runtime/trainer.py): loss .4g, lr .2e
    bar.set_postfix(loss=f"{0.0312:.4g}", lr=f"{1e-4:.2e}", refresh=False)
    assert bar.line(bar._t0 + 29.06) == shown


def test_runtime_md_sweep_folder_names_are_what_expand_gives(tmp_path: Path) -> None:
    from rl_tformers.runtime.sweep import expand

    text = _flat((DOCS / "runtime.md").read_text())

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
    FIFO holds m_m + c slots, and is skipped otherwise (it used to run on empty groups at every
    step)."""
    from rl_tformers import Backbone

    assert "skips the compressor" in _flat((DOCS / "memory_adaptive.md").read_text())
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
    kernel_doc = _flat((DOCS / "attention_kernel.md").read_text())
    m = re.search(r"`tests/attention/test_kernel_attention\.py` \((\d+) checks\) and the contract suite "
                  r"\(`tests/contracts/`, (\d+) checks for these kinds\)", kernel_doc)
    assert m, "attention_kernel.md: the test counts moved"
    assert len(collected("tests/attention/test_sparse_patterns.py")) == sparse
    assert len(collected("tests/attention/test_kernel_attention.py")) == int(m.group(1))
    kinds = re.compile(r"[\[:-](lsh|routing|linformer|rfa|performer|sinkhorn)[\]-]")
    assert sum(1 for t in collected("tests/contracts") if kinds.search(t)) == int(m.group(2))


def _mean_std(values: list[float], ddof: int) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=ddof))


def test_readme_backbone_swap_cells_are_the_mean_and_sample_std_of_their_seeds() -> None:
    """Each row's ``mean ± std`` is its per-seed column's mean and standard deviation with
    n - 1 (the sweep's ``results.md``), as the README now says; per-seed values are rounded to
    0.1 and the cells too, hence the tolerance of 0.1."""
    assert "std with n - 1, as the sweep's `results.md` gives it" in _flat(README)
    rows = re.findall(r"^\| (`backbone\.[^|]*|none:[^|]*) \| ([\d.]+) ± ([\d.]+) \| ([\d., ]+) \|$", README, re.M)
    assert len(rows) >= 9  # every row of the table (new rows are checked as they come)
    for name, mean, std, seeds in rows:
        m, s = _mean_std([float(x) for x in seeds.split(",")], ddof=1)
        assert abs(m - float(mean)) <= 0.1 and abs(s - float(std)) <= 0.1, (name, m, s)


def test_dt_md_hopper_cells_are_the_mean_and_population_std_of_their_seeds() -> None:
    text = _flat((DOCS / "dt.md").read_text())
    table = _table((DOCS / "dt.md").read_text(), "| dataset | DT (top return) | BC | %BC (top 10%) |")
    per_seed = re.search(r"Per seed \(0, 1, 2\): DT (.*?); BC (.*?); %BC (.*?) \(medium / medium-replay", text)
    assert per_seed and len(table) == 3
    for col, group in enumerate(per_seed.groups(), start=1):
        for row, seeds in zip(table, group.split(" / ")):
            mean, std = (float(x) for x in row[col].strip("*").split(" ± "))
            m, s = _mean_std([float(x) for x in seeds.split(",")], ddof=0)
            assert abs(m - mean) <= 0.1 and abs(s - std) <= 0.1, (row[0], col, m, s)
