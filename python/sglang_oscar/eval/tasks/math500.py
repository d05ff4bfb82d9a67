r"""MATH-500: the last \boxed{} answer, compared after LaTeX normalization (and numerically).

Normalization removes presentation that does not change the value: $ and spacing commands,
\left/\right, \dfrac/\tfrac -> \frac, \frac12 -> \frac{1}{2}, degree and percent signs, a text
unit after a number, a leading "x =", thousands separators, trailing zeros of decimals. Two answers
match if the normalized strings are equal or both parse to the same exact rational number
(so 0.5, 1/2 and \frac{1}{2} agree). No model-based equality judge: results must be reproducible offline.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from ..datasets import field
from . import Example, Task, final_text, last_boxed

PROMPT = ("Solve the following problem. Reason step by step, and put your final answer inside "
          "\\boxed{{}}.\n\n{problem}")


def _braced_args(s: str, cmd: str, nargs: int) -> str:
    r"""\frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}: give single-character arguments their braces."""
    out, i = [], 0
    while True:
        j = s.find(cmd, i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j + len(cmd)])
        i = j + len(cmd)
        for _ in range(nargs):
            if i < len(s) and s[i] == "{":
                depth, k = 0, i
                while k < len(s):
                    depth += {"{": 1, "}": -1}.get(s[k], 0)
                    k += 1
                    if depth == 0:
                        break
                out.append(s[i:k])
                i = k
            elif i < len(s):
                out.append("{" + s[i] + "}")
                i += 1


def normalize(ans: Optional[str]) -> Optional[str]:
    if ans is None:
        return None
    s = str(ans).strip()
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", ""),
                 ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                 ("\\%", ""), ("%", ""), ("\\{", "{"), ("\\}", "}"), ("\\displaystyle", "")):
        s = s.replace(a, b)
    s = re.sub(r"(\d)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}\s*$", r"\1", s)  # "5 \text{ cm}" -> 5
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^}]*)\}", r"\1", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 3" -> 3 (single variable answers)
    s = s.replace(" ", "").rstrip(".")
    s = _braced_args(s, "\\frac", 2)
    s = _braced_args(s, "\\sqrt", 1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 1,000 -> 1000; a tuple (1,234) is left alone
        s = s.replace(",", "")
    s = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", s)  # .5 -> 0.5
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # 3.0 -> 3
    return s


def as_number(s: Optional[str]) -> Optional[Fraction]:
    if s is None:
        return None
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return -v if m.group(1) else v
        if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def equivalent(pred: Optional[str], ref: Optional[str]) -> bool:
    a, b = normalize(pred), normalize(ref)
    if a is None or b is None or a == "":
        return False
    if a == b:
        return True
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


class Math500(Task):
    name = "math500"
    default_data = "hf:HuggingFaceH4/MATH-500/test.jsonl"

    def examples(self, records):
        out = []
        for i, r in enumerate(records):
            ans = r.get("answer")
            if ans in (None, ""):  # MATH's original records only have the solution: take its boxed answer
                ans = last_boxed(str(field(r, "solution")))
            out.append(Example(id=str(r.get("unique_id", i)), data=dict(problem=str(field(r, "problem", "question"))),
                               answer=str(ans)))
        return out

    def messages(self, ex, seed):
        return [{"role": "user", "content": PROMPT.format(problem=ex.data["problem"])}]

    def score(self, ex, text, seed):
        got = last_boxed(final_text(text))
        return float(equivalent(got, ex.answer)), got
