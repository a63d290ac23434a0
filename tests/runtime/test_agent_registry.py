"""rl_tformers.runtime.agent_registry: looking up agent kinds."""

from __future__ import annotations

import pytest

from rl_tformers.runtime.agent_registry import UnknownAgentError, get_agent


def test_unknown_kind_near_a_registered_one_suggests_it() -> None:
    with pytest.raises(UnknownAgentError) as exc:
        get_agent("dtt")
    assert str(exc.value).startswith("agent.kind='dtt' is not registered; did you mean dt? registered kinds: bc, dt, ")


def test_unknown_kind_far_from_every_registered_one_lists_them_only() -> None:
    with pytest.raises(UnknownAgentError) as exc:
        get_agent("zzzz")
    assert str(exc.value).startswith("agent.kind='zzzz' is not registered; registered kinds: bc, dt, ")
    assert "did you mean" not in str(exc.value)
