"""The fenced ```python blocks of README.md and docs/*.md, and how each one runs.

Every block is a complete program. The HTML comment on the line right before its fence (a blank
line may separate them) says how it runs:

* none: as a script, in a fresh Python process (its own working directory, the CPU unless it
  picks ``cuda`` itself where one is visible);
* ``<!-- snippet: 2 ranks -->``: as the script of each of 2 gloo CPU ranks, spawned through
  ``dist_helper.run_distributed`` (the ranks are what ``torchrun --nproc-per-node 2`` would
  start: ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set, and the block's own
  ``dist.init_process_group(...)`` joins the group the helper already made);
* ``<!-- snippet: gpu -->``: needs a CUDA GPU; runs as a script where one is visible, else skipped;
* ``<!-- snippet: fragment -->``: a deliberate fragment (a signature, one call out of a larger
  loop shown whole elsewhere): never run. Keep these rare.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
MODES = ("script", "2 ranks", "gpu", "fragment")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(.+?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    mode: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def sources() -> List[Path]:
    """README.md and every Markdown page of the docs site."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def extract(path: Path) -> List[Snippet]:
    """The ```python blocks of one Markdown file, with the mode their marker gives."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: List[Snippet] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body: List[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang not in ("python", "py"):
            continue
        out.append(Snippet(path, start + 1, _mode(lines, start, path), "\n".join(body) + "\n"))
    return out


def _mode(lines: List[str], fence: int, path: Path) -> str:
    j = fence - 1
    if j >= 0 and not lines[j].strip():
        j -= 1
    m = _MARKER.match(lines[j].strip()) if j >= 0 else None
    if m is None:
        return "script"
    mode = m.group(1)
    if mode not in MODES[1:]:
        raise ValueError(f"{path}:{fence + 1}: unknown snippet marker {mode!r}; expected one of {MODES[1:]}")
    return mode


def all_snippets() -> List[Snippet]:
    return [s for path in sources() for s in extract(path)]


def run_on_rank(rank: int, world_size: int, code: str, workdir: str) -> None:
    """One rank of a ``2 ranks`` block (called by dist_helper in each spawned process, whose
    gloo group is already initialised): run the block as that rank's ``__main__``."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.chdir(workdir)
    init = dist.init_process_group

    def join_existing(*args, **kwargs):  # the block's own init: the helper's group stands for it
        if not dist.is_initialized():
            init(*args, **kwargs)

    dist.init_process_group = join_existing
    try:
        exec(compile(code, f"<snippet rank {rank}>", "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group = init
