"""Checkpoint directories that survive a crash: written aside, published atomically, marked
complete last.

``save_sharded(path)`` writes into ``<path>.shardamp-partial``; only when every rank finished,
rank 0 writes the completion marker (``shardamp-complete.json``: format, world size, checksum of
the metadata) into it, fsyncs, and swaps it in for ``path`` (``path`` -> ``<path>.shardamp-old``,
staging -> ``path``, old removed). A save killed at any point leaves the previous checkpoint at
``path`` untouched (or, between the two renames, complete at ``<path>.shardamp-old`` with the new
one complete next to it, which ``problem_for_load`` names). A directory without the marker is
never loaded. Every tensor piece carries a CRC32, checked when it is read.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any, Dict, Optional

import torch
from torch import Tensor

MARKER = "shardamp-complete.json"
STAGING = ".shardamp-partial"
OLD = ".shardamp-old"


def staging_dir(path: str) -> str:
    return path.rstrip(os.sep) + STAGING


def old_dir(path: str) -> str:
    return path.rstrip(os.sep) + OLD


def tensor_crc(t: Tensor) -> int:
    """CRC32 of a CPU tensor's bytes (any dtype)."""
    flat = t.detach().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def problem_for_save(path: str) -> str:
    """Why ``path`` must not be replaced by a checkpoint ('' if it may)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    if os.path.isdir(path) and os.listdir(path) and not is_complete(path):
        return (f"{path} exists, is not empty and holds no complete shardamp checkpoint ({MARKER} is missing); "
                "refusing to replace it. Save into a new or empty directory, or remove it.")
    return ""


def problem_for_load(path: str) -> str:
    """Why ``path`` cannot be loaded ('' if it holds a complete checkpoint)."""
    if is_complete(path):
        return ""
    staged, old = staging_dir(path), old_dir(path)
    if not os.path.exists(path):
        if is_complete(staged) and os.path.isdir(old):
            return (f"no checkpoint at {path}: a save_sharded was interrupted while publishing; the new, "
                    f"complete checkpoint is at {staged} and the previous one at {old}. Rename one of them to "
                    f"{path}.")
        return f"no checkpoint at {path}"
    return (f"{path} is a torn or incomplete checkpoint: it has no completion marker {MARKER} (a save_sharded "
            "that did not finish, or a directory not written by save_sharded); refusing to load it.")


def prepare(path: str) -> str:
    """Rank 0, before anyone writes: an empty staging directory; returns its path."""
    staged = staging_dir(path)
    shutil.rmtree(staged, ignore_errors=True)  # a crashed earlier save's leftovers
    os.makedirs(staged)
    return staged


def publish(path: str, marker: Dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its shard: marker last, then swap the directory in."""
    staged = staging_dir(path)
    marker_path = os.path.join(staged, MARKER)
    with open(marker_path + ".tmp", "w") as f:
        json.dump(marker, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker_path + ".tmp", marker_path)
    _fsync_dir(staged)
    old = old_dir(path)
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(staged, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staged, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_crc(name: str, t: Tensor, crcs: Dict[str, int]) -> Optional[str]:
    """A problem message if ``t`` (read as ``name``) does not match its recorded CRC32."""
    want = crcs.get(name)
    if want is None:
        return f"no checksum recorded for '{name}'"
    if tensor_crc(t) != want:
        return f"'{name}' does not match its checksum (the file is corrupted)"
    return None
