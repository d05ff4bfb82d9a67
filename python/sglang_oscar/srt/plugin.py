"""The SGLang plugin entry point: `register()` installs the int2 KV-cache hooks.

Declared in pyproject.toml as `[project.entry-points."sglang.srt.plugins"] sglang_oscar = ...`.
SGLang's load_plugins() runs it in the main process and in every scheduler process, then applies
the hooks. Two things SGLang does not do for us:

* It only LOGS a failed hook (a renamed/moved target would silently run stock code, e.g. a BF16
  pool where int2 was asked for). So register() applies the hooks itself and checks that each of
  our targets is patched, and first checks each target's signature against what the hooks expect.
* It also only logs exceptions raised by a plugin. A failed self-check therefore raises
  OscarPluginError, a SystemExit subclass: the one exception type load_plugins() does not swallow,
  so the process stops with our message instead of serving with half the hooks.

Stock runs are unaffected: every hook is a no-op unless --kv-cache-dtype int2.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil

from . import hooks

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.17"

_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
_EXPORTER = "sglang.srt.model_executor.model_runner_components.weight_exporter.WeightExporter."

# target -> (hook type name, hook, parameter names the target must have, in order)
HOOKS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args":
        ("AFTER", hooks.add_cli_args_after, ("parser",)),
    "sglang.srt.server_args.ServerArgs.__post_init__":
        ("BEFORE", hooks.post_init_before, ("self",)),
    "sglang.srt.server_args.ServerArgs.from_cli_args":
        ("AFTER", hooks.from_cli_args_after, ("cls", "args")),
    "sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype":
        ("AROUND", hooks.configure_kv_cache_dtype_around,
         ("server_args_kv_cache_dtype", "model", "model_dtype", "is_draft_worker", "is_dflash",
          "speculative_draft_attention_backend")),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size":
        ("AROUND", hooks.compute_cell_size_around, ("self", "kvc", "num_layers")),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes":
        ("AROUND", hooks.calculate_pool_sizes_around, ("self", "available_bytes", "page_size")),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs":
        ("AFTER", hooks.resolve_max_num_reqs_after, ("self", "token_capacity")),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool":
        ("AROUND", hooks.build_mha_kv_pool_around, ("self", "max_total_num_tokens", "mha_pool_class", "quant_method")),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools":
        ("AFTER", hooks.init_pools_after, ("self", "sizes", "req_to_token_pool", "token_to_kv_pool_allocator")),
    "sglang.srt.model_executor.model_runner.ModelRunner.load_model":
        ("AFTER", hooks.load_model_after, ("self",)),
    "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill":
        ("AROUND", hooks.new_batch_prefill_around, ("self", "running_batch")),
    "sglang.srt.managers.scheduler.Scheduler.get_num_allocatable_reqs":
        ("AROUND", hooks.num_allocatable_reqs_around, ("self", "running_bs")),
    _UPDATER + "update_weights_from_disk": ("AROUND", hooks.weight_update_around, ("self", "model_path", "load_format")),
    _UPDATER + "update_weights_from_distributed":
        ("AROUND", hooks.weight_update_around, ("self", "names", "dtypes", "shapes", "group_name")),
    _UPDATER + "update_weights_from_tensor": ("AROUND", hooks.weight_update_around, ("self", "named_tensors")),
    _UPDATER + "update_weights_from_ipc": ("AROUND", hooks.weight_update_around, ("self", "recv_req")),
    _EXPORTER + "send_weights_to_remote_instance":
        ("AROUND", hooks.weight_update_around, ("self", "master_address", "ports", "group_name")),
    _EXPORTER + "save_remote_model": ("AROUND", hooks.weight_save_around, ("self", "url")),
    _EXPORTER + "save_sharded_model": ("AROUND", hooks.weight_save_around, ("self", "path")),
}


class OscarPluginError(SystemExit):
    """The plugin cannot work with the installed SGLang. SystemExit so that load_plugins() cannot swallow it."""

    def __init__(self, message: str):
        super().__init__(f"sglang_oscar: {message}")


def _resolve(target: str):
    obj_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(obj_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if raw is None:
        raw = getattr(owner, attr)
    return getattr(raw, "__func__", raw)  # classmethod/staticmethod -> function


def check_signatures() -> list:
    """Problems (strings) with the hook targets' signatures; empty = all as expected."""
    problems = []
    for target, (_, _, params) in HOOKS.items():
        try:
            fn = inspect.unwrap(_resolve(target))
        except Exception as e:  # noqa: BLE001 - report every missing target at once
            problems.append(f"{target}: not found ({type(e).__name__}: {e})")
            continue
        have = tuple(inspect.signature(fn).parameters)
        if have[: len(params)] != params and tuple(p for p in have if p in params) != params:
            problems.append(f"{target}: parameters {have}, expected {params}")
    return problems


def missing_targets() -> list:
    """Our targets that HookRegistry has not patched (it logs failures instead of raising)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [t for t in HOOKS if t not in HookRegistry._patched]


def self_check() -> None:
    """Raise OscarPluginError if any hook target is missing, changed or unpatched."""
    problems = check_signatures()
    problems += [f"{t}: HookRegistry did not apply the hook (see the 'Failed to apply hooks' log above)"
                 for t in missing_targets()]
    if problems:
        raise OscarPluginError(
            "the int2 KV-cache hooks do not fit this SGLang (supported: sglang==" + SUPPORTED_SGLANG + "):\n  "
            + "\n  ".join(problems)
            + "\nInstall sglang==" + SUPPORTED_SGLANG + ", or exclude the plugin with SGLANG_PLUGINS=<other plugins>.")


def _sglang_version() -> str:
    try:
        return importlib.import_module("sglang.version").__version__
    except Exception:  # noqa: BLE001
        from importlib.metadata import version

        return version("sglang")


def _create_oscar_backend(runner):
    from .backend import OscarAttnBackend  # lazy: only scheduler processes that use it pay the import

    return OscarAttnBackend(runner)


def _register_backend() -> None:
    """--attention-backend oscar_int2 through SGLang's official registry (hook #10)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .server_checks import BACKEND

    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(_create_oscar_backend)
    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    ver = _sglang_version()
    if ver != SUPPORTED_SGLANG:
        logger.warning("sglang_oscar is written against sglang==%s, found %s; checking hook targets",
                       SUPPORTED_SGLANG, ver)
    problems = check_signatures()
    if problems:  # register nothing half-way: a stock server must not get some of our hooks
        raise OscarPluginError("hook targets changed in sglang " + ver + ":\n  " + "\n  ".join(problems))
    for target, (kind, fn, _) in HOOKS.items():
        if target not in HookRegistry._patched:
            HookRegistry.register(target, fn, HookType[kind])
    _register_backend()
    # Apply now (idempotent; load_plugins() applies again after all plugins) so we can verify.
    HookRegistry.apply_hooks()
    self_check()
    logger.info("sglang_oscar: %d hooks applied (--kv-cache-dtype int2 available)", len(HOOKS))
