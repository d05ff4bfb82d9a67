"""Per-layer clip ratios (ρ_K, ρ_V), chosen on held-out windows.

The objective is what the cache actually breaks: the layer's attention output. For K, keys at
positions >= sink are replaced by their quantized reconstruction (V exact); for V, the same with
values (K exact). The score is the relative MSE ‖O_hat − O‖² / ‖O‖² summed over held-out
windows and a random subset of query positions (past the sink, where quantized keys exist).
The BF16 recent window is ignored on purpose: it would hide the quantization error from the
queries we sample and make every ρ look the same.

Speed: every ρ candidate of one side is evaluated in one batched matmul; queries are
subsampled (default 256 per window), so SmolLM2 (30 layers, 4k held-out tokens) takes about a
minute on one core.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..config import SERVED_RECENT, SERVED_SINK
from ..quant.clip import clip_count
from ..quant.intq import fake_quantize
from ..quant.kv import SideQuantizer, apply_transform

# Keys of small models want heavy clipping (SmolLM2 picks 0.75-0.85 for K), so the grid goes low.
DEFAULT_RHO_GRID = (1.0, 0.995, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80, 0.75, 0.70)


@dataclasses.dataclass
class ClipChoice:
    rho_k: float
    rho_v: float
    k_errors: torch.Tensor  # [len(candidates)] relative MSE, NaN if nothing to score
    v_errors: torch.Tensor
    candidates: list[float]  # the ρ of the error tables, mildest clip first


def _candidates(rho_grid: Sequence[float]) -> list[float]:
    rhos = sorted({float(r) for r in rho_grid}, reverse=True)  # ties resolve to the mildest clip
    for r in rhos:
        clip_count(r, 2)  # raises a clear error for ρ outside (0, 1]
    return rhos


def _clip_many(xt: torch.Tensor, rhos: Sequence[float]) -> torch.Tensor:
    """clip_rows for every ρ at once: [R, ...] (one topk for the largest count)."""
    d = xt.shape[-1]
    counts = [clip_count(r, d) for r in rhos]
    a = xt.abs()
    top = torch.topk(a, max(counts) + 1, dim=-1).values
    out = []
    for n in counts:
        t = top[..., n : n + 1]
        out.append(torch.maximum(torch.minimum(xt, t), -t))
    return torch.stack(out)


def _reconstructions(x: torch.Tensor, quant: SideQuantizer, rhos: Sequence[float], sink: int) -> torch.Tensor:
    """[G, H, T, D]: x with positions >= sink replaced by the quantized reconstruction per clip ratio."""
    xt = quant.transform(x.transpose(0, 1))  # [T, H, D] in the transformed basis
    inv = quant.inverse_matrix()
    outs = []
    for clipped in _clip_many(xt, rhos):
        rec = apply_transform(fake_quantize(clipped, quant.bits, quant.group), inv)
        if quant.mean is not None:
            rec = rec + quant.mean.float()
        rec = rec.transpose(0, 1)  # [H, T, D]
        rec[:, :sink] = x[:, :sink]
        outs.append(rec)
    return torch.stack(outs)


def _blocks(qpos: torch.Tensor, t: int, blocks: int = 4):
    """Split sorted query positions into blocks; block b only needs keys [0, last position + 1).

    Queries are sampled uniformly, so trimming the keys per block saves ~3/8 of the attention work.
    Each block gets an additive causal mask (0 / −inf) built once and reused for every candidate.
    """
    out = []
    for idx in torch.arange(qpos.numel()).chunk(blocks):
        if idx.numel() == 0:
            continue
        pos = qpos[idx]
        kmax = int(pos[-1]) + 1
        mask = torch.zeros(pos.numel(), kmax)
        mask.masked_fill_(torch.arange(kmax)[None, :] > pos[:, None], float("-inf"))
        out.append((idx, kmax, mask))
    return out


def _probs(qg: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention probabilities. qg [Hkv, g, n, D] (queries grouped under their KV head),
    k [..., Hkv, S, D] -> [..., Hkv, g, n, S]. Grouping avoids materializing repeated keys."""
    s = torch.matmul(qg, k.unsqueeze(-3).transpose(-1, -2))
    s.mul_(scaling).add_(mask)
    return torch.softmax(s, dim=-1)


def calibrate_layer_clip(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    k_quant: SideQuantizer,
    v_quant: SideQuantizer,
    *,
    scaling: float,
    rho_grid: Sequence[float] = DEFAULT_RHO_GRID,
    sink: int = SERVED_SINK,
    queries_per_window: int = 256,
    chunk: int = 4,
    seed: int = 0,
) -> ClipChoice:
    """Pick ρ for K and V of one layer. qs/ks/vs: per window q [Hq, T, D], k/v [Hkv, T, D].

    k_quant / v_quant give the transform (and key mean), bits and group; their own clip_ratio is
    ignored. Without any window longer than `sink` there is nothing to score and the result is ρ = 1.
    """
    if k_quant.bits != v_quant.bits:
        raise ValueError("K and V quantizers must use the same bit width")
    cands = _candidates(rho_grid)
    d = k_quant.matrix.shape[-1]
    # Candidates that clip the same number of entries per row are identical: evaluate each once.
    key_of = [clip_count(r, d) for r in cands]
    uniq = list(dict.fromkeys(key_of))
    rep = [key_of.index(u) for u in uniq]  # first (= mildest ρ) candidate of each class
    ucands = [cands[i] for i in rep]
    gen = torch.Generator().manual_seed(seed)
    num_k = torch.zeros(len(ucands), dtype=torch.float64)
    num_v = torch.zeros(len(ucands), dtype=torch.float64)
    den = 0.0
    for q, k, v in zip(qs, ks, vs):
        q, k, v = q.float(), k.float(), v.float()
        hkv, t, _ = k.shape
        g = q.shape[0] // hkv
        if t <= sink:
            continue
        n = min(queries_per_window, t - sink)
        qpos = (torch.randperm(t - sink, generator=gen)[:n] + sink).sort().values
        qg = q[:, qpos].view(hkv, g, n, -1)
        k_rec = _reconstructions(k, k_quant, ucands, sink)  # [G, Hkv, T, D]
        v_rec = _reconstructions(v, v_quant, ucands, sink)
        for idx, kmax, mask in _blocks(qpos, t):
            qb = qg[:, :, idx]
            probs = _probs(qb, k[:, :kmax], mask, scaling)  # [Hkv, g, nb, S]
            ref = probs @ v[:, None, :kmax]
            den += float(ref.pow(2).sum(dtype=torch.float64))
            for c0 in range(0, len(ucands), chunk):
                sl = slice(c0, c0 + chunk)
                ok = _probs(qb, k_rec[sl, :, :kmax], mask, scaling) @ v[:, None, :kmax]
                num_k[sl] += (ok - ref).pow(2).sum(dim=(1, 2, 3, 4), dtype=torch.float64)
                # V side: probabilities do not depend on the candidate
                ov = probs @ v_rec[sl, :, None, :kmax]
                num_v[sl] += (ov - ref).pow(2).sum(dim=(1, 2, 3, 4), dtype=torch.float64)
    if den == 0.0:
        nan = torch.full((len(cands),), float("nan"), dtype=torch.float64)
        return ClipChoice(1.0, 1.0, nan, nan.clone(), cands)
    cls = torch.tensor([uniq.index(kk) for kk in key_of])
    ek, ev = (num_k / den)[cls], (num_v / den)[cls]
    bk, bv = int(torch.argmin(ek)), int(torch.argmin(ev))  # first minimum = mildest clip
    return ClipChoice(cands[bk], cands[bv], ek, ev, cands)


def key_damage(qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor], k_quant: SideQuantizer, *, scaling: float,
               sink: int = SERVED_SINK, recent: int = SERVED_RECENT, tail: int = 64) -> torch.Tensor:
    """How much each KV head's quantized keys disturb attention: KL(exact || quantized keys) of the last `tail` query
    positions of each held-out window, summed over the head's query heads and averaged over positions, in decode
    semantics (a query at i reads keys [sink, i − recent] quantized with k_quant, the rest exact; values do not
    enter). qs/ks: per window q [Hq, T, D], k [Hkv, T, D]. Returns float64 [Hkv]: what the calibration ranks
    (layer, KV head) pairs by to choose the ones whose keys it stores in INT4 (fit.choose_k4_heads)."""
    total, count = None, 0
    for q, k in zip(qs, ks):
        q, k = q.float(), k.float()
        hkv, t, _ = k.shape
        g = q.shape[0] // hkv
        n = min(tail, t)
        qpos = torch.arange(t - n, t)
        krec = _reconstructions(k, k_quant, [k_quant.clip_ratio], sink)[0]  # [Hkv, T, D]
        keys = torch.arange(t)
        exact_zone = (keys[None, :] < sink) | (keys[None, :] > qpos[:, None] - recent)  # [n, T]
        mask = torch.zeros(n, t).masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
        qg = q[:, qpos].view(hkv, g, n, -1)
        s_exact = torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2)) * scaling + mask  # [Hkv, g, n, T]
        s_quant = torch.matmul(qg, krec.unsqueeze(1).transpose(-1, -2)) * scaling + mask
        ref = torch.log_softmax(s_exact, -1)
        approx = torch.log_softmax(torch.where(exact_zone, s_exact, s_quant), -1)
        kl = (ref.exp() * (ref - approx)).nan_to_num(0.0).sum(-1)  # [Hkv, g, n]
        per_head = kl.sum(dim=(1, 2), dtype=torch.float64)
        total = per_head if total is None else total + per_head
        count += n
    if total is None:
        return torch.zeros(ks[0].shape[0] if ks else 0, dtype=torch.float64)
    return total / max(count, 1)
