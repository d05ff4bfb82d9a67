"""Per-row clipping to the ρ-quantile of |x|.

The threshold of a row of D values is t = the k-th smallest |x| with k = ceil(ρ·D) (1-based),
so at least ρ·D entries satisfy |x| <= t and the D − k largest magnitudes are clipped.
ρ = 1 (or any ρ with ceil(ρ·D) = D) keeps the row unchanged. Equivalently t is the
(D − k + 1)-th largest |x|, which is how the kernels find it (max-and-count passes, or, in the decode
write's one-token programs, the smallest |x_j| with at most D − k entries strictly above it).
"""

from __future__ import annotations

import math

import torch

from ..config import clip_ratio_misfit


def clip_count(rho: float, d: int) -> int:
    """How many entries of a D-row lie above the threshold (ties aside)."""
    msg = clip_ratio_misfit(rho, f"clip ratio {rho}")
    if msg is not None:
        raise ValueError(msg)
    k = min(d, max(1, math.ceil(rho * d - 1e-9)))
    return d - k


def clip_threshold(x: torch.Tensor, rho: float) -> torch.Tensor:
    """Per-row threshold over the last dim, shape x.shape[:-1] + (1,)."""
    d = x.shape[-1]
    n = clip_count(rho, d)
    a = x.abs()
    if n == 0:
        return a.amax(-1, keepdim=True)
    # (n+1)-th largest |x|
    return torch.topk(a, n + 1, dim=-1).values[..., n : n + 1]


def clip_rows(x: torch.Tensor, rho: float) -> torch.Tensor:
    if clip_count(rho, x.shape[-1]) == 0:
        return x
    t = clip_threshold(x, rho)
    return torch.maximum(torch.minimum(x, t), -t)
