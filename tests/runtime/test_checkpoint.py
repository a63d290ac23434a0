"""Checkpoint files: atomic writes, integrity, safe loading, pruning, fallback to an older one."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    CheckpointFormatError,
    atomic_write,
    content_digest,
    find_latest_valid,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_temporaries,
    save_checkpoint,
)


def state(step: int, **extra) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"w": torch.randn(64, 64, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "scheduler": {"last_epoch": step, "_step_count": step + 1},
        "rng": {"python": (3, tuple(range(5)), None)},
        "extra": dict(extra),
        "trainer": {"window": {"count": 0}},
        "config": "seed: 0\n",
    }


def test_round_trip_with_weights_only(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, state(7, obs_mean=torch.ones(3), scale=2.5))
    assert path == tmp_path / "checkpoints" / "step_000000007.pt"
    raw = torch.load(path, weights_only=True)  # a plain torch file: loadable without our code
    assert raw["format"] == "rl-tformers-checkpoint" and raw["sha256"] == content_digest(raw)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and loaded["extra"]["scale"] == 2.5
    assert torch.equal(loaded["model"]["w"], state(7)["model"]["w"])
    assert loaded["model"]["b"].dtype == torch.bfloat16
    assert loaded["rng"]["python"] == (3, (0, 1, 2, 3, 4), None)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]  # no temp left


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, state(1))
    data = bytearray(path.read_bytes())
    w = state(1)["model"]["w"].numpy().tobytes()
    offset = bytes(data).find(w[:64])  # inside the tensor payload, which torch itself never checks
    assert offset > 0
    data[offset + 1000] ^= 0x01
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # torch alone does not notice ...
    with pytest.raises(CheckpointError, match=r"step_000000001\.pt: content does not match its SHA-256"):
        load_checkpoint(path)  # ... the digest does


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, state(1))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"step_000000001\.pt: cannot be loaded"):
        load_checkpoint(path)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch EXPLOITED",))


def test_loading_cannot_run_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "checkpoints"
    d.mkdir()
    torch.save({"format": "rl-tformers-checkpoint", "payload": _Exploit()}, d / "step_000000005.pt")
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_checkpoint(d / "step_000000005.pt")
    assert not (tmp_path / "EXPLOITED").exists()


def test_values_that_cannot_be_loaded_are_refused_at_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"checkpoint\.extra\.obs_mean has type ndarray"):
        save_checkpoint(tmp_path, state(1, obs_mean=np.zeros(3)))
    assert list_checkpoints(tmp_path) == []


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for s in (5, 10, 15, 20):
        save_checkpoint(tmp_path, state(s), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 15]
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_000000015.pt"]


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def fail(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_find_latest_valid_skips_and_names_bad_files(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        save_checkpoint(tmp_path, state(s))
    p30 = tmp_path / "checkpoints" / "step_000000030.pt"
    p20 = tmp_path / "checkpoints" / "step_000000020.pt"
    p30.write_bytes(p30.read_bytes()[: p30.stat().st_size // 2])
    p20.write_bytes(b"garbage")
    (tmp_path / "checkpoints" / ".step_000000040.pt.tmp-123").write_bytes(b"half a save")
    with pytest.warns(UserWarning) as rec:
        found = find_latest_valid(tmp_path)  # default: read-only
    assert found.state["step"] == 10 and [p for p, _ in found.skipped] == [p30, p20]
    assert "step_000000030.pt" in str(rec[0].message) and "step_000000020.pt" in str(rec[1].message)
    assert p30.exists()
    with pytest.warns(UserWarning) as rec:
        find_latest_valid(tmp_path, quarantine=True)
    assert [str(w.message).endswith(f"(moved to step_0000000{s}.pt.corrupt)") for w, s in zip(rec, (30, 20))] == [
        True, True]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".step_000000040.pt.tmp-123"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_latest_valid(tmp_path).path.name == "step_000000010.pt"


def test_no_valid_checkpoint_lists_reasons(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_latest_valid(tmp_path)
    save_checkpoint(tmp_path, state(3))
    p = tmp_path / "checkpoints" / "step_000000003.pt"
    p.write_bytes(b"x")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"(?s)no valid checkpoint.*step_000000003\.pt"):
        find_latest_valid(tmp_path)


def test_empty_and_non_contiguous_tensors_are_hashed_and_saved(tmp_path: Path) -> None:
    """An agent's extra/process state may hold tensors of any strides: an empty one with stride 0
    (``torch.from_numpy`` of an empty NumPy fancy index: Online DT's buffer once no offline episode
    is left), a transpose, an ``expand``. Each hashes like its row-major
    copy, and saves and loads back."""
    odd = {
        "empty_stride0": torch.from_numpy(np.zeros(5)[np.zeros(0, np.int64)]),
        "empty_2d": torch.zeros(0, 3).t(),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "expanded": torch.tensor(2.5).expand(1),  # shape (1,), stride 0: "contiguous", yet no byte view
        "broadcast": torch.arange(3).expand(2, 3),
        "sliced": torch.arange(10)[::3],
        "flags": torch.tensor([True, False, True])[::2],
    }
    assert odd["empty_stride0"].stride() == (0,) and odd["expanded"].stride() == (0,)
    copies = {k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in odd.items()}
    assert content_digest(state(1, **odd)) == content_digest(state(1, **copies))
    assert content_digest(state(1, **odd)) != content_digest(state(1, **{**copies, "sliced": copies["sliced"] + 1}))
    assert content_digest(state(1, **odd)) != content_digest(state(1, **{**copies, "empty_2d": torch.zeros(0, 4)}))
    loaded = load_checkpoint(save_checkpoint(tmp_path, state(4, **odd)))
    for k, v in odd.items():
        assert loaded["extra"][k].dtype == v.dtype and torch.equal(loaded["extra"][k], v), k


def saved_by_another_build(run_dir: Path, version: int | None) -> Path:
    """A run directory whose one checkpoint has format ``version`` (``None``: no version field),
    otherwise sound: its SHA-256 matches, so only the version can be refused."""
    save_checkpoint(run_dir, state(5))
    path = run_dir / "checkpoints" / "step_000000005.pt"
    old = torch.load(path, weights_only=True)
    old["config"] = "seed: 0\nagent:\n  kind: dt\n"  # no cpu_matmul, plugins...: keys this build writes
    if version is None:
        del old["version"]
    else:
        old["version"] = version
    del old["sha256"]
    old["sha256"] = content_digest(old)
    torch.save(old, path)
    (run_dir / "config.yaml").write_text(old["config"])
    return path


@pytest.mark.parametrize(("version", "has"), [(1, "format version 1"), (None, "no format version")])
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path: Path, version, has) -> None:
    path = saved_by_another_build(tmp_path, version)
    expected = (f"{path}: checkpoint {has}; this build of rl-tformers reads format version 2 only "
                f"(the run was saved by another build; train it again with this one)")
    assert FORMAT_VERSION == 2
    with pytest.raises(CheckpointFormatError) as exc:
        load_checkpoint(path)
    assert str(exc.value) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not skipped with a warning, and not moved aside
        with pytest.raises(CheckpointFormatError) as exc:
            find_latest_valid(tmp_path, quarantine=True)
    assert str(exc.value) == expected and path.is_file()


def test_the_format_version_is_written_into_every_checkpoint(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, state(2))
    raw = torch.load(path, weights_only=True)
    assert (raw["format"], raw["version"]) == (FORMAT, 2)


@pytest.mark.parametrize("command", [["eval", "{run}"], ["plot", "{run}", "--out", "{run}/p.png"],
                                     ["train", "--resume", "{run}"]])
def test_the_cli_refuses_a_run_of_another_format_version_with_exit_code_2(tmp_path: Path, command) -> None:
    run = tmp_path / "run"
    path = saved_by_another_build(run, 1)
    res = CliRunner().invoke(app, [a.format(run=run) for a in command])
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: {path}: checkpoint format version 1; this build of rl-tformers reads format "
                          f"version 2 only (the run was saved by another build; train it again with this one)\n")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000000005.pt"]


def test_all_corrupt_checkpoints_name_each_file_once(tmp_path: Path) -> None:
    from rl_tformers.runtime.checkpoint import CheckpointError, checkpoint_dir, find_latest_valid

    d = checkpoint_dir(tmp_path / "run")
    d.mkdir(parents=True)
    bad = d / "step_000000008.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as info:
        find_latest_valid(tmp_path / "run")
    lines = str(info.value).splitlines()
    assert lines[0] == f"no valid checkpoint in {d}:"
    assert lines[1].startswith(f"  {bad}: cannot be loaded") and lines[1].count(str(bad)) == 1
