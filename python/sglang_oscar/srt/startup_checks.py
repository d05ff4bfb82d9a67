"""Startup checks of the int2 mode against the model and the parallel layout, before any pool exists.

They run in each scheduler process (where the model config and the TP rank are known) and fail
with one message that says what to change, instead of a shape error deep inside a kernel.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..kernels.layout import check_shape
from ..rotation.bundle import (ORTHO_TOL, BundleError, RotationBundle, check_expectations, data_free_bundle, load_bundle,
                               load_seed_pt, orthogonality_error)
from .options import ENV_ABSORB_V, ENV_BUNDLE, ENV_HISTORY, GROUP_FLAG, OscarOptionError, OscarServeConfig

logger = logging.getLogger(__name__)

# decode.py's MAX_GQA (query heads per KV head the decode kernel holds in one tile); copied so this
# module imports without triton. test_srt_startup_checks.py checks the two agree where triton exists.
MAX_GQA = 16

# Architectures whose attention has qkv_proj (QKVParallelLinear, rows [q | k | v]) and o_proj
# (RowParallelLinear over the local q heads) as in SGLang 0.5.17 models/{llama,qwen2,qwen3}.py:
# the V-rotation absorption rewrites exactly those two weights (and the v bias of Qwen2).
V_ABSORB_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_heads: int  # query heads, total
    kv_heads: int  # total
    head_dim: int
    tp_size: int = 1

    @classmethod
    def from_hf_config(cls, cfg, tp_size: int = 1) -> "ModelInfo":
        arch = (getattr(cfg, "architectures", None) or ["?"])[0]
        heads = cfg.num_attention_heads
        return cls(arch, cfg.num_hidden_layers, heads, getattr(cfg, "num_key_value_heads", None) or heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, tp_size)


def kv_head_range(tp_rank: int, tp_size: int, kv_heads: int) -> tuple[int, int]:
    """Global KV heads [start, end) held by a rank, as QKVParallelLinear shards them (0.5.17)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if tp_size >= kv_heads:
        if tp_size % kv_heads:
            raise OscarOptionError(f"tp_size {tp_size} is not a multiple of the {kv_heads} KV heads")
        h = tp_rank // (tp_size // kv_heads)  # replicated: num_kv_head_replicas ranks share a head
        return h, h + 1
    if kv_heads % tp_size:
        raise OscarOptionError(f"{kv_heads} KV heads do not split evenly over tp_size {tp_size}")
    per = kv_heads // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def check_model(model: ModelInfo) -> None:
    check_shape(model.head_dim, 32, "model: ")  # head_dim the kernels support (group checked later)
    if model.num_heads % model.kv_heads:
        raise OscarOptionError(f"{model.num_heads} query heads are not a multiple of {model.kv_heads} KV heads")
    if model.num_heads // model.kv_heads > MAX_GQA:
        raise OscarOptionError(f"{model.architecture}: {model.num_heads // model.kv_heads} query heads per KV head; "
                               f"the int2 decode kernel supports at most {MAX_GQA}")
    kv_head_range(0, model.tp_size, model.kv_heads)


def check_v_absorption(cfg: OscarServeConfig, model: ModelInfo) -> None:
    if cfg.absorb_v_rotation and model.architecture not in V_ABSORB_ARCHITECTURES:
        raise OscarOptionError(
            f"V-rotation absorption knows {sorted(V_ABSORB_ARCHITECTURES)}, not {model.architecture}; set "
            f"{ENV_ABSORB_V}=0 to rotate V at runtime instead (slower decode)")


def load_rotation(cfg: OscarServeConfig, model: ModelInfo, group: Optional[int]) -> RotationBundle:
    """The full (unsharded) bundle for this model, validated; group = the flag's value or None."""
    src = cfg.rotation_source
    if src == "builtin":
        g = group or model.head_dim
        return data_free_bundle(cfg.bundle_path.split(":", 1)[1], model.num_layers, model.kv_heads,
                                model.head_dim, g, g)
    if src == "bundle":
        return load_bundle(cfg.bundle_path, expect_layers=model.num_layers, expect_kv_heads=model.kv_heads,
                           expect_head_dim=model.head_dim)
    g = group or model.head_dim  # seed files carry no group; the seed's default is one group per row
    b = load_seed_pt(cfg.k_rotation_path, cfg.v_rotation_path, k_group=g, v_group=g)
    check_expectations(b, f"{cfg.k_rotation_path} / {cfg.v_rotation_path}", expect_layers=model.num_layers,
                       expect_head_dim=model.head_dim)
    return b


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    """What one rank builds: its shard of the rotations, group sizes and KV head range."""

    bundle: RotationBundle  # this rank's shard, clip ratios overridden by the options if given
    k_group: int
    v_group: int
    kv_start: int
    kv_end: int

    @property
    def kv_heads_local(self) -> int:
        return self.kv_end - self.kv_start


def plan_rank(cfg: OscarServeConfig, model: ModelInfo, tp_rank: int = 0,
              bundle: Optional[RotationBundle] = None) -> StartupPlan:
    check_model(model)
    check_v_absorption(cfg, model)
    if cfg.group_size is not None:
        cfg.resolve_group(model.head_dim)  # flag's group vs head_dim and the kernels
    b = bundle if bundle is not None else load_rotation(cfg, model, cfg.group_size)
    if cfg.group_size is not None and (b.k_group, b.v_group) != (cfg.group_size, cfg.group_size):
        raise OscarOptionError(
            f"{GROUP_FLAG} {cfg.group_size} but the rotation bundle was fitted for groups K={b.k_group} "
            f"V={b.v_group} (spectral placement and clip ratios depend on it); drop the flag or recalibrate "
            f"with that group size ({ENV_BUNDLE})")
    for side, g in (("K", b.k_group), ("V", b.v_group)):
        try:
            check_shape(model.head_dim, g, f"{side}: ")
        except ValueError as e:
            raise OscarOptionError(f"rotation bundle: {e}") from None
    if b.bits != 2:
        raise OscarOptionError(f"rotation bundle was fitted for {b.bits}-bit codes; --kv-cache-dtype int2 needs 2")
    if cfg.absorb_v_rotation and not b.orthogonal:
        # Absorption itself works for any invertible T_V, but every path we test assumes T_V^-1 = T_V^T.
        # The bundle's flag covers K and V; only V matters here (a non-orthogonal K, e.g. method
        # "balanced", is served through T_q = T_K^-T, srt/pool.py).
        err = orthogonality_error(b.v_transform)
        if err > ORTHO_TOL:
            raise OscarOptionError(f"V absorption needs an orthogonal V transform; this bundle's V transforms have "
                                   f"max|T·Tᵀ − I| = {err:.3g}; set {ENV_ABSORB_V}=0 or refit")
    start, end = kv_head_range(tp_rank, model.tp_size, model.kv_heads)
    shard = b.shard(start, end) if b.kv_heads else b
    over = {}
    if cfg.k_clip is not None:
        over["k_clip"] = torch.full_like(shard.k_clip, cfg.k_clip)
    if cfg.v_clip is not None:
        over["v_clip"] = torch.full_like(shard.v_clip, cfg.v_clip)
    if over:
        shard = dataclasses.replace(shard, **over)
    return StartupPlan(shard, b.k_group, b.v_group, start, end)


# The page size the CUDA history stage was measured on (benchmark/NOTES.md "The pool in pages and the CUDA
# history stage"): correct at any page size, but it reaches its read rate only when a request's slots come
# in runs of 64 (smaller pages: each KV head's rows of a page are fewer, shorter contiguous reads).
CUDA_HISTORY_PAGE = 64


def check_history_kernel(kernel: str, *, head_dim: int, q_heads: int, kv_heads: int, k_group: int, v_group: int,
                         codebook: bool, device, page_size: int, window_dtype: torch.dtype = torch.bfloat16) -> None:
    """SGLANG_OSCAR_HISTORY_KERNEL against this rank's attention (local q / KV heads) and device, at startup.

    triton: nothing to check (every shape the pool accepts). cuda: the shape must be one the CUDA history
    stage covers (kernels/history_cuda.check_supported), the device a CUDA GPU (sm_80+), and the kernel is
    built (nvcc) and loaded here, before CUDA-graph capture and the first request: TP ranks share the on-disk
    cache and the build is atomic (os.replace), so concurrent ranks are safe. Every refusal says what to
    change. Warns (does not refuse) below --page-size 64."""
    if kernel == "triton":
        return
    if kernel != "cuda":
        raise OscarOptionError(f"{ENV_HISTORY}={kernel!r}: use triton or cuda")
    use_triton = f"set {ENV_HISTORY}=triton (the default; it serves every supported shape)"
    dev = torch.device(device)
    if dev.type != "cuda":
        raise OscarOptionError(f"{ENV_HISTORY}=cuda runs the INT2 history in a CUDA kernel, but this server runs on "
                               f"{dev.type}: {use_triton}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise OscarOptionError(f"{ENV_HISTORY}=cuda: {q_heads} query heads on this rank are not a multiple of its "
                               f"{kv_heads} KV heads")
    from ..kernels import history_cuda

    try:
        # the kernel module is the authority on what it covers (its message names the covered shapes)
        history_cuda.check_supported(head_dim, q_heads // kv_heads, k_group, v_group, codebook, dev,
                                     window_dtype=window_dtype)
    except (ValueError, history_cuda.CudaHistoryUnavailable) as e:
        raise OscarOptionError(
            f"{ENV_HISTORY}=cuda cannot serve this model on this rank (head_dim {head_dim}, {q_heads} query heads "
            f"per {kv_heads} KV heads = GQA {q_heads // kv_heads}, groups K={k_group} V={v_group}"
            f"{', codebook levels' if codebook else ''}, window {window_dtype}): {e}. Serve a covered shape (builtin bundles take their "
            f"groups from {GROUP_FLAG}) or {use_triton}") from None
    try:
        history_cuda.library()  # nvcc build (first server on this machine) or the cached library
    except history_cuda.CudaHistoryUnavailable as e:
        raise OscarOptionError(f"{ENV_HISTORY}=cuda: the CUDA history kernel could not be built or loaded: {e}; "
                               f"install the CUDA toolkit (nvcc) or {use_triton}") from None
    if page_size < CUDA_HISTORY_PAGE:
        logger.warning("sglang_oscar: %s=cuda with --page-size %d: correct at any page size, but it was measured "
                       "(and is fast) with --page-size %d, where a request's rows of one KV head are contiguous "
                       "per page", ENV_HISTORY, page_size, CUDA_HISTORY_PAGE)


__all__ = ["BundleError", "CUDA_HISTORY_PAGE", "MAX_GQA", "ModelInfo", "StartupPlan", "V_ABSORB_ARCHITECTURES",
           "check_history_kernel", "check_model", "check_v_absorption", "kv_head_range", "load_rotation", "plan_rank"]
