"""One trainer per run directory: an exclusive ``fcntl.flock`` on ``RUN_DIR/.train.lock``.

``rl-tformers train`` (new run or ``--resume``) holds the lock for as long as it trains; a second
trainer on the same directory (another ``--resume``, a rerun sweep...) is refused with
``RUN_DIR is being trained by pid N`` instead of writing the same checkpoints and logs twice.
Under DDP only rank 0 takes it (before the ranks touch the directory). The operating system
releases a ``flock`` when its process exits, however it exits (crash, ``kill -9``), so a stale
lock file never blocks a later resume. The file stays in the run directory (removing it would
let two processes lock two different files of the same name); it holds the owner's pid.

Why ``flock`` (POSIX, Linux and macOS): released by the kernel on exit, unlike a pid file, and
no extra dependency. On network file systems without ``flock`` support the call raises and the
error says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".train.lock"


class RunBusyError(FileExistsError):
    """Another process is training this run directory (``pid``: its process id, if known)."""

    def __init__(self, run_dir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"{run_dir} is being trained by {who}; wait for it to finish or stop it "
                         f"(Ctrl-C / SIGTERM saves a checkpoint), then resume with: rl-tformers train --resume {run_dir}")
        self.run_dir, self.pid = run_dir, pid


def directory_problem(path: str | os.PathLike, option: str = "--run-dir") -> str | None:
    """Why ``path`` cannot be (or become) a directory, or None: it, or a folder above it, is an
    existing file (or something else that is not a directory). Creates nothing."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            if p.is_dir():
                return None
            what = "is a file" if p.is_file() else "exists and is not a directory"
            where = f"{p} {what}" if p == path else f"{p} (a folder above it) {what}"
            return f"{option} {path}: {where}; pick another {option}"
    return None


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or "x")
    except (OSError, ValueError):
        return None


def lock_holder(run_dir: str | os.PathLike) -> int | None:
    """The pid training ``run_dir`` now (0 if the holder's pid is unknown), or None if nobody is.

    Probes the lock without waiting (takes and releases it at once); creates nothing.
    """
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(path) or 0
    finally:
        os.close(fd)  # also releases the probe's lock
    return None


@contextlib.contextmanager
def hold_run(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold the exclusive training lock of ``run_dir`` (created if needed) for the ``with`` body.

    A directory created here that holds nothing but the lock file when the body ends (the run
    was refused before writing anything) is removed again, with the empty parents created for it.

    Raises:
        RunBusyError: another process holds the lock; the message names its pid.
        OSError: the lock file cannot be created or locked (e.g. a file system without flock).
    """
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    # the parents this call creates too (e.g. runs/ on a first run), removed again with run_dir
    new_parents = [d for d in run_dir.parents if not d.exists()] if created else []
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunBusyError(run_dir, _read_pid(path)) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield run_dir
        finally:
            if created and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
                path.unlink()
                run_dir.rmdir()
                for d in new_parents:  # innermost first; stop at one that gained other entries
                    try:
                        d.rmdir()
                    except OSError:
                        break
    finally:
        os.close(fd)  # releases the lock


__all__ = ["LOCK_FILE", "RunBusyError", "directory_problem", "hold_run", "lock_holder"]
