"""oscar_decode (kernels/decode.py) against mixed_decode_reference (quant/attention.py).

On CPU the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported) with fp32 inputs: ‖o − ref‖/‖ref‖ < 1e-4. On CUDA: bf16 inputs, < 1e-2.
Caches are random (codes, float8 e4m3 params, window rows; k_bits=4: INT4 keys, a random k_hi
too); rows decode must NOT read are NaN (sink and ring rows of no position, and the float8 (scale,
min) params, NaN 0x7F, of every slot outside the positions [0, R) of a request, R = max(S, L − W,
ring_start) capped at L: the INT2 history and the sink positions, which read INT2 where a test drops
their sink rows), and the output is poisoned (NaN) before each call, so a wrong row, a stray INT2
read or an unwritten element fails. (The Triton kernels decode params with integer ops, e4m3_pair,
which read the NaN byte as 480: there a stray INT2 read fails as a gross error, ~10^3-10^4 relative,
not as NaN; the CUDA history kernel's hardware conversion gives NaN.)
"""

from __future__ import annotations

import dataclasses
import math
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from sglang_oscar.kernels.decode import default_merge_splits, default_window_splits, e4m3_pair, oscar_decode
from sglang_oscar.kernels.layout import LayerCache
from sglang_oscar.quant.attention import dequantize_rows, mixed_decode_reference
from sglang_oscar.quant.intq import round_param, quantize
from sglang_oscar.quant.pack import pack_int2

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = 1e-2 if CUDA else 1e-4
PAGE = 16


def make_case(lens, *, hkv=2, gqa=2, d=64, gk=64, gv=64, sink=8, window=16, ring_starts=None,
              dtype=None, device=DEV, seed=0, extra_reqs=1, pool_page=1, k_bits=2, k4_heads=None):
    """A random mixed cache holding len(lens) requests, and the decode inputs. pool_page: the pool's page
    size (kernels/layout.py; the slot assignment below uses pages of PAGE either way). k_bits 4: INT4 keys on the
    KV heads k4_heads (None: all; random k_hi bytes; key scales a fifth of the INT2 ones, as (max − min)/15 would
    be)."""
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    b = len(lens)
    max_reqs = b + extra_reqs
    max_ctx = max(lens) + 5
    # pool slots in pages of PAGE, pages shuffled: consecutive positions cross page boundaries
    pages_per_req = math.ceil(max_ctx / PAGE)
    num_slots = max_reqs * pages_per_req * PAGE + PAGE
    num_slots = -(-num_slots // pool_page) * pool_page
    perm = torch.randperm(max_reqs * pages_per_req, generator=g) + 1  # page 0 unused
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    for r in range(max_reqs):
        pages = perm[r * pages_per_req:(r + 1) * pages_per_req]
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:max_ctx]
        req_to_token[r] = slots.int()
    # requests sit at shuffled pool indices
    req_idx = torch.randperm(max_reqs, generator=g)[:b].int()
    if ring_starts is None:
        ring_starts = [0] * b
    ring_start = torch.zeros(max_reqs, dtype=torch.int32)
    for i, rs in enumerate(ring_starts):
        ring_start[req_idx[i]] = rs
    num_sink_rows = b * sink + 3
    cache = LayerCache.empty(num_slots, hkv, d, k_group=gk, v_group=gv, num_sink_rows=num_sink_rows,
                             max_reqs=max_reqs, window=window, sink=sink, window_dtype=dtype, device="cpu",
                             page=pool_page, k_bits=k_bits, k4_heads=k4_heads)
    cache.k_codes.copy_(torch.randint(0, 256, cache.k_codes.shape, generator=g, dtype=torch.uint8))
    cache.v_codes.copy_(torch.randint(0, 256, cache.v_codes.shape, generator=g, dtype=torch.uint8))
    for prm, shrink in ((cache.k_params, 0.2 if k_bits == 4 else 1.0), (cache.v_params, 1.0)):
        prm[..., 0] = round_param((torch.rand(prm.shape[:-1], generator=g) * 0.6 + 0.05) * shrink)
        prm[..., 1] = round_param(-1.5 * torch.rand(prm.shape[:-1], generator=g) - 0.2)
    nan = float("nan")
    # INT2 records decode may read: positions [0, min(L, max(S, L - W, ring_start))) of each request (the sink
    # positions too: read as INT2 where a test drops their sink rows); every other slot's params are NaN (0x7F;
    # e4m3_pair reads it as 480: a stray read in the Triton kernels is a gross error, in the CUDA one NaN)
    readable = torch.zeros(num_slots, dtype=torch.bool)
    for i, L in enumerate(lens):
        readable[req_to_token[int(req_idx[i]), :min(L, max(sink, L - window, ring_starts[i]))].long()] = True
    stray = (~readable).nonzero().flatten()
    cache.set_rows("k_params", stray, nan)
    cache.set_rows("v_params", stray, nan)
    cache.sink_k.fill_(nan)
    cache.sink_v.fill_(nan)
    cache.ring_k.fill_(nan)
    cache.ring_v.fill_(nan)
    cache.sink_table.fill_(-1)
    next_row = 1  # row 0 stays NaN
    for i, L in enumerate(lens):
        r = int(req_idx[i])
        for p in range(min(sink, L)):
            cache.sink_table[req_to_token[r, p]] = next_row
            cache.sink_k[next_row] = torch.randn(hkv, d, generator=g).to(dtype)
            cache.sink_v[next_row] = torch.randn(hkv, d, generator=g).to(dtype)
            next_row += 1
        for p in range(max(ring_starts[i], L - window, 0), L):
            cache.ring_k[r * window + p % window] = torch.randn(hkv, d, generator=g).to(dtype)
            cache.ring_v[r * window + p % window] = torch.randn(hkv, d, generator=g).to(dtype)
    q = (torch.randn(b, hkv * gqa, d, generator=g) * 0.5).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if k_bits == 4:
        cache.k_hi.copy_(torch.randint(0, 256, cache.k_hi.shape, generator=g, dtype=torch.uint8))
    if device != "cpu":
        cache = dataclasses.replace(cache, **{n: t.to(device) for n, t in cache.buffers().items()})
        q, req_to_token, req_idx, seq_lens, ring_start = (
            t.to(device) for t in (q, req_to_token, req_idx, seq_lens, ring_start))
    return dict(q=q, cache=cache, req_to_token=req_to_token, req_pool_indices=req_idx, seq_lens=seq_lens,
                ring_start=ring_start, sink=sink, window=window, sm_scale=1.0 / math.sqrt(d))


def run_and_check(case, tol=TOL, missing_sink_int2=False, **kw):
    ref = mixed_decode_reference(**case, q_transform=kw.get("q_transform"), missing_sink_int2=missing_sink_int2)
    assert torch.isfinite(ref).all()
    out = torch.full_like(case["q"], float("nan"))
    res = oscar_decode(**case, out=out, **kw)
    assert res is out
    assert torch.isfinite(out).all(), "unwritten or NaN output elements"
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.3e} >= {tol}"
    return err


def assert_graph_replays_equal(case, want, replays=2, after_each=None, **kw):
    """oscar_decode(**case, **kw) captured in a CUDA graph: each replay into a NaN-poisoned out equals `want` bit for
    bit (after_each: a further check after every replay). The caller has warmed the call up outside the capture."""
    out = torch.full_like(case["q"], float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oscar_decode(**case, out=out, **kw)
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        if after_each is not None:
            after_each()


# ---------------------------------------------------------------------------- the oracle itself


def test_reference_matches_direct_attention_all_bf16():
    """With every position in the sink or the ring the oracle is plain softmax attention."""
    torch.manual_seed(1)
    hkv, gqa, d, S, W, L = 2, 3, 64, 4, 32, 30
    case = make_case([L], hkv=hkv, gqa=gqa, d=d, sink=S, window=W, device="cpu", dtype=torch.float32)
    c, r = case["cache"], int(case["req_pool_indices"][0])
    k = torch.stack([c.sink_k[c.sink_table[case["req_to_token"][r, p]]] if p < S else c.ring_k[r * W + p % W]
                     for p in range(L)]).double()
    v = torch.stack([c.sink_v[c.sink_table[case["req_to_token"][r, p]]] if p < S else c.ring_v[r * W + p % W]
                     for p in range(L)]).double()
    q = case["q"][0].double()
    s = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(gqa, 1)) / math.sqrt(d)
    direct = torch.einsum("hl,lhd->hd", s.softmax(-1), v.repeat_interleave(gqa, 1))
    ref = mixed_decode_reference(**case)
    assert torch.allclose(ref[0], direct, atol=1e-12)


def test_reference_history_is_dequantized_int2():
    """Rows written with quant.intq + pack read back as intq's dequantized values."""
    torch.manual_seed(2)
    x = torch.randn(5, 2, 64)
    qr = quantize(x, 2, 32)
    got = dequantize_rows(pack_int2(qr.codes), qr.params())
    from sglang_oscar.quant.intq import dequantize
    assert torch.allclose(got.float(), dequantize(qr), atol=1e-6)


# ---------------------------------------------------------------------------- kernel vs oracle

EDGE_LENS = [5, 8, 9, 24, 25, 77]  # L < S, L = S, S < L < S+W, L = S+W, L = S+W+1, L >> S+W


@pytest.mark.parametrize("d,gk,gv,gqa", [
    (64, 64, 32, 1),
    (64, 32, 64, 2),
    (128, 128, 64, 4),
    (128, 32, 128, 3),
    (256, 32, 64, 8),
    (256, 128, 128, 5),
])
def test_decode_edge_lengths(d, gk, gv, gqa):
    run_and_check(make_case(EDGE_LENS, hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, seed=d + gk + gqa))


@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_decode_block_sizes(block_n):
    """Tokens per INT2 iteration (128 by default, 64 at NP 16) against the oracle, with histories that end mid-block
    and span several blocks per split (16: unfolded tiles at GQA 4)."""
    lens = [700, 333, 1200]
    case = make_case(lens, hkv=2, gqa=4, d=128, gk=64, gv=64, ring_starts=[0, 100, 0], seed=block_n)
    run_and_check(case, num_splits=3, block_n=block_n)


@pytest.mark.parametrize("ring_splits", [1, 2, 3, 7])  # 7 > W/2 rows: some ring chunks are empty
def test_decode_ring_splits(ring_splits):
    """The recent window read by several programs: window edges (L < S, S <= L < S+W, L >> S+W) and
    ring_start > 0 (ring shorter than W, chunks past L empty)."""
    lens = [5, 12, 20, 29, 70, 41]
    case = make_case(lens, gqa=2, sink=8, window=16, ring_starts=[0, 0, 0, 0, 60, 35], seed=ring_splits)
    run_and_check(case, num_splits=3, block_n=16, ring_splits=ring_splits)


def test_decode_default_ring_splits_window_256():
    """W = 256 (the serving default): 4 ring programs of 64 positions, lengths around S + W."""
    from sglang_oscar.kernels.shapes import RING_ROWS_PER_SPLIT

    assert -(-256 // RING_ROWS_PER_SPLIT) == 4
    lens = [63, 64, 200, 319, 320, 321, 900]
    case = make_case(lens, hkv=1, gqa=3, sink=64, window=256, ring_starts=[0, 0, 0, 0, 0, 100, 700], seed=5)
    run_and_check(case)


@pytest.mark.parametrize("sink_splits", [1, 2, 3, 5, 8])
def test_decode_sink_splits(sink_splits):
    """The sink read by several programs (chunks of ceil(S / SS) positions, some empty when L < S or SS
    does not divide S), with a missing sink row in one chunk only: the merge must drop every sink partial
    when any one of them is flagged."""
    lens = [3, 8, 9, 30, 70]
    case = make_case(lens, gqa=2, sink=8, window=16, ring_starts=[0, 0, 0, 0, 60], seed=60 + sink_splits)
    run_and_check(case, num_splits=3, block_n=16, sink_splits=sink_splits)
    case = drop_sink_rows(case, {(3, 7), (1, 0)})  # last chunk of request 3, first of request 1
    run_and_check(case, missing_sink_int2=True, num_splits=3, block_n=16, sink_splits=sink_splits)


def test_decode_rejects_zero_sink_splits():
    case = make_case([40], gqa=2)
    with pytest.raises(ValueError, match="sink_splits must be >= 1"):
        oscar_decode(**case, sink_splits=0)


def test_decode_rejects_zero_ring_splits():
    case = make_case([40], gqa=2)
    with pytest.raises(ValueError, match="ring_splits must be >= 1"):
        oscar_decode(**case, ring_splits=0)


@pytest.mark.parametrize("block_n", [16, 32])  # 32: the folded tiles (GQA 2 -> NP 4)
@pytest.mark.parametrize("num_splits", [1, 3, 8, 40])  # 40: most splits empty (b=1 long-context counts)
def test_decode_splits_and_ring_start(num_splits, block_n):
    # ring_start > 0: positions before it (and after L - W) read INT2; also ring_start > L - W, whose
    # extra INT2 rows [L - W, ring_start) only the split holding L - W takes (_history_end), also where
    # later splits are empty (40 splits); ring_start > L (the whole [S, L) is INT2: L = 33 < 40);
    # L - W <= S (no chunk: L = 20, the last split takes [S, ring_start)); and L - W exactly at the end
    # of the last chunk with 3 splits (L = 72 for 16-token blocks, L = 120 for 32)
    lens = [70, 41, 90, 33, 20, 72, 120]
    case = make_case(lens, gqa=2, ring_starts=[60, 30, 10, 40, 14, 65, 110], seed=num_splits)
    run_and_check(case, num_splits=num_splits, block_n=block_n)


def test_default_num_splits_from_shapes_only():
    from sglang_oscar.kernels.decode import (MAX_SPLITS, SMALL_BATCH_HEADS, SMALL_BATCH_SPLITS, SPLIT_MIN_ROWS,
                                             SPLIT_WAVES, _wave_splits, default_num_splits)

    assert (SPLIT_WAVES, SMALL_BATCH_HEADS, SMALL_BATCH_SPLITS, SPLIT_MIN_ROWS, MAX_SPLITS) == (3, 8, 64, 256, 128)
    # batch 1 x 8 KV heads: the small-batch floor of 64 splits over 3 programs per SM (50)
    assert default_num_splits(1, 8, 131072, 132) == SMALL_BATCH_SPLITS > triton.cdiv(SPLIT_WAVES * 132, 8) == 50
    assert _wave_splits(2, 8, 131072, 132) == 25  # 16 heads: 3 programs per SM only (above SMALL_BATCH_HEADS)
    # wave fill: 400 programs fill 76% of 528 slots (4 per SM) -> 32 splits (512 programs, 4096 rows each)
    assert default_num_splits(2, 8, 131072, 132) == 32
    assert default_num_splits(1, 1, 131072, 132) == MAX_SPLITS  # 396 wanted, capped at 128
    assert default_num_splits(64, 8, 131072, 132) == 1
    assert default_num_splits(1, 8, 1024, 132) == 1024 // SPLIT_MIN_ROWS == 4  # >= 256 rows per split
    assert _wave_splits(64, 3, 131072, 132) == 3  # 576 programs: more than 4 per SM
    assert default_num_splits(64, 16, 131072, 132) == 1  # never below 1


@pytest.mark.parametrize("batch,kv_heads,context,expect", [
    (64, 3, 131072, 8),  # SmolLM2 b64: 576 programs = 1.09 rounds of 528 -> 8 splits, 1536 = 2.91 rounds
    (64, 3, 32768, 8),  # 4096 rows per split: still allowed
    (64, 3, 8192, 3),  # 1024 rows per split would be too few: the rule's count stays
    (8, 8, 131072, 8),  # Qwen3 b8: 448 programs (85%) -> 512 (97%)
    (8, 8, 8192, 7),
    (4, 8, 32768, 13),  # 16 splits would leave 2048 rows each (measured 1.04x slower)
    (4, 8, 131072, 16),
    (8, 3, 32768, 17),  # 22 splits at 32k: measured 1.2x slower
    (32, 3, 131072, 5),  # 480 of 528 slots (91%): no change
    (32, 8, 131072, 2),
    (64, 8, 131072, 1),
    (1, 3, 131072, 128),  # at the cap of 128 already
])
def test_default_num_splits_wave_fill(batch, kv_heads, context, expect):
    """Wave fill (kernels/decode.py FILL_*): the cases of the H100 sweeps in benchmark/NOTES.md."""
    from sglang_oscar.kernels.decode import _rounds_fill, _wave_splits, default_num_splits

    ns = default_num_splits(batch, kv_heads, context, 132)
    assert ns == expect
    base = _wave_splits(batch, kv_heads, context, 132)
    if ns != base:  # a change always fills the rounds better and keeps >= FILL_MIN_ROWS rows per split
        assert _rounds_fill(batch * kv_heads * ns, 528) >= 0.95 > _rounds_fill(batch * kv_heads * base, 528)
        assert context // ns >= 4096


@pytest.mark.parametrize("batch,kv_heads,context,expect", [
    (8, 8, 32768, 12),  # Qwen3 b8: 7 -> 12 splits of 2730 rows (measured 0.74x; the 4096-row floor kept 7)
    (4, 8, 65536, 24),  # 13 -> 24 (0.72x)
    (2, 8, 131072, 48),  # 25 -> 48 (0.78x)
    (64, 8, 8192, 3),  # 1 -> 3 (0.85x)
    (1, 8, 131072, 95),  # 64 -> 95 (96 measured 0.95x)
    (1, 8, 32768, 64),  # 99 splits would hold 331 rows: below the floor, kept
    (8, 3, 32768, 32),  # SmolLM2 b8: 17 -> 32 (0.85x)
    (2, 3, 32768, 66),  # 126 splits would hold 260 rows: kept
    (16, 8, 131072, 6),  # one full round already: unchanged
    (32, 8, 131072, 3),  # one round of splits of 43k rows: no long-split step
    (64, 8, 131072, 16),  # two rounds of 43k-row splits -> 16 of 8192 (measured 0.88x)
    (64, 8, 65536, 9),  # -> 8 (86% full) -> 9 (97%)
    (64, 8, 32768, 6),  # -> 4 (86%) -> 6 (97%); measured as fast as 3
    (64, 3, 131072, 4),  # SmolLM2 b64: 768 programs, one round: unchanged
])
def test_default_num_splits_folded_rule(batch, kv_heads, context, expect):
    """The folded kernel's split rule (6 CTAs per SM, FOLD_FILL_MIN_ROWS, FOLD_LONG_SPLIT_ROWS): cases of
    the H100 sweep in benchmark/NOTES.md "Split rule for the folded kernel"."""
    from sglang_oscar.kernels.decode import (FOLD_FILL_MIN_ROWS, FOLD_LONG_SPLIT_ROWS, _rounds_fill, _wave_splits,
                                             default_num_splits)

    rule = dict(ctas_per_sm=6, fill_min_rows=FOLD_FILL_MIN_ROWS, long_split_rows=FOLD_LONG_SPLIT_ROWS)
    ns = default_num_splits(batch, kv_heads, context, 132, **rule)
    assert ns == expect
    if ns != _wave_splits(batch, kv_heads, context, 132):
        assert context // ns >= FOLD_FILL_MIN_ROWS
        assert _rounds_fill(batch * kv_heads * ns, 6 * 132) >= 0.9


@pytest.mark.parametrize("batch,kv_heads,context,expect", [
    (32, 1, 32768, 16),  # GLM-4.7 TP8 batch 32: 13 -> 16 (measured 0.89x)
    (2, 8, 65536, 32),  # Qwen3-32B batch 2: 25 -> 32 (0.86x)
    (8, 8, 8192, 8),  # Qwen3-32B 8k batch 8: 7 -> 8 (0.97x)
    (32, 8, 65536, 2),  # one full round already: unchanged
    (1, 8, 131072, 64),  # batch 1: the small-batch count, unchanged
])
def test_default_num_splits_large_np_rule(batch, kv_heads, context, expect):
    """The unfolded kernel at NP >= 8 fills with LARGE_NP_FILL_MIN_ROWS (4 CTAs per SM): cases of the H100
    sweep in benchmark/NOTES.md "Split sweep of the unfolded kernel at GQA 8 / 12"."""
    from sglang_oscar.kernels.decode import LARGE_NP_FILL_MIN_ROWS, default_num_splits

    assert default_num_splits(batch, kv_heads, context, 132, fill_min_rows=LARGE_NP_FILL_MIN_ROWS) == expect


def test_decode_large_np_launch_uses_its_split_rule(monkeypatch):
    """oscar_decode passes LARGE_NP_FILL_MIN_ROWS where it runs unfolded at NP >= 8 and D <= 128 only."""
    from sglang_oscar.kernels import decode as dec

    seen = []
    orig = dec.default_num_splits
    monkeypatch.setattr(dec, "default_num_splits", lambda *a, **k: seen.append(k) or orig(*a, **k))
    bn = 16 if not CUDA else 64
    run_and_check(make_case([300, 40], hkv=1, gqa=8, d=64, seed=72), block_n=bn)  # NP 8
    assert seen[-1].get("fill_min_rows") == dec.LARGE_NP_FILL_MIN_ROWS and "long_split_rows" not in seen[-1]
    run_and_check(make_case([300, 40], hkv=2, gqa=4, d=64, seed=73), block_n=16)  # NP 4, unfolded (block_n 16)
    assert "fill_min_rows" not in seen[-1]


def test_decode_folded_launch_uses_the_folded_split_rule(monkeypatch):
    """oscar_decode passes the folded rule's parameters (and 6 CTAs per SM) only when it folds."""
    from sglang_oscar.kernels import decode as dec

    seen = []
    orig = dec.default_num_splits
    monkeypatch.setattr(dec, "default_num_splits", lambda *a, **k: seen.append(k) or orig(*a, **k))
    case = make_case([300, 40], hkv=2, gqa=4, d=64, seed=71)
    run_and_check(case, block_n=32)  # NP 4: folded
    assert seen[-1]["fill_min_rows"] == dec.FOLD_FILL_MIN_ROWS and seen[-1]["ctas_per_sm"] == 6
    assert seen[-1]["long_split_rows"] == dec.FOLD_LONG_SPLIT_ROWS
    run_and_check(case, block_n=16)  # not a multiple of 32: unfolded
    assert "fill_min_rows" not in seen[-1] and seen[-1]["ctas_per_sm"] == 4


def test_default_num_splits_wave_fill_bounds():
    from sglang_oscar.kernels.decode import SPLIT_MIN_ROWS, _wave_splits, default_num_splits

    # the SPLIT_MIN_ROWS cap bounds the fill too (fill_min_rows 1: nothing else would stop it)
    assert default_num_splits(8, 8, 4 * SPLIT_MIN_ROWS, 132, fill_min_rows=1) == 4
    assert default_num_splits(8, 8, 7 * SPLIT_MIN_ROWS, 132, fill_min_rows=1) == 7  # cap 7: 8 not taken
    assert default_num_splits(8, 8, 8 * SPLIT_MIN_ROWS, 132, fill_min_rows=1) == 8  # 448 programs (85%) -> 512
    # other slot counts fill other rounds
    assert _wave_splits(64, 3, 131072, 132) == 3
    assert default_num_splits(64, 3, 131072, 132, ctas_per_sm=2) == 4  # 768 programs = 2.9 rounds of 264


def test_decode_with_a_wave_filled_split_count(monkeypatch):
    """oscar_decode end to end with a split count the wave fill raised (8 KV heads x batch 8 over a
    32k-wide req_to_token: 7 -> 8 splits); the requests themselves are short, so most splits are empty."""
    from sglang_oscar.kernels import decode as dec

    seen = []
    orig = dec.default_num_splits
    monkeypatch.setattr(dec, "default_num_splits", lambda *a, **k: seen.append(orig(*a, **k)) or seen[-1])
    lens = [300, 77, 5, 140, 25, 260, 9, 190]
    case = make_case(lens, hkv=8, gqa=2, d=64, seed=61)
    r2t = case["req_to_token"]
    case["req_to_token"] = torch.cat([r2t, torch.zeros(r2t.shape[0], 32768 - r2t.shape[1], dtype=r2t.dtype,
                                                        device=r2t.device)], 1)
    run_and_check(case, block_n=16)
    assert seen == [8] and dec._wave_splits(8, 8, 32768, 132) == 7


@pytest.mark.parametrize("per_head", [False, True])
def test_transform_query_low_precision_path(per_head):
    """T_q already in q's dtype (decode's cached bf16 copy): one GEMM, no casts, ~bf16 rounding away
    from the fp32 product."""
    from sglang_oscar.kernels.decode import transform_query

    g = torch.Generator().manual_seed(2)
    b, hkv, grp, d = 3, 2, 4, 64
    q = torch.randn(b, hkv * grp, d, generator=g)
    t = torch.randn(*((hkv,) if per_head else ()), d, d, generator=g) / d ** 0.5
    ref = transform_query(q.double(), t.double(), hkv)
    low = transform_query(q.bfloat16(), t.bfloat16(), hkv)
    assert low.dtype == torch.bfloat16 and low.shape == q.shape
    err = ((low.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err
    full = transform_query(q.bfloat16(), t, hkv)  # fp32 T_q: fp32 product, cast once
    assert ((full.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_decode_default_windows_long():
    # the real S=64, W=256 with L >> S + W, odd length, ring_start inside the window
    case = make_case([701, 333], hkv=1, gqa=2, d=64, gk=32, gv=64, sink=64, window=256,
                     ring_starts=[500, 0], seed=7)
    run_and_check(case)


@pytest.mark.parametrize("hkv,window,lens,ring_starts,block_n", [
    (2, 16, [1, 15, 16, 17, 77, 300], [0, 0, 0, 0, 0, 290], 16),  # L < W, L = W, W + 1, L >> W, a radix-hit ring
    (1, 256, [1, 255, 256, 257, 701], [0, 0, 0, 0, 500], 32),  # the served window (folded tiles)
])
def test_decode_sink_0(hkv, window, lens, ring_starts, block_n):
    """Sink size 0 (srt/options.py accepts SGLANG_MIXED_KV_PREFIX_TOKENS=0): no sink row is read (the pool's rows are
    NaN and the sink table all -1), positions [0, max(L − W, ring_start)) are INT2, the rest ring rows; the merge's
    one sink program, empty, must add nothing."""
    case = make_case(lens, hkv=hkv, gqa=3, d=64, gk=32, gv=64, sink=0, window=window, ring_starts=ring_starts,
                     seed=window + hkv)
    assert (case["cache"].sink_table == -1).all() and case["cache"].sink_k.isnan().all()
    run_and_check(case, num_splits=3, block_n=block_n)


def test_decode_large_batch_short_contexts():
    lens = [int(x) for x in torch.randint(1, 40, (64,), generator=torch.Generator().manual_seed(3))]
    run_and_check(make_case(lens, hkv=1, gqa=2, d=64, seed=3), num_splits=2)


# Subnormal codes (E_p = code·2^(2p−24) in the INT2 loop). Shapes where one K group spans 2 or 4 planes (q pre-scaled
# by 4^(p_g − p), down to 1/64), groups smaller than a plane (D 256: two byte chunks per plane), K and V with different
# groups, GQA 1-8.
@pytest.mark.parametrize("d,gk,gv,gqa", [
    (64, 64, 32, 3),
    (128, 128, 64, 4),
    (128, 32, 128, 1),
    (256, 32, 64, 8),
])
def test_decode_code_formats(d, gk, gv, gqa):
    case = make_case(EDGE_LENS + [300], hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, ring_starts=[0] * 6 + [250],
                     seed=3 * d + gk + gqa)
    run_and_check(case, num_splits=3, block_n=16)


def _ramp_history_scores(case, slow, steep, knee):
    """Raise the K mins with position so that every head's INT2 scores climb by `slow` log2 units per
    position before `knee` and by `steep` after it (per request), with q > 0 so every head climbs (in steps: the
    mins are float8, 3 mantissa bits)."""
    c = case["cache"]
    case["q"] = case["q"].abs() + 0.5
    rate = (case["q"].double().sum(-1) * case["sm_scale"] * 1.4426950408889634).min().item()  # log2 units per unit of min
    for i, L in enumerate(case["seq_lens"].tolist()):
        r = int(case["req_pool_indices"][i])
        pos = torch.arange(L, dtype=torch.float64, device=c.k_params.device)
        units = slow * pos.clamp(max=knee[i]) + steep * (pos - knee[i]).clamp(min=0)
        slots = case["req_to_token"][r, :L].long()
        c.k_params[slots, :, :, 1] = round_param(units / rate)[:, None, None]


# The online softmax under climbing scores. Request 0's history scores climb 0.1 log2 units per position, then 1 per
# position (> 128 units within a split, so fp32 overflows if a rescale is skipped); request 1 climbs slowly only;
# request 2 has a history shorter than one block (only a masked tail). Splits of 15 full blocks + a tail, and
# single-tail splits (block_n 16: the unfolded tiles).
def test_decode_rescale_ramp():
    case = make_case([700, 300, 37], hkv=2, gqa=3, d=64, gk=32, gv=64, seed=17)
    _ramp_history_scores(case, slow=0.1, steep=1.0, knee=[150, 10 ** 6, 10 ** 6])
    run_and_check(case, num_splits=3, block_n=16)


# Folded tiles (default_fold, NP < 8 and D <= 128 with block_n a multiple of 32): the two halves of each block side by
# side in N. Odd lengths and tails, page boundaries, windows, GQA 1-8 (NP 4 and 8: D 256 / NP 8 stay unfolded), K and
# V groups apart.
@pytest.mark.parametrize("d,gk,gv,gqa", [(64, 64, 32, 3), (128, 128, 64, 4), (128, 32, 128, 1), (256, 32, 64, 8)])
def test_decode_folded_tiles(d, gk, gv, gqa):
    case = make_case(EDGE_LENS + [300], hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, ring_starts=[0] * 6 + [250],
                     seed=5 * d + gk + gqa)
    run_and_check(case, num_splits=3, block_n=32)


def test_decode_folded_tiles_ramp():
    case = make_case([700, 300, 37], hkv=2, gqa=3, d=64, gk=32, gv=64, seed=17)
    _ramp_history_scores(case, slow=0.1, steep=1.0, knee=[150, 10 ** 6, 10 ** 6])
    run_and_check(case, num_splits=3, block_n=32)


def test_decode_folded_default_rule(monkeypatch):
    """The default folds where NP < 8 and D <= 128 only (D 256 spills under FOLD_MAXNREG), and takes 64 tokens
    per iteration where NP >= 16 and D <= 128 (default_block_n): a spy on stage 1's launches records both."""
    import sglang_oscar.kernels.decode as dec

    seen = []
    launch = dec._oscar_decode_stage1.__getitem__

    class Spy:
        def __getitem__(self, grid):
            fn = launch(grid)
            return lambda *a, **kw: (seen.append((kw["FOLD"], kw["BLOCK_N"])), fn(*a, **kw))[1]

    monkeypatch.setattr(dec, "_oscar_decode_stage1", Spy())
    for d, gqa, want in ((128, 4, (True, 128)), (64, 3, (True, 128)), (256, 2, (False, 128)), (128, 8, (False, 128)),
                         (128, 12, (False, dec.LARGE_NP_BLOCK_N)), (64, 16, (False, dec.LARGE_NP_BLOCK_N)),
                         (256, 12, (False, 128))):
        case = make_case([300], hkv=1, gqa=gqa, d=d, seed=d + gqa)
        run_and_check(case, num_splits=2)
        assert seen[-1] == want, (d, gqa, seen[-1])


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_q_transform(per_head):
    case = make_case([45], hkv=2, gqa=2, d=64, seed=13)
    g = torch.Generator().manual_seed(5)
    shape = (2, 64, 64) if per_head else (64, 64)
    t = (torch.randn(shape, generator=g) / 8 + torch.eye(64)).to(case["q"].device)
    run_and_check(case, q_transform=t)


# ---------------------------------------------------------------------------- large GQA groups
# GLM-4.x: 96 q heads / 8 KV heads = 12 per KV head (at TP8: 1 KV head, 12 q heads per rank). The
# INT2 split pads the group to NP = 16 columns; with hkv = 2 a padded column that leaked into a load
# or store would hit KV head 1's heads (poisoned output / wrong partials).


@pytest.mark.parametrize("gqa,d,gk,gv,hkv", [
    (12, 128, 64, 64, 2),
    (12, 128, 32, 128, 1),
    (16, 64, 32, 64, 2),
])
def test_decode_large_gqa(gqa, d, gk, gv, hkv):
    # L < S, L = S + W (window edge), S + W + 1, a few hundred tokens over shuffled 16-slot pages,
    # one ring_start inside the window
    lens = [5, 24, 25, 203]
    case = make_case(lens, hkv=hkv, gqa=gqa, d=d, gk=gk, gv=gv, ring_starts=[0, 0, 0, 195], seed=100 + gqa + gk)
    run_and_check(case, num_splits=2)


# ---------------------------------------------------------------------------- missing sink rows


def drop_sink_rows(case, drops):
    """sink_table[slot] = -1 for (request i, position p) in drops (rows exhausted, or INT2-only writes);
    the row the slot had is poisoned, so reading it anyway fails."""
    c, r2t = case["cache"], case["req_to_token"]
    for i, p in drops:
        slot = int(r2t[int(case["req_pool_indices"][i]), p])
        row = int(c.sink_table[slot])
        assert row >= 0
        c.sink_k[row] = float("nan")
        c.sink_v[row] = float("nan")
        c.sink_table[slot] = -1
    return case


def test_decode_missing_sink_rows_read_int2():
    """Sink positions whose slot has no sink row read the slot's INT2 form (never sink row -1)."""
    S = 8
    lens = [30, 5, 40, 9]
    drops = {(0, 0), (0, 3), (0, 7),  # some rows of a request
             *((1, p) for p in range(5)),  # L < S, all rows missing
             *((2, p) for p in range(S)),  # the pool's sink rows were exhausted for this request
             (3, 4)}
    case = drop_sink_rows(make_case(lens, hkv=2, gqa=3, d=64, gk=32, gv=64, sink=S, window=16, seed=41), drops)
    with pytest.raises(ValueError, match="no sink row"):
        mixed_decode_reference(**case)  # the strict oracle refuses such a cache
    run_and_check(case, missing_sink_int2=True, num_splits=2)


def test_decode_missing_sink_rows_large_gqa_window_edge():
    # GQA 12 (D 128) with every sink row of a request at the window edge (L = S + W) missing
    case = make_case([24, 61], hkv=1, gqa=12, d=128, gk=64, gv=64, seed=43)
    case = drop_sink_rows(case, {(0, p) for p in range(8)} | {(1, 2)})
    run_and_check(case, missing_sink_int2=True)


def test_decode_no_sink_rows_at_all():
    """A pool without any sink row (every sink position INT2): stage 1 must not index an empty buffer."""
    case = make_case([20, 6], hkv=2, gqa=2, d=64, seed=47)
    c = case["cache"]
    c.sink_table.fill_(-1)
    c.sink_k = c.sink_k[:0].contiguous()
    c.sink_v = c.sink_v[:0].contiguous()
    run_and_check(case, missing_sink_int2=True)


@pytest.mark.parametrize("merge_splits", [1, 2, 4])
def test_decode_merge_splits_with_missing_sink_rows(merge_splits):
    """The merge's programs each take D / merge_splits output dims; the missing-sink path scores with all D
    dims of K but accumulates only its slice of V. D 128, G 32/64: slices of 32 dims cross V groups."""
    case = make_case([30, 5, 70], hkv=2, gqa=3, d=128, gk=32, gv=64, sink=8, window=16, seed=53)
    case = drop_sink_rows(case, {(0, 1), (0, 6), *((1, p) for p in range(5)), (2, 0)})
    run_and_check(case, missing_sink_int2=True, num_splits=3, merge_splits=merge_splits)


def test_decode_merge_splits_all_rows_present():
    case = make_case([12, 300, 41], hkv=1, gqa=4, d=64, seed=59)
    run_and_check(case, merge_splits=2)


@pytest.mark.parametrize("query_heads,head_dim,expect", [
    (32, 128, 4),  # Qwen3-8B batch 1: 32 heads on 132 SMs -> 4 programs of 32 dims each
    (64, 128, 2), (128, 128, 1), (256, 128, 1),  # batch 2 / 4 / 8
    (9, 64, 2),  # SmolLM2 batch 1: capped at 32 dims per program
    (12, 128, 4),  # GLM-4.7 TP8 batch 1
    (200, 256, 1),
])
def test_default_merge_splits(query_heads, head_dim, expect):
    assert default_merge_splits(query_heads, head_dim, 132) == expect


@pytest.mark.parametrize("heads,ns,slots,expect", [
    (8, 95, 792, (2, 2)),  # Qwen3-8B batch 1, 64k/128k: 760 INT2 + 64 window programs > 792 slots -> 792
    (8, 64, 792, (4, 4)),  # 32k: 576 programs, one round already
    (8, 97, 792, (4, 4)),  # 776 + 32 > 792 even halved: unchanged
    (16, 48, 792, (4, 4)),  # batch 2: 768 + 128; halved 832 > 792
    (64, 12, 792, (4, 4)),  # batch 8: INT2 programs alone nearly fill the round; halved 1024
    (8, 100, 792, (4, 4)),  # INT2 programs alone take two rounds
])
def test_default_window_splits(heads, ns, slots, expect):
    assert default_window_splits(heads, ns, 64, 256, slots) == expect


def test_decode_halves_window_programs_into_one_round(monkeypatch):
    """With 7 SMs (42 slots of 6 folded programs) 2 requests x 2 KV heads x 3 splits fit, + 4 sink + 4 ring programs
    each do not, + 2 + 2 do: oscar_decode launches 2 + 2, and the result still matches the oracle."""
    from sglang_oscar.kernels import decode as dec

    seen = []
    orig = dec.default_window_splits
    monkeypatch.setattr(dec, "default_window_splits", lambda *a: seen.append(orig(*a)) or seen[-1])
    monkeypatch.setattr(dec, "_num_sms", lambda device: 7)
    case = make_case([700, 333], hkv=2, gqa=2, d=64, sink=64, window=256, seed=67)
    run_and_check(case, num_splits=3)
    assert seen[-1] == (2, 2)
    run_and_check(case, num_splits=3, sink_splits=4, ring_splits=4)  # explicit counts win


@pytest.mark.parametrize("bad", [0, 3, 8])  # 8: 8 dims per program < MERGE_MIN_DIMS
def test_decode_rejects_bad_merge_splits(bad):
    case = make_case([20], hkv=1, gqa=2, d=64, seed=0)
    with pytest.raises(ValueError, match="merge_splits"):
        oscar_decode(**case, merge_splits=bad)


# ---------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    case = make_case([20], hkv=1, gqa=2, d=64, seed=0)
    with pytest.raises(ValueError, match="dtype"):
        oscar_decode(**{**case, "q": case["q"].to(torch.int32)})
    with pytest.raises(ValueError, match="head_dim"):
        oscar_decode(**{**case, "q": case["q"][..., :32].contiguous()})
    with pytest.raises(ValueError, match="GQA group"):
        oscar_decode(**{**case, "q": case["q"].repeat(1, 9, 1)})  # 18 query heads per KV head > 16
    with pytest.raises(ValueError, match="seq_lens"):
        oscar_decode(**{**case, "seq_lens": case["seq_lens"].long()})
    bad = LayerCache.empty(8, 1, 64, k_group=64, v_group=64, device="cpu")
    bad.k_params = torch.empty(8, 1, 4, 2, dtype=torch.bfloat16)  # G = 16: unsupported
    with pytest.raises(ValueError, match="group size"):
        oscar_decode(**{**case, "cache": bad})


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gqa,d,gk,gv", [(4, 128, 64, 64), (3, 64, 64, 64), (8, 256, 64, 64), (12, 128, 64, 64),
                                          (16, 128, 64, 64), (4, 128, 128, 128), (4, 128, 32, 64),
                                          (8, 256, 32, 64)])  # D 256, G 32: two byte chunks per plane
def test_gpu_bf16_long(gqa, d, gk, gv):
    # the fp16 subnormal codes go through the tensor cores (a flush to zero would lose every code and miss the
    # tolerance by far)
    case = make_case([4000, 1333, 70, 9000], hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, sink=64, window=256,
                     ring_starts=[0, 1200, 0, 8900], seed=gqa + gk)
    run_and_check(case, tol=1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gqa,d,gk,gv", [(4, 128, 64, 64), (3, 64, 64, 64), (4, 128, 128, 128), (2, 256, 32, 64),
                                          (1, 128, 64, 64), (8, 256, 32, 64)])
def test_gpu_bf16_ramp(gqa, d, gk, gv):
    # folded tiles (NP < 8, D <= 128) and unfolded ones (D 256); history scores climbing slowly, then by ~25 log2
    # units per block of 128 (a rescale per block)
    case = make_case([4000, 1333, 70, 9000], hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, sink=64, window=256,
                     ring_starts=[0, 1200, 0, 8900], seed=gqa + gk + 1)
    run_and_check(case, tol=1e-2)
    _ramp_history_scores(case, slow=0.02, steep=0.2, knee=[2000, 10 ** 6, 10 ** 6, 4000])
    run_and_check(case, tol=1e-2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("merge_splits", [1, 2, 4])
def test_gpu_bf16_merge_splits(merge_splits):
    case = make_case([9000, 70], hkv=2, gqa=4, d=128, sink=64, window=256, ring_starts=[8900, 0], seed=61)
    case = drop_sink_rows(case, {(0, 3), (1, 0), (1, 63)})
    run_and_check(case, tol=1e-2, missing_sink_int2=True, merge_splits=merge_splits)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_capture():
    case = make_case([3000, 500], hkv=2, gqa=4, d=128, sink=64, window=256, seed=21)
    out = torch.full_like(case["q"], float("nan"))
    oscar_decode(**case, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oscar_decode(**case, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = mixed_decode_reference(**case)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2


@pytest.mark.parametrize("pool_page,d,gqa,block_n", [(4, 64, 2, 32), (16, 128, 4, 32), (64, 64, 3, 16),
                                                     (16, 128, 8, 32), (128, 64, 2, 32), (256, 128, 3, 16)])
def test_decode_paged_pool(pool_page, d, gqa, block_n):
    """Pools in pages (kernels/records.py): the history, the folded (block_n 32 at NP 4) and unfolded loops and the
    merge's sink positions read as INT2 all find a slot's record at ((s // P) * Hkv + h) * P + s % P. Slots are
    assigned in pages of 16 in random order, so requests cross pool pages mid-page (pages of 128 and 256, which the
    server takes too: a pool of 6 / 3 such pages)."""
    case = make_case([150, 33, 97], hkv=2, gqa=gqa, d=d, sink=8, window=16, ring_starts=[0, 0, 40],
                     pool_page=pool_page, seed=pool_page)
    assert case["cache"].k_codes.shape == (case["cache"].num_slots // pool_page, 2, pool_page, d // 4)
    run_and_check(case, num_splits=3, block_n=block_n)
    # some sink positions without a sink row: read as INT2 by the merge
    case["cache"].sink_table[case["req_to_token"][case["req_pool_indices"][0], :3].long()] = -1
    run_and_check(case, missing_sink_int2=True, num_splits=2, block_n=block_n)


@pytest.mark.parametrize("k_bits", [2, 4])
def test_decode_paged_pool_equals_unpaged(k_bits):
    """The same rows in a paged and an unpaged pool give the same output (bit-exact on the interpreter)."""
    flat = make_case([130, 61], hkv=2, gqa=2, d=64, sink=8, window=16, pool_page=1, seed=5, k_bits=k_bits)
    paged = make_case([130, 61], hkv=2, gqa=2, d=64, sink=8, window=16, pool_page=8, seed=5, k_bits=k_bits)
    slots = torch.arange(flat["cache"].num_slots)
    for name in flat["cache"].buffers().keys() & {"k_codes", "k_hi", "v_codes", "v_params", "k_params"}:
        paged["cache"].set_rows(name, slots, flat["cache"].rows(name, slots))
    a = oscar_decode(**flat, num_splits=3, block_n=32)
    b = oscar_decode(**paged, num_splits=3, block_n=32)
    assert torch.isfinite(a).all() and torch.equal(a, b)


# ---------------------------------------------------------------------------- float8 params, INT4 keys


@triton.jit
def _e4m3_pair_kernel(P, S, M, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale, mn = e4m3_pair(tl.load(P + offs).to(tl.int32))
    tl.store(S + offs, scale)
    tl.store(M + offs, mn)


def test_e4m3_pair_decodes_every_param_pair_exactly():
    """e4m3_pair, the kernels' integer decode of a (scale, min) pair (2^-8 times the values), against torch's float8
    e4m3 -> fp32 on all 2^16 byte pairs with finite bytes: ±0, subnormals 2^-9..2^-6, ±448, both bytes' signs."""
    pairs = torch.arange(1 << 16, dtype=torch.int32)
    b = torch.stack([pairs & 0xFF, pairs >> 8], -1).to(torch.uint8)  # scale byte at the lower address
    words = b.view(torch.int16).reshape(-1).to(DEV)
    got_s, got_m = (torch.full((1 << 16,), float("nan"), device=DEV) for _ in "sm")
    _e4m3_pair_kernel[((1 << 16) // 4096,)](words, got_s, got_m, BLOCK=4096)
    want = b.view(torch.float8_e4m3fn).float()
    finite = want.isfinite().all(-1)
    assert int(finite.sum()) == 254 * 254
    assert torch.equal(got_s.cpu()[finite] * 256, want[finite, 0])
    assert torch.equal(got_m.cpu()[finite] * 256, want[finite, 1])
    assert want[finite].abs().max() == 448 and (want[finite] == 2.0**-9).any()


# A layer with INT4-key heads (cache.k4_heads, high planes in cache.k_hi): codes lo | hi << 2 from k_codes and k_hi,
# uniform levels 0..15, on those heads; the layer's other heads INT2 (uniform levels); values INT2. The history loop's
# K side takes the subnormal codes (up to 15·2^(2p−24)) whatever the V side does. Shapes: D 64 / 128 / 256, K and V
# groups 32 / 64 / 128 (param words of 1, 2 and 4 pairs, two int64 words at D 256 G 32), folded (block_n 32 at NP 4)
# and unfolded tiles, GQA 1-12, pages of 1 and 64, all heads INT4 or some (k_hi holds fewer heads than k_codes: its
# own records), odd lengths around the window edges and a ring_start inside the window; then sink positions without
# a sink row, read by the merge as INT4 keys (with the merge's D split over programs).
@pytest.mark.parametrize("d,gk,gv,gqa,block_n,pool_page,hkv,k4_heads", [
    (64, 64, 32, 3, 32, 1, 2, None),  # folded
    (64, 32, 64, 1, 16, 64, 3, (1,)),  # unfolded, GQA 1
    (128, 64, 64, 4, 32, 64, 2, None),  # the served shape, folded
    (128, 64, 64, 4, 32, 64, 4, (0, 3)),
    (128, 128, 32, 2, 16, 1, 3, (0, 2)),  # a K group over all 4 planes: q pre-scaled down to 1/64
    (128, 32, 128, 8, 32, 64, 3, (2,)),  # NP 8: unfolded
    (128, 64, 64, 12, 64, 1, 2, None),  # NP 16
    (256, 32, 64, 5, 32, 64, 2, None),  # D 256: two byte chunks per plane
    (256, 128, 128, 2, 32, 1, 3, (1, 2)),
])
def test_decode_int4_keys(d, gk, gv, gqa, block_n, pool_page, hkv, k4_heads):
    case = make_case(EDGE_LENS + [300], hkv=hkv, gqa=gqa, d=d, gk=gk, gv=gv, ring_starts=[0] * 6 + [250],
                     pool_page=pool_page, seed=7 * d + gk + gqa + hkv, k_bits=4, k4_heads=k4_heads)
    assert case["cache"].k_hi.shape[-3 if pool_page > 1 else -2] == (hkv if k4_heads is None else len(k4_heads))
    run_and_check(case, num_splits=3, block_n=block_n)
    case = drop_sink_rows(case, {(1, 0), (3, 2), (5, 7), *((0, p) for p in range(5))})
    run_and_check(case, missing_sink_int2=True, num_splits=2, block_n=block_n, merge_splits=2)


@pytest.mark.parametrize("block_n", [16, 32])
def test_decode_int4_keys_rescale_ramp(block_n):
    case = make_case([700, 300, 37], hkv=2, gqa=3, d=64, gk=32, gv=64, seed=23, k_bits=4, k4_heads=(1,))
    _ramp_history_scores(case, slow=0.1, steep=1.0, knee=[150, 10 ** 6, 10 ** 6])
    run_and_check(case, num_splits=3, block_n=block_n)


def test_decode_refuses_bf16_params():
    case = make_case([40], gqa=2)
    case["cache"].v_params = case["cache"].v_params.float().to(torch.bfloat16)
    with pytest.raises(ValueError, match="v_params must be torch.float8_e4m3fn"):
        oscar_decode(**case)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("gqa,d,gk,gv,pool_page,k4_heads", [
    (4, 128, 64, 64, 64, None), (4, 128, 64, 64, 64, (1,)), (3, 64, 64, 64, 1, (0,)), (8, 256, 64, 64, 64, None),
    (12, 128, 64, 64, 64, None), (2, 256, 32, 64, 1, (1,)), (1, 128, 128, 128, 64, None), (16, 64, 32, 64, 64, None),
    (2, 128, 32, 64, 1, None)])
def test_gpu_int4_keys_long(gqa, d, gk, gv, pool_page, k4_heads):
    """INT4-key heads on the GPU's fast path: the inline-PTX INT4 subnormal codes (a wrong lane or bit would be far
    off) in folded and unfolded tiles, all heads INT4 or one of the two, and the merge's INT4 sink positions."""
    case = make_case([4000, 1333, 70, 9000], hkv=2, gqa=gqa, d=d, gk=gk, gv=gv, sink=64, window=256,
                     ring_starts=[0, 1200, 0, 8900], pool_page=pool_page, seed=gqa + gk + d, k_bits=4,
                     k4_heads=k4_heads)
    run_and_check(case, tol=1e-2)
    case = drop_sink_rows(case, {(0, 3), (2, 0), (2, 63)})
    run_and_check(case, tol=1e-2, missing_sink_int2=True)


# ---- the CUDA history stage (kernels/history_cuda.py) -------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and nvcc)")


def test_cuda_history_rejects_what_it_does_not_cover():
    from sglang_oscar.kernels import history_cuda

    assert os.path.exists(history_cuda.SOURCE)  # shipped as package data (pyproject.toml)
    case = make_case([40, 30], hkv=2, gqa=2, d=256, gk=64, gv=64, device="cpu")
    with pytest.raises(ValueError, match="the CUDA history stage covers head_dim 128 with K/V groups 64 or 128; "
                                         "head_dim 64 with K/V groups 32 or 64, GQA 1-16; this is "
                                         "head_dim 256"):
        oscar_decode(**case, history_kernel="cuda")
    for gk, gv in ((32, 64), (64, 32), (32, 32), (64, 64)):  # D 64 (SmolLM2): covered, its window read by Triton
        case = make_case([40, 30], hkv=3, gqa=3, d=64, gk=gk, gv=gv, device="cpu", dtype=torch.float32)
        with pytest.raises(ValueError, match="needs CUDA tensors"):  # not the BF16-window refusal of D 128
            oscar_decode(**case, history_kernel="cuda", ring_splits=2)  # nor the window programs' counts
    with pytest.raises(ValueError, match="this is head_dim 64, GQA 3, groups 16/64"):
        history_cuda.check_supported(64, 3, 16, 64, "cpu")
    case = make_case([40, 30], hkv=2, gqa=4, d=128, gk=64, gv=32, device="cpu")
    with pytest.raises(ValueError, match="this is head_dim 128, GQA 4, groups 64/32"):
        oscar_decode(**case, history_kernel="cuda")
    for gqa in (17, 20):  # above head groups of 8 x 2 (GLM-4.7's 12 is covered: 8 + 4); oscar_decode refuses
        with pytest.raises(ValueError, match=f"this is head_dim 128, GQA {gqa}"):  # these before, for both
            history_cuda.check_supported(128, gqa, 64, 64, "cpu")
    case = make_case([40, 30], hkv=1, gqa=12, d=128, device="cpu", dtype=torch.bfloat16)  # GLM-4.7 TP8: covered
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        oscar_decode(**case, history_kernel="cuda")
    case = make_case([40, 30], hkv=1, gqa=8, d=128, device="cpu", dtype=torch.bfloat16)  # Qwen3-32B: covered
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        oscar_decode(**case, history_kernel="cuda")
    case = make_case([40, 30], hkv=2, gqa=4, d=128, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="reads the sink and ring rows as bfloat16 at head_dim 128; this window is "
                                         "torch.float32"):
        oscar_decode(**case, history_kernel="cuda")
    with pytest.raises(ValueError, match="ring_splits / sink_splits set the Triton window programs"):
        oscar_decode(**make_case([40, 30], hkv=2, gqa=4, d=128, device="cpu", dtype=torch.bfloat16),
                     history_kernel="cuda", ring_splits=2)  # checked before the device: CPU CI sees it
    case = make_case([40, 30], hkv=2, gqa=4, d=128, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        oscar_decode(**case, history_kernel="cuda")
    with pytest.raises(ValueError, match="history_kernel must be"):
        oscar_decode(**case, history_kernel="cutlass")


def test_follows_write_refuses_what_would_race():
    """oscar_decode(follows_write=True) reads q before it waits for the KV write: it needs the CUDA history kernel,
    a q transformed and contiguous before the write (a GEMM or copy in between would write q while the kernel reads
    it) and PDL (sm_90+); the write's trigger needs PDL too; the launch's pdl mode is one of three. All checked
    before any device work, so CPU CI sees them."""
    from sglang_oscar.kernels import history_cuda
    from sglang_oscar.kernels.write import oscar_write_kv

    case = make_case([40, 30], hkv=2, gqa=4, d=128, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="follows_write .* needs history_kernel='cuda'"):
        oscar_decode(**case, follows_write=True)
    eye = torch.eye(128).expand(2, 128, 128).contiguous()
    with pytest.raises(ValueError, match="transform q .* before the KV write, and pass q_transform=None"):
        oscar_decode(**case, history_kernel="cuda", follows_write=True, q_transform=eye)
    strided = {**case, "q": torch.cat([case["q"], case["q"]], dim=-1)[..., :128]}
    with pytest.raises(ValueError, match="make it contiguous before the KV write"):
        oscar_decode(**strided, history_kernel="cuda", follows_write=True)
    with pytest.raises(ValueError, match="follows_write needs programmatic dependent launch"):
        oscar_decode(**case, history_kernel="cuda", follows_write=True)
    with pytest.raises(ValueError, match="q_from_write qualifies follows_write"):
        oscar_decode(**case, history_kernel="cuda", q_from_write=True)
    k = torch.zeros(1, 2, 128)
    idx = torch.full((1,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="pdl_trigger needs programmatic dependent launch"):
        oscar_write_kv(k, k, torch.zeros(1, dtype=torch.int64), idx, idx, case["cache"], k_transform=eye,
                       pdl_trigger=True)
    with pytest.raises(ValueError, match="pdl must be PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_WRITE or PDL_AFTER_WRITE_Q"):
        history_cuda.launch(case["q"], case["cache"], case["req_to_token"], case["req_pool_indices"],
                            case["seq_lens"], case["ring_start"], sink=8, window=16, sm_scale=1.0, ns=1, ns_total=3,
                            o_part=None, lse_part=None, pdl=4)


@requires_cuda
@pytest.mark.parametrize("gqa,q_in_write,write_kernel,d", [
    (4, False, "triton", 128), (8, False, "triton", 128), (4, True, "triton", 128), (5, True, "triton", 128),
    (12, False, "triton", 128), (12, True, "triton", 128), (4, False, "cuda", 128), (4, True, "cuda", 128),
    (12, True, "cuda", 128), (3, False, "triton", 64), (3, True, "triton", 64), (3, False, "triton", "64w"),
    (3, True, "triton", "64w")])
def test_cuda_history_after_the_kv_write(gqa, q_in_write, write_kernel, d, monkeypatch):
    """The decode step's chain as the server runs it on sm_90+: oscar_write_kv(pdl_trigger=True), then
    oscar_decode(follows_write=True), whose history CTAs run while the write does; q_in_write: the write also
    rotates q (q_out) and the history CTAs wait for it before reading q (q_from_write). Same bits as the plain chain
    (eager, and replays of a captured graph into a poisoned output; to rounding where the chained launch runs narrower
    stages than the plain one), and the plain chain matches the oracle on the
    written cache. The write also stores scratch tokens of a request outside the batch, listed first (4096; 249
    where it rotates q, at most 256 tokens), so that it is still running when the history kernel starts: a window
    CTA that read the new ring / sink row before the write had stored it, or a history CTA of the request whose
    history reaches the new token (ring_start >= L) that did not wait, would read the old row. Lengths: long, L =
    S + 1, L = S, L < S, window edges, ring_start >= L. write_kernel: the Triton write or the CUDA write
    (kernels/write_cuda.py), which triggers its dependents the same way. d 64 (SmolLM2): the window is read by the
    Triton window programs launched after the history kernel, which must see the new row too; d 64 runs the chained
    launch at 32-token stages, "64w" at 64-token ones (history_cuda.D64_WIDE_AFTER_WRITE past the batch / 1; the plain chain
    has 64-token stages either way)."""
    from sglang_oscar.kernels import history_cuda
    from sglang_oscar.kernels.decode import transform_query
    from sglang_oscar.kernels.write import oscar_write_kv

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    wide_after = d == "64w"
    d = 64 if wide_after else d
    monkeypatch.setattr(history_cuda, "D64_WIDE_AFTER_WRITE", 1 if wide_after else 1 << 20)  # from batch 1 / never
    if d == 64:
        assert history_cuda.block_tokens(64, 4, history_cuda.PDL_AFTER_WRITE, 7) == (64 if wide_after else 32)
    sink, window, hkv = 64, 256, 2
    lens = [5001, 65, 64, 3, 321, 320, 2000]  # L after the write: the new token is at L - 1
    ring_starts = [0, 0, 0, 0, 0, 0, 2000]  # the last request's history reaches L - 1
    case = make_case(lens, hkv=hkv, gqa=gqa, d=d, gk=64, gv=64 if d == 128 else 32, sink=sink, window=window,
                     ring_starts=ring_starts, pool_page=64, seed=90 + gqa + 10 * q_in_write + d)
    cache, r2t, ridx = case["cache"], case["req_to_token"], case["req_pool_indices"].long()
    b = len(lens)
    pos = case["seq_lens"].long() - 1
    new_slots = r2t[ridx, pos].long()
    extra = next(r for r in range(r2t.shape[0]) if r not in ridx.tolist())
    scratch = r2t[extra, :256 - b if q_in_write else 4096].long()
    none = torch.full((scratch.numel(),), -1, dtype=torch.int32, device="cuda")
    slots = torch.cat([scratch, new_slots])
    sink_dst = torch.cat([none, torch.where(pos < sink, cache.sink_table[new_slots], -1).int()])
    ring_dst = torch.cat([none, torch.where(pos >= sink, ridx * window + pos % window, -1).int()])
    g = torch.Generator(device="cuda").manual_seed(gqa)
    k_new, v_new = (torch.randn(slots.numel(), hkv, d, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, device="cuda"))[0].contiguous()
    t_q = rot.to(torch.bfloat16)
    q_rows = torch.randn(slots.numel(), hkv * gqa, d, generator=g, device="cuda").to(torch.bfloat16)
    q_rows[-b:] = case["q"]
    q_out = torch.full_like(q_rows, float("nan"))
    if q_in_write:  # the decode reads the write's q_out: its rows of the batch
        case = {**case, "q": q_out[-b:]}

    def chain(pdl, out):
        kw = dict(q=q_rows, q_transform=t_q, q_out=q_out) if q_in_write else {}
        oscar_write_kv(k_new, v_new, slots, sink_dst, ring_dst, cache, k_transform=rot, validate=False,
                       pdl_trigger=pdl, kernel=write_kernel, **kw)
        return oscar_decode(**case, out=out, history_kernel="cuda", follows_write=pdl,
                            q_from_write=pdl and q_in_write, write_kernel=write_kernel)

    ring_row = ridx[0] * window + pos[0] % window
    old_row = cache.ring_k[ring_row].clone()
    plain = chain(False, torch.full_like(case["q"], float("nan"))).clone()
    assert not torch.equal(cache.ring_k[ring_row], old_row)  # the write replaced make_case's row
    if q_in_write:  # the write's rotation of q: transform_query's, to bf16 rounding (fp32 vs GEMM summation)
        torch.testing.assert_close(q_out.float(), transform_query(q_rows, t_q, hkv).float(), rtol=1e-2, atol=1e-2)
    run_and_check(case, history_kernel="cuda")  # the oracle on the cache as written
    out = torch.full_like(case["q"], float("nan"))
    q_out.fill_(float("nan"))  # rewritten by the write of the chain below before the decode reads it
    chained = chain(True, out).clone()
    if d == 64 and not wide_after:  # 32-token stages chained, 64 plain: another summation order, equal to rounding
        torch.testing.assert_close(chained.float(), plain.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(chained, plain)
    gr = torch.cuda.CUDAGraph()  # the write and the decode captured together, as in a served decode step
    with torch.cuda.graph(gr):
        chain(True, out)
    for _ in range(3):
        out.fill_(float("nan"))
        q_out.fill_(float("nan"))
        gr.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chained)


@requires_cuda
@pytest.mark.parametrize("gqa", [4, 8, 12])
def test_cuda_history_after_the_kv_write_batch_1(gqa, monkeypatch):
    """One request chained to its KV write, q rotated by the write: oscar_decode picks chained_num_splits (its
    context bounds lowered to this case's: they are a speed choice); the output matches the oracle on the written
    cache, and the plain (unchained) decode of the same cache to rounding. Where the chained count without window CTAs
    is below the fold's 20 tiles (GQA 12: 16 head-group columns; any GQA at this short width, CHAINED_MIN_ROWS), plan()
    asks again with them: exactly plan()'s picks, all chained."""
    from sglang_oscar.kernels import history_cuda
    from sglang_oscar.kernels.write import oscar_write_kv

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    monkeypatch.setattr(history_cuda, "CHAINED_MIN_CONTEXT", 0)
    picked = []
    real = history_cuda.chained_num_splits
    monkeypatch.setattr(history_cuda, "chained_num_splits", lambda *a, **k: picked.append(real(*a, **k)) or picked[-1])
    case = make_case([9001], hkv=8, gqa=gqa, d=128, sink=64, window=256, pool_page=64, seed=130 + gqa)
    cache, r2t, ridx = case["cache"], case["req_to_token"], case["req_pool_indices"].long()
    pos = case["seq_lens"].long() - 1
    slots = r2t[ridx, pos].long()
    gen = torch.Generator(device="cuda").manual_seed(gqa)
    k_new, v_new = (torch.randn(1, 8, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
    rot = torch.linalg.qr(torch.randn(8, 128, 128, generator=gen, device="cuda"))[0].contiguous()
    q_out = torch.full_like(case["q"], float("nan"))
    none = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    ring_dst = (ridx * 256 + pos % 256).int()
    oscar_write_kv(k_new, v_new, slots, none, ring_dst, cache, k_transform=rot, validate=False, pdl_trigger=True,
                   q=case["q"], q_transform=rot.to(torch.bfloat16), q_out=q_out)
    out = torch.full_like(case["q"], float("nan"))
    oscar_decode(**{**case, "q": q_out}, out=out, history_kernel="cuda", follows_write=True, q_from_write=True)
    run_and_check({**case, "q": q_out.clone()}, history_kernel="cuda")  # the oracle on the cache as written
    torch.testing.assert_close(out.float(), oscar_decode(**{**case, "q": q_out}, history_kernel="cuda").float(),
                               rtol=1e-2, atol=1e-2)
    # the chained call only (the plain decodes above use the default count): plan()'s count without window CTAs,
    # then, where that does not fold, the count with them
    from sglang_oscar.kernels.write import default_block_t, write_grid

    programs = math.prod(write_grid(1, 8, default_block_t(1, 128), True))
    sms, width = torch.cuda.get_device_properties(0).multi_processor_count, r2t.shape[1]
    first = real(8, gqa, sms, programs, 0, max_context=width)
    want = [first] if history_cuda.folds(first, 64, 256) else \
        [first, real(8, gqa, sms, programs, sum(history_cuda.window_ctas(64, 256)), max_context=width)]
    assert picked == want and all(1 < p <= history_cuda.MAX_PARTIALS for p in picked), (picked, want)


def test_cuda_history_ctypes_signature_matches_the_source():
    """history_cuda.LAUNCH_ARGTYPES against the C parameters of oscar_history_launch in the .cu source: a parameter
    added on one side only would shift every later argument (no GPU or nvcc needed)."""
    import ctypes
    import re

    from sglang_oscar.kernels import history_cuda

    src = open(history_cuda.SOURCE).read()
    params = re.search(r"int oscar_history_launch\(([^)]*)\)", src).group(1)
    kinds = []
    for prm in (x.strip() for x in params.split(",")):
        kinds.append(ctypes.c_void_p if "*" in prm else ctypes.c_float if prm.startswith("float") else ctypes.c_int)
        assert "*" in prm or prm.startswith(("int ", "float ")), prm
    assert kinds == history_cuda.LAUNCH_ARGTYPES
    for fn in ("prepare", "occupancy"):  # (nstage, warps, hc, head_dim, wide)
        assert re.search(rf"int oscar_history_{fn}\(int nstage, int warps, int hc, int head_dim, int wide\)", src), fn
    assert params.startswith("int nstage, int warps, int hc, int head_dim, int wide, int bh,"), params[:80]


def test_cuda_history_block_tokens(monkeypatch):
    """64-token stages (int2_history.cu WIDE) at D 64 with 4-head columns for a launch that does not follow the KV
    write, and for one that does from batch D64_WIDE_AFTER_WRITE (2); 32 at batch 1 after the write, at 8-head
    columns and at D 128. occupancy() refuses the 64-token build where it is not built (before touching the
    library: a stand-in one here, no GPU)."""
    from sglang_oscar.kernels import history_cuda as hc

    assert hc.D64_WIDE_AFTER_WRITE == 2
    for batch in (1, 2, 64):
        for pdl in (hc.PDL_OFF, hc.PDL_WAIT_FIRST):
            assert hc.block_tokens(64, 4, pdl, batch) == 64
            assert hc.block_tokens(64, 8, pdl, batch) == 32
            assert hc.block_tokens(128, 4, pdl, batch) == 32
        for pdl in (hc.PDL_AFTER_WRITE, hc.PDL_AFTER_WRITE_Q):
            assert hc.block_tokens(64, 4, pdl, batch) == (32 if batch == 1 else 64)
            assert hc.block_tokens(64, 8, pdl, batch) == 32
            assert hc.block_tokens(128, 4, pdl, batch) == 32
    monkeypatch.setattr(hc, "_lib", object())  # never called: the refusals come first
    for heads, head_dim in ((4, 128), (8, 64)):
        with pytest.raises(ValueError, match="64-token stages at head_dim 64 with 4 heads per column only"):
            hc.occupancy(heads=heads, head_dim=head_dim, wide=True)


def test_cuda_history_columns_per_gqa():
    """Query heads per CTA column (history_cuda.cta_heads) and the grid's columns: 4 up to GQA 4, one column of 8
    for GQA 5-8 (the 8-head tile), head groups of 8 above that."""
    from sglang_oscar.kernels import history_cuda

    assert [history_cuda.cta_heads(g) for g in (1, 3, 4, 5, 6, 8, 12, 16)] == [4, 4, 4, 8, 8, 8, 8, 8]
    assert [history_cuda.cta_columns(16, g) for g in (1, 4, 5, 8, 12, 16)] == [16, 16, 16, 16, 32, 32]


def test_cuda_chained_split_count(monkeypatch):
    """history_cuda.chained_num_splits: one round of resident CTAs less the chained write's programs and the window
    CTAs, shared by the CTA columns: Qwen3-8B / 32B at batch 1 on 132 SMs (2 CTAs each), 8 columns, 24 write
    programs (K, V, q of 8 KV heads), 3 window CTAs per column -> (264 - 24 - 24) / 8 = 27; capped by the merge's
    partials; at least 1."""
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "occupancy", lambda heads=4, head_dim=128: 2)
    assert history_cuda.chained_num_splits(8, 4, 132, write_programs=24, window_partials=3) == 27
    assert history_cuda.chained_num_splits(8, 8, 132, write_programs=24, window_partials=3) == 27  # one 8-head tile
    assert history_cuda.chained_num_splits(8, 4, 132, write_programs=16, window_partials=3) == 28  # q by a GEMM
    assert history_cuda.chained_num_splits(1, 4, 132, write_programs=3, window_partials=3) == \
        history_cuda.MAX_PARTIALS - 3
    assert history_cuda.chained_num_splits(64, 4, 16, write_programs=192, window_partials=3) == 1
    # CHAINED_MIN_ROWS: above one CTA per SM with < 96 rows per warp, one CTA per SM. GLM-4.7 TP8 (1 KV head, GQA 12:
    # 2 head-group columns, 3 write programs): the round's 130 leaves 31-63 rows per warp at 32k-64k -> 66; TP4 (4
    # columns, 6 programs): 64 -> 33 at 32k (64 rows), 64 kept at 64k (128 rows); Qwen3-8B keeps 27 (151 rows at 32k)
    glm8 = [history_cuda.chained_num_splits(1, 12, 132, 3, 0, max_context=c) for c in (1 << 15, 1 << 16)]
    assert glm8 == [66, 66] and history_cuda.chained_num_splits(1, 12, 132, 3, 0) == 130
    glm4 = [history_cuda.chained_num_splits(2, 12, 132, 6, 0, max_context=c) for c in (1 << 15, 1 << 16)]
    assert glm4 == [33, 64]
    assert history_cuda.chained_num_splits(8, 4, 132, 24, 3, max_context=1 << 15) == 27
    assert history_cuda.split_count(1, 1, 12, 1 << 16, 132, 0, chained_write_programs=3) == 66
    # split_count, oscar_decode's pick: chained only for one chained request at a 32k-64k req_to_token width
    from sglang_oscar.kernels.write import write_grid

    assert math.prod(write_grid(1, 8, 1, True)) == 24 and math.prod(write_grid(1, 8, 1, False)) == 16
    for width in (1 << 15, 1 << 16):
        assert history_cuda.split_count(1, 8, 4, width, 132, 3, chained_write_programs=24) == 27
    for batch, width, chained in ((1, (1 << 15) - 1, 24), (1, (1 << 16) + 1, 24), (2, 1 << 15, 48), (1, 1 << 15, None)):
        assert history_cuda.split_count(batch, 8, 4, width, 132, 3, chained) == \
            history_cuda.default_num_splits(batch * 8, 4, width, 132, 3)
    # batch 1 beyond 64k: one round (33 columns' worth) less one slot per column, so that each column's sink CTA
    # starts in the first round; the one-round count elsewhere (batch 2: 16 x 16 columns = 256 <= 264)
    assert history_cuda.default_num_splits(8, 4, 1 << 17, 132, 3) == 33
    for chained in (None, 24):
        assert history_cuda.split_count(1, 8, 4, 1 << 17, 132, 3, chained) == 32
        assert history_cuda.split_count(1, 8, 8, 1 << 17, 132, 3, chained) == 32  # GQA 8: one 8-head column per KV head
    assert history_cuda.split_count(2, 8, 4, 1 << 17, 132, 3) == history_cuda.default_num_splits(16, 4, 1 << 17, 132, 3)
    assert history_cuda.split_count(1, 1, 4, 1 << 20, 4, 3) == 7  # 8 slots, 1 column: 7


def test_cuda_split_floor_fills_the_sms(monkeypatch):
    """history_cuda.default_num_splits: >= MIN_ROWS_PER_SPLIT (256) rows per warp, unless that leaves SMs without a
    CTA; then as many CTAs as SMs (never more: 17 x 8 = 136 CTAs on 132 SMs was 1.23x slower than 16 at 32k),
    down to MIN_ROWS_TO_FILL (32) rows per warp. GLM-4.7 at TP8 (1 KV head, GQA 12: 2 head-group columns) at batch
    1 on 132 SMs: 66 splits at 32k (the 256-row floor gave 16: 32 CTAs) and at 64k / 128k; Qwen3-8B (8 columns):
    16 at 8k (was 4) and 32k, 32 at 64k (the 256-row floor, > 16); batch 8 (64 columns): 4 at 8k (the 256-row
    floor); a short context keeps one block per warp at least."""
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "occupancy", lambda heads=4, head_dim=128: 2)
    glm = [history_cuda.default_num_splits(1, 12, ctx, 132, 0) for ctx in (1 << 15, 1 << 16, 1 << 17)]
    assert glm == [66, 66, 66]
    qwen = [history_cuda.default_num_splits(8, 4, ctx, 132, 0) for ctx in (1 << 13, 1 << 15, 1 << 16)]
    assert qwen == [16, 16, 32]
    assert history_cuda.default_num_splits(16, 4, 1 << 13, 132, 0) == 8  # batch 2: 132 // 16 columns
    assert history_cuda.default_num_splits(64, 4, 1 << 13, 132, 0) == 4
    assert history_cuda.default_num_splits(8, 4, 1024, 132, 0) == 4  # 1024 // (32 x 8): one block per warp
    assert history_cuda.default_num_splits(8, 4, 100, 132, 0) == 1


def test_cuda_window_fold_plan(monkeypatch):
    """history_cuda.plan: the split count of a grid without window CTAs, folded where it has a split per window tile
    (fold_tiles: ceil(S / 16) + ceil(W / 16)); else split_count with the window CTAs. Qwen3-8B on 132
    SMs x 2 CTAs: batch 1 at 64k folds into 32 splits (rows cap), at 128k into one whole round (33, no slot kept for a
    sink CTA), chained at 32k-64k into (264 - 24 write programs) / 8 = 30; batch 1 at 32k (16 splits by the rows cap)
    and batch 2 (16) keep the window CTAs."""
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "occupancy", lambda heads=4, head_dim=128: 2)
    assert history_cuda.fold_tiles(64, 256) == 20 and history_cuda.fold_tiles(5, 40) == 4
    assert history_cuda.fold_tiles(0, 16) == 1 and history_cuda.fold_tiles(130, 129) == 9 + 9
    assert history_cuda.folds(20, 64, 256) and not history_cuda.folds(19, 64, 256)
    assert history_cuda.plan(1, 8, 4, 1 << 16, 132, 64, 256) == (32, True)  # the rows cap: 64k / (256 x 8 warps)
    assert history_cuda.plan(1, 8, 4, 1 << 17, 132, 64, 256) == (33, True)
    assert history_cuda.plan(1, 8, 4, 1 << 16, 132, 64, 256, chained_write_programs=24) == (30, True)
    assert history_cuda.plan(1, 8, 4, 1 << 17, 132, 64, 256, chained_write_programs=24) == (33, True)
    assert history_cuda.plan(1, 8, 4, 1 << 15, 132, 64, 256) == (16, False)
    assert history_cuda.plan(2, 8, 4, 1 << 17, 132, 64, 256) == (16, False)
    assert history_cuda.plan(1, 8, 4, 1 << 15, 132, 5, 40) == (16, True)  # 4 window tiles
    # the count with window CTAs where the window does not fold (split_count with their partials)
    assert history_cuda.split_count(1, 8, 4, 1 << 17, 132, 3) == 32  # the sink CTA's slot kept
    assert history_cuda.split_count(1, 8, 4, 1 << 16, 132, 3, chained_write_programs=24) == 27
    # D 64 (SmolLM2: 3 KV heads, GQA 3): no window in the kernel; the split count keeps room in the merge for the
    # Triton window programs (ceil(64 / 16) + ceil(256 / 64) = 8) and counts D 64's own occupancy (3 CTAs per SM at
    # ~80 registers): 131072 / (256 rows x 8 warps) = 64 splits at batch 1
    assert not history_cuda.folds(33, 64, 256, head_dim=64)
    monkeypatch.setattr(history_cuda, "occupancy",
                        lambda heads=4, head_dim=128: 3 if head_dim == 64 else 2)
    assert history_cuda.plan(1, 3, 3, 1 << 17, 132, 64, 256, head_dim=64) == (64, False)
    assert history_cuda.plan(64, 3, 3, 1 << 17, 132, 64, 256, head_dim=64) == (2, False)  # 192 columns: 396 slots
    assert not history_cuda.fuses_window(64) and history_cuda.fuses_window(128)


def test_cuda_window_ctas_cover_the_window():
    from sglang_oscar.kernels import history_cuda

    rows = history_cuda.WINDOW_ROWS_PER_WARP * history_cuda.WARPS
    for sink, window in [(64, 256), (0, 16), (5, 40), (64, 1000), (130, 129)]:
        ss, rs = history_cuda.window_ctas(sink, window)
        assert ss >= 1 and rs >= 1 and ss * rows >= sink and rs * rows >= window
        assert (ss - 1) * rows < max(sink, 1) and (rs - 1) * rows < window  # no CTA that is always empty


@requires_cuda
@pytest.mark.parametrize("sink,window,lens,ring_starts", [
    (64, 256, [3, 64, 65, 319, 320, 321, 5000], [0, 0, 0, 0, 0, 300, 4990]),  # L < S, L = S, window edges, ring_start
    (5, 40, [1, 5, 6, 44, 45, 46, 2001], [0, 0, 0, 0, 0, 40, 1999]),  # sink and window not multiples of 16
    (64, 1000, [100, 1063, 1064, 1065, 9000], [0, 0, 0, 1060, 0]),  # 8 ring CTAs
    (0, 256, [1, 255, 256, 257, 3001], [0, 0, 0, 0, 2990]),  # sink 0: one empty sink CTA
])
def test_cuda_window_ctas_match_the_oracle(sink, window, lens, ring_starts, monkeypatch):
    """The sink and ring rows read by the CUDA kernel's own window CTAs (after the history CTAs in the grid): lengths
    on both sides of S, S + W and the window CTAs' 16-row tiles, ring_start past L - W, sink / window sizes that are
    not multiples of 16, at split counts below the fold's tiles (window CTAs, not the folded window). Poisoned output
    (run_and_check); sink positions without a sink row read from their INT2 records into the tile."""
    from sglang_oscar.kernels import history_cuda

    case = make_case(lens, hkv=2, gqa=4, d=128, sink=sink, window=window, ring_starts=ring_starts, pool_page=64,
                     seed=sink + window)
    for ns in sorted({3, min(11, history_cuda.fold_tiles(sink, window) - 1)}):  # below the fold's tiles
        assert not history_cuda.folds(ns, sink, window)
        run_and_check(case, history_kernel="cuda", num_splits=ns)
    r0 = case["req_pool_indices"][-1]
    case["cache"].sink_table[case["req_to_token"][r0, :3].long()] = -1  # the window CTAs read those INT2 records
    calls = []
    real = history_cuda.launch
    monkeypatch.setattr(history_cuda, "launch", lambda *a, **k: calls.append(k["window_splits"]) or real(*a, **k))
    run_and_check(case, missing_sink_int2=True, history_kernel="cuda", num_splits=3)
    assert calls == [history_cuda.window_ctas(sink, window)]


@requires_cuda
@pytest.mark.parametrize("sink,window,lens,ring_starts", [
    (64, 256, [3, 64, 65, 319, 320, 321, 5000], [0, 0, 0, 0, 0, 300, 4990]),  # L < S, L = S, window edges, ring_start
    (5, 40, [1, 5, 6, 44, 45, 46, 2001], [0, 0, 0, 0, 0, 40, 1999]),  # sink and window not multiples of 16
])
@pytest.mark.parametrize("gqa", [4, 8, 12, 16])
def test_cuda_window_folded_into_the_history_ctas(sink, window, lens, ring_starts, gqa, monkeypatch):
    """The window folded into the history CTAs (history_cuda.folds: warp 0 of split i reads window tile i, no window
    CTAs, and hands up to 7 16-row units of its history to the next warps): at the fold's smallest split count (one
    split per tile) and a larger one, at GQA 4 and 8 (4- and 8-head tiles), GQA 12 and 16 (head groups of 8: two CTA
    columns per KV head, each folding its own copy of the tile), with sink positions whose INT2 records are read into
    the tile, against the oracle with poisoned outputs."""
    from sglang_oscar.kernels import history_cuda

    case = make_case(lens, hkv=2, gqa=gqa, d=128, sink=sink, window=window, ring_starts=ring_starts, pool_page=64,
                     seed=sink + window + gqa)
    tiles = history_cuda.fold_tiles(sink, window)
    calls = []
    real = history_cuda.launch
    monkeypatch.setattr(history_cuda, "launch", lambda *a, **k: calls.append(k["fold"]) or real(*a, **k))
    for ns in (tiles, tiles + 13):
        assert history_cuda.folds(ns, sink, window)
        run_and_check(case, history_kernel="cuda", num_splits=ns)
    r0 = case["req_pool_indices"][0]
    case["cache"].sink_table[case["req_to_token"][r0, :3].long()] = -1  # L = 3: every sink position as INT2
    r1 = case["req_pool_indices"][-1]
    case["cache"].sink_table[case["req_to_token"][r1, 1:4].long()] = -1
    run_and_check(case, missing_sink_int2=True, history_kernel="cuda", num_splits=tiles)
    assert calls == [True] * 3


@requires_cuda
def test_cuda_window_folded_batch_1_auto_splits_and_graph_replay():
    """Batch 1 at a ~50k req_to_token width: oscar_decode's own pick folds the window (history_cuda.plan: 24 splits by
    the rows cap), the output matches the oracle, and CUDA-graph replays reproduce the eager output bit for bit."""
    from sglang_oscar.kernels import history_cuda

    case = make_case([50001], hkv=8, gqa=4, d=128, sink=64, window=256, ring_starts=[49900], pool_page=64,
                     seed=77)
    ns, fold = history_cuda.plan(1, 8, 4, case["req_to_token"].shape[1], torch.cuda.get_device_properties(0)
                                 .multi_processor_count, 64, 256)
    assert fold and ns >= history_cuda.fold_tiles(64, 256)
    run_and_check(case, history_kernel="cuda")
    want = oscar_decode(**case, history_kernel="cuda")
    assert_graph_replays_equal(case, want, history_kernel="cuda")


@requires_cuda
def test_cuda_ring_ctas_zero_the_rows_below_ring_start():
    """The ring CTAs copy the ring rows of max(L - W, S) .. L - 1 without waiting for ring_start, then zero and mask
    those of positions below it (W steps after a prefix-cache hit, where those positions are INT2 history). Here
    those ring rows hold NaN (stale bits): the output must still match the oracle, which never reads them; ring_start
    inside the first tile, on a tile edge, in a later CTA, and L - 1 (one ring row)."""
    sink, window = 64, 256
    lens = [3000, 3000, 3000, 3000, 700, 321]
    ring_starts = [2750, 2760, 2936, 2999, 600, 300]  # L - W = 2744 (444, 65): 6, 16, 192, 255 rows masked
    # make_case fills the ring with NaN and writes only the rows of positions max(ring_start, L - W) .. L - 1
    case = make_case(lens, hkv=2, gqa=4, d=128, sink=sink, window=window, ring_starts=ring_starts, pool_page=64,
                     seed=49)
    c, r = case["cache"], int(case["req_pool_indices"][0])
    assert torch.isnan(c.ring_k[r * window + (lens[0] - window) % window]).all()  # position L - W: stale NaN
    run_and_check(case, history_kernel="cuda")
    run_and_check(case, history_kernel="cuda", num_splits=5)  # window CTAs


@requires_cuda
def test_cuda_window_ctas_gqa_and_batch_64():
    """Window CTAs with spare columns (GQA 1, 3, 5) and eight heads per column (GQA 8), and with 64 requests."""
    for gqa in (1, 3, 5, 8):
        case = make_case([700, 3000, 90], hkv=2, gqa=gqa, d=128, sink=64, window=256, ring_starts=[0, 2900, 0],
                         pool_page=64, seed=60 + gqa)
        run_and_check(case, history_kernel="cuda")
    case = make_case([64 + 97 * i for i in range(64)], hkv=2, gqa=4, d=128, sink=64, window=256, pool_page=64,
                     seed=70)
    run_and_check(case, history_kernel="cuda")


@requires_cuda
@pytest.mark.parametrize("sink", [64, 0])  # 0: accepted by the server options (no sink rows)
@pytest.mark.parametrize("pool_page", [1, 64])
@pytest.mark.parametrize("lens,ring_starts", [
    ([5001], [0]),  # batch 1, odd length
    ([3000, 777, 330, 70], [0, 700, 0, 0]),  # ring_start > L - W, a request without history, L < S + W
    # the ranges taken again from ring_start (the kernel takes them from L first): ring_start = L, > L (clamped to
    # L), inside the window by one row, on a split's 16-row step, and below L - W (the ranges from L stand)
    ([2500, 600, 1201, 1200, 4000], [2500, 610, 946, 1104, 3000]),
    ([400 + 613 * i for i in range(64)], None),  # batch 64
])
def test_cuda_history_matches_the_oracle(pool_page, lens, ring_starts, sink):
    case = make_case(lens, hkv=2, gqa=4, d=128, gk=64, gv=64, sink=sink, window=256, ring_starts=ring_starts,
                     pool_page=pool_page, seed=len(lens) + pool_page + (0 if sink else 7))
    run_and_check(case, history_kernel="cuda")
    # sink positions without a sink row still go through the merge's INT2 path
    r0 = case["req_pool_indices"][0]
    case["cache"].sink_table[case["req_to_token"][r0, :5].long()] = -1
    run_and_check(case, missing_sink_int2=True, history_kernel="cuda")


@requires_cuda
@pytest.mark.parametrize("gqa", [4, 8])
def test_cuda_history_explicit_splits_and_graph_capture(gqa):
    case = make_case([2000, 1500], hkv=2, gqa=gqa, d=128, sink=64, window=256, pool_page=64, seed=3 + gqa)
    run_and_check(case, history_kernel="cuda", num_splits=8)
    want = oscar_decode(**case, history_kernel="cuda")  # build and warm up outside the capture
    assert_graph_replays_equal(case, want, replays=1, history_kernel="cuda")


@requires_cuda
def test_cuda_history_q_dtypes_and_alignment():
    """The warps read a 16-bit q in 16-byte loads before their index chain (fp32 q element by element): bf16, fp16
    and fp32 q against the oracle, the history and window CTAs both; a q that does not start 16-byte aligned is
    refused with what to do, not read misaligned."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        case = make_case([1500, 700, 97], hkv=2, gqa=4, d=128, sink=64, window=256, pool_page=64, seed=11)
        case["q"] = case["q"].to(dtype)
        run_and_check(case, history_kernel="cuda")
    case = make_case([700], hkv=2, gqa=4, d=128, sink=64, window=256, pool_page=64, seed=12)
    flat = torch.empty(case["q"].numel() + 4, dtype=case["q"].dtype, device=case["q"].device)
    q = flat[4:].view_as(case["q"])  # contiguous, 8 bytes past the start
    q.copy_(case["q"])
    case["q"] = q
    with pytest.raises(ValueError, match="q must start 16-byte aligned"):
        oscar_decode(**case, history_kernel="cuda")


@requires_cuda
def test_cuda_history_split_counts_and_index_dtypes():
    """One partial per CTA (its warps merged in shared memory): any split count, including CTAs whose warps
    are partly or wholly empty; SGLang's int64 req_pool_indices read as they are."""
    case = make_case([2000, 1500, 333], hkv=2, gqa=4, d=128, sink=64, window=256, pool_page=64, seed=11)
    for ns in (1, 3, 8, 37):  # 37 CTAs x 8 warps over 1680 / 1180 / 13 rows: many empty warps and CTAs
        run_and_check(case, history_kernel="cuda", num_splits=ns)
    want = oscar_decode(**case, history_kernel="cuda", num_splits=5)
    got64 = oscar_decode(**{**case, "req_pool_indices": case["req_pool_indices"].long()}, history_kernel="cuda",
                         num_splits=5)
    assert torch.isfinite(want).all() and torch.equal(got64, want)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        oscar_decode(**{**case, "seq_lens": case["seq_lens"].long()}, history_kernel="cuda")
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        oscar_decode(**case, history_kernel="cuda", num_splits=0)


@requires_cuda
@pytest.mark.parametrize("gqa", [1, 3, 5, 6, 7, 8, 12, 16])
def test_cuda_history_gqa_head_groups(gqa):
    """GQA != 4: spare columns of a CTA store nothing. GQA 5-8 in one column of 8 heads (the 8-head tile:
    Qwen3-14B / 32B, MiniMax-M2); above 8 head groups of 8 (12 = 8 + 4 with spare columns: GLM-4.x; 16 = 8 + 8). The
    output is poisoned with NaN before the call, so a missing or misplaced head fails the check."""
    for gk, gv in ((64, 64), (128, 64), (64, 128)):
        case = make_case([3001, 1200, 90], hkv=2, gqa=gqa, d=128, gk=gk, gv=gv, sink=64, window=256,
                         ring_starts=[0, 1000, 0], pool_page=64, seed=20 + gqa + gk + 2 * gv)
        run_and_check(case, history_kernel="cuda")
        run_and_check(case, history_kernel="cuda", num_splits=3)
        r0 = case["req_pool_indices"][0]
        case["cache"].sink_table[case["req_to_token"][r0, :5].long()] = -1  # the window CTAs' INT2 fill
        run_and_check(case, missing_sink_int2=True, history_kernel="cuda")


@requires_cuda
@pytest.mark.parametrize("gqa,gk,gv", [(3, 64, 64), (3, 32, 32), (3, 32, 64), (3, 64, 32), (1, 32, 32), (4, 64, 64),
                                       (5, 32, 64), (8, 64, 32), (12, 64, 64), (16, 32, 32)])
def test_cuda_history_head_dim_64(gqa, gk, gv, monkeypatch):
    """D 64 (SmolLM2: 9 query / 3 KV heads, GQA 3): planes of 16 dims, the K dot with two planes per m16n8k32, four V
    m-tiles; rows of one group (64) or two (32) on each side; GQA 1-4 in 4-head columns (64-token stages with the
    tiles unrolled), 5-8 in one 8-head column, 12 / 16 in head groups of 8 (32-token stages); the window read by the
    Triton window programs after the kernel. Against the oracle (NaN-poisoned output) with odd lengths across pages,
    ring_start inside and past the window, L < S + W, a request without history, missing sink rows, explicit split
    counts (empty warps and CTAs), q in fp16 / fp32, and a graph replay. (The 32-token stages at 4-head columns run
    chained to the write at batch 1: test_cuda_history_after_the_kv_write.)"""
    from sglang_oscar.kernels import history_cuda

    # emptied: from here it holds the configurations launched (each launch prepares its own) and plan's 32-token one
    monkeypatch.setattr(history_cuda, "_occupancy", {})
    lens, rings = [5001, 1200, 330, 70, 2500], [0, 1000, 0, 0, 2500]
    case = make_case(lens, hkv=3, gqa=gqa, d=64, gk=gk, gv=gv, sink=64, window=256, ring_starts=rings, pool_page=64,
                     seed=150 + gqa + gk + gv)
    run_and_check(case, history_kernel="cuda")
    for ns in (1, 7, 37):
        run_and_check(case, history_kernel="cuda", num_splits=ns)
    want = oscar_decode(**case, history_kernel="cuda")
    assert_graph_replays_equal(case, want, replays=1, history_kernel="cuda")
    if gqa == 3:
        for dtype in (torch.float16, torch.float32):
            run_and_check({**case, "q": case["q"].to(dtype)}, history_kernel="cuda")
    r0 = case["req_pool_indices"][0]
    case["cache"].sink_table[case["req_to_token"][r0, :5].long()] = -1
    run_and_check(case, missing_sink_int2=True, history_kernel="cuda")
    # the instance that ran: the launch prepares (occupancy) the configuration it launches
    launched = {k[3] for k in history_cuda._occupancy if k[2] == 64 and k[1] == history_cuda.cta_heads(gqa)}
    assert (True in launched) == (gqa <= 4), launched


@requires_cuda
def test_cuda_history_head_dim_64_wide_stages_keep_the_occupancy():
    """The split count (plan) comes from the 32-token D-64 instance's CTAs per SM; the 64-token instance (4-head
    columns) must hold as many."""
    from sglang_oscar.kernels import history_cuda

    narrow = history_cuda.occupancy(heads=4, head_dim=64)
    assert narrow >= 3, narrow  # ~80 registers: 3 CTAs of 8 warps
    assert history_cuda.occupancy(heads=4, head_dim=64, wide=True) == narrow


@requires_cuda
@pytest.mark.parametrize("lens,pool_page", [([9001], 64), ([64 + 331 * i for i in range(64)], 64), ([3001, 77], 1)])
def test_cuda_history_head_dim_64_batch_1_and_64(lens, pool_page):
    """SmolLM2's shape at batch 1 (the split rule's many splits: D 64's own occupancy) and batch 64, and on a pool
    of single-slot pages; the Triton path agrees with it to rounding."""
    case = make_case(lens, hkv=3, gqa=3, d=64, gk=64, gv=64, sink=64, window=256, pool_page=pool_page,
                     seed=170 + len(lens) + pool_page)
    run_and_check(case, history_kernel="cuda")
    torch.testing.assert_close(oscar_decode(**case, history_kernel="cuda").float(),
                               oscar_decode(**case, history_kernel="triton").float(), rtol=2e-2, atol=2e-2)


@requires_cuda
@pytest.mark.parametrize("gk,gv", [(128, 128), (64, 128), (128, 64)])
@pytest.mark.parametrize("pool_page", [1, 64])
def test_cuda_history_groups_of_128(gk, gv, pool_page):
    """K and / or V groups of 128: one (scale, min) pair per row, 4-byte param records."""
    case = make_case([4001, 1500, 300], hkv=2, gqa=4, d=128, gk=gk, gv=gv, sink=64, window=256,
                     ring_starts=[0, 0, 0], pool_page=pool_page, seed=40 + gk // 64 + gv // 32 + pool_page)
    run_and_check(case, history_kernel="cuda")
    run_and_check(case, history_kernel="cuda", num_splits=7)
