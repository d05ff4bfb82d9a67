"""Invariants of the quant/ oracle: every kernel is tested against these functions, so they must be right."""

import math

import pytest
import torch

from sglang_oscar import config
from sglang_oscar.quant import (
    SideQuantizer,
    apply_transform,
    bit_reversal,
    block_hadamard_matrix,
    clip_count,
    clip_rows,
    clip_threshold,
    dequantize,
    fwht,
    group_shares,
    hadamard_matrix,
    levels,
    pack_int2,
    pack_int4,
    pack_int4_planes,
    round_param,
    permutation_matrix,
    quantize,
    spectral_placement,
    unpack_int2,
    unpack_int4,
    unpack_int4_planes,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_orthonormal_symmetric(d):
    h = hadamard_matrix(d)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=h.dtype), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(d)))
    x = torch.randn(5, 3, d, dtype=torch.float64)
    assert torch.allclose(fwht(x), x @ h, atol=1e-12)


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(96)


def test_block_hadamard_mixes_only_within_groups():
    b = block_hadamard_matrix(64, 16)
    assert torch.allclose(b @ b.T, torch.eye(64, dtype=b.dtype), atol=1e-12)
    assert (b[:16, 16:] == 0).all() and (b[16:32, :16] == 0).all()


def test_bit_reversal():
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    br = bit_reversal(128)
    assert torch.equal(br[br], torch.arange(128))  # an involution


@pytest.mark.parametrize("d,group", [(64, 32), (128, 32), (128, 64), (256, 32)])
def test_spectral_placement_balances_groups(d, group):
    eig = torch.rand(d, dtype=torch.float64) ** 4  # skewed spectrum
    perm = spectral_placement(eig)
    assert sorted(perm.tolist()) == list(range(d))
    ranks = torch.empty(d, dtype=torch.long)
    ranks[torch.argsort(eig, descending=True)] = torch.arange(d)
    groups = d // group
    placed_rank = ranks[perm].view(groups, group)
    # Every run of `groups` consecutive ranks puts exactly one direction in each group.
    tier = placed_rank // groups
    for g in range(groups):
        assert sorted(tier[g].tolist()) == list(range(group))
    # Hence group shares differ by less than the largest eigenvalue of a tier.
    shares = group_shares(eig, perm, group)
    assert shares.max() - shares.min() <= eig.max() + 1e-12
    p = permutation_matrix(perm)
    x = torch.randn(4, d, dtype=torch.float64)
    assert torch.equal((x @ p), x[:, perm])


def test_clip_semantics():
    d = 64
    x = torch.randn(32, d)
    for rho in (1.0, 0.99, 0.96, 0.9, 0.5):
        n = clip_count(rho, d)
        assert n == d - math.ceil(rho * d - 1e-9)
        t = clip_threshold(x, rho)
        y = clip_rows(x, rho)
        assert (y.abs() <= t + 0.0).all()
        # exactly the n largest magnitudes change (no ties in random data)
        changed = (y != x).sum(-1)
        assert (changed == n).all()
        # at least ceil(rho*D) entries satisfy |x| <= t
        assert ((x.abs() <= t).sum(-1) >= d - n).all()
    assert torch.equal(clip_rows(x, 1.0), x)
    with pytest.raises(ValueError):
        clip_count(0.0, 64)
    with pytest.raises(ValueError):
        clip_count(1.5, 64)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantization_error_within_half_a_step(bits, group):
    d = 128
    x = torch.randn(200, 4, d) * torch.rand(200, 4, 1) * 10
    q = quantize(x, bits=bits, group=group)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 2**bits - 1
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (200, 4, d // group)
    xh = dequantize(q)
    s = q.scale.float().repeat_interleave(group, -1)
    m = q.minv.float().repeat_interleave(group, -1)
    err = (x - xh).abs()
    # Half a step, plus what rounding min/scale to e4m3 can move the grid: |Δmin| + qmax|Δscale| (e4m3 has 4
    # significant bits: relative rounding error <= 2^-4; below 2^-6 the absolute error is <= 2^-10).
    lo = x.view(200, 4, d // group, group).amin(-1).repeat_interleave(group, -1)
    slack = (lo.abs() + (2**bits - 1) * s) * 2**-4 + 2**bits * 2**-10 + 1e-6
    assert (err <= s / 2 + slack).all()
    # min and max of each group are reproduced to that slack too
    assert ((xh - m) >= -1e-6).all()


def test_quantization_is_the_nearest_level_for_the_stored_params():
    x = torch.randn(500, 64)
    q = quantize(x, bits=2, group=32)
    s = q.scale.float().repeat_interleave(32, -1)
    m = q.minv.float().repeat_interleave(32, -1)
    lv = levels(2)
    cand = m.unsqueeze(-1) + s.unsqueeze(-1) * lv  # [..., D, 4]
    best = (cand - x.unsqueeze(-1)).abs().min(-1).values
    got = (dequantize(q) - x).abs()
    assert torch.allclose(got, best, atol=1e-5)


def test_constant_group_is_exact():
    x = torch.full((3, 64), 2.5)
    q = quantize(x, group=32)
    assert (q.codes == 0).all()
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_pack_unpack_exact_and_layout(d):
    codes = torch.randint(0, 4, (7, 3, d), dtype=torch.uint8)
    p = pack_int2(codes)
    assert p.shape == (7, 3, d // 4) and p.dtype == torch.uint8
    assert torch.equal(unpack_int2(p), codes)
    q = d // 4
    j = 5
    byte = int(p[0, 0, j])
    assert [(byte >> (2 * k)) & 3 for k in range(4)] == [int(codes[0, 0, j + k * q]) for k in range(4)]
    c4 = torch.randint(0, 16, (7, 3, d), dtype=torch.uint8)
    p4 = pack_int4(c4)
    assert p4.shape == (7, 3, d // 2)
    assert torch.equal(unpack_int4(p4), c4)
    assert int(p4[0, 0, 1]) == int(c4[0, 0, 1]) | (int(c4[0, 0, 1 + d // 2]) << 4)
    lo, hi = pack_int4_planes(c4)  # the served cache's INT4 keys: two INT2 quarter-plane rows
    assert torch.equal(lo, pack_int2(c4 & 3)) and torch.equal(hi, pack_int2(c4 >> 2))
    assert torch.equal(unpack_int4_planes(lo, hi), c4)


def test_round_param_is_saturating_e4m3():
    x = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, 448.0, 460.0, 1e6, -1e6, 2**-9, 2**-10, 3 * 2**-10, -0.3])
    r = round_param(x).float()
    assert r.tolist()[:9] == [0.0, 0.0, 1.0, 1.0, 1.25, 448.0, 448.0, 448.0, -448.0]  # ties to even, saturated
    assert r[9] == 2**-9 and r[10] == 0.0 and r[11] == 2 * 2**-9  # subnormals: ties to even
    assert abs(float(r[12]) + 0.3) <= 0.3 * 2**-4
    assert torch.isfinite(r).all()


def test_side_quantizer_logits_invariance_with_mean():
    d, h = 64, 3
    t = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float()
    mu = torch.randn(h, d)
    sq = SideQuantizer(matrix=t, mean=mu, group=32)
    q = torch.randn(5, h, d)
    k = torch.randn(9, h, d)
    qt = torch.einsum("qhd,hde->qhe", q, sq.query_matrix())
    kt = sq.transform(k)
    logits = torch.einsum("qhd,khd->hqk", qt, kt)
    ref = torch.einsum("qhd,khd->hqk", q, k) - torch.einsum("qhd,hd->hq", q, mu)[..., None]
    assert torch.allclose(logits, ref, atol=1e-4)
    # softmax over keys is unchanged by the per-query shift
    assert torch.allclose(
        logits.softmax(-1), torch.einsum("qhd,khd->hqk", q, k).softmax(-1), atol=1e-5
    )
    # non-orthogonal transforms keep logits too (T_q = T^{-T})
    m = torch.randn(d, d) + 4 * torch.eye(d)
    sq2 = SideQuantizer(matrix=m)
    lg = torch.einsum("qhd,khd->hqk", q @ sq2.query_matrix(), sq2.transform(k))
    assert torch.allclose(lg, torch.einsum("qhd,khd->hqk", q, k), atol=1e-3)


def test_apply_transform_per_head_shape_check():
    with pytest.raises(ValueError, match="heads"):
        apply_transform(torch.randn(2, 4, 64), torch.randn(3, 64, 64))


def test_byte_math():
    f = config.QuantFormat(bits=2, group=64)
    assert f.bits_per_element == 2.25  # float8 (scale, min)
    assert config.QuantFormat(bits=2, group=128).bits_per_element == 2.125
    assert config.QuantFormat(bits=4, group=64).bits_per_element == 4.25
    assert f.bytes_per_row(64) == 16 + 2
    layout = config.CacheLayout(k=config.QuantFormat(group=128), v=config.QuantFormat(group=128))
    # Qwen3-8B: 36 layers, 8 kv heads, D 128 -> BF16 147456 B/token, INT2 g128 = 36*8*2*(32+2)
    assert layout.quant_bytes_per_token(36, 8, 128) == 36 * 8 * 2 * 34
    # the served format: groups of 64, INT4 keys on a quarter of the (layer, KV head) pairs -> 2.5 bits per element
    served = config.CacheLayout(k4_heads=config.max_k4_heads(36, 8))
    assert served.k4_heads == 72 and served.bits_per_element(36, 8) == 2.5
    assert served.quant_bytes_per_token(36, 8, 128) == 36 * 8 * 2 * (32 + 4) + 72 * 32
    assert config.max_k4_heads(30, 3) == 22 and config.CacheLayout(k4_heads=22).bits_per_element(30, 3) < 2.5
    with pytest.raises(ValueError):
        config.CacheLayout(k4_heads=7).bits_per_element(3, 2)
    assert config.CacheLayout.bf16_bytes_per_token(36, 8, 128) == 147456
    with pytest.raises(ValueError, match="larger than head_dim"):
        config.QuantFormat(group=128).bytes_per_row(64)
    with pytest.raises(ValueError):
        config.QuantFormat(group=48)
