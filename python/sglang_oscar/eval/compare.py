"""The accuracy comparison: calibrate every method once, then PPL, NIAH and attention KL.

    python -m sglang_oscar.eval.compare --quick            # the README's main job: minutes on CPU
    python -m sglang_oscar.eval.compare --stage all        # the full table (about an hour on 2 cores)

Stages (so the slow ones can run in parallel processes, see scripts/accuracy_smollm2.sh):
    calibrate  capture Q/K/V once on the calibration text, fit every method's bundle
    ppl        teacher-forced perplexity (decode semantics) + per-layer attention KL
    niah       RULER-style NIAH (exact single-chunk prefill, INT2 decode), shared prefills
    report     merge into the JSON / markdown / PNG and print the table
    update     add or replace NIAH cells of a published report JSON from --out-dir's niah*.json (no model)
PPL at 2k and at 4k come from the same 4k windows: under causal attention the first 2048
positions of a 4096-token window are exactly a 2048-token window, so one forward gives both.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .. import __version__
from ..config import SERVED_RECENT, SERVED_SINK, CacheLayout, QuantFormat, default_group, max_k4_heads
from .niah import ALL_TASKS, ANSWER_RULES, UNSEEN_TASKS, make_samples, score_niah
from .niah import TASKS as NIAH_TASKS


def method_specs(head_dim: int) -> dict[str, dict]:
    """name -> dict(variant = fit_bundle kwargs (None: exact bf16), bits, desc, served_default)."""
    g = default_group(head_dim)  # the served group
    S = {}

    def add(name, desc, bits=2, served_default=False, **variant):
        S[name] = dict(desc=desc, bits=bits, variant=variant or None, served_default=served_default)

    S["bf16"] = dict(desc="exact KV (the model's own precision)", bits=16, variant=None, served_default=False)
    add("int2_naive", "INT2, no rotation, no clip", method="identity", clip=None, k_group=g, v_group=g)
    add("int2_hadamard_clip", "INT2, Hadamard (QuaRot-style) + per-layer clip", method="hadamard", clip="auto",
        k_group=g, v_group=g)
    add("int2_oscar_clip", "INT2, OSCAR U_Q·H / U_S·H (per layer) + per-layer clip", method="oscar", clip="auto",
        k_group=g, v_group=g)
    add("int4_hadamard", "INT4, Hadamard (SAW-INT4-style) + per-layer clip", bits=4, method="hadamard", clip="auto",
        k_group=g, v_group=g)
    add("int2_best", "served default: balanced K transform + K mean removal, OSCAR V, per-layer clip, INT4 keys "
        "on the quarter of the (layer, KV head) pairs INT2 keys disturb most, INT2 elsewhere, calibrated on windows of "
        "the model's context", served_default=True, method="balanced", center_k=True, clip="auto", k_group=g,
        v_group=g, k4_heads="served")
    return S


QUICK_METHODS = ("bf16", "int2_naive", "int2_hadamard_clip", "int2_oscar_clip", "int2_best")


def settings(quick: bool) -> dict:
    """calib_seq_len: calibration windows as long as the evaluated context. Post-RoPE keys rotate
    their slow RoPE pairs to phases that short windows never show; a K mean and transform fitted on
    2k windows lose the needle at 8k (docs/results/accuracy.md, "Diagnosis")."""
    if quick:
        return dict(calib_tokens=6144, seq_len=2048, heldout_tokens=2048, ppl_len=2048, ppl_windows=2,
                    niah_lengths=[2048], niah_per_task=10, niah_tasks=["niah_single_1", "niah_multikey_1"],
                    kl_windows=1, kl_len=2048)
    return dict(calib_tokens=32768, seq_len=8192, heldout_tokens=8192, ppl_len=8192, ppl_windows=4,
                niah_lengths=[2048, 4096, 8192], niah_per_task=50,
                niah_tasks=["niah_single_1", "niah_multikey_1", "niah_multivalue"], kl_windows=1, kl_len=4096)




def bits_per_element(spec: dict, num_layers: int, kv_heads: int) -> float:
    """Codes + float8 (scale, min) per element, averaged over K, V and the model's (layer, KV head) pairs (the served
    format's INT4-key heads included)."""
    if spec["variant"] is None:
        return 16.0
    kg, vg = spec["variant"]["k_group"], spec["variant"]["v_group"]
    k4 = spec["variant"].get("k4_heads", 0)
    k4 = max_k4_heads(num_layers, kv_heads) if k4 == "served" else int(k4)
    layout = CacheLayout(k=QuantFormat(spec["bits"], kg), v=QuantFormat(spec["bits"], vg), k4_heads=k4)
    return layout.bits_per_element(num_layers, kv_heads)


def bits_with_windows(spec: dict, context: int, num_layers: int, kv_heads: int) -> float:
    """Bits per element of a whole cache of `context` tokens: the BF16 sink and recent window
    (16 bits) plus the quantized rest (codes and per-group scale/min)."""
    if spec["variant"] is None:
        return 16.0
    exact = min(context, SERVED_SINK + SERVED_RECENT)
    return (16.0 * exact + bits_per_element(spec, num_layers, kv_heads) * (context - exact)) / context


def layers_of(bundle, bits: int):
    return [bundle.layer_quantizers(i, bits=bits) for i in range(bundle.num_layers)]


# ------------------------------------------------------------------------------------------ stages
SHIPPED_METHOD = "int2_best"  # the served default: the checkout's zoo holds it for the embedded model


def shipped_bundle(name: str, model_name: str, quick: bool) -> Optional[Path]:
    """The bundle that --quick uses instead of calibrating `name`: for the served default of the embedded model, the
    one a server without a rotation source serves (zoo.find_for_model in the checkout's zoo, calibrated with the full
    settings); else None."""
    from .. import zoo
    from ..models import DEFAULT_MODEL, SMOLLM2_REPO

    if not (quick and model_name == DEFAULT_MODEL and name == SHIPPED_METHOD):
        return None
    found = None
    if (zoo.PACKAGED_ZOO / zoo.INDEX).is_file():
        try:
            found = zoo.find_for_model(SMOLLM2_REPO, None, str(zoo.PACKAGED_ZOO))
        except zoo.ZooError as e:
            raise SystemExit(f"--quick uses the zoo's bundle for {SMOLLM2_REPO}: {e}") from None
    if found is None:
        raise SystemExit(f"--quick uses the zoo's bundle for {SMOLLM2_REPO}, but {zoo.PACKAGED_ZOO} has none (run "
                         "from a checkout, or drop --quick to calibrate it)")
    return found[1]


def stage_calibrate(model, tok, model_id, specs, cfg, out_dir: Path, progress: bool,
                    shipped: Optional[dict] = None) -> None:
    """Calibrate every quantized method once (one capture); `shipped` {name: bundle path} are copied
    from the zoo instead (validated against the model when loaded)."""
    import shutil

    from ..calibrate import calibrate_many, served_context
    from ..rotation import save_bundle

    shipped = shipped or {}
    variants = {n: dict(s["variant"], bits=s["bits"]) for n, s in specs.items()
                if s["variant"] is not None and n not in shipped}
    t = time.time()
    (out_dir / "bundles").mkdir(parents=True, exist_ok=True)
    info = dict(shipped={n: str(p) for n, p in shipped.items()})
    if variants:
        bundles, stats = calibrate_many(model, tok, variants, tokens=cfg["calib_tokens"], seq_len=cfg["seq_len"],
                                        heldout_tokens=cfg["heldout_tokens"], progress=progress, model_id=model_id,
                                        context=served_context(model, None))
        for name, b in bundles.items():
            save_bundle(b, out_dir / "bundles" / f"{name}.safetensors")
        info.update(tokens=stats.tokens, heldout_tokens=stats.heldout_tokens)
    for name, path in shipped.items():
        shutil.copyfile(path, out_dir / "bundles" / f"{name}.safetensors")
        print(f"[calibrate] {name}: the zoo's {path.name} (calibrated with the full settings)", flush=True)
    info["seconds"] = time.time() - t
    (out_dir / "calibrate.json").write_text(json.dumps(info, indent=1))


def _bundles(out_dir: Path, names):
    from ..rotation import load_bundle

    return {n: load_bundle(out_dir / "bundles" / f"{n}.safetensors") for n in names}


def _sims(specs, bundles, mode):
    from .simulator import MixedCacheSimulator

    return {n: (None if specs[n]["variant"] is None else
                MixedCacheSimulator(layers_of(bundles[n], specs[n]["bits"]), sink=SERVED_SINK, recent=SERVED_RECENT,
                                    mode=mode))
            for n in specs}


def stage_ppl(model, tok, specs, cfg, out_dir: Path, progress: bool) -> None:
    from ..data import EVAL_SOURCE, eval_text, token_windows
    from .attention_metrics import attention_errors
    from .ppl import perplexity

    bundles = _bundles(out_dir, [n for n in specs if specs[n]["variant"] is not None])
    source = cfg.get("ppl_text")
    text = eval_text() if source is None else Path(source).read_text(encoding="utf-8")
    text_name = EVAL_SOURCE if source is None else Path(source).name
    windows = token_windows(tok, text, cfg["ppl_len"], cfg["ppl_windows"])
    sims = _sims(specs, bundles, "decode")
    prefixes = tuple(n for n in (2048, 4096) if n < cfg["ppl_len"])
    res = {}
    for name, sim in sims.items():
        t = time.time()
        r = perplexity(model, windows, sim=sim, progress=progress, prefixes=prefixes)
        entry = {str(cfg["ppl_len"]): {k: v for k, v in r.items() if k != "prefix"}}
        for n in prefixes:
            entry[str(n)] = r["prefix"][n]
        res[name] = dict(ppl=entry, seconds=time.time() - t, text=text_name)
        print(f"[ppl] {name}: " + " ".join(f"@{k}={v['mean']:.3f}" for k, v in entry.items())
              + f" ({time.time() - t:.0f} s)", flush=True)
    kl_windows = token_windows(tok, text, cfg["kl_len"], cfg["kl_windows"], offset=cfg["ppl_len"] // 2)
    quantized = {n: layers_of(bundles[n], specs[n]["bits"]) for n in specs if specs[n]["variant"] is not None}
    kl = attention_errors(model, kl_windows, quantized, sink=SERVED_SINK, recent=SERVED_RECENT, progress=progress)
    for name in specs:
        res[name]["attn"] = kl.get(name, dict(kl_mean=0.0, relmse_mean=0.0, kl_per_layer=None, relmse_per_layer=None))
    (out_dir / "ppl.json").write_text(json.dumps(res, indent=1, default=_jsonable))


def stage_niah(model, tok, specs, cfg, out_dir: Path, progress: bool, tag: str = "") -> None:
    bundles = _bundles(out_dir, [n for n in specs if specs[n]["variant"] is not None])
    sims = _sims(specs, bundles, "prefill")
    res: dict = {n: {} for n in specs}
    for length in cfg["niah_lengths"]:
        for task in cfg.get("niah_tasks", NIAH_TASKS):
            t = time.time()
            first = cfg.get("niah_first", 0)
            samples = make_samples(tok, task, length, cfg["niah_per_task"], seed=length, first=first)

            def save(out, length=length, task=task, first=first):
                # after every sample, so a run cut short keeps the samples it finished
                for name in specs:
                    res[name].setdefault(str(length), {})[task] = dict(out[name], first=first)
                tmp = out_dir / f".niah{tag}.json.tmp"  # renamed into place: a kill mid-write leaves the last file
                tmp.write_text(json.dumps(res, indent=1, default=_jsonable))
                tmp.replace(out_dir / f"niah{tag}.json")

            out = score_niah(model, tok, samples, sims, progress=progress, on_sample=save,
                             answer=cfg.get("niah_answer", "first_line"))
            print(f"[niah] {task} @ {length}: " + " ".join(f"{n}={out[n]['score']:.0f}" for n in specs)
                  + f" ({time.time() - t:.0f} s)", flush=True)


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    raise TypeError(type(x))


# ------------------------------------------------------------------------------------------ report
def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def merge_niah(parts: list[dict]) -> dict:
    """{name: {length: {task: result}}} from several niah*.json, concatenating sample ranges.

    Each result covers samples first..first+n-1 (first absent: 0, files older than the field).
    Ranges of one (method, length, task) must not overlap nor differ in answer rule (niah.ANSWER_RULES;
    absent: first_line); they are joined in index order and the score is recomputed over all of them;
    `samples` holds each per_sample entry's sample index."""
    runs: dict = {}
    for part in parts:
        for name, by_len in part.items():
            for L, by_task in by_len.items():
                for task, r in by_task.items():
                    runs.setdefault((name, L, task), []).append(r)
    niah: dict = {}
    for (name, L, task), rs in runs.items():
        rules = {r.get("answer", "first_line") for r in rs}
        if len(rules) > 1:
            raise ValueError(f"NIAH results for {name} {task} @ {L} were scored under different answer rules "
                             f"{sorted(rules)}; merge files of one rule")
        rs = sorted(rs, key=lambda r: r.get("first", 0))
        for a, b in zip(rs, rs[1:]):
            if a.get("first", 0) + len(a["per_sample"]) > b.get("first", 0):
                raise ValueError(f"NIAH results overlap for {name} {task} @ {L}: samples from "
                                 f"{a.get('first', 0)} (n={len(a['per_sample'])}) and from {b.get('first', 0)}; "
                                 "remove one of the niah*.json files")
        per_sample = [x for r in rs for x in r["per_sample"]]
        niah.setdefault(name, {}).setdefault(L, {})[task] = dict(
            score=sum(per_sample) / len(per_sample), per_sample=per_sample,
            kept=[x for r in rs for x in r.get("kept", [])],
            predictions=[x for r in rs for x in r.get("predictions", [])], first=rs[0].get("first", 0),
            samples=[r.get("first", 0) + i for r in rs for i in range(len(r["per_sample"]))], answer=rules.pop())
    return niah


def ppl_delta_windows(ppl: dict, name: str, length: str) -> list[float]:
    """% change of `name`'s perplexity against bf16's on each window of `length` (ppl.json of the ppl stage): paired,
    the same windows under both, so window difficulty cancels."""
    return [100.0 * (q / b - 1.0) for q, b in zip(ppl[name]["ppl"][length]["per_window"],
                                                   ppl["bf16"]["ppl"][length]["per_window"], strict=True)]


def niah_scored_tasks(niah: dict) -> tuple[dict, dict]:
    """Per length, the tasks that count in the NIAH score: those bf16 solves at least once.

    A task the unquantized model fails (SmolLM2-135M on niah_multikey_2: 0 at 2k) cannot show
    quantization damage; averaging it in would only halve every method's score. Such tasks stay in
    niah_by_task and are listed as excluded. Without a bf16 run every task counts."""
    tasks: dict = {}
    for by_len in niah.values():
        for L, by_task in by_len.items():
            tasks.setdefault(L, set()).update(by_task)
    bf = niah.get("bf16", {})
    scored, excluded = {}, {}
    for L, ts in tasks.items():
        scored[L] = sorted(t for t in ts if L not in bf or t not in bf[L] or bf[L][t]["score"] > 0)
        excluded[L] = sorted(ts - set(scored[L]))
    return scored, excluded


def read_niah(out_dir: Path) -> dict:
    """merge_niah of every niah*.json in out_dir (one per NIAH process, e.g. per context length)."""
    return merge_niah([json.loads(f.read_text()) for f in sorted(out_dir.glob("niah*.json"))])


def paired_niah(mine: dict, bf: dict) -> dict:
    """A method's NIAH cell against bf16 on the same samples ({sample index: score} each, scores 0-100): n, the
    method's and bf16's score over the method's samples, % of bf16, and diff_se, the standard error of the paired
    per-sample difference (method - bf16, points; None with one sample), the cell's spread. Every one of the
    method's samples must have a bf16 score."""
    idx = sorted(mine)
    missing = [i for i in idx if i not in bf]
    if missing:
        raise ValueError(f"bf16 did not run samples {missing[:5]}")
    score = sum(mine[i] for i in idx) / len(idx)
    bscore = sum(bf[i] for i in idx) / len(idx)
    diffs = [mine[i] - bf[i] for i in idx]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return dict(n=len(idx), score=round(score, 2), bf16_score=round(bscore, 2),
                pct_of_bf16=round(100.0 * score / bscore, 1) if bscore > 0 else None,
                diff_se=None if se is None else round(se, 2))


def niah_cells(niah: dict) -> dict:
    """merge_niah's results as the report keeps them: {name: {length: {task: dict(score, n[, all_values]
    [, diff_se])}}}; all_values (multivalue tasks): % of samples that returned every value (per-sample score 100),
    beside the score (string_match_all: the share of the values returned, averaged); diff_se (paired_niah): where
    bf16 ran every one of the method's samples."""
    out: dict = {}
    for name, by_len in niah.items():
        for L, by_task in by_len.items():
            for t, r in by_task.items():
                c = dict(score=r["score"], n=len(r["per_sample"]))
                if "multivalue" in t:
                    c["all_values"] = 100.0 * sum(x >= 100.0 for x in r["per_sample"]) / len(r["per_sample"])
                bf = niah.get("bf16", {}).get(L, {}).get(t)
                if name != "bf16" and bf is not None and "samples" in r and "samples" in bf \
                        and set(r["samples"]) <= set(bf["samples"]):
                    c["diff_se"] = paired_niah(dict(zip(r["samples"], r["per_sample"])),
                                               dict(zip(bf["samples"], bf["per_sample"])))["diff_se"]
                out.setdefault(name, {}).setdefault(L, {})[t] = c
    return out


def niah_fields(cells: dict, name: str, scored: dict) -> dict:
    """One method's NIAH fields of the report from niah_cells of every method: the mean over the tasks bf16 solves
    per length, per task, sample counts, % of bf16, multivalue's all-values share, and the paired spread against bf16
    (niah_diff_se, points) where the cells have it."""
    mine, bfn = cells[name], cells.get("bf16", {})
    out = dict(niah={L: round(sum(v[t]["score"] for t in scored[L]) / len(scored[L]), 2)
                     for L, v in mine.items() if scored.get(L)},
               niah_by_task={L: {t: round(r["score"], 2) for t, r in v.items()} for L, v in mine.items()},
               niah_samples={L: {t: r["n"] for t, r in v.items()} for L, v in mine.items()},
               niah_pct_of_bf16={L: {t: round(100.0 * r["score"] / bfn[L][t]["score"], 1) for t, r in v.items()
                                     if bfn.get(L, {}).get(t, {}).get("score", 0) > 0} for L, v in mine.items()})
    allv = {L: {t: round(r["all_values"], 2) for t, r in v.items() if "all_values" in r} for L, v in mine.items()}
    allv = {L: v for L, v in allv.items() if v}
    if allv:
        out["niah_all_values"] = allv
    se = {L: {t: r["diff_se"] for t, r in v.items() if r.get("diff_se") is not None} for L, v in mine.items()}
    se = {L: v for L, v in se.items() if v}
    if se:
        out["niah_diff_se"] = se
    return out


def update_niah(report: dict, niah: dict, note: str) -> dict:
    """The report with NIAH cells replaced or added from merge_niah results (other cells, PPL and the rest kept):
    a published table gains tasks or lengths without re-running what it has. Each (method, length, task) in niah
    replaces the report's cell; every method's NIAH fields and the scored / excluded tasks are recomputed."""
    cells: dict = {}
    for name, m in report["methods"].items():
        for L, by_task in m.get("niah_by_task", {}).items():
            for t, score in by_task.items():
                c = dict(score=score, n=m["niah_samples"][L][t])
                for field, key in (("niah_all_values", "all_values"), ("niah_diff_se", "diff_se")):
                    if t in m.get(field, {}).get(L, {}):
                        c[key] = m[field][L][t]
                cells.setdefault(name, {}).setdefault(L, {})[t] = c
    unknown = sorted(set(niah) - set(report["methods"]))
    if unknown:
        raise SystemExit(f"NIAH results for methods the report does not have: {unknown}")
    for L, by_task in niah.get("bf16", {}).items():  # a new bf16 cell: the others' spreads were against the old one
        for name, by_len in cells.items():
            for t in by_task:
                by_len.get(L, {}).get(t, {}).pop("diff_se", None)
    for name, by_len in niah_cells(niah).items():
        for L, by_task in by_len.items():
            cells.setdefault(name, {}).setdefault(L, {}).update(by_task)
    scored, excluded = niah_scored_tasks(cells)
    missing = [f"{name} {t} @ {L}" for name, by_len in cells.items() for L, v in by_len.items()
               for t in scored.get(L, []) if t not in v]
    if missing:
        raise SystemExit(f"NIAH cells missing after the update (run every method of the report on the new cells): "
                         f"{', '.join(missing[:6])}")
    for name in cells:
        report["methods"][name].update(niah_fields(cells, name, scored))
    report["settings"]["niah_tasks_scored"] = scored
    report["settings"]["niah_tasks_excluded_bf16_fails"] = excluded
    report["environment"].setdefault("niah_updates", []).append(
        dict(commit=_git_commit(), date=time.strftime("%Y-%m-%d"), note=note,
             cells=sorted(f"{L}:{t}" for by_len in niah.values() for L, by_task in by_len.items() for t in by_task)))
    return report


def build_report(specs, cfg, out_dir: Path, model_id: str) -> dict:
    from ..data import CALIBRATION_SOURCE, EVAL_SOURCE
    from ..rotation import load_bundle

    ppl = json.loads((out_dir / "ppl.json").read_text())
    niah = niah_cells(read_niah(out_dir))
    scored, excluded = niah_scored_tasks(niah)
    calib = json.loads((out_dir / "calibrate.json").read_text())
    bundles = sorted((out_dir / "bundles").glob("*.safetensors"))
    shape = load_bundle(bundles[0]) if bundles else None
    num_layers, kv_heads = (shape.num_layers, shape.kv_heads) if shape else (1, 1)
    methods = {}
    for name, spec in specs.items():
        m = dict(description=spec["desc"], served_default=spec.get("served_default", False),
                 bits_per_element=round(bits_per_element(spec, num_layers, kv_heads), 4),
                 bits_per_element_8k_with_windows=round(bits_with_windows(spec, 8192, num_layers, kv_heads), 4),
                 group=None if spec["variant"] is None else spec["variant"]["k_group"], code_bits=spec["bits"])
        p = ppl[name]["ppl"]
        m["ppl"] = {k: round(v["mean"], 4) for k, v in p.items()}
        m["ppl_spread"] = {k: dict(std=round(v["std"], 4), min=round(v["min"], 4), max=round(v["max"], 4),
                                   per_window=[round(x, 4) for x in v["per_window"]]) for k, v in p.items()}
        if "bf16" in ppl:
            # Paired: the same windows under bf16 and this method. Window difficulty varies a lot
            # (the std above), the per-window ratio much less: this is the spread that compares methods.
            m["ppl_delta_pct"] = {}
            for k in p:
                d = torch.tensor(ppl_delta_windows(ppl, name, k), dtype=torch.float64)
                m["ppl_delta_pct"][k] = dict(mean=round(float(d.mean()), 3), std=round(float(d.std(unbiased=False)), 3),
                                             min=round(float(d.min()), 3), max=round(float(d.max()), 3))
        if name in niah and niah[name]:
            m.update(niah_fields(niah, name, scored))
        a = ppl[name]["attn"]
        m["attn_kl"] = a["kl_mean"]
        m["attn_relmse"] = a["relmse_mean"]
        if spec["variant"] is not None:
            b = load_bundle(out_dir / "bundles" / f"{name}.safetensors")
            m["clip_k"] = dict(min=float(b.k_clip.min()), max=float(b.k_clip.max()), mean=float(b.k_clip.mean()))
            m["clip_v"] = dict(min=float(b.v_clip.min()), max=float(b.v_clip.max()), mean=float(b.v_clip.mean()))
            m["fit"] = dict(method=b.method, composition=b.composition, per_head=b.per_head, center_k=b.center_k,
                            k_group=b.k_group, v_group=b.v_group)
        methods[name] = m
    return {
        "model": model_id,
        "settings": dict(sink=SERVED_SINK, recent=SERVED_RECENT,
                         ppl_semantics="decode (every position reads the INT2 history beyond sink/recent, teacher "
                         "forced)", niah_semantics="exact single-chunk prefill, INT2 "
                         "decode (server semantics)",
                         niah_tasks_scored=scored, niah_tasks_excluded_bf16_fails=excluded,
                         calibration_source=CALIBRATION_SOURCE,
                         eval_source=EVAL_SOURCE, calibration_tokens_used=calib.get("tokens"),
                         heldout_tokens_used=calib.get("heldout_tokens"), shipped_bundles=calib.get("shipped", {}),
                         **cfg),
        "methods": methods,
        "environment": dict(python=platform.python_version(), torch=torch.__version__, sglang_oscar=__version__,
                            commit=_git_commit(), date=time.strftime("%Y-%m-%d")),
    }


def format_table(report: dict) -> str:
    ms = report["methods"]
    ppl_keys = sorted({k for m in ms.values() for k in m["ppl"]}, key=int)
    niah_keys = sorted({k for m in ms.values() for k in m.get("niah", {})}, key=int)
    head = ["method", "bits"] + [f"PPL@{int(k)//1024}k" for k in ppl_keys] + [f"Δ@{int(k)//1024}k" for k in ppl_keys] \
        + [f"NIAH@{int(k)//1024}k" for k in niah_keys] + ["attn KL"]
    rows = []
    for name, m in ms.items():
        r = [name, f"{m['bits_per_element']:.2f}"]
        r += [f"{m['ppl'][k]:.2f}±{m['ppl_spread'][k]['std']:.2f}" for k in ppl_keys]
        r += [f"{m['ppl_delta_pct'][k]['mean']:+.1f}±{m['ppl_delta_pct'][k]['std']:.1f}%" if "ppl_delta_pct" in m
              else "" for k in ppl_keys]
        r += [f"{m['niah'][k]:.0f}" if k in m.get("niah", {}) else "" for k in niah_keys]
        r += [f"{m['attn_kl']:.4f}"]
        rows.append(r)
    w = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(x.ljust(w[i]) for i, x in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in rows])


LEGEND = ("bits: codes + float8 scale/min per group, averaged over K, V and the layers (the BF16 sink + recent window "
          "add to this: bits_per_element_8k_with_windows in the JSON). PPL: teacher-forced, every position "
          "reads the INT2 history (mean ± std over windows); Δ: paired per-window change against bf16. "
          "NIAH: % of samples answered (single, multikey) and RULER's string_match_all for multivalue (the "
          "share of the needle's values returned, averaged; niah_all_values in the JSON: % of samples with "
          "every value), averaged over the tasks bf16 solves (quantized methods: kept bf16's answer, a lower "
          "bound of their greedy score). attn KL: mean "
          "KL(exact || quantized) of the attention probabilities.")


def verdict(report: dict) -> str:
    """One line per target for the served default (PPL <= +5%, NIAH >= 90% of bf16 in every
    task and length) and one for naive INT2 (visibly broken)."""
    ms = report["methods"]
    lines = []
    for name, m in ms.items():
        if not m.get("served_default"):
            continue
        if "ppl_delta_pct" in m:
            worst = max(m["ppl_delta_pct"], key=lambda k: m["ppl_delta_pct"][k]["mean"])
            d = m["ppl_delta_pct"][worst]["mean"]
            lines.append(f"verdict: {name} (served default) PPL {d:+.1f}% over bf16 at {int(worst) // 1024}k, worst "
                         f"length (target <= +5%: {'met' if d <= 5 else 'MISSED'})")
        cells = [(v, L, t) for L, by in m.get("niah_pct_of_bf16", {}).items() for t, v in by.items()]
        if cells:
            v, L, t = min(cells)
            lines.append(f"verdict: {name} (served default) NIAH {v:.0f}% of bf16 at its worst cell ({t} @ "
                         f"{int(L) // 1024}k; {len(cells)} cells; target >= 90%: {'met' if v >= 90 else 'MISSED'})")
    if "int2_naive" in ms and "niah" in ms["int2_naive"]:
        n = ms["int2_naive"]
        worst = max(n["niah"].values())
        lines.append(f"verdict: int2_naive NIAH <= {worst:.0f} at every length "
                     f"({'visibly broken' if worst < 50 else 'NOT visibly broken'})")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = report["methods"]
    names = list(ms)
    k = max((k for k in ms["bf16"]["ppl"]), key=int)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    ppl = [ms[n]["ppl"][k] for n in names]
    err = [ms[n]["ppl_spread"][k]["std"] for n in names]
    axes[0].barh(names, ppl, xerr=err, color=["tab:green" if n == "bf16" else "tab:blue" for n in names])
    axes[0].axvline(ms["bf16"]["ppl"][k] * 1.05, color="r", ls="--", label="bf16 + 5% (target)")
    axes[0].set_xscale("log")
    axes[0].set_xlabel(f"perplexity @ {int(k) // 1024}k (mean ± std over windows, log scale)")
    axes[0].legend()
    axes[0].invert_yaxis()
    if all("niah" in ms[n] for n in names):
        lengths = sorted(ms["bf16"]["niah"], key=int)
        width = 0.8 / len(lengths)
        for i, L in enumerate(lengths):
            axes[1].barh([j + i * width for j in range(len(names))],
                         [ms[n]["niah"].get(L, float("nan")) for n in names], height=width,
                         label=f"{int(L) // 1024}k")  # NaN (not run at this length): no bar
        axes[1].set_yticks([j + width * (len(lengths) - 1) / 2 for j in range(len(names))], names)
        axes[1].set_xlabel("NIAH score (string_match_all, %)")
        axes[1].legend()
        axes[1].invert_yaxis()
    fig.suptitle(f"{report['model']}: INT2 KV (sink {SERVED_SINK}, recent {SERVED_RECENT})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help='"smollm2" (embedded default), a .gguf or an HF directory')
    ap.add_argument("--quick", action="store_true", help="small settings and 5 methods (the README's main job)")
    ap.add_argument("--stage", default="all", choices=("all", "calibrate", "ppl", "niah", "report", "update"))
    ap.add_argument("--note", default="", help="update: where the new NIAH results come from (kept in the JSON)")
    ap.add_argument("--methods", default=None, help="comma-separated subset of methods")
    ap.add_argument("--out-dir", default=None, help="working directory (bundles, partial results)")
    ap.add_argument("--json", default=None, help="write the report JSON here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--plot", default=None, help="write the PNG plot here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--niah-lengths", default=None, help="comma-separated context lengths (niah stage)")
    ap.add_argument("--ppl-text", default=None,
                    help="ppl stage: a UTF-8 text file to score instead of the Language Reference (text no fit has seen); "
                         "needs ppl windows x 8192 tokens")
    ap.add_argument("--niah-tasks", default=None,
                    help=f"comma-separated NIAH tasks (default {NIAH_TASKS}; formats no fit has seen: {UNSEEN_TASKS})")
    ap.add_argument("--niah-per-task", type=int, default=None, help="samples per task and length")
    ap.add_argument("--niah-first", type=int, default=0,
                    help="index of the first NIAH sample (extend an earlier run with disjoint samples)")
    ap.add_argument("--niah-answer", default="first_line", choices=ANSWER_RULES,
                    help="what a NIAH answer is scored on: its first line, or the whole answer (RULER's rule: a "
                         "list of values, one per line, counts)")
    ap.add_argument("--niah-tag", default="", help="suffix of the niah result file (parallel niah processes)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the full table takes minutes on one GPU)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stage == "update":
        return update_main(args)
    from ..models import attention_shape, load_model

    cfg = settings(args.quick)
    if args.niah_lengths:
        cfg["niah_lengths"] = [int(x) for x in args.niah_lengths.split(",")]
    if args.niah_tasks:
        cfg["niah_tasks"] = args.niah_tasks.split(",")
        bad = [t for t in cfg["niah_tasks"] if t not in ALL_TASKS]
        if bad:
            raise SystemExit(f"unknown NIAH tasks {bad}; choose from {ALL_TASKS}")
    if args.niah_per_task:
        cfg["niah_per_task"] = args.niah_per_task
    cfg["niah_first"] = args.niah_first
    cfg["niah_answer"] = args.niah_answer
    if args.ppl_text is not None:
        if not Path(args.ppl_text).is_file():
            raise SystemExit(f"--ppl-text {args.ppl_text}: no such file (a UTF-8 text file to score perplexity on)")
        cfg["ppl_text"] = args.ppl_text
    out_dir = Path(args.out_dir or ("runs/accuracy_quick" if args.quick else "runs/accuracy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.quick:  # the README's main job leaves a file and a plot a user can open
        args.json = args.json or str(out_dir / "report.json")
        args.plot = args.plot or str(out_dir / "report.png")
    progress = not args.quiet
    model, tok, model_id = load_model(args.model, device=args.device)
    specs = method_specs(attention_shape(model)["head_dim"])
    wanted = args.methods.split(",") if args.methods else (list(QUICK_METHODS) if args.quick else list(specs))
    unknown = [m for m in wanted if m not in specs]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {list(specs)}")
    specs = {n: specs[n] for n in wanted}
    stages = ["calibrate", "ppl", "niah", "report"] if args.stage == "all" else [args.stage]
    for st in stages:
        t = time.time()
        if st == "calibrate":
            shipped = {n: p for n in specs if (p := shipped_bundle(n, args.model, args.quick)) is not None}
            stage_calibrate(model, tok, model_id, specs, cfg, out_dir, progress, shipped)
        elif st == "ppl":
            stage_ppl(model, tok, specs, cfg, out_dir, progress)
        elif st == "niah":
            stage_niah(model, tok, specs, cfg, out_dir, progress, tag=args.niah_tag)
        else:
            write_report(build_report(specs, cfg, out_dir, model_id), args)
        print(f"[{st}] done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return 0


def write_report(report: dict, args) -> None:
    """Print the table, legend and verdict; write the JSON, markdown table and plot where asked."""
    table = format_table(report)
    print(table)
    print("legend: " + LEGEND)
    print(verdict(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(table + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    for what, path in (("JSON", args.json), ("table", args.md), ("plot", args.plot)):
        if path:
            print(f"wrote {what}: {path}")


def update_main(args) -> int:
    """--stage update: the report in --json gains the NIAH cells of --out-dir's niah*.json (update_niah), in place;
    no model is loaded."""
    if not args.json or not Path(args.json).is_file():
        raise SystemExit("--stage update needs --json: the published report to update (e.g. "
                         "benchmark/results/accuracy_smollm2.json)")
    out_dir = Path(args.out_dir or "runs/accuracy")
    if not any(out_dir.glob("niah*.json")):
        raise SystemExit(f"--stage update: no niah*.json in {out_dir}")
    if not args.note:
        raise SystemExit("--stage update needs --note: where the new NIAH results come from (device, command)")
    report = json.loads(Path(args.json).read_text())
    write_report(update_niah(report, read_niah(out_dir), args.note), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
