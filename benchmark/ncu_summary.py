"""Summarise Nsight Compute output of benchmark/run_gpu_ncu_decode.sh into one small JSON (the .ncu-rep
files are MBs and stay out of git): warp-state stall reasons, issue rate, occupancy, memory throughput
from `ncu --page details` text, and, where a `--page source --csv` export exists, the INT2 loop's stall
samples by reason and its most stalled SASS instructions.

    python benchmark/ncu_summary.py OUTDIR [--out results/decode_ncu_stage1_<device>.json]
    python benchmark/ncu_summary.py OUTDIR/ncu --prefix write_ --segments   # run_gpu_ncu_write.sh

--segments (kernels without one hot loop, e.g. the write): instead of the loop, the SASS in runs of instructions
executed by the same number of warps (a branch of the kernel: the q, K or V programs), each with its instruction
count, stall samples and commonest opcodes.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import json
import os
import re

METRICS = [
    "Duration", "Issued Ipc Active", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
    "Active Warps Per Scheduler", "Eligible Warps Per Scheduler", "No Eligible", "Achieved Occupancy",
    "Theoretical Occupancy", "Registers Per Thread", "Block Limit Registers", "Block Limit Shared Mem",
    "Dynamic Shared Memory Per Block", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "L1/TEX Hit Rate",
    "Compute (SM) Throughput", "Elapsed Cycles", "SM Active Cycles", "SM Frequency",
]


def details(path):
    text = open(path).read()
    out = {}
    for name in METRICS:
        m = re.search(r"^\s*" + re.escape(name) + r"\s+(\S+)\s+([\d.,]+)\s*$", text, re.M)
        if m:
            out[f"{name} [{m.group(1)}]"] = float(m.group(2).replace(",", ""))
    stalls = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*Stall ([A-Za-z ]+?)\s+inst\s+([\d.]+)\s*$", text, re.M)}
    out["stall cycles per issued instruction"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return out


def source(path, top=15):
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    i_src, i_ex = hdr.index("Source"), hdr.index("Instructions Executed")
    i_all = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    ex = [int(r[i_ex] or 0) for r in data]
    # the INT2 loop: the rows around its MMAs (the most executed HMMAs) executed at least as often as they are.
    # (At batch 1 the splits' trip counts differ, so "the most executed instruction" alone can miss the loop.)
    mma = [i for i, r in enumerate(data) if "HMMA" in r[i_src]]
    hot = max(ex[i] for i in mma) if mma else max(ex)
    core = [i for i in mma if ex[i] == hot] or [ex.index(hot)]
    first, last = min(core), max(core)
    while first > 0 and ex[first - 1] >= hot:
        first -= 1
    while last + 1 < len(data) and ex[last + 1] >= hot:
        last += 1
    loop = data[first:last + 1]
    samples = [int(r[i_all] or 0) for r in data]
    total = max(sum(samples), 1)
    by_reason = collections.Counter()
    for r in loop:
        for i in reasons:
            by_reason[hdr[i]] += int(r[i] or 0)
    worst = sorted(loop, key=lambda r: -int(r[i_all] or 0))[:top]
    return {
        "samples_total": sum(samples),
        "int2_loop_instructions": len(loop),
        "int2_loop_samples": sum(samples[first:last + 1]),
        "samples_by_region": {"before_loop": round(sum(samples[:first]) / total, 4),
                              "int2_loop": round(sum(samples[first:last + 1]) / total, 4),
                              "after_loop": round(sum(samples[last + 1:]) / total, 4)},
        "int2_loop_samples_by_reason": dict(by_reason.most_common()),
        "most_stalled": [{"sass": r[i_src].strip(), "samples": int(r[i_all] or 0),
                          "reasons": {hdr[i]: int(r[i]) for i in reasons if r[i] not in ("", "0")}} for r in worst],
    }


def segments(path, min_samples=5):
    """Runs of SASS executed by the same number of warps, with their instructions, samples and top opcodes."""
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    i_src, i_ex = hdr.index("Source"), hdr.index("Instructions Executed")
    i_all = hdr.index("Warp Stall Sampling (All Samples)")
    out, start = [], 0
    for i in range(1, len(data) + 1):
        if i == len(data) or data[i][i_ex] != data[start][i_ex]:
            run = data[start:i]
            smp = sum(int(r[i_all] or 0) for r in run)
            if smp >= min_samples or len(run) > 40:
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", r[i_src].strip()).split()[0].split(".")[0]
                                          for r in run)
                out.append({"first": start, "instructions": len(run), "warps": int(data[start][i_ex] or 0),
                            "samples": smp, "opcodes": dict(ops.most_common(8))})
            start = i
    return {"samples_total": sum(int(r[i_all] or 0) for r in data), "instructions": len(data), "segments": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--out")
    ap.add_argument("--prefix", default="ncu_", help="file name prefix of the *_details.txt exports")
    ap.add_argument("--segments", action="store_true", help="SASS by runs of equal execution count (no loop)")
    args = ap.parse_args()
    res = {}
    for path in sorted(glob.glob(os.path.join(args.dir, f"{args.prefix}*_details.txt"))):
        tag = os.path.basename(path)[len(args.prefix):-len("_details.txt")]
        res[tag] = details(path)
        src = path.replace("_details.txt", "_sass.csv")
        if os.path.exists(src):
            res[tag]["source"] = segments(src) if args.segments else source(src)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
