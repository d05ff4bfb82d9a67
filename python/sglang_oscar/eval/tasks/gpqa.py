"""GPQA (Diamond by default): four-way multiple choice, scored on the letter of the final answer.

The choices are shuffled per (repeat seed, question), so repeats also average over answer
orderings, and the model is asked to end with "Answer: X". Extraction takes the last explicit
answer statement after any thinking, then a boxed letter, then a bare final letter.
"""

from __future__ import annotations

import random
import re

from ..datasets import field
from . import Example, Task, final_text, last_boxed

LETTERS = "ABCD"
PROMPT = (
    "Answer the following multiple-choice question. Think it through step by step, then give the "
    "final answer on the last line in the form 'Answer: X', where X is one of A, B, C or D.\n\n"
    "{question}\n\n{choices}"
)
# "Answer: C", "answer is (C)", "**Answer:** C)", "Final answer: $\boxed{C}$" -- letter not followed by a letter.
# Case-insensitive keyword, upper-case letter: "the answer is a bit subtle" must not read as A.
_STATED = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)\s*[*:\s]*(?:\$?\\boxed\{\s*)?(?:\\text\{\s*)?\(?\s*([A-D])(?![A-Za-z])")
_BARE = re.compile(r"^\W*\(?([A-D])\)?\W*$")


def extract_letter(text: str):
    body = final_text(text)
    m = list(_STATED.finditer(body))
    if m:
        return m[-1].group(1)
    boxed = last_boxed(body)
    if boxed is not None:
        inner = re.sub(r"\\text\{([^}]*)\}", r"\1", boxed).strip().strip("()").strip()
        if len(inner) == 1 and inner.upper() in LETTERS:
            return inner.upper()
    lines = [ln for ln in body.strip().splitlines() if ln.strip()]
    if lines:
        m = _BARE.match(lines[-1].strip())
        if m:
            return m.group(1)
    return None


class Gpqa(Task):
    name = "gpqa"
    default_data = "hf:Idavidrein/gpqa/gpqa_diamond.csv"  # gated: needs HF_TOKEN and an accepted licence

    def examples(self, records):
        out = []
        for i, r in enumerate(records):
            wrong = r.get("incorrect")
            if wrong is None:
                wrong = [field(r, f"Incorrect Answer {k}") for k in (1, 2, 3)]
            out.append(Example(id=str(r.get("Record ID") or r.get("id") or i),
                               data=dict(question=str(field(r, "Question", "question")).strip(),
                                         correct=str(field(r, "Correct Answer", "correct")).strip(),
                                         wrong=[str(w).strip() for w in wrong])))
        return out

    def choices(self, ex: Example, seed: int) -> tuple[list[str], str]:
        """(choices in the order shown, the correct letter) for this repeat."""
        opts = [ex.data["correct"]] + list(ex.data["wrong"])
        order = list(range(len(opts)))
        random.Random(f"gpqa|{seed}|{ex.id}").shuffle(order)
        return [opts[j] for j in order], LETTERS[order.index(0)]

    def messages(self, ex, seed):
        shown, _ = self.choices(ex, seed)
        lines = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(shown))
        return [{"role": "user", "content": PROMPT.format(question=ex.data["question"], choices=lines)}]

    def score(self, ex, text, seed):
        got = extract_letter(text)
        return float(got is not None and got == self.choices(ex, seed)[1]), got
