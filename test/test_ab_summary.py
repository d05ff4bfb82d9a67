"""benchmark/ab_summary.py (the same-call A/B summary of run_gpu_ab.sh) on synthetic runs: medians over rounds, the
ratio new / old, and a flag only where the ratio is outside both trees' round-to-round spread."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import ab_summary  # noqa: E402


def _write(root, name, rows, fname="decode_step_layer_X.json"):
    d = root / name
    d.mkdir()
    (d / fname).write_text(json.dumps({"device": "test", "rows": rows}))


def _row(impl, ctx, batch, ms=None, us=None):
    r = dict(impl=impl, model="qwen3-8b", context=ctx, batch=batch)
    if ms is not None:
        r["ms"] = ms
    if us is not None:
        r["us"] = us
    return r


def test_summary_medians_ratios_and_flags(tmp_path, capsys):
    # per round: a point that does not move (its change stays inside the spread), one 7% slower, one 10% faster
    # (times in ms), and a probe-style row in us
    for tree, rnd, same, slow, fast, probe in (("old", 1, 0.0300, 0.0356, 0.2660, 29.7), ("old", 2, 0.0303, 0.0357, 0.2670, 30.2),
                                               ("new", 1, 0.0302, 0.0382, 0.2400, 31.6), ("new", 2, 0.0299, 0.0384, 0.2390, 32.0)):
        _write(tmp_path, f"{tree}_{rnd}", [_row("a", 32768, 1, ms=same), _row("a", 65536, 1, ms=slow),
                                           _row("a", 131072, 8, ms=fast), _row("probe", 65536, 1, us=probe)])
    (tmp_path / "old_1.log").write_text("a log next to the run directories is ignored")
    rows = ab_summary.summarise(ab_summary.load_runs(str(tmp_path)))
    by = {(r["impl"], r["context"], r["batch"]): r for r in rows}
    assert len(rows) == 4 and [r["context"] for r in rows] == [32768, 65536, 131072, 65536]
    same = by[("a", 32768, 1)]
    assert same["old_us"] == pytest.approx(30.15) and same["new_us"] == pytest.approx(30.05)
    assert same["old_spread"] == pytest.approx(30.3 / 30.0) and same["flag"] == ""
    assert by[("a", 65536, 1)]["ratio"] == pytest.approx(38.3 / 35.65) and by[("a", 65536, 1)]["flag"] == "slower"
    assert by[("a", 131072, 8)]["flag"] == "faster" and by[("a", 131072, 8)]["rounds"] == 2
    assert by[("probe", 65536, 1)]["new_us"] == pytest.approx(31.8) and by[("probe", 65536, 1)]["flag"] == "slower"
    out = tmp_path / "summary.json"
    assert ab_summary.main([str(tmp_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == rows
    table = capsys.readouterr().out
    assert "| a | qwen3-8b | 65536 | 1 | 35.65 | 38.30 | 1.074 |" in table


def test_points_of_one_tree_only_are_left_out_and_bad_input_is_refused(tmp_path):
    _write(tmp_path, "old_1", [_row("a", 1, 1, ms=1.0), _row("gone", 1, 1, ms=1.0)])
    _write(tmp_path, "new_1", [_row("a", 1, 1, ms=2.0), _row("added", 1, 1, ms=1.0)])
    rows = ab_summary.summarise(ab_summary.load_runs(str(tmp_path)))
    assert [(r["impl"], r["ratio"], r["flag"]) for r in rows] == [("a", 2.0, "slower")]  # one round: spread 1
    only_new = tmp_path / "only_new"
    only_new.mkdir()
    _write(only_new, "new_1", [_row("a", 1, 1, ms=1.0)])
    with pytest.raises(ValueError, match="needs old_<n> and new_<n>"):
        ab_summary.load_runs(str(only_new))
    dup = tmp_path / "dup"
    dup.mkdir()
    _write(dup, "old_1", [_row("a", 1, 1, ms=1.0), _row("a", 1, 1, ms=1.1)])
    _write(dup, "new_1", [_row("a", 1, 1, ms=1.0)])
    with pytest.raises(ValueError, match="appears twice in one run"):
        ab_summary.load_runs(str(dup))
    bad = tmp_path / "bad"
    bad.mkdir()
    _write(bad, "old_1", [dict(impl="a", context=1, batch=1)])
    _write(bad, "new_1", [_row("a", 1, 1, ms=1.0)])
    with pytest.raises(ValueError, match="without 'us' or 'ms'"):
        ab_summary.load_runs(str(bad))
