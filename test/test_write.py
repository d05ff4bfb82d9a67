"""oscar_write_kv (kernels/write.py) against its oracle quant/cache_ops.py:write_reference.

On CPU the kernel runs under TRITON_INTERPRET=1 with fp32 activations and fp32 window buffers
(plus one bf16-window case); with CUDA the same comparisons run with bf16 activations and windows.

Tolerances: window rows within 1e-5 of the row's max |x'| (plus one bf16 ulp for bf16 buffers);
(scale, min) float8 e4m3 values equal, except in rare groups (<= 1 per 1000) where the transform's
summation order moved (max − min)/qmax or min across an e4m3 rounding boundary, and there within one
e4m3 ulp (all equal without a transform: x' = x; ±0 compare equal); codes equal except boundary cases (float64 t within
1e-4 of a decision threshold, off by one); every slot/row the call must not touch keeps its poison.
Layers with INT4-key heads (LayerCache k4_heads, k_hi) are checked the same way on codes lo | hi << 2 and
thresholds k + 0.5, their INT4 heads unclipped (the oracle's rule).
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import (
    ACT_DTYPE,
    DEVICE,
    HAS_CUDA,
    HAS_TRITON,
    assert_codes_match,
    assert_rows_close,
    assert_within_e4m3_ulp,
    gen,
    int4_thresholds,
    poison_,
    random_invertible,
    random_orthogonal,
    randn,
    requires_cuda,
    requires_triton,
    same_or_both_nan,
    threshold_rows,
)

from sglang_oscar.kernels.write_cuda import INT2_THRESHOLDS
from sglang_oscar.quant.cache_ops import k4_heads, key_hi_rows, write_reference
from sglang_oscar.quant.clip import clip_rows
from sglang_oscar.quant.pack import unpack_int2, unpack_int4_planes

pytestmark = requires_triton


def _imports():
    from sglang_oscar.kernels.layout import LayerCache
    from sglang_oscar.kernels.write import oscar_write_kv

    return LayerCache, oscar_write_kv


def t_exact64(x, mat, mean, clip, group, params):
    """float64 t = (clip(x') − min)/scale with the given stored params: [T, H, D]."""
    xt = x.double()
    if mean is not None:
        xt = xt - mean.double()
    if mat is not None:
        m = mat.double()
        xt = xt @ m if m.dim() == 2 else torch.einsum("thd,hde->the", xt, m)
    xt = clip_rows(xt, clip)
    t, h, d = xt.shape
    xg = xt.reshape(t, h, d // group, group)
    s = params[..., 0].double().unsqueeze(-1)
    mn = params[..., 1].double().unsqueeze(-1)
    tt = torch.where(s > 0, (xg - mn) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xg))
    return tt.reshape(t, h, d)


def make_case(T, D, H, gk, gv, *, per_head, mean, v_absorbed, seed, window_dtype=ACT_DTYPE, act_dtype=ACT_DTYPE,
              page=1, k4=(), min_slots=0):
    LayerCache, _ = _imports()
    g = gen(seed)
    num_slots, sink_rows, max_reqs, window = max(T + 5, min_slots), T + 2, 2, max(T, 4)
    num_slots = -(-num_slots // page) * page
    cache = LayerCache.empty(
        num_slots, H, D, k_group=gk, v_group=gv, num_sink_rows=sink_rows, max_reqs=max_reqs,
        window=window, sink=64, window_dtype=window_dtype, device=DEVICE, page=page, k4_heads=k4,
    )
    for t in cache.buffers().values():
        poison_(t)
    k = randn(T, H, D, g=g, dtype=act_dtype, scale=2.0)
    v = randn(T, H, D, g=g, dtype=act_dtype)
    # a few outlier channels so that clipping matters
    k[:, :, 3] *= 8
    shape = (H, D) if per_head else (D,)
    kmat = random_invertible(*shape, g=g) if per_head else random_orthogonal(D, g=g)
    vmat = None if v_absorbed else random_orthogonal(*shape, g=g)
    kmean = randn(*((H, D) if per_head else (D,)), g=g) if mean else None
    perm = torch.randperm(num_slots, generator=g)
    slots = perm[:T].to(DEVICE)
    sink_dst = torch.full((T,), -1, dtype=torch.int32)
    ring_dst = torch.full((T,), -1, dtype=torch.int32)
    sel = torch.rand(T, generator=g) < 0.5
    sink_dst[sel] = torch.randperm(sink_rows, generator=g)[: int(sel.sum())].int()
    sel = torch.rand(T, generator=g) < 0.7
    ring_dst[sel] = torch.randperm(max_reqs * window, generator=g)[: int(sel.sum())].int()
    return cache, k, v, slots, sink_dst.to(DEVICE), ring_dst.to(DEVICE), kmat, kmean, vmat


def run_and_check(cache, k, v, slots, sink_dst, ring_dst, kmat, kmean, vmat, *, k_clip, v_clip, **kw):
    _, oscar_write_kv = _imports()
    before = cache.clone()
    ref = cache.clone()
    write_reference(k, v, slots, sink_dst, ring_dst, ref, k_transform=kmat, k_mean=kmean, v_transform=vmat,
                    k_clip=k_clip, v_clip=v_clip)
    oscar_write_kv(k, v, slots, sink_dst, ring_dst, cache, k_transform=kmat, k_mean=kmean, v_transform=vmat,
                   k_clip=k_clip, v_clip=v_clip, **kw)

    written = torch.zeros(cache.num_slots, dtype=torch.bool, device=DEVICE)
    written[slots] = True
    every = torch.arange(cache.num_slots, device=DEVICE)  # [num_slots, H, ...] by slot, any page size (LayerCache.rows)
    int4_keys = cache.k_hi is not None
    heads4 = list(k4_heads(cache))  # INT4-key heads: never clipped
    for side, x, mat, mean, clip, group in (
        ("k", k, kmat, kmean, k_clip, cache.k_group),
        ("v", v, vmat, None, v_clip, cache.v_group),
    ):
        names = [f"{side}_codes", f"{side}_params"] + (["k_hi"] if side == "k" and int4_keys else [])
        for name in names:  # untouched slots keep the poison
            got, old = cache.rows(name, every), before.rows(name, every)
            assert same_or_both_nan(got[~written], old[~written]).all(), f"{name}: stray writes"
        got_p, want_p = cache.rows(f"{side}_params", slots), ref.rows(f"{side}_params", slots)
        assert got_p.dtype == want_p.dtype == torch.float8_e4m3fn
        assert not got_p.isnan().any(), f"{side}: params not written"
        assert_within_e4m3_ulp(got_p, want_p, f"{side} params")
        # [T, H, NG]; by value: a row of zeros clipped at 0 may give min -0 in one and +0 in the other (the clip's
        # max / min of signed zeros), the only byte difference that compares equal
        same_group = (got_p.float() == want_p.float()).all(-1)
        n_diff = int((~same_group).sum())
        allowed = 0 if mat is None and mean is None else max(1, same_group.numel() // 1000)  # x' = x: exact
        assert n_diff <= allowed, f"{side}: {n_diff} groups have different params"
        t64 = t_exact64(x, mat, mean, clip, group, want_p)
        if side == "k" and int4_keys:
            t64[:, heads4] = t_exact64(x, mat, mean, 1.0, group, want_p)[:, heads4]
            # codes lo | hi << 2 of every head (hi 0 on the INT2 heads); the thresholds of both are k + 0.5
            got_c = unpack_int4_planes(cache.rows("k_codes", slots), key_hi_rows(cache, slots))
            want_c = unpack_int4_planes(ref.rows("k_codes", slots), key_hi_rows(ref, slots))
            th = int4_thresholds()
        else:
            got_c, want_c = unpack_int2(cache.rows(f"{side}_codes", slots)), unpack_int2(ref.rows(f"{side}_codes", slots))
            th = INT2_THRESHOLDS
        excused = (~same_group).repeat_interleave(group, dim=-1)
        assert_codes_match(torch.where(excused, want_c, got_c), want_c, t64, th, f"{side} codes")
        # window rows: equal to the transform; rows not asked for keep the poison
        for win, dst in (("sink", sink_dst), ("ring", ring_dst)):
            buf, rbuf, old = (getattr(o, f"{win}_{side}") for o in (cache, ref, before))
            hit = dst >= 0
            rows = dst[hit].long()
            assert_rows_close(buf[rows], rbuf[rows], f"{side} {win} rows", rel=1e-5)
            mask = torch.ones(buf.shape[0], dtype=torch.bool, device=DEVICE)
            mask[rows] = False
            assert same_or_both_nan(buf[mask], old[mask]).all(), f"{side} {win}: stray row writes"
    assert same_or_both_nan(cache.sink_table, before.sink_table).all()


CASES = [
    # T, D, H, Gk, Gv, per_head, mean, v_absorbed, k_clip, v_clip
    (1, 64, 2, 64, 64, False, False, True, 1.0, 1.0),
    (7, 64, 3, 32, 64, True, True, False, 0.9, 0.95),
    (33, 64, 2, 32, 32, False, True, False, 0.8, 1.0),
    (1, 128, 2, 128, 32, True, True, True, 0.96, 1.0),
    (7, 128, 2, 32, 128, False, False, False, 1.0, 0.92),
    (33, 128, 1, 64, 64, True, True, False, 0.9, 0.9),
    (5, 256, 2, 128, 64, False, True, True, 0.95, 1.0),
]


@pytest.mark.parametrize("page,T,block_t", [(4, 7, None), (16, 33, None), (64, 33, 16), (8, 5, 1), (128, 33, None),
                                            (256, 9, 1)])
def test_write_paged_pool(page, T, block_t):
    """Pools in pages (kernels/records.py): codes and params land at the slot's record in [page, H, P, .], for the
    dot tiles and the one-token programs; checked through LayerCache.rows against the oracle as above. Three pages
    at least (the served 128 and 256 too), the tokens' slots drawn from all of them."""
    case = make_case(T, 128, 3, 64, 32, per_head=True, mean=True, v_absorbed=False, seed=page + T, page=page,
                     min_slots=2 * page + 1)
    assert case[0].k_codes.shape == (case[0].num_slots // page, 3, page, 32)
    run_and_check(*case, k_clip=0.9, v_clip=1.0, **({"block_t": block_t} if block_t else {}))


@pytest.mark.parametrize("T,D,H,gk,gv,per_head,mean,v_abs,k_clip,v_clip", CASES)
def test_write_matches_oracle(T, D, H, gk, gv, per_head, mean, v_abs, k_clip, v_clip):
    case = make_case(T, D, H, gk, gv, per_head=per_head, mean=mean, v_absorbed=v_abs, seed=T * 1000 + D + gk + gv)
    run_and_check(*case, k_clip=k_clip, v_clip=v_clip)


@pytest.mark.parametrize("T,D,H,gk,gv,per_head,mean,v_abs,k_clip,v_clip", CASES)
def test_write_one_token_programs_match_oracle(T, D, H, gk, gv, per_head, mean, v_abs, k_clip, v_clip):
    """The same cases with block_t=1: the GPU's decode path (_write_row: the [BK, D] tile of T, the clip from the
    pairwise count), which the interpreter's default takes only for one-token calls."""
    case = make_case(T, D, H, gk, gv, per_head=per_head, mean=mean, v_absorbed=v_abs, seed=T * 1000 + D + gk + gv + 1)
    run_and_check(*case, k_clip=k_clip, v_clip=v_clip, block_t=1)


def test_write_small_block_tail():
    """Several token tiles with a ragged tail (block_t=16, T=21)."""
    case = make_case(21, 64, 2, 64, 32, per_head=True, mean=True, v_absorbed=False, seed=5)
    run_and_check(*case, k_clip=0.9, v_clip=1.0, block_t=16)


@pytest.mark.parametrize("T,D,block_t", [(21, 64, 4), (3, 128, 2), (33, 128, 1), (16, 64, 1), (17, 128, 8)])
def test_write_decode_tiles(T, D, block_t):
    """The no-dot path for decode-sized calls (block_t < 16; the default up to SMALL_BATCH_TOKENS
    tokens) against the oracle, with ragged tails, forced also where the default would use dot tiles."""
    case = make_case(T, D, 3, 64, 32, per_head=True, mean=True, v_absorbed=False, seed=300 + T + block_t)
    run_and_check(*case, k_clip=0.9, v_clip=0.95, block_t=block_t)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from sglang_oscar.kernels.write import _e4m3

    @triton.jit
    def _e4m3_probe(x_ptr, v_ptr, b_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        val, byte = _e4m3(tl.load(x_ptr + offs))
        tl.store(v_ptr + offs, val)
        tl.store(b_ptr + offs, byte)


def e4m3_edge_values() -> torch.Tensor:
    """fp32 values around every float8 e4m3 number: all finite e4m3 values (±0, the subnormals 2^-9..7·2^-9, ±448),
    the midpoints between neighbours (ties: to even) and the fp32 numbers just either side of them, ties below the
    smallest subnormal (2^-10) and at the saturation bound (464), beyond ±448 (inf included), fp32 subnormals and
    random values of both signs from 2^-16 to 2^10."""
    e = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e = e[~e.isnan()]
    pos = e[e > 0].unique().sort().values
    grid = torch.cat([-pos.flip(0), torch.zeros(1), pos]).double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact in fp32: e4m3 numbers have 4 significant bits
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    special = torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-10, 2.0**-11, 2.0**-6, 2.0**-6 - 2.0**-10,
                            448.0, -448.0, 449.0, 464.0, -464.0, 480.0, 500.0, -1e6, 3.4e38, float("inf"),
                            -float("inf"), 1e-45, -1e-45, 1.1754942e-38])
    g = gen(11)
    rnd = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-16, 10, (4096,), generator=g).float())
    return torch.cat([e, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), special, rnd]).float()


def test_e4m3_encoder_matches_torch():
    """write._e4m3 (the params' encoder, bit arithmetic) against the oracle's round_param (torch: clamp to ±448, then
    float8_e4m3fn round-to-nearest-even): the same byte and the same fp32 value, bit for bit (-0 kept), on
    e4m3_edge_values."""
    from sglang_oscar.quant.intq import round_param

    x = e4m3_edge_values()
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[: x.numel()] = x
    xp = xp.to(DEVICE)
    val = torch.full((n,), float("nan"), device=DEVICE)
    byte = torch.full((n,), 0xA5, dtype=torch.uint8, device=DEVICE)
    _e4m3_probe[(1,)](xp, val, byte, N=n)
    want = round_param(xp.cpu())
    bad = byte.cpu() != want.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} bytes differ, e.g. x={xp.cpu()[bad][:5].tolist()}: {byte.cpu()[bad][:5]} vs {want.view(torch.uint8)[bad][:5]}"
    assert torch.equal(val.cpu().view(torch.int32), want.float().view(torch.int32))


INT4_CASES = [
    # T, D, H, Gk, Gv, page, block_t, k_clip, v_clip, INT4-key heads (the others INT2; V always INT2)
    (1, 64, 2, 32, 64, 1, None, 1.0, 1.0, (0, 1)),  # the default one-token program, no clip, every head
    (5, 64, 3, 64, 32, 64, 4, 0.9, 0.95, (1,)),  # small tiles, page 64, one of three heads
    (33, 64, 2, 64, 64, 1, 16, 1.0, 0.9, (1,)),  # dot tiles with a ragged tail
    (3, 128, 2, 128, 64, 64, 1, 0.95, 1.0, (0,)),
    (7, 128, 3, 32, 32, 1, 8, 1.0, 0.9, (0, 2)),
    (20, 128, 3, 64, 128, 64, 16, 0.9, 1.0, (0, 1, 2)),  # clipped INT2 nowhere: k_clip unused
    (20, 128, 4, 64, 64, 1, 16, 0.9, 1.0, (1, 3)),
    (2, 256, 2, 64, 64, 1, 1, 0.95, 0.95, (1,)),
    (6, 256, 2, 32, 128, 64, 2, 0.9, 1.0, (0, 1)),
    (17, 256, 1, 128, 32, 64, 16, 1.0, 1.0, (0,)),
]


@pytest.mark.parametrize("T,D,H,gk,gv,page,block_t,k_clip,v_clip,k4", INT4_CASES)
def test_write_int4_keys_match_oracle(T, D, H, gk, gv, page, block_t, k_clip, v_clip, k4):
    """Layers with INT4-key heads (LayerCache.empty(k4_heads=...): k_hi of those heads only): all, some or one of the
    KV heads, head_dim 64 / 128 / 256, key groups 32 / 64 / 128, pages of 1 and 64, the one-token programs, the small
    tiles and the dot tiles, the INT2 heads clipped or not (INT4 heads never), every buffer (k_hi included) poisoned
    first; codes lo | hi << 2 against the oracle with thresholds k + 0.5."""
    case = make_case(T, D, H, gk, gv, per_head=T % 2 == 1, mean=True, v_absorbed=D == 256, seed=900 + T + D + gk,
                     page=page, k4=k4)
    assert case[0].k4_heads == k4 and case[0].k_hi.shape[:2] == case[0].k_codes.shape[:1] + (len(k4),)
    run_and_check(*case, k_clip=k_clip, v_clip=v_clip, **({"block_t": block_t} if block_t else {}))


@pytest.mark.parametrize("d,group,block_t", [(64, 64, 1), (128, 32, 4), (64, 64, 16), (256, 128, 1)])
def test_write_codes_at_thresholds_are_exact(d, group, block_t):
    """Identity transforms, no clip (x' = x exactly): keys of an INT4 head and an INT2 head (uniform levels: the INT2
    thresholds 0.5 / 1.5 / 2.5, capped at 3 where t is far above) and INT2 values of rows at and around every INT4
    threshold (threshold_rows) equal the oracle's bit for bit, params and codes, on the one-token programs, the
    small tiles and the dot tiles."""
    LayerCache, oscar_write_kv = _imports()
    rows = threshold_rows(d, group)
    t = rows.shape[0] * 5
    x = rows.repeat(5, 1)[:, None, :].repeat(1, 2, 1).to(DEVICE)  # [T, 2 heads, d]
    cache = LayerCache.empty(t + 3, 2, d, k_group=group, v_group=group, num_sink_rows=2, max_reqs=1, window=4,
                             sink=2, device=DEVICE, window_dtype=torch.float32, k4_heads=(1,))
    for b in cache.buffers().values():
        poison_(b)
    ref = cache.clone()
    slots = torch.randperm(t + 3, generator=gen(d + group))[:t].to(DEVICE)
    none = torch.full((t,), -1, dtype=torch.int32, device=DEVICE)
    eye = torch.eye(d, device=DEVICE)
    write_reference(x, x, slots, none, none, ref, k_transform=eye)
    oscar_write_kv(x, x, slots, none, none, cache, k_transform=eye, block_t=block_t)
    for name in ("k_codes", "k_hi", "k_params", "v_codes", "v_params"):
        got, want = cache.rows(name, slots), ref.rows(name, slots)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    codes = unpack_int4_planes(cache.rows("k_codes", slots[:1]), key_hi_rows(cache, slots[:1]))
    assert int(codes[:, 1].max()) == 15 and int(codes[:, 0].max()) == 3 and int(codes.min()) == 0


def test_default_block_t_switches_at_the_small_batch_bound():
    from sglang_oscar.kernels.write import MID_BATCH_TOKENS, SMALL_BATCH_TOKENS, default_block_t

    assert default_block_t(1, 128) == default_block_t(SMALL_BATCH_TOKENS, 128) == 1
    assert default_block_t(SMALL_BATCH_TOKENS + 1, 128) == default_block_t(MID_BATCH_TOKENS, 64) == 16
    assert default_block_t(MID_BATCH_TOKENS + 1, 64) == 64 and default_block_t(100_000, 128) == 32


def test_default_block_t_in_the_interpreter_keeps_the_path_with_larger_tiles():
    """CPU tensors (interpreter): one token the GPU's one-token program; 2+ tokens the largest tile without tl.dot
    (8) below 16 rows, with it (128) from there."""
    from sglang_oscar.kernels.write import MID_BATCH_TOKENS, SMALL_BATCH_TOKENS, default_block_t

    assert default_block_t(1, 128, interpreter=True) == 1
    assert default_block_t(5, 128, interpreter=True) == 8
    assert default_block_t(SMALL_BATCH_TOKENS, 64, interpreter=True) == 8  # still the no-dot path
    assert default_block_t(SMALL_BATCH_TOKENS + 1, 64, interpreter=True) == 64
    assert default_block_t(150, 64, interpreter=True) == 128
    assert default_block_t(MID_BATCH_TOKENS + 1, 256, interpreter=True) == 128
    assert default_block_t(100_000, 128, interpreter=True) == 128


@pytest.mark.parametrize("T", [5, 150])
def test_write_default_tiles_on_this_device(T):
    """The default tile of this device (interpreter: 8 rows without tl.dot, 128 with) against the
    oracle, with ragged tails."""
    case = make_case(T, 64, 2, 32, 64, per_head=False, mean=True, v_absorbed=False, seed=400 + T)
    run_and_check(*case, k_clip=0.9, v_clip=0.95)


def test_write_bf16_windows():
    """bf16 window buffers (fp32 activations): rows rounded to nearest even, scale/min too."""
    case = make_case(7, 64, 2, 32, 64, per_head=False, mean=True, v_absorbed=False, seed=11, window_dtype=torch.bfloat16)
    run_and_check(*case, k_clip=0.95, v_clip=1.0)


@pytest.mark.parametrize("block_t", [None, 1])
def test_write_clip_ties_and_constant_groups(block_t):
    """Integer-valued V (absorbed: x' = v) has exact ties at the clip threshold; a constant row has scale 0; a row of
    zeros clips at 0. Both small paths: the max-and-count rounds (interpreter tiles of 8) and the pairwise count of
    the one-token programs."""
    cache, k, v, slots, sd, rd, kmat, kmean, vmat = make_case(7, 64, 2, 32, 32, per_head=False, mean=False, v_absorbed=True, seed=3)
    g = gen(4)
    v = torch.randint(-3, 4, v.shape, generator=g).to(device=DEVICE, dtype=v.dtype)
    v[2, 1] = 1.5  # constant row: every group has scale 0, codes 0
    v[4, 0] = 0.0
    v[5, 1, :8] = 3.0  # 8 tied maxima: the clip count at 0.9 of 64 (6) falls inside the tie
    run_and_check(cache, k, v, slots, sd, rd, kmat, kmean, vmat, k_clip=1.0, v_clip=0.9,
                  **({"block_t": block_t} if block_t else {}))
    _ = cache.v_params[slots[2], 1]
    assert (cache.v_params[slots[2], 1, :, 0] == 0).all() and (unpack_int2(cache.v_codes[slots[2], 1]) == 0).all()


def test_write_strided_inputs():
    """k and v as views into a fused [T, 2, H, D] buffer (token stride != H*D)."""
    cache, k, v, slots, sd, rd, kmat, kmean, vmat = make_case(7, 64, 2, 64, 64, per_head=False, mean=True, v_absorbed=False, seed=9)
    kv = torch.stack((k, v), dim=1)
    run_and_check(cache, kv[:, 0], kv[:, 1], slots, sd, rd, kmat, kmean, vmat, k_clip=0.9, v_clip=0.9)


def test_write_errors():
    LayerCache, oscar_write_kv = _imports()
    cache, k, v, slots, sd, rd, kmat, kmean, vmat = make_case(1, 64, 2, 64, 64, per_head=False, mean=False, v_absorbed=True, seed=1)
    kw = dict(k_transform=kmat)
    with pytest.raises(ValueError, match="head_dim 96"):
        LayerCache.empty(4, 2, 96, device=DEVICE)
    with pytest.raises(ValueError, match="group size 16"):
        LayerCache.empty(4, 2, 64, k_group=16, device=DEVICE)
    with pytest.raises(ValueError, match="group size 128 is larger"):
        LayerCache.empty(4, 2, 64, v_group=128, device=DEVICE)
    with pytest.raises(ValueError, match="page size 3 is not supported"):
        LayerCache.empty(12, 2, 64, page=3, device=DEVICE)
    with pytest.raises(ValueError, match="not a whole number of pages of 8"):
        LayerCache.empty(12, 2, 64, page=8, device=DEVICE)
    with pytest.raises(TypeError, match="float32"):
        oscar_write_kv(k, v, slots, sd, rd, cache, k_transform=kmat.to(torch.bfloat16))
    with pytest.raises(ValueError, match="k_transform must have shape"):
        oscar_write_kv(k, v, slots, sd, rd, cache, k_transform=kmat[:32, :32].contiguous())
    with pytest.raises(ValueError, match="k must have shape"):
        oscar_write_kv(k[:, :1], v, slots, sd, rd, cache, **kw)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        oscar_write_kv(k.double(), v, slots, sd, rd, cache, **kw)
    with pytest.raises(ValueError, match="slots must be"):
        oscar_write_kv(k, v, slots.int(), sd, rd, cache, **kw)
    with pytest.raises(ValueError, match="clip ratio"):
        oscar_write_kv(k, v, slots, sd, rd, cache, k_clip=0.0, **kw)
    for bad in (3, 12, 24):
        with pytest.raises(ValueError, match="block_t must be a power of two"):
            oscar_write_kv(k, v, slots, sd, rd, cache, block_t=bad, **kw)
    cache.k_params = cache.k_params.float()
    with pytest.raises(ValueError, match="k_params"):
        oscar_write_kv(k, v, slots, sd, rd, cache, **kw)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("v_abs", [False, True])
def test_write_gpu_prefill_bf16(v_abs):
    """GPU only: a larger bf16 prefill (T=1000, Qwen3-8B head shape: 32-row tiles, 8 warps in IEEE fp32) against the
    oracle, with and without the V transform (V absorbed into the weights: the served default)."""
    case = make_case(1000, 128, 8, 64, 64, per_head=False, mean=True, v_absorbed=v_abs, seed=77)
    run_and_check(*case, k_clip=0.96, v_clip=1.0)


def test_default_num_warps():
    """8 warps for the 16-row tiles of mid-sized decode batches and for the 32-row prefill tiles at head_dim 128 (4
    spilled there); 4 elsewhere."""
    from sglang_oscar.kernels.write import (MID_BATCH_TOKENS, MID_BATCH_WARPS, PREFILL_D128_WARPS, default_block_t,
                                            default_num_warps)

    assert default_num_warps(64, 128, 16) == default_num_warps(MID_BATCH_TOKENS, 64, 16) == MID_BATCH_WARPS == 8
    bt = default_block_t(100_000, 128)
    assert bt == 32 and default_num_warps(100_000, 128, bt) == PREFILL_D128_WARPS == 8
    assert default_num_warps(100_000, 64, default_block_t(100_000, 64)) == 4
    assert default_num_warps(100_000, 256, default_block_t(100_000, 256)) == 4
    assert default_num_warps(1, 128, 1) == 4


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T,D,block_t", [(1, 128, None), (8, 128, None), (64, 128, None), (64, 128, 1), (3, 64, None),
                                         (5, 256, None), (16, 128, 1)])
def test_write_gpu_decode_bf16(T, D, block_t):
    """GPU only: decode-sized bf16 calls (Qwen3-8B head shape, D 64 and 256), default and forced one-token programs,
    clipped K and V, per-head transforms."""
    case = make_case(T, D, 8, 64, 64, per_head=True, mean=True, v_absorbed=False, seed=78 + T + D)
    run_and_check(*case, k_clip=0.95, v_clip=0.96, block_t=block_t)


assert HAS_CUDA or ACT_DTYPE == torch.float32


@pytest.mark.parametrize("n,hkv,gqa,d", [(1, 2, 4, 128), (3, 3, 3, 64), (8, 2, 5, 128), (20, 2, 8, 64),
                                         (5, 1, 1, 256)])
def test_write_rotates_q_in_the_same_launch(n, hkv, gqa, d):
    """oscar_write_kv(q=, q_transform=, q_out=): the queries rotated by extra programs of the write's launch equal
    transform_query's (fp32: to summation order), per-head and shared transforms, GQA 1 / 3 / 5 / 8 (padded to a
    power of two in the tile), the small-tile and the dot path (20 tokens: 16+ rows); q_out poisoned first, the
    cache's codes, params and window rows the same bits as without q."""
    LayerCache, oscar_write_kv = _imports()
    from sglang_oscar.kernels.decode import transform_query

    g = torch.Generator().manual_seed(n + d)
    grp = min(64, d)

    def cache():
        c = LayerCache.empty(64, hkv, d, k_group=grp, v_group=grp, num_sink_rows=4, max_reqs=2, window=16,
                             sink=4, device=DEVICE, window_dtype=torch.float32)
        for t in c.buffers().values():  # empty(): what the write does not touch must compare equal too
            t.zero_()
        return c

    k, v = (torch.randn(n, hkv, d, generator=g).to(DEVICE) for _ in "kv")
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g))[0].contiguous().to(DEVICE)
    q = torch.randn(n, hkv * gqa, d, generator=g).to(DEVICE)
    slots = torch.randperm(64, generator=g)[:n].to(DEVICE)
    ring = torch.arange(n, dtype=torch.int32).to(DEVICE) if n <= 16 else torch.full((n,), -1, dtype=torch.int32,
                                                                                      device=DEVICE)
    none = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    for tq in (rot, rot[0]):  # per KV head, and one shared [D, D]
        plain, fused = cache(), cache()
        oscar_write_kv(k, v, slots, none, ring, plain, k_transform=rot)
        q_out = torch.full_like(q, float("nan"))
        oscar_write_kv(k, v, slots, none, ring, fused, k_transform=rot, q=q, q_transform=tq, q_out=q_out)
        torch.testing.assert_close(q_out, transform_query(q, tq, hkv), rtol=1e-5, atol=1e-5)
        for name, t in plain.buffers().items():
            assert torch.equal(t, getattr(fused, name)), name


def test_write_q_rotation_refusals():
    LayerCache, oscar_write_kv = _imports()
    c = LayerCache.empty(300, 2, 64, k_group=64, v_group=64, num_sink_rows=4, max_reqs=2, window=16, sink=4,
                         device=DEVICE, window_dtype=torch.float32)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    none = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    rot = torch.eye(64, device=DEVICE)
    q = torch.zeros(2, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="q, q_transform and q_out go together"):
        oscar_write_kv(k, k, slots, none, none, c, k_transform=rot, q=q)
    with pytest.raises(ValueError, match=r"q must be \[2, Hq, 64\]"):
        oscar_write_kv(k, k, slots, none, none, c, k_transform=rot, q=q[:, :7], q_transform=rot, q_out=q[:, :7])
    with pytest.raises(ValueError, match="q_out must be a contiguous"):
        oscar_write_kv(k, k, slots, none, none, c, k_transform=rot, q=q, q_transform=rot, q_out=q.double())
    with pytest.raises(TypeError, match="q_transform must be float32 or q's dtype"):
        oscar_write_kv(k, k, slots, none, none, c, k_transform=rot, q=q, q_transform=rot.double(), q_out=q.clone())
    with pytest.raises(ValueError, match=r"q_transform must have shape \[64, 64\] or \[2, 64, 64\]"):
        oscar_write_kv(k, k, slots, none, none, c, k_transform=rot, q=q, q_transform=torch.eye(32, device=DEVICE),
                       q_out=q.clone())
    n = 257
    kk = torch.zeros(n, 2, 64, device=DEVICE)
    nn = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    qq = torch.zeros(n, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="decode-sized calls .* this call has 257: use transform_query"):
        oscar_write_kv(kk, kk, torch.arange(n, device=DEVICE), nn, nn, c, k_transform=rot, q=qq, q_transform=rot,
                       q_out=qq.clone())


@requires_cuda
@pytest.mark.parametrize("n", [1, 3, 16, 40])
@pytest.mark.parametrize("gqa", [1, 4, 5, 8])
def test_write_gpu_rotates_bf16_q(n, gqa):
    """bf16 q and T_q on the GPU (the server's decode): the write's q programs, padded to 16 tile rows per program
    for a tensor-core dot (1 token per program up to 16 tokens, 16 from there), against transform_query's GEMM:
    both bf16 products with fp32 sums, so they differ by summation order and the final bf16 rounding (stated:
    1e-2 absolute on rows of norm ~sqrt(D))."""
    LayerCache, oscar_write_kv = _imports()
    from sglang_oscar.kernels.decode import transform_query

    hkv, d = 2, 128
    g = torch.Generator(device="cuda").manual_seed(n * 10 + gqa)
    cache = LayerCache.empty(64, hkv, d, k_group=64, v_group=64, num_sink_rows=4, max_reqs=2, window=16, sink=4,
                             device="cuda", page=64)
    k, v = (torch.randn(n, hkv, d, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, device="cuda"))[0].contiguous()
    q = torch.randn(n, hkv * gqa, d, generator=g, device="cuda").to(torch.bfloat16)
    q_out = torch.full_like(q, float("nan"))
    none = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    oscar_write_kv(k, v, torch.arange(n, device="cuda"), none, none, cache, k_transform=rot, q=q,
                   q_transform=rot.to(torch.bfloat16), q_out=q_out)
    want = transform_query(q, rot.to(torch.bfloat16), hkv)
    torch.testing.assert_close(q_out.float(), want.float(), rtol=1e-2, atol=1e-2)


# ---- the CUDA write (oscar_write_kv kernel="cuda", kernels/write_cuda.py) ----

CUDA_CASES = [
    # T, H, Gk, Gv, per_head, mean, v_absorbed, k_clip, v_clip, page, dtype, INT4-key heads
    (1, 8, 64, 64, True, True, False, 0.95, 0.96, 64, torch.bfloat16, ()),  # Qwen3-8B, batch 1
    (1, 1, 128, 128, False, False, True, 0.9, 1.0, 64, torch.bfloat16, ()),  # GLM-4.7 TP8: one KV head
    (8, 8, 64, 128, True, False, False, 1.0, 0.92, 16, torch.bfloat16, ()),  # no K clip
    (7, 2, 32, 64, False, True, True, 0.96, 0.8, 1, torch.float16, ()),  # odd batch, page 1, fp16
    (33, 4, 128, 32, True, True, False, 0.8, 1.0, 8, torch.bfloat16, ()),  # past one page of 8
    (64, 8, 64, 64, False, True, False, 0.95, 0.95, 64, torch.bfloat16, ()),  # large batch
    (1, 8, 64, 64, True, True, False, 0.95, 0.96, 64, torch.bfloat16, (0, 3, 4)),  # INT4 on 3 of 8 heads
    (5, 2, 32, 128, False, True, True, 0.95, 1.0, 1, torch.float16, (0, 1)),  # every head, page 1, fp16
    (9, 4, 128, 32, True, False, False, 0.9, 0.9, 64, torch.bfloat16, (2,)),  # one head
]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("T,H,gk,gv,per_head,mean,v_abs,k_clip,v_clip,page,dtype,k4", CUDA_CASES)
def test_write_cuda_kernel_matches_oracle(T, H, gk, gv, per_head, mean, v_abs, k_clip, v_clip, page, dtype, k4):
    """The CUDA write against the oracle with the module's tolerances: batch 1 to 64, 1 / 2 / 4 / 8 KV heads, groups
    32 / 64 / 128 per side, shared and per-head transforms, with and without K's mean and V's transform, clipped and
    unclipped, pages of 1 / 8 / 16 / 64, bf16 and fp16 rows, INT2 keys and layers with INT4-key
    heads (some or all); every buffer poisoned first."""
    case = make_case(T, 128, H, gk, gv, per_head=per_head, mean=mean, v_absorbed=v_abs, seed=300 + T + H,
                     window_dtype=torch.bfloat16, act_dtype=dtype, page=page, k4=k4)
    run_and_check(*case, k_clip=k_clip, v_clip=v_clip, kernel="cuda")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128])
def test_write_cuda_codes_at_thresholds_are_exact(group):
    """The CUDA write on threshold_rows, bit for bit against the oracle: K = 0 (bf16) with k_mean = −rows, one row per
    KV head (INT4 keys on three of the four), and an identity transform, so x' = rows exactly in fp32 (values no bf16 input holds, like 0.5 − 2^-25);
    V = the rows rounded to bf16, no transform."""
    LayerCache, oscar_write_kv = _imports()
    rows = threshold_rows(128, group).to(DEVICE)
    h, t = rows.shape[0], 6
    cache = LayerCache.empty(16, h, 128, k_group=group, v_group=group, num_sink_rows=2, max_reqs=1, window=4, sink=2,
                             device=DEVICE, window_dtype=torch.bfloat16, k4_heads=(0, 2, 3), page=16)
    for b in cache.buffers().values():
        poison_(b)
    ref = cache.clone()
    k = torch.zeros(t, h, 128, dtype=torch.bfloat16, device=DEVICE)
    v = rows.to(torch.bfloat16)[None].repeat(t, 1, 1)
    slots = torch.randperm(16, generator=gen(group))[:t].to(DEVICE)
    none = torch.full((t,), -1, dtype=torch.int32, device=DEVICE)
    kw = dict(k_transform=torch.eye(128, device=DEVICE), k_mean=(-rows).contiguous())
    write_reference(k, v, slots, none, none, ref, **kw)
    oscar_write_kv(k, v, slots, none, none, cache, kernel="cuda", **kw)
    for name in ("k_codes", "k_hi", "k_params", "v_codes", "v_params"):
        assert torch.equal(cache.rows(name, slots).view(torch.uint8), ref.rows(name, slots).view(torch.uint8)), name


@requires_cuda
@pytest.mark.gpu
def test_write_cuda_kernel_clip_ties_constant_and_strided_rows():
    """Integer-valued V (absorbed: x' = v) has exact ties at the clip threshold, and one row 16 tied maxima where the
    clip count of 0.9 of 128 (12) falls inside them; a constant row (scale 0, codes 0), a zero row; k / v as views of
    one [T, 2, H, D] buffer (token stride != H * D), then at an offset that is not 16-byte aligned (scalar loads)."""
    cache, k, v, slots, sd, rd, kmat, kmean, vmat = make_case(9, 128, 2, 64, 32, per_head=False, mean=True,
                                                              v_absorbed=True, seed=5, window_dtype=torch.bfloat16)
    g = gen(6)
    v = torch.randint(-3, 4, v.shape, generator=g).to(device=DEVICE, dtype=v.dtype)
    v[2, 1] = 1.5
    v[4, 0] = 0.0
    v[5, 1, :16] = 3.0
    v[6, 0, :8] = -3.0
    kv = torch.stack((k, v), dim=1)
    run_and_check(cache, kv[:, 0], kv[:, 1], slots, sd, rd, kmat, kmean, vmat, k_clip=0.9, v_clip=0.9,
                  kernel="cuda")
    assert (cache.rows("v_params", slots[2:3])[0, 1, :, 0] == 0).all()
    flat = torch.empty(1 + kv.numel(), dtype=kv.dtype, device=DEVICE)  # one element in: 2-byte aligned rows
    odd = flat[1:].view(kv.shape)
    odd.copy_(kv)
    cache2 = make_case(9, 128, 2, 64, 32, per_head=False, mean=True, v_absorbed=True, seed=5,
                       window_dtype=torch.bfloat16)[0]
    run_and_check(cache2, odd[:, 0], odd[:, 1], slots, sd, rd, kmat, kmean, vmat, k_clip=0.9, v_clip=0.9,
                  kernel="cuda")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5, 32])
@pytest.mark.parametrize("gqa", [1, 4, 8, 12, 16])
@pytest.mark.parametrize("tq_dtype", [torch.bfloat16, torch.float32])
def test_write_cuda_rotates_q(n, gqa, tq_dtype):
    """The CUDA write's q programs (GQA 12 / 16: two passes of 8 heads) against transform_query, q_out poisoned:
    bf16 T_q (the server's) as its bf16 GEMM with fp32 sums, up to summation order and the final rounding
    (1e-2 absolute on rows of norm ~sqrt(D), as the Triton q programs' test); fp32 T_q against fp32 products of the
    bf16 q rounded once (2 bf16 ulps). The cache the same bits as the CUDA write without q."""
    LayerCache, oscar_write_kv = _imports()
    from sglang_oscar.kernels.decode import transform_query

    hkv, d = 2, 128
    g = torch.Generator(device="cuda").manual_seed(n * 100 + gqa)

    def cache():
        c = LayerCache.empty(64, hkv, d, k_group=64, v_group=64, num_sink_rows=4, max_reqs=2, window=32, sink=4,
                             device="cuda", page=64)
        for t in c.buffers().values():
            t.zero_()
        return c

    k, v = (torch.randn(n, hkv, d, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, device="cuda"))[0].contiguous()
    q = torch.randn(n, hkv * gqa, d, generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(64, generator=g, device="cuda")[:n]
    ring = torch.arange(n, dtype=torch.int32, device="cuda")
    none = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    plain, fused = cache(), cache()
    oscar_write_kv(k, v, slots, none, ring, plain, k_transform=rot, k_clip=0.95, kernel="cuda")
    q_out = torch.full_like(q, float("nan"))
    tq = rot.to(tq_dtype)
    oscar_write_kv(k, v, slots, none, ring, fused, k_transform=rot, k_clip=0.95, q=q, q_transform=tq, q_out=q_out,
                   kernel="cuda")
    assert not q_out.isnan().any()
    if tq_dtype == torch.bfloat16:
        want = transform_query(q, tq, hkv)
        torch.testing.assert_close(q_out.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:  # fp32 products, summed in another order, then one rounding to bf16 (<= 2^-9 relative)
        want = torch.einsum("thd,hde->the", q.double(), rot.double().repeat_interleave(gqa, dim=0))
        torch.testing.assert_close(q_out.double(), want, rtol=2.0**-8, atol=1e-4)
    for name, t in plain.buffers().items():
        assert torch.equal(t, getattr(fused, name)), name


@requires_cuda
@pytest.mark.gpu
def test_write_cuda_kernel_in_a_cuda_graph():
    """Captured once, replayed with new rows and slots: the replay writes what a direct call writes (the launch holds
    no host state but the pointers)."""
    LayerCache, oscar_write_kv = _imports()
    case = make_case(4, 128, 8, 64, 64, per_head=True, mean=True, v_absorbed=False, seed=21,
                     window_dtype=torch.bfloat16, page=64)
    cache, k, v, slots, sd, rd, kmat, kmean, vmat = case
    kw = dict(k_transform=kmat, k_mean=kmean, v_transform=vmat, k_clip=0.95, v_clip=0.95, kernel="cuda",
              validate=False)
    kb, vb, sb = k.clone(), v.clone(), slots.clone()
    oscar_write_kv(kb, vb, sb, sd, rd, cache, **kw)  # build and load before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oscar_write_kv(kb, vb, sb, sd, rd, cache, **kw)
    k2, v2 = k.flip(0).contiguous(), (v * 0.5).contiguous()
    kb.copy_(k2), vb.copy_(v2)
    graph.replay()
    direct = cache.clone()
    oscar_write_kv(k2, v2, slots, sd, rd, direct, **kw)
    torch.cuda.synchronize()
    for name, t in direct.buffers().items():  # poison (NaN) where neither wrote
        assert same_or_both_nan(t, getattr(cache, name)).all(), name


def test_write_cuda_kernel_refusals():
    """kernel='cuda' says what it does not cover (these run on the CPU: the checks come before any CUDA call)."""
    LayerCache, oscar_write_kv = _imports()
    c64 = LayerCache.empty(8, 2, 64, k_group=64, v_group=64, num_sink_rows=2, max_reqs=1, window=4, sink=2,
                           device=DEVICE, window_dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    none = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(2, device=DEVICE)
    kw = dict(k_transform=torch.eye(64, device=DEVICE))
    with pytest.raises(ValueError, match="kernel must be one of"):
        oscar_write_kv(k, k, slots, none, none, c64, kernel="cutlass", **kw)
    with pytest.raises(ValueError, match="covers head_dim 128"):
        oscar_write_kv(k, k, slots, none, none, c64, kernel="cuda", **kw)
    with pytest.raises(ValueError, match="leave block_t and num_warps"):
        oscar_write_kv(k, k, slots, none, none, c64, kernel="cuda", block_t=1, **kw)
    c128 = LayerCache.empty(8, 2, 128, k_group=64, v_group=64, num_sink_rows=2, max_reqs=1, window=4, sink=2,
                            device=DEVICE, window_dtype=torch.float32)
    k128 = torch.zeros(2, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(k_transform=torch.eye(128, device=DEVICE))
    with pytest.raises(ValueError, match="stores bfloat16 sink / ring rows"):
        oscar_write_kv(k128, k128, slots, none, none, c128, kernel="cuda", **kw)
    with pytest.raises(ValueError, match="takes bf16 or fp16 k / v"):
        oscar_write_kv(k128.float(), k128.float(), slots, none, none, c128, kernel="cuda", **kw)
    if not HAS_CUDA:
        cb = LayerCache.empty(8, 2, 128, k_group=64, v_group=64, num_sink_rows=2, max_reqs=1, window=4, sink=2,
                              device=DEVICE, window_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            oscar_write_kv(k128, k128, slots, none, none, cb, kernel="cuda", **kw)


def test_write_cuda_launch_signature_matches_the_source():
    """write_cuda.LAUNCH_ARGTYPES against oscar_write_launch's C parameters (a mismatch would pass garbage through
    ctypes without an error)."""
    import ctypes
    import re

    from sglang_oscar.kernels import write_cuda

    src = open(write_cuda.SOURCE).read()
    sig = re.search(r"int oscar_write_launch\((.*?)\)\s*\{", src, re.S).group(1)
    params = [p.strip() for p in sig.split(",")]
    c_types = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong}
    got = []
    for p in params:
        decl = p.rsplit(" ", 1)[0].strip()
        got.append(ctypes.c_void_p if "*" in p else c_types[decl.replace("const ", "")])
    assert got == write_cuda.LAUNCH_ARGTYPES


def test_write_cuda_source_compiles_without_spills(tmp_path):
    """The CUDA write builds for sm_90 with nvcc (where installed: CI has none and skips), both input types with INT2
    and with INT4 keys (four kernels), with no stack or spills and at most 192 registers (the q programs hold a 32 x 4 slice of T_q: 168 with nvcc 13.0; three
    CTAs of 128 threads per SM)."""
    import re
    import subprocess

    from sglang_oscar.kernels import cuda_build, write_cuda

    try:
        nvcc = cuda_build.nvcc()
    except cuda_build.CudaUnavailable:
        pytest.skip("needs nvcc")
    res = subprocess.run([nvcc, "-O3", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "w.cubin"),
                          write_cuda.SOURCE], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", res.stderr)]
    assert len(regs) == 4 and max(regs) <= 192, res.stderr
    assert len(re.findall(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", res.stderr)) == 4, \
        res.stderr


def test_write_cuda_grid_counts_q_programs_of_four_heads():
    """write_cuda.grid, which a chained decode counts as the SM slots the write holds (oscar_decode write_kernel):
    K and V programs per (token, KV head), and with q one more per 4 query heads (GLM-4.7's 12: 3)."""
    from sglang_oscar.kernels import write_cuda

    assert write_cuda.grid(1, 1, 12) == (1, 1, 5)
    assert write_cuda.grid(3, 8, None) == (3, 8, 2)
    assert write_cuda.grid(1, 8, 4) == (1, 8, 3) and write_cuda.grid(2, 8, 5) == (2, 8, 4)
    src = open(write_cuda.SOURCE).read()
    assert f"constexpr int kQHeads = {write_cuda.Q_HEADS_PER_CTA};" in src
