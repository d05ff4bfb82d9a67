"""benchmark/probe_decode_fixed_cost.py's pairing of CUPTI kernel records into calls (pure Python, CPU)."""

import os
import sys

import pytest

import kernel_utils  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
from probe_decode_fixed_cost import split_calls  # noqa: E402


def test_split_calls_pairs_stage1_with_the_next_merge():
    ev = [  # (name, start us, duration us), sorted by start
        ("_oscar_decode_stage1", 0.0, 30.0),
        ("_oscar_decode_merge", 28.0, 4.0),  # PDL: launched before stage 1 ended
        ("_oscar_decode_stage1", 32.5, 31.0),
        ("_oscar_decode_merge", 64.0, 2.0),
        ("some_other_kernel", 66.5, 1.0),
        ("_oscar_decode_stage1", 68.0, 10.0),  # no merge after it: not a call
    ]
    calls = split_calls(ev)
    assert len(calls) == 2
    a, b = calls
    assert a["stage1"] == 30.0 and a["merge"] == 4.0
    assert a["overlap"] == pytest.approx(2.0) and a["span"] == pytest.approx(32.0)
    assert a["gap_next"] == pytest.approx(0.5)
    assert b["overlap"] == 0.0 and b["span"] == pytest.approx(33.5) and b["gap_next"] == pytest.approx(0.5)


def test_split_calls_without_merges_is_empty():
    assert split_calls([("_oscar_decode_stage1", 0.0, 1.0), ("_oscar_decode_stage1", 2.0, 1.0)]) == []


def test_split_calls_with_the_cuda_history_between_stage1_and_merge():
    ev = [
        ("_oscar_decode_stage1", 0.0, 5.0),  # the window programs
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 3.0, 20.0),  # PDL: starts before they end
        ("_oscar_decode_merge", 21.0, 3.0),  # PDL: launched after the history loop
        ("_oscar_decode_stage1", 24.5, 5.0),
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 29.5, 20.0),
        ("_oscar_decode_merge", 49.5, 2.0),
    ]
    a, b = split_calls(ev)
    assert a["stage1"] == 5.0 and a["history"] == 20.0 and a["merge"] == 3.0
    assert a["history_overlap"] == pytest.approx(2.0) and a["overlap"] == pytest.approx(2.0)
    assert a["span"] == pytest.approx(24.0) and a["gap_next"] == pytest.approx(0.5)
    assert b["history_overlap"] == 0.0 and b["overlap"] == 0.0 and b["span"] == pytest.approx(27.0)
    assert b["gap_next"] is None


def test_split_calls_with_the_history_kernel_first():
    ev = [
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 0.0, 20.0),
        ("_oscar_decode_stage1", 15.0, 6.0),  # the window programs in its tail (PDL)
        ("_oscar_decode_merge", 20.5, 2.0),
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 23.0, 20.0),
        ("_oscar_decode_stage1", 44.0, 4.0),  # no overlap
        ("_oscar_decode_merge", 48.5, 2.0),
    ]
    a, b = split_calls(ev)
    assert a["history"] == 20.0 and a["stage1"] == 6.0 and a["history_overlap"] == pytest.approx(5.0)
    assert a["overlap"] == pytest.approx(0.5) and a["span"] == pytest.approx(22.5) and a["gap_next"] == pytest.approx(0.5)
    assert b["history_overlap"] == 0.0 and b["overlap"] == 0.0 and b["span"] == pytest.approx(27.5)


def test_split_calls_with_the_window_in_the_history_kernel():
    """history_cuda.FUSED_WINDOW: a call is the CUDA kernel and the merge, no stage 1."""
    ev = [
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 0.0, 20.0),
        ("_oscar_decode_merge", 18.0, 4.0),  # launched early (PDL), waits for the kernel
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 23.0, 10.0),
        ("_oscar_decode_merge", 34.0, 2.0),
    ]
    a, b = split_calls(ev)
    assert a["stage1"] is None and a["history_overlap"] is None and a["history"] == 20.0 and a["merge"] == 4.0
    assert a["overlap"] == pytest.approx(2.0) and a["span"] == pytest.approx(22.0) and a["gap_next"] == pytest.approx(1.0)
    assert b["overlap"] == 0.0 and b["span"] == pytest.approx(13.0) and b["gap_next"] is None


def test_split_calls_with_the_merge_in_the_history_kernel():
    """history_cuda.FUSED_MERGE: a call is the CUDA kernel alone."""
    ev = [
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 0.0, 20.0),
        ("void (anonymous namespace)::int2_history_kernel<2>(Args)", 21.5, 10.0),
    ]
    a, b = split_calls(ev)
    assert a["history"] == 20.0 and a["span"] == 20.0 and a["merge"] is None and a["gap_next"] == pytest.approx(1.5)
    assert b["span"] == 10.0 and b["gap_next"] is None
