"""A perplexity text that no fit and no published table has used: the Python source of four standard-library modules
that calibration (data.CALIBRATION_MODULES: their docstrings) does not read, concatenated. Code, not prose: another
domain than both the calibration docstrings and the Language Reference the table is scored on.

    python benchmark/unseen_text.py text runs/unseen/stdlib_source.txt
    python -m sglang_oscar.eval.compare --stage ppl --out-dir runs/unseen --ppl-text runs/unseen/stdlib_source.txt \
        --methods bf16,int2_best   # runs/unseen/bundles: the table's bundles (copy or link runs/acc_full/bundles)
    python -m sglang_oscar.eval.compare --stage niah --out-dir runs/unseen --methods bf16,int2_best \
        --niah-lengths 4096 --niah-tasks niah_essay_single,niah_essay_multivalue --niah-per-task 16
    python benchmark/unseen_text.py summary runs/unseen --json benchmark/results/accuracy_unseen_cpu.json --note "..."
    # runs on another machine (the GPU's NIAH, --niah-answer whole): --python its version, --json ..._NVIDIA_H200.json

`summary` writes the paired PPL change per window (method against bf16 on the same windows) and the NIAH cells scored on
each method's own greedy answer, bf16 on the method's samples (niah_exact_summary.py).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

from sglang_oscar.data import CALIBRATION_MODULES
from sglang_oscar.eval.compare import ppl_delta_windows

sys.path.insert(0, str(Path(__file__).parent))
from niah_exact_summary import read_runs, summarise  # noqa: E402

MODULES = ("configparser", "optparse", "pickletools", "mailbox")


def unseen_source() -> str:
    overlap = set(MODULES) & set(CALIBRATION_MODULES)
    if overlap:
        raise RuntimeError(f"{sorted(overlap)} are calibration modules")
    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)


def ppl_deltas(ppl: dict) -> dict:
    """{method: {length: dict(ppl, bf16, delta_pct (mean), delta_pct_windows)}} from compare's ppl.json."""
    bf = ppl["bf16"]["ppl"]
    out = {}
    for name, r in ppl.items():
        if name == "bf16":
            continue
        out[name] = {}
        for L, cell in r["ppl"].items():
            d = ppl_delta_windows(ppl, name, L)
            out[name][L] = dict(ppl=round(cell["mean"], 4), bf16=round(bf[L]["mean"], 4),
                                delta_pct=round(sum(d) / len(d), 2), delta_pct_windows=[round(x, 2) for x in d])
    return out


def main(argv: list[str]) -> int:
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("text", help="write the unseen text")
    t.add_argument("out", type=Path)
    s = sub.add_parser("summary", help="PPL and NIAH of a run on unseen data as one JSON")
    s.add_argument("dir", type=Path, help="--out-dir of the compare runs (ppl.json, niah*.json)")
    s.add_argument("--json", type=Path, required=True)
    s.add_argument("--note", required=True, help="device, commit, commands")
    s.add_argument("--python", default=sys.version.split()[0],
                   help="the Python of the machine that ran (its stdlib is the text and the essay haystack); default: this one")
    args = ap.parse_args(argv)
    if args.cmd == "text":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        text = unseen_source()
        args.out.write_text(text, encoding="utf-8")
        print(f"{args.out}: {len(text)} characters from {', '.join(MODULES)} (Python {sys.version.split()[0]})")
        return 0
    ppl_file, niah_files = args.dir / "ppl.json", sorted(args.dir.glob("niah*.json"))
    if not ppl_file.is_file() and not niah_files:
        raise SystemExit(f"no ppl.json or niah*.json in {args.dir}")
    doc = dict(date=time.strftime("%Y-%m-%d"), note=args.note, python=args.python)
    if ppl_file.is_file():
        ppl = json.loads(ppl_file.read_text())
        doc["ppl"] = dict(text=next(iter(ppl.values())).get("text"), modules=list(MODULES), cells=ppl_deltas(ppl))
    if niah_files:
        cells, rule = read_runs(niah_files)
        doc["niah"] = dict(files=[f.name for f in niah_files], answer_rule=rule, cells=summarise(cells))
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
