"""Progress output (rl_tformers.runtime.progress): plain lines without a terminal, the bar with one."""

from __future__ import annotations

import io
import re
from pathlib import Path

import gymnasium as gym
import pytest

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train


# ---------------------------------------------------------------------- progress without a tty
def test_train_progress_without_a_terminal_is_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """stderr is not a terminal under pytest's capture, as in ``nohup rl-tformers train > log``.
    Each line is a plain line there (tqdm's redraws, ``\\r``, would fill the log); a 6-step run
    prints a line at every step (5% of the run rounds up to one step)."""
    cfg = compose(None, ["agent.kind=toy", "device=cpu", "train.steps=6", "train.log_every=3",
                         "train.warmup_steps=1", "eval.at_end=false", "train.progress=true"])
    train(cfg, tmp_path / "short")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train: ")]
    assert [ln.split(" steps")[0] for ln in lines] == [f"train: {k}/6" for k in range(1, 7)]
    assert lines[-1].startswith("train: 6/6 steps (100%), ") and "loss=" in lines[-1]
    assert "about " in lines[0] and " left" in lines[0] and "left" not in lines[-1]

    train(compose(None, ["agent.kind=toy", "device=cpu", "train.steps=2", "eval.at_end=false",
                         "train.progress=false"]), tmp_path / "quiet")
    assert "train: " not in capsys.readouterr().err


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _counts(text: str) -> list[int]:
    return [int(ln.split(": ")[1].split("/")[0].split(" ")[0]) for ln in text.splitlines()]


def test_plain_progress_prints_every_5_percent_of_a_fast_run() -> None:
    """1000 updates at one instant: a line at every 50 (5%), none in between, none again at close."""
    from rl_tformers.runtime.progress import PlainProgress

    out, clock = io.StringIO(), FakeClock()
    bar = PlainProgress(1000, desc="train", file=out, clock=clock)
    for _ in range(1000):
        bar.update(1)
    bar.close()
    assert _counts(out.getvalue()) == list(range(50, 1001, 50))


def test_plain_progress_prints_every_10_seconds_of_a_slow_run() -> None:
    """3 s per update of a 1000-step run: a line after 4 updates (12 s), then every 4 (5% would be 50)."""
    from rl_tformers.runtime.progress import PlainProgress

    out, clock = io.StringIO(), FakeClock()
    bar = PlainProgress(1000, desc="train", file=out, clock=clock)
    for _ in range(13):
        clock.now += 3.0
        bar.update(1)
    assert _counts(out.getvalue()) == [4, 8, 12]
    assert out.getvalue().splitlines()[0] == "train: 4/1000 steps (0%), 0.333 steps/s, elapsed 12s, about 49m48s left"
    bar.close()
    assert _counts(out.getvalue()) == [4, 8, 12, 13]


def test_plain_progress_of_unknown_length_prints_by_time_only() -> None:
    from rl_tformers.runtime.progress import PlainProgress

    out, clock = io.StringIO(), FakeClock()
    bar = PlainProgress(None, desc="collect", file=out, clock=clock)
    for _ in range(100):
        clock.now += 0.25
        bar.update(1)
    assert _counts(out.getvalue()) == [40, 80]
    assert out.getvalue().splitlines()[0] == "collect: 40 steps, 4 steps/s, elapsed 10s"


def test_a_terminal_keeps_the_bar() -> None:
    from rl_tformers.runtime import progress as progress_mod

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    bar = progress_mod.progress_bar(10, desc="train", file=Tty())
    assert isinstance(bar, tqdm)
    bar.close()
    plain = progress_mod.progress_bar(10, desc="train", file=io.StringIO())
    assert isinstance(plain, progress_mod.PlainProgress) and not plain.disable


def test_collect_progress_without_a_terminal_is_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from rl_tformers.envs.collect import Behaviour, collect
    from rl_tformers.envs.policies import RandomPolicy

    env = gym.make("CartPole-v1")
    collect("CartPole-v1", [Behaviour(RandomPolicy(env.action_space, seed=0), episodes=2)],
            dataset_id="t/cartpole/random-v0", root=tmp_path, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("t/cartpole/random-v0: ")]
    assert len(lines) == 1 and re.match(r"t/cartpole/random-v0: \d+ steps, ", lines[0]) and "episodes=2" in lines[0]


def test_plain_progress_line_says_when_its_logged_values_are_from_an_earlier_step() -> None:
    """After SIGTERM at step 143 the last line says that its loss and lr are those of the step-100
    log, not current values."""
    import io

    from rl_tformers.runtime.progress import PlainProgress

    bar = PlainProgress(200, desc="train", unit="step", file=io.StringIO())
    bar.n = 100
    bar.set_postfix(loss="1.12", lr="1.00e-03")
    assert bar.line(bar._t0 + 10).endswith("loss=1.12, lr=1.00e-03")
    bar.n = 143
    assert bar.line(bar._t0 + 14).endswith("loss=1.12, lr=1.00e-03 (as of step 100)")


def test_collect_by_steps_prints_a_line_every_5_percent(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--steps 200 without a terminal: a line at every 10 steps (5%), however fast the rollout."""
    from rl_tformers.envs.collect import Behaviour, collect
    from rl_tformers.envs.policies import RandomPolicy

    env = gym.make("CartPole-v1")
    collect("CartPole-v1", [Behaviour(RandomPolicy(env.action_space, seed=0), steps=200)],
            dataset_id="t/cartpole/steps-v0", root=tmp_path, seed=0, progress=True)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("t/cartpole/steps-v0: ")]
    counts = [int(re.match(r"t/cartpole/steps-v0: (\d+)", ln).group(1)) for ln in lines]
    assert counts[:20] == list(range(10, 201, 10)) and lines[19].startswith("t/cartpole/steps-v0: 200/200 steps (100%)")
