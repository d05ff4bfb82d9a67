"""Normalized Walsh–Hadamard transform (Sylvester order).

H_D is symmetric and orthonormal (H·H = I), so x ↦ x·H is its own inverse.
"""

from __future__ import annotations

import math

import torch


def _check_pow2(d: int) -> None:
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The d×d Sylvester Hadamard matrix scaled by 1/sqrt(d)."""
    _check_pow2(d)
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def block_hadamard_matrix(d: int, block: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """blockdiag(H_block, ..., H_block): mixes coordinates only inside each group of `block`."""
    _check_pow2(d)
    _check_pow2(block)
    if block > d:
        raise ValueError(f"block {block} larger than {d}")
    return torch.block_diag(*([hadamard_matrix(block, dtype, device)] * (d // block)))


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x·H_D along the last dimension in O(D log D), any float dtype (computed in x's dtype)."""
    d = x.shape[-1]
    _check_pow2(d)
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(d)).to(x.dtype)
