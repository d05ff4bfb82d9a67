"""Pure-PyTorch oracles of the cache write and prefix gather (kernels/write.py, kernels/gather.py).

They work on any object with the fields of kernels.layout.LayerCache (duck-typed, so the oracle
does not depend on the kernel package) and loop in the most obvious way; speed is irrelevant.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .clip import clip_rows
from .intq import QuantizedRows, dequantize, quantize
from .kv import apply_transform
from .pack import pack_int2, unpack_int2


def transform_side(x: torch.Tensor, matrix: Optional[torch.Tensor], mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x' = (x − mean)·matrix in fp32; matrix None means x already is in its basis (no mean allowed)."""
    if matrix is None:
        if mean is not None:
            raise ValueError("a mean needs a transform")
        return x.float()
    return apply_transform(x, matrix, mean)


def quantize_side(xt: torch.Tensor, group: int, clip: float, level_a: float) -> QuantizedRows:
    return quantize(clip_rows(xt, clip), 2, group, level_a)


def write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    sink_dst: torch.Tensor,
    ring_dst: torch.Tensor,
    cache,
    *,
    k_transform: torch.Tensor,
    k_mean: Optional[torch.Tensor] = None,
    v_transform: Optional[torch.Tensor] = None,
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    k_level_a: float = 1.0,
    v_level_a: float = 1.0,
) -> None:
    """What oscar_write_kv does, in place on `cache`: INT2 form at every slot, window rows where dst >= 0."""
    sides = (
        (k, k_transform, k_mean, cache.k_group, k_clip, k_level_a, "k_codes", "k_params", cache.sink_k, cache.ring_k),
        (v, v_transform, None, cache.v_group, v_clip, v_level_a, "v_codes", "v_params", cache.sink_v, cache.ring_v),
    )
    slots = slots.long()
    for x, mat, mean, group, clip, a, codes, params, sink, ring in sides:
        xt = transform_side(x, mat, mean)
        q = quantize_side(xt, group, clip, a)
        cache.set_rows(codes, slots, pack_int2(q.codes))
        cache.set_rows(params, slots, q.params().to(getattr(cache, params).dtype))
        for dst, buf in ((sink_dst, sink), (ring_dst, ring)):
            sel = dst >= 0
            buf[dst[sel].long()] = xt[sel].to(buf.dtype)


def dequantize_slots(codes: torch.Tensor, params: torch.Tensor, group: int, level_a: float) -> torch.Tensor:
    """fp32 [n, H, D] reconstruction of packed pool rows [n, H, D/4] with params [n, H, D/G, 2]."""
    q = QuantizedRows(unpack_int2(codes), params[..., 0], params[..., 1], 2, group, level_a)
    return dequantize(q)


def gather_reference(
    cache,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    ring_starts: Sequence[int],
    *,
    ring_ends: Optional[Sequence[int]] = None,
    k_level_a: float = 1.0,
    v_level_a: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
):
    """Dense transformed K, V [sum(prefix_lens), H, D] of the cached prefixes, concatenated in order.

    Position p of request r (pool row req_pool_indices[r], length L = prefix_lens[r]) reads
      * the sink row sink_table[slot]            if p < cache.sink and that row exists (>= 0),
      * ring row r_pool*W + p % W                if p >= max(sink, ring_start, ring_end − W),
      * the dequantized INT2 form of its slot    otherwise (dequantized in fp32, then cast).
    ring_end defaults to L; pass the length the ring has been written up to (e.g. prefix + the
    chunk whose rows were already stored) when it is larger, since those rows overwrote older ones.
    """
    s, w = cache.sink, cache.window
    ks, vs = [], []
    for i, (r, n, rs) in enumerate(zip(req_pool_indices, prefix_lens, ring_starts)):
        r, n, rs = int(r), int(n), int(rs)
        end = n if ring_ends is None else int(ring_ends[i])
        slots = req_to_token[r, :n].long()
        k = dequantize_slots(cache.rows("k_codes", slots), cache.rows("k_params", slots), cache.k_group, k_level_a)
        v = dequantize_slots(cache.rows("v_codes", slots), cache.rows("v_params", slots), cache.v_group, v_level_a)
        k, v = k.to(dtype), v.to(dtype)
        lo = max(s, rs, end - w)
        for p in range(n):
            row = int(cache.sink_table[slots[p]]) if (p < s and cache.sink_table is not None) else -1
            if row >= 0:
                k[p], v[p] = cache.sink_k[row].to(dtype), cache.sink_v[row].to(dtype)
            elif p >= lo and w > 0:
                j = r * w + p % w
                k[p], v[p] = cache.ring_k[j].to(dtype), cache.ring_v[j].to(dtype)
        ks.append(k)
        vs.append(v)
    return torch.cat(ks), torch.cat(vs)
