"""Server options of the int2 KV-cache mode, from one flag and the seed's environment variables.

The one flag we add, --kv-cache-quant-group-size, is added to SGLang's own parser (hooks.py
add_cli_args_after). SGLang's ServerArgs cannot grow new fields from a plugin (0.5.17:
`ServerArgs.from_cli_args` copies only dataclass fields), so the launcher's from_cli_args hook
exports its value in SGLANG_OSCAR_KV_QUANT_GROUP_SIZE, where every other option already is.
Environment variables are inherited by the spawned scheduler processes, where the pool and the
backend are built, so every process parses the same OscarServeConfig from the same source, once
(current()).
What the server decides from the model and the device (the decode kernels, the page size) is not
an option: srt/startup_checks.py decode_path.

Accepted (seed names kept so seed launch scripts work unchanged):

    --kv-cache-quant-group-size N      -> SGLANG_OSCAR_KV_QUANT_GROUP_SIZE (ours; the transport)
    SGLANG_OSCAR_BUNDLE                our safetensors rotation bundle (or builtin:identity|hadamard); unset,
                                       the server picks the zoo's bundle for the model, else builtin:hadamard
                                       (ensure_rotation_source)
    SGLANG_OSCAR_{K,V}_ROTATION_PATH   the seed's .pt rotations (both or neither)
    SGLANG_OSCAR_{K,V}_CLIP_RATIO      clip quantile in (0, 1]; 0 = the seed's "no clip" (= 1.0)
    SGLANG_OSCAR_ABSORB_V_ROTATION     fold T_V into qkv_proj / o_proj (default on)
    SGLANG_MIXED_KV_PREFIX_TOKENS      BF16 sink size S (default config.SERVED_SINK, 64)
    SGLANG_MIXED_KV_RECENT_TOKENS      BF16 recent window W (default config.SERVED_RECENT, 256)
    SGLANG_ENABLE_MIXED_KV_WINDOWS     must not be off: the windows are part of the format
    SGLANG_MIXED_KV_HP_DTYPE           window dtype: bfloat16 (default), float16, float32
    SGLANG_MIXED_KV_SCALE_DTYPE        only float8_e4m3fn (what the kernels store)

Two more variables are read where they are used, not parsed into OscarServeConfig (neither changes the cache format;
both modules also serve outside a server):

    SGLANG_OSCAR_ZOO                   zoo.ENV_ZOO: the zoo a server without a rotation source looks its model up in
                                       (zoo.server_zoo), and the zoo CLI's default --zoo
    SGLANG_OSCAR_CACHE                 kernels/cuda_build.py ENV_CACHE: where the nvcc-built CUDA libraries are cached
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping, Optional

from ..config import (SERVED_RECENT, SERVED_SINK, SUPPORTED_GROUPS, QuantFormat, clip_ratio_misfit, default_group,
                      group_misfit)

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

ALL_ENV = (ENV_GROUP, ENV_BUNDLE, ENV_K_PATH, ENV_V_PATH, ENV_K_CLIP, ENV_V_CLIP, ENV_ABSORB_V, ENV_PREFIX,
           ENV_RECENT, ENV_WINDOWS, ENV_HP_DTYPE, ENV_SCALE_DTYPE)

BUILTIN_BUNDLES = ("builtin:identity", "builtin:hadamard")

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


class OscarStartupError(SystemExit):
    """A refused server start in the launcher's process (the ServerArgs.from_cli_args hook, before anything is
    spawned or loaded): a SystemExit, so the launcher exits with status 1 and prints this one line, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"sglang_oscar: {message}")


@dataclasses.dataclass(frozen=True)
class OscarServeConfig:
    """Everything the int2 mode needs besides the model; identical in every process."""

    group_size: Optional[int] = None  # None: the bundle's groups, or config.default_group(head_dim) for builtin / seed
    sink: int = SERVED_SINK
    recent: int = SERVED_RECENT
    window_dtype: str = "bfloat16"
    scale_dtype: str = "float8_e4m3fn"
    bundle_path: Optional[str] = None
    k_rotation_path: Optional[str] = None
    v_rotation_path: Optional[str] = None
    k_clip: Optional[float] = None  # None: the bundle's per-layer calibrated ratios (seed files: 1.0)
    v_clip: Optional[float] = None
    absorb_v_rotation: bool = True

    @property
    def rotation_source(self) -> str:
        if self.bundle_path:
            return "builtin" if self.bundle_path in BUILTIN_BUNDLES else "bundle"
        return "seed"

    def resolve_group(self, head_dim: int) -> int:
        """The group size for a model without a calibrated bundle: the flag's, else config.default_group(head_dim)."""
        g = default_group(head_dim) if self.group_size is None else self.group_size
        check_group(g, head_dim)
        return g

    def summary(self) -> str:
        rot = self.bundle_path if self.bundle_path else f"seed K={self.k_rotation_path} V={self.v_rotation_path}"
        clip = "bundle" if self.k_clip is None and self.v_clip is None else f"K={self.k_clip} V={self.v_clip}"
        return (f"int2 KV: sink={self.sink} recent={self.recent} group={self.group_size or 'auto'} "
                f"window={self.window_dtype} params={self.scale_dtype} rotation={rot} clip={clip} "
                f"V={'absorbed' if self.absorb_v_rotation else 'runtime'}")


def check_group(group: int, head_dim: Optional[int] = None) -> None:
    if group not in SUPPORTED_GROUPS:
        bits = ", ".join(f"{g} -> {QuantFormat(2, g).bits_per_element:g}" for g in SUPPORTED_GROUPS)
        raise OscarOptionError(f"{GROUP_FLAG} {group} is not supported by the OSCAR kernels; use one of "
                               f"{SUPPORTED_GROUPS} (bits/element: {bits}, plus 0.5 on average for a calibrated "
                               "bundle's INT4-key heads)")
    misfit = None if head_dim is None else group_misfit(head_dim, group, GROUP_FLAG, supported=True)
    if misfit is not None:
        raise OscarOptionError(misfit)


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
    msg = clip_ratio_misfit(v, f"{name}={v}")
    if msg is not None:
        raise OscarOptionError(f"{msg}; the seed's 0 is also read as no clipping")
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


def env_group(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """SGLANG_OSCAR_KV_QUANT_GROUP_SIZE (where the launcher puts the group flag for the schedulers), checked; None
    when unset."""
    v = (os.environ if env is None else env).get(ENV_GROUP)
    if v is None or str(v).strip() == "":
        return None
    group = _int(v, ENV_GROUP, minimum=1)
    check_group(group)
    return group


def from_env(env: Optional[Mapping[str, str]] = None) -> OscarServeConfig:
    """Parse the options (the flag's group arrives in SGLANG_OSCAR_KV_QUANT_GROUP_SIZE)."""
    env = os.environ if env is None else env

    def get(name):
        v = env.get(name)
        return None if v is None or str(v).strip() == "" else v

    group_size = env_group(env)

    if get(ENV_WINDOWS) is not None and not _bool(get(ENV_WINDOWS), ENV_WINDOWS):
        raise OscarOptionError(f"{ENV_WINDOWS}=0 asks for INT2 without BF16 windows, which --kv-cache-dtype int2 "
                               f"does not offer (the windows are part of the format); unset it, or set "
                               f"{ENV_PREFIX}=0 for no sink")
    sink = _int(get(ENV_PREFIX), ENV_PREFIX, 0) if get(ENV_PREFIX) is not None else SERVED_SINK
    recent = _int(get(ENV_RECENT), ENV_RECENT, 1) if get(ENV_RECENT) is not None else SERVED_RECENT

    window_dtype = _dtype(get(ENV_HP_DTYPE), ENV_HP_DTYPE) if get(ENV_HP_DTYPE) is not None else "bfloat16"
    scale_dtype = "float8_e4m3fn"
    given = get(ENV_SCALE_DTYPE)
    if given is not None and str(given).strip().lower() not in ("float8_e4m3fn", "float8", "fp8", "e4m3"):
        raise OscarOptionError(f"{ENV_SCALE_DTYPE}={given} is not supported: the OSCAR kernels store scale and min as "
                               "float8 e4m3 (2.25 bits/element at G=64; the seed's float32 would be 3.0); unset it or "
                               "set float8_e4m3fn")

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
    return OscarServeConfig(group_size, sink, recent, window_dtype, scale_dtype, bundle, kp, vp, k_clip, v_clip, absorb)


_AUTO_SOURCE: dict = {}  # {"value": what ensure_rotation_source last put in SGLANG_OSCAR_BUNDLE}


def ensure_rotation_source(model_path, group: Optional[int] = None) -> Optional[str]:
    """With no rotation source set (or only the one this function chose, for another model or group), choose the
    default in this process's environment, which the spawned schedulers inherit: the zoo's calibrated bundle for the
    model (zoo.find_for_model, in zoo.server_zoo()) with K and V groups of `group` (None: the bundle's own), else the
    data-free builtin:hadamard. Returns the startup line that says which and why, or None when the user set one or
    the choice is unchanged."""
    from .. import zoo

    current = os.environ.get(ENV_BUNDLE, "").strip()
    seed = any(str(os.environ.get(n, "")).strip() for n in (ENV_K_PATH, ENV_V_PATH))
    auto = bool(current) and current == _AUTO_SOURCE.get("value")
    if auto and seed:
        del os.environ[ENV_BUNDLE]  # the user set the seed pair since: our earlier choice gives way
        return None
    if (current or seed) and not auto:
        return None
    where = zoo.server_zoo()
    found = None
    if where is not None and str(model_path or "").strip():
        try:
            found = zoo.find_for_model(str(model_path), group, where)
        except zoo.ZooError as e:
            raise OscarOptionError(f"no rotation source set, and the zoo it would be read from failed: {e}; set "
                                   f"{ENV_BUNDLE}=<bundle.safetensors> or builtin:hadamard") from None
    if found is not None:
        entry, path = found
        value = str(path)
        line = (f"rotations: the zoo's calibrated bundle {entry['name']} for {entry['model_id']} ({where}); "
                f"{ENV_BUNDLE} overrides it")
    else:
        value = "builtin:hadamard"
        line = (f"rotations: data-free Hadamard (builtin:hadamard): no calibrated bundle for "
                f"{zoo.model_key(str(model_path or '')) or 'this model'}"
                f"{'' if group is None else f' at groups of {group}'} in "
                f"{where or f'a zoo (none found: set {zoo.ENV_ZOO})'}; for long contexts calibrate one "
                f"(python -m sglang_oscar.calibrate) and set {ENV_BUNDLE}")
    if current == value:
        return None
    os.environ[ENV_BUNDLE] = value
    _AUTO_SOURCE["value"] = value
    return line


_CURRENT: list = []  # [(the int2 variables' values, config)]: this process's parse


def current() -> OscarServeConfig:
    """This process's options, parsed from its environment once and reused by every hook, the pool and the backend.
    Parsed again only if one of the int2 variables changed (the launcher's hook sets the group's; tests set others)."""
    key = tuple(os.environ.get(name) for name in ALL_ENV)
    if not _CURRENT or _CURRENT[0][0] != key:
        _CURRENT[:] = [(key, from_env())]
    return _CURRENT[0][1]
