"""Eval drivers: scorers on known answers, the code sandbox, and every task end to end against a
tiny in-process OpenAI-compatible server with canned answers (no model, no network)."""

import base64
import http.server
import json
import pickle
import re
import threading
import zlib

import pytest

from sglang_oscar.eval import bench
from sglang_oscar.eval.datasets import DatasetError, load_records
from sglang_oscar.eval.openai_client import ApiError, OpenAIClient
from sglang_oscar.eval.sandbox import run_python
from sglang_oscar.eval.tasks import last_boxed
from sglang_oscar.eval.tasks.aime import extract_int
from sglang_oscar.eval.tasks.code import extract_code, outputs_match
from sglang_oscar.eval.tasks.gpqa import extract_letter
from sglang_oscar.eval.tasks.humaneval import build_program
from sglang_oscar.eval.tasks.livecodebench import decode_tests
from sglang_oscar.eval.tasks.math500 import equivalent, normalize
from tiny_model import patch_bench_tokenizer


# ------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text,want", [
    ("Reasoning...\nAnswer: C", "C"),
    ("<think>Answer: A maybe</think>\nSo the answer is (B).", "B"),
    ("**Answer:** D) 4.2 eV", "D"),
    ("Final answer: $\\boxed{C}$", "C"),
    ("The answer is \\boxed{\\text{(A)}}", "A"),
    ("\\boxed{B}", "B"),
    ("lots of text\n\n(D)", "D"),
    ("The answer is a bit subtle.", None),
    ("The answer is a bit subtle.\nANSWER: B", "B"),
    ("Answer: Because of entropy", None),  # "B" of "Because" is not a choice letter
    ("I cannot decide between A and B.", None),
])
def test_gpqa_extraction(text, want):
    assert extract_letter(text) == want


@pytest.mark.parametrize("text,want", [
    ("so \\boxed{042}", 42),
    ("\\boxed{1,000}? no: \\boxed{ 17 }", 17),
    ("\\boxed{\\text{17}}.", 17),
    ("\\boxed{17.0}", 17),
    ("\\boxed{\\frac{1}{2}}", None),
    ("<think>\\boxed{5}</think> The answer is 7.", 7),
    ("... therefore the answer is $204$.", 204),
    ("We get 3 and then 12", 12),
    ("no digits", None),
])
def test_aime_extraction(text, want):
    assert extract_int(text) == want


def test_last_boxed_nested():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{\\sqrt{3}}{2}}") == "\\frac{\\sqrt{3}}{2}"
    assert last_boxed("\\boxed 5") == "5"
    assert last_boxed("\\boxed{unbalanced") is None


@pytest.mark.parametrize("pred,ref,ok", [
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("0.5", "\\frac{1}{2}", True),
    (".5", "1/2", True),
    ("x = 3", "3", True),
    ("3.0", "3", True),
    ("90^\\circ", "90", True),
    ("10\\%", "10", True),
    ("5 \\text{ cm}", "5", True),
    ("\\left(1, 2\\right)", "(1,2)", True),
    ("1,000", "1000", True),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("\\{1,2\\}", "{1,2}", True),
    ("(1,2)", "(1,3)", False),
    ("\\frac{1}{3}", "0.33", False),
    ("", "0", False),
    (None, "1", False),
])
def test_math_equivalence(pred, ref, ok):
    assert equivalent(pred, ref) is ok


def test_math_normalize_keeps_tuple_commas():
    assert normalize("(1,234)") == "(1,234)" and normalize("1,234,567") == "1234567"
    assert normalize("(1, 2)") == "(1,2)"


def test_code_extraction_and_compare():
    text = "<think>```python\nwrong()\n```</think>Here:\n```python\nprint(1)\n```\nand ```\nnot this\n```"
    assert extract_code(text) == "print(1)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nprint(2)\n") == "print(2)\n"  # unterminated (hit max_tokens)
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("yes", "YES")


# ---------------------------------------------------------------------------------------- sandbox
def test_sandbox_pass_fail_timeout_output():
    assert run_python("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"
    r = run_python("raise SystemExit(3)")
    assert r.status == "error" and r.returncode == 3
    r = run_python("assert 1 == 2")
    assert r.status == "error" and "AssertionError" in r.stderr
    r = run_python("while True: pass", timeout=1.0)
    assert r.status == "timeout"
    r = run_python("import time\ntime.sleep(30)", timeout=0.5)
    assert r.status == "timeout"
    r = run_python("while True: print('x' * 1000)", timeout=5.0, max_output=64 << 10)
    assert r.status == "output_limit" and len(r.stdout) <= 64 << 10
    r = run_python("x = bytearray(1 << 31)", memory_mb=256)
    assert r.status == "error" and "MemoryError" in r.stderr
    r = run_python("import sys; sys.exit(0)")  # exits without reading stdin
    assert r.ok


def test_humaneval_program_forms():
    prompt = "import math\n\ndef f(x):\n    \"\"\"doc\"\"\"\n"
    test = "def check(c):\n    assert c(4) == 2.0\n"
    body = "    return math.sqrt(x)\n"
    full = "def f(x):\n    return math.sqrt(x)\n"  # the model dropped the import
    for code in (body, full):
        assert run_python(build_program(prompt, code, test, "f")).ok
    assert not run_python(build_program(prompt, "    return x\n", test, "f")).ok


def test_lcb_private_tests_decoding():
    tests = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert decode_tests(packed) == tests
    assert decode_tests(json.dumps(tests)) == tests

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    for proto in range(pickle.HIGHEST_PROTOCOL + 1):  # every protocol's string pickle is read
        packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests), protocol=proto))).decode()
        assert decode_tests(packed) == tests
    bad = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(DatasetError, match="refusing pickle opcode"):
        decode_tests(bad)
    two = base64.b64encode(zlib.compress(pickle.dumps([json.dumps(tests), "x"]))).decode()  # a list: refused
    with pytest.raises(DatasetError, match="refusing pickle opcode"):
        decode_tests(two)
    huge = base64.b64encode(zlib.compress(b"\0" * ((1 << 28) + 1))).decode()
    with pytest.raises(DatasetError, match="inflates past 256 MiB"):
        decode_tests(huge)


def test_dataset_loading(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n')
    (tmp_path / "a.csv").write_text("x,y\n1,2\n")
    (tmp_path / "a.json").write_text('{"data": [{"x": 3}]}')
    assert load_records(str(tmp_path / "a.jsonl")) == [{"x": 1}, {"x": 2}]
    assert load_records(str(tmp_path / "a.csv")) == [{"x": "1", "y": "2"}]
    assert load_records(str(tmp_path / "a.json")) == [{"x": 3}]
    with pytest.raises(DatasetError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="unsupported"):
        (tmp_path / "a.txt").write_text("")
        load_records(str(tmp_path / "a.txt"))
    with pytest.raises(DatasetError, match="hf:OWNER/REPO"):
        load_records("hf:only-one-part")


# ------------------------------------------------------------------------------ fake server
GPQA_CORRECT = {"q1": "Paris", "q2": "4"}


def _chat_answer(prompt: str) -> str:
    """Canned 'model': right on gpqa q1 / wrong on q2, right on math & aime, correct and wrong code."""
    if "multiple-choice" in prompt:
        qid = "q1" if "capital" in prompt else "q2"
        letters = dict(re.findall(r"^([A-D])\) (.*)$", prompt, re.MULTILINE))
        right = next(k for k, v in letters.items() if v == GPQA_CORRECT[qid])
        pick = right if qid == "q1" else next(k for k in letters if k != right)
        return f"<think>hmm</think>Let me think.\nAnswer: {pick}"
    if "0 to 999" in prompt:
        return "The sum is \\boxed{42}" if "sum" in prompt else "\\boxed{7}"
    if "inside \\boxed" in prompt:
        return "So $x=\\boxed{\\dfrac{1}{2}}$."
    if "def add(" in prompt:
        return "```python\ndef add(a, b):\n    return a + b\n```"
    if "def sub(" in prompt:
        return "```python\ndef sub(a, b):\n    while True:\n        pass\n```"
    if "twoSum" in prompt:
        return ("```python\nclass Solution:\n    def twoSum(self, nums: List[int], t: int) -> List[int]:\n"
                "        seen = {}\n        for i, x in enumerate(nums):\n            if t - x in seen:\n"
                "                return [seen[t - x], i]\n            seen[x] = i\n```")
    if "standard input" in prompt:
        return "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    return "I don't know"


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        if self.path == "/v1/chat/completions":
            prompt = body["messages"][-1]["content"]
            if "FAIL" in prompt:
                return self._send({"error": "bad request"}, 400)
            msg = {"role": "assistant", "content": _chat_answer(prompt)}
            return self._send({"choices": [{"message": msg, "finish_reason": "stop"}], "usage": usage})
        if self.path == "/v1/completions":
            text = bytes(body["prompt"]).decode() if isinstance(body["prompt"], list) else body["prompt"]
            query = re.search(r"magic number for (\S+) mentioned", text).group(1)
            value = re.search(rf"for {re.escape(query)} is: (\d+)", text).group(1)
            return self._send({"choices": [{"text": f" {value}.\nMore", "finish_reason": "stop"}], "usage": usage})
        self._send({"error": "not found"}, 404)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.requests = []
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _bench(args, tmp_path, name):
    out = tmp_path / f"{name}.json"
    rc = bench.main(args + ["--out", str(out), "--quiet", "--concurrency", "4"])
    return rc, json.loads(out.read_text())


def test_client_errors(server):
    _, url = server
    c = OpenAIClient(url + "/v1/", retries=0)
    assert c.models() == ["fake-model"]
    with pytest.raises(ApiError, match="HTTP 400"):
        c.chat([{"role": "user", "content": "FAIL"}], "m")
    with pytest.raises(ApiError):
        OpenAIClient("http://127.0.0.1:9", retries=0, timeout=2).models()


def test_gpqa_end_to_end(server, tmp_path):
    srv, url = server
    csv = tmp_path / "gpqa.csv"
    csv.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3,Record ID\n"
                   "What is the capital of France?,Paris,Rome,Berlin,Madrid,q1\n"
                   "What is 2+2?,4,3,5,22,q2\n")
    rc, doc = _bench(["gpqa", "--base-url", url, "--data", str(csv), "--repeats", "3"], tmp_path, "gpqa")
    s = doc["summary"]
    assert rc == 0 and s["repeats"] == 3 and s["n"] == 2 and s["scores"] == [50.0, 50.0, 50.0] and s["std"] == 0
    assert doc["model"] == "fake-model"  # asked the server
    req = srv.requests[0]  # paper sampling defaults reach the server, with per-repeat seeds
    assert (req["temperature"], req["top_p"], req["top_k"], req["max_tokens"]) == (0.6, 0.95, 20, 32768)
    assert sorted({r["seed"] for r in srv.requests}) == [0, 1, 2]


def test_aime_math_end_to_end(server, tmp_path):
    _, url = server
    aime = _write_jsonl(tmp_path / "aime.jsonl", [{"problem": "Find the sum.", "answer": "042"},
                                                  {"problem": "Find x.", "answer": "8"}])
    rc, doc = _bench(["aime", "--base-url", url, "--data", aime, "--repeats", "2", "--temperature", "0"],
                     tmp_path, "aime")
    assert rc == 0 and doc["summary"]["mean"] == 50.0 and doc["settings"]["temperature"] == 0.0
    math = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "\\frac12", "unique_id": "a"},
                                               {"problem": "q", "solution": "so \\boxed{0.5}", "unique_id": "b"},
                                               {"problem": "r", "answer": "3"}])
    rc, doc = _bench(["math500", "--base-url", url, "--data", math, "--repeats", "1"], tmp_path, "math")
    assert rc == 0 and abs(doc["summary"]["mean"] - 200 / 3) < 1e-9


def test_code_end_to_end(server, tmp_path):
    _, url = server
    he = _write_jsonl(tmp_path / "he.jsonl", [
        {"task_id": "t/0", "prompt": "def add(a, b):\n    \"\"\"a+b\"\"\"\n", "entry_point": "add",
         "test": "def check(f):\n    assert f(1, 2) == 3\n"},
        {"task_id": "t/1", "prompt": "def sub(a, b):\n    \"\"\"a-b\"\"\"\n", "entry_point": "sub",
         "test": "def check(f):\n    assert f(3, 2) == 1\n"}])
    from sglang_oscar.eval.tasks.humaneval import HumanEval

    HumanEval.timeout = 1.0  # the canned wrong answer loops forever
    rc, doc = _bench(["humaneval", "--base-url", url, "--data", he, "--repeats", "1"], tmp_path, "he")
    res = {r["id"]: r for r in doc["runs"][0]["results"]}
    assert rc == 0 and res["t/0"]["score"] == 1.0 and res["t/1"]["extracted"] == "timeout"

    func_tests = [{"input": "[2, 7, 11]\n9", "output": "[0, 1]", "testtype": "functional"}]
    priv = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(
        [{"input": "3 4\n", "output": "12\n", "testtype": "stdin"}])))).decode()
    lcb = _write_jsonl(tmp_path / "lcb.jsonl", [
        {"question_id": "p1", "question_content": "Multiply two numbers.", "starter_code": "",
         "contest_date": "2025-03-01T00:00:00", "public_test_cases": json.dumps(
             [{"input": "2 3\n", "output": "6\n", "testtype": "stdin"}]), "private_test_cases": priv},
        {"question_id": "p2", "question_content": "Find twoSum indices.", "contest_date": "2025-03-02",
         "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], t: int) -> List[int]:\n",
         "public_test_cases": json.dumps(func_tests), "metadata": json.dumps({"func_name": "twoSum"})},
        {"question_id": "old", "question_content": "x", "contest_date": "2024-01-01",
         "public_test_cases": json.dumps([{"input": "", "output": "", "testtype": "stdin"}])}])
    rc, doc = _bench(["livecodebench", "--base-url", url, "--data", lcb, "--repeats", "1", "--since", "2025-02-01"],
                     tmp_path, "lcb")
    assert rc == 0 and doc["summary"]["n"] == 2 and doc["summary"]["mean"] == 100.0


def test_ruler_end_to_end(server, tmp_path, capsys, monkeypatch):
    patch_bench_tokenizer(monkeypatch)
    srv, url = server
    rc, doc = _bench(["ruler", "--base-url", url, "--model", "m", "--tokenizer", "tiny", "--lengths", "400", "700",
                      "--samples", "2"], tmp_path, "ruler")
    s = doc["summary"]
    assert rc == 0 and s["mean"] == 100.0 and s["n"] == 8 and s["repeats"] == 1
    assert set(s["groups"]) == {"niah_single_1@400", "niah_single_1@700", "niah_multikey_2@400",
                                "niah_multikey_2@700"}
    req = srv.requests[0]
    assert isinstance(req["prompt"], list) and req["temperature"] == 0.0 and req["max_tokens"] == 32
    assert len(req["prompt"]) <= 700 - 32
    assert bench.main(["summarize", str(tmp_path / "ruler.json")]) == 0
    assert "niah_multikey_2@700" in capsys.readouterr().out


def test_api_errors_are_counted(server, tmp_path, monkeypatch):
    _, url = server
    aime = _write_jsonl(tmp_path / "a.jsonl", [{"problem": "FAIL", "answer": "1"}, {"problem": "sum", "answer": 42}])
    rc, doc = _bench(["aime", "--base-url", url, "--data", aime, "--repeats", "1"], tmp_path, "err")
    assert rc == 1 and doc["summary"]["errors"] == 1 and doc["summary"]["mean"] == 50.0
    hub = pytest.importorskip("huggingface_hub")

    def unreachable(*a, **k):  # what an offline machine sees, without waiting for its retries
        raise OSError("network unreachable")

    monkeypatch.setattr(hub, "hf_hub_download", unreachable)
    with pytest.raises(SystemExit, match="cannot download from the Hugging Face hub.*network unreachable"):
        bench.main(["aime", "--base-url", url, "--data", "hf:nobody/none/x.jsonl", "--quiet"])
