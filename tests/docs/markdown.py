"""Readers of the README and docs/*.md for the docs tests: fenced blocks, prose, inline code,
tables, and the shell blocks' commands as bash expands them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_PATH = REPO / "README.md"
DOCS_DIR = REPO / "docs"
#: every markdown page the docs tests read: the README first, then docs/*.md
DOCS = [README_PATH, *sorted(DOCS_DIR.glob("*.md"))]
PERF = DOCS_DIR / "performance"
BASH = shutil.which("bash") or "/bin/bash"

FENCE_OPEN = re.compile(r"^(\s*)```(\w*)\s*$")
FENCE_CLOSE = re.compile(r"^\s*```\s*$")


def flat(text: str) -> str:
    """``text`` with every run of whitespace (line breaks too) as one space."""
    return re.sub(r"\s+", " ", text)


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, body) of every fenced block, indented ones too."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, j, body = m.group(1), m.group(2), i + 1, []
        while j < len(lines) and not FENCE_CLOSE.match(lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append((i + 1, lang, "\n".join(body)))
        i = j + 1
    return out


def prose(path: Path) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"(?ms)^\s*```.*?^\s*```[ \t]*$", "", path.read_text())


def inline_code(path: Path) -> list[str]:
    """Every `inline code` span of the prose."""
    return re.findall(r"`([^`\n]+)`", prose(path).replace("\n", " "))


def table(text: str, header_start: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[i + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]])
    return rows


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, body) of the ``bash`` blocks and the unlabelled blocks that start with a command."""
    out = []
    for line, lang, body in fenced_blocks(path):
        first = next((ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
        if lang == "bash" or (lang == "" and first.startswith(("rl-tformers ", "python "))):
            out.append((line, body))
    return out


# bash runs the block with an empty PATH: every external command (rl-tformers, python, make...)
# lands in command_not_found_handle, which records its expanded argv instead of running it.
_RECORDER = (
    'command_not_found_handle() { printf \'%s\\0\' "$@" >> "$LOG"; printf \'\\n\' >> "$LOG"; return 0; }\n'
)


def recorded_commands(body: str, tmp: Path) -> list[list[str]]:
    """The argv of every external command ``body`` runs, expanded by bash, none of them run."""
    log = tmp / "argv.log"
    log.write_bytes(b"")
    env = {"PATH": str(tmp / "no-bin"), "LOG": str(log), "HOME": str(tmp)}
    subprocess.run([BASH, "-c", _RECORDER + body], cwd=tmp, env=env, capture_output=True, timeout=60)
    return [c.split("\0") for c in log.read_text().split("\0\n") if c.strip()]


_SHELL_CACHE: dict[str, list[list[str]]] = {}


def doc_commands(tmp_path_factory, docs: list[Path] = DOCS) -> list[tuple[str, list[str]]]:
    """(``file:line``, argv) of every external command the docs' shell blocks run."""
    out = []
    for path in docs:
        for line, body in shell_blocks(path):
            if body not in _SHELL_CACHE:
                _SHELL_CACHE[body] = recorded_commands(body, tmp_path_factory.mktemp("sh"))
            out += [(f"{path.relative_to(REPO)}:{line}", argv) for argv in _SHELL_CACHE[body]]
    return out


def load_perf(name: str) -> dict:
    """One benchmark JSON of docs/performance/."""
    return json.loads((PERF / name).read_text())
