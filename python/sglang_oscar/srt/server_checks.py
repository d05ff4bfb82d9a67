"""Which SGLang server options the int2 KV mode works with, checked on a ServerArgs object.

Called from the ServerArgs.from_cli_args hook (main process, before anything is spawned, so a bad
combination fails at the command line) and again in the scheduler before the pool is sized (the
Engine API builds ServerArgs without from_cli_args). Only plain attribute reads: no SGLang import.
select_backend, the one option int2 sets for the user, runs at the start of ServerArgs.__post_init__.
"""

from __future__ import annotations

from .options import OscarOptionError

INT2 = "int2"
BACKEND = "oscar_int2"
BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")

# (attribute, value that is fine, what to tell the user). Each of these paths moves or reads KV
# bytes with code that does not know our layout (codes + params + windows + sink table).
_UNSUPPORTED = (
    ("speculative_algorithm", None, "speculative decoding (draft KV and move_kv_cache are not implemented for int2)"),
    ("enable_hierarchical_cache", False, "--enable-hierarchical-cache (HiCache copies k/v buffers only)"),
    ("enable_hisparse", False, "--enable-hisparse"),
    ("disaggregation_mode", "null", "PD disaggregation (--disaggregation-mode)"),
    ("enable_unified_memory", False, "--enable-unified-memory"),
    ("enable_page_major_kv_layout", False, "--enable-page-major-kv-layout"),
    ("enable_lora", False, "LoRA (--enable-lora)"),
    ("enable_mixed_chunk", False, "--enable-mixed-chunk (one forward mixing extend and decode)"),
    ("enable_lmcache", False, "--enable-lmcache (LMCache offloads k_buffer/v_buffer rows only)"),
    ("enable_flexkv", False, "--enable-flexkv (FlexKV offloads k_buffer/v_buffer rows only)"),
)


def is_int2(server_args) -> bool:
    return getattr(server_args, "kv_cache_dtype", None) == INT2


def check_server_args(sa) -> None:
    """Raise OscarOptionError naming the first option that int2 cannot run with."""
    if not is_int2(sa):
        return
    for attr, ok, what in _UNSUPPORTED:
        value = getattr(sa, attr, ok)
        if value is not None and value != ok:
            raise OscarOptionError(f"--kv-cache-dtype int2 does not support {what}; drop that option")
    if (getattr(sa, "dcp_size", 1) or 1) > 1:
        raise OscarOptionError("--kv-cache-dtype int2 does not support decode context parallelism (--dcp-size > 1)")
    check_page_size(sa)
    if getattr(sa, "max_running_requests", None) is None and (getattr(sa, "pp_size", 1) or 1) > 1:
        raise OscarOptionError("--kv-cache-dtype int2 with --pp-size > 1 needs --max-running-requests: without it "
                               "each pipeline stage would size its request count from its own layers")
    backends = {getattr(sa, n, None) for n in BACKEND_FIELDS} - {None}
    if backends and backends != {BACKEND}:
        raise OscarOptionError(f"--kv-cache-dtype int2 is read only by --attention-backend {BACKEND} (got "
                               f"{', '.join(sorted(backends))}); leave the attention backend out and int2 selects it")


def select_backend(sa) -> "str | None":
    """int2 with no attention backend given: --attention-backend oscar_int2, the one backend that reads the int2
    pool (set before SGLang picks its own default). Returns a message to log when it set it."""
    if not is_int2(sa) or any(getattr(sa, n, None) is not None for n in BACKEND_FIELDS):
        return None
    sa.attention_backend = BACKEND
    return f"--attention-backend {BACKEND} selected for --kv-cache-dtype int2"


def check_page_size(sa) -> None:
    """--page-size P: the int2 pool stores codes and params in pages of P ([pages, Hkv, P, .], srt/pool.py),
    which the kernels support for P in kernels/layout.py SUPPORTED_PAGES. At P > 1 SGLang's kv canary would
    count k_buffer's leading dimension (pages) as slots and hash page rows as token rows: refused."""
    from ..kernels.layout import SUPPORTED_PAGES
    from ..kernels.shapes import CUDA_HISTORY_PAGE

    page = getattr(sa, "page_size", None) or 1
    if page not in SUPPORTED_PAGES:
        raise OscarOptionError(f"--kv-cache-dtype int2 supports --page-size {', '.join(map(str, SUPPORTED_PAGES))} "
                               f"(got {page}); leave it out and the server picks one ({CUDA_HISTORY_PAGE} for the CUDA "
                               "history stage)")
    canary = str(getattr(sa, "kv_canary", "none") or "none").strip().lower()
    if page > 1 and canary != "none":
        raise OscarOptionError(f"--kv-cache-dtype int2 with --page-size {page} does not support --kv-canary "
                               f"{canary} (it reads k_buffer as one row per slot; the int2 pool stores pages); "
                               "drop --kv-canary or use --page-size 1")


def adjust_cuda_graphs(sa) -> "str | None":
    """Fit SGLang's per-phase CUDA-graph config to what the oscar_int2 backend can capture.

    Decode: "full" graphs (or none); the backend's decode is capturable as one whole graph, not
    through breakable / torch.compile piecewise capture. Prefill: turned off, because the extend
    path is eager (per-request prefix gather + SDPA); 0.5.17 captures prefill graphs by default,
    so refusing would make every int2 launch fail. Returns a message to log when it changed
    something (SGLang turns graphs off the same way for its own incompatible features)."""
    cfg = getattr(sa, "cuda_graph_config", None)
    if not is_int2(sa) or cfg is None:
        return None
    decode, prefill = cfg["decode"], cfg["prefill"]
    if decode.backend not in ("full", "disabled"):
        raise OscarOptionError(f"--kv-cache-dtype int2 captures decode as a full CUDA graph; the decode graph backend "
                               f"{decode.backend!r} is not supported: use --cuda-graph-backend-decode full "
                               "(the default) or --disable-decode-cuda-graph")
    if prefill.backend != "disabled":
        old, prefill.backend = prefill.backend, "disabled"
        return (f"prefill CUDA graphs ({old}) turned off for --kv-cache-dtype int2: the oscar_int2 extend path runs "
                "eagerly; decode graphs are unaffected")
    return None
