"""AIME (2025 by default): the answer is an integer 0..999, compared as an integer."""

from __future__ import annotations

import re

from ..datasets import field
from . import Example, Task, final_text, last_boxed

PROMPT = ("Solve the following problem. Reason step by step, and put your final answer (an integer "
          "from 0 to 999) inside \\boxed{{}}.\n\n{problem}")
_STATED = re.compile(r"answer\s*(?:is|:)\s*[*:\s$]*(-?\d[\d,]*)", re.IGNORECASE)


def to_int(s):
    """An integer from a boxed/stated answer: '042', '1,000', '\\text{ 17 }', '17.0', '$5$' -> int; else None."""
    if s is None:
        return None
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^}]*)\}", r"\1", str(s))
    s = s.replace("$", "").replace(",", "").replace("\\!", "").replace("{", "").replace("}", "").strip().rstrip(".")
    m = re.fullmatch(r"(-?\d+)(?:\.0+)?", s)
    return int(m.group(1)) if m else None


def extract_int(text: str):
    body = final_text(text)
    boxed = last_boxed(body)
    if boxed is not None:
        return to_int(boxed)  # a boxed non-integer is a wrong answer, not a reason to guess
    m = list(_STATED.finditer(body))
    if m:
        return to_int(m[-1].group(1))
    nums = re.findall(r"-?\d+", body[-200:])  # last resort: the last integer near the end
    return int(nums[-1]) if nums else None


class Aime(Task):
    name = "aime"
    default_data = "hf:math-ai/aime25/test.jsonl"

    def examples(self, records):
        return [Example(id=str(r.get("id", i)), data=dict(problem=str(field(r, "problem", "question", "Problem"))),
                        answer=to_int(field(r, "answer", "Answer", "solution")))
                for i, r in enumerate(records)]

    def messages(self, ex, seed):
        return [{"role": "user", "content": PROMPT.format(problem=ex.data["problem"])}]

    def score(self, ex, text, seed):
        got = extract_int(text)
        return float(got is not None and got == ex.answer), got
