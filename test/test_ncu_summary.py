"""benchmark/ncu_summary.py --segments on a small synthetic `ncu --page source --csv` export."""

from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import ncu_summary  # noqa: E402


def test_segments_split_by_execution_count(tmp_path):
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    rows = ([["0x0", "LDC R1, c[0x0][0x28]", "7", "96"]]
            + [[hex(16 * i), "FFMA R2, R3, R4, RZ", "1", "32"] for i in range(1, 45)]
            + [[hex(16 * i), "@P0 SHFL.BFLY PT, R7, R0, 0x2, 0x1f", "2", "8"] for i in range(45, 48)]
            + [[hex(16 * i), "EXIT", "0", "0"] for i in range(48, 50)])
    path = tmp_path / "write_x_sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_k"])
        w.writerow(hdr)
        w.writerows(rows)
    res = ncu_summary.segments(str(path))
    assert res["samples_total"] == 7 + 44 + 6 and res["instructions"] == 50
    segs = {s["first"]: s for s in res["segments"]}
    # the 1-instruction run (7 samples) and the 44-instruction run are kept; the 3-instruction run (6 samples) too;
    # the EXIT run has neither samples nor length
    assert sorted(segs) == [0, 1, 45]
    assert segs[1] == {"first": 1, "instructions": 44, "warps": 32, "samples": 44, "opcodes": {"FFMA": 44}}
    assert segs[45]["opcodes"] == {"SHFL": 3} and segs[45]["warps"] == 8
