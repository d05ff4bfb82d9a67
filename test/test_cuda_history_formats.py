"""The CUDA history stage (kernels/history_cuda.py, kernels/cuda/int2_history.cu) on the cache format's variants: INT4
keys on all or some KV heads of a layer (cache.k4_heads / k_hi: the kernel's K4 instances, in which an INT2 head reads
no high planes) beside all-INT2 layers, and float8 e4m3 (scale, min) pairs drawn from e4m3's
values in a range (zero, the subnormals 2^-9 .. 7 . 2^-9, negatives); every byte's decode is checked on CPU.

The kernel's partials are checked directly, without the Triton merge: history_cuda.launch into NaN-poisoned o_part /
lse_part, every partial written, and their LSE merge (here, in float64) against the float64 oracle
(quant/attention.py): the history rows [S, R) alone (dequantize_rows), and at D 128 with the window CTAs or the folded
window, the whole attention (mixed_decode_reference, sink positions without a sink row read from their records).
Relative error of o < 1e-2 (bf16 q, fp16 p . scale operands, 14-bit int8 q), of the LSE < 1e-2 log2 units. The CPU
side of the same code (register layouts, the INT4 nibble words, the param selectors and the e4m3 decode) is
test_cuda_history_layouts.py's; GPU-only tests skip without CUDA.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sglang_oscar.quant.attention import key_rows, dequantize_rows, mixed_decode_reference, segments

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and nvcc)")

TOL = 1e-2


def e4m3_values(lo: float, hi: float) -> torch.Tensor:
    """Every finite float8 e4m3 value in [lo, hi] (float32)."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)]
    return v[(v >= lo) & (v <= hi)].unique()


def k4_heads_of(k4, hkv):
    """The INT4-key heads of a test layer: none, all, or some (the odd ones)."""
    return {"none": (), "all": tuple(range(hkv)), "some": tuple(range(1, hkv, 2))}[k4]


def make_cache_case(lens, *, hkv, gqa, d, gk, gv, k4, page, ring_starts=None, sink=64, window=256, seed=0,
                    wide_params=False):
    """test_decode.make_case's random cache and decode inputs on CUDA, with INT4 keys (random k_hi bytes) on the heads
    k4_heads_of(k4, hkv); wide_params: (scale, min) drawn uniformly from e4m3's values (K scales in [0, 8], V in [0, 4], with
    zero and the subnormals; mins in [-8, 8] / [-4, 4]) instead of make_case's narrow range."""
    from test_decode import make_case

    case = make_case(lens, hkv=hkv, gqa=gqa, d=d, gk=gk, gv=gv, sink=sink, window=window, ring_starts=ring_starts,
                     pool_page=page, seed=seed, device="cuda")
    cache = case["cache"]
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    heads = k4_heads_of(k4, hkv)
    if heads:
        shape = list(cache.k_codes.shape)
        shape[1] = len(heads)
        hi = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device="cuda")
        cache = case["cache"] = dataclasses.replace(cache, k_hi=hi, k4_heads=heads)
    if wide_params:
        for prm, top in ((cache.k_params, 8.0), (cache.v_params, 4.0)):
            scales, mins = e4m3_values(0.0, top).cuda(), e4m3_values(-top, top).cuda()
            prm[..., 0] = scales[torch.randint(0, len(scales), prm.shape[:-1], generator=g, device="cuda")].to(prm.dtype)
            prm[..., 1] = mins[torch.randint(0, len(mins), prm.shape[:-1], generator=g, device="cuda")].to(prm.dtype)
    cache.validate()
    return case


def launch_partials(case, ns, window_splits=(0, 0), fold=False):
    """history_cuda.launch into NaN-poisoned partials; returns (o_part, lse_part) [B, Hq, NS_TOTAL(, D)], float64."""
    from sglang_oscar.kernels import history_cuda

    q, cache = case["q"], case["cache"]
    b, hq, d = q.shape
    ns_total = ns + sum(window_splits)
    o_part = torch.full((b, hq, ns_total, d), float("nan"), device="cuda")
    lse_part = torch.full((b, hq, ns_total), float("nan"), device="cuda")
    history_cuda.check_supported(d, hq // cache.kv_heads, cache.k_group, cache.v_group, q.device)
    history_cuda.launch(q, cache, case["req_to_token"], case["req_pool_indices"], case["seq_lens"], case["ring_start"],
                        sink=case["sink"], window=case["window"], sm_scale=case["sm_scale"], ns=ns, ns_total=ns_total,
                        o_part=o_part, lse_part=lse_part, window_splits=window_splits, fold=fold)
    torch.cuda.synchronize()
    o_part, lse_part = o_part.double().cpu(), lse_part.double().cpu()
    assert not torch.isnan(lse_part).any() and torch.isfinite(o_part).all(), "an unwritten partial"
    return o_part, lse_part


def merge(o_part, lse_part):
    """The LSE merge of the partials (log2 units): o [B, Hq, D] and lse [B, Hq] (-inf and o 0 where all are empty)."""
    m = lse_part.amax(-1, keepdim=True)
    w = torch.where(torch.isinf(lse_part), 0.0, torch.exp2(lse_part - m.clamp(min=-1e300)))
    tot = w.sum(-1)
    o = (w.unsqueeze(-1) * o_part).sum(-2) / tot.clamp(min=1e-300).unsqueeze(-1)
    return o, torch.where(tot > 0, m.squeeze(-1) + torch.log2(tot.clamp(min=1e-300)), -math.inf)


def history_reference(case):
    """float64 attention of each query head over its request's history rows [S, R) only (quantized keys and values,
    INT4 keys where cache.k_hi), and its LSE in log2 units (-inf, o 0 for a request without history)."""
    q, cache = case["q"].double().cpu(), case["cache"]
    b, hq, d = q.shape
    group = hq // cache.kv_heads
    out, lse = torch.zeros(b, hq, d, dtype=torch.float64), torch.full((b, hq), -math.inf, dtype=torch.float64)
    for i in range(b):
        r = int(case["req_pool_indices"][i])
        length = int(case["seq_lens"][i])
        _, lo, hi, _ = segments(length, int(case["ring_start"][r]), case["sink"], case["window"])
        if hi <= lo:
            continue
        s = case["req_to_token"][r, lo:hi].long()
        k = key_rows(cache, s)
        v = dequantize_rows(cache.rows("v_codes", s).cpu(), cache.rows("v_params", s).cpu())
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        sc = torch.einsum("hd,lhd->hl", q[i], k) * case["sm_scale"]
        out[i] = torch.einsum("hl,lhd->hd", sc.softmax(-1), v)
        lse[i] = torch.logsumexp(sc, -1) / math.log(2)
    return out, lse


def assert_close_attention(got, want, what):
    err = ((got - want).norm() / want.norm()).item()
    assert err < TOL, f"{what}: relative error {err:.3e} >= {TOL}"


def check_history(case, ns):
    o, lse = merge(*launch_partials(case, ns))
    want_o, want_lse = history_reference(case)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "an empty history where the oracle has one, or back"
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() < TOL, "history LSE"
    assert_close_attention(o, want_o, f"history partials (ns {ns})")


LENS, RINGS = [5001, 1200, 330, 70, 2501, 64], [0, 1000, 0, 0, 2500, 0]


@pytest.mark.parametrize("k4", ["none", "all", "some"])
@pytest.mark.parametrize("gqa,gk,gv,page,hkv", [
    (4, 64, 64, 64, 2),    # paired tiles (HC 4), the served format
    (8, 64, 64, 1, 3),     # HC 8, odd records on a pool of single-slot pages
    (12, 64, 64, 64, 2),   # head groups of 8 (spare columns)
    (1, 128, 64, 1, 3),    # one K group per row: record pairs' words, both parities
    (4, 64, 128, 1, 3),    # one V group per row
    (8, 128, 128, 64, 2),  # both
])
def test_history_partials_d128(k4, gqa, gk, gv, page, hkv):
    case = make_cache_case(LENS, hkv=hkv, gqa=gqa, d=128, gk=gk, gv=gv, k4=k4, page=page, ring_starts=RINGS,
                           seed=10 * gqa + gk + gv + page + len(k4))
    for ns in (1, 5, 37):  # 37 CTAs: many empty warps and CTAs
        check_history(case, ns)


@pytest.mark.parametrize("k4", ["none", "all", "some"])
@pytest.mark.parametrize("gqa,gk,gv,page,hkv", [
    (3, 64, 64, 64, 3),  # HC 4, 64-token stages (WIDE), one group per row on both sides
    (3, 32, 32, 1, 3),   # two groups each, single-slot pages
    (3, 64, 32, 1, 3),
    (8, 32, 64, 64, 2),  # HC 8
    (12, 32, 32, 64, 2),
])
def test_history_partials_d64(k4, gqa, gk, gv, page, hkv):
    case = make_cache_case(LENS, hkv=hkv, gqa=gqa, d=64, gk=gk, gv=gv, k4=k4, page=page, ring_starts=RINGS,
                           seed=20 * gqa + gk + gv + page + len(k4))
    for ns in (1, 7, 37):
        check_history(case, ns)


@pytest.mark.parametrize("d,gk,gv", [(128, 64, 64), (128, 128, 64), (64, 32, 32), (64, 64, 64)])
@pytest.mark.parametrize("k4", ["none", "all", "some"])
def test_history_partials_wide_e4m3_params(d, gk, gv, k4):
    """(scale, min) over e4m3's values in a range: zero scales (constant groups), subnormal scales and mins, negatives,
    peaked softmaxes: the kernel's exact decode matches the oracle's float64 one."""
    case = make_cache_case(LENS, hkv=2, gqa=4, d=d, gk=gk, gv=gv, k4=k4, page=64, ring_starts=RINGS,
                           seed=300 + d + gk + len(k4), wide_params=True)
    check_history(case, 5)


@pytest.mark.parametrize("k4", ["none", "all", "some"])
@pytest.mark.parametrize("gqa,gk", [(4, 64), (8, 128), (12, 64)])
def test_window_ctas_and_folded_window_d128(k4, gqa, gk):
    """At D 128 the kernel also reads the window (its window CTAs, or the window folded into >= fold_tiles history
    splits): all partials merged are the whole attention (mixed_decode_reference), with sink positions whose sink row
    is missing read from their records (INT4-key heads: lo | hi << 2) into the window tile."""
    from sglang_oscar.kernels import history_cuda

    sink, window = 64, 256
    case = make_cache_case([3, 64, 65, 319, 321, 5000], hkv=2, gqa=gqa, d=128, gk=gk, gv=64, k4=k4, page=64,
                           ring_starts=[0, 0, 0, 0, 300, 4990], seed=400 + gqa + gk + len(k4))
    r0 = case["req_pool_indices"][-1]
    case["cache"].sink_table[case["req_to_token"][r0, :5].long()] = -1
    want = mixed_decode_reference(**case, missing_sink_int2=True)
    windows = history_cuda.window_ctas(sink, window)
    o, _ = merge(*launch_partials(case, 3, window_splits=windows))
    assert_close_attention(o, want, "window CTAs")
    o, _ = merge(*launch_partials(case, history_cuda.fold_tiles(sink, window), fold=True))
    assert_close_attention(o, want, "folded window")


@pytest.mark.parametrize("k4", ["none", "all", "some"])
@pytest.mark.parametrize("d,gqa", [(128, 4), (128, 8), (64, 3)])
def test_oscar_decode_end_to_end(k4, d, gqa):
    """oscar_decode(history_kernel='cuda') on the format: this kernel, then the Triton merge (and at D 64 the Triton
    window programs), against the oracle; the history_kernel='triton' path agrees to rounding."""
    from sglang_oscar.kernels.decode import oscar_decode

    case = make_cache_case(LENS, hkv=2, gqa=gqa, d=d, gk=64, gv=64 if d == 128 else 32, k4=k4, page=64,
                           ring_starts=RINGS, seed=500 + d + gqa + len(k4))
    want = mixed_decode_reference(**case)
    out = torch.full_like(case["q"], float("nan"))
    oscar_decode(**case, out=out, history_kernel="cuda")
    assert torch.isfinite(out).all()
    assert_close_attention(out.double().cpu(), want, "oscar_decode cuda")
    tri = oscar_decode(**case, history_kernel="triton")
    torch.testing.assert_close(out.float(), tri.float(), rtol=2e-2, atol=2e-2)


def test_occupancy_holds_with_int4_keys():
    """history_cuda.occupancy is the fewest CTAs per SM of a shape's INT2- and INT4-key instances: the INT4 ones keep
    the split rule's budget (2 CTAs of 8 warps at D 128, 3 at D 64)."""
    from sglang_oscar.kernels import history_cuda

    for heads in (4, 8):
        assert history_cuda.occupancy(heads=heads, head_dim=128) >= 2
        assert history_cuda.occupancy(heads=heads, head_dim=64) >= 3
    assert history_cuda.occupancy(heads=4, head_dim=64, wide=True) >= 3
