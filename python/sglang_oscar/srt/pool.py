"""OscarKVPool: SGLang 0.5.17's MHATokenToKVPool with the OSCAR INT2 layout behind it.

Per local layer one `kernels/layout.py:LayerCache` (INT2 codes + float8 (scale, min) per slot, plus the high
key planes on the layers the bundle gives INT4 keys, BF16
sink rows, BF16 recent ring); one int32 sink table (slot -> sink row, -1 = none) shared by all
layers, because whether a position has a sink row is a property of the slot, not of the layer;
one ring_start int32 [R + 1] (row 0 = req_to_token's padding request). Memory matches
srt/capacity.py exactly: cell bytes per slot (size + page_size slots, like SGLang) + the fixed
window bytes.

Generic SGLang code only sees uint8 tensors: `k_buffer`/`v_buffer` are the packed codes (a slot's
params and window rows live elsewhere, so SGLang code that moves slot bytes would move part of a slot:
those paths raise, see the list at "paths that would move only part of a slot"), and get_key_buffer /
get_value_buffer (how attention backends read K/V) raise a clear error instead of handing out bytes as
activations. dtype = store_dtype = uint8 also keeps SGLang's bf16-only fused writers off (models/utils.py
enable_fused_set_kv_buffer).

Pages (SGLang's --page-size P, kernels/layout.py): every LayerCache is built with page = P, so the code and
param buffers are [slots/P, Hkv, P, .] (one KV head's rows of a page contiguous; the CUDA history stage
needs that to read at speed) and [slots, Hkv, .] at P = 1, the unchanged layout. SGLang allocates
size + P slots with size a multiple of P (pool_configurator.py floors the token count to whole pages),
so the pool is whole pages; anything else is refused. The windows, the sink table and ring_start are
not paged (keyed by sink row / request / slot). What in SGLang indexes the buffers by slot, and what
this pool does about each, is listed at "paths that would move only part of a slot": each such path
either works on the paged layout or raises naming the feature; none reads wrong bytes.

Sink rows are released when SGLang frees the slot that owns them: `attach` (called by the
_init_pools hook) wraps free / free_segment / clear of this pool's allocator instance. The release
is sync-free (a device-side free mask), so it adds no host sync to SGLang's free path.

set_kv_buffer (generic callers) writes the INT2 form only (sink_dst = ring_dst = -1: correct, without
windows); the oscar_int2 backend writes the windows too, with sink-row allocation (alloc_sink_rows,
from its host-side metadata step, srt/write_plan.py) and ring_start updates.

Sink rows can run out (a fixed pool of 2·R·S rows; cached prefixes keep theirs until evicted): a
position < S then stays INT2-only (read as INT2 by the kernels). That is counted in
`sink_rows_missing` and logged (first time, then each time the count doubles), never silent.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Optional

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from ..kernels.layout import SUPPORTED_PAGES, LayerCache
from ..kernels.shapes import CUDA_HISTORY_PAGE
from .int2_setup import Int2Setup
from .options import OscarOptionError

logger = logging.getLogger(__name__)

_WINDOW_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LayerRotation:
    """One layer's write-side parameters, on the pool's device (fp32, what oscar_write_kv takes)."""

    def __init__(self, bundle, layer: int, device, v_absorbed: bool):
        def squeeze(t):
            return t[0] if t is not None and t.shape[0] == 1 else t

        tk = squeeze(bundle.k_transform[layer])
        self.k_transform = tk.float().contiguous().to(device)
        # Scores need q·T_q with T_q = T_K^{-T}, so that (q·T_q)·(k·T_K)ᵀ = q·kᵀ. For an orthogonal T_K
        # that is T_K itself; a non-orthogonal one (method "balanced") needs the real inverse.
        tq = tk if bundle.orthogonal else torch.linalg.inv(tk.double()).transpose(-1, -2)
        self.q_transform = tq.float().contiguous().to(device)
        # Decode applies it as one GEMM in the query's dtype (a cast of this constant per call would be
        # another kernel in every replay): kept here once per dtype, see q_transform_as().
        self._q_cache = {torch.float32: self.q_transform}
        self.k_mean = None if bundle.k_mean is None else squeeze(bundle.k_mean[layer]).float().contiguous().to(device)
        # With V absorbed into qkv_proj/o_proj the model already emits V in the rotated basis.
        self.v_transform = None if v_absorbed else squeeze(bundle.v_transform[layer]).float().contiguous().to(device)
        self.k_clip = float(bundle.k_clip[layer])
        self.v_clip = float(bundle.v_clip[layer])

    def q_transform_as(self, dtype: torch.dtype) -> torch.Tensor:
        """T_q in `dtype` (bf16 rounding of T_q: ~2e-3 relative per entry, below bf16 q's own)."""
        if dtype not in self._q_cache:
            self._q_cache[dtype] = self.q_transform.to(dtype)
        return self._q_cache[dtype]


class OscarKVPool(MHATokenToKVPool):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str, enable_memory_saver: bool, *, setup: Int2Setup, v_head_dim: Optional[int] = None,
                 start_layer: Optional[int] = None, end_layer: Optional[int] = None, enable_alt_stream: bool = True,
                 enable_kv_cache_copy: bool = False, post_capture_active: bool = False):
        if dtype != torch.uint8:
            raise ValueError(f"OscarKVPool stores packed uint8 codes; got dtype {dtype} (the configure_kv_cache_dtype "
                             "hook maps int2 to torch.uint8)")
        if post_capture_active:
            raise ValueError("int2 KV cache does not support post-capture KV sizing")
        if enable_kv_cache_copy:
            raise ValueError("int2 KV cache does not support move_kv_cache (speculative decoding)")
        if v_head_dim not in (None, head_dim):
            raise ValueError(f"int2 KV cache needs v_head_dim == head_dim, got {v_head_dim} vs {head_dim}")
        if head_num != setup.plan.kv_heads_local or head_dim != setup.shape.head_dim or layer_num != setup.shape.num_layers:
            raise ValueError(f"pool shape (heads {head_num}, head_dim {head_dim}, layers {layer_num}) does not match "
                             f"the int2 plan (heads {setup.plan.kv_heads_local}, head_dim {setup.shape.head_dim}, "
                             f"layers {setup.shape.num_layers})")
        # _create_buffers runs inside super().__init__, so everything it reads is set first.
        self.setup = setup
        self.num_sink_rows = setup.num_sink_rows
        self.max_running_requests = setup.max_running_requests
        self.window_dtype = _WINDOW_DTYPES[setup.cfg.window_dtype]
        self._warned_no_windows = False
        self.sink_rows_missing = 0  # positions < S written INT2-only because no sink row was free
        self._sink_warn_at = 1
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                         v_head_dim=head_dim, start_layer=start_layer, end_layer=end_layer,
                         enable_alt_stream=enable_alt_stream, enable_kv_cache_copy=False,
                         post_capture_active=False)
        first = self.start_layer
        self.rotations = [LayerRotation(setup.plan.bundle, first + i, self.device, setup.cfg.absorb_v_rotation)
                          for i in range(self.layer_num)]

    # ---- buffers -------------------------------------------------------------------------------

    def _create_buffers(self):
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        s = self.setup
        page = self.page_size
        if page not in SUPPORTED_PAGES:
            raise OscarOptionError(f"--page-size {page} is not supported by the int2 KV pool (kernels/layout.py); "
                                   f"use one of {SUPPORTED_PAGES} ({CUDA_HISTORY_PAGE} for the CUDA history stage)")
        if self.size % page:
            # SGLang 0.5.17 floors the token count to whole pages (DefaultPoolConfigurator.calculate_pool_sizes
            # and calculate_pool_sizes_from_max_tokens) before it builds the pool, so this means another path
            # sized it: refuse instead of rounding, the allocator would hand out slots the pool lacks.
            raise RuntimeError(f"sglang_oscar: SGLang sized the int2 pool to {self.size} tokens, not a whole number "
                               f"of --page-size {page} pages; the int2 pool stores whole pages")
        slots = self.size + page  # slot 0's page absorbs padded writes, as in SGLang; whole pages
        ring_reqs = s.max_running_requests + 1  # + req_to_token row 0 (padding request of graph batches)
        pool_ctx = (torch.cuda.use_mem_pool(self.custom_mem_pool) if self.enable_custom_mem_pool else nullcontext())
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), pool_ctx:
            self.sink_table = torch.full((slots,), -1, dtype=torch.int32, device=self.device)
            # True = sink row free; the extra last entry absorbs releases of slots without a row
            # (index -1 -> num_sink_rows), which keeps the release free of data-dependent shapes.
            # Allocator metadata like SGLang's free_pages: not counted in the KV bytes.
            self.sink_row_free = torch.ones(s.num_sink_rows + 1, dtype=torch.bool, device=self.device)
            self.ring_start = torch.zeros(ring_reqs, dtype=torch.int32, device=self.device)
            self.layers = []
            for i in range(self.layer_num):
                lc = LayerCache.empty(slots, self.head_num, self.head_dim, k_group=s.plan.k_group,
                                      v_group=s.plan.v_group, num_sink_rows=s.num_sink_rows, max_reqs=ring_reqs,
                                      window=s.cfg.recent, sink=s.cfg.sink, window_dtype=self.window_dtype,
                                      device=self.device, with_sink_table=False, page=page,
                                      k4_heads=s.plan.bundle.k4_heads(self.start_layer + i))
                for t in lc.buffers().values():
                    t.zero_()  # deterministic scratch slot 0 / ring row 0, like SGLang's zeros
                lc.sink_table = self.sink_table  # one table for all layers
                lc.validate()
                self.layers.append(lc)
        if self.layers:
            k4 = sum(len(lc.k4_heads) for lc in self.layers)
            logger.info("sglang_oscar: int2 pool: %d slots in pages of %d per layer (codes %s, params %s); INT4 keys "
                        "on %d of %d (layer, KV head) pairs", slots, page, tuple(self.layers[0].k_codes.shape),
                        tuple(self.layers[0].k_params.shape), k4, self.layer_num * self.head_num)
        # k_buffer / v_buffer: the packed codes, [slots, Hkv, D/4] at page 1 and [pages, Hkv, P, D/4] else.
        # SGLang's generic code sees them (descs, memory accounting, the paths listed further down).
        self.k_buffer = [lc.k_codes for lc in self.layers]
        self.v_buffer = [lc.v_codes for lc in self.layers]
        self.k_scale_buffer = self.v_scale_buffer = self.dq_k_buffer = self.dq_v_buffer = None
        self._kv_buffer_descs = self._build_kv_buffer_descs()  # page rows at P > 1 (tokens_per_row = P)
        self._init_data_ptrs_and_strides()

    def _init_data_ptrs_and_strides(self):
        """SGLang's per-buffer pointer / byte-stride tables: a slot of buffer i at data_ptrs[i] +
        slot * data_strides[i]. Read only by slot moves: move_kv_cache (speculative decoding; refused below),
        the HiCache host pools (refused by server_checks) and the KV copy warmup (enable_kv_cache_copy,
        refused in __init__). At page 1 they are SGLang's own (codes and params of every layer). At P > 1 no
        per-slot stride exists (slot s of head h is row s % P of page s // P, kernels/records.py), so the
        tables are objects that raise naming the feature on any use instead of strides that would move
        whole pages as if they were slots."""
        if self.page_size == 1:
            return super()._init_data_ptrs_and_strides()
        refused = _RefusedSlotTable(self.page_size)
        self.k_data_ptrs = self.v_data_ptrs = self.data_ptrs = self.data_strides = refused

    def _slot_move_pointer_buffers(self):
        # A slot is its codes AND its (scale, min); the windows are keyed by sink row / request, not slot.
        if self.page_size != 1:
            raise _RefusedSlotTable(self.page_size).error("slot moves")
        return [*self.k_buffer, *self.v_buffer, *(lc.k_params for lc in self.layers),
                *(lc.v_params for lc in self.layers), *(lc.k_hi for lc in self.layers if lc.k_hi is not None)]

    def layer_cache(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id - self.start_layer]

    # Attention backends read K/V through these. Returning the packed codes would let a stock
    # backend compute on bytes (or die on an unrelated shape error), so refuse with the reason.
    def _refuse_read(self, *args, **kwargs):
        raise RuntimeError("the int2 KV cache holds packed INT2 codes + BF16 windows; only the oscar_int2 "
                           "attention backend can read it (a stock backend asked for K/V buffers)")

    get_key_buffer = get_value_buffer = get_kv_buffer = _refuse_read

    def get_kv_size_bytes(self):
        """(K bytes, V bytes) of everything allocated; the shared sink table and ring_start count on K."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        k = nbytes([t for lc in self.layers for t in (lc.k_codes, lc.k_hi, lc.k_params, lc.sink_k, lc.ring_k)
                    if t is not None])
        v = nbytes([t for lc in self.layers for t in (lc.v_codes, lc.v_params, lc.sink_v, lc.ring_v)])
        return k + nbytes([self.sink_table, self.ring_start]), v

    # ---- sink rows -----------------------------------------------------------------------------

    def attach(self, req_to_token_pool, allocator) -> None:
        """Bind to SGLang's request table and allocator (the _init_pools hook calls this once)."""
        rows = getattr(req_to_token_pool, "req_to_token", None)
        if rows is not None and rows.shape[0] > self.ring_start.shape[0]:
            raise RuntimeError(f"req_to_token has {rows.shape[0]} rows but the int2 ring was reserved for "
                               f"{self.ring_start.shape[0]} (max running requests + 1); the R cap did not apply")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        from .write_plan import RingStartTracker

        self.ring_tracker = RingStartTracker(self.ring_start.shape[0])
        # ReqToTokenPool.clear() zeroes req_generation, so generations can repeat: forget ours too.
        rclear = getattr(req_to_token_pool, "clear", None)
        if rclear is not None:
            def rclear_wrapped(*a, **k):
                self.ring_tracker = RingStartTracker(self.ring_start.shape[0])
                return rclear(*a, **k)

            req_to_token_pool.clear = rclear_wrapped
        # Wrap the instance's bound methods (not the class): only the allocator of this pool changes.
        free, free_segment, clear = allocator.free, allocator.free_segment, allocator.clear

        def free_wrapped(free_index, *a, **k):
            self.release_sink_rows(free_index)
            return free(free_index, *a, **k)

        def free_segment_wrapped(free_index, *a, **k):
            self.release_sink_rows(free_index)
            return free_segment(free_index, *a, **k)

        def clear_wrapped(*a, **k):
            self.reset_sink_rows()
            return clear(*a, **k)

        allocator.free, allocator.free_segment, allocator.clear = free_wrapped, free_segment_wrapped, clear_wrapped

    def _page_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every slot of the pages `slots` touch: a paged allocator frees whole pages even when given
        only some of their slots (free_segments trims shared boundary pages)."""
        if self.page_size == 1:
            return slots
        first = (slots.to(torch.int64) // self.page_size) * self.page_size
        return (first[:, None] + torch.arange(self.page_size, device=slots.device)).reshape(-1)

    def release_sink_rows(self, slots: torch.Tensor) -> None:
        """Give back the sink rows of freed slots (idempotent; no host sync)."""
        if slots.numel() == 0:
            return
        slots = self._page_slots(slots.to(self.sink_table.device))
        rows = self.sink_table[slots].to(torch.int64)
        self.sink_row_free[torch.where(rows >= 0, rows, self.num_sink_rows)] = True
        self.sink_table[slots] = -1

    def reset_sink_rows(self) -> None:
        self.sink_table.fill_(-1)
        self.sink_row_free.fill_(True)

    def alloc_sink_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Give each slot a free sink row (host-side metadata step; syncs). Slots beyond the free rows
        get -1 and stay INT2-only. Returns the rows (int32, -1 = none)."""
        free_rows = torch.nonzero(self.sink_row_free[:-1]).flatten()[: slots.numel()]
        rows = torch.full((slots.numel(),), -1, dtype=torch.int32, device=self.sink_table.device)
        rows[: free_rows.numel()] = free_rows.to(torch.int32)
        self.sink_row_free[free_rows] = False
        self.sink_table[slots.to(self.sink_table.device)] = rows
        short = slots.numel() - free_rows.numel()
        if short > 0:
            self.sink_rows_missing += short
            if self.sink_rows_missing >= self._sink_warn_at:
                logger.warning(
                    "int2 KV: no free BF16 sink rows for %d position(s) < S (%d so far): they are stored and "
                    "read as INT2 only (slightly less accurate). The %d sink rows are held by running requests "
                    "and radix-cached prefixes; more --max-running-requests reserves more, /flush_cache frees "
                    "cached ones.", short, self.sink_rows_missing, self.num_sink_rows)
                self._sink_warn_at = 2 * self.sink_rows_missing
        return rows

    # ---- writes --------------------------------------------------------------------------------

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None,
                      v_scale=None, layer_id_override: Optional[int] = None, dcp_kv_mask=None):
        """INT2 write of T tokens (no window rows: callers other than our backend do not know them)."""
        if dcp_kv_mask is not None:
            raise RuntimeError("int2 KV cache does not support decode context parallelism (dcp_kv_mask)")
        if k_scale is not None or v_scale is not None:
            raise RuntimeError("int2 KV cache takes unscaled K/V (k_scale/v_scale are for FP8 caches)")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        if not self._warned_no_windows:
            logger.warning("int2 set_kv_buffer from a generic caller: INT2 only, no BF16 sink/ring rows "
                           "(the oscar_int2 backend writes them)")
            self._warned_no_windows = True
        n = loc.shape[0]
        k = cache_k.view(n, self.head_num, self.head_dim)
        v = cache_v.view(n, self.head_num, self.head_dim)
        none = torch.full((n,), -1, dtype=torch.int32, device=loc.device)
        self.write_layer(layer_id, k, v, loc.to(torch.int64), none, none)

    def write_layer(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    sink_dst: torch.Tensor, ring_dst: torch.Tensor, validate: bool = False,
                    pdl_trigger: bool = False, kernel: str = "triton", **q_rotation) -> None:
        """One layer's write with precomputed destinations (see kernels/write.py; pdl_trigger: the decode's history
        kernel follows as its programmatic dependent; kernel: "triton" or "cuda" (kernels/write_cuda.py);
        q_rotation: q / q_transform / q_out, the step's queries rotated in the same launch)."""
        from ..kernels.write import oscar_write_kv

        r = self.rotations[layer_id - self.start_layer]
        oscar_write_kv(k, v, slots, sink_dst, ring_dst, self.layer_cache(layer_id), k_transform=r.k_transform,
                       k_mean=r.k_mean, v_transform=r.v_transform, k_clip=r.k_clip, v_clip=r.v_clip,
                       validate=validate, pdl_trigger=pdl_trigger, kernel=kernel, **q_rotation)

    # ---- paths that would move only part of a slot -------------------------------------------
    #
    # What in SGLang 0.5.17 reads or writes this pool's buffers by slot, outside the oscar_int2 backend
    # (audited for the paged pool; the INT2 layout is codes + params + windows + sink table, so every one
    # of these would miss part of a slot even at page 1, and at P > 1 would also take [pages, Hkv, P, .]
    # rows for slots):
    #   get_key_buffer / get_value_buffer / get_kv_buffer (stock attention backends)   raise (above)
    #   set_kv_buffer (generic writers)                       works: the write kernel, any page size
    #   set_kv_buffer_prefix_valid (DFlash / dspark writers)  raises (its CUDA path stores raw rows)
    #   move_kv_cache + data_ptrs / data_strides (speculative decoding)    raise; also refused at startup
    #   get_cpu_copy / load_cpu_copy (PD decode retraction)   raise; PD refused at startup
    #   get_contiguous_buf_infos (PD transfer, kv canary)     raises; PD refused at startup
    #   HiCache host pools (k_data_ptrs, data_ptrs), LMCache / FlexKV connectors (k_buffer rows),
    #   --kv-canary (k_buffer[0].shape[0] as the slot count)  refused by server_checks.check_server_args
    #                                                          (kv canary only at --page-size > 1)
    #   allocator frees (page granularity)                    works: attach() releases whole pages' sink rows

    def move_kv_cache(self, *args, **kwargs):
        raise NotImplementedError("int2 KV cache: move_kv_cache (speculative decoding) is not supported")

    def set_kv_buffer_prefix_valid(self, *args, **kwargs):
        raise NotImplementedError("int2 KV cache: set_kv_buffer_prefix_valid (DFlash speculative decoding / dspark "
                                  "KV commits) is not supported: its CUDA path stores raw K/V rows by slot")

    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("int2 KV cache: CPU offload of KV (PD decode retraction) is not supported")

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("int2 KV cache: CPU offload of KV (PD decode retraction) is not supported")

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("int2 KV cache: PD disaggregation transfer is not supported")


class _RefusedSlotTable:
    """Stands in for SGLang's slot pointer / stride tables (data_ptrs, data_strides, k_data_ptrs, v_data_ptrs)
    of a paged int2 pool: any use (an attribute such as data_ptr / numel, indexing, iteration, len) raises
    naming the reason, where a tensor of page strides would make a slot move copy the wrong bytes."""

    def __init__(self, page: int):
        self._page = page

    def error(self, what: str = "a slot move (KV copy / offload)") -> RuntimeError:
        return RuntimeError(f"int2 KV cache with --page-size {self._page}: {what} asked for per-slot pointer / "
                            f"stride tables, which the paged int2 layout ([pages, Hkv, {self._page}, .]) does not "
                            "have; that feature is not supported with --kv-cache-dtype int2")

    def __getattr__(self, name):
        if name.startswith("__") or name == "_page":
            raise AttributeError(name)
        raise self.error()

    def __getitem__(self, item):
        raise self.error()

    def __iter__(self):
        raise self.error()

    def __len__(self):
        raise self.error()

    def __repr__(self):
        return f"<int2 pool, page {self._page}: no per-slot tables>"
