"""Spectral placement P: spread eigen-directions evenly over quantization groups.

Eigen-directions sorted by eigenvalue (largest first) are placed at bit-reversed positions:
rank i goes to position br(i). With groups of G contiguous positions (G a power of two, G < D),
the group of position br(i) is given by the low bits of i, so every run of D/G consecutive ranks
puts exactly one direction in each group: every group gets an even share of the spectrum.

Convention: P is a permutation matrix with (x·P)[j] = x[perm[j]].
"""

from __future__ import annotations

import torch


def bit_reversal(n: int) -> torch.Tensor:
    """br[i] = i with its log2(n) bits reversed."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"bit reversal needs a power of two, got {n}")
    bits = n.bit_length() - 1
    idx = torch.arange(n)
    out = torch.zeros_like(idx)
    for b in range(bits):
        out |= ((idx >> b) & 1) << (bits - 1 - b)
    return out


def spectral_placement(eigenvalues: torch.Tensor) -> torch.Tensor:
    """perm such that output position br(i) receives the eigen-direction of rank i (descending)."""
    d = eigenvalues.shape[-1]
    order = torch.argsort(eigenvalues, descending=True, stable=True)
    br = bit_reversal(d)
    perm = torch.empty(d, dtype=torch.long)
    perm[br] = order
    return perm


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """P = I[:, perm], so (x·P)[j] = x[perm[j]]."""
    d = perm.numel()
    return torch.eye(d, dtype=dtype)[:, perm]


def group_shares(eigenvalues: torch.Tensor, perm: torch.Tensor, group: int) -> torch.Tensor:
    """Sum of eigenvalues landing in each group after placement (for checks and reports)."""
    placed = eigenvalues[perm]
    return placed.view(-1, group).sum(-1)
