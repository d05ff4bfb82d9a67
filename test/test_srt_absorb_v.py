"""V-rotation absorption (srt/absorb_v.py) on plain tensors: no SGLang needed.

A random GQA attention block is run twice: with the original weights, and with T_V folded into the
v rows of qkv_proj and the input columns of o_proj (the attention itself unchanged, so it now works
on v·T_V, which is what the int2 pool stores). The outputs must agree to fp32 rounding, and the
absorbed v must equal v·T_V. Then the same at TP=2/4, sharding the weights the way SGLang's
QKVParallelLinear / RowParallelLinear do (srt/capacity.py:kv_head_range), absorbing each
shard with its own KV heads' matrices, and summing the o_proj partial sums (the all-reduce).
"""

import types

import pytest
import torch

from sglang_oscar.srt import absorb_v as A
from sglang_oscar.srt.options import OscarOptionError
from sglang_oscar.srt.capacity import kv_head_range

D = 16
HIDDEN = 48


def _orth(n, gen):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _tv(kind, kv_heads, gen):
    if kind == "layer":
        return _orth(D, gen)[None]  # [1, D, D]: one T_V per layer
    if kind == "head":
        return torch.stack([_orth(D, gen) for _ in range(kv_heads)])  # [Hkv, D, D]
    # not orthogonal (well conditioned): o_proj must use the inverse, not the transpose
    return torch.stack([_orth(D, gen) @ torch.diag(torch.linspace(0.5, 2.0, D)) for _ in range(kv_heads)])


def _block(hq, hkv, bias, gen, o_bias=False):
    n_out = (hq + 2 * hkv) * D
    return dict(
        qkv_w=torch.randn(n_out, HIDDEN, generator=gen) / HIDDEN ** 0.5,
        qkv_b=torch.randn(n_out, generator=gen) if bias else None,
        o_w=torch.randn(HIDDEN, hq * D, generator=gen) / (hq * D) ** 0.5,
        o_b=torch.randn(HIDDEN, generator=gen) if o_bias else None,
        hq=hq, hkv=hkv)


def _rms(x):  # Qwen3-style per-head norm on q/k: acts before attention, never on v
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _qkv(x, qkv_w, qkv_b, hq, hkv):
    y = torch.nn.functional.linear(x, qkv_w, qkv_b)
    q, k, v = y.split([hq * D, hkv * D, hkv * D], dim=-1)
    return q.view(-1, hq, D), k.view(-1, hkv, D), v.view(-1, hkv, D)


def _attend(q, k, v):
    """Causal GQA attention, [T, H, D] -> [T, Hq*D] (query head j reads KV head j // group)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def _forward(x, b, partial=False):
    q, k, v = _qkv(x, b["qkv_w"], b["qkv_b"], b["hq"], b["hkv"])
    out = torch.nn.functional.linear(_attend(_rms(q), _rms(k), v), b["o_w"])
    return out if partial or b["o_b"] is None else out + b["o_b"]


def _absorbed(b, tv):
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    A.absorb_v_rows_(b["qkv_w"], b["qkv_b"], tv, q_size=b["hq"] * D, kv_heads=b["hkv"], head_dim=D)
    A.absorb_o_cols_(b["o_w"], tv, q_heads=b["hq"], kv_heads=b["hkv"], head_dim=D)
    return b


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (4, 1)])  # GQA ratios 1, 2, 4, 4 (MQA)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["layer", "head", "invertible"])
def test_absorbed_block_equals_original(hq, hkv, bias, kind):
    gen = torch.Generator().manual_seed(hq * 100 + hkv * 10 + bias)
    b = _block(hq, hkv, bias, gen, o_bias=True)
    tv = _tv(kind, hkv, gen)
    x = torch.randn(11, HIDDEN, generator=gen)
    ab = _absorbed(b, tv)
    torch.testing.assert_close(_forward(x, ab), _forward(x, b), rtol=1e-5, atol=1e-5)
    # what the pool stores: the absorbed model's v is the original v rotated per KV head
    _, _, v = _qkv(x, b["qkv_w"], b["qkv_b"], hq, hkv)
    _, _, v_abs = _qkv(x, ab["qkv_w"], ab["qkv_b"], hq, hkv)
    torch.testing.assert_close(v_abs, torch.einsum("thd,hde->the", v, A.per_kv_head(tv, hkv)), rtol=1e-5, atol=1e-5)
    # q and k rows untouched (K is rotated by the pool, never by the weights)
    n_qk = (hq + hkv) * D
    assert torch.equal(ab["qkv_w"][:n_qk], b["qkv_w"][:n_qk])
    if bias:
        assert torch.equal(ab["qkv_b"][:n_qk], b["qkv_b"][:n_qk])


def _shard(b, tp_rank, tp_size):
    """One rank's weights, as QKVParallelLinear (rows [q | k | v] of its heads; a KV head replicated
    when tp_size > kv_heads) and RowParallelLinear (its query heads' input columns) hold them."""
    hq, hkv = b["hq"], b["hkv"]
    hq_l = hq // tp_size
    kv0, kv1 = kv_head_range(tp_rank, tp_size, hkv)
    q_rows = torch.arange(tp_rank * hq_l * D, (tp_rank + 1) * hq_l * D)
    k_rows = hq * D + torch.arange(kv0 * D, kv1 * D)
    v_rows = (hq + hkv) * D + torch.arange(kv0 * D, kv1 * D)
    rows = torch.cat([q_rows, k_rows, v_rows])
    return dict(qkv_w=b["qkv_w"][rows].clone(), qkv_b=None if b["qkv_b"] is None else b["qkv_b"][rows].clone(),
                o_w=b["o_w"][:, q_rows].clone(), o_b=None, hq=hq_l, hkv=kv1 - kv0), (kv0, kv1)


@pytest.mark.parametrize("tp,hq,hkv", [(2, 4, 2), (2, 8, 4), (2, 4, 1), (4, 8, 2), (2, 4, 4)])
@pytest.mark.parametrize("kind", ["layer", "head"])
def test_tp_shards_absorbed_separately_equal_tp1(tp, hq, hkv, kind):
    gen = torch.Generator().manual_seed(tp * 1000 + hq * 10 + hkv)
    b = _block(hq, hkv, True, gen, o_bias=True)
    tv = _tv(kind, hkv, gen)
    x = torch.randn(9, HIDDEN, generator=gen)
    want = _forward(x, b)
    total = b["o_b"].clone()  # RowParallelLinear adds its (unsharded) bias once, after the reduce
    for r in range(tp):
        shard, (kv0, kv1) = _shard(b, r, tp)
        local_tv = tv if tv.shape[0] == 1 else tv[kv0:kv1]  # = RotationBundle.shard(kv0, kv1)
        total = total + _forward(x, _absorbed(shard, local_tv), partial=True)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_rounded_once(dtype):
    """The math runs in float64 and is cast back once: every absorbed weight is the exact product
    rounded to the weight dtype (within one ulp), not a product accumulated in half precision."""
    gen = torch.Generator().manual_seed(7)
    b = _block(4, 2, True, gen)
    tv = _tv("head", 2, gen)
    w, bias, o = b["qkv_w"].to(dtype), b["qkv_b"].to(dtype), b["o_w"].to(dtype)
    w2, b2, o2 = w.clone(), bias.clone(), o.clone()
    A.absorb_v_rows_(w2, b2, tv, q_size=4 * D, kv_heads=2, head_dim=D)
    A.absorb_o_cols_(o2, tv, q_heads=4, kv_heads=2, head_dim=D)
    t = tv.double()
    exact_w = torch.einsum("hde,hdi->hei", t, w.double()[6 * D:].view(2, D, HIDDEN)).reshape(2 * D, HIDDEN)
    exact_b = torch.einsum("hd,hde->he", bias.double()[6 * D:].view(2, D), t).reshape(-1)
    exact_o = torch.einsum("ohd,hde->ohe", o.double().view(HIDDEN, 4, D), t.repeat_interleave(2, 0)).reshape(HIDDEN, -1)
    ulp = torch.finfo(dtype).eps
    for got, exact in ((w2[6 * D:], exact_w), (b2[6 * D:], exact_b), (o2, exact_o)):
        assert got.dtype == dtype
        assert bool(((got.double() - exact).abs() <= exact.abs() * ulp + 1e-6).all())
    assert torch.equal(w2[:6 * D], w[:6 * D]) and torch.equal(b2[:6 * D], bias[:6 * D])


def test_large_o_proj_is_processed_in_row_blocks(monkeypatch):
    monkeypatch.setattr(A, "_ROW_BLOCK", 5)  # 48 rows -> 10 blocks, the last one partial
    gen = torch.Generator().manual_seed(3)
    b = _block(4, 2, False, gen)
    tv = _tv("head", 2, gen)
    x = torch.randn(6, HIDDEN, generator=gen)
    torch.testing.assert_close(_forward(x, _absorbed(b, tv)), _forward(x, b), rtol=1e-5, atol=1e-5)


def test_shape_errors():
    gen = torch.Generator().manual_seed(0)
    b = _block(4, 2, False, gen)
    with pytest.raises(ValueError, match="q_size"):
        A.absorb_v_rows_(b["qkv_w"], None, _tv("layer", 2, gen), q_size=2 * D, kv_heads=2, head_dim=D)
    with pytest.raises(ValueError, match="3 heads"):
        A.absorb_v_rows_(b["qkv_w"], None, torch.eye(D).expand(3, D, D), q_size=4 * D, kv_heads=2, head_dim=D)
    with pytest.raises(ValueError, match="q_heads"):
        A.absorb_o_cols_(b["o_w"], _tv("layer", 2, gen), q_heads=3, kv_heads=1, head_dim=D)


# ---- model walk (duck-typed SGLang modules) -------------------------------------------------------

class UnquantizedLinearMethod:  # the name is what absorb_v checks
    pass


class Fp8LinearMethod:
    pass


class _Linear(torch.nn.Module):
    def __init__(self, w, b=None, tp_rank=0, tp_size=1, quant=UnquantizedLinearMethod, **extra):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)
        self.quant_method, self.tp_rank, self.tp_size = quant(), tp_rank, tp_size
        for k, v in extra.items():
            setattr(self, k, v)


class _Attn(torch.nn.Module):
    def __init__(self, blk, layer_id, tp_rank=0, tp_size=1, total_kv=None, quant=UnquantizedLinearMethod):
        super().__init__()
        hq, hkv = blk["hq"], blk["hkv"]
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, D
        self.q_size, self.kv_size = hq * D, hkv * D
        self.qkv_proj = _Linear(blk["qkv_w"].clone(), None if blk["qkv_b"] is None else blk["qkv_b"].clone(),
                                tp_rank, tp_size, quant, total_num_kv_heads=total_kv or hkv, num_kv_heads=hkv)
        self.o_proj = _Linear(blk["o_w"].clone(), None, tp_rank, tp_size, quant)
        self.attn = types.SimpleNamespace(layer_id=layer_id)


class Qwen3ForCausalLM(torch.nn.Module):  # stands in for SGLang's class of that name
    def __init__(self, blocks, start=0, **kw):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Attn(b, start + i, **kw) for i, b in enumerate(blocks)])
        self.start_layer, self.end_layer = start, start + len(blocks)


class GemmaForCausalLM(Qwen3ForCausalLM):
    pass


SUPPORTED = frozenset({"Qwen3ForCausalLM"})


def _bundle(tvs):
    return types.SimpleNamespace(v_transform=torch.stack(tvs))  # [L, H, D, D]


def test_absorb_model_rewrites_every_layer_once():
    gen = torch.Generator().manual_seed(11)
    blocks = [_block(4, 2, True, gen) for _ in range(3)]
    tvs = [_tv("head", 2, gen) for _ in range(3)]
    model = Qwen3ForCausalLM(blocks)
    calls = []

    def bundle_for_rank(tp_rank, tp_size):
        calls.append((tp_rank, tp_size))
        return _bundle(tvs)

    rec = A.absorb_model_(model, bundle_for_rank, SUPPORTED)
    assert calls == [(0, 1)] and rec.layers == (0, 1, 2) and (rec.kv_start, rec.kv_end) == (0, 2)
    x = torch.randn(5, HIDDEN, generator=gen)
    for blk, tv, m in zip(blocks, tvs, model.layers):
        got = dict(blk, qkv_w=m.qkv_proj.weight, qkv_b=m.qkv_proj.bias, o_w=m.o_proj.weight)
        torch.testing.assert_close(_forward(x, got), _forward(x, blk), rtol=1e-5, atol=1e-5)
    before = model.layers[0].qkv_proj.weight.clone()
    assert A.absorb_model_(model, bundle_for_rank, SUPPORTED) is rec  # a second call must not rotate again
    assert torch.equal(model.layers[0].qkv_proj.weight, before) and len(calls) == 1


def test_absorb_model_uses_the_ranks_kv_heads():
    gen = torch.Generator().manual_seed(12)
    full = _block(4, 4, False, gen)
    shard, (kv0, kv1) = _shard(full, 1, 2)
    model = Qwen3ForCausalLM([shard], tp_rank=1, tp_size=2, total_kv=4)
    tv = _tv("head", 4, gen)
    rec = A.absorb_model_(model, lambda r, n: _bundle([tv[kv0:kv1]]), SUPPORTED)
    assert (rec.kv_start, rec.kv_end) == (2, 4) == (kv0, kv1)


def test_absorb_model_refuses_other_architectures_and_quantized_weights():
    gen = torch.Generator().manual_seed(13)
    blk = _block(4, 2, False, gen)
    tv = [_tv("layer", 2, gen)]
    with pytest.raises(OscarOptionError, match="GemmaForCausalLM.*SGLANG_OSCAR_ABSORB_V_ROTATION=0"):
        A.absorb_model_(GemmaForCausalLM([blk]), lambda r, n: _bundle(tv), SUPPORTED)
    model = Qwen3ForCausalLM([blk], quant=Fp8LinearMethod)
    w = model.layers[0].qkv_proj.weight.clone()
    with pytest.raises(OscarOptionError, match="unquantized float weights.*Fp8LinearMethod"):
        A.absorb_model_(model, lambda r, n: _bundle(tv), SUPPORTED)
    assert torch.equal(model.layers[0].qkv_proj.weight, w)  # checked before anything is rewritten
    model = Qwen3ForCausalLM([blk])
    model.layers[0].o_proj.use_intel_amx_backend = True
    with pytest.raises(OscarOptionError, match="AMX"):
        A.absorb_model_(model, lambda r, n: _bundle(tv), SUPPORTED)


def test_server_args_that_forbid_rewriting_weights():
    ok = types.SimpleNamespace(weight_cache_mode="off", cpu_offload_gb=0, offload_group_size=-1, quantization=None)
    A.check_server_args_for_absorption(ok)
    for bad, match in ((dict(weight_cache_mode="client"), "weight-cache-mode"), (dict(cpu_offload_gb=4), "offload"),
                       (dict(quantization="fp8"), "quantization fp8")):
        with pytest.raises(OscarOptionError, match=match):
            A.check_server_args_for_absorption(types.SimpleNamespace(**{**vars(ok), **bad}))


def _fake_pool(absorb, layers=(0, 3), kv=(0, 2), tvs=None):
    plan = types.SimpleNamespace(kv_start=kv[0], kv_end=kv[1], bundle=_bundle(tvs))
    return types.SimpleNamespace(setup=types.SimpleNamespace(cfg=types.SimpleNamespace(absorb_v_rotation=absorb),
                                                             plan=plan),
                                 start_layer=layers[0], layer_num=layers[1] - layers[0])


def test_backend_guard_checks_weights_and_pool_agree():
    gen = torch.Generator().manual_seed(14)
    tvs = [_tv("head", 2, gen) for _ in range(3)]
    model = Qwen3ForCausalLM([_block(4, 2, False, gen) for _ in range(3)])
    with pytest.raises(OscarOptionError, match="was not absorbed"):
        A.check_v_basis(model, _fake_pool(True, tvs=tvs))
    A.check_v_basis(model, _fake_pool(False, tvs=tvs))  # runtime rotation, plain weights: fine
    A.absorb_model_(model, lambda r, n: _bundle(tvs), SUPPORTED)
    A.check_v_basis(model, _fake_pool(True, tvs=tvs))
    with pytest.raises(RuntimeError, match="pool rotates V at runtime"):
        A.check_v_basis(model, _fake_pool(False, tvs=tvs))
    with pytest.raises(RuntimeError, match="different V rotation"):
        A.check_v_basis(model, _fake_pool(True, tvs=[torch.eye(D)[None].expand(2, D, D)] * 3))
    with pytest.raises(RuntimeError, match="KV heads"):
        A.check_v_basis(model, _fake_pool(True, kv=(2, 4), tvs=tvs))
    with pytest.raises(RuntimeError, match="layers"):
        A.check_v_basis(model, _fake_pool(True, layers=(0, 2), tvs=tvs))
