"""Per-layer attention error of quantized histories, with every layer's inputs exact.

One exact forward per window. Inside it, at each layer, the exact post-RoPE q/k/v are also fed to
every method's quantized attention (decode semantics: a key is read from its reconstruction when
j >= sink and i − j >= recent), and compared with exact attention on the same inputs:

    KL(p_exact || p_method)                 per query and head, summed over keys (nats)
    relMSE = Σ‖o_method − o_exact‖² / Σ‖o_exact‖²   over the same queries and heads (ratio of sums)

Errors therefore never compound across layers: they isolate what each layer's quantizers do.
Only queries at positions >= sink + recent are scored (earlier ones have no quantized history).
To bound cost, at most `max_queries` of those positions per window are used, evenly spaced
(always including the last position). Per layer, KL is the mean over all scored (query, head)
pairs of all windows; relMSE pools numerator and denominator over all windows; the `_mean`
values average the per-layer values over layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..config import SERVED_RECENT, SERVED_SINK
from ..hf_attention import attention_override, causal_attention
from .simulator import _per_head, fake_rows, mixed_attention, quantized_mask, transform_rows


def scored_positions(length: int, sink: int, recent: int, max_queries: Optional[int]) -> torch.Tensor:
    first = sink + recent
    if length <= first:
        raise ValueError(f"windows of {length} tokens have no query with a quantized history "
                         f"(need more than sink + recent = {first})")
    pos = torch.arange(first, length)
    if max_queries is not None and pos.numel() > max_queries:
        idx = torch.linspace(0, pos.numel() - 1, max_queries).round().long().unique()
        pos = pos[idx]
    return pos


class _Collector:
    def __init__(self, methods, num_layers, sink, recent, qpos):
        self.methods, self.sink, self.recent, self.qpos = methods, sink, recent, qpos
        z = lambda: torch.zeros(num_layers, dtype=torch.float64)  # noqa: E731
        self.kl_sum = {n: z() for n in methods}
        self.kl_cnt = {n: z() for n in methods}
        self.err = {n: z() for n in methods}
        self.ref = {n: z() for n in methods}

    def __call__(self, module, query, key, value, scaling=None):
        out = causal_attention(query, key, value, scaling, module.num_key_value_groups)
        idx = module.layer_idx
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[-2]
        if T != S:
            raise RuntimeError("attention_errors expects one full forward per window (no cache)")
        G = Hq // Hkv
        scaling = D ** -0.5 if scaling is None else scaling
        qpos = self.qpos.to(query.device)
        L = int(qpos[-1]) + 1
        q = query.float()[:, :, qpos].reshape(B, Hkv, G, -1, D)
        k, v = key.float()[:, :, :L], value.float()[:, :, :L]
        o_ex, lp_ex = mixed_attention(q, k, v, None, None, qpos, None, scaling, return_logp=True)
        p_ex = lp_ex.exp()
        ref = float((o_ex.double() ** 2).sum())
        quant = quantized_mask(qpos, L, self.sink, self.recent, qpos)
        for name, layers in self.methods.items():
            self.ref[name][idx] += ref
            self.kl_cnt[name][idx] += p_ex[..., 0].numel()
            entry = None if layers is None else layers[idx]
            if entry is None:
                continue  # exact layer: zero error (its queries still count in the mean)
            qk, qv = entry
            tq = _per_head(qk.query_matrix(), Hkv).to(query.device)
            tinv = _per_head(qv.inverse_matrix(), Hkv).to(query.device)
            ke, ve = transform_rows(qk, k), transform_rows(qv, v)
            qt = torch.einsum("bhgtd,hde->bhgte", q, tq)
            o_t, lp = mixed_attention(qt, ke, ve, fake_rows(qk, ke), fake_rows(qv, ve),
                                      qpos, quant, scaling, return_logp=True)
            o_m = torch.einsum("bhgte,hed->bhgtd", o_t, tinv)
            # p_ex = 0 only on future keys, where lp is -inf as well: count those terms as 0.
            kl = torch.where(p_ex > 0, p_ex * (lp_ex - lp), torch.zeros_like(p_ex)).sum(-1)
            self.kl_sum[name][idx] += float(kl.double().sum())
            self.err[name][idx] += float(((o_m - o_ex).double() ** 2).sum())
        return out


@torch.no_grad()
def attention_errors(model, windows: list[list[int]], methods: dict[str, Optional[Sequence]], *,
                     sink: int = SERVED_SINK, recent: int = SERVED_RECENT, max_queries: Optional[int] = 256,
                     progress: bool = True) -> dict:
    """{name: dict(kl_per_layer, kl_mean, relmse_per_layer, relmse_mean)}; a method is a per-layer
    list of (K, V) SideQuantizer pairs / None, or None for the exact model (all zeros)."""
    n = model.config.num_hidden_layers
    for name, layers in methods.items():
        if layers is not None and len(layers) != n:
            raise ValueError(f"method {name!r} has {len(layers)} layer entries, the model has {n} layers")
    if not windows:
        raise ValueError("attention_errors needs at least one window")
    dev = next(model.parameters()).device
    col = None
    for w in tqdm(windows, desc="attention errors", disable=not progress):
        qpos = scored_positions(len(w), sink, recent, max_queries)
        if col is None:
            col = _Collector(methods, n, sink, recent, qpos)
        col.qpos = qpos
        with attention_override(model, col):
            model.get_decoder()(input_ids=torch.tensor([list(w)], device=dev), use_cache=False)
    result = {}
    for name in methods:
        kl = (col.kl_sum[name] / col.kl_cnt[name]).tolist()
        rel = (col.err[name] / col.ref[name].clamp_min(1e-300)).tolist()
        result[name] = dict(kl_per_layer=kl, kl_mean=sum(kl) / n, relmse_per_layer=rel, relmse_mean=sum(rel) / n)
    return result
