"""Where a CUDA history call spends its time inside the kernel, warp by warp: a build of kernels/cuda/int2_history.cu
with OSCAR_HISTORY_TRACE, in which lane 0 of every warp stores %globaltimer and clock64 at seven marks (entry; the
index chain done: seq_lens, req_pool_indices, ring_start; block 0's copies issued: its req_to_token slots landed;
q's operands built; block 0's data landed; the loop done; the CTA's partial stored), its SM, split and block count.

Why: at Qwen3-8B 64k batch 1 the history kernel alone takes ~27 us for ~42 MB, ~16 us of which its loop's batch-32
rate explains, and the split sweeps fit time = ~16 us + ~13 us x (the largest share of rows on one SM)
(benchmark/NOTES.md). Kernel-level timelines (probe_chain_timeline.py) cannot say whether that fixed part is CTA
dispatch, the index chain, the first data, the loop's tail or the CTA merge; this can.

Each configuration is timed with every source's plain build in interleaved rounds (--sources: a same-call A/B of
kernel sources, stage counts, window rows, the folded window (+F0 / +F1) or macros) and once with its trace build
(the marks' cost), then one CUDA-graph replay of the trace build is read back: the last call of the replay (every
call of a replay writes the same slots). No SGLang or FlashInfer needed (kernels only).

    python benchmark/probe_history_trace.py --configs alone:65536:1:auto,alone:65536:1:16,chain:65536:1:auto

Writes $OUT/probe_history_trace_<tag>_<device>.json: per configuration and source the us per call (interleaved
rounds) of the plain build and of the trace build, and a summary of the phases (median / p10 / p90 / max, us);
with --raw also the offsets of each warp, with its SM, split and column (for plots and per-SM analysis).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import math
import os
import sys
from typing import Optional

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

MARKS = ("entry", "index", "slots", "q", "first", "loop", "end")
WORDS = 16  # per warp: words 2i, 2i + 1 = mark i's (globaltimer ns, clock64); 14 meta; 15 CTA column


def decode_meta(meta):
    """(smid, split or -1, nblocks, window CTA) from meta words (uint64 array)."""
    meta = meta.astype(np.uint64)
    smid = (meta & np.uint64(0xFF)).astype(np.int64)
    split = ((meta >> np.uint64(8)) & np.uint64(0xFFFF)).astype(np.int64) - 1
    nblocks = ((meta >> np.uint64(24)) & np.uint64(0xFFFF)).astype(np.int64)
    window = ((meta >> np.uint64(40)) & np.uint64(1)).astype(bool)
    return smid, split, nblocks, window


def _stats(x):
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return None
    return dict(median=float(np.median(x)), p10=float(np.percentile(x, 10)), p90=float(np.percentile(x, 90)),
                min=float(x.min()), max=float(x.max()))


def summarize(words: np.ndarray, warps_per_cta: int) -> dict:
    """Phase statistics (us) of one traced call from its trace words ([n_warps, 16] uint64, zero rows = warps that
    did not run). Offsets are from the first warp's entry. History warps: entry offset, then each phase between
    consecutive marks; window CTAs: entry and end offsets. Also the span (first entry to last end), the warp that
    ends last with its phases, the history CTAs per SM, and the loop's us per block after block 0."""
    words = np.asarray(words, dtype=np.uint64).reshape(-1, WORDS)
    live = words[:, 14] != 0
    w = words[live]
    if not len(w):
        raise ValueError("no traced warps: was the trace build launched?")
    smid, split, nblocks, window = decode_meta(w[:, 14])
    gt = w[:, 0:14:2].astype(np.int64)  # [n, 7] ns
    ck = w[:, 1:14:2].astype(np.int64)
    off = (gt - gt[:, 0].min()) / 1e3  # us from the first entry
    hist = ~window & (nblocks > 0)  # a history warp without rows never takes the "first" mark
    out = dict(warps=int(len(w)), history_warps=int(hist.sum()), window_warps=int(window.sum()),
               empty_history_warps=int((~window & (nblocks == 0)).sum()),
               span_us=float(off[:, 6].max()), history_end=_stats(off[hist, 6]),
               entry=_stats(off[hist, 0]))
    phases = {}
    for i in range(1, 7):
        if i == 5:  # loop: from block 0's data to the loop's end
            d = off[hist, 5] - off[hist, 4]
        else:
            d = off[hist, i] - off[hist, i - 1]
        phases[f"{MARKS[i - 1]}->{MARKS[i]}"] = _stats(d)
    out["phases"] = phases
    if window.any():
        out["window_entry"] = _stats(off[window, 0])
        out["window_end"] = _stats(off[window, 6])
    nb = nblocks[hist]
    many = nb > 1
    if many.any():
        out["loop_us_per_block"] = _stats((off[hist, 5] - off[hist, 4])[many] / (nb[many] - 1))
    out["nblocks"] = _stats(nb)
    # the SM clock over each warp's life (clock64 cycles per ns), and the globaltimer's smallest step seen
    life_ns = gt[:, 6] - gt[:, 0]
    ok = life_ns > 0
    out["sm_ghz"] = float(np.median((ck[ok, 6] - ck[ok, 0]) / life_ns[ok])) if ok.any() else None
    steps = np.diff(np.unique(gt.ravel()))
    out["globaltimer_min_step_ns"] = int(steps[steps > 0].min()) if (steps > 0).any() else None
    last = int(np.argmax(off[:, 6]))
    out["last_warp"] = dict(window=bool(window[last]), smid=int(smid[last]), split=int(split[last]),
                            nblocks=int(nblocks[last]), offsets=[round(float(x), 3) for x in off[last]])
    # history CTAs per SM (warp 0 of each CTA) and, per SM, the last end
    first_warps = np.flatnonzero(live)[hist] % warps_per_cta == 0
    sm_of_cta = smid[hist][first_warps]
    counts = np.bincount(sm_of_cta, minlength=int(smid.max()) + 1)
    out["history_ctas_per_sm"] = {str(k): int(v) for k, v in zip(*np.unique(counts, return_counts=True))}
    out["arrival_order"] = arrival_order(off[hist], smid[hist], split[hist], w[hist, 15].astype(np.int64))
    return out


def arrival_order(off: np.ndarray, smid: np.ndarray, split: np.ndarray, column: np.ndarray) -> Optional[dict]:
    """On the SMs that hold exactly two history CTAs: the loop time (median over the CTA's warps, us from block 0's
    data to the loop's end) and the end (its last warp's) of the CTA that arrived first and of the one that arrived
    second (by the CTA's first entry), medians over those SMs. Why: on H200 the second CTA's loop ran 28-37% slower
    on every such SM (the schedulers favour the older CTA's warps), and the call ends with it."""
    ctas: dict = {}
    for i, key in enumerate(zip(column.tolist(), split.tolist())):
        ctas.setdefault(key, []).append(i)
    per_sm: dict = {}
    for ix in ctas.values():
        ix = np.asarray(ix)
        per_sm.setdefault(int(smid[ix[0]]), []).append(
            (float(off[ix, 0].min()), float(np.median(off[ix, 5] - off[ix, 4])), float(off[ix, 6].max())))
    pairs = [sorted(v) for v in per_sm.values() if len(v) == 2]
    if not pairs:
        return None
    return dict(sms=len(pairs), loop_first=float(np.median([p[0][1] for p in pairs])),
                loop_second=float(np.median([p[1][1] for p in pairs])),
                end_first=float(np.median([p[0][2] for p in pairs])),
                end_second=float(np.median([p[1][2] for p in pairs])))


def per_warp_offsets(words: np.ndarray) -> dict:
    """The offsets (us from the first entry, 3 decimals) of every live warp's marks, with its SM, split and block
    count: the raw timeline of one call, for plots."""
    words = np.asarray(words, dtype=np.uint64).reshape(-1, WORDS)
    w = words[words[:, 14] != 0]
    smid, split, nblocks, window = decode_meta(w[:, 14])
    gt = w[:, 0:14:2].astype(np.int64)
    off = np.round((gt - gt[:, 0].min()) / 1e3, 3)
    return dict(smid=smid.tolist(), split=split.tolist(), nblocks=nblocks.tolist(), window=window.tolist(),
                column=w[:, 15].astype(np.int64).tolist(), offsets=off.tolist())


def parse_source(spec: str, default_path: str, defaults: dict):
    """(path, macros, history_cuda settings) of a --sources value 'path[+S<stages>][+W<rows>][+F<0|1>][+B<0|1>]
    [+A<0|1>][+D<macro>=<value>]...' (empty path: this tree's kernel source). Settings: the module attributes of
    kernels/history_cuda.py that the source's calls run with, `defaults` (STAGES, WINDOW_ROWS_PER_WARP, FOLD_WINDOW,
    D64_WIDE_BLOCKS, D64_WIDE_AFTER_WRITE) updated by S (stages), W (the window CTAs' rows per warp), F (the window
    folded into the history CTAs, or not), B (64-token stages at D 64) and A (the smallest batch at which they are
    taken after the KV write too; 0: never)."""
    parts = spec.split("+")
    path = parts[0] or default_path
    defines, settings = [], dict(defaults)
    for p in parts[1:]:
        if p[:1] == "S" and p[1:].isdigit():
            settings["STAGES"] = int(p[1:])
        elif p[:1] == "W" and p[1:].isdigit():
            settings["WINDOW_ROWS_PER_WARP"] = int(p[1:])
        elif p in ("F0", "F1"):
            settings["FOLD_WINDOW"] = p == "F1"
        elif p in ("B0", "B1"):
            settings["D64_WIDE_BLOCKS"] = p == "B1"
        elif p[:1] == "A" and p[1:].isdigit():
            settings["D64_WIDE_AFTER_WRITE"] = int(p[1:])
        elif p[:1] == "D" and len(p) > 1:
            defines.append(p[1:])
        else:
            raise SystemExit(f"--sources: cannot read {p!r} in {spec!r} (S<stages>, W<rows>, F0 / F1, B0 / B1, "
                             f"A<batch> or D<macro>=<value>)")
    return path, tuple(defines), settings


def main():
    import torch
    import triton

    from bench_decode import MODELS, bench, capture_graph, make_oscar, n_copies, oscar_bytes, oscar_fns
    from bench_write import git_commit, write_json
    from bench_write_decode import OSCAR_PAGE, oscar_chain_fns
    from sglang_oscar.kernels import history_cuda

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--configs", default="alone:65536:1:auto,alone:65536:1:16,chain:65536:1:auto,"
                                         "alone:131072:1:auto,alone:32768:1:auto,alone:65536:8:auto",
                    help="comma list of mode:context:batch:splits (mode alone, chain (to the Triton write) or chainw "
                         "(to the CUDA write); splits auto or a count)")
    ap.add_argument("--sources", default="",
                    help="comma list of name=path[+S<stages>][+W<rows>][+F0|+F1][+B0|+B1][+A<batch>]"
                         "[+D<macro>=<value>]...: other kernel sources (e.g. the previous commit's int2_history.cu, "
                         "with the same launch signature; an empty path: this tree's) with their stage count "
                         "(history_cuda.STAGES), window CTA rows per warp (WINDOW_ROWS_PER_WARP), folded window off / "
                         "on (FOLD_WINDOW), 64-token D-64 stages off / on (D64_WIDE_BLOCKS), after the KV write from "
                         "this batch (D64_WIDE_AFTER_WRITE; 0: never) and macros (e.g. +DOSCAR_TOK=32), timed and "
                         "traced beside this "
                         "tree's default ('new') in the same process")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per configuration")
    ap.add_argument("--raw", action="store_true",
                    help="also write every warp's offsets, SM, split and column (~1-2 MB per configuration and "
                         "source at batch 1-8)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    dev = torch.cuda.get_device_name()
    sources = [("new", "")] + [tuple(x.split("=", 1)) for x in args.sources.split(",") if x]
    defaults = {k: getattr(history_cuda, k) for k in ("STAGES", "WINDOW_ROWS_PER_WARP", "FOLD_WINDOW",
                                                      "D64_WIDE_BLOCKS", "D64_WIDE_AFTER_WRITE")}
    libs, settings, specs, paths = {}, {}, {}, {}
    for name, spec in sources:
        path, defines, settings[name] = parse_source(spec, history_cuda.SOURCE, defaults)
        # every history_cuda setting the source ran with, lower-cased (stages, window_rows_per_warp, fold_window,
        # d64_wide_blocks, d64_wide_after_write)
        specs[name] = dict(path=path, defines=list(defines), **{k.lower(): v for k, v in settings[name].items()})
        paths[name] = (path, defines)
    # every source's plain and traced library at once: one nvcc is single-threaded (~40 s for the file's instances)
    # (one job per distinct build: two threads building the same file would write the same temporary file)
    jobs = list(dict.fromkeys((d, path) for path, defines in paths.values()
                              for d in (defines, defines + ("OSCAR_HISTORY_TRACE",))))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as ex:
        built = dict(zip(jobs, ex.map(lambda job: history_cuda.build(*job), jobs)))
    for name, (path, defines) in paths.items():
        plain = history_cuda.load(built[(defines, path)])
        traced = history_cuda.load(built[(defines + ("OSCAR_HISTORY_TRACE",), path)])
        traced.oscar_history_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
        traced.oscar_history_trace_words.restype = ctypes.c_int
        libs[name] = (plain, traced)

    def use(name, lib):  # launch from this source's build, with its settings (stage count, window rows, fold)
        for k, v in settings[name].items():
            setattr(history_cuda, k, v)
        history_cuda.use_library(lib)
    rows = []
    for spec in args.configs.split(","):
        mode, ctx, b, splits = spec.split(":")
        ctx, b = int(ctx), int(b)
        n = None if splits == "auto" else int(splits)
        copies = n_copies(oscar_bytes(b, hq, hkv, d, ctx))
        if mode == "alone":
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=OSCAR_PAGE)
            fns = oscar_fns(q, cache, r2t, seq, ring_start, b, copies, d, history_kernel="cuda", num_splits=n)
            keep = (q, cache, r2t, seq, ring_start)
        elif mode in ("chain", "chainw"):  # chainw: chained to the CUDA write (kernels/write_cuda.py)
            fns, _, keep = oscar_chain_fns(b, hq, hkv, d, ctx, copies, after_write=True, fuse_q=True, num_splits=n,
                                           write_kernel="cuda" if mode == "chainw" else "triton")
        else:
            raise SystemExit(f"mode must be alone, chain or chainw, got {mode!r}")
        times = {name: [] for name in libs}
        for r in range(args.rounds):  # interleaved, alternating order
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                use(name, libs[name][0])
                times[name].append(1e3 * bench(fns))
        base = float(np.median(times["new"]))
        for name, (_, traced) in libs.items():
            use(name, traced)
            us_trace = 1e3 * bench(fns)
            graph = capture_graph(fns)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            traced.oscar_history_trace_clear()
            graph.replay()
            torch.cuda.synchronize()
            n_words = traced.oscar_history_trace_words()
            buf = np.zeros(n_words, dtype=np.uint64)
            rc = traced.oscar_history_trace_read(buf.ctypes.data, n_words)
            if rc:
                raise RuntimeError(f"trace read failed (cuda error {rc})")
            summ = summarize(buf, history_cuda.WARPS)
            us = float(np.median(times[name]))
            row = dict(config=spec, source=name, mode=mode, context=ctx, batch=b, splits=n, us=us,
                       us_rounds=times[name], us_trace=us_trace, vs_new=us / base, calls_per_replay=len(fns),
                       summary=summ)
            if args.raw:
                row["warps"] = per_warp_offsets(buf)
            rows.append(row)
            ph = summ["phases"]
            print(f"{spec:22s} {name:5s} {us:6.1f} us ({us / base:.3f}x new; trace build {us_trace:.1f}) | span "
                  f"{summ['span_us']:.1f} hist end p50/max {summ['history_end']['median']:.1f}/"
                  f"{summ['history_end']['max']:.1f} win {summ.get('window_entry', {}).get('median', math.nan):.1f}-"
                  f"{summ.get('window_end', {}).get('max', math.nan):.1f} | "
                  + " ".join(f"{k} {v['median']:.2f}" for k, v in ph.items() if v)
                  + f" | per block {summ.get('loop_us_per_block', {}).get('median', math.nan):.2f}", flush=True)
            del graph
        del fns, keep
        torch.cuda.empty_cache()
        for k, v in defaults.items():
            setattr(history_cuda, k, v)
        history_cuda.use_library(None)
        out = dict(device=dev, model=args.model, page=OSCAR_PAGE, marks=MARKS, sources=specs,
                   versions=dict(torch=torch.__version__, triton=triton.__version__, git_commit=git_commit()),
                   rows=rows)
        write_json(args.out, "probe_history_trace" + (f"_{args.tag}" if args.tag else ""), dev, out)


if __name__ == "__main__":
    main()
