"""oscar_int2 attention backend: eager extend, eager or CUDA-graph decode.

Reads the int2 pool exactly as the kernels define it:
* decode: kernels/decode.py:oscar_decode (INT2 history + BF16 sink + BF16 ring, one launch + merge), with
  the INT2 history in kernels/history_cuda.py where startup_checks.decode_path picks the CUDA stage (chosen
  and built at construction, logged in one line). Every per-step decision (splits, folds, the chain to
  the KV write, which write kernel) is made once per batch in the metadata step (DecodeStep, a
  kernels/decode.py DecodePlan per batch size) and read by every layer;
* extend: kernels/gather.py rebuilds each request's cached prefix in BF16 in the transformed basis
  (before the chunk is written, so the prefix's last W positions still come from the ring) into a
  ragged K/V buffer, followed by the chunk's own K/V transformed in torch (exact, not quantized: a
  chunk attends to itself at full precision, as the seed does); one causal attention call per
  layer over the whole batch (srt/extend_attention.py: FlashInfer's ragged prefill on CUDA, torch
  SDPA on CPU). Prefill CUDA graphs are turned off for int2 (server_checks.adjust_cuda_graphs).
Writes (INT2 + windows) go through srt/write_plan.py + OscarKVPool.write_layer. At decode the write's launch
also rotates the step's queries (up to write.MID_BATCH_TOKENS tokens) and, with the CUDA history stage on sm_90+
at small batch (AFTER_WRITE_MAX_BATCH), the history kernel starts as the write's programmatic dependent.

Basis: keys are stored as (k − μ)·T_K and queries become q·T_K (T_K orthogonal, so T_K^{−T} = T_K;
the μ term shifts every score of a query equally, which softmax ignores). V is stored as v·T_V:
with SGLANG_OSCAR_ABSORB_V_ROTATION=1 (default) the model's qkv_proj already emits v·T_V and its
o_proj takes the output in that basis (hook #9, srt/absorb_v.py); with =0 the write kernel
rotates V and _unrotate_v turns the output back with ·T_Vᵀ.

CUDA graphs (decode only; SGLang 0.5.17's 3-method contract, base_attn_backend.py). The host part
of a step (write plan: sink-row allocation, ring_start of new requests, ring rows) runs in
init_forward_metadata_out_graph, outside the graph, and lands in persistent buffers made by
init_cuda_graph_state; forward_decode reads only those buffers (plus the pool, req_to_token and
ring_start, all fixed addresses), so the captured kernels replay correctly for any batch.

Padding. SGLang pads a graph batch at its tail with req_pool_indices = 0 (ReqToTokenPool keeps row 0
as the padding row: free rows start at 1), out_cache_loc = 0 and seq_lens = the fill value
(decode_cuda_graph_runner.py + cuda_graph_buffer_registry.py build_decode_registry, ZERO /
FILL_SENTINEL policies); eager DP-attention padding (ForwardBatch._pad_inputs_to_size) does the same.
This backend therefore treats every request in row 0 as padding, whatever its other fields say:
no sink row, no ring row, no ring_start change, its token written to scratch slot 0 (INT2 only) and
its length forced to 0 in the buffer the decode kernel reads, so the kernel reads nothing for it
(all splits empty, output 0) and in particular never reads through sink_table[0] = -1.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from .extend_attention import ExtendAttention
from .options import OscarOptionError
from .pool import OscarKVPool
from .write_plan import in_sink, plan_writes, ring_row
from ..kernels.decode import DecodePlan, plan_decode
from ..kernels.shapes import CUDA_WRITE_MAX_TOKENS, has_pdl
from ..kernels.write import MID_BATCH_TOKENS

NAME = "oscar_int2"
# Decode, per layer (benchmark/bench_write_decode.py, NOTES "The decode after the KV write"): the step's queries are
# rotated (q . T_q) by the KV write's own launch (oscar_write_kv q_out) for batches of at most MID_BATCH_TOKENS (the
# write's decode tiles), one GEMM less; with the CUDA history stage on sm_90+, up to AFTER_WRITE_MAX_BATCH the history
# kernel is launched as the write's programmatic dependent (oscar_decode follows_write): its CTAs issue their first
# copies, then wait for the write before reading q. Above it, plain launches measured as fast or faster. Decode writes
# of up to CUDA_WRITE_MAX_TOKENS tokens run the CUDA write where decode_path chose it (0.80-0.85x the Triton write's
# time with q at batch 1-8 on H200).
AFTER_WRITE_MAX_BATCH = 8

logger = logging.getLogger(__name__)


def _per_q_head(t: Optional[torch.Tensor], kv_heads: int, q_heads: int) -> Optional[torch.Tensor]:
    """[D, D] or [Hkv, D, D] -> [Hq, D, D] (each query head uses its KV head's matrix)."""
    if t is None:
        return None
    if t.dim() == 2:
        return t.expand(q_heads, *t.shape)
    return t.repeat_interleave(q_heads // kv_heads, dim=0)


@dataclasses.dataclass
class DecodeMeta:
    """What forward_decode reads. Eager: this step's own tensors. Graphs: [:bs] views of
    GraphBuffers, so the addresses the captured kernels hold stay valid at every replay."""

    req_pool_indices: torch.Tensor  # int64 [bs]; padded requests: 0
    seq_lens: torch.Tensor  # int32 [bs]; padded requests: 0 (the decode kernel reads nothing for them)
    slots: torch.Tensor  # int64 [bs]: INT2 slot of each new token; padded: 0 (scratch)
    sink_dst: torch.Tensor  # int32 [bs]: sink row or -1
    ring_dst: torch.Tensor  # int32 [bs]: ring row or -1


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """The decisions of a decode step of one batch size, made once in the metadata step and read by every layer."""

    fuse_q: bool  # the KV write rotates the step's queries (oscar_write_kv q_out)
    chain: bool  # the CUDA history kernel launched as the write's programmatic dependent
    write_kernel: str  # "triton" or "cuda" (oscar_write_kv kernel)
    plan: DecodePlan  # the decode of a layer that writes this step's KV
    plain: DecodePlan  # the decode of a layer that does not (save_kv_cache False): no chain


@dataclasses.dataclass
class GraphBuffers:
    """Persistent decode inputs of the captured graphs (init_cuda_graph_state), filled outside the
    graph each step. Our own copies rather than the runner's buffers: we choose the padding values
    (length 0, slot 0, no window rows) and the dtypes the kernels want (int32 lengths, int64 slots)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    sink_dst: torch.Tensor
    ring_dst: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, device) -> "GraphBuffers":
        def full(value, dtype):
            return torch.full((max_bs,), value, dtype=dtype, device=device)

        return cls(full(0, torch.int64), full(0, torch.int32), full(0, torch.int64), full(-1, torch.int32),
                   full(-1, torch.int32))

    @property
    def max_bs(self) -> int:
        return self.req_pool_indices.shape[0]

    def view(self, bs: int) -> DecodeMeta:
        return DecodeMeta(self.req_pool_indices[:bs], self.seq_lens[:bs], self.slots[:bs], self.sink_dst[:bs],
                          self.ring_dst[:bs])


@dataclasses.dataclass
class ExtendMeta:
    """One extend step, built once per forward. Ragged K/V layout of the attention call: request i's
    rows are [kv_starts[i], kv_starts[i] + prefix[i]) its rebuilt prefix, then its ext[i] new tokens."""

    prefix: list  # cached tokens per request (host)
    ext: list  # new tokens per request (host)
    kv_starts: list  # first row of each request in the ragged K/V buffer (host)
    gather_args: list  # per request with a prefix: (index, req row [1], indptr [0, p], ring_start [1]) on device

    @classmethod
    def build(cls, rows, prefix, ext, ring_starts: torch.Tensor) -> "ExtendMeta":
        kv_starts, off = [], 0
        for p, e in zip(prefix, ext):
            kv_starts.append(off)
            off += p + e
        dev = ring_starts.device
        idx = [i for i, p in enumerate(prefix) if p]
        args = []
        if idx:  # one small H2D copy per forward; each layer's gathers then launch without host tensors
            rows_t = torch.tensor([rows[i] for i in idx], dtype=torch.int32, device=dev)
            ptr_t = torch.tensor([[0, prefix[i]] for i in idx], dtype=torch.int32, device=dev)
            starts_t = ring_starts.to(torch.int32)  # WritePlan gives int32 already: a no-op then
            args = [(i, rows_t[j:j + 1], ptr_t[j], starts_t[i:i + 1]) for j, i in enumerate(idx)]
        return cls(list(prefix), list(ext), kv_starts, args)

    @property
    def kv_lens(self) -> list:
        return [p + e for p, e in zip(self.prefix, self.ext)]


class OscarAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarKVPool):
            raise OscarOptionError(f"--attention-backend {NAME} reads only the int2 KV cache; use it with "
                                   f"--kv-cache-dtype int2 (pool is {type(pool).__name__})")
        # V must be rotated exactly once: by the weights (hook #9, SGLANG_OSCAR_ABSORB_V_ROTATION=1) or by
        # the write kernel + _unrotate_v (=0). Refuse a model whose weights disagree with the pool.
        from .absorb_v import check_v_basis

        check_v_basis(getattr(model_runner, "model", None), pool)
        self.pool = pool
        self.device = model_runner.device
        mc = getattr(model_runner, "model_config", None)
        if mc is None:
            raise OscarOptionError(f"--attention-backend {NAME} needs the model config to plan its decode; the model "
                                   "runner has none")
        self.q_heads = mc.get_num_attention_heads(pool.setup.shape.tp_size)
        self._choose_decode_path(model_runner)
        # decode with the CUDA history stage on sm_90+: the history kernel can be launched as the KV write's
        # programmatic dependent (oscar_decode follows_write), streaming the old INT2 rows while the write runs;
        # the decode step chains them up to AFTER_WRITE_MAX_BATCH
        self.history_after_write = self.history_kernel == "cuda" and has_pdl(self.device)
        model_dtype = getattr(model_runner, "dtype", None)
        for r in pool.rotations if model_dtype is not None else ():  # made here, not inside a graph capture
            r.q_transform_as(model_dtype)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.extend_attention = ExtendAttention("auto", self.device)
        self.plan = None  # extend: WritePlan of the step
        self.meta = None  # extend: ExtendMeta
        self.decode_meta: Optional[DecodeMeta] = None
        self.decode_step: Optional[DecodeStep] = None
        self._steps: dict = {}  # batch size -> DecodeStep
        self.graph: Optional[GraphBuffers] = None  # set by init_cuda_graph_state

    def _choose_decode_path(self, model_runner) -> None:
        """startup_checks.decode_path for this rank's attention (local query heads as SGLang splits them, local KV
        heads, the bundle's groups) on the pool's page size, its CUDA libraries built
        here, before any CUDA graph is captured or request served. One log line names the choice (the launcher logged
        the same one where it made it; a rank logs its own only where it differs, e.g. a failed build)."""
        from .hooks import DECODE_LINE_ATTR
        from .startup_checks import build_cuda_path, decode_path

        pool = self.pool
        path = decode_path(head_dim=pool.head_dim, q_heads=self.q_heads, kv_heads=pool.head_num,
                           k_group=pool.setup.plan.k_group, v_group=pool.setup.plan.v_group,
                           window_dtype=pool.window_dtype,
                           x_dtype=getattr(model_runner, "dtype", None) or torch.bfloat16, device=self.device,
                           page_size=pool.page_size)
        built = build_cuda_path(path, self.device)
        launcher = getattr(getattr(model_runner, "server_args", None), DECODE_LINE_ATTR, None)
        if built is not path:
            logger.warning("sglang_oscar: %s", built.line())
        elif built.line() != launcher:
            logger.info("sglang_oscar: %s", built.line())
        self.decode_path = built
        self.history_kernel = built.history
        self.decode_write_kernel = built.write

    # ---- metadata (host side, once per forward) -----------------------------------------------

    @staticmethod
    def _real_rows(forward_batch) -> list:
        """req_to_token rows of the real requests: the leading entries != 0 (row 0 is SGLang's padding
        row and never holds a request). Host copy of req_pool_indices: one sync, as the plan needs."""
        rows = forward_batch.req_pool_indices.tolist()
        n = next((i for i, r in enumerate(rows) if r == 0), len(rows))
        if any(rows[n:]):
            raise RuntimeError(f"{NAME}: padded requests (row 0) must come after the real ones, got rows {rows}")
        return rows[:n]

    def _plan_decode(self, forward_batch, rows: list):
        """Write plan of one decode token for each real request (the first len(rows) of the batch)."""
        n = len(rows)
        seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        seq = (seq_cpu[:n] if seq_cpu is not None else forward_batch.seq_lens[:n]).tolist()
        loc = forward_batch.out_cache_loc
        if loc is None or loc.numel() < n:
            raise RuntimeError(f"{NAME}: decode batch has {n} requests but out_cache_loc "
                               f"{None if loc is None else loc.numel()} slots")
        gens = self.req_to_token_pool.req_generation[rows].tolist()
        return plan_writes(self.pool, self.pool.ring_tracker, rows, [x - 1 for x in seq], [1] * n, loc[:n], gens)

    def init_forward_metadata(self, forward_batch):
        """Eager step (no graph): decode and extend; idle / empty batches are a no-op."""
        mode = forward_batch.forward_mode
        self.plan = self.meta = self.decode_meta = self.decode_step = None
        if mode.is_idle() or forward_batch.req_pool_indices.numel() == 0:
            return
        if mode == ForwardMode.DECODE:
            rows = self._real_rows(forward_batch)
            bs, n = forward_batch.req_pool_indices.numel(), len(rows)
            seq_lens = forward_batch.seq_lens.to(torch.int32)
            if n:
                p = self._plan_decode(forward_batch, rows)
                slots, sink_dst, ring_dst = p.slots, p.sink_dst, p.ring_dst
            else:
                slots = sink_dst = ring_dst = seq_lens[:0]
            if n < bs:  # DP-attention padding in eager mode: same treatment as graph padding
                dev = seq_lens.device
                seq_lens = seq_lens.clone()
                seq_lens[n:] = 0
                slots = torch.cat([slots.to(torch.int64), torch.zeros(bs - n, dtype=torch.int64, device=dev)])
                pad = torch.full((bs - n,), -1, dtype=torch.int32, device=dev)
                sink_dst, ring_dst = torch.cat([sink_dst.to(torch.int32), pad]), torch.cat([ring_dst.to(torch.int32), pad])
            self.decode_meta = DecodeMeta(forward_batch.req_pool_indices, seq_lens, slots, sink_dst, ring_dst)
            self.decode_step = self._decode_step(bs)
        elif mode == ForwardMode.EXTEND:
            rows = forward_batch.req_pool_indices.tolist()
            if 0 in rows:
                raise NotImplementedError(f"{NAME}: padded extend batches (DP attention) are not supported")
            prefix, ext = list(forward_batch.extend_prefix_lens_cpu), list(forward_batch.extend_seq_lens_cpu)
            gens = self.req_to_token_pool.req_generation[rows].tolist()
            self.plan = plan_writes(self.pool, self.pool.ring_tracker, rows, prefix, ext, forward_batch.out_cache_loc,
                                    gens)
            self.meta = ExtendMeta.build(rows, prefix, ext, self.plan.ring_starts)
            self.extend_attention.reset()
        else:  # MIXED, TARGET_VERIFY, DRAFT_EXTEND_V2, SPLIT_PREFILL, DLLM_EXTEND, PREBUILT
            raise NotImplementedError(f"{NAME}: forward mode {mode.name} is not supported (decode and extend only)")

    # ---- CUDA graphs (decode) --------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        # Decode graphs hold one token per request (spec decode is rejected at the command line).
        if max_num_tokens != max_bs:
            raise OscarOptionError(f"{NAME}: CUDA graphs support one token per request (graph batch {max_bs}, "
                                   f"{max_num_tokens} tokens): speculative decoding is not supported")
        self.graph = GraphBuffers.allocate(max_bs, self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host work of a graph step, outside the graph: write plan of the real requests into the
        persistent buffers; padded requests (row 0) get slot 0, no window rows and length 0.

        in_capture: the batch is the runner's dummy (rows 0, or stale indices on a recapture): every
        request is treated as padding, so capture never allocates sink rows, moves ring_start or
        writes a window row of a real request. forward_batch is a ForwardBatch at capture and the
        runner's replay view (build_replay_fb_view: padded req_pool_indices/seq_lens/seq_lens_cpu,
        RAW out_cache_loc of the real tokens) at replay."""
        g = self.graph
        if g is None:
            raise RuntimeError(f"{NAME}: init_forward_metadata_out_graph before init_cuda_graph_state")
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            raise NotImplementedError(f"{NAME}: CUDA graphs are for decode only, got {mode.name}")
        bs = forward_batch.batch_size
        if bs > g.max_bs:
            raise RuntimeError(f"{NAME}: graph batch {bs} > max_bs {g.max_bs} of init_cuda_graph_state")
        self.plan = self.meta = None
        n = 0 if in_capture or mode.is_idle() else self._past_sink_count(forward_batch)
        if n:
            self._plan_decode_on_device(forward_batch, n)
        else:
            rows = [] if in_capture or mode.is_idle() else self._real_rows(forward_batch)
            n = len(rows)
            if n:
                p = self._plan_decode(forward_batch, rows)
                g.slots[:n].copy_(p.slots)
                g.sink_dst[:n].copy_(p.sink_dst)
                g.ring_dst[:n].copy_(p.ring_dst)
        if n:
            g.req_pool_indices[:n].copy_(forward_batch.req_pool_indices[:n])
            g.seq_lens[:n].copy_(forward_batch.seq_lens[:n])
        # Padding tail, rewritten every step: a smaller batch must not leave the previous step's
        # destinations there, or the replay would write those rows again.
        g.slots[n:bs].zero_()
        g.sink_dst[n:bs].fill_(-1)
        g.ring_dst[n:bs].fill_(-1)
        g.req_pool_indices[n:bs].zero_()
        g.seq_lens[n:bs].zero_()
        self.decode_meta = g.view(bs)
        self.decode_step = self._decode_step(bs) if bs else None

    def _decode_step(self, bs: int) -> DecodeStep:
        """The DecodeStep of a batch of bs requests (shapes only: the same for every replay of its graph), made once
        per batch size."""
        step = self._steps.get(bs)
        if step is None:
            chain = self.history_after_write and bs <= AFTER_WRITE_MAX_BATCH
            fuse_q = bs <= MID_BATCH_TOKENS
            write_kernel = self.decode_write_kernel if bs <= CUDA_WRITE_MAX_TOKENS else "triton"
            plan = self._plan(bs, follows_write=chain, q_from_write=chain and fuse_q, write_kernel=write_kernel)
            plain = self._plan(bs) if chain else plan
            step = self._steps[bs] = DecodeStep(fuse_q, chain, write_kernel, plan, plain)
        return step

    def _plan(self, bs: int, **chain) -> DecodePlan:
        cfg = self.pool.setup.cfg
        return plan_decode(bs, self.q_heads, self.pool.head_num, self.pool.head_dim,
                           self.req_to_token_pool.req_to_token.shape[1], self.device, sink=cfg.sink,
                           window=cfg.recent, history_kernel=self.history_kernel, **chain)

    def _past_sink_count(self, forward_batch) -> int:
        """Replay steps whose new tokens all lie at positions >= S: the number of real requests, else 0.

        Then the write plan needs nothing from the host (no sink row to allocate, the ring row is
        r·W + p mod W, no request starts in a decode step: ring_start was set by its extend), so it is
        built from device tensors without the req_pool_indices sync of _real_rows, which made the host
        wait for the previous step. The replay view's out_cache_loc holds the real tokens only
        (build_replay_fb_view), its length is the real count; seq_lens_cpu is already on the host."""
        seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        loc = forward_batch.out_cache_loc
        if seq_cpu is None or loc is None:
            return 0
        n = loc.numel()
        if n == 0 or n > forward_batch.batch_size:
            return 0
        if in_sink(int(seq_cpu[:n].min()) - 1, self.pool.setup.cfg.sink):
            return 0
        return n

    def _plan_decode_on_device(self, forward_batch, n: int) -> None:
        """The graph buffers of n decode tokens at positions >= S, as plan_writes would give them."""
        g, w = self.graph, self.pool.setup.cfg.recent
        rows = forward_batch.req_pool_indices[:n].to(torch.int64)
        pos = forward_batch.seq_lens[:n].to(torch.int64) - 1
        g.slots[:n].copy_(forward_batch.out_cache_loc[:n])
        g.sink_dst[:n].fill_(-1)
        g.ring_dst[:n].copy_(ring_row(rows, pos, w))

    def init_forward_metadata_in_graph(self, forward_batch):
        # Nothing to record: out_graph already wrote every buffer the kernels read.
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        # Only the runner sees this (seq_lens_sum, its own buffers): this backend zeroes the length of
        # every padded request (row 0) in the buffer its decode kernel reads, whatever the fill.
        return 1

    # ---- per layer ----------------------------------------------------------------------------

    def _write(self, layer, k, v):
        h, d = self.pool.head_num, self.pool.head_dim
        p = self.plan
        self.pool.write_layer(layer.layer_id, k.reshape(-1, h, d), v.reshape(-1, h, d), p.slots, p.sink_dst,
                              p.ring_dst)

    def _unrotate_v(self, o: torch.Tensor, layer) -> torch.Tensor:
        """o [N, Hq, D] in the V basis -> model basis (·T_Vᵀ per head). With V absorbed
        (v_transform None) o_proj takes the V basis itself: nothing to do."""
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        if r.v_transform is None:
            return o
        tv = _per_q_head(r.v_transform, self.pool.head_num, o.shape[1])
        return torch.einsum("nhe,hde->nhd", o.float(), tv).to(o.dtype)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Launches kernels only, on decode_meta (graph: persistent buffers), decode_step and the pool; reads no
        per-step field of forward_batch, so a captured replay is correct for any batch."""
        from ..kernels.decode import oscar_decode

        m, step = self.decode_meta, self.decode_step
        h, hq, d = self.pool.head_num, layer.tp_q_head_num, layer.qk_head_dim
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        q = q.reshape(-1, hq, d)
        q_transform = r.q_transform_as(q.dtype)
        write = save_kv_cache and k is not None
        if write:
            q_kw = {}
            if step.fuse_q:
                q_kw = dict(q=q, q_transform=q_transform, q_out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
            self.pool.write_layer(layer.layer_id, k.reshape(-1, h, d), v.reshape(-1, h, d), m.slots, m.sink_dst,
                                  m.ring_dst, pdl_trigger=step.chain, kernel=step.write_kernel, **q_kw)
            if step.fuse_q:
                q, q_transform = q_kw["q_out"], None
        lc = self.pool.layer_cache(layer.layer_id)
        o = oscar_decode(q, lc, self.req_to_token_pool.req_to_token, m.req_pool_indices,
                         m.seq_lens, self.pool.ring_start, sink=lc.sink, window=lc.window, sm_scale=layer.scaling,
                         q_transform=q_transform, plan=step.plan if write else step.plain)
        return self._unrotate_v(o, layer).reshape(-1, hq * d)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        from ..kernels.decode import transform_query
        from ..kernels.gather import oscar_gather_prefixes

        hq, d, h = layer.tp_q_head_num, layer.qk_head_dim, self.pool.head_num
        r = self.pool.rotations[layer.layer_id - self.pool.start_layer]
        lc = self.pool.layer_cache(layer.layer_id)
        m = self.meta
        qt = transform_query(q.reshape(-1, hq, d), r.q_transform, h)
        kk = k.reshape(-1, h, d).float()
        if r.k_mean is not None:
            kk = kk - r.k_mean
        kt = torch.einsum("nhd,hde->nhe", kk, _per_q_head(r.k_transform, h, h)).to(q.dtype)
        vt = (v.reshape(-1, h, d).to(q.dtype) if r.v_transform is None  # absorbed: the model emits v·T_V
              else torch.einsum("nhd,hde->nhe", v.reshape(-1, h, d).float(), _per_q_head(r.v_transform, h, h)).to(q.dtype))
        if m.gather_args:
            # Ragged K/V = each request's prefix, then its chunk. Gather every prefix BEFORE this chunk
            # is written: the chunk's ring writes would overwrite the ring rows of the prefix's last W
            # positions (p mod W collides), which would then be read as INT2. Reading first keeps them
            # exact, the same rule as decode and eval/simulator.py.
            n = sum(m.kv_lens)
            keys = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
            vals = torch.empty_like(keys)
            for i, row_t, ptr_t, start_t in m.gather_args:
                a, p = m.kv_starts[i], m.prefix[i]
                oscar_gather_prefixes(lc, self.req_to_token_pool.req_to_token, row_t, ptr_t, start_t,
                                      keys[a:a + p], vals[a:a + p], validate=False)
            start = 0
            for a, p, e in zip(m.kv_starts, m.prefix, m.ext):
                keys[a + p:a + p + e] = kt[start:start + e]
                vals[a + p:a + p + e] = vt[start:start + e]
                start += e
        else:  # no cached prefix anywhere: the chunk is the whole ragged K/V
            keys, vals = kt, vt
        if save_kv_cache and k is not None:
            self._write(layer, k, v)
        att = self.extend_attention
        if att.needs_plan(hq, h, d, q.dtype, layer.scaling):
            att.plan(m.ext, m.kv_lens, hq, h, d, q.dtype, layer.scaling)
        out = att.run(qt, keys, vals)
        return self._unrotate_v(out, layer).reshape(-1, hq * d)
