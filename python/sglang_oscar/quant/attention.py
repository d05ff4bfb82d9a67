"""Pure-PyTorch oracle of kernels/decode.py: decode attention over the mixed OSCAR cache.

Per request of length L (current token already written), in the transformed basis:
    sink     [0, min(S, L))                   rows sink_k/v[sink_table[req_to_token[r, pos]]]
                                              (missing_sink_int2: INT2 where sink_table < 0)
    history  [S, R)                           INT2 at slot req_to_token[r, pos], dequantized
    recent   [R, L), R = max(S, L − W, ring_start[r])   rows ring_k/v[r·W + pos % W]
Everything is gathered and computed in float64, one request at a time; speed is irrelevant.
Works on any object with LayerCache's fields (duck-typed).

ragged_causal_reference is the oracle of srt/extend_attention.py (extend steps over ragged K/V).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .intq import levels
from .cache_ops import k4_heads, key_hi_rows
from .pack import unpack_int2, unpack_int4_planes


def dequantize_rows(codes: torch.Tensor, params: torch.Tensor, hi: Optional[torch.Tensor] = None,
                    heads: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Packed INT2 rows [..., H, D/4] + (scale, min) [..., H, D/G, 2] → float64 [..., H, D]; the KV heads in `heads`
    (default: every head when `hi` is given) are INT4, lo | hi << 2 with `hi` [..., H, D/4] (cache_ops.key_hi_rows)."""
    if heads is None:
        heads = range(codes.shape[-2]) if hi is not None else ()
    d = codes.shape[-1] * 4
    group = d // params.shape[-2]

    def rows(c, p, lv):
        lv_c = lv[c.long()].reshape(*c.shape[:-1], d // group, group)
        x = p[..., 1].double().unsqueeze(-1) + p[..., 0].double().unsqueeze(-1) * lv_c
        return x.reshape(c.shape)

    out = rows(unpack_int2(codes), params, levels(2, dtype=torch.float64))
    if heads:
        h = list(heads)
        out[..., h, :] = rows(unpack_int4_planes(codes[..., h, :], hi[..., h, :]), params[..., h, :, :],
                              levels(4, dtype=torch.float64))
    return out


def key_rows(cache, slots):
    """Dequantized keys of `slots` (INT2, and INT4 on the layer's k4_heads)."""
    hi = key_hi_rows(cache, slots)
    return dequantize_rows(cache.rows("k_codes", slots).cpu(), cache.rows("k_params", slots).cpu(),
                           None if hi is None else hi.cpu(), k4_heads(cache))


def segments(length: int, ring_start: int, sink: int, window: int):
    """(sink_end, hist_lo, hist_hi, recent_lo) of a request of `length` tokens."""
    recent_lo = max(sink, length - window, ring_start)
    return min(sink, length), sink, max(sink, min(recent_lo, length)), recent_lo


def gather_kv(cache, req_to_token, r: int, length: int, ring_start: int, sink: int, window: int,
              missing_sink_int2: bool = False):
    """K, V float64 [L, Hkv, D] of one request, each position from where decode reads it.

    A sink position whose slot has no sink row (sink_table < 0) raises, unless missing_sink_int2:
    then it reads the slot's INT2 form, as the decode kernel does."""
    sink_end, hist_lo, hist_hi, recent_lo = segments(length, ring_start, sink, window)
    slots = req_to_token[r, :length].long().cpu()
    ks, vs = [], []
    if sink_end > 0:
        rows = cache.sink_table.cpu()[slots[:sink_end]].long()
        missing = rows < 0
        if missing.any() and not missing_sink_int2:
            raise ValueError(f"request {r}: a sink position has no sink row")
        s, have = slots[:sink_end][missing], rows[~missing]
        k = torch.empty(sink_end, *cache.sink_k.shape[1:], dtype=torch.float64)
        v = torch.empty_like(k)
        k[~missing] = cache.sink_k.cpu()[have].double()
        v[~missing] = cache.sink_v.cpu()[have].double()
        k[missing] = key_rows(cache, s)
        v[missing] = dequantize_rows(cache.rows("v_codes", s).cpu(), cache.rows("v_params", s).cpu())
        ks.append(k)
        vs.append(v)
    if hist_hi > hist_lo:
        s = slots[hist_lo:hist_hi]
        ks.append(key_rows(cache, s))
        vs.append(dequantize_rows(cache.rows("v_codes", s).cpu(), cache.rows("v_params", s).cpu()))
    if length > recent_lo:
        pos = torch.arange(recent_lo, length)
        rows = r * window + pos % window
        ks.append(cache.ring_k.cpu()[rows].double())
        vs.append(cache.ring_v.cpu()[rows].double())
    return torch.cat(ks), torch.cat(vs)


def mixed_decode_reference(
    q: torch.Tensor,
    cache,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_start: torch.Tensor,
    *,
    sink: int,
    window: int,
    sm_scale: float,
    q_transform: Optional[torch.Tensor] = None,
    missing_sink_int2: bool = False,
) -> torch.Tensor:
    """o [B, Hq, D] float64 in the V-transformed basis (what oscar_decode returns).

    missing_sink_int2: sink positions without a sink row read their INT2 form (else: ValueError)."""
    b, hq, d = q.shape
    hkv = cache.k_codes.shape[1]
    qd = q.detach().cpu().double()
    if q_transform is not None:
        t = q_transform.detach().cpu().double()
        if t.dim() == 2:
            qd = qd @ t
        else:
            qd = torch.einsum("bhgd,hde->bhge", qd.reshape(b, hkv, hq // hkv, d), t).reshape(b, hq, d)
    out = torch.empty(b, hq, d, dtype=torch.float64)
    group = hq // hkv
    for i in range(b):
        r = int(req_pool_indices[i])
        k, v = gather_kv(cache, req_to_token, r, int(seq_lens[i]), int(ring_start[r]), sink, window, missing_sink_int2)
        kh = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        vh = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", qd[i], kh) * sm_scale
        p = torch.softmax(s, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, vh)
    return out


def ragged_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Sequence[int],
                            kv_lens: Sequence[int], scale: float) -> torch.Tensor:
    """float64 causal attention on ragged rows, mask aligned bottom-right: new token j of request i
    sees keys [0, kv_lens[i] − q_lens[i] + j] of that request. q [ΣQ, Hq, D], k/v [ΣKV, Hkv, D]."""
    q, k, v = q.double(), k.double(), v.double()
    hq, h = q.shape[1], k.shape[1]
    out = torch.empty(q.shape[0], hq, v.shape[2], dtype=torch.float64)
    qs = ks = 0
    for e, n in zip(q_lens, kv_lens):
        qi = q[qs:qs + e]  # [e, Hq, D]
        ki = k[ks:ks + n].repeat_interleave(hq // h, 1)  # [n, Hq, D]
        vi = v[ks:ks + n].repeat_interleave(hq // h, 1)
        s = torch.einsum("ehd,nhd->hen", qi, ki) * scale
        j = torch.arange(e).unsqueeze(1)
        t = torch.arange(n).unsqueeze(0)
        s = s.masked_fill(t > (n - e) + j, -math.inf)
        out[qs:qs + e] = torch.einsum("hen,nhd->ehd", s.softmax(-1), vi)
        qs, ks = qs + e, ks + n
    return out
