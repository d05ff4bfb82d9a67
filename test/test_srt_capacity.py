"""srt/capacity.py: bytes per token, fixed window reservation, and the capacity ratio vs BF16."""

import pytest

from sglang_oscar.srt import capacity as c

QWEN3_8B = c.ModelShape(num_layers=36, kv_heads=8, head_dim=128)
GIB = 2**30


def test_cells_qwen3_8b():
    # per (token, head, side): 32 code bytes + (128/G) x (scale, min) bf16
    assert c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 128)) == 36 * 8 * 2 * (32 + 4) + 4
    assert c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 64)) == 36 * 8 * 2 * (32 + 8) + 4
    assert c.bf16_cell_bytes(QWEN3_8B) == 147456
    assert c.bf16_cell_bytes(QWEN3_8B) / c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 128)) > 7.1


def test_tp_shards_kv_heads():
    assert c.ModelShape(36, 8, 128, tp_size=2).kv_heads_per_rank == 4
    assert c.ModelShape(36, 8, 128, tp_size=16).kv_heads_per_rank == 1  # replicated
    with pytest.raises(ValueError):
        c.ModelShape(36, 8, 128, tp_size=3).kv_heads_per_rank


def test_fixed_bytes_and_tokens():
    lay = c.layout_for(64, 256, 128)
    row = c.window_row_bytes(QWEN3_8B)
    assert row == 147456
    f = c.fixed_bytes(QWEN3_8B, lay, 64)
    assert f.ring == 65 * 256 * row and f.sink_rows == 2 * 64 * 64 * row and f.ring_start == 65 * 4
    budget = 40 * GIB
    t = c.max_total_num_tokens(budget, QWEN3_8B, lay, 64, page_size=64)
    assert t % 64 == 0 and t * c.int2_cell_bytes(QWEN3_8B, lay) + f.total <= budget
    assert (t + 64) * c.int2_cell_bytes(QWEN3_8B, lay) + f.total > budget
    with pytest.raises(ValueError, match="lower --max-running-requests"):
        c.max_total_num_tokens(GIB, QWEN3_8B, lay, 64)


def test_issue_target_6_5x():
    """>= 6.5x BF16 tokens at the same budget on Qwen3-8B at G=128 with a pinned request count."""
    lay = c.layout_for(64, 256, 128)
    r = c.capacity_report(55 * GIB, QWEN3_8B, lay, 64)
    assert r.ratio >= 6.5, r.summary()
    assert "6.6" in r.summary()
    # the window reservation is what limits it: many requests fall below the target
    assert c.capacity_report(55 * GIB, QWEN3_8B, lay, 256).ratio < 6.5
    assert 64 <= c.max_requests_for_ratio(6.5, 55 * GIB, QWEN3_8B, lay) < 256
    # G=64 costs 2.5 bits/element: its ceiling (6.4x) is under the target whatever the request count
    assert c.max_requests_for_ratio(6.5, 55 * GIB, QWEN3_8B, c.layout_for(64, 256, 64)) == 0
