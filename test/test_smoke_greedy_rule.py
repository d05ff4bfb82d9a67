"""The GPU smoke's greedy comparison (benchmark/serving/smollm2_serve.py:compare_greedy): equal ids pass,
a flip at an exact stock tie passes, a flip with a clear stock margin or a new candidate token fails."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmark" / "serving" / "smollm2_serve.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("smollm2_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _server(ids, logprobs, top2):
    return dict(prompt_len=8, output_ids=ids, logprobs=logprobs, top2=top2, text="")


def _compare(smoke, tmp_path, a_rows, b_rows):
    rec = smoke.Record(tmp_path / "r.json", {"checks": []})
    smoke.compare_greedy(rec, {"label": "int2", "greedy": a_rows}, {"label": "stock", "greedy": b_rows})
    doc = json.loads((tmp_path / "r.json").read_text())
    return doc["checks"][-1]


def test_equal_ids_pass(smoke, tmp_path):
    row = _server([1, 2, 3], [-0.1, -0.2, -0.3], [[[-0.1, 1], [-2.0, 9]]] * 3)
    c = _compare(smoke, tmp_path, [row], [dict(row)])
    assert c["pass"] is True and c["outputs"][0]["equal"]


def test_flip_at_exact_tie_passes(smoke, tmp_path):
    # the 2026-11-25 H100 case: stock top-2 tied at -1.18595, int2 prefers the other token by 0.125
    a = _server([5, 1485], [-0.50, -1.13642], [[[-0.5, 5], [-3.0, 7]], [[-1.13642, 1485], [-1.26142, 325]]])
    b = _server([5, 325], [-0.42, -1.18595], [[[-0.42, 5], [-3.1, 7]], [[-1.18595, 1485], [-1.18595, 325]]])
    c = _compare(smoke, tmp_path, [a], [b])
    out = c["outputs"][0]
    assert out["matching_prefix"] == 1 and out["stock_top2_gap"] == 0.0 and out["near_tie_flip"] is True
    assert c["pass"] is True


def test_flip_with_clear_margin_fails(smoke, tmp_path):
    a = _server([5, 325], [-0.50, -1.9], [[[-0.5, 5], [-3.0, 7]], [[-1.9, 325], [-2.0, 1485]]])
    b = _server([5, 1485], [-0.49, -0.3], [[[-0.49, 5], [-3.1, 7]], [[-0.3, 1485], [-1.9, 325]]])
    c = _compare(smoke, tmp_path, [a], [b])
    assert c["outputs"][0]["near_tie_flip"] is False and c["pass"] is False


def test_flip_to_a_new_candidate_fails(smoke, tmp_path):
    # tie in the stock server, but int2's top-2 holds a token the stock top-2 does not: not a swap
    a = _server([5, 42], [-0.5, -1.0], [[[-0.5, 5], [-3.0, 7]], [[-1.0, 42], [-1.2, 1485]]])
    b = _server([5, 325], [-0.5, -1.1], [[[-0.5, 5], [-3.0, 7]], [[-1.1, 1485], [-1.1, 325]]])
    c = _compare(smoke, tmp_path, [a], [b])
    assert c["outputs"][0]["near_tie_flip"] is False and c["pass"] is False


def test_one_bad_prompt_fails_the_check(smoke, tmp_path):
    good = _server([1, 2], [-0.1, -0.2], [[[-0.1, 1], [-2.0, 9]], [[-0.2, 2], [-2.0, 9]]])
    a_bad = _server([1, 3], [-0.1, -2.5], [[[-0.1, 1], [-2.0, 9]], [[-2.5, 3], [-2.6, 2]]])
    b_bad = _server([1, 2], [-0.1, -0.2], [[[-0.1, 1], [-2.0, 9]], [[-0.2, 2], [-2.5, 3]]])
    c = _compare(smoke, tmp_path, [good, a_bad], [dict(good), b_bad])
    assert [o["equal"] for o in c["outputs"]] == [True, False] and c["pass"] is False
