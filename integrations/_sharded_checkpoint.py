"""Optimizer shards beside a checkpoint file: the ``sharded_checkpoint=True`` format of
shardamp's Lightning strategies (Trainer and Fabric alike).

Each rank writes its own shard through ``shardamp.optim.save_sharded`` into the directory
``<checkpoint file><suffix>`` (e.g. ``step=2.ckpt.optim0``), and the checkpoint file stores, in
the optimizer's place, ``{DCP_KEY: "<that directory's name>"}``: a name RELATIVE to the
checkpoint file's directory, so a checkpoint directory can be moved, copied or synced elsewhere
and still load. Checkpoints written before stored an absolute local path; they still load (from
that path, or, if it is gone, from the directory of the same name beside the checkpoint file).

Paths may be fsspec URLs:

* the local disk (plain paths, ``file://``): ``save_sharded`` writes in place, crash-safe (a
  staging directory swapped in by rename, the completion marker written last);
* any other filesystem (``s3://``, ``gs://``, ``memory://`` ...): ``save_sharded`` writes to a
  local staging directory (made by rank 0 under ``staging_dir``, default the temp dir, which
  every rank must see: one node, or a shared filesystem), then rank 0 uploads it, the
  completion marker LAST (object stores have no atomic rename: a directory without the marker is
  never loaded; an existing one loses its marker first). Loading is the reverse: rank 0
  downloads, every rank reads its pieces from the local copy. Only rank 0 touches the URL.

``save_sharded``/``load_sharded`` themselves take local paths only (DCP's FileSystemWriter, the
atomic rename): writing straight to object storage from every rank would need them to take
fsspec URLs (``torch.distributed.checkpoint``'s ``FsspecWriter``/``FsspecReader``, a
marker-last publish without rename), a change in ``shardamp.optim``.
"""
from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from typing import Any, Dict, Optional, Protocol, Tuple

from shardamp.optim import DistributedFusedAdam, load_sharded, save_sharded

DCP_KEY = "shardamp_dcp_dir"
# The file save_sharded writes last into a finished checkpoint (shardamp.optim.atomic_publish.MARKER,
# part of the on-disk format): uploaded last here, and required before a download is loaded.
MARKER = "shardamp-complete.json"


class Ranks(Protocol):
    """What the strategies lend for the collective parts (both Lightning's and Fabric's have it)."""

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...


def is_reference(state: Any) -> bool:
    """Whether an optimizer entry of a checkpoint refers to shards instead of holding the state."""
    return isinstance(state, dict) and DCP_KEY in state


def save(opt: DistributedFusedAdam, checkpoint_path: Any, suffix: str, ranks: Ranks,
         staging_dir: Optional[str] = None) -> Dict[str, str]:
    """Write ``opt``'s shards to ``<checkpoint_path><suffix>`` (every rank calls it: a collective)
    and return the entry the checkpoint stores in the optimizer's place.

    Raises:
        RuntimeError: on every rank alike, if rank 0's staging directory (non-local URLs) is not
            visible on every rank or the upload failed.
        ValueError: as ``save_sharded`` (invalid state, a path holding something else).
    """
    fs, path, local = _split(checkpoint_path)
    target = path + suffix
    name = posixpath.basename(target)
    if local:
        save_sharded(opt, target)
        return {DCP_KEY: name}
    url = fs.unstrip_protocol(target)
    stage = _stage(ranks, staging_dir, url)
    try:
        save_sharded(opt, os.path.join(stage, name))
        error = ""
        if ranks.is_global_zero:
            try:
                _upload(os.path.join(stage, name), fs, target)
            except Exception as exc:  # noqa: BLE001  (every rank raises it below)
                error = f"uploading the optimizer shards to {url} failed: {type(exc).__name__}: {exc}"
        error = ranks.broadcast(error, src=0)
        if error:
            raise RuntimeError(error)
    finally:
        if ranks.is_global_zero:
            shutil.rmtree(stage, ignore_errors=True)
    return {DCP_KEY: name}


def resolve(entry: Dict[str, Any], checkpoint_path: Any) -> str:
    """Where the shards an entry refers to are: a local path or a URL.

    A relative name (this format) is taken beside ``checkpoint_path``; an absolute path (the
    format before) as it is, unless it no longer exists and the checkpoint is local, then the
    directory of the same name beside the checkpoint file (the checkpoints were moved).

    Raises:
        ValueError: if the stored name is not a plain directory name.
    """
    ref = os.fspath(entry[DCP_KEY])
    fs, path, local = _split(checkpoint_path)
    parent = posixpath.dirname(path)
    if os.path.isabs(ref) or "://" in ref:
        if not local or os.path.isdir(ref):
            return ref
        moved = os.path.join(parent, os.path.basename(ref.rstrip("/")))
        return moved if os.path.isdir(moved) else ref
    if "/" in ref or "\\" in ref or ref in ("", ".", ".."):
        raise ValueError(f"{checkpoint_path}: optimizer entry {DCP_KEY}={ref!r} is not the name of a directory "
                         "beside the checkpoint file; the checkpoint was not written by shardamp's strategies")
    sibling = posixpath.join(parent, ref)
    return sibling if local else fs.unstrip_protocol(sibling)


def load(opt: DistributedFusedAdam, location: str, ranks: Ranks, staging_dir: Optional[str] = None) -> None:
    """Load the shards at ``location`` (from :func:`resolve`) into ``opt``: a collective.

    Raises:
        ValueError: as ``load_sharded`` (no or an incomplete checkpoint, a mismatch); for a URL
            without a completion marker, on every rank alike.
        RuntimeError: if rank 0's staging directory is not visible on every rank.
    """
    fs, path, local = _split(location)
    if local:
        load_sharded(opt, path)
        return
    stage = _stage(ranks, staging_dir, location)
    try:
        name = posixpath.basename(path.rstrip("/"))
        problem = ""
        if ranks.is_global_zero:
            try:
                problem = _download(fs, path, os.path.join(stage, name))
            except Exception as exc:  # noqa: BLE001  (every rank raises it below)
                problem = f"downloading {location} failed: {type(exc).__name__}: {exc}"
        problem = ranks.broadcast(problem, src=0)
        if problem:
            raise ValueError(problem)
        load_sharded(opt, os.path.join(stage, name))
        ranks.reduce_boolean_decision(True, all=True)  # every rank has read its pieces before rank 0 removes them
    finally:
        if ranks.is_global_zero:
            shutil.rmtree(stage, ignore_errors=True)


def remove(checkpoint_path: Any, suffix: str) -> None:
    """Remove ``<checkpoint_path><suffix>`` if it exists (one rank calls it); the marker goes first."""
    fs, path, local = _split(checkpoint_path)
    target = path + suffix
    if local:
        if os.path.isfile(os.path.join(target, MARKER)):
            os.remove(os.path.join(target, MARKER))
        shutil.rmtree(target, ignore_errors=True)
    elif fs.exists(target):
        _remove_remote(fs, target)


# ====================================================================== internals
def _split(url: Any) -> Tuple[Any, str, bool]:
    """``(filesystem, path in it, whether it is the local disk)`` for a path or fsspec URL."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(os.fspath(url))
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return fs, path.rstrip("/"), bool(protocols & {"file", "local"})


def _stage(ranks: Ranks, staging_dir: Optional[str], url: str) -> str:
    """A fresh local directory made by rank 0 that every rank sees; RuntimeError on every rank if not."""
    stage, problem = "", ""
    if ranks.is_global_zero:
        try:
            stage = tempfile.mkdtemp(prefix="shardamp-stage-", dir=staging_dir)
        except OSError as exc:
            problem = f"cannot create a staging directory under staging_dir={staging_dir!r}: {exc}"
    stage, problem = ranks.broadcast((stage, problem), src=0)
    if not ranks.reduce_boolean_decision(not problem and _visible(stage), all=True):
        if ranks.is_global_zero and stage:
            shutil.rmtree(stage, ignore_errors=True)
        raise RuntimeError(
            f"sharded checkpoint at {url}: {problem or f'the staging directory {stage} rank 0 made is not visible on every rank'}. "
            "Shards for a non-local URL are written to a local staging directory every rank must see, then uploaded "
            "by rank 0: pass staging_dir= a directory on a filesystem all ranks share (or save to a shared local path)."
        )
    return stage


def _visible(path: str) -> bool:
    return os.path.isdir(path)


def _upload(local_dir: str, fs: Any, target: str) -> None:
    if fs.exists(target):
        _remove_remote(fs, target)  # a torn overwrite must not look complete
    files = []
    for root, _dirs, names in os.walk(local_dir):
        files += [os.path.relpath(os.path.join(root, n), local_dir) for n in names]
    files.sort(key=lambda rel: (rel == MARKER, rel))  # the completion marker last
    if MARKER not in files:
        raise RuntimeError(f"{local_dir} holds no {MARKER}: save_sharded did not finish")
    fs.makedirs(target, exist_ok=True)
    for rel in files:
        remote = posixpath.join(target, *rel.split(os.sep))
        fs.makedirs(posixpath.dirname(remote), exist_ok=True)
        fs.put_file(os.path.join(local_dir, rel), remote)


def _download(fs: Any, source: str, local_dir: str) -> str:
    """Copy ``source`` into ``local_dir``; returns a problem ('' if none)."""
    if not fs.exists(posixpath.join(source, MARKER)):
        where = fs.unstrip_protocol(source)
        if not fs.exists(source):
            return f"no sharded optimizer checkpoint at {where}"
        return (f"{where} holds no complete sharded optimizer checkpoint ({MARKER} is missing: an upload that "
                "did not finish); refusing to load it")
    files = sorted(f for f in fs.find(source) if posixpath.basename(f) != MARKER) + [posixpath.join(source, MARKER)]
    for remote in files:
        local = os.path.join(local_dir, *posixpath.relpath(remote, source).split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs.get_file(remote, local)
    return ""


def _remove_remote(fs: Any, target: str) -> None:
    marker = posixpath.join(target, MARKER)
    if fs.exists(marker):
        fs.rm(marker)
    fs.rm(target, recursive=True)
