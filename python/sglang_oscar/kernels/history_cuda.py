"""The quantized history stage of oscar_decode in CUDA (kernels/cuda/int2_history.cu): checks, split rule, launch.

It reads the cache format of kernels/layout.py: INT2 values, INT2 keys and, on a layer's cache.k4_heads, INT4 keys
(cache.k_hi; the kernel's INT4 instances run a layer with such heads, the INT2 ones every other layer), and (scale,
min) pairs of float8 e4m3 on both sides.

oscar_decode(..., history_kernel="cuda") runs this kernel for the history splits [0, NS) (one split per CTA; its
warps merge in shared memory) and, in the same grid, the BF16 sink and ring rows: in window CTAs after the history
CTAs, or, where a launch has a split per 16-row window tile, in the first warp of each of those splits (folds). The
Triton merge follows it (PDL). In a served decode step it is itself the PDL dependent of the step's KV write
(oscar_decode follows_write; PDL_AFTER_WRITE / PDL_AFTER_WRITE_Q below): its history CTAs stream while the write runs.
What it covers is kernels/shapes.py's rule (D 128 with groups 64 / 128, D 64 with groups 32 / 64, GQA 1-16 with
above 8 as head groups of 8; INT2 keys and INT4 ones on any KV heads); at D 64 the Triton window programs read the
window after it. Anything else raises with the reason. It pays on a pool in pages of 64 (kernels/records.py): on
H100 78-93% of copy bandwidth at 64k / 128k batch >= 8 for Qwen3-8B / 14B / 32B shapes, against 56-68% for the Triton
path (benchmark/NOTES.md).

The library is built with nvcc on first use (kernels/cuda_build.py) and loaded with ctypes. CPU CI covers this
kernel's register layouts through test/test_cuda_history_layouts.py; the GPU tests compare it with the oracle.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from typing import Optional

import torch

from . import cuda_build
from .cuda_build import CudaUnavailable
from .shapes import CUDA_HISTORY_GROUPS, CUDA_WINDOW_HEAD_DIMS, cuda_history_refusal, window_programs

SOURCE = os.path.join(cuda_build.CUDA_DIR, "int2_history.cu")
HEAD_DIMS = tuple(CUDA_HISTORY_GROUPS)
# Per CTA: 8 warps of 2 pipeline stages (the instances int2_history.cu builds).
WARPS, STAGES = 8, 2
# D 64: 64-token stages with the block's four tiles unrolled (int2_history.cu WIDE), except for a launch chained to
# this step's KV write below this batch, which keeps 32-token stages. Why: the D-64 loop is issue-bound, and a
# 32-token block pays its slots, records and copies per 2 tiles (H200, SmolLM2: 0.84-0.92x the time); chained at batch
# 1 the wider first copies delay the write's q (1.10x at 32k / 64k).
D64_WIDE_AFTER_WRITE = 2
# Rows per warp of a split: at least MIN_ROWS_PER_SPLIT, unless that leaves SMs without a CTA: then as many CTAs as
# SMs (not more), down to MIN_ROWS_TO_FILL rows per warp (one 32-token block). Why: with few CTA columns (GLM-4.7 at
# TP8: 2 columns at batch 1) the 256-row floor left most SMs idle; past one CTA per SM the second CTA on an SM runs
# at half rate.
MIN_ROWS_PER_SPLIT = 256
MIN_ROWS_TO_FILL = 32
WINDOW_ROWS_PER_WARP = 16  # positions per warp of a window CTA (one 16-row tile)
# The merge reads a query head's partials (history splits + window partials) in one tile of at most this many.
MAX_PARTIALS = 256
LOG2E = 1.4426950408889634
Q_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the kernel's q_dtype codes

# oscar_history_launch's C parameters in order (test_decode checks them against the source's signature)
_i, _p = ctypes.c_int, ctypes.c_void_p
LAUNCH_ARGTYPES = [_i, _i, _i, _i, _i, _i, _i, _i, _i, _i, _p, _i, ctypes.c_float, _p, _p, _p, _p, _i, _p, _p, _p,
                   _i, _p, _i, _p, _p, _i, _i, _i, _p, _p, _i, _i, _i, _p, _p, _p, _p, _p, _i, _i, _i, _i, _p, _i,
                   _p, _i, _i, _p]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_occupancy: dict = {}


def fuses_window(head_dim: int) -> bool:
    """Whether this kernel reads the BF16 sink / ring rows itself at head_dim; else oscar_decode runs the Triton window
    programs after it."""
    return head_dim in CUDA_WINDOW_HEAD_DIMS


def check_supported(head_dim: int, group: int, k_group: int, v_group: int, device,
                    window_dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ValueError / CudaUnavailable saying why history_kernel="cuda" cannot run this call (device None: the
    shape only)."""
    why = cuda_history_refusal(head_dim, group, k_group, v_group, window_dtype)
    if why:
        raise ValueError(f"history_kernel='cuda': {why}: use history_kernel='triton'")
    if device is None:
        return
    if torch.device(device).type != "cuda":
        raise ValueError("history_kernel='cuda' needs CUDA tensors")
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        raise CudaUnavailable("history_kernel='cuda' needs sm_80 or newer (mma.sync, cp.async)")


def library() -> ctypes.CDLL:
    """The compiled kernel library (built on first use, then cached on disk and in the process); its first load also
    raises the shared-memory limits of the instances, before any graph capture."""
    global _lib
    if _lib is not None:  # every decode call comes here: no lock, no device query once loaded
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(cuda_build.build(SOURCE))
        lib.oscar_history_launch.argtypes = LAUNCH_ARGTYPES
        lib.oscar_history_launch.restype = ctypes.c_int
        for f in (lib.oscar_history_prepare, lib.oscar_history_occupancy):
            f.argtypes, f.restype = [ctypes.c_int] * 5, ctypes.c_int
        _lib = lib
    for heads in (4, 8):
        for head_dim in HEAD_DIMS:
            for wide in (False, True) if wide_built(head_dim, heads) else (False,):
                occupancy(heads=heads, head_dim=head_dim, wide=wide)
    return _lib


def occupancy(heads: int = 4, head_dim: int = 128, wide: bool = False) -> int:
    """Resident CTAs per SM of the kernel with `heads` query heads per CTA column (cta_heads), head_dim and, at D 64,
    32- or 64-token stages (wide, block_tokens) on the current device: the fewest of its instances with INT2 and INT4
    keys (the split rule is the shape's, whatever the layer's key bits); the first call per configuration and device
    also raises their dynamic shared-memory limits. (D 64 compiles to ~80 registers: 3 CTAs of 8 warps per SM; D 128
    to 128: 2.)"""
    lib = _lib if _lib is not None else library()
    if heads not in (4, 8) or head_dim not in HEAD_DIMS or (wide and not wide_built(head_dim, heads)):
        raise ValueError(f"history_kernel='cuda' builds 4 or 8 heads per CTA column, head_dim {HEAD_DIMS} and 64-token "
                         f"stages at head_dim 64 with 4 heads per column only, got {heads}/{head_dim}"
                         f"{' wide' if wide else ''}")
    key = (torch.cuda.current_device(), heads, head_dim, bool(wide))
    if key not in _occupancy:
        rc = lib.oscar_history_prepare(STAGES, WARPS, heads, head_dim, int(wide))
        if rc:
            raise CudaUnavailable(f"cudaFuncSetAttribute for the history kernel failed (cuda error {rc})")
        _occupancy[key] = lib.oscar_history_occupancy(STAGES, WARPS, heads, head_dim, int(wide))
    return _occupancy[key]


def wide_built(head_dim: int, heads: int) -> bool:
    """Whether int2_history.cu builds the 64-token (WIDE) instance at head_dim with `heads` query heads per CTA column:
    D 64 with 4 heads (with 8 it would hold 2 CTAs per SM instead of 3)."""
    return head_dim == 64 and heads == 4


def block_tokens(head_dim: int, heads: int, pdl: int, batch: int) -> int:
    """Tokens per pipeline stage of a warp: 64 where the WIDE instance is built (wide_built), unless the launch follows
    this step's KV write at a batch below D64_WIDE_AFTER_WRITE; else 32."""
    after_write = pdl in (PDL_AFTER_WRITE, PDL_AFTER_WRITE_Q)
    return 64 if wide_built(head_dim, heads) and (not after_write or batch >= D64_WIDE_AFTER_WRITE) else 32


def cta_heads(gqa: int) -> int:
    """Query heads per CTA column: 4 up to GQA 4 (columns 4..7 of a warp's tile repeat them), 8 above (one head per
    column: the same MMA count per token for twice the heads)."""
    return 8 if gqa > 4 else 4


def cta_columns(kv_heads: int, gqa: int) -> int:
    """CTA columns of a launch (grid x): one per (request, KV head) and head group of cta_heads(gqa) query heads."""
    return kv_heads * -(-gqa // cta_heads(gqa))


def window_ctas(sink: int, window: int) -> tuple:
    """(sink CTAs, ring CTAs) per CTA column: WINDOW_ROWS_PER_WARP positions per warp (at least one sink CTA, as
    the Triton path has one sink program, so that the merge's sink-partial range is never empty)."""
    rows = WINDOW_ROWS_PER_WARP * WARPS
    return max(1, -(-sink // rows)), max(1, -(-window // rows))


def fold_tiles(sink: int, window: int) -> int:
    """Window tiles of 16 positions per CTA column when the window is folded into the history CTAs: the sink's, then
    the ring's (20 for S 64, W 256)."""
    return -(-sink // 16) + -(-window // 16)


def folds(num_splits: int, sink: int, window: int, head_dim: int = 128) -> bool:
    """Whether a launch of num_splits history splits folds the window into them: where this kernel reads the window
    (fuses_window) and the launch has a split per window tile, so that a CTA reads at most one. Why: at batch 1 the
    window CTAs did not fit the grid's one round beside the history CTAs, and those of the second round ended the
    call."""
    return fuses_window(head_dim) and num_splits >= fold_tiles(sink, window) > 0


def default_num_splits(kv_heads: int, gqa: int, max_context: int, num_sms: int, window_partials: int = 8,
                       head_dim: int = 128) -> int:
    """History splits (CTAs) per CTA column (kv_heads = requests x KV heads): one round of resident CTAs,
    >= MIN_ROWS_PER_SPLIT rows per warp unless more splits fill the SMs once (MIN_ROWS_TO_FILL, at most one CTA per
    SM), at most MAX_PARTIALS - window_partials (the merge holds a head's partials, windows included, in one tile).
    The window CTAs are not counted in the round: they end within a few microseconds. Shapes only (max_context =
    req_to_token's width), so CUDA-graph capturable."""
    ctas = occupancy(heads=cta_heads(gqa), head_dim=head_dim)
    cols = max(cta_columns(kv_heads, gqa), 1)
    want = max(1, (num_sms * ctas) // cols)
    ctx = max(max_context, 1)
    rows = ctx // (MIN_ROWS_PER_SPLIT * WARPS)
    fill = min(num_sms // cols, ctx // (MIN_ROWS_TO_FILL * WARPS))  # <= one CTA per SM, rows allowing
    return max(1, min(want, max(rows, fill), MAX_PARTIALS - window_partials))


# chained_num_splits applies to req_to_token widths (the longest context a call can have; in a server its context
# length) in [CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT]: there it measured 0.91-0.95x the one-round count (H100,
# Qwen3-8B and 32B, batch 1), above it 1.01-1.05x (the history's share of fewer CTAs costs more than the late start of
# the last ones); below 32k the one-round count is capped by MIN_ROWS_PER_SPLIT anyway.
CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT = 1 << 15, 1 << 16
# ...but a chained count of more than one CTA per SM that leaves fewer than CHAINED_MIN_ROWS rows per warp falls back
# to one CTA per SM: with few CTA columns (GLM-4.x) the round's second CTA per SM would stream only 1-3 blocks of 32
# tokens per warp for its own fixed cost (index chain, q build, CTA merge).
CHAINED_MIN_ROWS = 96


def chained_num_splits(kv_heads: int, gqa: int, num_sms: int, write_programs: int, window_partials: int = 8,
                       max_context: Optional[int] = None, head_dim: int = 128) -> int:
    """History splits per CTA column for one request chained to its KV write (oscar_decode follows_write, batch 1):
    the slots of one round that the write's programs and this grid's window CTAs leave. Why: launched as the write's
    programmatic dependent, the history CTAs start beside the write's programs, and an SM holding one of those has no
    registers left for a second history CTA, so with the one-round count (default_num_splits) the last-dispatched
    CTAs would start only when the write ends and end the call that much later. With max_context (req_to_token's
    width), a count above one CTA per SM that leaves < CHAINED_MIN_ROWS rows per warp becomes one CTA per SM."""
    ctas = occupancy(heads=cta_heads(gqa), head_dim=head_dim)
    cols = max(cta_columns(kv_heads, gqa), 1)
    free = num_sms * ctas - write_programs - cols * window_partials
    n = free // cols
    one_per_sm = num_sms // cols
    if max_context is not None and n > one_per_sm >= 1 and max_context // (n * WARPS) < CHAINED_MIN_ROWS:
        n = one_per_sm
    return max(1, min(n, MAX_PARTIALS - window_partials))


def plan(batch: int, kv_heads: int, gqa: int, max_context: int, num_sms: int, sink: int, window: int,
         chained_write_programs: Optional[int] = None, head_dim: int = 128) -> tuple:
    """(history splits, fold): the count of a grid without window CTAs (split_count with no window partials), and the
    window folded where that count has a split per window tile (folds); else split_count with the window CTAs'
    partials, or, where this kernel does not read the window (D 64), with the partials of the Triton window programs
    that follow it."""
    if not fuses_window(head_dim):
        partials = sum(window_programs(sink, window))
        return split_count(batch, kv_heads, gqa, max_context, num_sms, partials, chained_write_programs,
                           head_dim), False
    n = split_count(batch, kv_heads, gqa, max_context, num_sms, 0, chained_write_programs, head_dim)
    if folds(n, sink, window, head_dim):
        return n, True
    return split_count(batch, kv_heads, gqa, max_context, num_sms, sum(window_ctas(sink, window)),
                       chained_write_programs, head_dim), False


def split_count(batch: int, kv_heads: int, gqa: int, max_context: int, num_sms: int, window_partials: int,
                chained_write_programs: Optional[int] = None, head_dim: int = 128) -> int:
    """The history split count: chained_num_splits for one request chained to its KV write (chained_write_programs:
    that write's program count, write.write_grid or write_cuda.grid) at a req_to_token width (max_context) in
    [CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT], else default_num_splits; at batch 1 at most one round less one slot
    per column, so that each column's first window CTA (its sink CTA, whose index chain is the longest) starts in the
    first round instead of after the first history CTAs end. window_partials 0: a grid without window CTAs (the
    window folded, plan), so no slot is kept for them."""
    if (chained_write_programs is not None and batch == 1
            and CHAINED_MIN_CONTEXT <= max_context <= CHAINED_MAX_CONTEXT):
        return chained_num_splits(kv_heads, gqa, num_sms, chained_write_programs, window_partials, max_context,
                                  head_dim)
    n = default_num_splits(batch * kv_heads, gqa, max_context, num_sms, window_partials, head_dim)
    if batch == 1 and window_partials:
        cols = max(cta_columns(kv_heads, gqa), 1)
        n = max(1, min(n, (num_sms * occupancy(heads=cta_heads(gqa), head_dim=head_dim) - cols) // cols))
    return n


_INDEX_DTYPES = {torch.int32: 0, torch.int64: 1}
# The kernel's dormant arguments (int2_history.cu Args says why they are still there): win_last 1 (window CTAs after
# the history CTAs), out / out_dtype / counters / fused_merge off (the Triton merge follows).
_DORMANT = (1, None, 0, None, 0)
# launch(pdl=...): the kernel's Args.pdl (kernels/cuda/int2_history.cu kPdl*). PDL_WAIT_FIRST: a programmatic
# dependent of any kernel (every CTA waits for it first). PDL_AFTER_WRITE: a programmatic dependent of this decode
# step's KV write (oscar_write_kv(pdl_trigger=True)), with q and the indices written before that write: the history
# CTAs run while the write does, the window CTAs (which read the new row) wait for it. PDL_AFTER_WRITE_Q: the same
# with q rotated by that write (oscar_write_kv q_out): the history CTAs issue their first copies, then wait for it.
PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_WRITE, PDL_AFTER_WRITE_Q = 0, 1, 2, 3


def launch(q, cache, req_to_token, req_pool_indices, seq_lens, ring_start, *, sink, window, sm_scale, ns, ns_total,
           o_part, lse_part, pdl: int = PDL_OFF, window_splits: tuple = (0, 0), sink_k=None, sink_v=None,
           fold: bool = False) -> None:
    """Write the history partials [0, ns) of o_part / lse_part (oscar_decode's layout) for q [B, Hq, D], and
    with window_splits = (SS, RS) != (0, 0) (window_ctas) the sink partials [ns, ns + SS) and the ring partials
    [ns + SS, ns + SS + RS) as well (sink_k / sink_v: the cache's sink rows, or a one-row stand-in where it has
    none). fold (folds; window_splits (0, 0)): the history CTAs read the window themselves (no window partials).
    oscar_decode, the caller, has checked the index dtypes and check_supported the shape; this checks only what the
    kernel adds (the split range, contiguous 1-D inputs, q's alignment, cache.k_hi's layout, the params' storage).
    A layer with INT4-key heads (cache.k_hi, cache.k4_heads) runs the kernel's INT4-key instance.

    The kernel lets its dependents launch at once (griddepcontrol.launch_dependents); a kernel launched after it
    with PDL must wait for it (griddepcontrol.wait) before it relies on these partials. pdl: launch this kernel
    itself as a programmatic dependent of the previous one (PDL_WAIT_FIRST: it waits for that one before anything
    else; PDL_AFTER_WRITE / PDL_AFTER_WRITE_Q: the previous kernel is this step's KV write, see the constants)."""
    if pdl not in (PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_WRITE, PDL_AFTER_WRITE_Q):
        raise ValueError(f"pdl must be PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_WRITE or PDL_AFTER_WRITE_Q (0-3), "
                         f"got {pdl!r}")
    head_dim = q.shape[-1]
    records = cache.k_codes.numel() // (head_dim // 4)
    if records >= 1 << 31:  # the loop's copies index records in 32 bits (pool_record32)
        raise ValueError(f"history_kernel='cuda' indexes the pool's (slot, KV head) records in 32 bits; this pool has "
                         f"{records} (>= 2^31): use history_kernel='triton' or a smaller pool")
    if not fuses_window(head_dim) and (window_splits != (0, 0) or fold):
        raise ValueError(f"history_kernel='cuda' reads the window in its own grid at head_dim {CUDA_WINDOW_HEAD_DIMS} "
                         f"only; at {head_dim} launch it with window_splits (0, 0) and no fold, and the Triton window "
                         f"programs after it (oscar_decode does)")
    k_hi = cache.k_hi
    if k_hi is not None:
        h4 = len(cache.k4_heads)
        want = list(cache.k_codes.shape)
        want[1] = h4  # [slots, H4, D/4] or [slots/P, H4, P, D/4]: the INT4 heads' rows only
        if k_hi.dtype != torch.uint8 or list(k_hi.shape) != want or not k_hi.is_contiguous() or not h4:
            raise ValueError(f"history_kernel='cuda' reads cache.k_hi (the high planes of the k4_heads "
                             f"{cache.k4_heads}) as contiguous uint8 {tuple(want)}, got {k_hi.dtype} "
                             f"{tuple(k_hi.shape)}")
        k4_index = cache.k4_index
        if k4_index.dtype != torch.int32 or k4_index.device != cache.k_codes.device or k4_index.numel() != \
                cache.kv_heads:
            raise ValueError(f"history_kernel='cuda' reads cache.k4_index as int32 [{cache.kv_heads}] on the cache's "
                             f"device, got {k4_index.dtype} {tuple(k4_index.shape)} on {k4_index.device}")
    for name, prm, group in (("k_params", cache.k_params, cache.k_group), ("v_params", cache.v_params, cache.v_group)):
        # a row of one group has a 2-byte pair per record, copied as the 4-byte word of its record pair: with an odd
        # record count the last record's word reaches 2 bytes past the buffer
        end = (prm.storage_offset() + prm.numel()) * prm.element_size()
        if group == head_dim and records % 2 and prm.untyped_storage().nbytes() < end + 2:
            raise ValueError(f"history_kernel='cuda' reads one-group (scale, min) pairs in 4-byte words of two records: "
                             f"{name} of an odd record count ({records}) needs 2 bytes of storage past its end; use an "
                             f"even slot count or history_kernel='triton'")
    lib = library()
    b, hq = q.shape[0], q.shape[1]
    hkv = cache.kv_heads
    heads = cta_heads(hq // hkv)
    wide = block_tokens(head_dim, heads, pdl, b) == 64
    ss, rs = window_splits
    if not 1 <= ns <= ns_total - ss - rs:
        raise ValueError(f"history_kernel='cuda': num_splits must be in [1, {ns_total - ss - rs}], got {ns}")
    if fold and (ss or rs or ns < fold_tiles(sink, window)):
        raise ValueError(f"history_kernel='cuda' folds the window into >= {fold_tiles(sink, window)} history splits "
                         f"without window CTAs; got {ns} splits and window_splits {window_splits}")
    if ss or rs or fold:
        sink_k = cache.sink_k if sink_k is None else sink_k
        sink_v = cache.sink_v if sink_v is None else sink_v
        for x in (sink_k, sink_v, cache.ring_k, cache.ring_v):
            if x.dtype != torch.bfloat16 or not x.is_contiguous():
                raise ValueError("history_kernel='cuda' reads contiguous BF16 sink / ring rows in its window CTAs, "
                                 f"got {x.dtype}: keep the window in bfloat16 or use history_kernel='triton'")
        win = (sink_k.data_ptr(), sink_v.data_ptr(), cache.ring_k.data_ptr(), cache.ring_v.data_ptr(),
               cache.sink_table.data_ptr())
    else:
        win = (None,) * 5
    if not (req_pool_indices.is_contiguous() and seq_lens.is_contiguous() and q.is_contiguous()):
        raise ValueError("history_kernel='cuda' needs contiguous q, req_pool_indices and seq_lens")
    if q.data_ptr() % 16:  # its warps read q's rows in 16-byte loads
        raise ValueError("history_kernel='cuda' reads q in 16-byte loads: q must start 16-byte aligned (a tensor at "
                         "its own storage's start, e.g. q.clone(), is)")
    occupancy(heads=heads, head_dim=head_dim, wide=wide)  # a dict hit once prepared (library() did it)
    # q [B, Hq, D] contiguous; each warp builds its operands from it (no extra launches)
    rc = lib.oscar_history_launch(
        STAGES, WARPS, heads, head_dim, int(wide), b * hkv, hq // hkv, int(cache.k_group == head_dim),
        int(cache.v_group == head_dim), ns, q.data_ptr(),
        Q_DTYPES[q.dtype], float(sm_scale) * LOG2E,
        cache.k_codes.data_ptr(), cache.v_codes.data_ptr(), None if k_hi is None else k_hi.data_ptr(),
        None if k_hi is None else k4_index.data_ptr(), 0 if k_hi is None else h4,
        cache.k_params.data_ptr(), cache.v_params.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
        _INDEX_DTYPES[req_pool_indices.dtype], seq_lens.data_ptr(), ring_start.data_ptr(), hkv, sink, window,
        o_part.data_ptr(), lse_part.data_ptr(), ns_total, int(math.log2(cache.page)), int(pdl), *win, ss, rs,
        WINDOW_ROWS_PER_WARP // 16, *_DORMANT, fold_tiles(sink, window) if fold else 0,
        torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"history_kernel='cuda' launch failed (cuda error {rc})")
