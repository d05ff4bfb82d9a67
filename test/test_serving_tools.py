"""CPU checks of the serving benchmark's pure parts (benchmark/serving/): the batch-decode window of
tp_serve.steady_gaps and the --batch-decode spec."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark", "serving"))
tp_serve = pytest.importorskip("tp_serve")


def stream(t0, step, n, tokens_per_chunk=1):
    """Chunks every `step` seconds from t0, each carrying tokens_per_chunk tokens."""
    return [(t0 + i * step, (i + 1) * tokens_per_chunk) for i in range(n)]


def test_steady_gaps_count_only_the_window_where_all_decode():
    # request a starts at 0 with 10 ms steps; b starts at 0.5 s (its prefill) with 20 ms steps and outlives a
    a = stream(0.0, 0.010, 101)  # last chunk at 1.0 s
    b = stream(0.5, 0.020, 51)  # 0.5 .. 1.5 s
    gaps, window = tp_serve.steady_gaps([a, b])
    assert window == pytest.approx(0.5)
    # a's gaps inside [0.5, 1.0]: 50 of 10 ms; b's: 25 of 20 ms; none of a's before b started
    assert len(gaps) == 75
    assert sorted(set(round(g, 6) for g in gaps)) == [0.01, 0.02]


def test_steady_gaps_per_token_when_a_chunk_carries_several():
    a = stream(0.0, 0.030, 11, tokens_per_chunk=3)  # 3 tokens per 30 ms chunk: 10 ms per token
    gaps, window = tp_serve.steady_gaps([a])
    assert window == pytest.approx(0.3) and len(gaps) == 10
    assert all(g == pytest.approx(0.010) for g in gaps)


def test_steady_gaps_without_overlap_or_data():
    a, b = stream(0.0, 0.01, 10), stream(1.0, 0.01, 10)  # b starts after a has finished
    assert tp_serve.steady_gaps([a, b]) == ([], 0.0)
    assert tp_serve.steady_gaps([]) == ([], 0.0)
    assert tp_serve.steady_gaps([[(0.0, 1)]]) == ([], 0.0)  # a single chunk has no gap


def test_specs_and_modes():
    assert tp_serve.parse_spec("32768x256@8") == (32768, 256, 8)
    assert tp_serve.parse_spec("8192x1024") == (8192, 1024, None)
    with pytest.raises(SystemExit):
        tp_serve.parse_spec("32k x 256")
    # int2 is the served command: --kv-cache-dtype int2, the server picks backend, R, page size and kernels (the
    # CUDA history stage on Hopper by itself: no int2_cuda mode, no SGLANG_OSCAR_HISTORY_KERNEL)
    assert tp_serve.MODES["int2"] == (None, "int2", [])
    assert tp_serve.MODES["int2_eager"] == (None, "int2", ["--disable-cuda-graph"])
    assert "int2_cuda" not in tp_serve.MODES and not hasattr(tp_serve, "MODE_ENV")
