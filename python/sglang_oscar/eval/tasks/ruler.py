"""RULER-style NIAH over a server: eval/niah.py's samples (sized with the served model's tokenizer),
sent as token ids to /v1/completions so the prompt length is exact, greedy, scored with
string_match_all. Results are broken down by (task, length)."""

from __future__ import annotations

from ..niah import GENERATION_RESERVE, TASKS, make_samples, string_match_all
from . import Example, Task

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


class Ruler(Task):
    name = "ruler"
    api = "completion"
    max_tokens = GENERATION_RESERVE
    text_tokenizer = None  # set: send decoded text instead of ids (servers that take no token prompts)

    def build(self, tokenizer, lengths, samples: int, tasks=TASKS, seed: int = 0, chat: bool = False):
        out = []
        for task in tasks:
            for length in lengths:
                for i, s in enumerate(make_samples(tokenizer, task, length, samples, seed, chat=chat)):
                    out.append(Example(id=f"{task}/{length}/{i}", answer=s.answers,
                                       data=dict(prompt_ids=s.prompt_ids, group=f"{task}@{length}",
                                                 prompt_tokens=len(s.prompt_ids))))
        return out

    def prompt(self, ex, seed):
        ids = ex.data["prompt_ids"]
        return ids if self.text_tokenizer is None else self.text_tokenizer.decode(ids)

    def score(self, ex, text, seed):
        # The answer is the first line of the continuation (as in the offline NIAH); keep it for the record.
        first = text.strip().split("\n")[0]
        return string_match_all(first, ex.answer) / 100.0, first
