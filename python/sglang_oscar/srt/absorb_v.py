"""V-rotation absorption: fold T_V into qkv_proj (v rows) and o_proj (input columns) after loading.

The int2 cache stores V as v·T_V. Without absorption the write kernel computes v·T_V for every
token and the backend turns each attention output back with ·T_V⁻¹. Attention is linear in V
(o = softmax(qkᵀ)·V), so a rotation of V simply passes through to o. Both matrix products can
therefore move into the weights, once, at load time:

* qkv_proj, v rows of KV head h: v_h = x·W_hᵀ + b_h  ->  v_h·T_h = x·(T_hᵀ·W_h)ᵀ + b_h·T_h,
  so W_h <- T_hᵀ·W_h and b_h <- b_h·T_h (W_h = the D rows of that head, nn.Linear's [out, in]).
* o_proj, input columns of query head j (KV head h = j's group): the attention output arrives as
  o'_j = o_j·T_h, and o_j·W_jᵀ = o'_j·T_h⁻¹·W_jᵀ, so W_j <- W_j·T_h⁻ᵀ (= W_j·T_h for orthogonal T).

K is not absorbed: RoPE and Qwen3's k_norm act on k between qkv_proj and the cache, and neither
commutes with a rotation. V passes through nothing between qkv_proj and attention in the Llama,
Qwen2 and Qwen3 attention blocks (Qwen3's q_norm/k_norm take only the q and k slices), which is
why these three are the supported architectures.

TP: each rank holds the v rows of its own KV heads (QKVParallelLinear; a KV head is replicated
when tp_size > kv_heads) and the o_proj columns of its own query heads (RowParallelLinear), and
its query heads' KV heads are among its own, so every rank absorbs its shard with its KV heads'
matrices and no communication. o_proj's bias acts on the output and is untouched.

The top half of this module is pure tensor math (testable without SGLang); the bottom half walks
an SGLang model duck-typed (no SGLang import) and is called by hook #9 (ModelRunner.load_model).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from .options import ENV_ABSORB_V, OscarOptionError

logger = logging.getLogger(__name__)

# Rows of a weight processed at once: bounds the float64 temporaries on large models
# (an 8192x8192 o_proj in float64 would be 512 MiB in one piece).
_ROW_BLOCK = 1024


# ---- pure tensor math ----------------------------------------------------------------------------

def per_kv_head(t_v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[D, D], [1, D, D] or [kv_heads, D, D] -> [kv_heads, D, D] (a per-layer T_V serves every head)."""
    if t_v.dim() == 2:
        t_v = t_v.unsqueeze(0)
    if t_v.dim() != 3 or t_v.shape[-1] != t_v.shape[-2]:
        raise ValueError(f"T_V must be [D, D] or [H, D, D], got {tuple(t_v.shape)}")
    if t_v.shape[0] == 1:
        return t_v.expand(kv_heads, -1, -1)
    if t_v.shape[0] != kv_heads:
        raise ValueError(f"T_V has {t_v.shape[0]} heads, this shard {kv_heads} KV heads")
    return t_v


def absorb_v_rows_(qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor], t_v: torch.Tensor, *,
                   q_size: int, kv_heads: int, head_dim: int) -> None:
    """In place: the v rows of a fused [q | k | v] projection now produce v·T_V per KV head."""
    kv_size = kv_heads * head_dim
    if qkv_weight.dim() != 2 or qkv_weight.shape[0] != q_size + 2 * kv_size:
        raise ValueError(f"qkv weight {tuple(qkv_weight.shape)} is not [q_size + 2*kv_size = "
                         f"{q_size + 2 * kv_size}, in]")
    t = per_kv_head(t_v, kv_heads).to(device=qkv_weight.device, dtype=torch.float64)
    start = q_size + kv_size
    for h in range(kv_heads):  # one head at a time: D rows, small float64 temporaries
        rows = slice(start + h * head_dim, start + (h + 1) * head_dim)
        w = qkv_weight[rows].to(torch.float64)
        qkv_weight[rows] = (t[h].transpose(0, 1) @ w).to(qkv_weight.dtype)
        if qkv_bias is not None:
            qkv_bias[rows] = (qkv_bias[rows].to(torch.float64) @ t[h]).to(qkv_bias.dtype)


def absorb_o_cols_(o_weight: torch.Tensor, t_v: torch.Tensor, *, q_heads: int, kv_heads: int,
                   head_dim: int) -> None:
    """In place: o_proj now takes the attention output in the V basis (o·T_V of each query head's
    KV head). Uses T⁻ᵀ (exact for any invertible T; equal to T when T is orthogonal)."""
    if o_weight.dim() != 2 or o_weight.shape[1] != q_heads * head_dim:
        raise ValueError(f"o_proj weight {tuple(o_weight.shape)} is not [out, q_heads*head_dim = "
                         f"{q_heads * head_dim}]")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    t = per_kv_head(t_v, kv_heads).to(device=o_weight.device, dtype=torch.float64)
    m = torch.linalg.inv(t).transpose(-1, -2).repeat_interleave(q_heads // kv_heads, dim=0)  # [Hq, D, D]
    for r0 in range(0, o_weight.shape[0], _ROW_BLOCK):
        block = o_weight[r0:r0 + _ROW_BLOCK]
        w = block.to(torch.float64).reshape(block.shape[0], q_heads, head_dim)
        block.copy_(torch.einsum("ohd,hde->ohe", w, m).reshape(block.shape).to(o_weight.dtype))


# ---- SGLang models (duck-typed: attributes of models/{llama,qwen2,qwen3}.py in 0.5.17) ------------

@dataclasses.dataclass(frozen=True)
class AbsorbRecord:
    """Left on the model (`model._oscar_v_absorbed`) so the backend can check that the weights and
    the pool agree: V must be rotated exactly once, by the same matrices."""

    layers: tuple  # global layer ids absorbed on this rank
    kv_start: int
    kv_end: int
    checksum: float  # float64 sum of the absorbed T_V (this rank's shard, all its layers)


ABSORB_ATTR = "_oscar_v_absorbed"


def _kv_checksum(bundle, layers) -> float:
    return float(sum(bundle.v_transform[i].double().sum() for i in layers))


def check_server_args_for_absorption(sa) -> None:
    """Options under which rewriting the loaded weights in place would be wrong or unsafe."""
    def fix(what):
        return f"V-rotation absorption cannot be used with {what}; set {ENV_ABSORB_V}=0 (runtime V rotation)"

    if (getattr(sa, "weight_cache_mode", "off") or "off") != "off":
        # The weights are the daemon's shared copy (CUDA IPC): rewriting them changes every client.
        raise OscarOptionError(fix(f"--weight-cache-mode {sa.weight_cache_mode} (weights shared with a daemon)"))
    if (getattr(sa, "cpu_offload_gb", 0) or 0) > 0 or (getattr(sa, "offload_group_size", -1) or -1) > 0:
        raise OscarOptionError(fix("weight offloading (--cpu-offload-gb / --offload-group-size)"))
    if getattr(sa, "quantization", None):
        raise OscarOptionError(fix(f"--quantization {sa.quantization} (absorption rewrites float weights only)"))


def attention_modules(model) -> list:
    """(layer id, attention module) of every attention block this rank holds, in layer order."""
    found = {}
    for m in model.modules():
        if hasattr(m, "qkv_proj") and hasattr(m, "o_proj") and hasattr(getattr(m, "attn", None), "layer_id"):
            lid = int(m.attn.layer_id)
            if lid in found:
                raise RuntimeError(f"sglang_oscar: two attention blocks claim layer {lid}")
            found[lid] = m
    return sorted(found.items())


def _check_float_linear(name: str, lin) -> None:
    qm = type(getattr(lin, "quant_method", None)).__name__
    w = getattr(lin, "weight", None)
    problem = None
    if qm != "UnquantizedLinearMethod":
        problem = f"its quant method is {qm}"
    elif not isinstance(w, torch.Tensor) or w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problem = f"its weight is {getattr(w, 'dtype', type(w).__name__)}"
    elif getattr(lin, "use_intel_amx_backend", False):
        problem = "its weight was repacked for the CPU AMX kernel"
    if problem:
        raise OscarOptionError(f"V-rotation absorption needs unquantized float weights in {name}, but {problem}; "
                               f"set {ENV_ABSORB_V}=0 (runtime V rotation)")


def rank_kv_range(qkv_proj) -> tuple:
    """Global KV heads [start, end) whose v rows this QKVParallelLinear holds."""
    tp_rank, tp_size, total = int(qkv_proj.tp_rank), int(qkv_proj.tp_size), int(qkv_proj.total_num_kv_heads)
    from .capacity import kv_head_range

    start, end = kv_head_range(tp_rank, tp_size, total)
    if end - start != int(qkv_proj.num_kv_heads):
        raise RuntimeError(f"sglang_oscar: qkv_proj holds {qkv_proj.num_kv_heads} KV heads on rank {tp_rank}/"
                           f"{tp_size}, our sharding says [{start}, {end}); this SGLang shards differently")
    return start, end


def absorb_attention_(attn, t_v: torch.Tensor) -> None:
    """Fold one layer's T_V ([D, D] or [local KV heads, D, D]) into one attention block, in place."""
    hq, hkv, d = int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_dim)
    qkv, o = attn.qkv_proj, attn.o_proj
    if attn.q_size != hq * d or attn.kv_size != hkv * d or o.weight.shape[1] != hq * d:
        raise RuntimeError(f"sglang_oscar: unexpected attention shapes (q_size {attn.q_size}, kv_size "
                           f"{attn.kv_size}, o_proj in {o.weight.shape[1]}) for {hq}/{hkv} heads of {d}")
    if (int(o.tp_rank), int(o.tp_size)) != (int(qkv.tp_rank), int(qkv.tp_size)):
        raise RuntimeError("sglang_oscar: qkv_proj and o_proj are sharded over different ranks")
    with torch.no_grad():
        absorb_v_rows_(qkv.weight.data, None if qkv.bias is None else qkv.bias.data, t_v, q_size=hq * d,
                       kv_heads=hkv, head_dim=d)
        absorb_o_cols_(o.weight.data, t_v, q_heads=hq, kv_heads=hkv, head_dim=d)


def absorb_model_(model, bundle_for_rank, supported: frozenset) -> AbsorbRecord:
    """Absorb every attention block of an SGLang model. bundle_for_rank(tp_rank, tp_size) -> the
    rotation bundle sharded for that rank (the caller's plan_rank; sharding read from the model)."""
    arch = type(model).__name__
    if arch not in supported:
        raise OscarOptionError(f"V-rotation absorption supports {sorted(supported)}; this model is served by "
                               f"{arch}; set {ENV_ABSORB_V}=0 to rotate V at runtime instead")
    if getattr(model, ABSORB_ATTR, None) is not None:
        return getattr(model, ABSORB_ATTR)  # never twice: a second pass would rotate V by T_V²
    blocks = attention_modules(model)
    if not blocks:
        raise RuntimeError(f"sglang_oscar: found no attention block (qkv_proj/o_proj/attn) in {arch}")
    ids = [lid for lid, _ in blocks]
    start, end = getattr(model, "start_layer", ids[0]), getattr(model, "end_layer", ids[-1] + 1)
    if ids != list(range(start, end)):
        raise RuntimeError(f"sglang_oscar: attention blocks of layers {ids}, expected {start}..{end - 1}")
    ranges = {rank_kv_range(m.qkv_proj) for _, m in blocks}
    shards = {(int(m.qkv_proj.tp_rank), int(m.qkv_proj.tp_size)) for _, m in blocks}
    if len(ranges) != 1 or len(shards) != 1:
        raise RuntimeError(f"sglang_oscar: attention layers disagree on their TP shard ({shards}, {ranges})")
    (kv_start, kv_end), (tp_rank, tp_size) = ranges.pop(), shards.pop()
    bundle = bundle_for_rank(tp_rank, tp_size)
    for lid, m in blocks:
        _check_float_linear(f"layer {lid} qkv_proj", m.qkv_proj)
        _check_float_linear(f"layer {lid} o_proj", m.o_proj)
    for lid, m in blocks:
        absorb_attention_(m, bundle.v_transform[lid])
    rec = AbsorbRecord(tuple(ids), kv_start, kv_end, _kv_checksum(bundle, ids))
    setattr(model, ABSORB_ATTR, rec)
    logger.info("sglang_oscar: V rotation absorbed into qkv_proj/o_proj of layers %d..%d (KV heads [%d, %d) of "
                "TP rank %d/%d)", ids[0], ids[-1], kv_start, kv_end, tp_rank, tp_size)
    return rec


def check_v_basis(model, pool) -> None:
    """The backend's guard: the pool rotates V at write time iff the model does not. Raises otherwise."""
    rec = getattr(model, ABSORB_ATTR, None)
    absorb = pool.setup.cfg.absorb_v_rotation
    if not absorb:
        if rec is not None:
            raise RuntimeError("sglang_oscar: the model's weights have V absorbed but the pool rotates V at runtime")
        return
    if rec is None:
        raise OscarOptionError(f"{ENV_ABSORB_V}=1 but the V rotation was not absorbed into this model's weights "
                               f"(hook #9 on ModelRunner.load_model did not run); set {ENV_ABSORB_V}=0")
    plan = pool.setup.plan
    want_layers = tuple(range(pool.start_layer, pool.start_layer + pool.layer_num))
    problems = []
    if rec.layers != want_layers:
        problems.append(f"layers {rec.layers} vs pool {want_layers}")
    if (rec.kv_start, rec.kv_end) != (plan.kv_start, plan.kv_end):
        problems.append(f"KV heads [{rec.kv_start}, {rec.kv_end}) vs pool [{plan.kv_start}, {plan.kv_end})")
    got = _kv_checksum(plan.bundle, want_layers) if rec.layers == want_layers else None
    if got is not None and abs(got - rec.checksum) > 1e-6 * max(1.0, abs(got)):
        problems.append("a different V rotation")
    if problems:
        raise RuntimeError("sglang_oscar: absorbed V rotation and int2 pool disagree: " + "; ".join(problems))
