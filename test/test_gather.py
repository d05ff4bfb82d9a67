"""oscar_gather_prefixes / oscar_gather_prefix (kernels/gather.py) against quant/cache_ops.py:gather_reference.

The cache is filled the way the engine fills it (the write oracle, quant/cache_ops.py:write_reference, with sink
rows for positions < S and ring rows for the last W positions; float8 (scale, min), INT4 keys on a layer's k4_heads),
or with random bytes. Tolerance: 1e-6 of the row's max (the dequantization min + scale·code is the same fp32
arithmetic; a GPU may fuse it into one FMA) plus one ulp for 16-bit outputs. Rows past kv_indptr[-1] keep their
poison.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import ACT_DTYPE, DEVICE, assert_rows_close, gen, poison_, random_orthogonal, randn, requires_triton

from sglang_oscar.quant.cache_ops import gather_reference, write_reference

pytestmark = requires_triton

I32 = dict(dtype=torch.int32, device=DEVICE)


def _kernels():
    from sglang_oscar.kernels.gather import oscar_gather_prefix, oscar_gather_prefixes
    from sglang_oscar.kernels.layout import LayerCache

    return LayerCache, oscar_gather_prefixes, oscar_gather_prefix


def engine_cache(lengths, ring_starts, *, D=64, H=2, gk=32, gv=64, S=4, W=6, seed=0, drop_sink=(), page=1,
                 k4_heads=(), min_slots=0):
    """Write every request's tokens [0, L) like the engine: the quantized form always (INT4 keys on k4_heads), sink
    rows for p < S, ring rows for p in [max(ring_start, L − W), L). Returns cache, req_to_token, pool indices.
    min_slots: a pool of at least that many slots (whole pages), the requests' slots drawn from all of them."""
    LayerCache, _, _ = _kernels()
    g = gen(seed)
    b = len(lengths)
    max_len = max(max(lengths), 1)
    num_slots = -(-max(sum(lengths) + 8, min_slots) // page) * page
    cache = LayerCache.empty(num_slots, H, D, k_group=gk, v_group=gv, num_sink_rows=S * b, max_reqs=b + 1,
                             window=W, sink=S, window_dtype=ACT_DTYPE, device=DEVICE, page=page,
                             k_bits=4 if k4_heads else 2, k4_heads=k4_heads)
    for t in cache.buffers().values():
        poison_(t)
    cache.sink_table.fill_(-1)
    pool_idx = torch.randperm(b + 1, generator=g)[:b]
    req_to_token = torch.full((b + 1, max_len + 3), -1, dtype=torch.int32)
    slots_all = torch.randperm(num_slots, generator=g)
    kmat, vmat = random_orthogonal(D, g=g), random_orthogonal(H, D, g=g)
    kmean = randn(D, g=g)
    used = 0
    ks, vs, slots, sdst, rdst = [], [], [], [], []
    sink_row = 0
    for i, (L, rs) in enumerate(zip(lengths, ring_starts)):
        r = int(pool_idx[i])
        sl = slots_all[used: used + L]
        used += L
        req_to_token[r, :L] = sl.int()
        for p in range(L):
            if p < S and (i, p) not in drop_sink:
                cache.sink_table[sl[p]] = sink_row
                sdst.append(sink_row)
                sink_row += 1
            else:
                sdst.append(-1)
            rdst.append(r * W + p % W if p >= max(rs, L - W) else -1)
        slots.append(sl)
        ks.append(randn(L, H, D, g=g, dtype=ACT_DTYPE))
        vs.append(randn(L, H, D, g=g, dtype=ACT_DTYPE))
    k, v = torch.cat(ks), torch.cat(vs)
    write_reference(k, v, torch.cat(slots).to(DEVICE), torch.tensor(sdst, **I32), torch.tensor(rdst, **I32), cache,
                    k_transform=kmat, k_mean=kmean, v_transform=vmat, k_clip=0.95)
    return cache, req_to_token.to(DEVICE), pool_idx.to(DEVICE)


def check(cache, req_to_token, pool_idx, prefix_lens, ring_starts, ring_ends=None, *, out_dtype=ACT_DTYPE,
          extra_rows=3, block_n=32):
    _, oscar_gather_prefixes, _ = _kernels()
    n = sum(prefix_lens)
    out_k = poison_(torch.empty(n + extra_rows, cache.kv_heads, cache.head_dim, dtype=out_dtype, device=DEVICE))
    out_v = poison_(torch.empty_like(out_k))
    indptr = torch.tensor([0] + torch.tensor(prefix_lens).cumsum(0).tolist(), **I32)
    oscar_gather_prefixes(cache, req_to_token, pool_idx, indptr, torch.tensor(ring_starts, **I32), out_k, out_v,
                          ring_ends=None if ring_ends is None else torch.tensor(ring_ends, **I32),
                          block_n=block_n)
    rk, rv = gather_reference(cache, req_to_token, pool_idx.tolist(), prefix_lens, ring_starts, ring_ends=ring_ends,
                              dtype=out_dtype)
    assert not rk.isnan().any() and not rv.isnan().any(), "reference read a poisoned row: bad test setup"
    assert_rows_close(out_k[:n], rk, "gathered K", rel=1e-6)
    assert_rows_close(out_v[:n], rv, "gathered V", rel=1e-6)
    assert out_k[n:].isnan().all() and out_v[n:].isnan().all(), "rows past kv_indptr[-1] were written"
    return out_k[:n], out_v[:n]


def test_gather_engine_written():
    """Lengths around S and S + W, a request with a radix-hit ring_start, an empty request."""
    lengths = [3, 17, 0, 10, 25]
    ring_starts = [0, 0, 0, 8, 21]
    cache, r2t, idx = engine_cache(lengths, ring_starts, drop_sink={(1, 2)})
    # a (stale) sink entry for a slot at position >= S must be ignored
    cache.sink_table[r2t[idx[1], 6].long()] = 0
    check(cache, r2t, idx, lengths, ring_starts)


def test_gather_missing_sink_rows_read_int2():
    """Sink rows exhausted (a whole request without rows, L < S and L > S) or missing for single
    positions: those positions read the slot's INT2 form, never sink row -1 (as decode does)."""
    lengths, ring_starts = [3, 12, 9], [0, 0, 5]
    drop = {(0, 0), (0, 1), (0, 2), *((1, p) for p in range(4)), (2, 1), (2, 3)}
    cache, r2t, idx = engine_cache(lengths, ring_starts, drop_sink=drop, seed=7)
    k, v = check(cache, r2t, idx, lengths, ring_starts)
    # request 1 (rows 3..14): its first S = 4 positions equal the INT2 reconstruction of their slots
    from sglang_oscar.quant.cache_ops import dequantize_slots

    slots = r2t[idx[1], :4].long()
    want = dequantize_slots(cache.k_codes[slots], cache.k_params[slots], cache.k_group)
    assert_rows_close(k[3:7], want, "INT2 form of the sink positions", rel=1e-6)


@pytest.mark.parametrize("page", [4, 16, 128, 256])
def test_gather_paged_pool(page):
    """Pools in pages (kernels/records.py): written by the write kernel and read by the gather kernel in the
    same paged layout, INT2 positions included (missing sink rows too), against the oracle. Three pages at least
    (the served 128 and 256 too), the requests' slots drawn from all of them."""
    lengths, ring_starts = [3, 17, 0, 40, 25], [0, 0, 0, 8, 21]
    cache, r2t, idx = engine_cache(lengths, ring_starts, drop_sink={(1, 2), (4, 0)}, seed=page, page=page,
                                   min_slots=2 * page + 1)
    assert cache.k_codes.shape[2] == page and cache.k_codes.shape[0] >= 3
    check(cache, r2t, idx, lengths, ring_starts)


@pytest.mark.parametrize("S", [64, 0])
def test_gather_served_sizes(S):
    """The served sizes: sink 64 (and 0, which the server accepts: no sink rows, every position below the ring
    INT2), window 256, D 128 with groups of 64, pool pages of 64, 40 requests at the default block_n 64: lengths on
    both sides of S, W and S + W, an empty request, ragged short ones; ring_starts below L − W (no effect), past it
    (INT2 rows up to it) and at L − 1, a missing sink row; against the oracle, outputs poisoned."""
    W = 256
    g = gen(64 + S)
    edges = [0, 1, 63, 64, 65, 255, 256, 257, 319, 320, 321, 2]
    lengths = edges + [int(x) for x in torch.randint(3, 120, (40 - len(edges),), generator=g)]  # (interpreter time)
    ring_starts = [0] * len(lengths)
    ring_starts[8] = 10  # L 319: below L − W = 63
    ring_starts[10] = 300  # L 321: past L − W = 65
    ring_starts[-1] = lengths[-1] - 1
    drop = {(9, 1)} if S else set()
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=128, H=2, gk=64, gv=64, S=S, W=W, seed=S + 1,
                                   drop_sink=drop, page=64)
    assert cache.k_codes.shape[2] == 64 and cache.sink_k.shape[0] == S * len(lengths)
    check(cache, r2t, idx, lengths, ring_starts, block_n=64)


def test_gather_chunk_already_in_ring():
    """ring_end > prefix_len: the chunk [prefix, L) is in the ring, so fewer prefix rows come from it."""
    lengths, ring_starts = [20, 13], [0, 5]
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=128, gk=128, gv=32, seed=1)
    prefix = [16, 9]
    check(cache, r2t, idx, prefix, ring_starts, ring_ends=lengths, block_n=16)


def test_gather_bf16_out_and_d256():
    lengths, ring_starts = [12], [0]
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=256, gk=64, gv=128, W=4, S=2, seed=2)
    check(cache, r2t, idx, lengths, ring_starts, out_dtype=torch.bfloat16)


def test_gather_groups_smaller_than_a_quarter_plane():
    """D 256 with G 32 (a quarter plane of 64 elements spans two groups: per-element (scale, min))."""
    lengths, ring_starts = [21, 9], [0, 3]
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=256, gk=32, gv=64, W=4, S=2, seed=5)
    check(cache, r2t, idx, lengths, ring_starts)


@pytest.mark.parametrize("block_n", [16, 64])
def test_gather_long_prefix_blocks_without_window_rows(block_n):
    """Long prefixes: most blocks hold no sink or ring row (the kernel skips their window loads),
    some hold a few; odd lengths so blocks straddle two requests and the ragged end."""
    lengths, ring_starts = [301, 77, 190], [0, 40, 0]
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=64, gk=32, gv=64, S=4, W=6, seed=11)
    check(cache, r2t, idx, lengths, ring_starts, block_n=block_n)


def test_gather_matches_write_semantics():
    """Sink/ring positions return the exact transformed rows; history positions the INT2 reconstruction."""
    lengths, ring_starts = [15], [0]
    cache, r2t, idx = engine_cache(lengths, ring_starts, S=4, W=6, seed=3)
    k, _ = check(cache, r2t, idx, lengths, ring_starts)
    slots = r2t[idx[0], :15].long()
    sink_rows = cache.sink_table[slots[:4]].long()
    assert torch.equal(k[:4], cache.sink_k[sink_rows].to(k.dtype))
    assert torch.equal(k[9:], cache.ring_k[int(idx[0]) * 6 + torch.arange(9, 15, device=DEVICE) % 6].to(k.dtype))


def test_gather_single_request_wrapper():
    _, _, oscar_gather_prefix = _kernels()
    lengths, ring_starts = [2, 14], [0, 3]
    cache, r2t, idx = engine_cache(lengths, ring_starts, seed=4)
    out_k = poison_(torch.empty(16, cache.kv_heads, cache.head_dim, dtype=ACT_DTYPE, device=DEVICE))
    out_v = poison_(torch.empty_like(out_k))
    oscar_gather_prefix(cache, r2t, int(idx[1]), 14, 3, out_k, out_v)
    rk, rv = gather_reference(cache, r2t, [int(idx[1])], [14], [3], dtype=ACT_DTYPE)
    assert_rows_close(out_k[:14], rk, "K", rel=1e-6)
    assert_rows_close(out_v[:14], rv, "V", rel=1e-6)
    assert out_k[14:].isnan().all()


def test_gather_random_bytes_no_sink_table():
    """Arbitrary pool contents (all 256 byte values), no sink table: every prefix position below the ring is INT2."""
    LayerCache, _, _ = _kernels()
    g = gen(5)
    cache = LayerCache.empty(40, 3, 64, k_group=32, v_group=64, num_sink_rows=0, max_reqs=2, window=5, sink=3,
                             window_dtype=ACT_DTYPE, device=DEVICE, with_sink_table=False)
    cache.k_codes.copy_(torch.randint(0, 256, cache.k_codes.shape, generator=g, dtype=torch.uint8))
    cache.v_codes.copy_(torch.randint(0, 256, cache.v_codes.shape, generator=g, dtype=torch.uint8))
    for t in (cache.k_params, cache.v_params, cache.ring_k, cache.ring_v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    r2t = torch.randperm(40, generator=g).int().view(2, 20).to(DEVICE)
    check(cache, r2t, torch.tensor([1, 0], device=DEVICE), [20, 7], [0, 2])


def test_gather_errors():
    _, oscar_gather_prefixes, _ = _kernels()
    cache, r2t, idx = engine_cache([5], [0], seed=6)
    out = torch.empty(5, cache.kv_heads, cache.head_dim, dtype=ACT_DTYPE, device=DEVICE)
    ind = torch.tensor([0, 5], **I32)
    rs = torch.tensor([0], **I32)
    with pytest.raises(ValueError, match="kv_indptr"):
        oscar_gather_prefixes(cache, r2t, idx, ind.long(), rs, out, out.clone())
    with pytest.raises(ValueError, match="out_k must be"):
        oscar_gather_prefixes(cache, r2t, idx, ind, rs, out[:, :1], out.clone())
    with pytest.raises(ValueError, match="ring_starts"):
        oscar_gather_prefixes(cache, r2t, idx, ind, rs.long(), out, out.clone())
    with pytest.raises(ValueError, match="req_to_token"):
        oscar_gather_prefixes(cache, r2t.float(), idx, ind, rs, out, out.clone())


# INT4-key heads (pool.k4_heads, high planes in pool.k_hi): codes lo | hi << 2 there, INT2 on the layer's other heads;
# D 64 / 128 / 256, groups 32 (per-element params at D 256) / 64 / 128, paged and not, all heads or some, missing sink
# rows (read as INT4), ring_end past the prefix.
@pytest.mark.parametrize("D,H,gk,gv,page,k4_heads", [
    (64, 2, 32, 64, 1, (0, 1)),
    (64, 3, 64, 32, 4, (1,)),
    (128, 3, 128, 64, 16, (0, 2)),
    (256, 2, 32, 128, 1, (1,)),
])
def test_gather_int4_key_heads(D, H, gk, gv, page, k4_heads):
    lengths, ring_starts = [3, 17, 0, 40, 25], [0, 0, 0, 8, 21]
    cache, r2t, idx = engine_cache(lengths, ring_starts, D=D, H=H, gk=gk, gv=gv, seed=D + H + page,
                                   drop_sink={(1, 2), (4, 0), (3, 1)}, page=page, k4_heads=k4_heads)
    assert cache.k_hi is not None and cache.k4_heads == k4_heads
    k, _ = check(cache, r2t, idx, lengths, ring_starts)
    check(cache, r2t, idx, [l - 2 if l > 2 else l for l in lengths], ring_starts, ring_ends=lengths, block_n=16)
    # the INT4 heads' history really is INT4: codes above 3 there
    from sglang_oscar.quant.pack import unpack_int4_planes

    slots = r2t[idx[3], :40].long()
    c = unpack_int4_planes(cache.rows("k_codes", slots)[:, list(k4_heads)], cache.rows("k_hi", slots))
    assert int(c.max()) > 3


def test_gather_int4_random_bytes_every_param_byte():
    """Random code bytes and random (scale, min) bytes (every finite float8 value: subnormals, ±448) on a paged layer
    whose KV head 1 has INT4 keys."""
    LayerCache, _, _ = _kernels()
    g = gen(9)
    cache = LayerCache.empty(64, 3, 64, k_group=32, v_group=64, num_sink_rows=0, max_reqs=2, window=5, sink=3,
                             window_dtype=ACT_DTYPE, device=DEVICE, with_sink_table=False, page=4, k4_heads=(1,))
    for t in (cache.k_codes, cache.k_hi, cache.v_codes):
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    for t in (cache.k_params, cache.v_params):
        b = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
        b[(b & 0x7F) == 0x7F] = 0x7E  # NaN bytes are never stored (the writes saturate to ±448)
        t.copy_(b.view(torch.float8_e4m3fn).to(t.device))
    for t in (cache.ring_k, cache.ring_v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    r2t = torch.randperm(64, generator=g).int().view(2, 32).to(DEVICE)
    check(cache, r2t, torch.tensor([1, 0], device=DEVICE), [32, 7], [0, 2])
