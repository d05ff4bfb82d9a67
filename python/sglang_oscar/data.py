"""Text sources that exist on every Python install (nothing is downloaded at run time).

Calibration and evaluation use *different* sources so rotations and clip ratios are never fitted
on the text they are scored on:
  calibration: docstrings of a fixed list of standard-library modules (inspect.getdoc of the
               modules, their classes and functions) -- API documentation prose;
  evaluation:  pydoc_data.topics, the Python Language Reference topics that `help()` shows --
               a separate document set (reference-manual prose), different authorship and style.
Both are PSF-licensed text read from the interpreter at run time, never copied into the repo.
"""

from __future__ import annotations

import importlib
import inspect

CALIBRATION_MODULES = (
    "argparse", "asyncio.tasks", "bisect", "calendar", "collections", "concurrent.futures", "contextlib",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "heapq", "http.client", "inspect", "json", "logging", "pathlib", "queue", "random",
    "sched", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile",
)

CALIBRATION_SOURCE = "python-stdlib-docstrings"
EVAL_SOURCE = "pydoc_data.topics (Python Language Reference)"


def _docstrings(module_name: str) -> list[str]:
    mod = importlib.import_module(module_name)
    out = []
    doc = inspect.getdoc(mod)
    if doc:
        out.append(doc)
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            d = inspect.getdoc(obj)
            if d and len(d) > 200:
                out.append(d)
            if inspect.isclass(obj):
                for mname, meth in sorted(vars(obj).items()):
                    if mname.startswith("_") or not inspect.isfunction(meth):
                        continue
                    md = inspect.getdoc(meth)
                    if md and len(md) > 200:
                        out.append(md)
    return out


def calibration_text() -> str:
    """About 225 kB of API documentation prose (58k SmolLM2 tokens on Python 3.11)."""
    parts: list[str] = []
    for name in CALIBRATION_MODULES:
        parts.extend(_docstrings(name))
    return "\n\n".join(parts)


def eval_text() -> str:
    """About 465 kB of Language Reference prose (113k SmolLM2 tokens), topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def token_windows(tokenizer, text: str, length: int, count: int, *, offset: int = 0) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens, spread evenly over the text after `offset`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    usable = len(ids) - offset
    if usable < length * count:
        raise ValueError(f"text has {usable} tokens after offset {offset}; need {length} x {count}")
    stride = usable // count
    return [ids[offset + i * stride : offset + i * stride + length] for i in range(count)]
