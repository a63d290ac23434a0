"""Tiny data files written by tests (imported as ``tests.datafiles``)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np


def write_cartpole_h5(path: Path, *, n: int = 30, seed: int = 0, reward: float = 1.0) -> Path:
    """CartPole-shaped D4RL file: episodes of 10 steps, every reward ``reward``."""
    rng = np.random.default_rng(seed)
    data = {
        "observations": (rng.normal(size=(n, 4)) * 0.05).astype(np.float32),
        "actions": rng.integers(0, 2, n).astype(np.int64),
        "rewards": np.full(n, reward, np.float32),
        "terminals": np.zeros(n, bool),
        "timeouts": np.zeros(n, bool),
    }
    data["terminals"][np.arange(9, n - 1, 10)] = True
    data["timeouts"][n - 1] = True
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
        f.attrs["env_id"] = "CartPole-v1"
    return path


def write_d4rl_h5(path: Path, *, n: int = 30, obs_dim: int = 4, env_id: str | None = "CartPole-v1",
                  discrete: bool = True, **override) -> Path:
    """A small D4RL-layout file: episodes of 10 steps (terminal, terminal, timeout); ``override``
    replaces whole arrays by key."""
    rng = np.random.default_rng(0)
    data = {
        "observations": (rng.normal(size=(n, obs_dim)) * 0.05).astype(np.float32),
        "actions": rng.integers(0, 2, n).astype(np.int64) if discrete
        else rng.uniform(-1, 1, (n, 1)).astype(np.float32),
        "rewards": np.ones(n, np.float32),
        "terminals": np.zeros(n, bool),
        "timeouts": np.zeros(n, bool),
    }
    data["terminals"][[9, 19]] = True
    data["timeouts"][n - 1] = True
    data.update(override)
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
        if env_id:
            f.attrs["env_id"] = env_id
    return path


def write_compressed_copy(src: Path, dst: Path, *, chunk_rows: int = 500) -> Path:
    """``src``'s datasets and attributes written again gzip-compressed, ``chunk_rows`` rows per chunk."""
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        for key in f:
            g.create_dataset(key, data=f[key][()], compression="gzip",
                             chunks=(min(chunk_rows, f[key].shape[0]),) + f[key].shape[1:])
        g.attrs.update(f.attrs)
    return dst


def flip_object_header(path: Path, key: str) -> Path:
    """Flip every bit of the first byte (the version) of the object header of ``key`` (a dataset
    path inside the file): h5py can then no longer open that dataset."""
    with h5py.File(path, "r") as f:
        addr = h5py.h5o.get_info(f[key].id).addr
    with open(path, "r+b") as fh:
        fh.seek(addr)
        byte = fh.read(1)[0]
        fh.seek(addr)
        fh.write(bytes([byte ^ 0xFF]))
    return path


def corrupt_chunk(path: Path, key: str, index: int = 0) -> Path:
    """Overwrite 16 bytes in the middle of chunk ``index`` of the compressed dataset ``key``
    (located with h5py's ``get_chunk_info``): its gzip filter then fails when it is read."""
    with h5py.File(path, "r") as f:
        info = f[key].id.get_chunk_info(index)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xff" * 16)
    return path
