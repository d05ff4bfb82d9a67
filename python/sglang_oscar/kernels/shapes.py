"""Which shapes each kernel path serves, defined once.

The kernels check their calls against these rules, and the server asks them at startup (srt/startup_checks.py) to
refuse a model no path serves and to pick the fastest path that serves it. No triton import: the server's main
process reads this module before any kernel is loaded.

* Triton (write, gather, decode): head_dim in SUPPORTED_HEAD_DIMS, K and V groups in SUPPORTED_GROUPS (<= head_dim),
  1..MAX_GQA query heads per KV head, any window dtype and page size.
* CUDA history stage (history_cuda.py): head_dim and groups in CUDA_HISTORY_GROUPS, 1..MAX_GQA query heads per KV head
  (above 8 as head groups of 8); at CUDA_WINDOW_HEAD_DIMS it also reads the window, which must then be
  bfloat16. It reaches its read rate on pages of CUDA_HISTORY_PAGE slots (each KV head's rows contiguous per page).
* CUDA decode write (write_cuda.py): head_dim CUDA_WRITE_HEAD_DIM, groups in SUPPORTED_GROUPS, bf16 / fp16 k and v, a
  bfloat16 window, up to CUDA_WRITE_MAX_TOKENS tokens per call (decode batches).
"""

from __future__ import annotations

from typing import Optional

from ..config import MAX_GQA, SUPPORTED_GROUPS, SUPPORTED_HEAD_DIMS, default_group

__all__ = ["CUDA_HISTORY_GROUPS", "CUDA_HISTORY_PAGE", "CUDA_WINDOW_HEAD_DIMS", "CUDA_WRITE_HEAD_DIM",
           "CUDA_WRITE_MAX_TOKENS", "MAX_GQA", "PDL_SM_MAJOR", "RING_ROWS_PER_SPLIT", "SINK_ROWS_PER_SPLIT",
           "SUPPORTED_GROUPS", "SUPPORTED_HEAD_DIMS", "cuda_history_refusal", "cuda_write_refusal", "default_group",
           "has_pdl", "window_programs"]

# head_dim -> the K and V group sizes the CUDA history stage covers (each side either: a row of two groups or one)
CUDA_HISTORY_GROUPS = {128: (64, 128), 64: (32, 64)}
# head dims at which the CUDA history stage reads the BF16 sink and ring rows itself; at the others the Triton window
# programs of decode.py follow it
CUDA_WINDOW_HEAD_DIMS = (128,)
# the page size the CUDA history stage is served with: a request's rows of one KV head then come in contiguous runs
# of 64, which its copies need to reach the read rate (correct at any page size)
CUDA_HISTORY_PAGE = 64
CUDA_WRITE_HEAD_DIM = 128
# decode writes of up to this many tokens run the CUDA write where it covers the shape (the Triton write's one-token
# programs take over above; measured with the write chained to the history stage, which stops at batch 8)
CUDA_WRITE_MAX_TOKENS = 8

# programmatic dependent launch (griddepcontrol), which chains the decode write, the history stage and the merge:
# sm_90 or newer
PDL_SM_MAJOR = 9

# The Triton window programs of a decode call (per request and KV head): the sink range in chunks of
# SINK_ROWS_PER_SPLIT positions (each sink row is a chain of three dependent loads, so one program walking 64 rows
# was the longest at small batch), the recent window in chunks of RING_ROWS_PER_SPLIT.
SINK_ROWS_PER_SPLIT = 16
RING_ROWS_PER_SPLIT = 64


def window_programs(sink: int, window: int) -> tuple:
    """(sink programs, ring programs) of the Triton window: at least one sink program, so that the merge's range of
    sink partials is never empty."""
    return max(1, -(-sink // SINK_ROWS_PER_SPLIT)), -(-window // RING_ROWS_PER_SPLIT)


def has_pdl(device) -> bool:
    """`device` launches kernels as programmatic dependents (a CUDA device of sm_90 or newer: PDL_SM_MAJOR)."""
    import torch  # only here: the shape rules above need no torch

    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= PDL_SM_MAJOR


def cuda_history_refusal(head_dim: int, gqa: int, k_group: int, v_group: int, window_dtype=None) -> Optional[str]:
    """Why the CUDA history stage cannot serve this attention shape (None: it can). window_dtype: a torch dtype, or
    None for bfloat16."""
    groups = CUDA_HISTORY_GROUPS.get(head_dim, ())
    if k_group not in groups or v_group not in groups or not 1 <= gqa <= MAX_GQA:
        covers = "; ".join(f"head_dim {d} with K/V groups {' or '.join(map(str, g))}"
                           for d, g in CUDA_HISTORY_GROUPS.items())
        return (f"the CUDA history stage covers {covers}, GQA 1-{MAX_GQA}; this is head_dim {head_dim}, "
                f"GQA {gqa}, groups {k_group}/{v_group}")
    if head_dim in CUDA_WINDOW_HEAD_DIMS and window_dtype is not None and str(window_dtype) != "torch.bfloat16":
        return (f"the CUDA history stage reads the sink and ring rows as bfloat16 at head_dim {head_dim}; this "
                f"window is {window_dtype}")
    return None


def cuda_write_refusal(head_dim: int, k_group: int, v_group: int, x_dtype, window_dtype) -> Optional[str]:
    """Why the CUDA decode write cannot write this cache (None: it can); x_dtype / window_dtype are torch dtypes."""
    if head_dim != CUDA_WRITE_HEAD_DIM or k_group not in SUPPORTED_GROUPS or v_group not in SUPPORTED_GROUPS:
        return (f"the CUDA write covers head_dim {CUDA_WRITE_HEAD_DIM} with K / V groups of {SUPPORTED_GROUPS}; this "
                f"cache has head_dim {head_dim}, groups {k_group}/{v_group}")
    if str(x_dtype) not in ("torch.bfloat16", "torch.float16"):
        return f"the CUDA write takes bf16 or fp16 k / v, got {x_dtype}"
    if str(window_dtype) != "torch.bfloat16":
        return f"the CUDA write stores bfloat16 sink / ring rows; this cache keeps them as {window_dtype}"
    return None
