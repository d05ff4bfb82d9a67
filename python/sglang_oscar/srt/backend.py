"""oscar_int2 attention backend, phase 2a: eager and correctness-first (no CUDA graphs yet).

Reads the int2 pool exactly as the kernels define it:
* decode: kernels/decode.py:oscar_decode (INT2 history + BF16 sink + BF16 ring, one launch + merge);
* extend: kernels/gather.py rebuilds each request's cached prefix in the transformed basis (before
  the chunk is written, so the prefix's last W positions still come from the ring), the
  chunk's own K/V are transformed in torch (exact, not quantized: a chunk attends to itself at
  full precision, as the seed does), and attention runs per request with torch SDPA. This extend
  path is simple, not fast; the GPU version goes through SGLang's extend kernel (plan section 3).
Writes (INT2 + windows) go through srt/write_plan.py + OscarKVPool.write_layer.

Basis: keys are stored as (k − μ)·T_K and queries become q·T_K (T_K orthogonal, so T_K^{−T} = T_K;
the μ term shifts every score of a query equally, which softmax ignores). V is stored as v·T_V, and
the output is turned back with ·T_Vᵀ here, because V absorption into the weights (hook #9) does
not exist yet: this backend refuses SGLANG_OSCAR_ABSORB_V_ROTATION=1 until it does.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .options import ENV_ABSORB_V, OscarOptionError
from .pool import OscarKVPool
from .write_plan import plan_writes

NAME = "oscar_int2"


def _per_q_head(t: Optional[torch.Tensor], kv_heads: int, q_heads: int) -> Optional[torch.Tensor]:
    """[D, D] or [Hkv, D, D] -> [Hq, D, D] (each query head uses its KV head's matrix)."""
    if t is None:
        return None
    if t.dim() == 2:
        return t.expand(q_heads, *t.shape)
    return t.repeat_interleave(q_heads // kv_heads, dim=0)


class OscarAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarKVPool):
            raise OscarOptionError(f"--attention-backend {NAME} reads only the int2 KV cache; use it with "
                                   f"--kv-cache-dtype int2 (pool is {type(pool).__name__})")
        if pool.setup.cfg.absorb_v_rotation:
            raise OscarOptionError(f"V-rotation absorption is not implemented yet; set {ENV_ABSORB_V}=0 "
                                   "(V is then rotated at write time and un-rotated after attention)")
        self.pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.device = model_runner.device
        self.plan = None
        self.meta = None

    # ---- metadata (host side, once per forward) -----------------------------------------------

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle() or forward_batch.req_pool_indices.numel() == 0:
            self.plan = self.meta = None
            return
        rows = forward_batch.req_pool_indices.tolist()
        if mode.is_decode():
            seq = forward_batch.seq_lens_cpu.tolist()
            prefix, ext = [s - 1 for s in seq], [1] * len(seq)
        elif mode.is_extend() and not mode.is_mixed():
            prefix, ext = list(forward_batch.extend_prefix_lens_cpu), list(forward_batch.extend_seq_lens_cpu)
        else:
            raise NotImplementedError(f"{NAME}: forward mode {mode} is not supported")
        gens = self.req_to_token_pool.req_generation[rows].tolist()
        self.plan = plan_writes(self.pool, self.pool.ring_tracker, rows, prefix, ext, forward_batch.out_cache_loc, gens)
        self.meta = (rows, prefix, ext)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ---- per layer ----------------------------------------------------------------------------

    def _write(self, layer, k, v):
        h, d = self.pool.head_num, self.pool.head_dim
        p = self.plan
        self.pool.write_layer(layer.layer_id, k.reshape(-1, h, d), v.reshape(-1, h, d), p.slots, p.sink_dst,
                              p.ring_dst)

    def _unrotate_v(self, o: torch.Tensor, layer) -> torch.Tensor:
        """o [N, Hq, D] in the V basis -> model basis (·T_Vᵀ per head)."""
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        tv = _per_q_head(r.v_transform, self.pool.head_num, o.shape[1])
        return torch.einsum("nhe,hde->nhd", o.float(), tv).to(o.dtype)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        from ..kernels.decode import oscar_decode

        if save_kv_cache and k is not None:
            self._write(layer, k, v)
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        lc = self.pool.layer_cache(layer.layer_id)
        o = oscar_decode(q.reshape(-1, hq, d), lc, self.req_to_token_pool.req_to_token,
                         forward_batch.req_pool_indices, forward_batch.seq_lens.to(torch.int32),
                         self.pool.ring_start, sink=lc.sink, window=lc.window, sm_scale=layer.scaling,
                         q_transform=r.k_transform,
                         k_level_a=None if r.k_level_a == 1.0 else r.k_level_a,
                         v_level_a=None if r.v_level_a == 1.0 else r.v_level_a)
        return self._unrotate_v(o, layer).reshape(-1, hq * d)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        from ..kernels.decode import transform_query
        from ..kernels.gather import oscar_gather_prefix

        hq, d, h = layer.tp_q_head_num, layer.qk_head_dim, self.pool.head_num
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        lc = self.pool.layer_cache(layer.layer_id)
        qt = transform_query(q.reshape(-1, hq, d), r.k_transform, h)
        kk = k.reshape(-1, h, d).float()
        if r.k_mean is not None:
            kk = kk - r.k_mean
        kt = torch.einsum("nhd,hde->nhe", kk, _per_q_head(r.k_transform, h, h)).to(q.dtype)
        vt = torch.einsum("nhd,hde->nhe", v.reshape(-1, h, d).float(), _per_q_head(r.v_transform, h, h)).to(q.dtype)
        out = torch.empty(qt.shape, dtype=q.dtype, device=q.device)
        rows, prefix, ext = self.meta
        # Gather every prefix BEFORE this chunk is written: the chunk's ring writes would overwrite
        # the ring rows of the prefix's last W positions (p mod W collides), which would then be read
        # as INT2. Reading first keeps them exact, the same rule as decode and eval/simulator.py.
        prefixes = []
        for i, (row, p) in enumerate(zip(rows, prefix)):
            pk = torch.empty(p, h, d, dtype=q.dtype, device=q.device)
            pv = torch.empty_like(pk)
            if p:
                oscar_gather_prefix(lc, self.req_to_token_pool.req_to_token, row, p,
                                    int(self.plan.ring_starts[i]), pk, pv,
                                    k_level_a=r.k_level_a, v_level_a=r.v_level_a)
            prefixes.append((pk, pv))
        if save_kv_cache and k is not None:
            self._write(layer, k, v)
        start = 0
        for (pk, pv), p, e in zip(prefixes, prefix, ext):
            keys = torch.cat([pk, kt[start:start + e]]).transpose(0, 1)  # [H, p+e, D]
            vals = torch.cat([pv, vt[start:start + e]]).transpose(0, 1)
            qi = qt[start:start + e].transpose(0, 1)  # [Hq, e, D]
            # causal with the chunk placed after its prefix: query j sees keys [0, p + j]
            mask = torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
            oi = torch.nn.functional.scaled_dot_product_attention(
                qi, keys, vals, attn_mask=mask, scale=layer.scaling, enable_gqa=hq != h)
            out[start:start + e] = oi.transpose(0, 1)
            start += e
        return self._unrotate_v(out, layer).reshape(-1, hq * d)


def create_backend(runner):
    return OscarAttnBackend(runner)
