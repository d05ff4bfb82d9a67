"""benchmark/probe_history_copies.py on the CPU: the pinned occupancy that keeps the copies-only build on the shipped
build's grid (no GPU: history_cuda.occupancy replaced by a stand-in)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import probe_history_copies as probe  # noqa: E402
from sglang_oscar.kernels import history_cuda  # noqa: E402


def test_pinned_occupancy_returns_the_shipped_count(monkeypatch):
    prepared = []
    per_build = {"count": 3}  # the library in use: the shipped build first, then the copies-only one

    def stand_in(stages=None, warps=None, heads=4, head_dim=128, wide=False):
        prepared.append((stages, heads, head_dim, wide))
        return per_build["count"]

    monkeypatch.setattr(history_cuda, "occupancy", stand_in)
    pinned = probe.PinnedOccupancy()
    assert pinned(heads=4, head_dim=64, wide=True) == 3  # recording: the shipped build's own count
    pinned.recording = False
    per_build["count"] = 8  # the copies-only build: fewer registers, more CTAs per SM
    assert pinned(heads=4, head_dim=64, wide=True) == 3  # the shipped grid
    assert prepared[-1] == (None, 4, 64, True)  # still prepared (its shared-memory limit) through the real call
    with pytest.raises(RuntimeError, match="no shipped occupancy recorded"):
        pinned(heads=8, head_dim=64)
    pinned.recording = True
    assert pinned(heads=8, head_dim=64) == 8


def test_points_are_checked():
    assert probe.parse_points("smollm2:65536:8,qwen3-8b:131072:1") == [("smollm2", 65536, 8), ("qwen3-8b", 131072, 1)]
    with pytest.raises(SystemExit, match="unknown model"):
        probe.parse_points("llama:1024:1")
