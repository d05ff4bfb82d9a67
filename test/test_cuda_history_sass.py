"""The CUDA history kernel's static budget for sm_90, compiled on the CPU (benchmark/inspect_cuda_history_sass.py):
every template instance at <= 128 registers with no stack or spills (2 CTAs of 8 warps per SM), its hot loop (one
16-token tile: 16 HMMA + IMMA) and a 32-token block's other code no longer than recorded, and the whole kernel within
5% of its recorded size (code outside the loop once cost every batch-1 call ~1.8 us). Skips without nvcc / cuobjdump
or with an nvcc other than the budget's."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
import inspect_cuda_history_sass as sass  # noqa: E402

TOOLS = sass.tools()
pytestmark = pytest.mark.skipif(TOOLS is None or sass.nvcc_version(TOOLS[0]) != sass.BUDGET_NVCC,
                                reason=f"needs nvcc {sass.BUDGET_NVCC} and cuobjdump (the budget's compiler)")


@pytest.fixture(scope="module")
def rows():
    return sass.inspect()


def test_every_instance_within_its_budget(rows):
    # the DISPATCH table's instances (2 stages), each with a budget: 32-token stages everywhere, 64-token ones (wide)
    # at D 64 with 4-head columns
    budgets = {k + (False,) for k in sass.BUDGET} | {k + (True,) for k in sass.WIDE_BUDGET}
    assert set(rows) <= budgets and {k[0] for k in rows} == {2}
    assert {(k[1], k[3], k[4]) for k in rows} == {(4, 128, False), (8, 128, False), (4, 64, False), (8, 64, False),
                                                 (4, 64, True)}
    for key, r in rows.items():
        loop_budget, total_budget = sass.budget(key)
        wide, d = key[4], key[3]
        assert r["registers"] <= (sass.MAX_REGISTERS_D64 if d == 64 else sass.MAX_REGISTERS), (key, r)
        assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (key, r)
        assert r["hot_loop"]["hmma"] == sass.block_tiles(key) * sass.tile_mma(d), (key, r["hot_loop"])
        assert r["hot_loop"]["length"] <= loop_budget, (key, r["hot_loop"], "the hot loop grew: A/B it on a GPU")
        if sass.block_tiles(key) > 1:  # the tiles unrolled (wide, D 128): no loop inside the block's
            assert r["block_loop"] is None, key
        else:
            assert r["block_loop"]["extra"] <= sass.BLOCK_BUDGET[key[:4]], (key, r["block_loop"], "a block grew")
        assert r["instructions"] <= total_budget * sass.TOTAL_SLACK, (key, r["instructions"],
                                                                       "the kernel grew: A/B it on a GPU")


def test_the_budget_catches_the_reverted_rotation(tmp_path):
    """8ecb8ea's kernel (q rotated in the CTAs, off at run time) had the same hot loop and was ~1.8 us slower per
    batch-1 call: the whole-kernel budget fails it. Rebuilt here from the current source plus a dead-weight block
    of the same kind, so that the test needs no git history: an unrolled loop of global loads and FMAs behind a
    runtime branch in the prologue."""
    src = open(sass.SOURCE).read()
    anchor = "  const int head0 = HC == 8 ? 2 * t : (2 * t) & 3;"
    assert src.count(anchor) == 1
    extra = """  if (a.fold_tiles == -7) {  // never true: code that is compiled in but does not run
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    const float* src = a.lse_part + threadIdx.x;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] = fmaf(__ldg(src + k * 16 + i), acc[(i + k) & 15], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) a.o_part[threadIdx.x * 16 + i] = acc[i];
  }
"""
    grown = tmp_path / "grown.cu"
    grown.write_text(src.replace(anchor, extra + anchor))
    rows = sass.inspect(str(grown))
    over = [k for k, r in rows.items() if r["instructions"] > sass.budget(k)[1] * sass.TOTAL_SLACK]
    assert over == sorted(rows), {k: r["instructions"] for k, r in rows.items()}
