"""Evaluation tasks for `python -m sglang_oscar.eval.bench`: data, prompt, answer extraction, score.

A task turns dataset records into Examples, an Example (plus the repeat's seed) into chat
messages, and a response into (score in [0, 1], extracted answer). Tasks hold no client and no
threads: bench.py drives them, so every scorer is testable on strings alone.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional


@dataclasses.dataclass
class Example:
    id: str
    data: dict  # the task's normalized fields
    answer: Any = None


class Task:
    name = ""
    default_data: Optional[str] = None  # a hf: spec, used when --data is not given
    api = "chat"

    def examples(self, records: list[dict]) -> list[Example]:
        raise NotImplementedError

    def messages(self, ex: Example, seed: int) -> list[dict]:
        raise NotImplementedError

    def score(self, ex: Example, text: str, seed: int) -> tuple[float, Any]:
        raise NotImplementedError


def final_text(text: str) -> str:
    """The answer part of a response: what follows the last </think> (thinking left in content)."""
    i = text.rfind("</think>")
    return text[i + len("</think>"):] if i >= 0 else text


def last_boxed(text: str) -> Optional[str]:
    r"""Content of the last \boxed{...} (or \fbox{...}), braces balanced; None if there is none."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end(): i - 1]
    if best is None:  # "\boxed 5" (no braces) is legal LaTeX and some models write it
        m = list(re.finditer(r"\\boxed\s+([^\s$]+)", text))
        best = m[-1].group(1) if m else None
    return best


def registry() -> dict[str, Task]:
    from .aime import Aime
    from .gpqa import Gpqa
    from .humaneval import HumanEval
    from .livecodebench import LiveCodeBench
    from .math500 import Math500

    return {t.name: t for t in (Gpqa(), Aime(), Math500(), HumanEval(), LiveCodeBench())}
