"""The INT2 history stage of oscar_decode in CUDA (kernels/cuda/int2_history.cu): build, checks, launch.

oscar_decode(..., history_kernel="cuda") runs this kernel for the history splits [0, NS) (one split per CTA; its
warps merge in shared memory) and, in the same grid, the BF16 sink and ring rows (window CTAs, FUSED_WINDOW; or,
where a launch has a split per 16-row window tile, the first warp of each of those splits: FOLD_WINDOW), then
the Triton merge (PDL; FUSED_MERGE: the last CTA of each (request, KV head) merges instead, measured slower). In
a served decode step it is itself the PDL dependent of the step's KV write (oscar_decode follows_write;
PDL_AFTER_WRITE / PDL_AFTER_WRITE_Q below): its history CTAs stream while the write runs. It
covers the shape family it was written and measured for: D 128, K and V groups of 64 or 128, uniform INT2 levels,
GQA 1-16 (Qwen3-4B / 8B / 14B / 32B, Llama-3-8B, MiniMax-M2; GLM-4.x's 12 in head groups), BF16 sink / ring rows;
and D 64 (SmolLM2) with groups of 32 or 64, whose window the Triton window programs read after it (fuses_window).
Anything else raises with the reason instead of falling back. It pays on a pool in pages (kernels/records.py): on
H100, page 64, 78-93% of copy bandwidth at 64k / 128k batch >= 8 for Qwen3-8B / 14B / 32B shapes, against 56-68%
for the Triton path (benchmark/NOTES.md).

Build: nvcc (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin) compiles the source once per (source, GPU arch,
nvcc) into $SGLANG_OSCAR_CACHE (default ~/.cache/sglang_oscar) and the library is loaded with ctypes (no
Python extension, no ninja). The Triton path needs none of this; CPU CI covers this kernel's register layouts
through test/test_probe_cuda_history.py and the GPU tests compare it with the oracle. $SGLANG_OSCAR_HISTORY_DEFINES
(space-separated NAME=VALUE macros, e.g. OSCAR_IMMA_K=0) builds the shipped source with the kernel's experiment
knobs, so that the GPU tests can run a variant before it becomes the default; unset in production.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import re
import shutil
import subprocess
import threading
from typing import Optional

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "int2_history.cu")
# head_dim -> the K and V group sizes it covers (each side either): a row of two groups or of one (int2_history.cu TWO_G)
GROUPS = {128: (64, 128), 64: (32, 64)}
HEAD_DIMS = tuple(GROUPS)
# The BF16 sink / ring rows are read in this kernel (window CTAs, the folded window) at these head dims; at the others
# (D 64) oscar_decode launches the Triton window programs as its programmatic dependents, and the merge after them.
WINDOW_HEAD_DIMS = (128,)
# the stage counts D 64 is built at (int2_history.cu DISPATCH; 2 by default, 3 / 4 for benchmark/probe_d64_stages.py)
D64_STAGES = (2, 3, 4)
# D 64: 64-token stages with the block's four tiles unrolled (int2_history.cu WIDE) for a launch that does not follow
# the KV write; 32-token stages after it. Why: the D-64 loop is issue-bound (ncu: 62-69% of issue slots, "not
# selected" the first stall reason; its copies alone take 0.56-0.61x its time, results/probe_history_copies_*), and a
# 32-token block paid ~117 instructions of slots, records and copies per 2 tiles. Same-process H200 A/B, SmolLM2
# (results/probe_history_trace_d64_variants_*): 0.84-0.86x the time at batch 8 and 32k batch 64, 0.92x at 128k batch
# 64, 0.89x at 128k batch 1, 0.99x at 64k batch 1. Chained to the KV write they pay from batch 2 only (same-process
# H200 A/B, results/probe_history_trace_d64_chain_865eb8e_*): 0.94-0.95x at 64k batch 2 / 4 and 32k batch 8, 0.86-0.89x
# at 64k / 128k batch 8, but 1.10x / 1.12x at 32k / 64k batch 1 (the write's q arrives later behind the wider first
# copies, and the last warps end ~2 us later) and 0.95x at 128k batch 1. Module attributes, so that benchmarks time
# both in one process (probe_history_trace.py --sources name=+B0): D64_WIDE_AFTER_WRITE is the smallest batch at
# which a launch after the write takes them (+A<n>; 0: never, 1: always). A graph is captured per batch size, so the
# rule holds for its replays.
D64_WIDE_BLOCKS = True
D64_WIDE_AFTER_WRITE = 2
# the stage counts the 64-token D-64 build has (at 4 its 96 KB of stages per CTA fit twice per SM, not 3 times)
D64_WIDE_STAGES = (2, 3)
# Query heads per KV head. A CTA column holds 4 query heads (GQA <= 4) or, with WIDE_TILE, 8 (GQA 5-8: one head
# per column of the warp's tile, the same MMA count per token; kernels/cuda/int2_history.cu "HC"). A KV head with
# more query heads than a column holds is read by several CTA columns (head groups): GQA 5-8 that way (WIDE_TILE
# off) measured slower than the Triton path on H100 (Qwen3-32B: 0.86-0.95x, results/decode_cuda_history_gqa8_*).
# GQA 9-16 (GLM-4.x: 96 q / 8 KV heads, 12 per KV head at any TP) runs in head groups of 8 (12 = 8 + 4 with spare
# columns): on H200 (results/decode_kernel_glm_*) 1.05-1.12x the Triton path's speed at batch >= 8, and with the
# split floor below (MIN_ROWS_TO_FILL) at batch 1 too except at 32k (~0.9x); refused on H100 before that floor
# (0.86-0.99x at batch >= 8 in 2026-11-27's kernel). Both module attributes, for experiments.
MAX_GQA = 16
WIDE_TILE = True
# Per CTA. 8 warps x 2 stages: 0.96-1.00x the time of 4 x 2 at Qwen3-8B 32k-128k batch 1 / 8 in one H100 run
# (3 x 4 and 4 x 4 slower: 1.02-1.16x; results/probe_decode_fixed_cost_cuda_configs_*), and half the partials.
# Module attributes, so that benchmarks can time others (probe_decode_fixed_cost.py --cuda-configs).
WARPS, STAGES = 8, 2
MIN_ROWS_PER_SPLIT = 256
# ...unless that leaves SMs without a CTA: then as many CTAs as SMs (not more), down to MIN_ROWS_TO_FILL rows per warp
# (one 32-token block). Why: with few CTA columns (GLM-4.7 at TP8 / TP4: 1 / 2 KV heads in head groups of 8, 2 / 4
# columns at batch 1) the 256-row floor gave 16 splits at 32k, 32 / 64 CTAs on 132 SMs; an H200 sweep
# (results/probe_split_count_glm-4.7-*_c53b907_*) had 64 splits 0.80x / 0.84x the time at 32k / 64k (TP8); Qwen3-8B at
# 8k batch 1 16 splits 0.76x the time of the old 4. Not past one CTA per SM: Qwen3-8B at 32k batch 1, 17 splits (136
# CTAs: 4 SMs run two, at half rate) took 1.23x the time of 16 (results/probe_split_count_floor_qwen3-8b_2cb7139_*).
MIN_ROWS_TO_FILL = 32
# The BF16 sink and ring rows in the kernel's own CTAs (16 positions per warp; partials in the Triton window
# programs' layout) instead of the Triton window programs launched after it. A module attribute, so that
# benchmarks time both in one run (probe_decode_fixed_cost.py --cuda-windows).
FUSED_WINDOW = True
WINDOW_ROWS_PER_WARP = 16  # a multiple of 16 (the warp reads them one 16-row tile at a time)
WINDOW_LAST = True  # the window CTAs after the history CTAs in the grid (else before)
# The window folded into the history CTAs where a launch has at least one history split per window tile (fold_tiles:
# 20 for S 64, W 256): warp 0 of split i reads window tile i before its history range, and no window CTAs are
# launched (kernels/cuda/int2_history.cu). Why: at batch 1 the window CTAs did not fit the grid's one round beside
# the history CTAs, and those of the second round ended the call (benchmark/NOTES.md). A module attribute, so that
# benchmarks time both in one process (probe_history_trace.py --sources name=+F0).
FOLD_WINDOW = True
# The merge in the kernel (with FUSED_WINDOW): the last CTA of a column to finish merges its partials and writes
# the output, so a decode call is one launch; off, the Triton merge kernel follows (PDL). A column's CTAs count
# themselves done in a per-device int32 counter (COUNTERS of them, zero between calls). Off by default: correct
# (GPU tests), but slower in the same H100 run (results/probe_cuda_fused_merge_254359d_*: batch 1 at 32k / 64k /
# 128k 24.2 / 35.4 / 50.8 us vs 20.6 / 30.9 / 45.7 with the Triton merge): the last CTA's fence, count and
# partial reads run after everything else, where the Triton merge, launched early (PDL), has its prologue done.
FUSED_MERGE = False
COUNTERS = 1 << 16
# The merge reads a query head's partials (history splits + window partials) in one tile of at most this many.
MAX_PARTIALS = 256
LOG2E = 1.4426950408889634
Q_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the kernel's q_dtype codes

# oscar_history_launch's C parameters in order (test_decode checks them against the source's signature)
_i, _p = ctypes.c_int, ctypes.c_void_p
LAUNCH_ARGTYPES = [_i, _i, _i, _i, _i, _i, _i, _i, _i, _i, _p, _i, ctypes.c_float, _p, _p, _p, _p, _p, _i, _p, _i,
                   _p, _p, _i, _i, _i, _p, _p, _i, _i, _i, _p, _p, _p, _p, _p, _i, _i, _i, _i, _p, _i, _p, _i, _i, _p]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_occupancy: dict = {}
_counters: dict = {}  # device index -> int32 [COUNTERS], zeros (each call leaves it zero)


def counters(device) -> torch.Tensor:
    """The merge's per-column counters on `device`, allocated on first use: with FUSED_MERGE, library() does it for
    the current device when it loads, i.e. at server start (startup_checks) or on the first decode call, before any
    capture; otherwise the first launch with the merge in the kernel does."""
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _counters:
        _counters[idx] = torch.zeros(COUNTERS, dtype=torch.int32, device=f"cuda:{idx}")
    return _counters[idx]


class CudaHistoryUnavailable(RuntimeError):
    pass


def fuses_window(head_dim: int) -> bool:
    """Whether this kernel reads the BF16 sink / ring rows itself at head_dim (FUSED_WINDOW, WINDOW_HEAD_DIMS); else
    oscar_decode runs the Triton window programs after it."""
    return FUSED_WINDOW and head_dim in WINDOW_HEAD_DIMS


def check_supported(head_dim: int, group: int, k_group: int, v_group: int, codebook: bool, device,
                    window_dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ValueError / CudaHistoryUnavailable saying why history_kernel="cuda" cannot run this call."""
    groups = GROUPS.get(head_dim, ())
    if k_group not in groups or v_group not in groups or not 1 <= group <= MAX_GQA or codebook:
        covers = "; ".join(f"head_dim {d} with K/V groups {' or '.join(map(str, g))}" for d, g in GROUPS.items())
        raise ValueError(
            f"history_kernel='cuda' covers {covers}, GQA 1-{MAX_GQA}, uniform levels; this call has head_dim "
            f"{head_dim}, GQA {group}, groups {k_group}/{v_group}{', a codebook' if codebook else ''}: use "
            f"history_kernel='triton'")
    if head_dim == 64 and STAGES not in D64_STAGES:
        raise ValueError(f"history_kernel='cuda' builds head_dim 64 at {D64_STAGES} stages, history_cuda.STAGES is "
                         f"{STAGES}")
    if fuses_window(head_dim) and window_dtype != torch.bfloat16:
        raise ValueError(f"history_kernel='cuda' reads the sink and ring rows as BF16 in its window CTAs; this cache "
                         f"keeps them as {window_dtype}: keep the window in bfloat16 or use history_kernel='triton'")
    if torch.device(device).type != "cuda":
        raise ValueError("history_kernel='cuda' needs CUDA tensors")
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        raise CudaHistoryUnavailable("history_kernel='cuda' needs sm_80 or newer (mma.sync, cp.async)")


def _nvcc() -> str:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    raise CudaHistoryUnavailable("history_kernel='cuda' builds its kernel with nvcc, which was not found on PATH, "
                                 "in $CUDA_HOME/bin or /usr/local/cuda/bin: install the CUDA toolkit or use "
                                 "history_kernel='triton'")


def build(defines: tuple = (), source: Optional[str] = None) -> str:
    """Path of the compiled library of `source` (default SOURCE; kernels/write_cuda.py builds the CUDA write with it)
    with these preprocessor macros (none: the shipped kernel), built with nvcc on first use and cached on disk by
    (source text, macros, GPU arch, nvcc), named after the source file. Variants
    (OSCAR_HISTORY_TRACE, or an older source for a same-run A/B: benchmark/probe_history_trace.py) get their own
    file."""
    source = source or SOURCE
    nvcc = _nvcc()
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    src = open(source, "rb").read()
    flags = [f"-D{d}" for d in defines]
    key = hashlib.sha256(src + arch.encode() + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    cache = os.environ.get("SGLANG_OSCAR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sglang_oscar"))
    os.makedirs(cache, exist_ok=True)
    stem = os.path.splitext(os.path.basename(source))[0]  # int2_history, int2_write (write_cuda.py), a variant's name
    so = os.path.join(cache, f"{stem}_{key}.so")
    if not os.path.exists(so):
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = [nvcc, "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared", "-Xcompiler", "-fPIC",
               *flags, "-o", tmp, source]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise CudaHistoryUnavailable(f"nvcc failed to build {source}:\n{res.stderr[-2000:]}")
        os.replace(tmp, so)  # atomic: concurrent builders (TP ranks) each write their own tmp file
    return so


def env_defines() -> tuple:
    """The kernel macros of $SGLANG_OSCAR_HISTORY_DEFINES (module docstring), checked for the NAME=VALUE form; a
    non-empty set is logged as a warning, since it builds a kernel other than the shipped one."""
    defines = tuple(os.environ.get("SGLANG_OSCAR_HISTORY_DEFINES", "").split())
    for d in defines:
        if not re.fullmatch(r"OSCAR_[A-Z0-9_]+=[0-9]+", d):
            raise ValueError(f"SGLANG_OSCAR_HISTORY_DEFINES: {d!r} is not OSCAR_<NAME>=<integer> (e.g. "
                             f"OSCAR_IMMA_K=0)")
    if defines:
        logging.getLogger(__name__).warning(
            "SGLANG_OSCAR_HISTORY_DEFINES=%s: the CUDA history kernel is built with these experiment macros, not as "
            "shipped (unset it for the shipped kernel)", " ".join(defines))
    return defines


# oscar_history_abi() of the sources this module launches (int2_history.cu): 3 since the entry points take `wide`
# (64-token stages at D 64), 2 since head_dim
ABI = 3


def load(path: str) -> ctypes.CDLL:
    """The library at `path` (build()) with its entry points typed; refused unless its C interface is this module's
    (ABI): an older source's launch takes other arguments, so a same-run A/B against one (probe_history_trace.py
    --sources) would pass them shifted."""
    lib = ctypes.CDLL(path)
    abi = lib.oscar_history_abi() if hasattr(lib, "oscar_history_abi") else 1
    if abi != ABI:
        raise CudaHistoryUnavailable(f"{path} has the history kernel's C interface {abi}, this module launches {ABI} "
                                     f"(head_dim in the entry points since 4dda357, wide since ABI 3): build a source "
                                     f"of the same interface, or give the older source its own launcher")
    lib.oscar_history_launch.argtypes = LAUNCH_ARGTYPES
    lib.oscar_history_launch.restype = ctypes.c_int
    for f in (lib.oscar_history_prepare, lib.oscar_history_occupancy):
        f.argtypes, f.restype = [ctypes.c_int] * 5, ctypes.c_int
    return lib


def use_library(lib: Optional[ctypes.CDLL]) -> None:
    """Launch from `lib` (a load()ed variant) from now on, or from the shipped build again with None; the
    per-configuration shared-memory limits are set again for it. For benchmarks of kernel variants."""
    global _lib
    with _lock:
        _lib = lib
        _occupancy.clear()


def library() -> ctypes.CDLL:
    """The compiled kernel library (built on first use, then cached on disk and in the process)."""
    global _lib
    if _lib is not None:  # every decode call comes here: no lock, no device query once loaded
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        _lib = load(build(env_defines()))
    for heads in (4, 8):  # first load: the default configurations' shared-memory limits, before any graph capture
        for head_dim in HEAD_DIMS:
            if head_dim != 64 or STAGES in D64_STAGES:
                for wide in (False, True) if wide_built(head_dim, heads, STAGES) else (False,):
                    occupancy(heads=heads, head_dim=head_dim, wide=wide)
    if FUSED_MERGE:
        counters(torch.cuda.current_device())
    return _lib


def occupancy(stages: Optional[int] = None, warps: Optional[int] = None, heads: int = 4, head_dim: int = 128,
              wide: bool = False) -> int:
    """Resident CTAs per SM of the kernel at (stages, warps) (default STAGES, WARPS), `heads` query heads per CTA
    column (cta_heads), head_dim and, at D 64, 32- or 64-token stages (wide, block_tokens) on the current device; the
    first call per configuration and device also raises its dynamic shared-memory limit. (D 64 compiles to ~80
    registers at either stage width: 3 CTAs of 8 warps per SM, D 128 to 128: 2.)"""
    lib = _lib if _lib is not None else library()
    stages, warps = stages or STAGES, warps or WARPS
    if (stages not in (2, 3, 4) or warps not in (1, 2, 4, 8) or heads not in (4, 8) or head_dim not in HEAD_DIMS
            or (head_dim == 64 and stages not in D64_STAGES)
            or (wide and not wide_built(head_dim, heads, stages))):
        raise ValueError(f"history_kernel='cuda' builds stages 2-4 (head_dim 64: {D64_STAGES}), 1/2/4/8 warps per "
                         f"CTA, 4 or 8 heads per CTA column, head_dim {HEAD_DIMS} and 64-token stages at head_dim 64 "
                         f"with 4 heads per column and {D64_WIDE_STAGES} stages only, got {stages}/{warps}/{heads}/"
                         f"{head_dim}{' wide' if wide else ''}")
    key = (torch.cuda.current_device(), stages, warps, heads, head_dim, bool(wide))
    if key not in _occupancy:
        rc = lib.oscar_history_prepare(stages, warps, heads, head_dim, int(wide))
        if rc:
            raise CudaHistoryUnavailable(f"cudaFuncSetAttribute for the history kernel failed (cuda error {rc})")
        _occupancy[key] = lib.oscar_history_occupancy(stages, warps, heads, head_dim, int(wide))
    return _occupancy[key]


def wide_built(head_dim: int, heads: int, stages: int) -> bool:
    """Whether int2_history.cu builds the 64-token (WIDE) instance at head_dim, `heads` query heads per CTA column and
    this stage count: D 64, 4 heads, D64_WIDE_STAGES (elsewhere it would hold 2 CTAs per SM instead of 3)."""
    return head_dim == 64 and heads == 4 and stages in D64_WIDE_STAGES


def block_tokens(head_dim: int, heads: int, pdl: int, batch: int) -> int:
    """Tokens per pipeline stage of a warp for a launch of `batch` requests at head_dim, `heads` query heads per CTA
    column (cta_heads) and this pdl mode: 64 at D 64 with 4 heads per column (GQA <= 4: SmolLM2's 3) at STAGES in
    D64_WIDE_STAGES, unless the launch follows this step's KV write at a batch below D64_WIDE_AFTER_WRITE (above),
    else 32. (8 heads per column: the 64-token build took 82-84 registers; 4 stages: 96 KB of stages per CTA; either
    way 2 CTAs per SM instead of 3, and not built.)"""
    wide = D64_WIDE_BLOCKS and wide_built(head_dim, heads, STAGES)
    after_write = pdl in (PDL_AFTER_WRITE, PDL_AFTER_WRITE_Q)
    return 64 if wide and (not after_write or 0 < D64_WIDE_AFTER_WRITE <= batch) else 32


def cta_heads(gqa: int) -> int:
    """Query heads per CTA column: 4 up to GQA 4, 8 above with WIDE_TILE (else head groups of 4)."""
    return 8 if gqa > 4 and WIDE_TILE else 4


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


def folds(num_splits: int, sink: int, window: int) -> bool:
    """Whether a launch of num_splits history splits folds the window into them (FOLD_WINDOW, FUSED_WINDOW, and a
    split per window tile, so that a CTA reads at most one)."""
    return FOLD_WINDOW and FUSED_WINDOW and num_splits >= fold_tiles(sink, window) > 0


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


# chained_num_splits for req_to_token widths (the longest context a call can have; in a server its context length)
# in [CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT]: the same-call A/B (H100, batch 1,
# results/ab_layer_chained_splits_c44e8cf_vs_440e27a_*) measured it 0.91-0.95x at 32k and 64k for Qwen3-8B and 32B
# but 1.01-1.05x at 96k and 128k, where the history is long enough that its share of fewer CTAs costs more than the
# late start of the last ones (at 48k the split sweep's neighbours, 26 and 28, were 1.02-1.03x the one-round count).
# Below 32k it was not measured, and there the one-round count is capped by MIN_ROWS_PER_SPLIT, so it stays.
CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT = 1 << 15, 1 << 16
# ...but a chained count of more than one CTA per SM that leaves fewer than CHAINED_MIN_ROWS rows per warp falls back to
# one CTA per SM (SMs // columns): with few CTA columns the round's second CTA per SM streams only 1-3 blocks of 32
# tokens per warp for its own fixed cost (index chain, q build, CTA merge). H200 sweeps of the chain at batch 1
# (results/probe_split_count_chain_*_90633ff_*): GLM-4.7 TP8 (2 columns) 66 splits 0.91-0.94x the time of the round's
# 130 at 32k / 48k / 64k (31-63 rows per warp at 130); TP4 (4 columns) 33 splits 0.98x at 32k (64 rows at 64), even at
# 64k (128 rows); Qwen3-8B (8 columns) keeps the round's 30 (136 / 273 rows at 32k / 64k), where one per SM (16) took
# 1.14x / 1.32x the time.
CHAINED_MIN_ROWS = 96


def chained_num_splits(kv_heads: int, gqa: int, num_sms: int, write_programs: int, window_partials: int = 8,
                       max_context: Optional[int] = None, head_dim: int = 128) -> int:
    """History splits per CTA column for one request chained to its KV write (oscar_decode follows_write, batch 1):
    the slots of one round that the write's programs and this grid's window CTAs leave. Why: launched as the write's
    programmatic dependent, the history CTAs start beside the write's programs, and an SM holding one of those has no
    registers left for a second history CTA (two take all 64K), so with the one-round count (default_num_splits)
    the last-dispatched CTAs start only when the write ends (~6 us later) and end the call that much later. Measured
    at batch 1 only (H100, Qwen3-8B / 32B layers, benchmark/NOTES.md "The chained layer's timeline"): at batch 2-4
    the one-round count stayed the fastest, and outside [CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT] too. With
    max_context (req_to_token's width), a count above one CTA per SM that leaves < CHAINED_MIN_ROWS rows per warp
    becomes one CTA per SM (GLM-4.x's few head-group columns; see the constant)."""
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
    """(history splits, fold) of a call where num_splits is None: with FOLD_WINDOW the count of a grid without
    window CTAs (split_count with no window partials), and the window folded where that count has a split per
    window tile (folds); else split_count with the window CTAs' partials, or, where this kernel does not read the
    window (fuses_window: D 64), with the partials of the Triton window programs that follow it."""
    if not fuses_window(head_dim):
        from .decode import RING_ROWS_PER_SPLIT, SINK_ROWS_PER_SPLIT

        partials = max(1, -(-sink // SINK_ROWS_PER_SPLIT)) + -(-window // RING_ROWS_PER_SPLIT)
        return split_count(batch, kv_heads, gqa, max_context, num_sms, partials, chained_write_programs,
                           head_dim), False
    if FOLD_WINDOW:
        n = split_count(batch, kv_heads, gqa, max_context, num_sms, 0, chained_write_programs, head_dim)
        if folds(n, sink, window):
            return n, True
    return split_count(batch, kv_heads, gqa, max_context, num_sms, sum(window_ctas(sink, window)),
                       chained_write_programs, head_dim), False


def split_count(batch: int, kv_heads: int, gqa: int, max_context: int, num_sms: int, window_partials: int,
                chained_write_programs: Optional[int] = None, head_dim: int = 128) -> int:
    """The history split count oscar_decode uses where num_splits is None: chained_num_splits for one request chained
    to its KV write (chained_write_programs: that write's program count, write.write_grid or write_cuda.grid) at a
    req_to_token width (max_context) in [CHAINED_MIN_CONTEXT, CHAINED_MAX_CONTEXT], else default_num_splits; at batch
    1 at most one round less one slot per column, so that each column's first window CTA (its sink CTA, whose index
    chain is the longest) starts in the first round instead of after the first history CTAs end. Measured on H100,
    Qwen3-8B batch 1, 32 splits against the one-round 33 (results/probe_split_count_8d6a747_32v33_*, 3 rounds): 128k
    0.96x alone and 0.95x chained to the write, 96k 0.97x / 1.00x; up to 64k the rows cap is already <= 32.
    window_partials 0: a grid without window CTAs (the window folded, plan), so no slot is kept for them."""
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
# launch(pdl=...): the kernel's Args.pdl (kernels/cuda/int2_history.cu kPdl*). PDL_WAIT_FIRST: a programmatic
# dependent of any kernel (every CTA waits for it first). PDL_AFTER_WRITE: a programmatic dependent of this decode
# step's KV write (oscar_write_kv(pdl_trigger=True)), with q and the indices written before that write: the history
# CTAs run while the write does, the window CTAs (which read the new row) wait for it. PDL_AFTER_WRITE_Q: the same
# with q rotated by that write (oscar_write_kv q_out): the history CTAs issue their first copies, then wait for it.
PDL_OFF, PDL_WAIT_FIRST, PDL_AFTER_WRITE, PDL_AFTER_WRITE_Q = 0, 1, 2, 3


def launch(q, cache, req_to_token, req_pool_indices, seq_lens, ring_start, *, sink, window, sm_scale, ns, ns_total,
           o_part, lse_part, pdl: int = PDL_OFF, window_splits: tuple = (0, 0), sink_k=None, sink_v=None,
           out=None, fold: bool = False) -> None:
    """Write the history partials [0, ns) of o_part / lse_part (oscar_decode's layout) for q [B, Hq, D], and
    with window_splits = (SS, RS) != (0, 0) (window_ctas) the sink partials [ns, ns + SS) and the ring partials
    [ns + SS, ns + SS + RS) as well (sink_k / sink_v: the cache's sink rows, or a one-row stand-in where it has
    none). fold (folds; window_splits (0, 0)): the history CTAs read the window themselves (no window partials).
    With out (a contiguous [B, Hq, 128] tensor of q's dtype; needs the window partials or fold) the kernel also
    merges them into out (FUSED_MERGE) and nothing needs to follow. oscar_decode, the caller, has checked the index
    dtypes and check_supported the shape; this checks only what the kernel adds (the split range, contiguous 1-D
    inputs, the merge's counters).

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
    if head_dim not in WINDOW_HEAD_DIMS and (window_splits != (0, 0) or fold or out is not None):
        raise ValueError(f"history_kernel='cuda' reads the window (and merges) in its own grid at head_dim "
                         f"{WINDOW_HEAD_DIMS} only; at {head_dim} launch it with window_splits (0, 0), no fold and no "
                         f"out, and the Triton window programs after it (oscar_decode does)")
    lib = library()
    b, hq = q.shape[0], q.shape[1]
    hkv = cache.kv_heads
    heads = cta_heads(hq // hkv)
    wide = block_tokens(head_dim, heads, pdl, b) == 64
    # a dict hit; prepares the configuration where experiments changed STAGES / WARPS. The split count (plan) came
    # from the 32-token instance's occupancy: a grid sized for more CTAs per SM than the wide one holds would run a
    # second round
    n = occupancy(heads=heads, head_dim=head_dim, wide=wide)
    if wide and n < occupancy(heads=heads, head_dim=head_dim):
        raise CudaHistoryUnavailable(f"the 64-token D-64 history kernel holds {n} CTAs per SM, fewer than the split "
                                     f"count assumes: set history_cuda.D64_WIDE_BLOCKS = False")
    ss, rs = window_splits
    if WINDOW_ROWS_PER_WARP < 16 or WINDOW_ROWS_PER_WARP % 16:
        raise ValueError(f"history_cuda.WINDOW_ROWS_PER_WARP must be a positive multiple of 16, got "
                         f"{WINDOW_ROWS_PER_WARP}")
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
    merge = (None, 0, None, 0)
    if out is not None:
        if not (ss or rs or fold):
            raise ValueError("history_kernel='cuda' merges in the kernel only with the window in its grid "
                             "(window_splits or fold)")
        if out.dtype != q.dtype or out.shape != q.shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
        cols = cta_columns(q.shape[0] * cache.kv_heads, q.shape[1] // cache.kv_heads)
        cnt = counters(q.device)
        if cols > cnt.numel():
            raise ValueError(f"history_kernel='cuda' merges at most {cnt.numel()} (request, KV head) columns in the "
                             f"kernel, this call has {cols}: raise history_cuda.COUNTERS")
        merge = (out.data_ptr(), Q_DTYPES[out.dtype], cnt.data_ptr(), 1)
    if not (req_pool_indices.is_contiguous() and seq_lens.is_contiguous() and q.is_contiguous()):
        raise ValueError("history_kernel='cuda' needs contiguous q, req_pool_indices and seq_lens")
    if q.data_ptr() % 16:  # its warps read q's rows in 16-byte loads
        raise ValueError("history_kernel='cuda' reads q in 16-byte loads: q must start 16-byte aligned (a tensor at "
                         "its own storage's start, e.g. q.clone(), is)")
    page = cache.page
    # q [B, Hq, D] contiguous; each warp builds its operands from it (no extra launches)
    rc = lib.oscar_history_launch(
        STAGES, WARPS, heads, head_dim, int(wide), b * hkv, hq // hkv, int(cache.k_group == head_dim),
        int(cache.v_group == head_dim), ns, q.data_ptr(),
        Q_DTYPES[q.dtype], float(sm_scale) * LOG2E,
        cache.k_codes.data_ptr(), cache.v_codes.data_ptr(), cache.k_params.data_ptr(), cache.v_params.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), req_pool_indices.data_ptr(),
        _INDEX_DTYPES[req_pool_indices.dtype], seq_lens.data_ptr(), ring_start.data_ptr(), hkv, sink, window,
        o_part.data_ptr(), lse_part.data_ptr(), ns_total, int(math.log2(page)), int(pdl), *win, ss, rs,
        WINDOW_ROWS_PER_WARP // 16, int(WINDOW_LAST), *merge, fold_tiles(sink, window) if fold else 0,
        torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"history_kernel='cuda' launch failed (cuda error {rc})")
