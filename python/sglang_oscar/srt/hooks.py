"""The HookRegistry hooks of the int2 KV mode (docs/sglang_integration.md section 2).

Every hook is a no-op unless the kv cache dtype is "int2", so installing the plugin never changes
a stock run. Signatures follow HookRegistry: AFTER fn(result, *args), AROUND fn(original, *args);
staticmethod targets get no self, classmethod targets get cls.
"""

from __future__ import annotations

import logging
import os

from ..config import SERVED_GROUP, SUPPORTED_GROUPS
from ..kernels.shapes import CUDA_HISTORY_PAGE
from ..rotation.bundle import BundleError
from . import options
from .server_checks import INT2, adjust_cuda_graphs, check_page_size, check_server_args, is_int2, select_backend

logger = logging.getLogger(__name__)

KV_DTYPE_FLAG = "--kv-cache-dtype"


# 1. ServerArgs.add_cli_args (staticmethod), AFTER: accept int2 and our flag ----------------------

def add_cli_args_after(result, parser):
    # 0.5.17 builds a fresh Arg(choices=[...]) per get_type_hints call, so the only choices list
    # that sticks is the one on the argparse action itself.
    action = parser._option_string_actions.get(KV_DTYPE_FLAG)
    if action is None:
        raise RuntimeError(f"sglang_oscar: SGLang's parser has no {KV_DTYPE_FLAG}; this SGLang version is not "
                           "supported (pin sglang==0.5.17)")
    if action.choices is not None and INT2 not in action.choices:
        action.choices = list(action.choices) + [INT2]
    if action.help and "int2" not in action.help:
        action.help += ' "int2": OSCAR INT2 history + BF16 sink/recent windows (sglang_oscar plugin).'
    if options.GROUP_FLAG not in parser._option_string_actions:
        parser.add_argument(options.GROUP_FLAG, type=int, default=None, dest="kv_cache_quant_group_size",
                            help=f"int2 KV cache: elements per (scale, min) group, "
                                 f"{'/'.join(map(str, SUPPORTED_GROUPS))} (default: the rotation bundle's groups, "
                                 f"else {SERVED_GROUP}). sglang_oscar plugin.")
    return None


# 2a. ServerArgs.__post_init__, BEFORE: int2 without an attention backend gets oscar_int2 ---------------
#     (before SGLang resolves its own default; the CLI and the Engine API both construct ServerArgs)

def post_init_before(self):
    msg = select_backend(self)
    if msg:
        logger.info("sglang_oscar: %s", msg)
    return None


def ensure_rotations(sa) -> None:
    """The default rotation source (options.ensure_rotation_source) for the model ServerArgs names, at the group
    the flag put in the environment, logged in one line when it was chosen here. The launcher's from_cli_args hook
    runs it once for the CLI (the schedulers inherit the result); the scheduler-side hooks run it too, for the Engine
    API, which never runs from_cli_args (a no-op where the launcher already chose)."""
    line = options.ensure_rotation_source(getattr(sa, "model_path", None), options.env_group())
    if line:
        logger.info("sglang_oscar: %s", line)


# 2b. ServerArgs.from_cli_args (classmethod), AFTER: carry our flag, check everything before anything is loaded, ---
#    and choose the decode kernels and the page size

DECODE_LINE_ATTR = "_oscar_decode_line"  # on ServerArgs: the launcher's decode choice, pickled to the schedulers


def from_cli_args_after(server_args, cls, args):
    """In the launcher's process, before any scheduler is spawned or any weight loaded: check the options, the
    rotation bundle against the model for every rank, and pick the decode path (startup_checks.decode_path), setting
    the page size it needs unless the user gave one. A refusal exits with status 1 and one line (OscarStartupError)."""
    group = getattr(args, "kv_cache_quant_group_size", None)
    try:
        if group is not None and not is_int2(server_args):
            raise options.OscarOptionError(f"{options.GROUP_FLAG} only applies to --kv-cache-dtype int2")
        if not is_int2(server_args):
            return None
        if group is not None:
            options.check_group(group)
            # ServerArgs cannot carry new fields; the env reaches every spawned scheduler process.
            os.environ[options.ENV_GROUP] = str(group)
        ensure_rotations(server_args)
        cfg = options.current()  # bad env / a bundle that is not there fails here, in the main process
        check_server_args(server_args)
        msg = adjust_cuda_graphs(server_args)
        if msg:
            logger.info("sglang_oscar: %s", msg)
        if cfg.absorb_v_rotation:
            from .absorb_v import check_server_args_for_absorption

            check_server_args_for_absorption(server_args)
        logger.info("sglang_oscar: %s", cfg.summary())
        if str(getattr(server_args, "model_path", "")).lower() in ("none", "dummy"):
            return None  # no model config to check against (SGLang's own short-circuit)
        _choose_decode_path(server_args, args, cfg)
    except (options.OscarOptionError, BundleError) as e:
        raise options.OscarStartupError(str(e)) from None
    return None


def _choose_decode_path(server_args, args, cfg) -> None:
    import torch

    from .int2_setup import check_before_load
    from .startup_checks import decode_path

    info, plan = check_before_load(server_args, cfg)
    user_page = getattr(args, "page_size", None)
    refusal = None
    canary = str(getattr(server_args, "kv_canary", "none") or "none").strip().lower()
    chunk = getattr(server_args, "chunked_prefill_size", None) or 0
    if canary != "none":
        refusal = f"--kv-canary {canary} reads one row per slot"
    elif chunk > 0 and chunk % CUDA_HISTORY_PAGE:
        refusal = f"--chunked-prefill-size {chunk} is not a multiple of {CUDA_HISTORY_PAGE}"
    device = str(getattr(server_args, "device", "cuda") or "cuda")
    if device == "cuda" and torch.cuda.is_available():
        gpu, count = int(getattr(server_args, "base_gpu_id", 0) or 0), torch.cuda.device_count()
        if gpu >= count:  # SGLang indexes the visible devices with it too (CUDA_VISIBLE_DEVICES renumbers from 0)
            raise options.OscarOptionError(f"--base-gpu-id {gpu} names no GPU: {count} are visible here; pass one "
                                           f"below {count}")
        device = f"cuda:{gpu}"
    mc = getattr(server_args, "model_config", None)
    window_dtype = getattr(torch, cfg.window_dtype)
    path = decode_path(head_dim=info.head_dim, q_heads=info.num_heads // info.tp_size, kv_heads=plan.kv_heads_local,
                       k_group=plan.k_group, v_group=plan.v_group, window_dtype=window_dtype,
                       x_dtype=getattr(mc, "dtype", torch.bfloat16), device=device, page_size=user_page,
                       page_refusal=refusal)
    if path.page_size != server_args.page_size:
        server_args.override("sglang_oscar", page_size=path.page_size)
        check_page_size(server_args)
    object.__setattr__(server_args, DECODE_LINE_ATTR, path.line())
    logger.info("sglang_oscar: %s", path.line())


# 3. configure_kv_cache_dtype, AROUND: "int2" -> ("int2", torch.uint8) ------------------------------

def configure_kv_cache_dtype_around(original, *args, **kwargs):
    if kwargs.get("server_args_kv_cache_dtype") != INT2:
        return original(*args, **kwargs)
    import torch

    if kwargs.get("is_draft_worker"):
        raise options.OscarOptionError("--kv-cache-dtype int2 has no draft-model cache (speculative decoding)")
    return INT2, torch.uint8


# 4./5. pool sizing: cell = INT2 bytes; fixed window bytes come off the budget first ---------------

def compute_cell_size_around(original, self, kvc, num_layers):
    if getattr(kvc, "kv_cache_dtype_str", None) != INT2:
        return original(self, kvc, num_layers)
    from .int2_setup import setup_for_kvc

    if getattr(kvc, "use_mla_backend", False) or getattr(kvc, "is_hybrid_swa", False):
        raise options.OscarOptionError("--kv-cache-dtype int2 supports dense MHA/GQA models only (not MLA or "
                                       "hybrid sliding-window models)")
    s = setup_for_kvc(kvc, num_layers)
    # 0.5.17's configurator has no fixed-overhead field: remember it here for calculate_pool_sizes.
    self._oscar_setup = s
    return s.cell_bytes


def calculate_pool_sizes_around(original, self, available_bytes, page_size):
    s = getattr(self, "_oscar_setup", None)
    if s is None:
        return original(self, available_bytes, page_size)
    from .int2_setup import size_for_budget

    # R is known from here on: --max-running-requests, else sized from this budget (capacity.py)
    s = self._oscar_setup = size_for_budget(s, available_bytes, page_size)
    tokens = s.max_total_num_tokens(available_bytes, page_size)  # raises if the windows do not fit
    config = original(self, available_bytes - s.fixed.total, page_size)
    if config.max_total_num_tokens != tokens:
        raise RuntimeError(f"sglang_oscar: SGLang sized {config.max_total_num_tokens} tokens, capacity.py "
                           f"{tokens}; the pool sizing of this SGLang version changed")
    logger.info("sglang_oscar: %s", s.report(available_bytes, page_size).summary())
    return config


# 6. KVCacheConfigurator.resolve_max_num_reqs, AFTER: never more requests than windows reserved; the startup line -

def resolve_max_num_reqs_after(result, self, token_capacity):
    if getattr(self, "kv_cache_dtype_str", None) != INT2:
        return None
    from .int2_setup import setup_for_kvc

    s = setup_for_kvc(self)
    cap = s.sized_requests()
    final = min(result, cap)
    if result > cap and not s.requests_from_budget:
        logger.info("sglang_oscar: max running requests %d -> %d (BF16 rings reserved for %d)", result, cap, cap)
    if _rank(self) == 0:
        logger.info("sglang_oscar: %s", s.startup_line(token_capacity, final,
                                                       getattr(self.model_config, "context_len", None)))
    return final if final != result else None


def _rank(kvc) -> int:
    """This process's global rank (0 outside a distributed server)."""
    try:
        return int(getattr(kvc.ps, "world_rank", 0) or 0)
    except Exception:  # noqa: BLE001 - a server without distributed state is rank 0
        return 0


# 7. KVCacheConfigurator._build_mha_kv_pool, AROUND: our pool class --------------------------------

def build_mha_kv_pool_around(original, self, *, max_total_num_tokens, mha_pool_class, quant_method=None):
    if getattr(self, "kv_cache_dtype_str", None) != INT2:
        return original(self, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_mod
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from .pool import OscarKVPool

    if quant_method is not None:
        raise options.OscarOptionError("--kv-cache-dtype int2 cannot be combined with a KV quant method")
    if mha_pool_class is not MHATokenToKVPool:
        raise options.OscarOptionError(f"--kv-cache-dtype int2 replaces MHATokenToKVPool, not "
                                       f"{mha_pool_class.__name__} (drop --enable-page-major-kv-layout)")
    if getattr(self, "post_capture_kv_active", False):
        raise options.OscarOptionError("--kv-cache-dtype int2 does not support post-capture KV sizing")
    mc = self.model_config
    tp = self.ps.attn_tp_size
    return OscarKVPool(
        max_total_num_tokens,
        page_size=self.pool_page_size,
        dtype=self.kv_cache_dtype,
        head_num=mc.get_num_kv_heads(tp),
        head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim,
        layer_num=self.layer_info.num_effective_layers,
        device=self.device,
        # the same process-wide settings the stock branch reads (kv_cache_configurator.py:1422)
        enable_memory_saver=kvc_mod.get_exec().features.enable_memory_saver,
        start_layer=self.layer_info.start_layer,
        end_layer=self.layer_info.end_layer,
        enable_alt_stream=not kvc_mod.get_disagg().enable_pdmux,
        setup=_sized_setup(self),
    )


def _sized_setup(kvc):
    from .int2_setup import setup_for_kvc

    s = setup_for_kvc(kvc)
    s.sized_requests()  # the pool needs R: raises if the sizing hook has not run
    return s


# 8. KVCacheConfigurator._init_pools, AFTER: bind the pool to the request table and allocator ------

def init_pools_after(result, self, *args, **kwargs):
    from .pool import OscarKVPool

    pool = getattr(result, "token_to_kv_pool", None)
    if isinstance(pool, OscarKVPool):
        pool.attach(result.req_to_token_pool, result.token_to_kv_pool_allocator)
    elif getattr(self, "kv_cache_dtype_str", None) == INT2 and pool is not None:
        raise RuntimeError(f"sglang_oscar: --kv-cache-dtype int2 but SGLang built {type(pool).__name__}; "
                           "a pool path this plugin does not hook was taken")
    return None


# 9. ModelRunner.load_model, AFTER: fold T_V into qkv_proj / o_proj (V-rotation absorption) ----------

def load_model_after(result, self):
    """After the weights are loaded and before pools, backends and graphs exist (model_runner.py
    initialize()): rewrite this rank's qkv_proj v rows and o_proj columns so the model emits V as
    v·T_V and consumes the attention output in that basis. The pool then stores V as it comes
    (LayerRotation.v_transform = None) and the backend does not un-rotate (check_v_basis)."""
    sa = self.server_args
    if not is_int2(sa) or getattr(self, "is_draft_worker", False):
        return None  # draft workers: int2 refuses speculative decoding; never touch a draft model
    ensure_rotations(sa)  # the Engine API's first int2 hook in a scheduler
    cfg = options.current()
    if not cfg.absorb_v_rotation:
        return None
    from .absorb_v import absorb_model_, check_server_args_for_absorption
    from .int2_setup import model_info
    from .startup_checks import V_ABSORB_ARCHITECTURES, plan_rank

    check_server_args_for_absorption(sa)  # again here: the Engine API never runs from_cli_args

    def bundle_for_rank(tp_rank, tp_size):
        # plan_rank also checks the HF architecture, orthogonality and the bundle/model match.
        return plan_rank(cfg, model_info(self.model_config, tp_size), tp_rank).bundle

    absorb_model_(self.model, bundle_for_rank, V_ABSORB_ARCHITECTURES)
    return None


# 11. weight updates and exports, AROUND: refuse while the weights carry the absorbed V rotation -----

_ABSORBED_MSG = ("sglang_oscar: {op} refused: this server's qkv_proj/o_proj weights carry the absorbed V "
                 "rotation (--kv-cache-dtype int2 with {env}=1), so {why}. Restart with {env}=0 (runtime V "
                 "rotation) to use it.")
_UPDATE_WHY = "new weights would be loaded without it (the pool would then store V un-rotated, or half-rotated)"
_EXPORT_WHY = "the exported checkpoint would not be the model (v rows and o_proj columns rotated)"


def _v_absorbed(self) -> bool:
    from .absorb_v import ABSORB_ATTR

    get_model = getattr(self, "get_model", None)
    model = get_model() if callable(get_model) else None
    return getattr(model, ABSORB_ATTR, None) is not None


def weight_update_around(original, self, *args, **kwargs):
    """WeightUpdater.update_weights_* and WeightExporter.send_weights_to_remote_instance return
    (success, message): answer with a failure instead of silently mixing bases."""
    if not _v_absorbed(self):
        return original(self, *args, **kwargs)
    why = _UPDATE_WHY if "update" in getattr(original, "__name__", "update") else _EXPORT_WHY
    msg = _ABSORBED_MSG.format(op=getattr(original, "__name__", "weight update"), env=options.ENV_ABSORB_V, why=why)
    logger.error(msg)
    return False, msg


def weight_save_around(original, self, *args, **kwargs):
    """WeightExporter.save_*: called through the scheduler's RPC, which reports an exception."""
    if _v_absorbed(self):
        raise RuntimeError(_ABSORBED_MSG.format(op=getattr(original, "__name__", "saving the model"),
                                                env=options.ENV_ABSORB_V, why=_EXPORT_WHY))
    return original(self, *args, **kwargs)


# 12. Scheduler.get_new_batch_prefill + get_num_allocatable_reqs, AROUND: count the chunked request once
#
# SGLang 0.5.17 (scheduler.py get_new_batch_prefill) stops adding waiting requests once
# len(can_run_list) >= min(max_running - running_bs, free request slots). The request in chunked
# prefill already holds a request slot (not free) AND is put into can_run_list first
# (PrefillAdder.add_chunked_req), so the check counts it twice: with R - 2 requests running, the next
# waiting request is refused and batch_is_full stays set until a running request finishes. On its
# last chunk scheduler.chunked_req is already None when the check runs, so the planning pass
# remembers the chunked request it started with. int2 servers run with a small R (one BF16 ring per
# request): this left one of 16 requests idle through a whole 100k job (docs/troubleshooting.md).

_CHUNKED_AT_PLAN = "_oscar_chunked_at_plan"


def new_batch_prefill_around(original, self, running_batch):
    if not is_int2(getattr(self, "server_args", None)):
        return original(self, running_batch)
    setattr(self, _CHUNKED_AT_PLAN, getattr(self, "chunked_req", None))
    try:
        return original(self, running_batch)
    finally:
        setattr(self, _CHUNKED_AT_PLAN, None)


def num_allocatable_reqs_around(original, self, running_bs):
    res = original(self, running_bs)
    held = getattr(self, _CHUNKED_AT_PLAN, None)
    if held is None or getattr(held, "req_pool_idx", None) is None:
        return res  # stock servers never set it; nor does int2 outside a planning pass
    from sglang.srt.runtime_context import get_parallel

    # its slot is taken but it is counted in can_run_list: give the slot back to the count once.
    # res = min(max_running - running_bs, free slots), so this is min(max_running - running_bs, free + 1)
    return min(res + 1, get_parallel().pp_max_micro_batch_size - running_bs)
