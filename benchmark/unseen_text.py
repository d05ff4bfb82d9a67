"""A perplexity text that no fit and no published table has used: the Python source of four standard-library modules
that calibration (data.CALIBRATION_MODULES: their docstrings) does not read, concatenated. Code, not prose: another
domain than both the calibration docstrings and the Language Reference the table is scored on.

    python benchmark/unseen_text.py runs/unseen/stdlib_source.txt
    python -m sglang_oscar.eval.compare --stage ppl --out-dir runs/unseen --ppl-text runs/unseen/stdlib_source.txt \
        --methods bf16,int2_best   # runs/unseen/bundles: the table's bundles (copy or link runs/acc_full/bundles)
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

from sglang_oscar.data import CALIBRATION_MODULES

MODULES = ("configparser", "optparse", "pickletools", "mailbox")


def unseen_source() -> str:
    overlap = set(MODULES) & set(CALIBRATION_MODULES)
    if overlap:
        raise RuntimeError(f"{sorted(overlap)} are calibration modules")
    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmark/unseen_text.py OUT.txt")
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    text = unseen_source()
    out.write_text(text, encoding="utf-8")
    print(f"{out}: {len(text)} characters from {', '.join(MODULES)} (Python {sys.version.split()[0]})")
