"""Server options of the int2 KV-cache mode, from one flag and the seed's environment variables.

SGLang's ServerArgs cannot grow new fields from a plugin (0.5.17: `ServerArgs.from_cli_args`
copies only dataclass fields), so the one flag we add, --kv-cache-quant-group-size, is taken out
of argv here and carried, like every other option, in an environment variable. Environment
variables are inherited by the spawned scheduler processes, where the pool and the backend are
built, so every process parses the same OscarServeConfig from the same source.

Accepted (seed names kept so seed launch scripts work unchanged):

    --kv-cache-quant-group-size N      -> SGLANG_OSCAR_KV_QUANT_GROUP_SIZE (ours; the transport)
    SGLANG_OSCAR_BUNDLE                our safetensors rotation bundle (or builtin:identity|hadamard)
    SGLANG_OSCAR_{K,V}_ROTATION_PATH   the seed's .pt rotations (both or neither)
    SGLANG_OSCAR_{K,V}_CLIP_RATIO      clip quantile in (0, 1]; 0 = the seed's "no clip" (= 1.0)
    SGLANG_OSCAR_ABSORB_V_ROTATION     fold T_V into qkv_proj / o_proj (default on)
    SGLANG_MIXED_KV_PREFIX_TOKENS      BF16 sink size S (default 64)
    SGLANG_MIXED_KV_RECENT_TOKENS      BF16 recent window W (default 256)
    SGLANG_ENABLE_MIXED_KV_WINDOWS     must not be off: the windows are part of the format
    SGLANG_MIXED_KV_HP_DTYPE           window dtype: bfloat16 (default), float16, float32
    SGLANG_MIXED_KV_SCALE_DTYPE        only bfloat16 (what the kernels store)
    SGLANG_MIXED_KV_HP_MAX_SPLITS      split count for the window part of decode (default 8)
    SGLANG_OSCAR_DECODE_WAVES          at least this many decode programs per SM for the INT2 history
                                       (default 3; the kernel's wave fill may add splits; more splits
                                       help small batches at long context)
    SGLANG_OSCAR_EXTEND_ATTENTION      attention of prefill / extend steps over the rebuilt BF16 prefix:
                                       auto (default: FlashInfer on CUDA, torch SDPA on CPU),
                                       flashinfer, or sdpa (torch, slower on CUDA; for comparison)
    SGLANG_OSCAR_HISTORY_KERNEL        the INT2 history stage of decode: triton (default, every shape) or
                                       cuda (kernels/history_cuda.py, the shapes its check_supported
                                       accepts, e.g. Qwen3-8B; checked and built with nvcc at startup;
                                       meant for --page-size 64)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..config import SUPPORTED_GROUPS

GROUP_FLAG = "--kv-cache-quant-group-size"
ENV_GROUP = "SGLANG_OSCAR_KV_QUANT_GROUP_SIZE"
ENV_BUNDLE = "SGLANG_OSCAR_BUNDLE"
ENV_K_PATH = "SGLANG_OSCAR_K_ROTATION_PATH"
ENV_V_PATH = "SGLANG_OSCAR_V_ROTATION_PATH"
ENV_K_CLIP = "SGLANG_OSCAR_K_CLIP_RATIO"
ENV_V_CLIP = "SGLANG_OSCAR_V_CLIP_RATIO"
ENV_ABSORB_V = "SGLANG_OSCAR_ABSORB_V_ROTATION"
ENV_PREFIX = "SGLANG_MIXED_KV_PREFIX_TOKENS"
ENV_RECENT = "SGLANG_MIXED_KV_RECENT_TOKENS"
ENV_WINDOWS = "SGLANG_ENABLE_MIXED_KV_WINDOWS"
ENV_HP_DTYPE = "SGLANG_MIXED_KV_HP_DTYPE"
ENV_SCALE_DTYPE = "SGLANG_MIXED_KV_SCALE_DTYPE"
ENV_HP_SPLITS = "SGLANG_MIXED_KV_HP_MAX_SPLITS"
ENV_WAVES = "SGLANG_OSCAR_DECODE_WAVES"
ENV_EXTEND = "SGLANG_OSCAR_EXTEND_ATTENTION"
ENV_HISTORY = "SGLANG_OSCAR_HISTORY_KERNEL"

ALL_ENV = (ENV_GROUP, ENV_BUNDLE, ENV_K_PATH, ENV_V_PATH, ENV_K_CLIP, ENV_V_CLIP, ENV_ABSORB_V, ENV_PREFIX,
           ENV_RECENT, ENV_WINDOWS, ENV_HP_DTYPE, ENV_SCALE_DTYPE, ENV_HP_SPLITS, ENV_WAVES, ENV_EXTEND, ENV_HISTORY)

BUILTIN_BUNDLES = ("builtin:identity", "builtin:hadamard")
DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DEFAULT_HP_SPLITS = 8
DEFAULT_WAVES = 3
EXTEND_IMPLS = ("auto", "flashinfer", "sdpa")
HISTORY_KERNELS = ("triton", "cuda")  # oscar_decode(..., history_kernel=...)

# Accepted spellings -> canonical torch dtype name (the seed accepted all of these).
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "torch.float16": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32", "torch.float32": "float32",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class OscarOptionError(ValueError):
    """A bad int2 server option; the message names the flag or variable and what to do."""


@dataclasses.dataclass(frozen=True)
class OscarServeConfig:
    """Everything the int2 mode needs besides the model; identical in every process."""

    group_size: Optional[int] = None  # None: the bundle's groups, or head_dim for seed files (seed default)
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    window_dtype: str = "bfloat16"
    scale_dtype: str = "bfloat16"
    hp_max_splits: int = DEFAULT_HP_SPLITS
    bundle_path: Optional[str] = None
    k_rotation_path: Optional[str] = None
    v_rotation_path: Optional[str] = None
    k_clip: Optional[float] = None  # None: the bundle's per-layer calibrated ratios (seed files: 1.0)
    v_clip: Optional[float] = None
    absorb_v_rotation: bool = True
    decode_waves: int = DEFAULT_WAVES
    extend_attention: str = "auto"
    history_kernel: str = "triton"  # "cuda": checked against the model and built at startup (srt/startup_checks.py)

    @property
    def rotation_source(self) -> str:
        if self.bundle_path:
            return "builtin" if self.bundle_path in BUILTIN_BUNDLES else "bundle"
        return "seed"

    def resolve_group(self, head_dim: int) -> int:
        """The group size for a model (the seed's default is one group per row: G = head_dim)."""
        g = head_dim if self.group_size is None else self.group_size
        check_group(g, head_dim)
        return g

    def to_env(self) -> dict:
        """Environment that reproduces this config in a child process (from_env(to_env()) == self)."""
        env = {
            ENV_PREFIX: str(self.sink), ENV_RECENT: str(self.recent), ENV_WINDOWS: "1",
            ENV_HP_DTYPE: self.window_dtype, ENV_SCALE_DTYPE: self.scale_dtype,
            ENV_HP_SPLITS: str(self.hp_max_splits), ENV_ABSORB_V: "1" if self.absorb_v_rotation else "0",
            ENV_WAVES: str(self.decode_waves), ENV_EXTEND: self.extend_attention,
            ENV_HISTORY: self.history_kernel,
        }
        optional = {ENV_GROUP: self.group_size, ENV_BUNDLE: self.bundle_path, ENV_K_PATH: self.k_rotation_path,
                    ENV_V_PATH: self.v_rotation_path, ENV_K_CLIP: self.k_clip, ENV_V_CLIP: self.v_clip}
        env.update({k: repr(v) if isinstance(v, float) else str(v) for k, v in optional.items() if v is not None})
        return env

    def summary(self) -> str:
        rot = self.bundle_path if self.bundle_path else f"seed K={self.k_rotation_path} V={self.v_rotation_path}"
        clip = "bundle" if self.k_clip is None and self.v_clip is None else f"K={self.k_clip} V={self.v_clip}"
        return (f"int2 KV: sink={self.sink} recent={self.recent} group={self.group_size or 'auto'} "
                f"window={self.window_dtype} params={self.scale_dtype} rotation={rot} clip={clip} "
                f"V={'absorbed' if self.absorb_v_rotation else 'runtime'} history={self.history_kernel}")


def check_group(group: int, head_dim: Optional[int] = None) -> None:
    if group not in SUPPORTED_GROUPS:
        raise OscarOptionError(f"{GROUP_FLAG} {group} is not supported by the OSCAR kernels; use one of "
                               f"{SUPPORTED_GROUPS} (bits/element: 32 -> 3.0, 64 -> 2.5, 128 -> 2.25)")
    if head_dim is not None and group > head_dim:
        raise OscarOptionError(f"{GROUP_FLAG} {group} is larger than the model's head_dim {head_dim}; "
                               f"use a group size <= {head_dim}")


def pop_group_flag(argv: Sequence[str]) -> tuple[list, Optional[int]]:
    """Remove --kv-cache-quant-group-size [=]N from argv (SGLang's parser would reject it)."""
    rest, value, i = [], None, 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a == GROUP_FLAG:
            if i + 1 >= len(argv):
                raise OscarOptionError(f"{GROUP_FLAG} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(GROUP_FLAG + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, None if value is None else _int(value, GROUP_FLAG, minimum=1)


def _int(text: str, name: str, minimum: int) -> int:
    try:
        v = int(str(text).strip())
    except ValueError:
        raise OscarOptionError(f"{name}={text!r} is not an integer") from None
    if v < minimum:
        raise OscarOptionError(f"{name}={v} must be >= {minimum}")
    return v


def _bool(text: str, name: str) -> bool:
    t = str(text).strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise OscarOptionError(f"{name}={text!r} is not a boolean (use 1/0, true/false)")


def _clip(text: str, name: str) -> float:
    try:
        v = float(str(text).strip())
    except ValueError:
        raise OscarOptionError(f"{name}={text!r} is not a number") from None
    if v == 0.0:
        return 1.0  # the seed's spelling of "no clipping"; our convention is rho = 1
    if not 0.0 < v <= 1.0:
        raise OscarOptionError(f"{name}={v} is outside (0, 1]: it is the quantile of |x| kept unclipped "
                               "(1 = no clipping; the seed's 0 is also read as no clipping)")
    return v


def _dtype(text: str, name: str) -> str:
    d = _DTYPE_ALIASES.get(str(text).strip().lower())
    if d is None:
        raise OscarOptionError(f"{name}={text!r} is not a dtype (use bfloat16, float16 or float32)")
    return d


def _path(text: str, name: str) -> str:
    p = str(text).strip()
    if not Path(p).is_file():
        raise OscarOptionError(f"{name}={p!r}: file not found")
    return p


def from_env(env: Optional[Mapping[str, str]] = None, *, group_size: Optional[int] = None) -> OscarServeConfig:
    """Parse the options; group_size (from the flag) wins over SGLANG_OSCAR_KV_QUANT_GROUP_SIZE."""
    env = os.environ if env is None else env

    def get(name):
        v = env.get(name)
        return None if v is None or str(v).strip() == "" else v

    if group_size is None and get(ENV_GROUP) is not None:
        group_size = _int(get(ENV_GROUP), ENV_GROUP, minimum=1)
    if group_size is not None:
        check_group(group_size)

    if get(ENV_WINDOWS) is not None and not _bool(get(ENV_WINDOWS), ENV_WINDOWS):
        raise OscarOptionError(f"{ENV_WINDOWS}=0 asks for INT2 without BF16 windows, which --kv-cache-dtype int2 "
                               f"does not offer (the windows are part of the format); unset it, or set "
                               f"{ENV_PREFIX}=0 for no sink")
    sink = _int(get(ENV_PREFIX), ENV_PREFIX, 0) if get(ENV_PREFIX) is not None else DEFAULT_SINK
    recent = _int(get(ENV_RECENT), ENV_RECENT, 1) if get(ENV_RECENT) is not None else DEFAULT_RECENT

    window_dtype = _dtype(get(ENV_HP_DTYPE), ENV_HP_DTYPE) if get(ENV_HP_DTYPE) is not None else "bfloat16"
    scale_dtype = _dtype(get(ENV_SCALE_DTYPE), ENV_SCALE_DTYPE) if get(ENV_SCALE_DTYPE) is not None else "bfloat16"
    if scale_dtype != "bfloat16":
        raise OscarOptionError(f"{ENV_SCALE_DTYPE}={get(ENV_SCALE_DTYPE)} is not supported: the OSCAR kernels "
                               "store scale and min as bfloat16 (2.25 bits/element at G=128; the seed's float32 "
                               "would be 2.5); unset it or set bfloat16")
    splits = _int(get(ENV_HP_SPLITS), ENV_HP_SPLITS, 1) if get(ENV_HP_SPLITS) is not None else DEFAULT_HP_SPLITS

    bundle = get(ENV_BUNDLE)
    kp, vp = get(ENV_K_PATH), get(ENV_V_PATH)
    if bundle is not None and (kp is not None or vp is not None):
        raise OscarOptionError(f"both {ENV_BUNDLE} and the seed's {ENV_K_PATH}/{ENV_V_PATH} are set; "
                               "give one rotation source")
    if (kp is None) != (vp is None):
        given, missing = (ENV_K_PATH, ENV_V_PATH) if kp is not None else (ENV_V_PATH, ENV_K_PATH)
        raise OscarOptionError(f"{given} is set but {missing} is not: the seed's rotations come as a K and V pair")
    if bundle is None and kp is None:
        raise OscarOptionError(f"--kv-cache-dtype int2 needs rotations: set {ENV_BUNDLE}=<bundle.safetensors> "
                               f"(python -m sglang_oscar.calibrate), {ENV_BUNDLE}=builtin:hadamard for a "
                               f"data-free one, or the seed's {ENV_K_PATH} and {ENV_V_PATH}")
    if bundle is not None and bundle not in BUILTIN_BUNDLES:
        if bundle.startswith("builtin:"):
            raise OscarOptionError(f"{ENV_BUNDLE}={bundle!r}: unknown builtin, use one of {BUILTIN_BUNDLES}")
        bundle = _path(bundle, ENV_BUNDLE)
    if kp is not None:
        kp, vp = _path(kp, ENV_K_PATH), _path(vp, ENV_V_PATH)

    k_clip = _clip(get(ENV_K_CLIP), ENV_K_CLIP) if get(ENV_K_CLIP) is not None else None
    v_clip = _clip(get(ENV_V_CLIP), ENV_V_CLIP) if get(ENV_V_CLIP) is not None else None
    absorb = _bool(get(ENV_ABSORB_V), ENV_ABSORB_V) if get(ENV_ABSORB_V) is not None else True
    waves = _int(get(ENV_WAVES), ENV_WAVES, 1) if get(ENV_WAVES) is not None else DEFAULT_WAVES
    extend = str(get(ENV_EXTEND) or "auto").strip().lower()
    if extend not in EXTEND_IMPLS:
        raise OscarOptionError(f"{ENV_EXTEND}={get(ENV_EXTEND)!r}: use one of {EXTEND_IMPLS}")
    history = str(get(ENV_HISTORY) or "triton").strip().lower()
    if history not in HISTORY_KERNELS:
        raise OscarOptionError(f"{ENV_HISTORY}={get(ENV_HISTORY)!r}: use one of {HISTORY_KERNELS} (triton: every "
                               "supported shape; cuda: the shapes kernels/history_cuda.py covers, e.g. Qwen3-8B)")

    return OscarServeConfig(group_size, sink, recent, window_dtype, scale_dtype, splits, bundle, kp, vp,
                            k_clip, v_clip, absorb, waves, extend, history)


def from_argv(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> tuple[list, OscarServeConfig]:
    """(argv without our flag, config). The launcher then exports config.to_env() for the children."""
    rest, group = pop_group_flag(argv)
    return rest, from_env(env, group_size=group)
