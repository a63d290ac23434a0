"""rl_tformers.cli.errors: the one-line refusal every command prints for bad input."""

from __future__ import annotations

import pytest
import typer

from rl_tformers.cli.errors import error_line, fail


def test_a_message_of_several_lines_is_printed_on_one() -> None:
    text = "data.hdf5: cannot read 'rewards' (OSError: Can't read data\n  (file read failed)\n)"
    assert error_line(text) == "error: data.hdf5: cannot read 'rewards' (OSError: Can't read data (file read failed) )"
    assert error_line("train.lr: unknown key") == "error: train.lr: unknown key"


def test_fail_prints_the_line_on_stderr_and_gives_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    exit_ = fail("a\nb")
    assert isinstance(exit_, typer.Exit) and exit_.exit_code == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "error: a b\n")
