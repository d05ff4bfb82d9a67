"""A CPU stand-in for `sgl_kernel`, for running the real SGLang 0.5.17 server on a CPU-only test box.

Why: with SGLANG_USE_CPU_ENGINE=1, several SGLang modules do `if _is_cpu: from sgl_kernel import X`
at import time, and the installed sgl_kernel is the CUDA build (it cannot load without libcuda).
Put this directory FIRST on PYTHONPATH only in the environment of a test server; never install it
(it would shadow the real package on a GPU machine).

Exactly the 7 names 0.5.17 imports at startup for a dense model (shared/reference/sglang-on-cpu.md
section R.3). Two have real pure-torch implementations because plain (non-speculative) runs can reach
them through generic pool code; the speculative-decoding ones raise NotImplementedError when called,
so a test that wanders into spec decoding fails loudly instead of computing garbage. Any other name
raises AttributeError, so an SGLang upgrade that needs a new symbol fails at import, not later.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+cpu-test-shim"


def _rows_view(address: int, num_rows: int, row_bytes: int) -> torch.Tensor:
    """A uint8 [num_rows, row_bytes] tensor aliasing host memory at `address` (no copy)."""
    buf = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every buffer b: row[tgt_loc[i]] = row[src_loc[i]] (rows of strides[b] bytes at data_ptrs[b]).

    Gathers all source rows before scattering, so overlapping src/tgt sets (moves, swaps) behave
    like the GPU kernel's "safe for in-place" contract.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).cpu()
    tgt = tgt_loc.to(torch.int64).cpu()
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _rows_view(int(ptr), num_rows, int(stride))
        rows[tgt] = rows[src].clone()


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end[i]-start[i]) entries of
    out_cache_loc, consumed in batch order (the contract of SGLang's Triton assign kernel)."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token row length {req_to_token.shape[1]}")
    off = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        if n > 0:
            req_to_token[int(row), int(s):int(e)] = out_cache_loc[off:off + n].to(req_to_token.dtype)
            off += n


def _unsupported(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU test shim "
                                  "(speculative decoding is not supported in CPU tests)")

    fn.__name__ = name
    return fn


assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")

__all__ = ["copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
           "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "fill_bonus_tokens_cpu",
           "fill_accept_out_cache_loc_cpu"]
