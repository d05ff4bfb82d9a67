"""Memory accounting of the int2 pool, per tensor-parallel rank, in the terms SGLang sizes pools in.

SGLang 0.5.17 turns a byte budget into a token count as
`max_total_num_tokens = available_bytes // cell_size` (pool_configurator.py:
DefaultPoolConfigurator.calculate_pool_sizes), then decides max_running_requests from that count.
Our pool has a per-token part and a fixed part:

    per token (cell):  INT2 codes + float8 (scale, min) of K and V, every    2 + 16/G bits/element
                       layer, + the high key planes of INT4-key heads       + 2 on those heads' keys
                       + one int32 sink_table entry (one table shared by all layers)
    fixed:             BF16 ring   (R + 1) x W rows   (+1: req_to_token row 0 is the padding request
                                                       of CUDA-graph batches; its ring rows are scratch)
                       BF16 sink rows  num_sink_rows  (slot-keyed, shared across radix hits)
                       ring_start int32 [R + 1]
    where one BF16 "row" = all layers x local KV heads x head_dim x (K, V).

The fixed part depends on R = max_running_requests, which SGLang only decides after the token
count, so the plugin fixes R before sizing and subtracts the fixed bytes from the budget; then
max_total_num_tokens is exactly what fits. R is --max-running-requests when given, else
auto_max_running_requests: the most requests whose windows take at most 1/WINDOW_SHARE of the
budget. Each request's windows cost as many bytes as ~2.5k INT2 tokens (Qwen3-8B, G=64), so a
tenth of the budget sizes R for requests of ~22k tokens on average: shorter requests are bounded
by R, longer ones by the token count, and the pool keeps 9/10 of its INT2-only tokens at any group
size (a fixed ratio-to-BF16 target could not: G=32's INT2-only ceiling is 6.40x BF16, below a 6.5x target).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import CacheLayout, QuantFormat
from .options import OscarOptionError

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
SINK_TABLE_BYTES = 4  # int32 per slot
DEFAULT_SINK_ROW_FACTOR = 2  # sink rows for R live requests + as many cached prefixes (see docs)
WINDOW_SHARE = 10  # without --max-running-requests the BF16 windows get at most 1/10 of the KV budget
MAX_AUTO_REQUESTS = 2048  # and R stays <= SGLang 0.5.17's smallest own default (resolve_max_num_reqs)
LINE_LENGTHS = (4096, 32768, 100000)  # request lengths the startup line counts (plus the context length)


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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_heads: int  # total, before tensor parallelism
    head_dim: int
    tp_size: int = 1

    @property
    def kv_heads_per_rank(self) -> int:
        """The KV heads of one rank (every rank holds as many: kv_head_range)."""
        start, end = kv_head_range(0, self.tp_size, self.kv_heads)
        return end - start


def layout_for(sink: int, recent: int, k_group: int, v_group: Optional[int] = None, k4_heads: int = 0) -> CacheLayout:
    """k4_heads: (layer, KV head) pairs with INT4 keys on one rank (the most of any rank: every rank sizes the same)."""
    return CacheLayout(sink, recent, QuantFormat(2, k_group), QuantFormat(2, v_group or k_group), k4_heads)


def int2_cell_bytes(shape: ModelShape, layout: CacheLayout) -> int:
    """Bytes per pool slot on one rank: what the _compute_cell_size hook returns."""
    return layout.quant_bytes_per_token(shape.num_layers, shape.kv_heads_per_rank, shape.head_dim) + SINK_TABLE_BYTES


def bf16_cell_bytes(shape: ModelShape) -> int:
    """SGLang's own cell for a BF16 cache (kv heads x (D + Dv) x layers x 2 B)."""
    return CacheLayout.bf16_bytes_per_token(shape.num_layers, shape.kv_heads_per_rank, shape.head_dim)


def window_row_bytes(shape: ModelShape, window_dtype: str = "bfloat16") -> int:
    """One position of one request in the windows: K and V rows of every layer."""
    return shape.num_layers * shape.kv_heads_per_rank * shape.head_dim * 2 * _ITEMSIZE[window_dtype]


def default_sink_rows(max_running_requests: int, sink: int, factor: int = DEFAULT_SINK_ROW_FACTOR) -> int:
    return factor * max_running_requests * sink


@dataclasses.dataclass(frozen=True)
class FixedBytes:
    ring: int
    sink_rows: int
    ring_start: int

    @property
    def total(self) -> int:
        return self.ring + self.sink_rows + self.ring_start


def fixed_bytes(shape: ModelShape, layout: CacheLayout, max_running_requests: int, *,
                num_sink_rows: Optional[int] = None, window_dtype: str = "bfloat16") -> FixedBytes:
    if max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1 (the ring is reserved per request)")
    reqs = max_running_requests + 1  # + the padding request (row 0 of req_to_token)
    rows = default_sink_rows(max_running_requests, layout.sink) if num_sink_rows is None else num_sink_rows
    row = window_row_bytes(shape, window_dtype)
    return FixedBytes(ring=reqs * layout.recent * row, sink_rows=rows * row, ring_start=reqs * 4)


def max_total_num_tokens(available_bytes: int, shape: ModelShape, layout: CacheLayout, max_running_requests: int,
                         *, page_size: int = 1, num_sink_rows: Optional[int] = None,
                         window_dtype: str = "bfloat16") -> int:
    """Pool slots that fit after the fixed window reservation, floored to page_size (as SGLang does)."""
    fixed = fixed_bytes(shape, layout, max_running_requests, num_sink_rows=num_sink_rows,
                        window_dtype=window_dtype).total
    if fixed >= available_bytes:
        raise ValueError(f"the BF16 windows of {max_running_requests} requests need {fixed / 2**30:.2f} GiB, more "
                         f"than the {available_bytes / 2**30:.2f} GiB KV budget; lower --max-running-requests or "
                         f"the window sizes, or raise --mem-fraction-static")
    tokens = (available_bytes - fixed) // int2_cell_bytes(shape, layout)
    return tokens // page_size * page_size


@dataclasses.dataclass(frozen=True)
class CapacityReport:
    available_bytes: int
    max_running_requests: int
    int2_tokens: int
    bf16_tokens: int
    int2_cell: int
    bf16_cell: int
    fixed: FixedBytes

    @property
    def ratio(self) -> float:
        """Tokens of the int2 pool / tokens of a BF16 pool at the same budget."""
        return self.int2_tokens / self.bf16_tokens if self.bf16_tokens else float("inf")

    def summary(self) -> str:
        g = 2**30
        return (f"KV budget {self.available_bytes / g:.2f} GiB/rank: int2 {self.int2_tokens:,} tokens "
                f"({self.int2_cell:,} B/token) vs bf16 {self.bf16_tokens:,} ({self.bf16_cell:,} B/token) = "
                f"{self.ratio:.2f}x; fixed {self.fixed.total / g:.2f} GiB for {self.max_running_requests} requests "
                f"(ring {self.fixed.ring / g:.2f}, sink rows {self.fixed.sink_rows / g:.2f})")


def capacity_report(available_bytes: int, shape: ModelShape, layout: CacheLayout, max_running_requests: int,
                    *, page_size: int = 1, num_sink_rows: Optional[int] = None,
                    window_dtype: str = "bfloat16") -> CapacityReport:
    tokens = max_total_num_tokens(available_bytes, shape, layout, max_running_requests, page_size=page_size,
                                  num_sink_rows=num_sink_rows, window_dtype=window_dtype)
    bf16 = available_bytes // bf16_cell_bytes(shape) // page_size * page_size
    return CapacityReport(available_bytes, max_running_requests, tokens, bf16, int2_cell_bytes(shape, layout),
                          bf16_cell_bytes(shape), fixed_bytes(shape, layout, max_running_requests,
                                                              num_sink_rows=num_sink_rows, window_dtype=window_dtype))


def auto_max_running_requests(available_bytes: int, shape: ModelShape, layout: CacheLayout, *,
                              window_dtype: str = "bfloat16") -> int:
    """R when --max-running-requests is not given: the most requests whose BF16 windows (ring, sink rows,
    ring_start: fixed_bytes) fit in 1/WINDOW_SHARE of the KV budget, at most MAX_AUTO_REQUESTS."""
    share = available_bytes // WINDOW_SHARE
    fits = lambda r: fixed_bytes(shape, layout, r, window_dtype=window_dtype).total <= share  # noqa: E731
    if not fits(1):
        one = fixed_bytes(shape, layout, 1, window_dtype=window_dtype).total
        raise ValueError(f"the {available_bytes / 2**30:.2f} GiB KV budget is too small for int2: one request's BF16 "
                         f"windows take {one / 2**30:.3f} GiB, more than the 1/{WINDOW_SHARE} of the budget they get "
                         "without --max-running-requests; raise --mem-fraction-static or give --max-running-requests")
    lo, hi = 1, MAX_AUTO_REQUESTS
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n / 1000:g}k" if n % 1000 == 0 else f"{n:,}"


def capacity_line(tokens: int, report: CapacityReport, max_running_requests: int, context_len: Optional[int],
                  *, from_budget: bool) -> str:
    """The startup line: the pool's tokens against BF16 in the same budget, R, and how many requests of a few
    lengths run at once (min(R, tokens // length))."""
    head = f"int2 KV: {tokens:,} tokens ({report.ratio:.1f}x BF16's {report.bf16_tokens:,} in the same budget)"
    if tokens < report.int2_tokens:
        head = (f"int2 KV: {tokens:,} tokens (capped by --max-total-tokens; the budget holds {report.int2_tokens:,}, "
                f"{report.ratio:.1f}x BF16's {report.bf16_tokens:,})")
    why = f"their windows sized to 1/{WINDOW_SHARE} of the budget" if from_budget else "--max-running-requests"
    lengths = sorted({n for n in LINE_LENGTHS if not context_len or n < context_len} | ({context_len} - {None, 0}))
    fits = [(min(max_running_requests, tokens // n), n) for n in lengths]
    fit_text = ", ".join(f"{k} {'requests ' if i == 0 else ''}of {_length(n)}"
                         + (" (context length)" if n == context_len else "") for i, (k, n) in enumerate(fits))
    return f"{head}; windows reserved for R={max_running_requests} requests ({why}); fits {fit_text}"
