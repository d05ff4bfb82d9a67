"""Asymmetric min-max integer quantization per group (the oracle of every write kernel).

A row of D values (already rotated and clipped) is cut into D/G contiguous groups. Per group:

    scale = (max − min) / (2^bits − 1)        stored as float8 e4m3 (round_param)
    min   = min                               stored as float8 e4m3
    t     = (x − min_s) / scale_s             with the *stored* (rounded) scale and min
    code  = number of thresholds <= t         (round half up, clamped to [0, 2^bits − 1])
    x̂     = min_s + scale_s · level[code]

Storing `min` rather than a zero point lets the decode kernel fold it out of the inner loop:
q·x̂ = Σ_g scale_g·(q_g·level[c_g]) + Σ_g min_g·Σ_{i∈g} q_i.

Levels are uniform: 0 .. 2^bits − 1.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import SERVED_GROUP

# (scale, min) storage: float8 e4m3 (1 byte each, 0.25 bits per element at groups of 64). Every e4m3 value is exact
# in fp16 / bf16 / fp32, so kernels decode it without rounding. Values are saturated to +-448 before rounding.
PARAM_DTYPE = torch.float8_e4m3fn
PARAM_MAX = 448.0


def round_param(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the stored (scale, min): float8 e4m3 round-to-nearest-even after saturating to +-PARAM_MAX (what the
    kernels' satfinite conversion does)."""
    return x.float().clamp(-PARAM_MAX, PARAM_MAX).to(PARAM_DTYPE)


@dataclasses.dataclass
class QuantizedRows:
    codes: torch.Tensor  # uint8 [..., D], unpacked, values in [0, 2^bits)
    scale: torch.Tensor  # PARAM_DTYPE [..., D // group]
    minv: torch.Tensor  # PARAM_DTYPE [..., D // group]
    bits: int
    group: int

    def params(self) -> torch.Tensor:
        """(scale, min) interleaved as the pool stores them: [..., D // group, 2]."""
        return torch.stack((self.scale, self.minv), dim=-1)


def levels(bits: int, dtype=torch.float32, device=None) -> torch.Tensor:
    return torch.arange(2**bits, dtype=dtype, device=device)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"group size {group} must divide the row length {d}")
    return x.reshape(*x.shape[:-1], d // group, group)


def quantize(x: torch.Tensor, bits: int = 2, group: int = SERVED_GROUP) -> QuantizedRows:
    """Quantize rows of x (last dim) per group. Computation in fp32."""
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    xg = _grouped(x.float(), group)
    lo = xg.amin(-1)
    hi = xg.amax(-1)
    qmax = 2**bits - 1
    scale_s = round_param((hi - lo) / qmax)
    min_s = round_param(lo)
    s = scale_s.float().unsqueeze(-1)
    m = min_s.float().unsqueeze(-1)
    # A constant group has scale 0: every code is 0 and x̂ = min exactly.
    t = torch.where(s > 0, (xg - m) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xg))
    lv = levels(bits, device=x.device)
    thresholds = (lv[1:] + lv[:-1]) / 2
    codes = (t.unsqueeze(-1) >= thresholds).sum(-1).to(torch.uint8)
    return QuantizedRows(codes.reshape(x.shape), scale_s, min_s, bits, group)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    lv = levels(q.bits, device=q.codes.device)
    c = _grouped(lv[q.codes.long()], q.group)
    x = q.minv.float().unsqueeze(-1) + q.scale.float().unsqueeze(-1) * c
    return x.reshape(q.codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int = 2, group: int = SERVED_GROUP) -> torch.Tensor:
    return dequantize(quantize(x, bits, group), dtype=x.dtype)
