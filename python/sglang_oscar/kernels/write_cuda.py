"""The decode-sized KV write in CUDA (kernels/cuda/int2_write.cu): checks, build, launch.

oscar_write_kv(..., kernel="cuda") runs this kernel instead of the Triton one, for the same cache format (float8 e4m3
(scale, min); INT4 keys on the layer's k4_heads, a template parameter of the kernel whether it has any): a CTA per
token, KV head and side, and with q one per token, KV head and 4 of its query heads (grid below); the same results (the
oracle
quant/cache_ops.py:write_reference; test/test_write.py compares both kernels with it on the GPU), the same PDL
trigger for the decode's history kernel (pdl_trigger). Why: a decode write is one program's dependent chain, and the
Triton one-token program's was ~4.6 us on H200 for any number of KV heads (benchmark/NOTES.md).

It covers kernels/shapes.py's rule (cuda_write_refusal: head_dim 128, groups of 32, 64 or 128 per side, bf16 or fp16
k / v, and q of the same dtype, BF16 sink and ring rows), the fp32 transforms of oscar_write_kv, a q_transform of q's
dtype or fp32. Anything else raises with the reason; nothing falls back. It reads the head's D x D fp32 transform
once per (token, head, side), so it is meant for decode batches (the server uses it up to
shapes.CUDA_WRITE_MAX_TOKENS tokens); prefill stays on the Triton kernel's dot tiles.

Build: kernels/cuda_build.py (nvcc once per source, GPU arch and nvcc, cached on disk; ctypes, no extension).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from typing import Optional

import torch

from . import cuda_build
from .cuda_build import CudaUnavailable
from .shapes import cuda_write_refusal

logger = logging.getLogger(__name__)
_SCALAR_NOTED = set()  # the row layouts already logged as read with scalar loads

SOURCE = os.path.join(cuda_build.CUDA_DIR, "int2_write.cu")
Q_HEADS_PER_CTA = 4  # query heads per q program (int2_write.cu kQHeads)
X_DTYPES = {torch.bfloat16: 0, torch.float16: 1}  # the kernel's x_dtype codes (k, v, q and q_out share it)
# The INT2 decision thresholds (midpoints of the levels 0, 1, 2, 3), the kernel's th0..th2 of each side
INT2_THRESHOLDS = (0.5, 1.5, 2.5)

_i, _p, _l, _f = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float
# oscar_write_launch's C parameters in order (test_write checks them against the source's signature)
LAUNCH_ARGTYPES = ([_i, _i, _i, _i, _p, _p, _p, _i]
                   + [_p, _l, _l, _p, _l, _p, _l, _p, _p, _p, _i, _p, _p, _p, _i, _i, _f, _f, _f]
                   + [_p, _l, _l, _p, _l, _p, _p, _p, _p, _i, _i, _f, _f, _f]
                   + [_p, _l, _l, _p, _l, _i, _p, _i, _i, _p])

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def grid(num_tokens: int, kv_heads: int, gqa: Optional[int] = None) -> tuple:
    """The CUDA write's launch grid: tokens x KV heads x (K, V and, with q of GQA gqa, ceil(gqa / Q_HEADS_PER_CTA) q
    programs). A chained decode counts these programs (oscar_decode write_kernel="cuda")."""
    return (num_tokens, kv_heads, 2 + (-(-gqa // Q_HEADS_PER_CTA) if gqa else 0))


def check_supported(head_dim: int, k_group: int, v_group: int, x_dtype: torch.dtype, window_dtype: torch.dtype,
                    device) -> None:
    """Raise ValueError / CudaUnavailable saying why kernel="cuda" cannot write this call."""
    why = cuda_write_refusal(head_dim, k_group, v_group, x_dtype, window_dtype)
    if why:
        raise ValueError(f"{why}: use kernel='triton'")
    if torch.device(device).type != "cuda":
        raise ValueError("kernel='cuda' needs CUDA tensors")
    if torch.cuda.get_device_capability(device)[0] < 8:
        raise CudaUnavailable("the CUDA write needs sm_80 or newer (redux.sync)")


def library() -> ctypes.CDLL:
    """The compiled write library (built with nvcc on first use, cached on disk and in the process)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(cuda_build.build(SOURCE))
            lib.oscar_write_launch.argtypes = LAUNCH_ARGTYPES
            lib.oscar_write_launch.restype = ctypes.c_int
            lib.oscar_write_prepare.restype = ctypes.c_int
            rc = lib.oscar_write_prepare()  # the shared-memory carveout (int2_write.cu oscar_write_prepare)
            if rc:
                raise CudaUnavailable(f"cudaFuncSetAttribute for the CUDA write failed (cuda error {rc})")
            _lib = lib
    return _lib


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _rows_vec(x: torch.Tensor) -> bool:
    """16-byte loads of 8 elements: the rows start 16-byte aligned and every stride but the last is a multiple of 8."""
    return x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in x.stride()[:-1])


def launch(k, v, slots, sink_dst, ring_dst, pool, *, kmat, s_kmh, kmean, s_kmeanh, vmat, s_vmh, k_clip_n, v_clip_n,
           pdl_trigger: bool, q=None, q_transform=None, s_tqh: int = 0, q_out=None) -> None:
    """Launch the write of oscar_write_kv(kernel="cuda"), which has checked the shapes, dtypes and devices of the
    pool, k / v, the indices, the transforms (fp32, contiguous; vmat None: V in its basis) and q / q_out / q_transform
    (write._check_q: [D, D] or [Hkv, D, D] with head stride s_tqh, fp32 or q's dtype). This checks what the kernel
    adds: check_supported, q's dtype, 16-byte alignment of the transforms and the mean (their vector loads)."""
    check_supported(pool.head_dim, pool.k_group, pool.v_group, k.dtype, pool.sink_k.dtype, k.device)
    if v.dtype != k.dtype:
        raise ValueError(f"the CUDA write takes k and v of one dtype, got {k.dtype} and {v.dtype}")
    mats = [m for m in (kmat, vmat, kmean) if m is not None]
    if not _aligned(*mats):
        raise ValueError("the CUDA write reads the transforms and the mean in 16-byte loads: pass tensors that start "
                         "16-byte aligned (e.g. .clone())")
    h, n = pool.kv_heads, k.shape[0]
    tq, gqa, tq_fp32 = None, 0, 0
    if q is not None:
        if q.dtype != k.dtype:
            raise ValueError(f"the CUDA write rotates q of k's dtype {k.dtype}, got {q.dtype}: use kernel='triton'")
        tq = q_transform.contiguous()
        tq_fp32 = int(tq.dtype == torch.float32)
        if not _aligned(tq):
            raise ValueError("the CUDA write reads q_transform in vector loads: pass one that starts 16-byte aligned")
        gqa = q.shape[1] // h
    vec = int(_rows_vec(k) and _rows_vec(v) and (q is None or _rows_vec(q)))
    if not vec:  # correct, but slower: say so once per layout instead of falling back silently
        layout = tuple((t.data_ptr() % 16, t.stride()) for t in (k, v, q) if t is not None)
        if layout not in _SCALAR_NOTED:
            _SCALAR_NOTED.add(layout)
            logger.warning("sglang_oscar: the CUDA KV write reads k / v / q rows with scalar loads: a row does not "
                           "start 16-byte aligned or a stride is not a multiple of 8 elements (strides %s)",
                           [t.stride() for t in (k, v, q) if t is not None])
    slots, sink_dst, ring_dst = slots.contiguous(), sink_dst.contiguous(), ring_dst.contiguous()
    th0, th1, th2 = INT2_THRESHOLDS

    def ptr(t):
        return None if t is None else t.data_ptr()

    rc = library().oscar_write_launch(
        n, h, X_DTYPES[k.dtype], int(math.log2(pool.page)), slots.data_ptr(), sink_dst.data_ptr(),
        ring_dst.data_ptr(), vec,
        k.data_ptr(), k.stride(0), k.stride(1), kmat.data_ptr(), s_kmh, ptr(kmean), s_kmeanh,
        pool.k_codes.data_ptr(), ptr(pool.k_hi), ptr(pool.k4_index if pool.has_k4 else None),
        pool.k_hi.shape[1] if pool.has_k4 else 0, pool.k_params.data_ptr(), pool.sink_k.data_ptr(), pool.ring_k.data_ptr(),
        pool.k_group, k_clip_n, th0, th1, th2,
        v.data_ptr(), v.stride(0), v.stride(1), ptr(vmat), s_vmh,
        pool.v_codes.data_ptr(), pool.v_params.data_ptr(), pool.sink_v.data_ptr(), pool.ring_v.data_ptr(),
        pool.v_group, v_clip_n, th0, th1, th2,
        ptr(q), q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0, ptr(tq), s_tqh, tq_fp32,
        ptr(q_out), gqa, int(bool(pdl_trigger)), torch.cuda.current_stream(k.device).cuda_stream)
    if rc:
        raise RuntimeError(f"the CUDA write's launch failed (cuda error {rc})")
