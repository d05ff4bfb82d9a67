"""HumanEval: complete a function; pass@1 = the dataset's check() passes in the sandbox."""

from __future__ import annotations

import re

from ..datasets import field
from ..sandbox import run_python
from . import Example, Task
from .code import extract_code

PROMPT = ("Complete the following Python function. Reply with the complete function, including the "
          "imports it needs, in a single ```python code block.\n\n```python\n{prompt}```")


def build_program(prompt: str, code: str, test: str, entry_point: str) -> str:
    """Prompt + body when the model only wrote the body; the model's own definition when it wrote one.

    The prompt's imports and helper definitions are kept in both cases (models often drop them)."""
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        head = prompt[: prompt.find(f"def {entry_point}")] if f"def {entry_point}" in prompt else ""
        program = head + "\n" + code
    else:
        program = prompt + code
    return f"{program}\n\n{test}\n\ncheck({entry_point})\n"


class HumanEval(Task):
    name = "humaneval"
    default_data = "hf:openai/openai_humaneval/openai_humaneval/test-00000-of-00001.parquet"
    timeout = 10.0

    def examples(self, records):
        return [Example(id=str(field(r, "task_id")), data=dict(prompt=str(field(r, "prompt")), test=str(field(r, "test")),
                                                              entry_point=str(field(r, "entry_point"))))
                for r in records]

    def messages(self, ex, seed):
        return [{"role": "user", "content": PROMPT.format(prompt=ex.data["prompt"])}]

    def score(self, ex, text, seed):
        program = build_program(ex.data["prompt"], extract_code(text), ex.data["test"], ex.data["entry_point"])
        res = run_python(program, timeout=self.timeout)
        return float(res.ok), res.status
