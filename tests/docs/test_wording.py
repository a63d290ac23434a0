"""The README and docs/*.md speak to users: the README is at most about 250 lines with no commit
hashes, and no page names the roles or the process by which the project is worked on."""

from __future__ import annotations

import re

from tests.docs.markdown import DOCS, README_PATH

README = README_PATH.read_text()


def test_readme_is_short_and_speaks_to_users() -> None:
    assert len(README.splitlines()) <= 250
    assert not re.search(r"\bcommit [0-9a-f]{7}\b", README)
    for word in ("must-show", "must show", "issue", "breaker", "fresh user", "audit", "session", "used to"):
        assert word not in README.lower(), word


#: words about who works on the project and how ("session" alone is also a POSIX process session)
ROLE_WORDS = re.compile(
    r"breaker|fresh[ -]user|auditor|\baudit\b|\bthe lead\b|must[- ]show|test_found_by|"
    r"\bsessions? \d|\bfirst session\b|\bthe issue\b|\bissue \d",
    re.I,
)


def test_docs_name_no_roles_or_working_process() -> None:
    bad = [f"{path.name}: {m.group(0)}" for path in DOCS for m in ROLE_WORDS.finditer(path.read_text())]
    assert not bad, "\n".join(bad)


def test_role_word_pattern_finds_the_words_and_spares_a_process_session() -> None:
    found = ROLE_WORDS.findall("the breaker found; a fresh user; the issue's must-show; session 9; tell the lead")
    assert found == ["breaker", "fresh user", "the issue", "must-show", "session 9", "the lead"]
    assert ROLE_WORDS.findall("each runs in its own session; d3rlpy issue #401") == []
