"""The per-layer buffers of the OSCAR KV cache, shared by the write, gather and decode kernels.

Per layer (Hkv KV heads, head_dim D, group sizes Gk / Gv, page size P):

    k_codes   uint8 [num_slots, Hkv, D/4]        quarter-plane packed INT2 (quant/pack.py), P = 1
              uint8 [num_slots/P, Hkv, P, D/4]   P > 1: slot s is row s % P of page s // P, so the
                                                 rows of one KV head are contiguous within a page
    k_params  fp8   [num_slots, Hkv, D/Gk, 2]    (scale, min) per group, float8 e4m3 (quant/intq.py)
                                                 (P > 1: [num_slots/P, Hkv, P, D/Gk, 2])
    k_hi      uint8 [num_slots, H4, D/4], or None  the KV heads of this layer with INT4 keys (k4_heads, H4 of them):
                                                 k_codes holds the low two bits of each code, k_hi the high two
                                                 (quant/pack.py "two planes"); paged [num_slots/P, H4, P, D/4]
    k4_index  int32 [Hkv]                        head h's row among k_hi's heads, -1 for an INT2-key head
    v_codes, v_params                            likewise with Gv (values are always INT2)
    sink_k, sink_v  [num_sink_rows, Hkv, D]      transformed rows of positions < sink (window dtype)
    ring_k, ring_v  [max_reqs * window, Hkv, D]  transformed rows of the recent window;
                                                 position p of request r is row r*window + p % window
    sink_table int32 [num_slots]                 pool slot -> sink row, -1 = none

Every slot always holds the quantized form; sink and ring rows are extra BF16 copies. All buffers
must be contiguous (the kernels compute offsets from the shapes; the record of (slot, head) is
kernels/records.py:pool_record). rows() / set_rows() read and write [n, Hkv, ...] by slot in
either layout (the oracles and tests use them).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..config import (SERVED_GROUP, SERVED_RECENT, SERVED_SINK, SUPPORTED_GROUPS, check_group_fits,
                      check_supported_head_dim)
from ..quant.intq import PARAM_DTYPE
SUPPORTED_PAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WINDOW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_shape(head_dim: int, group: int, what: str = "") -> None:
    """Raise a clear error for a head_dim / group size the kernels do not support."""
    check_supported_head_dim(head_dim, what)
    if group not in SUPPORTED_GROUPS:
        raise ValueError(f"{what}group size {group} is not supported by the OSCAR kernels (use one of {SUPPORTED_GROUPS})")
    check_group_fits(head_dim, group, f"{what}group size", supported=True)


def check_page(page: int, num_slots: Optional[int] = None) -> None:
    """Raise a clear error for a page size the kernels do not support, or a pool that is not whole pages."""
    if page not in SUPPORTED_PAGES:
        raise ValueError(f"page size {page} is not supported by the OSCAR pool (use one of {SUPPORTED_PAGES})")
    if num_slots is not None and num_slots % page:
        raise ValueError(f"a pool of {num_slots} slots is not a whole number of pages of {page}")


def pool_shape(num_slots: int, kv_heads: int, tail: tuple, page: int) -> tuple:
    """Shape of a code / param buffer: [num_slots, Hkv, *tail] at page 1, [num_slots/page, Hkv, page, *tail] else."""
    if page == 1:
        return (num_slots, kv_heads, *tail)
    return (num_slots // page, kv_heads, page, *tail)


@dataclasses.dataclass
class LayerCache:
    k_codes: torch.Tensor
    k_params: torch.Tensor
    v_codes: torch.Tensor
    v_params: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    k_group: int
    v_group: int
    window: int = SERVED_RECENT
    sink: int = SERVED_SINK
    sink_table: Optional[torch.Tensor] = None
    page: int = 1
    k_hi: Optional[torch.Tensor] = None
    k4_heads: tuple = ()  # KV heads with INT4 keys, ascending (k_hi's heads in that order); needs k_hi

    def __post_init__(self) -> None:
        self.k4_heads = tuple(int(h) for h in self.k4_heads)
        index = torch.full((self.k_codes.shape[1],), -1, dtype=torch.int32)
        for j, h in enumerate(self.k4_heads):
            index[h] = j
        self.k4_index = index.to(self.k_codes.device)

    @property
    def has_k4(self) -> bool:
        """Some KV head of this layer stores INT4 keys (k_hi); the kernels specialise on it."""
        return self.k_hi is not None

    @property
    def num_slots(self) -> int:
        return self.k_codes.shape[0] * self.page

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[-1] * 4

    def _slot_index(self, slots: torch.Tensor, device) -> tuple:
        """Index of `slots` into a code / param buffer: [slots] at page 1, [slots // P, :, slots % P] else."""
        slots = slots.long().to(device)
        if self.page == 1:
            return (slots,)
        return (slots // self.page, slice(None), slots % self.page)

    def rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Buffer `name` (k_codes, k_hi, k_params, v_codes, v_params) at `slots`: [n, Hkv, ...] ([n, H4, ...] for k_hi),
        either layout."""
        t = getattr(self, name)
        return t[self._slot_index(slots, t.device)]

    def set_rows(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write [n, Hkv, ...] values into buffer `name` at `slots` (either layout)."""
        t = getattr(self, name)
        t[self._slot_index(slots, t.device)] = values

    @classmethod
    def empty(
        cls,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        *,
        k_group: int = SERVED_GROUP,
        v_group: int = SERVED_GROUP,
        num_sink_rows: int = 0,
        max_reqs: int = 1,
        window: int = SERVED_RECENT,
        sink: int = SERVED_SINK,
        window_dtype: torch.dtype = torch.bfloat16,
        device=None,
        with_sink_table: bool = True,
        page: int = 1,
        k_bits: int = 2,
        k4_heads=None,
    ) -> "LayerCache":
        """Uninitialised buffers (torch.empty) of the right shapes; the sink table is all -1. k4_heads: the KV heads
        with INT4 keys (a k_hi buffer of their high planes beside k_codes); k_bits 4 without k4_heads: every head."""
        if k_bits not in (2, 4):
            raise ValueError(f"key bits must be 2 or 4, got {k_bits}")
        if k4_heads is None:
            k4_heads = range(kv_heads) if k_bits == 4 else ()
        k4_heads = tuple(sorted({int(x) for x in k4_heads}))
        if any(not 0 <= x < kv_heads for x in k4_heads):
            raise ValueError(f"k4_heads {k4_heads} outside the {kv_heads} KV heads")
        check_shape(head_dim, k_group, "K: ")
        check_shape(head_dim, v_group, "V: ")
        check_page(page, num_slots)
        d, h = head_dim, kv_heads

        def codes(heads=h):
            return torch.empty(pool_shape(num_slots, heads, (d // 4,), page), dtype=torch.uint8, device=device)

        def params(g):
            return torch.empty(pool_shape(num_slots, h, (d // g, 2), page), dtype=PARAM_DTYPE, device=device)

        def rows(n):
            return torch.empty(n, h, d, dtype=window_dtype, device=device)

        table = torch.full((num_slots,), -1, dtype=torch.int32, device=device) if with_sink_table else None
        return cls(
            codes(), params(k_group), codes(), params(v_group),
            rows(num_sink_rows), rows(num_sink_rows), rows(max_reqs * window), rows(max_reqs * window),
            k_group, v_group, window, sink, table, page, codes(len(k4_heads)) if k4_heads else None, k4_heads,
        )

    def buffers(self) -> dict:
        names = ("k_codes", "k_hi", "k_params", "v_codes", "v_params", "sink_k", "sink_v", "ring_k", "ring_v",
                 "sink_table")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def clone(self) -> "LayerCache":
        return dataclasses.replace(self, **{n: t.clone() for n, t in self.buffers().items()})

    def validate(self) -> None:
        """Check shapes, dtypes, devices and contiguity; raise ValueError with the offending buffer."""
        n, h, d, pg = self.num_slots, self.kv_heads, self.head_dim, self.page
        check_shape(d, self.k_group, "K: ")
        check_shape(d, self.v_group, "V: ")
        check_page(pg)
        dev = self.k_codes.device
        expect = {
            "k_codes": (pool_shape(n, h, (d // 4,), pg), torch.uint8),
            "v_codes": (pool_shape(n, h, (d // 4,), pg), torch.uint8),
            "k_params": (pool_shape(n, h, (d // self.k_group, 2), pg), PARAM_DTYPE),
            "v_params": (pool_shape(n, h, (d // self.v_group, 2), pg), PARAM_DTYPE),
        }
        if self.k_hi is not None:
            h4 = len(self.k4_heads)
            if not h4 or list(self.k4_heads) != sorted(set(self.k4_heads)) or not 0 <= self.k4_heads[0] \
                    or self.k4_heads[-1] >= h:
                raise ValueError(f"LayerCache.k4_heads {self.k4_heads}: ascending KV heads of [0, {h}) with k_hi")
            expect["k_hi"] = (pool_shape(n, h4, (d // 4,), pg), torch.uint8)
        elif self.k4_heads:
            raise ValueError(f"LayerCache.k4_heads {self.k4_heads} without a k_hi buffer")
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"LayerCache.{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        for name in ("sink_k", "sink_v", "ring_k", "ring_v"):
            t = getattr(self, name)
            if t.dim() != 3 or tuple(t.shape[1:]) != (h, d) or t.dtype not in WINDOW_DTYPES:
                raise ValueError(f"LayerCache.{name}: expected [rows, {h}, {d}] of {WINDOW_DTYPES}, got {t.dtype} {tuple(t.shape)}")
        if self.ring_k.shape[0] % max(self.window, 1):
            raise ValueError(f"LayerCache.ring_k has {self.ring_k.shape[0]} rows, not a multiple of window {self.window}")
        if self.sink_k.shape != self.sink_v.shape or self.ring_k.shape != self.ring_v.shape:
            raise ValueError("LayerCache: K and V window buffers must have the same shapes")
        if self.sink_table is not None and (self.sink_table.shape != (n,) or self.sink_table.dtype != torch.int32):
            raise ValueError(f"LayerCache.sink_table: expected int32 [{n}], got {self.sink_table.dtype} {tuple(self.sink_table.shape)}")
        for name, t in self.buffers().items():
            if t.device != dev:
                raise ValueError(f"LayerCache.{name} is on {t.device}, k_codes on {dev}")
            if not t.is_contiguous():
                raise ValueError(f"LayerCache.{name} must be contiguous")
