"""A change's effect on the frameworks' rows, measured on one machine: runs of
``bench_frameworks.py`` from a base tree and from this tree, taking turns (``gpu_session.sh``'s
``frameworks_base`` part makes them), compared run by run.

Each run's row is already its own default route against its shardamp route (a ratio, so a host
drifting between runs cancels out of it); run ``i`` of the tree is paired with run ``i`` of the
base, and the table gives the geometric mean of ``tree ratio / base ratio`` with its 95%
t-interval (above 1: the tree's shardamp route is faster against the same default), beside each
side's own ratio and shardamp ms.

    python benchmarks/frameworks_ab.py out/frameworks_base
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_iteration import paired_ratio  # noqa: E402

Key = Tuple[str, str, str]  # framework, model, precision


def load(root: Path) -> Dict[str, List[Dict[Key, dict]]]:
    """``{"base": [rows of run 1, ...], "tree": [...]}`` from ``root/<side>_<i>/bench_frameworks.json``."""
    runs: Dict[str, Dict[int, Dict[Key, dict]]] = {"base": {}, "tree": {}}
    for path in sorted(root.glob("*_*/bench_frameworks.json")):
        side, _, index = path.parent.name.partition("_")
        if side in runs and index.isdigit():
            rows = json.loads(path.read_text())["rows"]
            runs[side][int(index)] = {(r["framework"], r["model"], r["precision"]): r
                                      for r in rows if r.get("status") == "ok"}
    both = sorted(set(runs["base"]) & set(runs["tree"]))
    return {side: [runs[side][i] for i in both] for side in runs}


def table(runs: Dict[str, List[Dict[Key, dict]]]) -> str:
    lines = ["| framework | model | precision | runs | base: default / shardamp | tree: default / shardamp "
             "| shardamp ms base / tree | tree / base [95% t] |", "|---|---|---|---|---|---|---|---|"]
    keys = sorted(set().union(*runs["base"], *runs["tree"]))
    for key in keys:
        pairs = [(b[key], t[key]) for b, t in zip(runs["base"], runs["tree"]) if key in b and key in t]
        if not pairs:
            continue
        mean, lo, hi = paired_ratio([t["ratio"] for _, t in pairs], [b["ratio"] for b, _ in pairs])
        med = lambda side, field: statistics.median(p[side][field] for p in pairs)  # noqa: E731
        lines.append(f"| {' | '.join(key)} | {len(pairs)} | {med(0, 'ratio'):.3f}x | {med(1, 'ratio'):.3f}x "
                     f"| {med(0, 'shardamp_ms'):.2f} / {med(1, 'shardamp_ms'):.2f} | {mean:.3f} [{lo:.3f}-{hi:.3f}] |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="the folder holding base_<i>/ and tree_<i>/ runs of bench_frameworks.py")
    args = ap.parse_args()
    runs = load(Path(args.root))
    if not runs["base"]:
        sys.exit(f"frameworks_ab: no paired base_<i>/ and tree_<i>/ runs under {args.root}")
    print(table(runs))


if __name__ == "__main__":
    main()
