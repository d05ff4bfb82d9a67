"""Where a (slot, KV head) record of the INT2 pool lives: the one address rule of the write, gather
and decode kernels (kernels/layout.py describes the buffers).

PAGE 1:  record slot * H + h                                   ([slot, H, .], the original layout)
PAGE P:  record ((slot // P) * H + h) * P + slot % P           ([page, H, P, .]: a page's P rows of one
                                                                KV head are contiguous)

Why pages (benchmark/NOTES.md "A hand-written history loop"): a decode program reads one KV head of
consecutive positions; in [slot, H, .] those 32-byte code rows sit H * 32 bytes apart, and that gather
alone took as long as the whole decode call on H100. With P = 64 the rows of a request's run of slots
are contiguous; pages in any order cost nothing (measured).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k4_row(k4_index, h, K4: tl.constexpr):
    """K4 (the layer has INT4-key heads): KV head h's row among k_hi's heads (kernels/layout.py k4_index), -1 where
    its keys are INT2; -1 without K4 (no head has INT4 keys). Address it with pool_record(slot, row, H4, PAGE)."""
    if K4:
        return tl.load(k4_index + h)
    else:
        return -1


@triton.jit
def pool_record(slot, h, H: tl.constexpr, PAGE: tl.constexpr):
    """Record index of (slot, KV head h); multiply by the record's size (D/4 code bytes, D/G param pairs)."""
    if PAGE == 1:
        return slot * H + h
    else:
        return ((slot // PAGE) * H + h) * PAGE + slot % PAGE
