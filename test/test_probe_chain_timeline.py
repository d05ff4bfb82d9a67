"""benchmark/probe_chain_timeline.py's bookkeeping on synthetic profiler records (CPU): kernel names to tags, calls
split at each merge (the last kernel of a call, whatever kernels precede it: q's GEMM, the write, the history)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import probe_chain_timeline as probe  # noqa: E402


def test_kernel_tags():
    assert probe.short("_oscar_write_kv_kernel") == "write"
    assert probe.short("void (anonymous namespace)::int2_history_kernel<2, 4>(Args)") == "history"
    assert probe.short("_oscar_decode_merge") == "merge"
    assert probe.short("_oscar_decode_stage1") == "stage1"
    assert probe.short("nvjet_tst_128x64_64x4_1x2_h_bz_TNN") == "other"  # q's GEMM, named by cuBLAS


def test_calls_end_at_each_merge():
    recs = [("nvjet_gemm", 0.0, 2.0), ("_oscar_write_kv_kernel", 2.5, 5.0), ("int2_history_kernel<2, 4>", 3.0, 20.0),
            ("_oscar_decode_merge", 10.0, 14.0),
            ("_oscar_write_kv_kernel", 30.0, 5.0), ("int2_history_kernel<2, 4>", 31.0, 20.0),
            ("_oscar_decode_merge", 40.0, 12.0),
            ("_oscar_write_kv_kernel", 60.0, 5.0)]  # a call cut off by the profile's end: dropped
    calls = probe.per_call(recs)
    assert [[tag for tag, _, _ in c] for c in calls] == [["other", "write", "history", "merge"],
                                                         ["write", "history", "merge"]]
    assert calls[1][1] == ("history", 31.0, 51.0)  # (tag, start, end = start + duration)
