"""Summarise a same-call A/B of a benchmark between an older tree and this one (benchmark/run_gpu_ab.sh).

Input: a directory with one subdirectory per run, named old_<round> / new_<round>, each holding the result JSONs that
the benchmark wrote ({"rows": [...]} with a time per row in "ms" or "us"). Rows are matched by their point (impl, model,
context, batch, where present). Per point: the median time of each tree over its rounds, the ratio new / old, and the
spread of each tree (max / min over rounds). A point is flagged where the ratio is further from 1 than both trees'
spreads: an effect larger than the run-to-run noise that the interleaved rounds show.

    python benchmark/ab_summary.py OUT/ab [--out OUT/ab_summary.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

POINT_KEYS = ("impl", "model", "context", "batch")


def _time_us(row: dict) -> float:
    if "us" in row:
        return float(row["us"])
    if "ms" in row:
        return 1e3 * float(row["ms"])
    raise ValueError(f"a row without 'us' or 'ms': {sorted(row)}")


def load_runs(root: str) -> dict:
    """{(tree, round): {point: us}} from root/<tree>_<round>/*.json."""
    runs = {}
    for d in sorted(glob.glob(os.path.join(root, "*_*"))):
        m = re.fullmatch(r"(old|new)_(\d+)", os.path.basename(d))
        if not m or not os.path.isdir(d):
            continue
        points = {}
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            for row in json.load(open(path)).get("rows", []):
                point = tuple(row.get(k) for k in POINT_KEYS)
                if point in points:
                    raise ValueError(f"{path}: point {point} appears twice in one run")
                points[point] = _time_us(row)
        runs[(m.group(1), int(m.group(2)))] = points
    if not any(t == "old" for t, _ in runs) or not any(t == "new" for t, _ in runs):
        raise ValueError(f"{root}: needs old_<n> and new_<n> run directories with result JSONs")
    return runs


def summarise(runs: dict) -> list:
    """One row per point measured by both trees, in the points' first-seen order."""
    order = []
    for pts in runs.values():
        order += [p for p in pts if p not in order]
    out = []
    for point in order:
        per = {tree: [pts[point] for (t, _), pts in sorted(runs.items()) if t == tree and point in pts]
               for tree in ("old", "new")}
        if not per["old"] or not per["new"]:
            continue
        old, new = statistics.median(per["old"]), statistics.median(per["new"])
        ratio = new / old
        spread = {t: max(v) / min(v) for t, v in per.items()}
        noise = max(spread.values())
        row = dict(zip(POINT_KEYS, point))
        row.update(old_us=old, new_us=new, ratio=ratio, old_spread=spread["old"], new_spread=spread["new"],
                   rounds=min(len(per["old"]), len(per["new"])),
                   flag=("slower" if ratio > noise else "faster" if ratio < 1 / noise else ""))
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = summarise(load_runs(args.root))
    print("| impl | model | context | batch | old us | new us | new / old | spread old / new | |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['model']} | {r['context']} | {r['batch']} | {r['old_us']:.2f} | {r['new_us']:.2f} | "
              f"{r['ratio']:.3f} | {r['old_spread']:.3f} / {r['new_spread']:.3f} | {r['flag']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
