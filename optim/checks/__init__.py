"""Ranks that disagree and misuse: construction-time and per-step agreement (``agreement.py``),
host reads of per-step device flags without a sync (``deferred.py``), misuse that would train
silently wrong (``misuse.py``)."""
