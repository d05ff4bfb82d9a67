"""LiveCodeBench (code generation): stdin/stdout programs and LeetCode-style functional problems.

Records follow livecodebench/code_generation_lite: public_test_cases is a JSON list of
{input, output, testtype}; private_test_cases is the same list, either as JSON or as
base64(zlib(pickle(json string))). That pickle is not unpickled: its opcodes are parsed and only
one string and the framing around it are accepted (anything else, e.g. a global, is refused), and
the decompressed size is capped. Functional problems
(testtype "functional") call Solution().<func_name>(*args) with one JSON argument per input line
(func_name from the record's metadata). A problem passes if every test passes; the first failure
stops it. --since / --until select a contest-date window (v6 of the paper: 2025-02-01..2025-05-01).
"""

from __future__ import annotations

import base64
import json
import pickletools
import zlib

from ..datasets import DatasetError, field
from ..sandbox import run_python
from . import Example, Task
from .code import extract_code, outputs_match

PROMPT_STDIN = ("Solve the following programming problem in Python 3. The program must read the input "
                "from standard input and write the answer to standard output. Reply with the complete "
                "program in a single ```python code block.\n\n{question}")
PROMPT_FUNC = ("Solve the following programming problem in Python 3 by completing the starter code. "
               "Reply with the complete solution in a single ```python code block.\n\n{question}\n\n"
               "Starter code:\n```python\n{starter}\n```")

# Put before a functional solution: LeetCode's environment pre-imports these, and starter code
# relies on it (List[int], Optional[TreeNode] annotations without imports).
_FUNC_HEADER = ("from typing import *\nfrom collections import *\nfrom itertools import *\n"
                "from functools import *\nfrom heapq import *\nfrom bisect import *\nimport math\n\n")

# Appended to a functional solution: read one JSON argument per line, print the JSON result.
_FUNC_DRIVER = """

if __name__ == "__main__":
    import json as _json, sys as _sys
    _args = [_json.loads(_l) for _l in _sys.stdin.read().splitlines() if _l.strip()]
    _obj = Solution() if "Solution" in globals() else None
    _fn = getattr(_obj, {name!r}) if _obj is not None else globals()[{name!r}]
    print(_json.dumps(_fn(*_args)))
"""


MAX_TESTS_BYTES = 1 << 28  # one problem's private tests, inflated: a cap against a decompression bomb
# the opcodes of a pickled str or bytes (protocols 0-5): framing, the string, the memo, nothing that calls or imports
_STRING_OPS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
_FRAME_OPS = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "STOP"}


def _pickled_string(data: bytes):
    """The one str / bytes a pickle of a string holds, read from its opcodes; any other opcode is refused."""
    found = []
    for op, arg, _ in pickletools.genops(data):
        if op.name in _STRING_OPS:
            found.append(arg)
        elif op.name not in _FRAME_OPS:
            raise ValueError(f"refusing pickle opcode {op.name} in test data (only a pickled string is read)")
    if len(found) != 1:
        raise ValueError(f"expected one pickled string in test data, found {len(found)}")
    return found[0]


def _inflate(data: bytes) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(data, MAX_TESTS_BYTES)
    if d.unconsumed_tail:
        raise ValueError(f"test data inflates past {MAX_TESTS_BYTES >> 20} MiB")
    return out


def decode_tests(raw) -> list[dict]:
    if raw in (None, ""):
        return []
    if isinstance(raw, list):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return json.loads(_pickled_string(_inflate(base64.b64decode(raw))))
    except Exception as e:
        raise DatasetError(f"cannot decode test cases ({type(e).__name__}: {e})") from None


def _json_equal(got: str, want: str) -> bool:
    try:
        return json.loads(got.strip()) == json.loads(want.strip())
    except ValueError:
        return outputs_match(got, want)


class LiveCodeBench(Task):
    name = "livecodebench"
    default_data = "hf:livecodebench/code_generation_lite/test6.jsonl"
    timeout = 6.0  # per test; LCB's own limit is a few seconds per case
    since = None
    until = None

    def add_args(self, p):
        p.add_argument("--since", default=None, help="first contest date (YYYY-MM-DD), inclusive")
        p.add_argument("--until", default=None, help="last contest date (YYYY-MM-DD), exclusive")

    def configure(self, args):
        self.since, self.until = getattr(args, "since", None), getattr(args, "until", None)

    def examples(self, records):
        out = []
        for i, r in enumerate(records):
            date = str(r.get("contest_date", ""))[:10]
            if (self.since and date < self.since) or (self.until and date >= self.until):
                continue
            tests = decode_tests(r.get("public_test_cases")) + decode_tests(r.get("private_test_cases"))
            if not tests:
                raise DatasetError(f"problem {r.get('question_id', i)} has no test cases")
            meta = r.get("metadata") or {}
            meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else (meta or {})
            out.append(Example(id=str(r.get("question_id", i)), data=dict(
                question=str(field(r, "question_content", "question")), starter=str(r.get("starter_code") or ""),
                tests=tests, func_name=meta.get("func_name"), date=date)))
        return out

    def messages(self, ex, seed):
        if ex.data["starter"].strip():
            text = PROMPT_FUNC.format(question=ex.data["question"], starter=ex.data["starter"])
        else:
            text = PROMPT_STDIN.format(question=ex.data["question"])
        return [{"role": "user", "content": text}]

    def score(self, ex, text, seed):
        code = extract_code(text)
        for k, t in enumerate(ex.data["tests"]):
            functional = t.get("testtype") == "functional"
            if functional:
                if not ex.data["func_name"]:
                    raise DatasetError(f"problem {ex.id}: functional test but no metadata.func_name")
                program = _FUNC_HEADER + code + _FUNC_DRIVER.format(name=ex.data["func_name"])
            else:
                program = code
            res = run_python(program, stdin=t["input"], timeout=self.timeout)
            if not res.ok:
                return 0.0, f"test {k}: {res.status}"
            same = _json_equal(res.stdout, t["output"]) if functional else outputs_match(res.stdout, t["output"])
            if not same:
                return 0.0, f"test {k}: wrong answer"
        return 1.0, "passed"
