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
from .pack import pack_int2, pack_int4_planes, unpack_int2, unpack_int4_planes


def transform_side(x: torch.Tensor, matrix: Optional[torch.Tensor], mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x' = (x − mean)·matrix in fp32; matrix None means x already is in its basis (no mean allowed)."""
    if matrix is None:
        if mean is not None:
            raise ValueError("a mean needs a transform")
        return x.float()
    return apply_transform(x, matrix, mean)


def quantize_side(xt: torch.Tensor, group: int, clip: float, bits: int = 2) -> QuantizedRows:
    return quantize(clip_rows(xt, clip), bits, group)


def k4_heads(cache) -> tuple:
    """The KV heads of this layer whose keys are INT4 (their high planes in cache.k_hi), else ()."""
    return tuple(getattr(cache, "k4_heads", ())) if getattr(cache, "k_hi", None) is not None else ()


def key_hi_rows(cache, slots: torch.Tensor) -> Optional[torch.Tensor]:
    """The high key planes of `slots` as [n, Hkv, D/4], zero on INT2-key heads; None for a layer without INT4 keys."""
    heads = k4_heads(cache)
    if not heads:
        return None
    codes = cache.rows("k_codes", slots)
    hi = torch.zeros_like(codes)
    hi[:, list(heads)] = cache.rows("k_hi", slots).to(codes.device)
    return hi


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
) -> None:
    """What oscar_write_kv does, in place on `cache`: the quantized form at every slot, window rows where dst >= 0.
    Keys of the heads in cache.k4_heads are INT4, never clipped (k_clip is the INT2 heads'), split into k_codes (low
    planes) and k_hi (high planes)."""
    heads = list(k4_heads(cache))
    sides = (
        (k, k_transform, k_mean, cache.k_group, k_clip, "k_codes", "k_params", cache.sink_k, cache.ring_k),
        (v, v_transform, None, cache.v_group, v_clip, "v_codes", "v_params", cache.sink_v, cache.ring_v),
    )
    slots = slots.long()
    for x, mat, mean, group, clip, codes, params, sink, ring in sides:
        xt = transform_side(x, mat, mean)
        q = quantize_side(xt, group, clip)
        packed, pairs = pack_int2(q.codes), q.params()
        if codes == "k_codes" and heads:
            q4 = quantize_side(xt[:, heads], group, 1.0, bits=4)
            lo, hi = pack_int4_planes(q4.codes)
            packed[:, heads] = lo
            pairs[:, heads] = q4.params()
            cache.set_rows("k_hi", slots, hi)
        cache.set_rows(codes, slots, packed)
        cache.set_rows(params, slots, pairs)
        for dst, buf in ((sink_dst, sink), (ring_dst, ring)):
            sel = dst >= 0
            buf[dst[sel].long()] = xt[sel].to(buf.dtype)


def dequantize_slots(codes: torch.Tensor, params: torch.Tensor, group: int, hi: Optional[torch.Tensor] = None,
                     heads: Optional[Sequence[int]] = None) -> torch.Tensor:
    """fp32 [n, H, D] reconstruction of packed pool rows [n, H, D/4] with params [n, H, D/G, 2]; the KV heads in
    `heads` (default: every head when `hi` is given) are INT4, lo | hi << 2 with `hi` [n, H, D/4] (key_hi_rows)."""
    if heads is None:
        heads = range(codes.shape[-2]) if hi is not None else ()
    out = dequantize(QuantizedRows(unpack_int2(codes), params[..., 0], params[..., 1], 2, group))
    if heads:
        h = list(heads)
        p = params[:, h]
        out[:, h] = dequantize(QuantizedRows(unpack_int4_planes(codes[:, h], hi[:, h]), p[..., 0], p[..., 1], 4,
                                             group))
    return out


def gather_reference(
    cache,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    ring_starts: Sequence[int],
    *,
    ring_ends: Optional[Sequence[int]] = None,
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
        k = dequantize_slots(cache.rows("k_codes", slots), cache.rows("k_params", slots), cache.k_group,
                             key_hi_rows(cache, slots), k4_heads(cache))
        v = dequantize_slots(cache.rows("v_codes", slots), cache.rows("v_params", slots), cache.v_group)
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
