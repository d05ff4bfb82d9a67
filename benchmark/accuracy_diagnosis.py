"""Why INT2 retrieval fails as the history grows: per-layer / per-head attention diagnostics and
candidate fixes, scored on the same NIAH samples (docs/results/accuracy.md, "Diagnosis").

For every NIAH sample the prompt is prefilled once with the exact model (a one-chunk server
prefill reads exact K/V), the bf16 model's greedy answer is decoded once, and then every method
re-reads that answer teacher-forced in one call whose queries see the method's INT2 history
(server decode semantics: sink and recent window exact, the rest reconstructed). A method
*keeps* a sample when its argmax equals the bf16 token at every answer position, i.e. its greedy
decode would write the same answer; `kept` is the share of the samples bf16 answers correctly.
The same call records, per layer and query head, against the exact attention of the same
queries: the attention mass on the needle value's tokens, the mass on the quantized history,
KL(exact || method) and the logit error on quantized keys.

    python benchmark/accuracy_diagnosis.py --device cuda --samples 30 --out $OUT/diagnosis.json
    # K at 3 bits funded by V at 1 (2.5 bits/element), on the served bundle:
    python benchmark/accuracy_diagnosis.py --set bits --bundle served=zoo/<served bundle> --top-heads --out ...
    # the history rows the prompt's end attends to most kept in BF16 (32 / 64 / 128 per layer and KV head), on the
    # served bundle's format (float8 parameters and, in a format-v2 bundle, its INT4-key heads):
    python benchmark/accuracy_diagnosis.py --set keep --bundle served=zoo/<served bundle> --top-heads --out ...
    # keys quantized per channel over blocks of 64 tokens (KIVI's grouping) instead of per token:
    python benchmark/accuracy_diagnosis.py --set channel --bundle served=zoo/<served bundle> --top-heads --out ...
    # INT4 keys on the KV heads INT2 keys disturb most on calibration text, paid for by float8 (scale, min):
    python benchmark/accuracy_diagnosis.py --set headbits --bundle served=zoo/<served bundle> --top-heads --out ...
    # the same methods' perplexity instead (decode semantics, the table's windows: 4 x 8192 tokens, PPL@4k and @8k):
    python benchmark/accuracy_diagnosis.py --set channel --bundle served=zoo/<served bundle> --ppl 4 --out ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_oscar.config import CacheLayout, QuantFormat  # noqa: E402
from sglang_oscar.eval.niah import _greedy_tokens, _truncate, make_samples  # noqa: E402
from sglang_oscar.eval.simulator import MixedCacheSimulator, quantized_mask  # noqa: E402
from sglang_oscar.hf_attention import attention_override, causal_attention  # noqa: E402
from sglang_oscar.quant.intq import _grouped  # noqa: E402
from sglang_oscar.quant.kv import SideQuantizer, clip_rows  # noqa: E402

SINK, RECENT = 64, 256
TASKS = ("niah_single_1", "niah_multikey_1", "niah_multivalue")


class Recorder:
    """Per (layer, query head) sums over answer queries of one (method, length, task) cell."""

    def __init__(self, layers: int, heads: int):
        z = lambda: torch.zeros(layers, heads, dtype=torch.float64)  # noqa: E731
        self.sums = {k: z() for k in ("needle_e", "needle_q", "hist_e", "hist_q", "kl", "err_mean", "err_sq")}
        self.count = 0
        self.needle: list[int] = []

    def add(self, layer: int, pe, pq, se, sq_raw, quant):
        # p* [Hq, T, S] (batch 1), quant [T, S]
        nd = torch.tensor(self.needle, device=pe.device, dtype=torch.long)
        s = self.sums
        s["needle_e"][layer] += pe[..., nd].sum(-1).sum(-1).double().cpu()
        s["needle_q"][layer] += pq[..., nd].sum(-1).sum(-1).double().cpu()
        qm = quant.float()
        s["hist_e"][layer] += (pe * qm).sum(-1).sum(-1).double().cpu()
        s["hist_q"][layer] += (pq * qm).sum(-1).sum(-1).double().cpu()
        kl = (pe * (torch.log(pe.clamp_min(1e-30)) - torch.log(pq.clamp_min(1e-30)))).sum(-1)
        s["kl"][layer] += kl.sum(-1).double().cpu()
        n = qm.sum(-1).clamp_min(1)  # [T]
        d = (sq_raw - se) * qm
        s["err_mean"][layer] += (d.sum(-1) / n).sum(-1).double().cpu()
        s["err_sq"][layer] += ((d * d).sum(-1) / n).sum(-1).double().cpu()
        if layer == 0:
            self.count += pe.shape[-2]

    def result(self) -> dict:
        c = max(self.count, 1)
        return {k: (v / c).tolist() for k, v in self.sums.items()} | dict(queries=self.count)


class ProbeSim(MixedCacheSimulator):
    """The simulator with knobs for the diagnosis (decode calls only; prefill is exact).

    k_exact / v_exact: read that side exact (quantize only the other).
    exact_k_heads: {(layer, kv_head)} whose keys are read exact.
    k_bits: quantize keys at this many bits (same transform and clip).
    k4_heads: {layer: [kv heads]} whose keys are INT4 (no clip), every other head's INT2 (the bundle's own INT4-key
        heads not kept): the per-head bit allocation of --set headbits; {} is INT2 keys on every head.
    vc: subtract half the expected variance of each quantized key's logit error, estimated as
        kappa_l * sum_g |q_g|^2 * scale_g^2 ("scale"; kappa_l = E[err^2] / E[scale^2] of the layer)
        or from the row's actual error ("oracle").
    """

    def __init__(self, layers, *, k_exact=False, v_exact=False, exact_k_heads=(), vc=None, recorder=None, keep=None,
                 k_channel=None, k_blockmean=None, k4_heads=None):
        super().__init__(layers, sink=SINK, recent=RECENT, mode="prefill")
        self.k4_heads = k4_heads  # {layer: [kv heads]} whose keys are quantized at 4 bits (per-head bit allocation)
        self.k_blockmean = k_blockmean  # dict(block): a per-channel block mean plus the per-token INT2 residual
        self.k_channel = k_channel  # dict(block): keys quantized per channel over blocks of tokens
        self.k_exact, self.v_exact, self.vc = k_exact, v_exact, vc
        self.exact_k_heads = set(exact_k_heads)
        self.recorder = recorder
        self.keep = keep  # {layer: bool [Hkv, prompt length]}: history rows read exact (Observer's selection)

    def __call__(self, module, query, key, value, scaling=None):
        idx = module.layer_idx
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[-2]
        entry = self.layers[idx]
        call_start = S - T
        if entry is None or call_start == 0:
            return super().__call__(module, query, key, value, scaling)
        if B != 1:
            raise ValueError("the diagnosis runs one sample at a time")
        scaling = D ** -0.5 if scaling is None else scaling
        qk, qv = entry
        G = Hq // Hkv
        tq, tinv = self._matrices(idx, Hkv, query.device)
        st = self._rows(idx, qk, qv, key, value)
        ke, kq, ve, vq = st.ke[:, :, :S], st.kq[:, :, :S], st.ve[:, :, :S], st.vq[:, :, :S]
        kq, vq = row_knobs(self, qk, qv, ke, kq, ve, vq, idx)
        if self.exact_k_heads and not self.k_exact:
            kq = kq.clone()
            for (layer, h) in self.exact_k_heads:
                if layer == idx:
                    kq[:, h] = ke[:, h]
        qt = torch.einsum("bhgtd,hde->bhgte", query.float().reshape(B, Hkv, G, T, D), tq)
        qpos = torch.arange(call_start, S, device=query.device)
        quant = quantized_mask(qpos, S, self.sink, self.recent, torch.full_like(qpos, call_start))
        if self.keep is not None:  # the selected rows read exact: a per-KV-head mask [1, Hkv, 1, T, S]
            kept = torch.zeros(Hkv, S, dtype=torch.bool, device=query.device)
            sel = self.keep[idx][:, :S]
            kept[:, :sel.shape[1]] = sel
            quant = (quant[None, :, :] & ~kept[:, None, :])[None, :, None]
        future = torch.arange(S, device=query.device)[None, :] > qpos[:, None]
        se = (qt @ ke.unsqueeze(2).transpose(-1, -2)) * scaling
        sq_raw = (qt @ kq.unsqueeze(2).transpose(-1, -2)) * scaling
        sq = torch.where(quant, sq_raw, se)
        if self.vc is not None and not self.k_exact:
            gk = qk.group
            if self.vc == "oracle":
                var = _grouped((kq - ke) ** 2, gk).mean(-1)  # [B, Hkv, S, ng]
            else:
                scale = qk.quantize_transformed(ke).scale.float()  # [B, Hkv, S, ng]
                err = _grouped((kq - ke) ** 2, gk).mean(-1)
                kappa = (err.mean() / (scale ** 2).mean().clamp_min(1e-30))
                var = kappa * scale ** 2
            qn = _grouped(qt, gk).pow(2).sum(-1)  # [B, Hkv, G, T, ng]
            corr = 0.5 * scaling ** 2 * torch.einsum("bhgtn,bhsn->bhgts", qn, var)
            sq = sq - torch.where(quant, corr, torch.zeros_like(corr))
        se = se.masked_fill(future, float("-inf"))
        sq = sq.masked_fill(future, float("-inf"))
        pe, pq = torch.softmax(se, -1), torch.softmax(sq, -1)
        out = pq @ ve.unsqueeze(2) + (pq * quant) @ (vq - ve).unsqueeze(2)
        if self.recorder is not None:
            self.recorder.add(idx, pe.reshape(Hq, T, S), pq.reshape(Hq, T, S), se.reshape(Hq, T, S).nan_to_num(0),
                              sq_raw.reshape(Hq, T, S), quant)
        o = torch.einsum("bhgte,hed->bhgtd", out, tinv)
        return o.reshape(B, Hq, T, D).transpose(1, 2).to(query.dtype)


def row_knobs(sim, qk, qv, ke, kq, ve, vq, idx):
    """(kq, vq): the rows of layer idx as a simulator's knobs reconstruct them (k4_heads, k_channel, k_blockmean, then
    k_exact / v_exact read that side exact), from the exact rows ke / ve and the served quantizer's kq / vq."""
    if sim.k4_heads is not None:
        kq = int2_everywhere(qk).fake_transformed(ke)
        if sim.k4_heads.get(idx):
            k4 = dataclasses.replace(qk, bits=4, clip_ratio=1.0, k4_heads=()).fake_transformed(ke)  # INT4: no clip
            for h in sim.k4_heads[idx]:
                kq[:, h] = k4[:, h]
    if sim.k_channel is not None:
        kq = channel_quantized(ke, **sim.k_channel)
    if sim.k_blockmean is not None:
        kq = blockmean_quantized(ke, qk, **sim.k_blockmean)
    return (ke if sim.k_exact else kq), (ve if sim.v_exact else vq)


class RowSim(MixedCacheSimulator):
    """The PPL harness's decode semantics (every position reads the INT2 history beyond the windows) with a method's
    row knobs: how K and V rows are reconstructed (k_blockmean, k_channel, k4_heads, k_exact, v_exact as in
    ProbeSim)."""

    KNOBS = ("k_blockmean", "k_channel", "k_exact", "v_exact", "k4_heads")

    def __init__(self, layers, *, k_blockmean=None, k_channel=None, k_exact=False, v_exact=False, k4_heads=None):
        super().__init__(layers, sink=SINK, recent=RECENT, mode="decode")
        self.k_blockmean, self.k_channel = k_blockmean, k_channel
        self.k_exact, self.v_exact = k_exact, v_exact
        self.k4_heads = k4_heads

    def _rows(self, idx, qk, qv, key, value):
        st = super()._rows(idx, qk, qv, key, value)
        k0, v0 = st.kq, st.vq
        kq, vq = row_knobs(self, qk, qv, st.ke, k0, st.ve, v0, idx)
        if kq is not k0:
            st.bufs[1][:, :, :st.n] = kq
        if vq is not v0:
            st.bufs[3][:, :, :st.n] = vq
        return st


def int2_everywhere(q: SideQuantizer) -> SideQuantizer:
    """q without INT4-key heads: its fake_transformed quantizes every row at q.bits with q's clip, whatever the row
    layout (the knobs' rows are [B, H, S, D], not the [..., H, D] that q's per-head widths index)."""
    return dataclasses.replace(q, k4_heads=())


def _token_blocks(ke: torch.Tensor, block: int):
    """(a copy of ke to write into, ke's whole blocks of `block` tokens as fp32 [B, H, nb, block, D], rows in them);
    None when no block is whole. Blocks are aligned at position 0; the rows past the last whole one stay exact (they
    are inside the recent window)."""
    B, H, S, D = ke.shape
    n = (S // block) * block
    if n == 0:
        return None
    return ke.clone(), ke[:, :, :n].float().reshape(B, H, n // block, block, D), n


def channel_quantized(ke: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Keys [B, H, S, D] quantized per channel over blocks of `block` tokens (KIVI's grouping): one bf16 (scale, min)
    per channel and block, 4 uniform levels between the block's min and max."""
    blocks = _token_blocks(ke, block)
    if blocks is None:
        return ke.clone()
    out, x, n = blocks
    lo = x.amin(3, keepdim=True).to(torch.bfloat16).float()
    scale = ((x.amax(3, keepdim=True) - x.amin(3, keepdim=True)) / 3).to(torch.bfloat16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.floor((x - lo) / safe + 0.5).clamp(0, 3)
    out[:, :, :n] = (lo + scale * code).reshape(out[:, :, :n].shape).to(ke.dtype)
    return out


def blockmean_quantized(ke: torch.Tensor, qk: SideQuantizer, block: int = 64) -> torch.Tensor:
    """Keys [B, H, S, D] as a bf16 per-channel mean of each block of `block` tokens plus the row's residual quantized
    per token by the served quantizer at INT2 on every head (its clip, float8 (scale, min)). The block mean follows
    what a global K mean cannot: the slow RoPE pairs turning the keys' common part with position."""
    blocks = _token_blocks(ke, block)
    if blocks is None:
        return ke.clone()
    out, x, n = blocks
    m = x.mean(3, keepdim=True).to(torch.bfloat16).float()
    r = (x - m).reshape(out[:, :, :n].shape)
    rq = int2_everywhere(qk).fake_transformed(r)
    out[:, :, :n] = (m + rq.reshape(x.shape)).reshape(r.shape).to(ke.dtype)
    return out


def rank_kv_heads(model, tok, layers, device, windows: int = 2, length: int = 8192, tail: int = 64) -> list:
    """(layer, KV head) pairs, most damaged first, with their score: the attention KL(exact || INT2) of the served
    quantizer (layers), summed over the KV head's query heads, for the last `tail` positions of `windows` windows of the
    calibration text, each read in decode semantics after an exact prefill of the rest. Only calibration text: the
    NIAH samples that judge the allocation never choose it."""
    from sglang_oscar.data import calibration_text, token_windows

    cfg = model.config
    L, Hq, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    rec = Recorder(L, Hq)
    for w in token_windows(tok, calibration_text(), length, windows):
        pre = model(input_ids=torch.tensor([w[:-tail]], device=device), use_cache=True, logits_to_keep=1)
        with ProbeSim(layers, recorder=rec).attach(model):
            model(input_ids=torch.tensor([w[-tail:]], device=device), past_key_values=pre.past_key_values,
                  use_cache=True)
    kl = torch.tensor(rec.result()["kl"]).reshape(L, Hkv, Hq // Hkv).sum(-1).flatten().tolist()
    return [(i // Hkv, i % Hkv, kl[i]) for i in sorted(range(len(kl)), key=lambda i: -kl[i])]


class Observer:
    """An exact attention (for the prompt's prefill) that also selects, per layer and KV head, the `keep` history rows
    (outside the sink and the prompt's recent window) the prompt's last `obs` queries attend to most: attention summed
    over the group's query heads and those queries, max-pooled over 7 neighbouring positions so a span is kept whole
    (SnapKV's selection). A server would run it once at the end of a prefill and keep those rows in BF16."""

    def __init__(self, keeps, obs: int = 32):
        self.keeps, self.obs, self.sel = sorted(keeps), obs, {k: {} for k in keeps}

    def __call__(self, module, query, key, value, scaling=None):
        B, Hq, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[-2]
        scaling = D ** -0.5 if scaling is None else scaling
        out = causal_attention(query, key, value, scaling, module.num_key_value_groups)
        n = min(self.obs, T)
        q = query[0, :, -n:].float().reshape(Hkv, Hq // Hkv, n, D)
        s = torch.einsum("hgtd,hsd->hgts", q, key[0].float()) * scaling
        qpos = torch.arange(S - n, S, device=query.device)
        s = s.masked_fill(torch.arange(S, device=query.device)[None, :] > qpos[:, None], float("-inf"))
        score = torch.softmax(s, -1).sum((1, 2))  # [Hkv, S]
        score = torch.nn.functional.max_pool1d(score[None], 7, stride=1, padding=3)[0]
        cand = torch.zeros(S, dtype=torch.bool, device=query.device)
        cand[SINK:max(SINK, S - RECENT)] = True
        score = score.masked_fill(~cand, float("-inf"))
        order = score.topk(min(max(self.keeps), int(cand.sum())), -1).indices
        for k in self.keeps:
            mask = torch.zeros(Hkv, S, dtype=torch.bool, device=query.device)
            mask.scatter_(1, order[:, :k], True)
            self.sel[k][module.layer_idx] = mask
        return out


def needle_positions(tok, ids: list[int], values: list[str]) -> list[int]:
    """Token positions of every answer value in the prompt (character offsets of a re-encoding)."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    if len(enc["input_ids"]) != len(ids):  # BOS or a different split: align from the end
        shift = len(ids) - len(enc["input_ids"])
    else:
        shift = 0
    pos = []
    for v in values:
        c = text.rfind(v)
        if c < 0:
            continue
        pos += [i + shift for i, (a, b) in enumerate(offs) if a < c + len(v) and b > c]
    return pos


@dataclasses.dataclass
class AnyBits(SideQuantizer):
    """A side quantized at a width the served format does not have (diagnostic, --set bits): 3 bits = 8 uniform
    levels between the clipped group's min and max; 1 bit = two levels per group, the means of the values below and
    above the group's mean (a one-step Lloyd fit), stored like (scale, min) in two bf16 values."""

    def fake_transformed(self, xt: torch.Tensor) -> torch.Tensor:
        if self.bits in (2, 4):
            return super().fake_transformed(xt)
        xg = _grouped(clip_rows(xt, self.clip_ratio).float(), self.group)
        if self.bits == 1:
            hi_mask = xg >= xg.mean(-1, keepdim=True)
            cnt_hi = hi_mask.sum(-1, keepdim=True).clamp_min(1)
            cnt_lo = (~hi_mask).sum(-1, keepdim=True).clamp_min(1)
            hi = ((xg * hi_mask).sum(-1, keepdim=True) / cnt_hi).to(torch.bfloat16).float()
            lo = ((xg * ~hi_mask).sum(-1, keepdim=True) / cnt_lo).to(torch.bfloat16).float()
            out = torch.where(hi_mask, hi, lo)
        elif self.bits == 3:
            lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            scale = ((hi - lo) / 7).to(torch.bfloat16).float()
            lo = lo.to(torch.bfloat16).float()
            t = torch.where(scale > 0, (xg - lo) / torch.where(scale > 0, scale, torch.ones_like(scale)), 0 * xg)
            out = lo + scale * torch.floor(t + 0.5).clamp(0, 7)
        else:
            raise ValueError(f"AnyBits: {self.bits} bits")
        return out.reshape(xt.shape).to(xt.dtype)


@dataclasses.dataclass
class Method:
    name: str
    bundle: str  # None for bf16
    bits_note: str
    kw: dict
    diag: bool = False  # record the per-head arrays

    def parts(self) -> tuple:
        """(k_bits, v_bits, k_ident): what the layers' quantizers take; and the simulator's knobs (the rest of kw)."""
        kw = dict(self.kw)
        return (kw.pop("k_bits", None), kw.pop("v_bits", None), kw.pop("k_ident", False)), kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--top-heads", type=int, nargs="*", default=[3, 9])
    ap.add_argument("--set", choices=("methods", "context", "offsets", "bits", "keep", "channel", "headbits"),
                    default="methods",
                    help="methods: fixes at the 2k calibration; context: calibration window length; offsets: "
                         "2k windows spread over RoPE positions up to 8k")
    ap.add_argument("--bundle", action="append", default=[], help="NAME=PATH: also evaluate this bundle")
    ap.add_argument("--methods", nargs="+", default=None, help="evaluate only these methods of the set (bf16 always)")
    ap.add_argument("--ppl", type=int, default=0, metavar="N",
                    help="perplexity instead of NIAH: N windows of 8192 tokens of the evaluation text, PPL@4k and @8k "
                         "in decode semantics, paired against bf16 (methods with row knobs only)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)

    from sglang_oscar.calibrate import calibrate_many
    from sglang_oscar.models import load_model

    t0 = time.time()
    model, tok, model_id = load_model("smollm2", device=args.device)
    cfgm = model.config
    L, Hq = cfgm.num_hidden_layers, cfgm.num_attention_heads
    variants = {
        "naive": dict(method="identity", clip=None, k_group=64, v_group=64, bits=2),
        "hadamard_clip": dict(method="hadamard", clip="auto", k_group=64, v_group=64, bits=2),
        "best": dict(method="balanced", center_k=True, clip="auto", k_group=64, v_group=64, bits=2),
        "best_noclip": dict(method="balanced", center_k=True, clip=None, k_group=64, v_group=64, bits=2),
        "best_kg32": dict(method="balanced", center_k=True, clip="auto", k_group=32, v_group=64, bits=2),
    }
    long_variants = {
        "hadamard_clip_8k": dict(method="hadamard", clip="auto", k_group=64, v_group=64, bits=2),
        "best_8k": dict(method="balanced", center_k=True, clip="auto", k_group=64, v_group=64, bits=2),
        "balanced_clip_8k": dict(method="balanced", clip="auto", k_group=64, v_group=64, bits=2),
        "oscar_clip_8k": dict(method="oscar", clip="auto", k_group=64, v_group=64, bits=2),
        "pca_clip_8k": dict(method="pca", clip="auto", k_group=64, v_group=64, bits=2),
        "int4_hadamard_8k": dict(method="hadamard", clip="auto", k_group=64, v_group=64, bits=4),
    }
    if args.set == "context":
        variants = {k: variants[k] for k in ("hadamard_clip", "best")}
    if args.set == "offsets":
        variants = {"best_offsets": variants["best"]}
    if args.set in ("bits", "keep", "channel", "headbits"):  # on the served bundle (--bundle served=PATH)
        variants = {}
    bundles = {}
    if variants:
        bundles, _ = calibrate_many(model, tok, variants, tokens=args.calib_tokens, seq_len=2048,
                                    heldout_tokens=4096, progress=False, model_id=model_id,
                                    context=8192 if args.set == "offsets" else None)
    for item in args.bundle:
        from sglang_oscar.rotation import load_bundle

        name, path = item.split("=", 1)
        bundles[name] = load_bundle(path)
    print(f"calibrated {len(bundles)} bundles in {time.time() - t0:.0f} s", flush=True)
    if args.set == "context":
        # The same methods calibrated on windows as long as the model's context (8k): post-RoPE keys
        # at positions the 2k windows never reach rotate their slow RoPE pairs to new phases.
        t1 = time.time()
        more, _ = calibrate_many(model, tok, long_variants, tokens=32768, seq_len=8192, heldout_tokens=8192,
                                 progress=False, model_id=model_id)
        bundles.update(more)
        print(f"calibrated {len(more)} 8k-window bundles in {time.time() - t1:.0f} s", flush=True)

    def layers(name, k_bits=None, v_bits=None, k_ident=False):
        out = []
        for i in range(L):
            if name == "k4_v2_8k":  # K from the INT4 bundle (its own clip), V from the INT2 one
                qk = bundles["int4_hadamard_8k"].layer_quantizers(i, bits=4)[0]
                qv = bundles["hadamard_clip_8k"].layer_quantizers(i, bits=2)[1]
            else:
                qk, qv = bundles[name].layer_quantizers(i, bits=2)
            if k_ident:  # keys in their own basis (post-RoPE channels), no mean
                qk = dataclasses.replace(qk, matrix=torch.eye(qk.matrix.shape[-1]), mean=None)
            if k_bits is not None:
                qk = AnyBits(**{**dataclasses.asdict(qk), "bits": k_bits})
            if v_bits is not None:
                qv = AnyBits(**{**dataclasses.asdict(qv), "bits": v_bits})
            on = lambda x: None if x is None else x.to(args.device)  # noqa: E731
            qk = dataclasses.replace(qk, matrix=on(qk.matrix), mean=on(qk.mean))
            qv = dataclasses.replace(qv, matrix=on(qv.matrix), mean=on(qv.mean))
            out.append((qk, qv))
        return out

    nkv = cfgm.num_key_value_heads

    def side_bits(bits, group):
        """Bits per element of one side with codes of `bits` in groups of `group`: float8 (scale, min) at the served
        widths 2 and 4 (config.QuantFormat), bf16 ones at AnyBits' diagnostic widths 1 and 3 (b + 32 / group)."""
        return QuantFormat(bits, group).bits_per_element if bits in (2, 4) else bits + 2 * 16 / group

    def kv_bits(name, k_bits=None, v_bits=None, k4_heads=None):
        """(K, V) bits per element of the quantized history as layers(name, k_bits, v_bits) stores it, K averaged over
        the (layer, KV head) pairs: the bundle's INT4-key heads count unless k_bits gives every head its width (AnyBits
        at 1, 3 or 4 bits) or the k4_heads knob ({layer: [KV heads]}) replaces them."""
        if name == "k4_v2_8k":
            return side_bits(4, bundles["int4_hadamard_8k"].k_group), side_bits(2, bundles["hadamard_clip_8k"].v_group)
        b = bundles[name]
        v = side_bits(2 if v_bits is None else v_bits, b.v_group)
        if k_bits not in (None, 2):
            return side_bits(k_bits, b.k_group), v
        k4 = b.k4_count if k4_heads is None else sum(len(h) for h in k4_heads.values())
        lay = CacheLayout(k=QuantFormat(2, b.k_group), v=QuantFormat(2, b.v_group), k4_heads=k4)
        return 2 * lay.bits_per_element(L, nkv) - lay.v.bits_per_element, v

    def num(x):  # 2.25, 2.739, 16
        return f"{x:.3f}".rstrip("0").rstrip(".")

    def avg(name, **kw):  # the method's bits per element over K and V, as a label
        k, v = kv_bits(name, **kw)
        return num((k + v) / 2)

    def kv_label(k, v):  # "K x / V y = average"
        return f"K {num(k)} / V {num(v)} = {num((k + v) / 2)}"

    def kv(name, **kw):
        return kv_label(*kv_bits(name, **kw))

    if args.set == "methods":  # labels read the bundles, which only this set fits
        methods = [
            Method("bf16", None, "16", {}),
            Method("int2_naive", "naive", avg("naive"), {}),
            Method("int2_hadamard_clip", "hadamard_clip", avg("hadamard_clip"), {}),
            Method("int2_best", "best", avg("best"), {}, diag=True),
            Method("int2_best_noclip", "best_noclip", avg("best_noclip"), {}),
            Method("int2_best_kq_only", "best", f"K {num(kv_bits('best')[0])} / V 16 (diagnostic)", dict(v_exact=True),
                   diag=True),
            Method("int2_best_vq_only", "best", f"K 16 / V {num(kv_bits('best')[1])} (diagnostic)", dict(k_exact=True),
                   diag=True),
            Method("int2_best_k4", "best", kv("best", k_bits=4), dict(k_bits=4)),
            Method("int2_best_kg32", "best_kg32", kv("best_kg32"), {}),
            Method("int2_best_vc", "best", avg("best"), dict(vc="scale"), diag=True),
            Method("int2_best_vc_oracle", "best", f"{avg('best')} + per-row error (diagnostic)", dict(vc="oracle")),
            Method("int2_hadamard_clip_vc", "hadamard_clip", avg("hadamard_clip"), dict(vc="scale")),
        ]

    if args.set == "context":
        methods = [
            Method("bf16", None, "16", {}),
            Method("int2_hadamard_clip", "hadamard_clip", avg("hadamard_clip"), {}),
            Method("int2_best", "best", avg("best"), {}),
            Method("int2_hadamard_clip_8k", "hadamard_clip_8k", avg("hadamard_clip_8k"), {}, diag=True),
            Method("int2_best_8k", "best_8k", avg("best_8k"), {}, diag=True),
            Method("int2_balanced_clip_8k", "balanced_clip_8k", avg("balanced_clip_8k"), {}),
            Method("int2_oscar_clip_8k", "oscar_clip_8k", avg("oscar_clip_8k"), {}),
            Method("int2_pca_clip_8k", "pca_clip_8k", avg("pca_clip_8k"), {}),
            Method("k4_v2_8k", "k4_v2_8k", kv("k4_v2_8k") + " (diagnostic)", {}),
        ]

    if args.set == "offsets":
        # 2k windows spread over RoPE positions [0, 8k) against 8k windows (--bundle best_8k=...)
        methods = [Method("bf16", None, "16", {}),
                   Method("int2_best_offsets", "best_offsets", avg("best_offsets"), {}, diag=True)]
        methods += [Method(f"int2_{n}", n, avg(n), {}) for n in bundles if n != "best_offsets"]

    if args.set == "bits":
        # bits per element = codes + two parameters per group (kv_bits): float8 at 2 and 4 bits (b + 0.25 at groups
        # of 64), bf16 at AnyBits' 1 and 3 (b + 0.5); K counts the bundle's INT4-key heads only at 2 bits (k_bits 3 or
        # 4 gives every head its width)
        methods = [Method("bf16", None, "16", {}),
                   Method("int2_best", "served", kv("served"), {}, diag=True),
                   Method("k3_v1", "served", kv("served", k_bits=3, v_bits=1), dict(k_bits=3, v_bits=1), diag=True),
                   Method("k2_v1", "served", kv("served", v_bits=1) + " (diagnostic: V at 1 bit alone)",
                          dict(v_bits=1)),
                   Method("k3_v2", "served", kv("served", k_bits=3) + " (diagnostic: K at 3 bits alone)",
                          dict(k_bits=3)),
                   Method("k4_v1", "served", kv("served", k_bits=4, v_bits=1), dict(k_bits=4, v_bits=1))]

    if args.set == "keep":
        # the history rows the prompt's end attends to most kept in BF16 (Observer), per layer and KV head, on the
        # served bundle's format (float8 (scale, min), INT4 keys on the bundle's INT4-key heads); bits at 8k: the
        # format's + k * 16 / 8192 (the sink and window are BF16 in every method)
        b = bundles["served"]
        served_bits = sum(kv_bits("served")) / 2
        methods = [Method("bf16", None, "16", {}),
                   Method("int2_best", "served", f"{served_bits:.3f} (INT4 keys on {b.k4_count} of {L * nkv} KV heads)",
                          {})]
        methods += [Method(f"int2_best_keep{k}", "served", f"{served_bits:.3f} + {k * 16 / 8192:.3f} (BF16 rows at 8k)",
                           dict(keep=k)) for k in (32, 64, 128)]

    if args.set == "channel":
        # keys grouped along tokens: per channel over blocks of 64 tokens (KIVI), or a per-channel block mean plus the
        # per-token INT2 residual ("kbm"); K bits: kbm = codes + float8 (scale, min) (0.25 at groups of 64, every
        # head INT2) + bf16 block mean (16 / block); kchan = codes + bf16 (scale, min) per channel and block (32 /
        # block); V the served quantizer's
        k_served, v_served = kv_bits("served")
        chan = lambda block: 2 + 2 * 16 / block  # noqa: E731
        bm = lambda block: QuantFormat(2, bundles["served"].k_group).bits_per_element + 16 / block  # noqa: E731
        methods = [Method("bf16", None, "16", {}), Method("int2_best", "served", avg("served"), {}, diag=True),
                   Method("kchan_served", "served",
                          f"{num((chan(64) + v_served) / 2)} (K per channel over 64 tokens, served basis)",
                          dict(k_channel=dict(block=64))),
                   Method("kbm64_fp8", "served", kv_label(bm(64), v_served), dict(k_blockmean=dict(block=64)),
                          diag=True),
                   Method("kbm32_fp8_vfp8", "served", kv_label(bm(32), v_served), dict(k_blockmean=dict(block=32)),
                          diag=True),
                   Method("k3_v2", "served", kv("served", k_bits=3) + " (reference: K at 3 bits)", dict(k_bits=3)),
                   Method("kbm32_fp8_vfp8_keep64", "served",
                          f"{num((bm(32) + v_served) / 2)} + {num(64 * 16 / 8192)} (64 BF16 rows at 8k)",
                          dict(k_blockmean=dict(block=32), keep=64)),
                   Method("served_kq_only", "served", f"K {num(k_served)} / V 16 (diagnostic)", dict(v_exact=True)),
                   Method("served_vq_only", "served", f"K 16 / V {num(v_served)} (diagnostic)", dict(k_exact=True))]
        if args.lengths == [2048]:  # keys per channel in their post-RoPE basis (no transform): lost at 2k
            methods += [Method("kchan_raw", "served",
                               f"{num((chan(64) + v_served) / 2)} (K per channel over 64 tokens, post-RoPE basis)",
                               dict(k_channel=dict(block=64), k_ident=True)),
                        Method("kchan_raw_b32", "served",
                               f"{num((chan(32) + v_served) / 2)} (K per channel over 32 tokens, post-RoPE basis)",
                               dict(k_channel=dict(block=32), k_ident=True))]

    if args.set == "headbits":
        # per-head bit allocation at <= 2.5 bits: INT4 keys on the KV heads whose INT2 keys disturb attention most on
        # calibration text (rank_kv_heads), INT2 keys elsewhere (k4_heads: the bundle's own INT4-key heads not kept);
        # float8 (scale, min) (0.25 bits per element at groups of 64) funds the INT4 heads: 2.25 + 2 * n /
        # (layers x KV heads) for K, 2.25 for V
        ranked = rank_kv_heads(model, tok, layers("served"), args.device)
        nh = len(ranked)
        budget = int((2.5 - 2.25) * nh)  # INT4 heads that keep the average at 2.5: (2.25 + 2 n / nh + 2.25) / 2
        top = {}
        for layer, h, _ in ranked[:budget]:
            top.setdefault(layer, []).append(h)
        gen = torch.Generator().manual_seed(0)
        rand = {}
        for i in torch.randperm(nh, generator=gen)[:budget].tolist():
            rand.setdefault(ranked[i][0], []).append(ranked[i][1])
        every = {layer: list(range(cfgm.num_key_value_heads)) for layer in range(L)}
        # per-layer allocation (one key width per layer, what a layer-specialised kernel serves): every head of the
        # layers with the most summed KL, as many heads as the budget
        per_layer = {}
        for layer, _, kl in ranked:
            per_layer[layer] = per_layer.get(layer, 0.0) + kl
        top_layers = sorted(per_layer, key=per_layer.get, reverse=True)[: budget // nkv]
        layer_heads = {layer: list(range(nkv)) for layer in top_layers}
        print(f"INT4 keys on {budget} of {nh} KV heads; most damaged: "
              + ", ".join(f"L{a}h{b} {kl:.3f}" for a, b, kl in ranked[:8]), flush=True)
        bits = lambda heads: kv("served", k4_heads=heads)  # noqa: E731
        methods = [Method("bf16", None, "16", {}), Method("int2_best", "served", avg("served"), {}),
                   Method("int2_keys", "served", bits({}) + " (INT2 keys on every head)", dict(k4_heads={})),
                   Method(f"k4_top{budget}_fp8", "served", bits(top), dict(k4_heads=top)),
                   Method(f"k4_rand{budget}_fp8", "served", bits(rand) + " (control: random heads)",
                          dict(k4_heads=rand)),
                   Method(f"k4_layers{len(top_layers)}_fp8", "served", bits(layer_heads) + " (one key width per layer)",
                          dict(k4_heads=layer_heads)),
                   Method("k4_all_fp8", "served", bits(every) + " (reference: INT4 keys everywhere)",
                          dict(k4_heads=every))]
        extra_report = dict(heads_ranked=[list(r) for r in ranked], int4_heads=budget)
    else:
        extra_report = {}

    if args.methods:
        unknown = set(args.methods) - {m.name for m in methods}
        if unknown:
            raise SystemExit(f"--methods: {sorted(unknown)} not in --set {args.set} ({', '.join(m.name for m in methods)})")
        methods = [m for m in methods if m.name == "bf16" or m.name in args.methods]
    if args.ppl:
        return ppl_impl(args, model, tok, model_id, methods, layers, t0, extra_report)
    if args.top_heads and not any(m.name == "int2_best" and m.diag for m in methods):
        raise SystemExit(f"--top-heads ranks heads by int2_best's per-head diagnosis, which --set {args.set} "
                         f"{'does not record' if not args.methods else 'with these --methods does not run'}: "
                         "pass --top-heads with no value (the default ranks 3 and 9 heads)")

    def sim_of(m: Method, recorder=None, exact_k_heads=()):
        if m.bundle is None:
            return None
        layer_args, kw = m.parts()
        if "keep" in kw:
            kw["keep"] = observed[kw["keep"]]
        return ProbeSim(layers(m.bundle, *layer_args), recorder=recorder, exact_k_heads=exact_k_heads, **kw)

    observed = {}  # keep -> the Observer's selection for the current sample
    report = dict(model=model_id, sink=SINK, recent=RECENT, samples_per_cell=args.samples,
                  methods={m.name: dict(bits=m.bits_note) for m in methods}, cells={}, diag={}, **extra_report)
    dev = args.device

    def run_cell(length, task, mlist, extra_sims=None):
        samples = make_samples(tok, task, length, args.samples, seed=length)
        cell = {m.name: dict(kept=0, nll=0.0) for m in mlist}
        recs = {m.name: Recorder(L, Hq) for m in mlist if m.diag}
        extra_sims = extra_sims or {}
        for name in extra_sims:
            cell[name] = dict(kept=0, nll=0.0)
        n_ok = 0
        for s in samples:
            ids = torch.tensor([s.prompt_ids], device=dev)
            shared = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            first = int(shared.logits[0, -1].argmax())
            ans = _greedy_tokens(model, tok, first, shared.past_key_values, 12 * len(s.answers), len(s.answers))
            _truncate(shared.past_key_values, len(s.prompt_ids))
            text = tok.decode(ans)
            if not all(v in text for v in s.answers):
                continue  # bf16 misses it: nothing to keep
            n_ok += 1
            needle = needle_positions(tok, s.prompt_ids, s.answers)
            observed.clear()
            keeps = {m.kw["keep"] for m in mlist if "keep" in m.kw}
            if keeps:
                obs = Observer(keeps)
                with attention_override(model, obs):
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                observed.update(obs.sel)
            sims = {}
            for m in mlist:
                rec = recs.get(m.name)
                if rec is not None:
                    rec.needle = needle
                sims[m.name] = sim_of(m, rec)
            sims.update(extra_sims)
            # teacher-forced: feed ans[:-1], predict ans[1:] (ans[0] comes from the exact prefill)
            inp = torch.tensor([ans[:-1]], device=dev)
            tgt = torch.tensor(ans[1:], device=dev)
            # Only the answer's digits count (separators and closing words may differ harmlessly).
            digit = torch.tensor([tok.decode([t]).strip().isdigit() for t in ans[1:]], device=dev)
            for name, sim in sims.items():
                if sim is None:
                    cell[name]["kept"] += 1
                    continue
                with sim.attach(model):
                    out = model(input_ids=inp, past_key_values=shared.past_key_values, use_cache=True)
                _truncate(shared.past_key_values, len(s.prompt_ids))
                lp = torch.log_softmax(out.logits[0].float(), -1)
                cell[name]["kept"] += int(bool((lp.argmax(-1) == tgt)[digit].all()))
                cell[name]["nll"] += float(-lp[torch.arange(len(tgt), device=dev), tgt][digit].sum())
        for v in cell.values():
            v["kept_pct"] = round(100.0 * v["kept"] / max(n_ok, 1), 1)
            v["nll"] = round(v["nll"] / max(n_ok, 1), 4)
            v["n"] = n_ok
        return cell, {k: r.result() for k, r in recs.items()}, n_ok

    def top_heads():
        top_heads_impl(args, report, L, Hq, cfgm, methods, run_cell, sim_of)

    lengths = sorted(args.lengths, reverse=True)
    for li, length in enumerate(lengths):
        if li == 1 and args.top_heads:
            top_heads()
        for task in args.tasks:
            t = time.time()
            cell, diag, n_ok = run_cell(length, task, methods)
            report["cells"].setdefault(str(length), {})[task] = cell
            report["diag"].setdefault(str(length), {})[task] = diag
            print(f"[{length} {task}] bf16 solved {n_ok}/{args.samples}; kept %: "
                  + " ".join(f"{n}={c['kept_pct']:.0f}" for n, c in cell.items()) + f" ({time.time() - t:.0f} s)",
                  flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report))

    if len(lengths) == 1 and args.top_heads:
        top_heads()
    report["seconds"] = round(time.time() - t0, 1)
    report["device"] = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    report["torch"] = torch.__version__
    args.out.write_text(json.dumps(report))
    print(f"done in {report['seconds']} s -> {args.out}")
    return 0


def ppl_impl(args, model, tok, model_id, methods, layers, t0, extra_report=None) -> int:
    """--ppl: per-window PPL@4k / @8k of each method over the PPL table's windows, and the paired change against bf16
    (the table's Δ: mean over windows of PPL_method / PPL_bf16 - 1)."""
    from sglang_oscar.data import eval_text, token_windows
    from sglang_oscar.eval.ppl import perplexity

    windows = token_windows(tok, eval_text(), 8192, args.ppl)
    report = dict(model=model_id, sink=SINK, recent=RECENT, windows=len(windows), window_tokens=8192,
                  methods={m.name: dict(bits=m.bits_note) for m in methods}, ppl={}, **(extra_report or {}))
    for m in methods:
        sim = None
        if m.bundle is not None:
            layer_args, kw = m.parts()
            other = sorted(set(kw) - set(RowSim.KNOBS))
            if other:
                raise SystemExit(f"--ppl: {m.name} uses {other}, which act on one prompt's attention, not on rows")
            sim = RowSim(layers(m.bundle, *layer_args), **kw)
        t = time.time()
        r = perplexity(model, windows, sim=sim, progress=False, prefixes=(4096,))
        report["ppl"][m.name] = {"4096": r["prefix"][4096]["per_window"], "8192": r["per_window"]}
        print(f"[ppl] {m.name}: @4k {r['prefix'][4096]['mean']:.3f} @8k {r['mean']:.3f} ({time.time() - t:.0f} s)",
              flush=True)
    bf = report["ppl"].get("bf16")
    if bf is not None:
        for name, by_len in report["ppl"].items():
            report["methods"][name]["delta_pct"] = {
                k: round(100 * sum(a / b - 1 for a, b in zip(v, bf[k])) / len(v), 2) for k, v in by_len.items()}
            report["methods"][name]["delta_pct_per_window"] = {
                k: [round(100 * (a / b - 1), 2) for a, b in zip(v, bf[k])] for k, v in by_len.items()}
    report["seconds"] = round(time.time() - t0, 1)
    report["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report["torch"] = torch.__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for name, m in report["methods"].items():
        if "delta_pct" in m:
            print(f"{name:24s} {m['bits']:34s} Δ@4k {m['delta_pct']['4096']:+.2f}%  Δ@8k {m['delta_pct']['8192']:+.2f}%")
    return 0


def top_heads_impl(args, report, L, Hq, cfgm, methods, run_cell, sim_of):
    # Which heads carry the loss: rank (layer, kv head) by the needle mass int2_best loses at the
    # longest length, then read those heads' keys exact.
    Lmax = str(max(args.lengths))
    G = Hq // cfgm.num_key_value_heads
    drop = torch.zeros(L, cfgm.num_key_value_heads, dtype=torch.float64)
    for task in args.tasks:
        d = report["diag"][Lmax][task]["int2_best"]
        e, q = torch.tensor(d["needle_e"]), torch.tensor(d["needle_q"])
        drop += (e - q).clamp_min(0).reshape(L, -1, G).sum(-1)
    order = torch.argsort(drop.flatten(), descending=True).tolist()
    ranked = [(i // drop.shape[1], i % drop.shape[1]) for i in order]
    report["heads_by_needle_mass_lost"] = [[a, b, float(drop[a, b])] for a, b in ranked[:20]]
    best = next(m for m in methods if m.name == "int2_best")
    for k in args.top_heads:
        heads = ranked[:k]
        name = f"int2_best_exactK_top{k}"
        report["methods"][name] = dict(bits=f"{best.bits_note} + exact K on {k} of {L * cfgm.num_key_value_heads} "
                                            "KV heads (diagnostic)", heads=heads)
        for task in args.tasks:
            cell, _, _ = run_cell(int(Lmax), task, [], {name: sim_of(best, exact_k_heads=heads)})
            report["cells"][Lmax][task][name] = cell[name]
            print(f"[{Lmax} {task}] {name}: kept {cell[name]['kept_pct']:.0f}%", flush=True)
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
