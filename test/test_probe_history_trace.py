"""benchmark/probe_history_trace.py's bookkeeping on synthetic trace words (CPU), and the trace build of the CUDA
history kernel: it compiles at <= 128 registers without spills (so that the marks do not change the kernel's
occupancy), exports its read / clear entry points, and the shipped build has no trace code (skips without nvcc)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import probe_history_trace as probe  # noqa: E402


def _warp(entry_ns, phases_ns, smid, split, nblocks, window=False, clock_per_ns=1.8, column=0):
    """One warp's 16 words: marks at entry + cumulative phases (6 of them; a window CTA: entry and end only)."""
    w = np.zeros(probe.WORDS, dtype=np.uint64)
    t = [entry_ns]
    for p in phases_ns:
        t.append(t[-1] + p)
    for i, ti in enumerate(t):
        w[2 * i] = ti
        w[2 * i + 1] = int(1_000_000 + clock_per_ns * (ti - entry_ns))
    w[14] = smid | ((split + 1) << 8) | (nblocks << 24) | (int(window) << 40)
    w[15] = column
    return w


def test_meta_round_trip():
    words = np.stack([_warp(0, [1] * 6, 131, 255, 7), _warp(0, [1] * 6, 0, -1, 0, window=True)])
    smid, split, nblocks, window = probe.decode_meta(words[:, 14])
    assert smid.tolist() == [131, 0] and split.tolist() == [255, -1]
    assert nblocks.tolist() == [7, 0] and window.tolist() == [False, True]


def test_summary_phases_span_and_last_warp():
    ws = 2  # warps per CTA
    rows = []
    # CTA 0 on SM 5 (two warps), CTA 1 on SM 5, CTA 2 on SM 9: phases index 1000, slots 500, q 200, first 300,
    # loop (first -> loop) 3000 over 4 blocks, end 700; CTA 2 starts 2 us late
    for cta, (sm, start) in enumerate([(5, 1000), (5, 1000), (9, 3000)]):
        for _ in range(ws):
            ph = [1000, 500, 200, 300, 3000, 700]
            rows.append(_warp(start, ph, sm, cta, 4))
    # a warp without history rows: no "first" mark (zero), left out of the phases
    rows.append(_warp(1000, [1000, 500, 200, 0, 0, 700], 5, 0, 0))
    rows[-1][8] = 0
    # a window CTA after them, the one that ends last
    for _ in range(ws):
        rows.append(_warp(9000, [0, 0, 0, 0, 0, 1500], 9, -1, 0, window=True))
    words = np.concatenate([np.stack(rows), np.zeros((3, probe.WORDS), dtype=np.uint64)])  # 3 warps that never ran
    s = probe.summarize(words, ws)
    assert s["warps"] == 9 and s["history_warps"] == 6 and s["window_warps"] == 2 and s["empty_history_warps"] == 1
    assert s["entry"]["max"] == pytest.approx(2.0) and s["entry"]["min"] == 0.0
    assert s["phases"]["entry->index"]["median"] == pytest.approx(1.0)
    assert s["phases"]["index->slots"]["median"] == pytest.approx(0.5)
    assert s["phases"]["first->loop"]["median"] == pytest.approx(3.0)  # from block 0's data to the loop's end
    assert s["phases"]["loop->end"]["max"] == pytest.approx(0.7)
    assert s["loop_us_per_block"]["median"] == pytest.approx(1.0)  # 3 us over the 3 blocks after block 0
    assert s["span_us"] == pytest.approx(9.5)  # first entry 1000 ns, window end 10500 ns
    assert s["last_warp"]["window"] and s["last_warp"]["smid"] == 9
    assert s["window_entry"]["median"] == pytest.approx(8.0)
    assert s["history_ctas_per_sm"] == {"0": 8, "1": 1, "2": 1}  # SMs 0..9: two CTAs on SM 5, one on SM 9
    assert s["sm_ghz"] == pytest.approx(1.8, rel=1e-3)
    off = probe.per_warp_offsets(words)
    assert s["phases"]["q->first"]["min"] == pytest.approx(0.3)
    assert len(off["offsets"]) == 9 and off["offsets"][0][0] == 0.0 and off["split"][-1] == -1


def test_source_specs():
    d = dict(STAGES=2, WINDOW_ROWS_PER_WARP=16, FOLD_WINDOW=True)
    assert probe.parse_source("", "/k.cu", d) == ("/k.cu", (), d)
    assert probe.parse_source("/old.cu", "/k.cu", d) == ("/old.cu", (), d)
    assert probe.parse_source("+S3+DOSCAR_TOK=32", "/k.cu", d) == ("/k.cu", ("OSCAR_TOK=32",), {**d, "STAGES": 3})
    assert probe.parse_source("+W32+F0", "/k.cu", d) == ("/k.cu", (), {**d, "WINDOW_ROWS_PER_WARP": 32,
                                                                       "FOLD_WINDOW": False})
    assert probe.parse_source("+B0", "/k.cu", d) == ("/k.cu", (), {**d, "D64_WIDE_BLOCKS": False})
    assert probe.parse_source("+A1+B1", "/k.cu", d) == ("/k.cu", (), {**d, "D64_WIDE_AFTER_WRITE": 1,
                                                                      "D64_WIDE_BLOCKS": True})
    assert probe.parse_source("+A0", "/k.cu", d) == ("/k.cu", (), {**d, "D64_WIDE_AFTER_WRITE": 0})
    assert probe.parse_source("+A8", "/k.cu", d) == ("/k.cu", (), {**d, "D64_WIDE_AFTER_WRITE": 8})
    assert d["FOLD_WINDOW"] is True  # the defaults are not changed
    with pytest.raises(SystemExit, match="cannot read"):
        probe.parse_source("/k.cu+X3", "/k.cu", d)


def test_summary_refuses_an_empty_trace():
    with pytest.raises(ValueError, match="no traced warps"):
        probe.summarize(np.zeros((4, probe.WORDS), dtype=np.uint64), 8)


def _nvcc():
    from sglang_oscar.kernels import history_cuda
    try:
        return history_cuda._nvcc()
    except Exception:  # noqa: BLE001
        return None


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_trace_build_compiles_within_the_register_budget(tmp_path):
    from sglang_oscar.kernels import history_cuda
    nvcc = _nvcc()
    for defines, traced in (((), False), (("-DOSCAR_HISTORY_TRACE",), True)):
        obj = tmp_path / f"k{int(traced)}.o"
        res = subprocess.run([nvcc, "-O3", "-c", "-arch=sm_90", "-Xptxas", "-v", *defines, "-o", str(obj),
                              "-Xcompiler", "-fPIC", history_cuda.SOURCE], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        regs = [int(x.split("Used ")[1].split(" registers")[0]) for x in res.stderr.splitlines() if "Used " in x]
        assert regs and max(regs) <= 128, regs
        # per instance (ptxas prints the entry's name, then its stack / spill line): none spills, except that the
        # trace build's 64-token D-64 instances (WIDE, "...ELi64ELb1E") and its paired-tile instances (HC 4, D 128:
        # "...ELi4ELb?ELi128ELb0E", held to 128 registers by their launch bounds) may spill up to 8 bytes: their marks' registers do not fit the 80 / 128 that 3 / 2 CTAs per SM leave (a measurement build; its
        # timings are reported beside the plain build's in the same process)
        spills, entry = {}, None
        for line in res.stderr.splitlines():
            if "Compiling entry function" in line:
                entry = line.split("'")[1]
            elif "spill stores" in line:
                spills[entry] = int(line.split("bytes spill stores")[0].split(",")[-1])
        assert spills and len(spills) == len(regs), (len(spills), len(regs))
        for name, n in spills.items():
            tight = "ELi64ELb1E" in name or re.search(r"ILi[234]ELi4ELb[01]ELi128ELb0E", name) is not None
            assert n <= (8 if traced and tight else 0), (name, n)
        syms = subprocess.run(["nm", "-g", str(obj)], capture_output=True, text=True).stdout
        assert ("oscar_history_trace_read" in syms) == traced
        assert ("oscar_history_trace_clear" in syms) == traced
        assert "oscar_history_launch" in syms


def test_arrival_order_pairs_the_two_ctas_of_an_sm():
    """arrival_order: on SMs with exactly two history CTAs, the CTA that entered first vs second (loop and end
    medians); an SM with one CTA is left out, and none with two gives None."""
    # [entry, index, slots, q, first, loop, end] offsets in us; two warps per CTA
    def warp(entry, first, loop, end):
        return [entry, entry, entry, entry, first, loop, end]
    rows, sm, split, col = [], [], [], []
    for s_id, (a_loop, b_loop) in enumerate([(10.0, 14.0), (11.0, 15.0), (9.0, 13.0)]):
        for c, (entry, lp) in enumerate([(0.5, b_loop), (0.1, a_loop)]):  # listed second-first: order is by entry
            for wi in range(2):
                rows.append(warp(entry, 2.0, 2.0 + lp + 0.1 * wi, 3.0 + lp + 0.1 * wi))
                sm.append(s_id), split.append(c), col.append(s_id)
    rows.append(warp(0.0, 1.0, 5.0, 6.0)), sm.append(7), split.append(0), col.append(99)  # alone on SM 7
    out = probe.arrival_order(np.array(rows), np.array(sm), np.array(split), np.array(col))
    assert out["sms"] == 3
    assert out["loop_first"] == pytest.approx(10.05) and out["loop_second"] == pytest.approx(14.05)
    assert out["end_first"] == pytest.approx(13.1) and out["end_second"] == pytest.approx(17.1)
    assert probe.arrival_order(np.array(rows[-1:]), np.array(sm[-1:]), np.array(split[-1:]),
                               np.array(col[-1:])) is None
