"""Fake-quantized attention that reproduces what the INT2 server computes, inside a HF model.

Which history a query sees. For a query at position i and a key/value at position j <= i the
server holds the row in BF16 ("exact") when

    j < sink            (attention sink: the first tokens are never quantized)
    i - j < recent      (the recent window is still BF16)
    j >= chunk_start(i) (rows written by the *current* forward call are attended before they
                         are quantized: the server's prefill reads its own fresh K/V)

and otherwise reads the INT2 reconstruction: transform -> clip -> quantize -> dequantize.
chunk_start(i) depends on `mode`:
    "decode"  -> i                       every token as if it were a decode step (teacher-forced PPL)
    "prefill" -> first position of the current forward call (server prefill/decode semantics)
    int C     -> floor(i / C) * C        chunked prefill with chunk size C, in one forward call

Attention runs in the transformed basis of each layer (q' = q·T^{-T}, k' = (k − μ)·T, v' = v·T,
o = o'·T^{-1}) for exact and quantized rows alike, exactly as the server stores them. The K mean
shifts every logit of a query by the same q·μ, so for exact rows this equals plain attention.

Cost control: queries are processed in blocks (each block only looks at keys up to its last
position), all math is fp32, and every K/V row is transformed and quantized once per sequence:
rows are quantized independently, so the per-layer reconstructions are cached and only the rows
a forward call adds are processed (the decode loop of generate() re-sends the whole cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Sequence, Union

import torch

from ..config import SERVED_RECENT, SERVED_SINK
from ..hf_attention import attention_override, causal_attention
from ..quant.kv import SideQuantizer

Mode = Union[str, int]
LayerQuant = Optional[tuple]  # (SideQuantizer for K, SideQuantizer for V) or None (exact layer)


def _check_mode(mode: Mode) -> Mode:
    if isinstance(mode, bool) or not (mode in ("decode", "prefill") or (isinstance(mode, int) and mode > 0)):
        raise ValueError(f'mode must be "decode", "prefill" or a positive chunk size, got {mode!r}')
    return mode


def chunk_starts(qpos: torch.Tensor, mode: Mode, call_start: int) -> torch.Tensor:
    """chunk_start(i) for each query position (rows at or after it are attended exactly)."""
    if mode == "decode":
        return qpos
    if mode == "prefill":
        return torch.full_like(qpos, call_start)
    return torch.div(qpos, mode, rounding_mode="floor") * mode


def quantized_mask(qpos: torch.Tensor, nkeys: int, sink: int, recent: int, cstart: torch.Tensor) -> torch.Tensor:
    """[Tq, nkeys] bool: True where query i reads the *reconstruction* of key j (causality not applied)."""
    kpos = torch.arange(nkeys, device=qpos.device)[None, :]
    i = qpos[:, None]
    return (kpos >= sink) & (i - kpos >= recent) & (kpos < cstart[:, None])


def _per_head(m: torch.Tensor, heads: int) -> torch.Tensor:
    """A [D, D] or [H, D, D] matrix as [heads, D, D]."""
    m = m.float()
    if m.dim() == 2:
        return m.expand(heads, *m.shape)
    if m.shape[0] == 1:
        return m.expand(heads, *m.shape[1:])
    if m.shape[0] != heads:
        raise ValueError(f"per-head matrix has {m.shape[0]} heads, the layer has {heads} KV heads")
    return m


def transform_rows(sq: SideQuantizer, x: torch.Tensor) -> torch.Tensor:
    """sq.transform on [B, H, S, D] (the quantizer works on [..., H, D])."""
    return sq.transform(x.transpose(1, 2)).transpose(1, 2)


def fake_rows(sq: SideQuantizer, xt: torch.Tensor) -> torch.Tensor:
    """sq.fake_transformed on transformed rows [B, H, S, D] (its per-head widths index the head axis)."""
    return sq.fake_transformed(xt.transpose(1, 2)).transpose(1, 2)


def mixed_attention(
    qt: torch.Tensor,
    ke: torch.Tensor,
    ve: torch.Tensor,
    kq: Optional[torch.Tensor],
    vq: Optional[torch.Tensor],
    qpos: torch.Tensor,
    quant: Optional[torch.Tensor],
    scaling: float,
    return_logp: bool = False,
):
    """Attention of grouped queries over a mix of exact and reconstructed rows.

    qt [B, Hkv, G, Tq, D]; ke/ve (exact) and kq/vq (reconstructed) [B, Hkv, L, D] with L > max(qpos);
    quant [Tq, L] bool selects the reconstruction (None: everything exact).
    Returns o' [B, Hkv, G, Tq, D] (and log-probabilities [B, Hkv, G, Tq, L] if asked).
    """
    L = ke.shape[-2]
    kpos = torch.arange(L, device=qt.device)
    future = kpos[None, :] > qpos[:, None]  # [Tq, L]
    if quant is None or not bool(quant.any()):
        scores = (qt @ ke.unsqueeze(2).transpose(-1, -2)) * scaling
        logp = torch.log_softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out = logp.exp() @ ve.unsqueeze(2)
        return (out, logp) if return_logp else out
    # Most key columns are read the same way by every query of the block (the sink and old
    # history always exact / always reconstructed); only a band of about block + recent columns
    # differs per query. Score each column once, with the row the block reads, and compute the
    # second version only for the mixed band: ~1x the cost of plain attention instead of 2x.
    all_q = quant.all(0)
    mixed = (quant.any(0) & ~all_q).nonzero().squeeze(-1)
    k_one = torch.where(all_q[:, None], kq, ke)
    v_one = torch.where(all_q[:, None], vq, ve)
    scores = (qt @ k_one.unsqueeze(2).transpose(-1, -2)) * scaling
    if mixed.numel():
        qm = quant[:, mixed]  # [Tq, M]
        s_alt = (qt @ kq[:, :, mixed].unsqueeze(2).transpose(-1, -2)) * scaling
        scores[..., mixed] = torch.where(qm, s_alt, scores[..., mixed])
    logp = torch.log_softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    p = logp.exp()
    out = p @ v_one.unsqueeze(2)
    if mixed.numel():
        dv = (vq[:, :, mixed] - ve[:, :, mixed]).unsqueeze(2)
        out = out + (p[..., mixed] * qm) @ dv
    return (out, logp) if return_logp else out


def _flash(q, k, v, scaling, causal):
    """(out, lse) of softmax attention; causal is top-left aligned (query r sees keys c <= r)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scaling)


def _band(q, k, v, scaling, lo, recent, block=256):
    """(out, lse) over keys j in [max(lo, i - recent + 1), i] for every query i = row index."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((B, H, T), float("-inf"), dtype=q.dtype, device=q.device)
    for a in range(0, T, block):
        b = min(T, a + block)
        k0 = max(lo, a - recent + 1)
        if k0 >= b:
            continue
        i = torch.arange(a, b, device=q.device)[:, None]
        j = torch.arange(k0, b, device=q.device)[None, :]
        vis = (j <= i) & (j > i - recent)
        sc = (q[:, :, a:b] @ k[:, :, k0:b].transpose(-1, -2)) * scaling
        sc = sc.masked_fill(~vis, float("-inf"))
        m = torch.logsumexp(sc, dim=-1)
        p = torch.exp(sc - m.unsqueeze(-1)).nan_to_num(0.0)
        out[:, :, a:b] = p @ v[:, :, k0:b]
        lse[:, :, a:b] = m
    return out, lse


def decode_full_sequence(qt, ke, ve, kq, vq, sink, recent, scaling):
    """Teacher-forced decode semantics for a whole sequence starting at position 0, fast path.

    Query i reads exact rows [0, sink) and (i - recent, i], and reconstructions [sink, i - recent].
    Each of the three pieces is a (shifted) causal attention, so CPU flash attention computes them
    without materializing [T, T] scores; the pieces are merged by their log-sum-exp.
    qt [B, Hq, T, D]; ke/ve/kq/vq [B, Hq, T, D] (KV heads already repeated). Returns [B, Hq, T, D].
    """
    T = qt.shape[-2]
    s = min(sink, T)
    parts = []
    if s > 0:
        parts.append(_flash(qt, ke[:, :, :s], ve[:, :, :s], scaling, True))
    if T > s:
        parts.append(_band(qt, ke, ve, scaling, s, recent))
    if T > sink + recent:
        o, l = _flash(qt[:, :, sink + recent:], kq[:, :, sink:T - recent], vq[:, :, sink:T - recent], scaling, True)
        pad = sink + recent
        o = torch.cat((torch.zeros_like(qt[:, :, :pad]), o), dim=2)
        l = torch.cat((torch.full_like(l[..., :1].expand(*l.shape[:-1], pad), float("-inf")), l), dim=-1)
        parts.append((o, l))
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
    return sum(o * torch.exp(l - lse).unsqueeze(-1) for o, l in parts)


@dataclasses.dataclass
class _LayerState:
    """Transformed exact rows and their reconstructions for the rows seen so far in this sequence.

    Rows live in buffers with spare capacity (grown geometrically), so a decode step appends one
    row instead of copying the whole history.
    """

    bufs: list  # [ke, kq, ve, vq], each [B, Hkv, capacity, D]
    n: int
    last_k: torch.Tensor  # raw key row n-1, to notice a different sequence / cache

    def view(self, i: int) -> torch.Tensor:
        return self.bufs[i][:, :, : self.n]

    ke = property(lambda self: self.view(0))
    kq = property(lambda self: self.view(1))
    ve = property(lambda self: self.view(2))
    vq = property(lambda self: self.view(3))

    def append(self, parts) -> None:
        add = parts[0].shape[-2]
        cap = self.bufs[0].shape[-2]
        if self.n + add > cap:
            new_cap = max(2 * cap, self.n + add)
            grown = []
            for b in self.bufs:
                g = b.new_empty(*b.shape[:-2], new_cap, b.shape[-1])
                g[:, :, : self.n] = b[:, :, : self.n]
                grown.append(g)
            self.bufs = grown
        for b, x in zip(self.bufs, parts):
            b[:, :, self.n : self.n + add] = x
        self.n += add


class MixedCacheSimulator:
    """Fake-quantized KV-cache attention for a transformers model (see the module docstring).

    layers: one entry per decoder layer, (K quantizer, V quantizer) or None for an exact layer.
    Use ``with sim.attach(model): model(...)`` (state is reset on entry) and ``sim.reset()``
    between sequences processed inside one attach block.
    """

    def __init__(self, layers: Sequence[LayerQuant], *, sink: int = SERVED_SINK, recent: int = SERVED_RECENT,
                 mode: Mode = "decode", block: int = 512):
        if sink < 0 or recent < 1:
            raise ValueError(f"need sink >= 0 and recent >= 1, got sink={sink} recent={recent}")
        if block < 1:
            raise ValueError(f"block must be positive, got {block}")
        self.layers = list(layers)
        for idx, entry in enumerate(self.layers):
            if entry is None:
                continue
            if (not isinstance(entry, (tuple, list)) or len(entry) != 2
                    or not all(isinstance(s, SideQuantizer) for s in entry)):
                raise TypeError(f"layer {idx}: expected (SideQuantizer, SideQuantizer) or None, got {type(entry)}")
            if entry[1].mean is not None:
                # A V mean would shift the output by p·μ, which does not cancel.
                raise ValueError(f"layer {idx}: the V quantizer must not have a mean")
        self.sink, self.recent, self.block = sink, recent, block
        self.mode = _check_mode(mode)
        self._mats: dict[int, tuple] = {}
        self._state: dict[int, _LayerState] = {}

    # ----------------------------------------------------------------------------------- API
    def reset(self) -> None:
        """Forget the cached reconstructions (start of a new sequence)."""
        self._state.clear()

    @contextlib.contextmanager
    def attach(self, model):
        n = model.config.num_hidden_layers
        if len(self.layers) != n:
            raise ValueError(f"simulator has {len(self.layers)} layer entries, the model has {n} layers")
        self.reset()
        try:
            with attention_override(model, self):
                yield self
        finally:
            self.reset()

    # ------------------------------------------------------------------------------ internals
    def _matrices(self, idx: int, hkv: int, device):
        """(T_q [Hkv,D,D], T^{-1} [Hkv,D,D]) of a layer, inverted once."""
        if idx not in self._mats:
            qk, qv = self.layers[idx]
            self._mats[idx] = (_per_head(qk.query_matrix(), hkv).to(device), _per_head(qv.inverse_matrix(), hkv).to(device))
        return self._mats[idx]

    def _rows(self, idx: int, qk: SideQuantizer, qv: SideQuantizer, key, value) -> _LayerState:
        """Bring the layer's cached transformed/reconstructed rows up to key.shape[-2] rows."""
        S = key.shape[-2]
        st = self._state.get(idx)
        if st is not None and (st.n > S or st.ke.shape[0] != key.shape[0]
                               or not torch.equal(st.last_k, key[:, :, st.n - 1])):
            st = None  # a different sequence (or a rewound cache): start over
        start = 0 if st is None else st.n
        if start < S:
            kn = transform_rows(qk, key[:, :, start:])
            vn = transform_rows(qv, value[:, :, start:])
            parts = (kn, fake_rows(qk, kn), vn, fake_rows(qv, vn))
            if st is None:
                st = _LayerState(bufs=[p.clone() for p in parts], n=S, last_k=key[:, :, S - 1].clone())
            else:
                st.append(parts)
                st.last_k = key[:, :, S - 1].clone()
            self._state[idx] = st
        return st

    def __call__(self, module, query, key, value, scaling=None):
        idx = module.layer_idx
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[-2]
        if scaling is None:
            scaling = D ** -0.5
        entry = self.layers[idx]
        if entry is None:
            return causal_attention(query, key, value, scaling, module.num_key_value_groups)
        qk, qv = entry
        G = Hq // Hkv
        tq, tinv = self._matrices(idx, Hkv, query.device)
        st = self._rows(idx, qk, qv, key, value)
        call_start = S - T
        # q' per KV head group: [B, Hkv, G, T, D]
        qt = torch.einsum("bhgtd,hde->bhgte", query.float().reshape(B, Hkv, G, T, D), tq)
        if self.mode == "decode" and call_start == 0 and T > 1 and query.device.type == "cpu":
            # Whole sequence in one call (teacher-forced PPL): the CPU flash-attention fast path
            # (a GPU runs the blocked path below, fast enough there).
            rep = lambda x: x[:, :, :S].repeat_interleave(G, dim=1)  # noqa: E731
            o = decode_full_sequence(qt.reshape(B, Hq, T, D), rep(st.ke), rep(st.ve), rep(st.kq), rep(st.vq),
                                     self.sink, self.recent, scaling)
            o = torch.einsum("bhgte,hed->bhgtd", o.reshape(B, Hkv, G, T, D), tinv)
            return o.reshape(B, Hq, T, D).transpose(1, 2).to(query.dtype)
        out = torch.empty(B, Hkv, G, T, D, dtype=torch.float32, device=query.device)
        for a in range(0, T, self.block):
            b = min(T, a + self.block)
            qpos = torch.arange(call_start + a, call_start + b, device=query.device)
            L = call_start + b  # keys past the block's last query are never visible
            quant = quantized_mask(qpos, L, self.sink, self.recent, chunk_starts(qpos, self.mode, call_start))
            out[:, :, :, a:b] = mixed_attention(
                qt[:, :, :, a:b], st.ke[:, :, :L], st.ve[:, :, :L], st.kq[:, :, :L], st.vq[:, :, :L],
                qpos, quant, scaling)
        o = torch.einsum("bhgte,hed->bhgtd", out, tinv)
        return o.reshape(B, Hq, T, D).transpose(1, 2).to(query.dtype)
