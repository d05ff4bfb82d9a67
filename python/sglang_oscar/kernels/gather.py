"""Prefix gather: the dense transformed K/V of cached prefixes, exactly as decode reads them.

For radix-cache hits and chunked prefill the BF16 extend kernel needs the cached prefix as dense
rows. Position p of a request (pool row r, prefix length L) reads, per KV head:

    sink row sink_table[slot]        if p < pool.sink and sink_table[slot] >= 0
    ring row r*W + p % W             elif p >= max(pool.sink, ring_start, ring_end − W)
    dequantized form of slot         otherwise: min + scale·code in fp32, then cast

The quantized form (kernels/layout.py): INT2 codes, and on the INT4-key heads of a layer (pool.k4_heads)
K codes lo | hi << 2 with lo from k_codes and hi from k_hi (levels 0..15); (scale, min) float8 e4m3
pairs, decoded exactly by integer ops (decode.e4m3_pair).

with slot = req_to_token[r, p]. ring_end defaults to L; if the rows of the chunk being computed
([L, L + extend)) were already written into the ring, pass ring_end = L + extend, because they
overwrote ring rows of positions < L + extend − W.

Batched and ragged: requests i = 0..B−1 own output rows [kv_indptr[i], kv_indptr[i+1]).
Grid (cdiv(N, BLOCK_N), Hkv) with N = out_k.shape[0]; every program finds the request of each of
its rows by a binary search in kv_indptr, so no host sync is needed. Rows >= kv_indptr[B] are
left untouched. The oracle is quant/cache_ops.py:gather_reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import WINDOW_DTYPES, LayerCache
from .write import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .decode import PARAM_SCALE, e4m3_pair, param_words
    from .records import k4_row, pool_record
    from .write import _to_window

    @triton.jit
    def _gather_side(
        out_ptr, stride_on, codes_ptr, hi_ptr, j4, params_ptr, sink_ptr, ring_ptr,
        rows, slot, srow, rrow, use_sink, use_ring, use_q, h,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, FOUR: tl.constexpr,
        H4: tl.constexpr,
    ):
        # Plane by plane: byte j of a head holds elements j, j+Q, j+2Q, j+3Q (quarter planes), so
        # each code byte is loaded once and plane s is (byte >> 2s) & 3 for the Q elements
        # [sQ, sQ+Q) (FOUR: that | the same plane of the hi byte << 2, the byte at head j4 of hi_ptr's H4
        # heads, 0 where j4 < 0: an INT2-key head of a layer with INT4-key heads). When G is a multiple
        # of Q a plane lies in one group: its (scale, min) are one pair per row, not one per element.
        # params_ptr: int16 words, one (scale, min) pair each (e4m3_pair: 2^-8 times their values, undone
        # by PARAM_SCALE, exactly). Window rows (sink, ring) are few (<= S + W per request), so their
        # loads run only in blocks that hold one.
        Q: tl.constexpr = D // 4
        NG: tl.constexpr = D // G
        offs_j = tl.arange(0, Q)
        qm = use_q[:, None]
        rec = pool_record(slot, h, H, PAGE)  # (slot, head) records (kernels/records.py)
        byte = tl.load(codes_ptr + rec[:, None] * Q + offs_j[None, :], mask=qm, other=0).to(tl.int32)
        hbyte = byte
        if FOUR:
            rec4 = pool_record(slot, j4, H4, PAGE)
            hbyte = tl.load(hi_ptr + rec4[:, None] * Q + offs_j[None, :], mask=qm & (j4 >= 0), other=0).to(tl.int32)
        p_row = params_ptr + rec * NG
        out_row = out_ptr + rows.to(tl.int64)[:, None] * stride_on + h * D + offs_j[None, :]
        valid = (use_sink | use_ring | use_q)[:, None]
        any_window = tl.max((use_sink | use_ring).to(tl.int32), axis=0) > 0
        for s in tl.static_range(4):
            code = (byte >> (2 * s)) & 3
            if FOUR:
                code = code | (((hbyte >> (2 * s)) & 3) << 2)
            lvl = code.to(tl.float32)
            if G % Q == 0:
                scale, minv = e4m3_pair(tl.load(p_row + (s * Q) // G, mask=use_q, other=0).to(tl.int32))
                scale, minv = scale[:, None], minv[:, None]
            else:
                pg = p_row[:, None] + ((s * Q + offs_j) // G)[None, :]
                scale, minv = e4m3_pair(tl.load(pg, mask=qm, other=0).to(tl.int32))
            x = (minv + scale * lvl) * PARAM_SCALE
            if any_window:
                col = h * D + s * Q + offs_j[None, :]
                xs = tl.load(sink_ptr + srow[:, None] * (H * D) + col, mask=use_sink[:, None], other=0.0)
                xr = tl.load(ring_ptr + rrow[:, None] * (H * D) + col, mask=use_ring[:, None], other=0.0)
                x = tl.where(use_sink[:, None], xs.to(tl.float32), tl.where(use_ring[:, None], xr.to(tl.float32), x))
            tl.store(out_row + s * Q, _to_window(x, out_ptr), mask=valid)

    @triton.jit
    def _oscar_gather_kernel(
        req_to_token_ptr, stride_r2t, req_pool_ptr, indptr_ptr, ring_start_ptr, ring_end_ptr, sink_table_ptr,
        k_codes_ptr, k_hi_ptr, k4_index_ptr, k_params_ptr, v_codes_ptr, v_params_ptr, sink_k_ptr, sink_v_ptr, ring_k_ptr,
        ring_v_ptr,
        out_k_ptr, stride_okn, out_v_ptr, stride_ovn,
        N, B,
        H: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
        S: tl.constexpr, W: tl.constexpr, HAS_RING_END: tl.constexpr, HAS_SINK_TABLE: tl.constexpr,
        SEARCH_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, K4: tl.constexpr, H4: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.program_id(1)
        total = tl.load(indptr_ptr + B)
        valid = (rows < N) & (rows < total)
        # request of each row: the last i with indptr[i] <= row (empty requests are skipped)
        lo = tl.zeros((BLOCK_N,), dtype=tl.int32)
        hi = tl.zeros((BLOCK_N,), dtype=tl.int32) + B
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            ok = tl.load(indptr_ptr + mid, mask=valid, other=0) <= rows
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        req = lo
        start = tl.load(indptr_ptr + req, mask=valid, other=0)
        length = tl.load(indptr_ptr + req + 1, mask=valid, other=0) - start
        pos = rows - start
        rpool = tl.load(req_pool_ptr + req, mask=valid, other=0).to(tl.int64)
        slot = tl.load(req_to_token_ptr + rpool * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
        if HAS_RING_END:
            end = tl.load(ring_end_ptr + req, mask=valid, other=0)
        else:
            end = length
        ring_lo = tl.maximum(tl.maximum(tl.load(ring_start_ptr + req, mask=valid, other=0), end - W), S)
        if HAS_SINK_TABLE:
            srow = tl.load(sink_table_ptr + slot, mask=valid & (pos < S), other=-1).to(tl.int64)
        else:
            srow = tl.full((BLOCK_N,), -1, tl.int64)
        use_sink = valid & (srow >= 0)
        if W > 0:
            use_ring = valid & (srow < 0) & (pos >= ring_lo)
            rrow = rpool * W + pos % W
        else:
            use_ring = valid & (pos < 0)
            rrow = rpool
        use_q = valid & (srow < 0) & ~use_ring
        j4 = k4_row(k4_index_ptr, h, K4)  # head h's row among k_hi's heads, -1: INT2 keys
        _gather_side(out_k_ptr, stride_okn, k_codes_ptr, k_hi_ptr, j4, k_params_ptr, sink_k_ptr, ring_k_ptr,
                     rows, slot, srow, rrow, use_sink, use_ring, use_q, h, H, D, GK, PAGE, K4, H4)
        _gather_side(out_v_ptr, stride_ovn, v_codes_ptr, v_codes_ptr, 0, v_params_ptr, sink_v_ptr, ring_v_ptr,
                     rows, slot, srow, rrow, use_sink, use_ring, use_q, h, H, D, GV, PAGE, False, 1)


def oscar_gather_prefixes(
    pool: LayerCache,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    ring_starts: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    *,
    ring_ends: Optional[torch.Tensor] = None,
    block_n: int = 64,
    validate: bool = True,
) -> None:
    """Fill out_k/out_v [N, Hkv, D] (rows [kv_indptr[i], kv_indptr[i+1]) = prefix of request i).

    req_to_token: int32/int64 [max_reqs, max_len] (SGLang's table); req_pool_indices: int [B];
    kv_indptr: int32 [B+1] (kv_indptr[i+1] − kv_indptr[i] = prefix length of request i);
    ring_starts / ring_ends: int32 [B] (see the module docstring). out dtype: bf16/fp16/fp32.
    """
    if not HAS_TRITON:
        raise RuntimeError("oscar_gather_prefixes needs triton")
    if validate:
        pool.validate()
    h, d = pool.kv_heads, pool.head_dim
    dev = pool.k_codes.device
    b = req_pool_indices.shape[0]
    for name, out in (("out_k", out_k), ("out_v", out_v)):
        if out.dim() != 3 or tuple(out.shape[1:]) != (h, d) or out.dtype not in WINDOW_DTYPES:
            raise ValueError(f"{name} must be [N, {h}, {d}] of {WINDOW_DTYPES}, got {out.dtype} {tuple(out.shape)}")
        if out.stride(2) != 1 or out.stride(1) != d or out.device != dev:
            raise ValueError(f"{name} must be on {dev} with contiguous [Hkv, D] rows")
    if out_k.shape[0] != out_v.shape[0]:
        raise ValueError("out_k and out_v must have the same number of rows")
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64) or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be an int32/int64 [max_reqs, max_len] table, contiguous per row")
    if req_pool_indices.dim() != 1 or req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("req_pool_indices must be int32/int64 [B]")
    if kv_indptr.dtype != torch.int32 or tuple(kv_indptr.shape) != (b + 1,):
        raise ValueError(f"kv_indptr must be int32 [{b + 1}], got {kv_indptr.dtype} {tuple(kv_indptr.shape)}")
    for name, t in (("ring_starts", ring_starts), ("ring_ends", ring_ends)):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (b,)):
            raise ValueError(f"{name} must be int32 [{b}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("kv_indptr", kv_indptr),
                    ("ring_starts", ring_starts)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, the cache on {dev}")
    k4 = pool.k_hi is not None
    n = out_k.shape[0]
    if n == 0 or b == 0:
        return
    grid = (triton.cdiv(n, block_n), h)
    _oscar_gather_kernel[grid](
        req_to_token, req_to_token.stride(0), req_pool_indices, kv_indptr, ring_starts,
        ring_ends if ring_ends is not None else ring_starts,
        pool.sink_table if pool.sink_table is not None else kv_indptr,
        pool.k_codes, pool.k_hi if k4 else pool.k_codes, pool.k4_index if k4 else kv_indptr,
        param_words(pool.k_params, 1), pool.v_codes,
        param_words(pool.v_params, 1),
        pool.sink_k, pool.sink_v, pool.ring_k, pool.ring_v,
        out_k, out_k.stride(0), out_v, out_v.stride(0),
        n, b,
        H=h, D=d, GK=pool.k_group, GV=pool.v_group, S=pool.sink, W=pool.window,
        HAS_RING_END=ring_ends is not None, HAS_SINK_TABLE=pool.sink_table is not None,
        SEARCH_STEPS=max(1, b.bit_length()), BLOCK_N=block_n, PAGE=pool.page, K4=k4,
        H4=pool.k_hi.shape[1] if k4 else 1, num_warps=4,
    )


def oscar_gather_prefix(
    pool: LayerCache,
    req_to_token: torch.Tensor,
    req_pool_index: int,
    prefix_len: int,
    ring_start: int,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    *,
    ring_end: Optional[int] = None,
) -> None:
    """One request: out_k/out_v[:prefix_len] = its cached prefix (host ints; a tiny H2D copy)."""
    dev = pool.k_codes.device
    if out_k.shape[0] < prefix_len:
        raise ValueError(f"out_k has {out_k.shape[0]} rows, prefix_len is {prefix_len}")
    i32 = dict(dtype=torch.int32, device=dev)
    oscar_gather_prefixes(
        pool, req_to_token, torch.tensor([req_pool_index], **i32), torch.tensor([0, prefix_len], **i32),
        torch.tensor([ring_start], **i32), out_k, out_v,
        ring_ends=None if ring_end is None else torch.tensor([ring_end], **i32),
    )
