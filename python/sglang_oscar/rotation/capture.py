"""Capture the second-order statistics the rotation fit needs, streaming, in float64.

The model runs under hf_attention.attention_override with our own fp32 causal attention, so we
see q/k/v exactly as an attention backend does (post q/k-norm, post-RoPE) and we get the
softmax matrix S of every window for free (it is what produces the layer output).

Per layer and per KV head h (query heads of the GQA group {h·g, ..., h·g + g − 1}, g = Hq/Hkv):
  C_Q        = mean over tokens and the group's query heads of q qᵀ
  C_K, C_V   = E[k kᵀ], E[v vᵀ];  μ_K = E[k]  (centered C_K = C_K − μ_K μ_Kᵀ)
  C_S cheap  = Σ_t w_t v_t v_tᵀ / Σ_t w_t,  w_t = k_t C_Q^{(w)} k_tᵀ  (expected squared logit)
  C_S exact  = (S V)ᵀ (S V) / n over the group's query heads (the VᵀSᵀSV target)
Only sums are kept (D×D per head), never the tokens, so memory does not grow with the
calibration set. Held-out windows are not folded into the statistics; their q/k/v are kept
(fp32) for clip calibration.

C_S cheap note: the seed weights tokens with the *global* C_Q, which needs a second pass over
the data (or a D⁴ tensor). We use the query second moment of the same window, C_Q^{(w)}: one
pass, exact for what it defines, and with windows of ~2k tokens the estimate is close to the
global one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..hf_attention import attention_override
from ..models import attention_shape


@dataclasses.dataclass
class LayerSums:
    """Float64 running sums for one layer, per KV head (index 0 of every tensor = head)."""

    q2: torch.Tensor  # [H, D, D]  Σ q qᵀ over tokens and the group's query heads
    k2: torch.Tensor  # [H, D, D]
    v2: torch.Tensor  # [H, D, D]
    k1: torch.Tensor  # [H, D]
    s_cheap: torch.Tensor  # [H, D, D]  Σ w v vᵀ
    w_sum: torch.Tensor  # [H]        Σ w
    s_exact: torch.Tensor  # [H, D, D]  Σ o oᵀ, o = attention output row of a query head
    tokens: int = 0  # tokens per KV head
    queries: int = 0  # query rows per KV head (tokens · group)

    @classmethod
    def zeros(cls, kv_heads: int, head_dim: int) -> "LayerSums":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        h, d = kv_heads, head_dim
        return cls(z(h, d, d), z(h, d, d), z(h, d, d), z(h, d), z(h, d, d), z(h), z(h, d, d))


@dataclasses.dataclass
class CalibrationStats:
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    sums: list[LayerSums]
    scaling: list[float]  # softmax scale of each layer, as the model passes it
    windows: int = 0
    seq_len: int = 0
    tokens: int = 0
    # held-out q/k/v per layer: list over windows of q [Hq, T, D], k/v [Hkv, T, D] (fp32, CPU)
    heldout_q: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    heldout_k: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    heldout_v: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    heldout_tokens: int = 0

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def _check(self, layer: int) -> LayerSums:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        s = self.sums[layer]
        if s.tokens == 0:
            raise ValueError("no calibration tokens were captured; pass at least one window")
        return s

    # Per-head statistics [H, D, D] / [H, D]; per-layer ones are their mean over heads (every
    # head saw the same tokens, so the mean over heads is the mean over all (token, head) rows).
    def c_q(self, layer: int) -> torch.Tensor:
        s = self._check(layer)
        return s.q2 / s.queries

    def c_k(self, layer: int, centered: bool = False) -> torch.Tensor:
        s = self._check(layer)
        c = s.k2 / s.tokens
        if centered:
            mu = self.mu_k(layer)
            c = c - mu.unsqueeze(-1) * mu.unsqueeze(-2)
        return c

    def c_v(self, layer: int) -> torch.Tensor:
        s = self._check(layer)
        return s.v2 / s.tokens

    def mu_k(self, layer: int) -> torch.Tensor:
        s = self._check(layer)
        return s.k1 / s.tokens

    def c_s(self, layer: int, kind: str = "exact") -> torch.Tensor:
        s = self._check(layer)
        if kind == "exact":
            return s.s_exact / s.queries
        if kind == "cheap":
            return s.s_cheap / s.w_sum.clamp_min(1e-300)[:, None, None]
        raise ValueError(f"C_S kind must be 'exact' or 'cheap', got {kind!r}")

    def layer_mean(self, per_head: torch.Tensor) -> torch.Tensor:
        """Per-layer statistic from per-head ones (keeps a head axis of size 1)."""
        return per_head.mean(0, keepdim=True)

    def c_k_layer_centered(self, layer: int) -> torch.Tensor:
        """Per-layer centered C_K around the head-averaged mean (the μ a per-layer bundle stores)."""
        c = self.c_k(layer).mean(0)
        mu = self.mu_k(layer).mean(0)
        return (c - torch.outer(mu, mu)).unsqueeze(0)


def accumulate_window(sums: LayerSums, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
    """Fold one window into the sums. q/o [Hq, T, D], k/v [Hkv, T, D] (any float dtype)."""
    hkv, t, d = k.shape
    g = q.shape[0] // hkv
    q64 = q.double().reshape(hkv, g * t, d)  # query heads of a group are consecutive
    o64 = o.double().reshape(hkv, g * t, d)
    k64, v64 = k.double(), v.double()
    q2 = q64.transpose(1, 2) @ q64
    sums.q2 += q2
    sums.k2 += k64.transpose(1, 2) @ k64
    sums.v2 += v64.transpose(1, 2) @ v64
    sums.k1 += k64.sum(1)
    sums.s_exact += o64.transpose(1, 2) @ o64
    cq_window = q2 / (g * t)
    w = torch.einsum("htd,hde,hte->ht", k64, cq_window, k64)  # [H, T]
    sums.s_cheap += (v64 * w.unsqueeze(-1)).transpose(1, 2) @ v64
    sums.w_sum += w.sum(1)
    sums.tokens += t
    sums.queries += g * t


def rope_rotation(model, offset: int, head_dim: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) [D] of the model's own RoPE at position `offset`, without any attention scaling
    (YaRN's mscale), or None for a model without a rotary embedding module."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    x = torch.zeros(1, 1, head_dim, device=device)
    cos, sin = rotary(x, torch.tensor([[offset]], device=device))
    cos, sin = cos.reshape(-1).float(), sin.reshape(-1).float()
    if cos.numel() != head_dim:
        raise ValueError(f"the rotary embedding covers {cos.numel()} of head_dim {head_dim}: partial RoPE is not "
                         "supported by --context")
    norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
    return cos / norm, sin / norm


def apply_rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [..., D] rows by (cos, sin) in the rotate-half pairing (i, i + D/2) of HF models."""
    cos, sin = cs
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def window_offsets(windows: list[list[int]], context: Optional[int]) -> list[int]:
    """Extra RoPE offsets that spread the windows evenly over positions [0, context): a window of
    T tokens at offset d shows the keys and queries of positions d .. d + T − 1."""
    if context is None or not windows:
        return [0] * len(windows)
    n = len(windows)
    return [round(i / max(n - 1, 1) * max(context - len(w), 0)) for i, w in enumerate(windows)]


def _run_windows(model, windows, on_layer, progress: bool, desc: str, offsets: Optional[list[int]] = None) -> None:
    """Run each window (batch 1); on_layer(layer_idx, q, k, v, o) gets [H, T, D] fp32 tensors.

    offsets: per window, an extra RoPE rotation applied to the post-RoPE q and k the hooks see, as
    if the window stood that many positions later. Relative positions, logits and attention are
    unchanged (q and k turn by the same angle); only the absolute phase the quantizer sees moves.
    RoPE composes additively (R(p + d) = R(d)·R(p)), so these are the keys of those positions for
    the same content."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    shape = attention_shape(model)
    turn: dict = {"cs": None}

    def attn(module, query, key, value, scaling):
        if query.shape[0] != 1 or query.shape[-2] != key.shape[-2]:
            raise RuntimeError("capture expects batch 1 prefill windows without a KV cache")
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        if turn["cs"] is not None:
            q, k = apply_rope(q, turn["cs"]), apply_rope(k, turn["cs"])
        hq, hkv = q.shape[0], k.shape[0]
        g = hq // hkv
        t = q.shape[1]
        kk = k.repeat_interleave(g, dim=0)
        vv = v.repeat_interleave(g, dim=0)
        scores = (q @ kk.transpose(-1, -2)) * scaling
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        del scores
        o = probs @ vv  # [Hq, T, D]
        del probs
        on_layer(module.layer_idx, q, k, v, o, float(scaling))
        return o.transpose(0, 1).unsqueeze(0).to(query.dtype)

    with attention_override(model, attn), torch.inference_mode():
        for i, ids in enumerate(tqdm(windows, desc=desc, disable=not progress, unit="win")):
            if len(ids) == 0:
                raise ValueError("empty calibration window")
            d = offsets[i] if offsets else 0
            turn["cs"] = rope_rotation(model, d, shape["head_dim"], device) if d else None
            if d and turn["cs"] is None:
                raise ValueError("--context needs a model with a rotary embedding (model.model.rotary_emb)")
            x = torch.tensor([ids], dtype=torch.long, device=device)
            model(input_ids=x, use_cache=False)


def capture_statistics(
    model, windows: list[list[int]], heldout: list[list[int]], progress: bool = True,
    context: Optional[int] = None,
) -> CalibrationStats:
    """Run the model over `windows` (statistics) and `heldout` (kept raw for clip calibration).

    context: the longest context the cache will serve. Post-RoPE keys turn their slow RoPE pairs
    with position, so a K mean, transform and clip fitted on short windows only fit the phases those
    windows reach. With context set, the windows (and held-out windows) are spread over
    [0, context) by extra RoPE rotations (window_offsets), so the statistics cover every phase
    the server will store. It does not replace windows as long as the context (SmolLM2 at 8k: 42%
    of bf16's NIAH answers kept with 2k windows + offsets, 0% without, 83% with 8k windows): keys
    of deeper layers also depend on how much context they attend to."""
    if not windows:
        raise ValueError("capture_statistics needs at least one calibration window")
    shape = attention_shape(model)
    L, hq, hkv, d = shape["num_layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    stats = CalibrationStats(
        num_layers=L,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        sums=[LayerSums.zeros(hkv, d) for _ in range(L)],
        scaling=[math.nan] * L,
        windows=len(windows),
        seq_len=max(len(w) for w in windows),
        tokens=sum(len(w) for w in windows),
        heldout_q=[[] for _ in range(L)],
        heldout_k=[[] for _ in range(L)],
        heldout_v=[[] for _ in range(L)],
        heldout_tokens=sum(len(w) for w in heldout),
    )

    def on_stats(layer, q, k, v, o, scaling):
        accumulate_window(stats.sums[layer], q.cpu(), k.cpu(), v.cpu(), o.cpu())
        stats.scaling[layer] = scaling

    def on_heldout(layer, q, k, v, o, scaling):
        stats.heldout_q[layer].append(q.detach().cpu().clone())
        stats.heldout_k[layer].append(k.detach().cpu().clone())
        stats.heldout_v[layer].append(v.detach().cpu().clone())
        stats.scaling[layer] = scaling

    _run_windows(model, windows, on_stats, progress, "capture", window_offsets(windows, context))
    if heldout:
        _run_windows(model, heldout, on_heldout, progress, "held-out", window_offsets(heldout, context))
    missing = [i for i, s in enumerate(stats.sums) if s.tokens == 0]
    if missing:
        raise RuntimeError(f"attention of layers {missing} was never called; is this a decoder-only model?")
    return stats
