"""The README's "Python API" block runs as written (with 4 updates instead of 200), so the
README cannot drift from the functions it shows."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_api_block() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README: no python block under '## Python API'"
    return match.group(1)


def test_readme_python_api_block_runs(tmp_path: Path) -> None:
    code = _python_api_block()
    assert "train.steps=200" in code
    code = code.replace("train.steps=200", "train.steps=4")
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md:Python API", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)
    lines = out.getvalue().splitlines()
    # one line per target ("250.0 <mean return>", "500.0 ..."), then the own loop's return
    assert [ln.split()[0] for ln in lines[-3:-1]] == ["250.0", "500.0"]
    assert lines[-1].startswith("own loop: ")
    assert 1.0 <= float(lines[-1].split()[-1]) <= 500.0  # a CartPole-v1 episode's return
    assert (tmp_path / "runs" / "api-dt" / "checkpoints" / "step_000000004.pt").is_file()
