"""Startup checks of the int2 mode against the model and the parallel layout, and the choice of decode kernels.

They run in the launcher's process before anything is spawned or loaded (the ServerArgs.from_cli_args
hook: int2_setup.check_before_load, for every TP rank) and again in each scheduler process, and fail
with one message that says what to change, instead of a shape error deep inside a kernel.
decode_path picks the fastest decode kernels the shape supports on the device, and the page size.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..config import MAX_GQA, check_supported_head_dim, default_group
from ..kernels.layout import check_shape
from ..kernels.shapes import CUDA_HISTORY_PAGE, CUDA_WRITE_MAX_TOKENS, cuda_history_refusal, cuda_write_refusal
from ..models import shape_from_config
from ..rotation.bundle import (ORTHO_TOL, BundleError, RotationBundle, check_expectations, data_free_bundle, load_bundle,
                               load_seed_pt, orthogonality_error)
from .capacity import kv_head_range
from .options import ENV_ABSORB_V, ENV_BUNDLE, GROUP_FLAG, OscarOptionError, OscarServeConfig

logger = logging.getLogger(__name__)

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
        shape = shape_from_config(cfg)  # the fallbacks of models.py: no num_key_value_heads, no head_dim
        return cls(arch, shape["num_layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], tp_size)


def check_model(model: ModelInfo) -> None:
    try:
        check_supported_head_dim(model.head_dim, "model: ")  # the group is checked against it later
    except ValueError as e:
        raise OscarOptionError(f"{model.architecture}: {e}") from None
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
        g = group or default_group(model.head_dim)
        return data_free_bundle(cfg.bundle_path.split(":", 1)[1], model.num_layers, model.kv_heads,
                                model.head_dim, g, g)
    if src == "bundle":
        return load_bundle(cfg.bundle_path, expect_layers=model.num_layers, expect_kv_heads=model.kv_heads,
                           expect_head_dim=model.head_dim)
    g = group or default_group(model.head_dim)  # seed files carry no group
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
    # (layer, KV head) pairs with INT4 keys on the rank that has the most: every rank sizes its pool for that many,
    # so all ranks hold the same token count (SGLang sizes one count for every rank)
    k4_heads_max: int = 0

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
    k4 = None if b.k_bits is None else b.k_bits == 4  # k_bits needs the bundle's KV heads (validate_bundle)
    k4_max = 0 if k4 is None else max(int(k4[:, slice(*kv_head_range(r, model.tp_size, model.kv_heads))].sum())
                                      for r in range(model.tp_size))
    return StartupPlan(shard, b.k_group, b.v_group, start, end, k4_max)


# The GPU generation the CUDA history stage is built and measured for (H100 / H200).
CUDA_HISTORY_SM_MAJOR = 9


@dataclasses.dataclass(frozen=True)
class DecodePath:
    """The decode kernels a server runs and the page size of its pool (decode_path)."""

    history: str  # "cuda" (kernels/history_cuda.py) or "triton" (kernels/decode.py)
    write: str  # the decode KV write of up to CUDA_WRITE_MAX_TOKENS tokens: "cuda" (kernels/write_cuda.py) or "triton"
    page_size: int
    why: str  # cuda: what it was chosen for; triton: what keeps the CUDA history stage out
    why_write: str = ""  # write "triton" beside the CUDA history: why

    def line(self) -> str:
        """The one startup log line naming the choice (and for the Triton path, why)."""
        if self.history == "triton":
            return f"decode: Triton history and KV write, page size {self.page_size} (no CUDA history stage: {self.why})"
        write = (f"CUDA KV write up to {CUDA_WRITE_MAX_TOKENS} tokens" if self.write == "cuda"
                 else f"Triton KV write ({self.why_write})")
        return f"decode: CUDA history stage and {write}, page size {self.page_size} ({self.why})"


def decode_path(*, head_dim: int, q_heads: int, kv_heads: int, k_group: int, v_group: int,
                window_dtype: torch.dtype, x_dtype: torch.dtype, device, page_size: Optional[int],
                page_refusal: Optional[str] = None, nvcc: Optional[bool] = None) -> DecodePath:
    """The fastest decode kernels this rank's attention (local query / KV heads) supports on `device`.

    The CUDA history stage (kernels/history_cuda.py, with the CUDA KV write where kernels/shapes.py covers the model)
    on pages of CUDA_HISTORY_PAGE slots, where: the device is a Hopper GPU (sm_90), the shape is one the stage covers
    (shapes.cuda_history_refusal), nvcc is there to build it, and the page size is free (page_size None: the user
    gave none, and nothing else needs pages of 1: page_refusal) or already >= CUDA_HISTORY_PAGE. Otherwise the Triton
    path (every supported shape) on the given page size (None: 1), and `why` says what kept the CUDA stage out.
    nvcc: whether nvcc is found (None: look it up)."""
    dev = torch.device(device)

    def triton(why: str) -> DecodePath:
        return DecodePath("triton", "triton", page_size or 1, why)

    if dev.type != "cuda":
        return triton(f"it needs an NVIDIA GPU, this server runs on {dev.type}")
    major, minor = torch.cuda.get_device_capability(dev)
    if major != CUDA_HISTORY_SM_MAJOR:
        return triton(f"it is built and measured for Hopper GPUs (sm_90), this GPU is sm_{major}{minor}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise OscarOptionError(f"{q_heads} query heads on this rank are not a multiple of its {kv_heads} KV heads")
    gqa = q_heads // kv_heads
    why = cuda_history_refusal(head_dim, gqa, k_group, v_group, window_dtype)
    if why:
        return triton(why.replace("the CUDA history stage covers", "it covers"))
    if page_size is not None and page_size < CUDA_HISTORY_PAGE:
        return triton(f"--page-size {page_size} kept; it needs pages of {CUDA_HISTORY_PAGE} (drop --page-size to get "
                      "them)")
    if page_size is None and page_refusal:
        return triton(f"{page_refusal}, and it needs pages of {CUDA_HISTORY_PAGE}")
    if nvcc is None:
        from ..kernels.cuda_build import CudaUnavailable, nvcc as find_nvcc

        try:
            find_nvcc()
            nvcc = True
        except CudaUnavailable:
            nvcc = False
    if not nvcc:
        return triton("it is built at startup with nvcc, which is not on PATH, in $CUDA_HOME/bin or "
                      "/usr/local/cuda/bin")
    page = page_size or CUDA_HISTORY_PAGE
    chosen = f"Hopper sm_{major}{minor}, head_dim {head_dim}, GQA {gqa}, groups {k_group}/{v_group}"
    why_write = cuda_write_refusal(head_dim, k_group, v_group, x_dtype, window_dtype)
    return DecodePath("cuda", "triton" if why_write else "cuda", page, chosen, why_write or "")


def build_cuda_path(path: DecodePath, device) -> DecodePath:
    """Build and load the CUDA libraries of a "cuda" path on this rank (nvcc on the first server of a machine, then
    the on-disk cache; ranks share it and the build is atomic), before any CUDA graph is captured. A build that fails
    gives the Triton path, whose `why` names the failure (the caller logs it: never a silent fallback)."""
    if path.history != "cuda":
        return path
    from ..kernels import history_cuda, write_cuda
    from ..kernels.cuda_build import CudaUnavailable

    with torch.cuda.device(torch.device(device)):
        try:
            history_cuda.library()
        except CudaUnavailable as e:
            return DecodePath("triton", "triton", path.page_size, f"its build failed: {str(e).splitlines()[0]}")
        if path.write == "cuda":
            try:
                write_cuda.library()
            except CudaUnavailable as e:
                return dataclasses.replace(path, write="triton", why_write=f"its build failed: {e}")
    return path


__all__ = ["BundleError", "CUDA_HISTORY_SM_MAJOR", "DecodePath", "MAX_GQA", "ModelInfo", "StartupPlan",
           "V_ABSORB_ARCHITECTURES", "build_cuda_path", "check_model", "check_v_absorption", "decode_path",
           "load_rotation", "plan_rank"]
