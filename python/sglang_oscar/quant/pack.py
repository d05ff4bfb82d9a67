"""Bit packing of codes. Layouts (per (token, head) row of D codes):

INT2, "quarter-plane": byte j (0 <= j < D/4) holds
    bits 1:0 = code[j], bits 3:2 = code[j + D/4], bits 5:4 = code[j + D/2], bits 7:6 = code[j + 3D/4]
  so plane p = (byte >> 2p) & 3 is the contiguous slice of dims [p·D/4, (p+1)·D/4). A decode
  kernel extracts one plane with a shift and a mask and runs a dot over D/4 dims, no reshapes.
INT4, "half-plane": byte j (0 <= j < D/2) holds code[j] in bits 3:0 and code[j + D/2] in bits 7:4.
INT4 keys of the served cache, "two planes": code = lo + 4·hi, lo = code & 3 and hi = code >> 2 each packed as
  INT2 quarter-plane rows (k_codes and k_hi): a kernel that reads INT2 rows reads an INT4 row as two of them and
  forms lo | hi << 2 with the same shifts and masks.
"""

from __future__ import annotations

import torch


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    d = codes.shape[-1]
    if d % 4:
        raise ValueError(f"INT2 packing needs a row length divisible by 4, got {d}")
    c = codes.to(torch.uint8)
    q = d // 4
    return c[..., :q] | (c[..., q : 2 * q] << 2) | (c[..., 2 * q : 3 * q] << 4) | (c[..., 3 * q :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.cat([(p >> (2 * k)) & 3 for k in range(4)], dim=-1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    d = codes.shape[-1]
    if d % 2:
        raise ValueError(f"INT4 packing needs an even row length, got {d}")
    c = codes.to(torch.uint8)
    h = d // 2
    return c[..., :h] | (c[..., h:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.uint8)
    return torch.cat([p & 15, p >> 4], dim=-1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_int2(codes) if bits == 2 else pack_int4(codes)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_int2(packed) if bits == 2 else unpack_int4(packed)


def pack_int4_planes(codes: torch.Tensor) -> tuple:
    """INT4 codes [..., D] -> (lo, hi) quarter-plane packed rows [..., D/4] (the served cache's INT4 keys)."""
    c = codes.to(torch.uint8)
    return pack_int2(c & 3), pack_int2(c >> 2)


def unpack_int4_planes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return unpack_int2(lo) | (unpack_int2(hi) << 2)
