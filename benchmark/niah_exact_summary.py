"""NIAH cells scored on each method's own greedy answer (eval/niah.score_niah), from niah*.json files that cover
parts of a cell (GPU and CPU runs of sample ranges), as the section `niah_exact_greedy` of the accuracy JSON and a
markdown table.

Per (task, length, method): the samples it ran, its score and bf16's score on exactly those samples, and the ratio.
Ranges of one (method, task, length) must not overlap.

    python benchmark/niah_exact_summary.py runs/acc_exact --json benchmark/results/accuracy_smollm2.json \
        --note "device, commit, command"
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sglang_oscar.eval.compare import merge_niah, paired_niah


def read_runs(files: list[Path]) -> tuple[dict, str]:
    """({(method, length, task): {sample index: score}}, the answer rule) over every file, read once
    (eval/compare.merge_niah: ranges joined, overlaps refused); files of different answer rules are refused."""
    try:
        niah = merge_niah([json.loads(f.read_text()) for f in files])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rules = {r["answer"] for by_len in niah.values() for by_task in by_len.values() for r in by_task.values()}
    if len(rules) > 1:
        raise SystemExit(f"the files mix answer rules {sorted(rules)}: summarise the runs of one rule")
    cells = {(name, L, task): dict(zip(r["samples"], r["per_sample"]))
             for name, by_len in niah.items() for L, by_task in by_len.items() for task, r in by_task.items()}
    return cells, rules.pop()


def summarise(cells: dict) -> dict:
    """{task: {length: {method: compare.paired_niah cell}}}: n, score, bf16's score on the method's own samples, %
    of bf16 and diff_se (the standard error of the paired per-sample difference, the cell's spread)."""
    out: dict = {}
    for (name, L, task), by_i in sorted(cells.items(), key=lambda kv: (kv[0][2], int(kv[0][1]), kv[0][0])):
        try:
            cell = paired_niah(by_i, cells.get(("bf16", L, task), {}))
        except ValueError as e:
            raise SystemExit(f"{name} {task} @ {L}: {e}") from None
        out.setdefault(task, {}).setdefault(L, {})[name] = cell
    return out


def markdown(summary: dict, methods: list[str]) -> str:
    lines = ["| task | length | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for task, by_len in summary.items():
        for L, by_m in sorted(by_len.items(), key=lambda kv: int(kv[0])):
            row = []
            for m in methods:
                c = by_m.get(m)
                if c is None:
                    row.append("not run")
                elif m == "bf16":
                    row.append(f"{c['score']:.0f} (n={c['n']})")
                else:
                    pct = "n/a" if c["pct_of_bf16"] is None else f"{c['pct_of_bf16']:.0f}%"
                    se = "" if c["diff_se"] is None else f" ±{c['diff_se']:.0f}"
                    row.append(f"{c['score']:.0f} vs {c['bf16_score']:.0f}{se}: {pct} (n={c['n']})")
            lines.append(f"| {task} | {int(L) // 1024}k | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="folder of niah*.json")
    ap.add_argument("--json", type=Path, default=None, help="accuracy JSON to add the section niah_exact_greedy to")
    ap.add_argument("--note", default="", help="where the runs come from (kept in the JSON)")
    args = ap.parse_args(argv)
    files = sorted(args.dir.glob("niah*.json"))
    if not files:
        raise SystemExit(f"no niah*.json in {args.dir}")
    cells, rule = read_runs(files)
    summary = summarise(cells)
    methods = sorted({m for by_len in summary.values() for by_m in by_len.values() for m in by_m},
                     key=lambda m: (m != "bf16", m))
    print(markdown(summary, methods))
    if args.json is not None:
        if not args.note:
            raise SystemExit("--json needs --note: where the runs come from (device, commit, command)")
        report = json.loads(args.json.read_text())
        section = "niah_exact_greedy" if rule == "first_line" else f"niah_exact_greedy_{rule}"
        report[section] = dict(
            scorer="each method's own greedy answer (eval/niah.score_niah: bf16's answer teacher-forced, "
                   "then the method's greedy decode from its first differing token), string_match_all over "
                   + ("the answer's first line" if rule == "first_line" else "the whole answer (every line)"),
            answer_rule=rule, date=time.strftime("%Y-%m-%d"), note=args.note, files=[f.name for f in files],
            cells=summary)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote section {section} of {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
