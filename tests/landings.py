"""Counting the one-process merged landings (test_fused_step.py, test_step_ops.py): those the native
stager makes in its hook under a landing plan (``set_plan`` or ``prearm``, then ``finish_plan`` or
``end_quiet``: no Python call at the landing, so they are counted when Python adopts them)."""
from __future__ import annotations

from collections import Counter
from typing import Any, List, Optional


class PlannedLandings:
    """Stands in for ``sync.landings.stager`` (the hooks keep calling the native stager itself): counts
    each landing a plan made as ``calls["planned"]`` and appends its assign flag to
    ``assigned`` (the plan's first landing assigns the shared partial row where the plan said so)."""

    def __init__(self, stager: Any, calls: Counter, assigned: Optional[List[bool]] = None) -> None:
        self._stager, self._calls, self._assigned = stager, calls, assigned
        self._assign = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stager, name)

    def set_plan(self, next_bucket: int, assign: bool, entries: list) -> None:
        self._assign = assign
        self._stager.set_plan(next_bucket, assign, entries)

    def prearm(self, flags: Any) -> None:
        self._assign = True  # a plan set at zero_grad starts at the round's first bucket: it assigns
        self._stager.prearm(flags)

    def finish_plan(self):
        landed, error = self._stager.finish_plan()
        self._count(landed)
        return landed, error

    def end_quiet(self):  # a quietly begun backward's end: its plan finished as finish_plan's
        began, landed, error, complete = self._stager.end_quiet()
        self._count(landed)
        return began, landed, error, complete

    def _count(self, landed: list) -> None:
        for k, _ in enumerate(landed):
            self._calls["planned"] += 1
            if self._assigned is not None:
                self._assigned.append(self._assign and k == 0)
        if landed:
            self._assign = False


def count_landings(sync: Any, calls: Counter, assigned: Optional[List[bool]] = None) -> None:
    """Count ``sync``'s merged landings (the hook's, under a plan) into ``calls["planned"]`` and
    their assign flags into ``assigned``, in landing order."""
    landings = sync.landings
    if hasattr(landings.stager, "set_plan"):
        landings.stager = PlannedLandings(landings.stager, calls, assigned)
