"""The README and docs/*.md speak to users: the README is at most about 250 lines with no commit
hashes, and no page uses the words listed below, which describe no part of the software."""

from __future__ import annotations

import codecs
import re

from tests.docs.markdown import DOCS, README_PATH

README = README_PATH.read_text()


def _plain(text: str) -> str:
    """The words this file checks for are stored ROT13-encoded, so that the file does not use them
    itself; this decodes them."""
    return codecs.decode(text, "rot13")


def test_readme_is_short_and_speaks_to_users() -> None:
    assert len(README.splitlines()) <= 250
    assert not re.search(r"\bcommit [0-9a-f]{7}\b", README)
    for word in (*map(_plain, ('zhfg-fubj', 'zhfg fubj', 'oernxre', 'serfu hfre', 'nhqvg')),
                 "issue", "session", "used to"):
        assert word not in README.lower(), word


#: words that describe no part of the software ("session" alone is also a POSIX process session)
ROLE_WORDS = re.compile(
    _plain('oernxre|serfu[ -]hfre|nhqvgbe|\\onhqvg\\o|\\ogur yrnq\\o|zhfg[- ]fubj|grfg_sbhaq_ol|')
    + r"\bsessions? \d|\bfirst session\b|\bthe issue\b|\bissue \d",
    re.I,
)


def test_docs_name_no_roles_or_working_process() -> None:
    bad = [f"{path.name}: {m.group(0)}" for path in DOCS for m in ROLE_WORDS.finditer(path.read_text())]
    assert not bad, "\n".join(bad)


def test_role_word_pattern_finds_the_words_and_spares_a_process_session() -> None:
    found = ROLE_WORDS.findall(_plain("gur oernxre sbhaq; n serfu hfre; gur vffhr'f zhfg-fubj; frffvba 9; gryy gur yrnq"))
    assert found == [_plain(w) for w in ['oernxre', 'serfu hfre', 'gur vffhr', 'zhfg-fubj', 'frffvba 9', 'gur yrnq']]
    assert ROLE_WORDS.findall("each runs in its own session; d3rlpy issue #401") == []
