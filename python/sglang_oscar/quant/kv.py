"""One side (K or V) of one layer of the cache, end to end: transform → clip → quantize.

Keys are stored as k' = (k − μ)·T. Queries use T_q = T^{-T}, so q'·k'ᵀ = q·(k − μ)ᵀ =
q·kᵀ − q·μᵀ. The last term is the same for every key of a query, so softmax is unchanged as
long as *every* key (BF16 windows included) is stored the same way. For an orthogonal T
(all rotations) T_q = T. Values are stored as v' = v·T and attention outputs come back with
o = o'·T^{-1}; V never gets a mean (it would not cancel).

T has shape [D, D] (one per layer) or [H, D, D] (one per KV head); x has shape [..., H, D].
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..config import SERVED_GROUP
from .clip import clip_rows
from .intq import QuantizedRows, dequantize, quantize
from .pack import pack


def apply_transform(x: torch.Tensor, matrix: torch.Tensor, mean: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x − mean)·matrix per head, computed in fp32. matrix: [D, D] or [H, D, D]."""
    xf = x.float()
    if mean is not None:
        xf = xf - mean.float().to(xf.device)
    m = matrix.float().to(xf.device)
    if m.dim() == 2:
        return xf @ m
    if m.shape[0] == 1:
        return xf @ m[0]
    if xf.shape[-2] != m.shape[0]:
        raise ValueError(f"per-head transform has {m.shape[0]} heads but x has {xf.shape[-2]}")
    return torch.einsum("...hd,hde->...he", xf, m)


@dataclasses.dataclass
class SideQuantizer:
    matrix: torch.Tensor  # [D, D] or [H, D, D]
    mean: Optional[torch.Tensor] = None  # [D] or [H, D], keys only
    bits: int = 2
    group: int = SERVED_GROUP
    clip_ratio: float = 1.0
    # KV heads (of x's head axis, -2) stored as INT4 instead: no clip (the served keys' per-head widths,
    # rotation/fit.py:choose_k4_heads). Only with bits 2.
    k4_heads: tuple = ()

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        return apply_transform(x, self.matrix, self.mean)

    def query_matrix(self) -> torch.Tensor:
        """T^{-T}: what queries are multiplied by so that logits are unchanged."""
        m = self.matrix.double()
        return torch.linalg.inv(m).transpose(-1, -2).float()

    def inverse_matrix(self) -> torch.Tensor:
        return torch.linalg.inv(self.matrix.double()).float()

    def quantize_transformed(self, xt: torch.Tensor) -> QuantizedRows:
        if self.k4_heads:
            raise ValueError("a quantizer with INT4 heads has no single QuantizedRows: use fake_transformed")
        return quantize(clip_rows(xt, self.clip_ratio), self.bits, self.group)

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        return self.quantize_transformed(self.transform(x))

    def fake_transformed(self, xt: torch.Tensor) -> torch.Tensor:
        """Dequantized reconstruction of already transformed rows [..., H, D], in the transformed basis."""
        out = dequantize(quantize(clip_rows(xt, self.clip_ratio), self.bits, self.group))
        if self.k4_heads:
            h = list(self.k4_heads)
            out[..., h, :] = dequantize(quantize(xt[..., h, :], 4, self.group))
        return out

    def packed(self, x: torch.Tensor):
        """What the pool stores for an all-INT2 (or all-INT4) quantizer: (packed codes uint8, (scale, min) pairs)."""
        q = self.quantize(x)
        return pack(q.codes, self.bits), q.params()
