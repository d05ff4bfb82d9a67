"""The comparison driver's report: JSON shape required by the accuracy issue, paired deltas, table."""

import json

import pytest

import torch

from sglang_oscar.eval import compare
from sglang_oscar.rotation import data_free_bundle, save_bundle


def _ppl(per_window):
    t = torch.tensor(per_window)
    return dict(mean=float(t.mean()), per_window=per_window, std=float(t.std(unbiased=False)),
                min=float(t.min()), max=float(t.max()))


def test_report_shape_and_paired_delta(tmp_path):
    all_specs = compare.method_specs(64)
    assert [n for n, s in all_specs.items() if s["served_default"]] == ["int2_best"]  # exactly one default
    assert set(all_specs) >= {"bf16", "int2_naive", "int2_hadamard_clip", "int2_oscar_clip", "int4_hadamard"}
    specs = {n: dict(s) for n, s in all_specs.items() if n in ("bf16", "int2_hadamard_clip", "int4_hadamard")}
    specs["int2_hadamard"] = dict(specs.pop("int2_hadamard_clip"), served_default=True)
    assert specs["int2_hadamard"]["variant"]["k_group"] == 64
    (tmp_path / "bundles").mkdir()
    for name in ("int2_hadamard", "int4_hadamard"):
        bits = specs[name]["bits"]
        save_bundle(data_free_bundle("hadamard", 2, 1, 64, 64, 64, bits=bits), tmp_path / "bundles" / f"{name}.safetensors")
    attn = dict(kl_mean=0.1, relmse_mean=0.2, kl_per_layer=[0.1, 0.1], relmse_per_layer=[0.2, 0.2])
    ppl = {
        "bf16": dict(ppl={"2048": _ppl([10.0, 20.0])}, attn=dict(attn, kl_mean=0.0, relmse_mean=0.0)),
        "int2_hadamard": dict(ppl={"2048": _ppl([11.0, 22.0])}, attn=attn),
        "int4_hadamard": dict(ppl={"2048": _ppl([10.1, 20.4])}, attn=attn),
    }
    niah = {n: {"2048": {t: dict(score=s, per_sample=[s, s]) for t in compare.NIAH_TASKS}}
            for n, s in (("bf16", 100.0), ("int2_hadamard", 50.0), ("int4_hadamard", 100.0))}
    (tmp_path / "ppl.json").write_text(json.dumps(ppl))
    # two NIAH result files (parallel processes) are merged
    (tmp_path / "niah.json").write_text(json.dumps({n: {"2048": {"niah_single_1": v["2048"]["niah_single_1"]}}
                                                    for n, v in niah.items()}))
    (tmp_path / "niah_mk.json").write_text(json.dumps({n: {"2048": {"niah_multikey_2": v["2048"]["niah_multikey_2"]}}
                                                       for n, v in niah.items()}))
    (tmp_path / "calibrate.json").write_text(json.dumps(dict(tokens=100, heldout_tokens=10)))
    cfg = compare.settings(quick=True)
    rep = compare.build_report(specs, cfg, tmp_path, "tiny")
    assert rep["settings"]["sink"] == 64 and rep["settings"]["recent"] == 256
    m = rep["methods"]["int2_hadamard"]
    assert m["bits_per_element"] == 2.25 and m["group"] == 64  # float8 (scale, min) per 64
    assert rep["methods"]["int4_hadamard"]["bits_per_element"] == 4.25
    assert m["ppl"]["2048"] == 16.5 and m["niah"]["2048"] == 50.0
    assert m["niah_samples"] == {"2048": {"niah_single_1": 2, "niah_multikey_2": 2}}
    assert m["niah_pct_of_bf16"] == {"2048": {"niah_single_1": 50.0, "niah_multikey_2": 50.0}}
    assert m["served_default"] and not rep["methods"]["int4_hadamard"]["served_default"]
    # the BF16 sink + recent window (320 of 8192 tokens at 16 bits) count in the whole-cache bits
    assert abs(m["bits_per_element_8k_with_windows"] - (320 * 16 + 7872 * 2.25) / 8192) < 1e-3
    # the served spec's INT4-key heads: a quarter of the (layer, KV head) pairs -> 2.5 bits at groups of 64
    assert compare.bits_per_element(all_specs["int2_best"], 30, 3) == pytest.approx(2.25 + 22 / 90)
    assert compare.bits_per_element(all_specs["int2_best"], 36, 8) == 2.5
    v = compare.verdict(rep)
    assert "int2_hadamard (served default) PPL +10.0%" in v and "MISSED" in v
    assert "NIAH 50% of bf16" in v
    # paired delta: both windows +10% -> mean 10, std 0 (the unpaired std would be large)
    assert abs(m["ppl_delta_pct"]["2048"]["mean"] - 10.0) < 1e-6 and m["ppl_delta_pct"]["2048"]["std"] < 1e-6
    assert m["attn_kl"] == 0.1 and m["clip_k"]["max"] == 1.0
    table = compare.format_table(rep)
    assert "int2_hadamard" in table and "+10.0±0.0%" in table
    compare.plot(rep, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_merge_niah_joins_disjoint_sample_ranges_and_rejects_overlap():
    a = {"m": {"2048": {"niah_single_1": dict(score=100.0, per_sample=[100.0, 100.0], predictions=["1", "2"])}}}
    b = {"m": {"2048": {"niah_single_1": dict(score=0.0, per_sample=[0.0, 0.0], predictions=["3", "4"], first=2)}}}
    merged = compare.merge_niah([b, a])  # order of files does not matter, sample index does
    r = merged["m"]["2048"]["niah_single_1"]
    assert r["per_sample"] == [100.0, 100.0, 0.0, 0.0] and r["predictions"] == ["1", "2", "3", "4"]
    assert r["score"] == 50.0 and r["samples"] == [0, 1, 2, 3]
    gap = {"m": {"2048": {"niah_single_1": dict(score=0.0, per_sample=[0.0], predictions=["9"], first=7)}}}
    assert compare.merge_niah([a, gap])["m"]["2048"]["niah_single_1"]["samples"] == [0, 1, 7]
    c = {"m": {"2048": {"niah_single_1": dict(score=0.0, per_sample=[0.0], predictions=["x"], first=1)}}}
    with pytest.raises(ValueError, match="overlap"):
        compare.merge_niah([a, c])
    assert r["answer"] == "first_line"  # files without the field were scored on the first line
    whole = {"m": {"2048": {"niah_single_1": dict(score=0.0, per_sample=[0.0], predictions=["y"], first=5,
                                                  answer="whole")}}}
    with pytest.raises(ValueError, match="different answer rules"):
        compare.merge_niah([a, whole])
    assert compare.merge_niah([whole])["m"]["2048"]["niah_single_1"]["answer"] == "whole"


def test_niah_score_excludes_tasks_bf16_fails():
    r = lambda s: dict(score=s, per_sample=[s])  # noqa: E731
    niah = {"bf16": {"2048": {"niah_single_1": r(100.0), "niah_multikey_2": r(0.0)}, "4096": {"niah_single_1": r(90.0)}},
            "int2": {"2048": {"niah_single_1": r(60.0), "niah_multikey_2": r(0.0)}, "4096": {"niah_single_1": r(30.0)}}}
    scored, excluded = compare.niah_scored_tasks(niah)
    assert scored == {"2048": ["niah_single_1"], "4096": ["niah_single_1"]}
    assert excluded == {"2048": ["niah_multikey_2"], "4096": []}


def test_update_adds_niah_cells_to_a_published_report(tmp_path):
    """--stage update: new cells replace or join the report's, the rest (PPL, other cells) stays; the mean, % of
    bf16, sample counts, the scored / excluded tasks and multivalue's all-values share are recomputed."""
    def method(by_task, n):
        return dict(bits_per_element=2.5, ppl={"8192": 10.0}, ppl_spread={"8192": dict(std=1.0)}, attn_kl=0.1, niah={L: sum(v.values()) / len(v) for L, v in by_task.items()},
                    niah_by_task=by_task, niah_samples={L: {t: n for t in v} for L, v in by_task.items()})

    report = dict(settings={}, environment={}, methods=dict(
        bf16=method({"2048": {"niah_single_1": 100.0}, "4096": {"niah_single_1": 96.0}}, 25),
        int2=method({"2048": {"niah_single_1": 70.0}, "4096": {"niah_single_1": 48.0}}, 25)))
    mv = lambda per: dict(score=sum(per) / len(per), per_sample=per, samples=list(range(len(per))))  # noqa: E731
    new = {"bf16": {"4096": {"niah_single_1": mv([100.0] * 3 + [0.0]), "niah_multivalue": mv([100.0, 75.0, 25.0, 0.0])},
                    "8192": {"niah_multivalue": mv([0.0, 0.0])}},
           "int2": {"4096": {"niah_single_1": mv([100.0, 100.0, 0.0, 0.0]), "niah_multivalue": mv([100.0, 0, 0, 0])},
                    "8192": {"niah_multivalue": mv([0.0, 0.0])}}}
    out = compare.update_niah(json.loads(json.dumps(report)), new, "test run")
    b, q = out["methods"]["bf16"], out["methods"]["int2"]
    assert q["ppl"] == {"8192": 10.0} and q["niah_by_task"]["2048"] == {"niah_single_1": 70.0}  # kept
    assert q["niah_by_task"]["4096"] == {"niah_single_1": 50.0, "niah_multivalue": 25.0}  # replaced and added
    assert q["niah_samples"]["4096"] == {"niah_single_1": 4, "niah_multivalue": 4} and q["niah_samples"]["2048"] == {
        "niah_single_1": 25}
    assert q["niah"]["4096"] == 37.5 and b["niah"]["4096"] == 62.5
    assert q["niah_pct_of_bf16"]["4096"] == {"niah_single_1": round(100 * 50 / 75, 1), "niah_multivalue": 50.0}
    assert b["niah_all_values"] == {"4096": {"niah_multivalue": 25.0}, "8192": {"niah_multivalue": 0.0}}
    assert q["niah_all_values"]["4096"] == {"niah_multivalue": 25.0}
    # the paired spread: per-sample differences [0, 0, -100, 0] and [0, -75, -25, 0] against bf16's same samples
    assert q["niah_diff_se"] == {"4096": {"niah_single_1": 25.0, "niah_multivalue": 17.68}, "8192": {
        "niah_multivalue": 0.0}} and "niah_diff_se" not in b
    # bf16 solves no 8k multivalue sample: the task is listed as excluded and 8k has no mean
    assert out["settings"]["niah_tasks_excluded_bf16_fails"]["8192"] == ["niah_multivalue"]
    assert "8192" not in q["niah"] and q["niah_pct_of_bf16"]["8192"] == {}
    assert out["environment"]["niah_updates"][0]["note"] == "test run"
    assert "4096:niah_multivalue" in out["environment"]["niah_updates"][0]["cells"]
    # an updated report updates again: the all-values share of kept cells survives
    again = compare.update_niah(out, {"bf16": {"2048": {"niah_single_1": mv([100.0])}}}, "again")
    assert again["methods"]["bf16"]["niah_all_values"]["4096"] == {"niah_multivalue": 25.0}
    assert again["methods"]["int2"]["niah_diff_se"] == q["niah_diff_se"]  # and so do the spreads
    # a new bf16 cell: the spread measured against the old one is dropped, the others stay
    rebf = compare.update_niah(json.loads(json.dumps(out)), {"bf16": {"4096": {"niah_single_1": mv([0.0] * 4)}}}, "b")
    assert rebf["methods"]["int2"]["niah_diff_se"]["4096"] == {"niah_multivalue": 17.68}
    with pytest.raises(SystemExit, match="int2 niah_multikey_1 @ 2048"):  # a new task for bf16 only
        compare.update_niah(json.loads(json.dumps(out)), {"bf16": {"2048": {"niah_multikey_1": mv([100.0])}}}, "x")
    with pytest.raises(SystemExit, match="does not have"):
        compare.update_niah(out, {"int9": {"2048": {"niah_single_1": mv([0.0])}}}, "x")
    # the CLI: refuses without --json / --note, rewrites the JSON in place
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    (tmp_path / "niah_new.json").write_text(json.dumps(new))
    with pytest.raises(SystemExit, match="--note"):
        compare.main(["--stage", "update", "--json", str(path), "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--json"):
        compare.main(["--stage", "update", "--out-dir", str(tmp_path), "--note", "n"])
    assert compare.main(["--stage", "update", "--json", str(path), "--out-dir", str(tmp_path), "--note", "n"]) == 0
    assert json.loads(path.read_text())["methods"]["int2"]["niah"]["4096"] == 37.5


def test_quick_uses_the_shipped_default_bundle(tmp_path):
    from sglang_oscar.rotation import load_bundle

    p = compare.shipped_bundle("int2_best", "smollm2", quick=True)
    assert p is not None and p.is_file()
    b = load_bundle(p)
    assert b.method == "balanced" and b.center_k and b.k_group == 64 and b.num_layers == 30
    # the zoo bundle covers the model's whole context (8k windows or RoPE offsets up to 8k)
    cal = b.calibration
    assert max(cal.get("seq_len") or 0, cal.get("context") or 0) >= 8192, cal
    assert compare.shipped_bundle("int2_best", "smollm2", quick=False) is None
    assert compare.shipped_bundle("int2_best", "other.gguf", quick=True) is None
    assert compare.shipped_bundle("int2_naive", "smollm2", quick=True) is None


def test_niah_exact_summary_pairs_bf16_on_the_methods_own_samples(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "niah_exact_summary", Path(__file__).parent.parent / "benchmark" / "niah_exact_summary.py")
    summary_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary_mod)
    cell = lambda ps, first: {"niah_multivalue": dict(score=0.0, per_sample=ps, first=first)}  # noqa: E731
    (tmp_path / "niah_a.json").write_text(json.dumps({"bf16": {"4096": cell([100.0, 50.0, 100.0, 0.0], 0)},
                                                      "q": {"4096": cell([50.0], 1)}}))
    (tmp_path / "niah_b.json").write_text(json.dumps({"q": {"4096": cell([100.0], 3)}}))
    files = sorted(tmp_path.glob("niah*.json"))
    s = summary_mod.summarise(summary_mod.read_runs(files)[0])["niah_multivalue"]["4096"]
    assert s["q"]["n"] == 2 and s["q"]["score"] == 75.0
    assert s["q"]["bf16_score"] == 25.0 and s["q"]["pct_of_bf16"] == 300.0  # bf16 on samples 1 and 3 only
    assert s["q"]["diff_se"] == 50.0  # diffs 0 and +100: stdev 70.71 / sqrt(2)
    (tmp_path / "niah_c.json").write_text(json.dumps({"q": {"4096": cell([0.0], 1)}}))
    with pytest.raises(SystemExit, match="overlap"):
        summary_mod.read_runs(sorted(tmp_path.glob("niah*.json")))
    (tmp_path / "niah_c.json").write_text(json.dumps({"r": {"4096": {"niah_multivalue": dict(
        score=0.0, per_sample=[0.0], first=0, answer="whole")}}}))
    with pytest.raises(SystemExit, match="mix answer rules"):
        summary_mod.read_runs(sorted(tmp_path.glob("niah*.json")))
    (tmp_path / "niah_c.json").unlink()
    assert summary_mod.read_runs(sorted(tmp_path.glob("niah*.json")))[1] == "first_line"  # files without the field


def test_bad_niah_task_and_missing_ppl_text_fail_before_the_model_loads(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model must not load for a bad argument")

    from sglang_oscar import models

    monkeypatch.setattr(models, "load_model", no_model)
    with pytest.raises(SystemExit, match="unknown NIAH tasks"):
        compare.main(["--stage", "niah", "--out-dir", str(tmp_path), "--niah-tasks", "niah_essay"])
    with pytest.raises(SystemExit, match="no such file"):
        compare.main(["--stage", "ppl", "--out-dir", str(tmp_path), "--ppl-text", str(tmp_path / "missing.txt")])


def test_unseen_text_is_not_calibration_text_and_ppl_deltas_pair_windows():
    import importlib.util
    from pathlib import Path

    from sglang_oscar.data import CALIBRATION_MODULES, calibration_text

    spec = importlib.util.spec_from_file_location(
        "unseen_text", Path(__file__).parent.parent / "benchmark" / "unseen_text.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not set(mod.MODULES) & set(CALIBRATION_MODULES)
    text = mod.unseen_source()
    assert len(text) > 200_000 and "class ConfigParser" in text
    assert text[1000:1200] not in calibration_text()
    ppl = {"bf16": {"ppl": {"4096": dict(mean=5.0, per_window=[4.0, 6.0])}},
           "q": {"ppl": {"4096": dict(mean=5.3, per_window=[4.4, 6.06])}}}
    d = mod.ppl_deltas(ppl)["q"]["4096"]
    assert d["delta_pct_windows"] == [10.0, 1.0] and d["delta_pct"] == 5.5 and d["bf16"] == 5.0


def test_paired_niah_spread_and_refusals():
    c = compare.paired_niah({0: 100.0, 1: 0.0, 2: 100.0}, {0: 100.0, 1: 100.0, 2: 100.0, 3: 0.0})
    assert (c["n"], c["score"], c["bf16_score"], c["pct_of_bf16"]) == (3, 66.67, 100.0, 66.7)
    assert c["diff_se"] == round(57.735 / 3 ** 0.5, 2)  # differences [0, -100, 0]
    assert compare.paired_niah({5: 50.0}, {5: 0.0}) == dict(n=1, score=50.0, bf16_score=0.0, pct_of_bf16=None,
                                                           diff_se=None)
    with pytest.raises(ValueError, match=r"bf16 did not run samples \[7\]"):
        compare.paired_niah({7: 100.0}, {0: 100.0})
