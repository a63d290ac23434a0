"""The results tables' mean ± std cells are their per-seed values' mean and standard deviation,
with the convention each table states (docs/results.md: n - 1 for the sweep table; docs/dt.md:
n for the Hopper table)."""

from __future__ import annotations

import re

import numpy as np

from tests.docs.markdown import DOCS_DIR, flat, table


def _mean_std(values: list[float], ddof: int) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=ddof))


def test_backbone_swap_cells_are_the_mean_and_sample_std_of_their_seeds() -> None:
    """Each row's ``mean ± std`` is its per-seed column's mean and standard deviation with
    n - 1 (the sweep's ``results.md``), as docs/results.md says; per-seed values are rounded to
    0.1 and the cells too, hence the tolerance of 0.1."""
    text = (DOCS_DIR / "results.md").read_text()
    assert "std with n - 1, as the sweep's `results.md` gives it" in flat(text)
    rows = re.findall(r"^\| (`backbone\.[^|]*|none:[^|]*) \| ([\d.]+) ± ([\d.]+) \| ([\d., ]+) \|$", text, re.M)
    assert len(rows) >= 9  # every row of the table (new rows are checked as they come)
    for name, mean, std, seeds in rows:
        m, s = _mean_std([float(x) for x in seeds.split(",")], ddof=1)
        assert abs(m - float(mean)) <= 0.1 and abs(s - float(std)) <= 0.1, (name, m, s)


def test_dt_md_hopper_cells_are_the_mean_and_population_std_of_their_seeds() -> None:
    text = flat((DOCS_DIR / "dt.md").read_text())
    rows = table((DOCS_DIR / "dt.md").read_text(), "| dataset | DT (top return) | BC | %BC (top 10%) |")
    per_seed = re.search(r"Per seed \(0, 1, 2\): DT (.*?); BC (.*?); %BC (.*?) \(medium / medium-replay", text)
    assert per_seed and len(rows) == 3
    for col, group in enumerate(per_seed.groups(), start=1):
        for row, seeds in zip(rows, group.split(" / ")):
            mean, std = (float(x) for x in row[col].strip("*").split(" ± "))
            m, s = _mean_std([float(x) for x in seeds.split(",")], ddof=0)
            assert abs(m - mean) <= 0.1 and abs(s - std) <= 0.1, (row[0], col, m, s)
