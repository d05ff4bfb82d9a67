"""Shared pieces of the code tasks: pulling the program out of a response, comparing outputs."""

from __future__ import annotations

import re

from . import final_text

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block (else the last fenced block, else the whole answer part)."""
    body = final_text(text)
    blocks = _FENCE.findall(body)
    py = [code for lang, code in blocks if lang.lower() in ("python", "python3", "py")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    # An unterminated fence (the generation hit max_tokens inside the block): take what is there.
    m = re.search(r"```[ \t]*(?:python3?|py)?[^\n]*\n(.*)$", body, re.DOTALL)
    return m.group(1) if m else body


def outputs_match(got: str, want: str, tol: float = 1e-6) -> bool:
    """Token-wise comparison (whitespace and line breaks insignificant); numbers within tol."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if abs(fx - fy) > tol * max(1.0, abs(fy)):
            return False
    return True
