"""srt/capacity.py: bytes per token, fixed window reservation, and the capacity ratio vs BF16."""

import pytest

from sglang_oscar.srt import capacity as c
from sglang_oscar.srt.options import OscarOptionError

QWEN3_8B = c.ModelShape(num_layers=36, kv_heads=8, head_dim=128)
GIB = 2**30
SERVED = c.layout_for(64, 256, 64, k4_heads=72)  # groups of 64, INT4 keys on a quarter of the 36 x 8 KV heads


def test_cells_qwen3_8b():
    # per (token, head, side): 32 code bytes + (128/G) x (scale, min) float8, + 32 high-plane key bytes per head on
    # the INT4-key heads
    assert c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 128)) == 36 * 8 * 2 * (32 + 2) + 4
    assert c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 64)) == 36 * 8 * 2 * (32 + 4) + 4
    assert c.int2_cell_bytes(QWEN3_8B, SERVED) == 36 * 8 * 2 * (32 + 4) + 72 * 32 + 4  # 2.5 bits per element
    assert c.bf16_cell_bytes(QWEN3_8B) == 147456
    assert c.bf16_cell_bytes(QWEN3_8B) / c.int2_cell_bytes(QWEN3_8B, c.layout_for(64, 256, 128)) > 7.1


def test_kv_head_range_matches_qkv_parallel_linear():
    assert [c.kv_head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [c.kv_head_range(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4  # replicas
    with pytest.raises(OscarOptionError):
        c.kv_head_range(0, 3, 8)


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
    assert f"int2 {r.int2_tokens:,} tokens" in r.summary() and f" = {r.ratio:.2f}x; " in r.summary()
    # the window reservation is what limits it: many requests fall below the target
    assert c.capacity_report(55 * GIB, QWEN3_8B, lay, 256).ratio < 6.5


@pytest.mark.parametrize("layout, ratios", [
    (c.layout_for(64, 256, 128), (7.41, 7.29, 7.06, 6.60, 5.68)),
    (SERVED, (6.30, 6.20, 6.00, 5.61, 4.82)),  # the served format never reaches 6.5x
])
def test_the_memory_table_of_the_integration_doc(layout, ratios):
    """docs/sglang_integration.md section 4: int2 / BF16 tokens on Qwen3-8B at 55 GiB for R = 16 .. 256."""
    got = tuple(round(c.capacity_report(55 * GIB, QWEN3_8B, layout, r).ratio, 2) for r in (16, 32, 64, 128, 256))
    assert got == ratios


def test_r_sized_from_the_budget_qwen3_8b():
    """No --max-running-requests: R = the most requests whose windows fit in 1/10 of the budget. Qwen3-8B at the
    served format with 100 GiB (about what 0.85 of an H200 leaves after the weights): 188 requests' windows, and the
    tokens left still hold 128 requests of 32k and are 9/10 of the INT2-only pool (5.76x BF16)."""
    lay = SERVED
    budget = 100 * GIB
    r = c.auto_max_running_requests(budget, QWEN3_8B, lay)
    assert r == 188
    fixed = c.fixed_bytes(QWEN3_8B, lay, r).total
    assert fixed <= budget // 10 < c.fixed_bytes(QWEN3_8B, lay, r + 1).total
    rep = c.capacity_report(budget, QWEN3_8B, lay, r)
    assert rep.int2_tokens // 32768 == 128
    assert rep.ratio == pytest.approx(0.9 * c.bf16_cell_bytes(QWEN3_8B) / c.int2_cell_bytes(QWEN3_8B, lay), rel=2e-3)
    assert rep.ratio > 5.7
    # the same share at every group: G=128 gives the same R and 6.8x, G=32 still serves
    assert c.auto_max_running_requests(budget, QWEN3_8B, c.layout_for(64, 256, 128)) == 188
    assert c.capacity_report(budget, QWEN3_8B, c.layout_for(64, 256, 128), 188).ratio > 6.77
    assert c.auto_max_running_requests(budget, QWEN3_8B, c.layout_for(64, 256, 32)) == 188
    # R scales with the budget and stops at SGLang's own smallest default
    assert c.auto_max_running_requests(50 * GIB, QWEN3_8B, lay) == 94
    assert c.auto_max_running_requests(10_000 * GIB, QWEN3_8B, lay) == c.MAX_AUTO_REQUESTS == 2048


def test_budget_too_small_for_one_request_is_a_clear_error():
    lay = SERVED
    one = c.fixed_bytes(QWEN3_8B, lay, 1).total  # 0.088 GiB: 2 x 256 ring rows (+ padding request) + 128 sink rows
    assert c.auto_max_running_requests(10 * one, QWEN3_8B, lay) == 1
    with pytest.raises(ValueError, match=r"KV budget is too small for int2: one request's BF16 windows take 0\.088 GiB"
                                         r".*raise --mem-fraction-static or give --max-running-requests"):
        c.auto_max_running_requests(10 * one - 10, QWEN3_8B, lay)


def test_startup_line():
    lay = SERVED
    rep = c.capacity_report(100 * GIB, QWEN3_8B, lay, 188)
    line = c.capacity_line(rep.int2_tokens, rep, 188, 131072, from_budget=True)
    assert line == (f"int2 KV: {rep.int2_tokens:,} tokens ({rep.ratio:.1f}x BF16's {rep.bf16_tokens:,} in the same "
                    "budget); "
                    "windows reserved for R=188 requests (their windows sized to 1/10 of the budget); fits 188 "
                    f"requests of 4k, 128 of 32k, {rep.int2_tokens // 100000} of 100k, {rep.int2_tokens // 131072} of "
                    "128k (context length)")
    # --max-total-tokens below what the budget holds, a short context: the cap is named, lengths past it dropped
    line = c.capacity_line(4096, rep, 16, 256, from_budget=False)
    assert line.startswith(f"int2 KV: 4,096 tokens (capped by --max-total-tokens; the budget holds {rep.int2_tokens:,}")
    assert line.endswith("R=16 requests (--max-running-requests); fits 16 requests of 256 (context length)")
