"""The README: its feature table lists exactly the registered kinds, its counts are the
code's, and its headline results and performance tables are the rows of docs/results.md and
docs/performance.md."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict

from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.registry import Capabilities
from tests.docs.markdown import DOCS_DIR, README_PATH, REPO, flat, table

README = README_PATH.read_text()


def registered_kinds() -> dict[str, set[str]]:
    r = CliRunner().invoke(app, ["backbones", "--json"])
    assert r.exit_code == 0, r.output
    kinds: dict[str, set[str]] = defaultdict(set)
    for entry in json.loads(r.output):
        kinds[entry["slot"]].add(entry["kind"])
    return kinds


def test_readme_feature_table_lists_every_registered_kind_and_nothing_else() -> None:
    readme = (REPO / "README.md").read_text()
    kinds = registered_kinds()
    for label, slot in (
        ("Attention", "attention"),
        ("Positions", "position"),
        ("Memory", "memory"),
        ("Blocks", "block"),
        ("Depth", "depth"),
    ):
        m = re.search(rf"^\| \*\*{label}\*\* \((\d+)[^)]*\) \| (.*) \|$", readme, re.M)
        assert m, label
        listed = set(re.findall(r"`(\w+)`", m.group(2)))
        assert listed == kinds[slot], (label, sorted(listed ^ kinds[slot]))
        assert int(m.group(1)) == len(kinds[slot]), label


def test_readme_names_every_capability_flag() -> None:
    m = re.search(r"`rl-tformers backbones` lists its capabilities \(([^)]*)\)", flat(README))
    assert m, "README: the capability list moved"
    named = [s.strip() for s in m.group(1).split(",")]
    assert named == [f.name for f in dataclasses.fields(Capabilities)]


def test_compression_functions_in_the_readme_and_memory_adaptive_md_are_the_code_s() -> None:
    from rl_tformers.memory.compressive import COMPRESSIONS

    n = int(re.search(r"`compressive` \((\d+) compression functions", README).group(1))
    assert n == len(COMPRESSIONS)
    bullet = re.search(r"- \*\*f_c\*\* \(sec\. 3\.1\):(.*?)\n- \*\*Losses", (DOCS_DIR / "memory_adaptive.md").read_text(),
                       re.S).group(1)
    listed = {w for w in re.findall(r"`(\w+)`", bullet) if w in COMPRESSIONS}
    assert listed == set(COMPRESSIONS), sorted(set(COMPRESSIONS) - listed)


def test_dt_md_demo_note_repeats_the_readme_s_measured_returns() -> None:
    """dt.md's demo transcript predates the short-window layout change; its note quotes the
    README's re-measured returns, which must stay the same numbers."""
    readme = re.search(r"The agent hits every target: ([\d., and]+?) for targets", flat(README)).group(1)
    values = re.findall(r"\d+\.\d", readme)
    assert len(values) == 6
    note = re.search(r"the demo prints the returns given in the README: ([\d., ]+)\)",
                     (DOCS_DIR / "dt.md").read_text()).group(1)
    assert re.findall(r"\d+\.\d", note) == values



def _score(cell: str) -> tuple[str, str, str]:
    """(mean, std, n) of a results cell: ``**61.9 ± 6.4** (n=2)``, ``33.4 (n=1)`` (one seed: std
    0.0) or docs/results.md's ``61.9 ± 6.4 (n=2: 68.3, 55.5)``."""
    m = re.fullmatch(r"\**([\d.]+)(?: ± ([\d.]+))?\** \(n=(\d+)(?::[^)]*)?\)", cell)
    assert m, cell
    return m.group(1), m.group(2) or "0.0", m.group(3)


def test_readme_headline_results_rows_are_docs_results_md_rows() -> None:
    """The README's headline table is the converged Hopper table of docs/results.md: the same
    datasets, and in every cell the same mean, std and number of seeds."""
    readme_rows = table(README, "| dataset | DT (top return) | BC | %BC (top 10%) |")
    results_rows = table((DOCS_DIR / "results.md").read_text(), "| dataset | DT (top return) | BC | %BC (top 10%) | d3rlpy")
    assert [r[0] for r in readme_rows] == ["hopper-medium", "hopper-medium-replay", "hopper-medium-expert"]
    assert [r[0] for r in results_rows] == [r[0] for r in readme_rows]
    for mine, full in zip(readme_rows, results_rows):
        assert [_score(c) for c in mine[1:]] == [_score(c) for c in full[1:4]], mine[0]


def test_readme_headline_performance_rows_are_docs_performance_md_rows() -> None:
    header = "| ratio (same run, updates/s), 1 thread | sample + update | update only |"
    readme_rows = table(README, header)
    perf_rows = table((DOCS_DIR / "performance.md").read_text(), header)
    assert len(readme_rows) == 5 and readme_rows == perf_rows
