"""A filesystem the Lightning integration must treat as remote, kept on this disk so that every
spawned rank sees the same files: ``shardamptest:///abs/path``. Its protocol is not ``file``, so
sharded checkpoints go through the staging + upload path (as for ``s3://``), and it has no
rename (``mv`` raises), so nothing may rely on one. Imported by the cases modules: each spawned
rank registers it."""
from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "shardamptest"


class RemoteOnDisk(LocalFileSystem):
    protocol = (PROTOCOL,)

    def mv(self, *args, **kwargs):
        raise NotImplementedError(f"{PROTOCOL}:// has no rename, as an object store")


fsspec.register_implementation(PROTOCOL, RemoteOnDisk, clobber=True)


def url(path: str) -> str:
    return f"{PROTOCOL}://{os.path.abspath(path)}"
