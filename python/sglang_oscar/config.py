"""The KV-cache format in one place: window sizes, group sizes, and the byte math.

Everything that needs "how many bits per element" or "bytes per token" asks this module,
so the accuracy tables, the memory accounting of the pool and the benchmarks agree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_GROUPS = (32, 64, 128)
MAX_GQA = 16  # query heads per KV head the decode kernels hold in one tile
PARAM_BITS = 8  # scale and min are stored as float8 e4m3 (quant/intq.py)
# The share of (layer, KV head) pairs whose keys the calibration makes INT4 (the ones INT2 keys disturb most,
# rotation/fit.py:choose_k4_heads): each adds 2 bits per key element, which the float8 (scale, min) pay for at groups
# of 64 (2.25 bits per element elsewhere): 2.25 + (2 / 4) / 2 = 2.5 bits per element on average over K, V and heads.
K4_HEAD_SHARE = 4  # at most num_layers * kv_heads // K4_HEAD_SHARE pairs


# The served format: the one whose accuracy (docs/results/accuracy.md) and decode speed (docs/results/kernels.md) are
# published. Every default of the server, the calibration CLI, the kernels and the evaluation is one of these.
SERVED_GROUP = 64  # elements per float8 (scale, min) pair
SERVED_SINK = 64  # BF16 sink: the first tokens of every request (SGLANG_MIXED_KV_PREFIX_TOKENS)
SERVED_RECENT = 256  # BF16 recent window: each request's last tokens (SGLANG_MIXED_KV_RECENT_TOKENS)


def group_misfit(head_dim: Optional[int], group: int, what: str = "group size",
                 supported: bool = False) -> Optional[str]:
    """Why rows of head_dim cannot be quantized in groups of `group` (None: they can). The one rule: head_dim is a
    power of two (the Hadamard transform and the kernels need one) and the group a power of two > 0 that divides it,
    so <= head_dim (head_dim None: the group alone). `what` names what set the group (a flag, a bundle field). Which
    groups and head_dims the kernels support is a narrower check on top (SUPPORTED_GROUPS, SUPPORTED_HEAD_DIMS):
    `supported` makes the advice name the supported groups that fit instead of any power of two."""
    if head_dim is None:
        return None if group > 0 and not group & (group - 1) else f"{what} must be a power of two, got {group}"
    if head_dim <= 0 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two: the Hadamard transform and the kernels need one"
    fit = "is larger than" if group > head_dim else "does not divide" if group <= 0 or head_dim % group else None
    if fit is None:
        return None
    advice = f"one of {groups_for(head_dim)}" if supported else f"a power of two <= {head_dim}"
    return f"{what} {group} {fit} head_dim {head_dim}; use {advice}"


def check_group_fits(head_dim: Optional[int], group: int, what: str = "group size", supported: bool = False) -> None:
    """group_misfit as a ValueError."""
    msg = group_misfit(head_dim, group, what, supported)
    if msg is not None:
        raise ValueError(msg)


def check_supported_head_dim(head_dim: int, what: str = "") -> None:
    """The head_dims the OSCAR kernels have paths for; `what` prefixes the message (e.g. "model: ")."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{what}head_dim {head_dim} is not supported by the OSCAR kernels (use one of "
                         f"{SUPPORTED_HEAD_DIMS})")


def groups_for(head_dim: int) -> list:
    """The supported group sizes that fit a row of head_dim (group_misfit)."""
    return [g for g in SUPPORTED_GROUPS if group_misfit(head_dim, g) is None]


def default_group(head_dim: int) -> int:
    """The group size when neither the flag nor a calibrated bundle sets one: 64 at every supported head_dim
    (2.25 bits/element, 2.5 with a quarter of the layers' keys in INT4), the one configuration whose accuracy (docs/results/accuracy.md) and decode-kernel table
    (docs/results/kernels.md) are published; the flag can choose 128 (2.125 bits, more capacity, accuracy not
    measured). Every supported head_dim has a decode path at this group (kernels/shapes.py)."""
    check_supported_head_dim(head_dim)
    fits = groups_for(head_dim)
    return SERVED_GROUP if SERVED_GROUP in fits else max(fits)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """How one side (K or V) of a (token, head) row is stored.

    bits:  code width (2 for OSCAR, 4 for the INT4 baseline)
    group: elements per (scale, min) pair, contiguous along head_dim
    """

    bits: int = 2
    group: int = SERVED_GROUP

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {self.bits}")
        check_group_fits(None, self.group)

    @property
    def bits_per_element(self) -> float:
        """Code bits plus the amortised scale/min bits."""
        return self.bits + 2 * PARAM_BITS / self.group

    def bytes_per_row(self, head_dim: int) -> int:
        check_group_fits(head_dim, self.group)
        codes = head_dim * self.bits // 8
        params = (head_dim // self.group) * 2 * (PARAM_BITS // 8)
        return codes + params


def check_groups(head_dim: int, groups: dict) -> None:
    """Refuse quantization groups the server cannot serve at this head_dim: `groups` maps the option that set each
    group (e.g. "--group-k") to its value. Cheap, so CLIs call it before any model load or capture; the ValueError
    names the option and the values that fit."""
    check_supported_head_dim(head_dim)
    fits = groups_for(head_dim)
    for option, group in groups.items():
        if group not in fits:
            raise ValueError(f"{option} {group} does not fit head_dim {head_dim}: use one of {fits}")


def clip_ratio_misfit(rho: float, named: str) -> Optional[str]:
    """The one rule of a clip ratio: the quantile of |x| kept unclipped, in (0, 1] (1 = no clipping; quant/clip.py).
    None when rho follows it, else the message, which names rho as `named` (e.g. "--clip-k 1.5", "k_clip[3] = 0.0")."""
    if 0.0 < rho <= 1.0:
        return None
    return f"{named} is outside (0, 1]: a clip ratio is the quantile of |x| kept unclipped (1 = no clipping)"


def max_k4_heads(num_layers: int, kv_heads: int) -> int:
    """The most (layer, KV head) pairs with INT4 keys the served format allows (K4_HEAD_SHARE)."""
    return num_layers * kv_heads // K4_HEAD_SHARE


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The whole mixed-precision cache: BF16 sink [0, sink), quantized history, BF16 recent window.
    k is the key format of most (layer, KV head) pairs; k4_heads of them (on one rank) store INT4 keys instead
    (same group)."""

    sink: int = SERVED_SINK
    recent: int = SERVED_RECENT
    k: QuantFormat = QuantFormat()
    v: QuantFormat = QuantFormat()
    k4_heads: int = 0

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0:
            raise ValueError("sink and recent window sizes must be >= 0")
        if self.k4_heads < 0:
            raise ValueError("k4_heads must be >= 0")

    def bits_per_element(self, num_layers: int = 1, kv_heads: int = 1) -> float:
        """Average over K, V and the num_layers x kv_heads (layer, head) pairs of the quantized history (windows
        excluded)."""
        pairs = num_layers * kv_heads
        if self.k4_heads > pairs:
            raise ValueError(f"{self.k4_heads} INT4-key heads of {pairs}")
        k4 = QuantFormat(4, self.k.group).bits_per_element
        k = (self.k.bits_per_element * (pairs - self.k4_heads) + k4 * self.k4_heads) / pairs
        return (k + self.v.bits_per_element) / 2

    def quant_bytes_per_token(self, num_layers: int, kv_heads: int, head_dim: int) -> int:
        per_head = self.k.bytes_per_row(head_dim) + self.v.bytes_per_row(head_dim)
        k4_extra = QuantFormat(4, self.k.group).bytes_per_row(head_dim) - self.k.bytes_per_row(head_dim)
        return num_layers * kv_heads * per_head + self.k4_heads * k4_extra

    @staticmethod
    def bf16_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
        return num_layers * kv_heads * head_dim * 2 * 2
