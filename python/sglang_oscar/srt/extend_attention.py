"""Causal attention of an int2 extend batch over BF16 K/V in the ragged layout.

The int2 backend rebuilds each request's cached prefix in BF16 (kernels/gather.py) and appends the
chunk's own rows, so an extend step is ordinary causal attention on ragged tensors:

    q [sum(q_lens), Hq, D]     rows of request i: [q_indptr[i], q_indptr[i+1]), its new tokens
    k, v [sum(kv_lens), Hkv, D] rows of request i: [kv_indptr[i], kv_indptr[i+1]) = prefix + chunk

with kv_lens[i] >= q_lens[i] and the causal mask aligned bottom-right: new token j of request i
(0-based) sees keys [0, kv_lens[i] - q_lens[i] + j].

Two implementations, by device ("auto", what the server runs):
* "flashinfer" (CUDA): FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, the kernel SGLang's own
  FlashInfer backend runs for the new tokens of a prefill (FA3 on Hopper). GQA is native, so nothing
  is repeated or transposed; planned once per forward, run once per layer.
* "sdpa" (CPU): torch SDPA per request, K/V repeated to the query heads. On CUDA it is the reference
  the GPU test compares FlashInfer to (70% of FlashInfer's prefill speed at 32k on an H100).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .options import OscarOptionError

IMPLS = ("auto", "flashinfer", "sdpa")

# FlashInfer's float workspace holds split-KV partial outputs of the prefill plan; 128 MiB is its
# documented default, and plan() raises ("increase the workspace buffer size") if a batch needs more.
WORKSPACE_BYTES = 128 << 20


def _indptr(lens: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if len(lens):
        out[1:] = torch.tensor(list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def check_ragged(q_lens: Sequence[int], kv_lens: Sequence[int]) -> None:
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens has {len(q_lens)} requests, kv_lens {len(kv_lens)}")
    bad = [i for i, (e, n) in enumerate(zip(q_lens, kv_lens)) if e < 0 or n < e]
    if bad:
        i = bad[0]
        raise ValueError(f"request {i}: {q_lens[i]} new tokens but {kv_lens[i]} keys (keys = prefix + new tokens)")


def ragged_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Sequence[int],
                       kv_lens: Sequence[int], scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ragged causal attention with torch SDPA, one request at a time (see the module docstring).

    Batched 4-D inputs and no materialized mask, so CUDA runs a fused kernel: flash (plain causal)
    without a prefix, mem-efficient (lower-right causal bias) with one. On CUDA only those two are
    allowed: the math fallback would build [H, e, prefix + e] scores (128 GiB at 32k on Qwen3-8B),
    better a clear error than an OOM or a silently slow path. CPU runs the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    check_ragged(q_lens, kv_lens)
    hq, h = q.shape[1], k.shape[1]
    if hq % h:
        raise ValueError(f"{hq} query heads is not a multiple of {h} KV heads")
    if out is None:
        out = torch.empty(q.shape[0], hq, v.shape[2], dtype=q.dtype, device=q.device)
    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    qs = ks = 0
    with sdpa_kernel(allowed):
        for e, n in zip(q_lens, kv_lens):
            if e:
                qi = q[qs:qs + e].transpose(0, 1).unsqueeze(0)  # [1, Hq, e, D]
                ki, vi = k[ks:ks + n].transpose(0, 1), v[ks:ks + n].transpose(0, 1)
                if hq != h:
                    ki, vi = ki.repeat_interleave(hq // h, 0), vi.repeat_interleave(hq // h, 0)
                ki, vi = ki.unsqueeze(0), vi.unsqueeze(0)
                if n == e:
                    o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
                else:
                    o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale,
                                                                         attn_mask=causal_lower_right(e, n))
                out[qs:qs + e] = o[0].transpose(0, 1)
            qs, ks = qs + e, ks + n
    return out


class ExtendAttention:
    """plan(q_lens, kv_lens, ...) once per extend forward, run(q, k, v) once per layer."""

    def __init__(self, impl: str, device):
        if impl not in IMPLS:
            raise ValueError(f"extend attention {impl!r}: use one of {IMPLS}")
        device = torch.device(device)
        if impl == "auto":
            impl = "flashinfer" if device.type == "cuda" else "sdpa"
        if impl == "flashinfer" and device.type != "cuda":
            raise ValueError("the flashinfer extend attention needs a CUDA device (CPU uses sdpa)")
        self.impl, self.device = impl, device
        self._wrapper = None
        self._plan_key = None
        self._lens = None
        if impl == "flashinfer":
            try:
                import flashinfer
            except ImportError as e:  # a dependency of sglang; missing means a broken install
                raise OscarOptionError(
                    f"the int2 extend (prefill) attention runs FlashInfer on CUDA, but `import flashinfer` failed "
                    f"({e}); install flashinfer-python (sglang's dependency)") from e
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")

    def plan(self, q_lens: Sequence[int], kv_lens: Sequence[int], q_heads: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, scale: float) -> None:
        q_lens, kv_lens = [int(x) for x in q_lens], [int(x) for x in kv_lens]
        check_ragged(q_lens, kv_lens)
        self._lens = (q_lens, kv_lens)
        self._plan_key = (q_heads, kv_heads, head_dim, dtype, float(scale))
        if self._wrapper is not None:
            self._wrapper.plan(_indptr(q_lens), _indptr(kv_lens), q_heads, kv_heads, head_dim, causal=True,
                               sm_scale=float(scale), q_data_type=dtype, kv_data_type=dtype)

    def needs_plan(self, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, scale: float) -> bool:
        return self._plan_key != (q_heads, kv_heads, head_dim, dtype, float(scale))

    def reset(self) -> None:
        """Forget the plan (a new forward batch)."""
        self._plan_key = self._lens = None

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._lens is None:
            raise RuntimeError("ExtendAttention.run before plan")
        q_lens, kv_lens = self._lens
        if q.shape[0] != sum(q_lens) or k.shape[0] != sum(kv_lens) or v.shape[0] != k.shape[0]:
            raise ValueError(f"planned {sum(q_lens)} query rows and {sum(kv_lens)} key rows, got q {tuple(q.shape)} "
                             f"k {tuple(k.shape)} v {tuple(v.shape)}")
        if self._wrapper is None:
            return ragged_causal_sdpa(q, k, v, q_lens, kv_lens, self._plan_key[4], out=out)
        return self._wrapper.run(q, k, v, out=out)
