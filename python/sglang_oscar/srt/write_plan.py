"""Where one forward batch writes: INT2 slot, BF16 sink row, BF16 ring row of every new token.

Host-side step of the oscar_int2 backend, run once per forward outside any CUDA graph
(init_forward_metadata_out_graph); the per-layer write kernel then only reads the result. It follows
exactly the read rules of kernels/decode.py and kernels/gather.py:

    sink   position p < S              -> a sink row from the pool's free rows (none left: -1, the
                                          position stays INT2-only, which readers handle)
    ring   S <= p and p >= end - W     -> row r*W + p % W   (end = prefix + extend of the request;
                                          only the last W positions, so rows are unique per call)
    INT2   every new position, always  -> slot out_cache_loc[t]

and keeps ring_start: when a request row starts a new request (req_to_token_pool.req_generation
changed), ring_start[r] = its first computed position. Positions before it (a radix-cache hit)
were never in this request's ring, so readers take them from sink/INT2 instead.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def in_sink(pos, sink: int):
    """Position(s) `pos` (an int or a tensor) lie in the BF16 sink: p < S."""
    return pos < sink


def ring_row(rows: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """The ring row of position `pos` of request row `rows` (int64 tensors): r·W + p mod W. Pure tensor arithmetic, no
    host sync: the backend's replay steps build it from device tensors."""
    return rows * window + pos % window


@dataclasses.dataclass
class WritePlan:
    slots: torch.Tensor  # int64 [T]
    sink_dst: torch.Tensor  # int32 [T]
    ring_dst: torch.Tensor  # int32 [T]
    ring_starts: torch.Tensor  # int32 [B]: ring_start of each request of the batch after this step
    new_requests: list  # rows whose ring_start was (re)set in this step


class RingStartTracker:
    """Host copy of which request generation each req_to_token row last served."""

    def __init__(self, num_rows: int):
        self.generation = [-1] * num_rows
        self.ring_start = [0] * num_rows

    def update(self, rows: Sequence[int], prefix_lens: Sequence[int], generations: Optional[Sequence[int]]):
        """ring_start of each row after this step, and the rows that started a new request."""
        new = []
        for i, r in enumerate(rows):
            gen = None if generations is None else int(generations[i])
            if gen is not None and gen != self.generation[r]:
                self.generation[r] = gen
                self.ring_start[r] = int(prefix_lens[i])
                new.append(r)
        return [self.ring_start[r] for r in rows], new


def plan_writes(pool, tracker: RingStartTracker, rows: Sequence[int], prefix_lens: Sequence[int],
                extend_lens: Sequence[int], out_cache_loc: torch.Tensor,
                generations: Optional[Sequence[int]] = None) -> WritePlan:
    """Destinations of the new tokens of a batch (extend or decode: decode is extend_len 1).

    pool: OscarKVPool (sink/window sizes, sink-row allocation, device ring_start);
    rows / prefix_lens / extend_lens: host ints per request; out_cache_loc: [sum(extend_lens)] slots
    in batch order; generations: req_to_token_pool.req_generation[rows] (None = no new requests).
    """
    s, w = pool.setup.cfg.sink, pool.setup.cfg.recent
    n = int(sum(extend_lens))
    if out_cache_loc.numel() != n:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots for {n} new tokens")
    if len(rows) != len(prefix_lens) or len(rows) != len(extend_lens):
        raise ValueError("rows, prefix_lens and extend_lens must have one entry per request")
    dev = pool.sink_table.device
    ext = torch.tensor(list(extend_lens), dtype=torch.int64)
    pre = torch.tensor(list(prefix_lens), dtype=torch.int64)
    req = torch.tensor(list(rows), dtype=torch.int64)
    # position of every new token: prefix_i + (0 .. extend_i - 1)
    first = torch.repeat_interleave(pre, ext)
    offset = torch.arange(n, dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(ext, 0) - ext, ext)
    pos = first + offset
    end = torch.repeat_interleave(pre + ext, ext)
    r_tok = torch.repeat_interleave(req, ext)

    sink = in_sink(pos, s)
    ring_ok = ~sink & (pos >= end - w)
    ring_dst = torch.where(ring_ok, ring_row(r_tok, pos, w), torch.full_like(pos, -1)).to(torch.int32)
    slots = out_cache_loc.to(torch.int64).to(dev)
    sink_dst = torch.full((n,), -1, dtype=torch.int32, device=dev)
    sink = sink.to(dev)
    if bool(sink.any()):
        sink_dst[sink] = pool.alloc_sink_rows(slots[sink])

    starts, new = tracker.update(list(rows), list(prefix_lens), generations)
    ring_starts = torch.tensor(starts, dtype=torch.int32, device=dev)
    if new:  # device copy the kernels read; only rows that changed
        idx = torch.tensor(new, dtype=torch.int64, device=dev)
        pool.ring_start[idx] = torch.tensor([tracker.ring_start[r] for r in new], dtype=torch.int32, device=dev)
    return WritePlan(slots, sink_dst, ring_dst.to(dev), ring_starts, new)
