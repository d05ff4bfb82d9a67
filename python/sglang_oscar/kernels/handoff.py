"""The step's rotated queries from the KV write to the decode's CUDA history CTAs, without waiting for the whole write.

In a served decode step at small batch the write rotates q in its own launch (oscar_write_kv q_out) and the CUDA
history kernel runs as the write's programmatic dependent (oscar_decode follows_write / q_from_write). The history
CTAs need only q' from the write, but griddepcontrol.wait waits for all of it (the K / V programs' quantisation and
the grid's completion). With a QHandoff the write's q programs count the tokens they have stored in a device flag
(a release add after a CTA barrier) and the history warps poll it (acquire) after their first copies; the window
CTAs, which read the new row, still wait for the whole write.

Device protocol (kernels/write.py, kernels/cuda/int2_history.cu): flags[0] counts q' rows (tokens x KV heads)
stored; once it reaches the target, each history warp counts itself in flags[COUNT]; the grid's last warp resets
both to zero for the next write. Host protocol: a write arms the handoff with its target, the decode that follows
takes it; an unpaired write or decode raises here, before a stale count could let a decode read q' early.
One handoff per device and stream; a model's layers use it in turn (write, decode, write, decode, ...).
"""

from __future__ import annotations

from typing import Optional

import torch

COUNT = 32  # the history warps' count: its own 128-byte line, away from the q programs' adds


class QHandoff:
    def __init__(self, device):
        device = torch.device(device)  # CUDA to be of use (the decode side is the CUDA history kernel's)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("create the QHandoff before capturing a CUDA graph (its flags must exist, zeroed, "
                               "outside the graph)")
        self.flags = torch.zeros(2 * COUNT, dtype=torch.int32, device=device)
        self.target: Optional[int] = None

    def arm(self, target: int) -> None:
        """Called by oscar_write_kv when it launches: the history warps wait until `target` q' rows are stored."""
        if self.target is not None:
            raise RuntimeError("QHandoff: a write armed it again before oscar_decode(q_handoff=...) took the previous "
                               "write's queries; every write with q_handoff must be followed by its decode (if a "
                               "call failed in between, make a new QHandoff: the device count may be stale)")
        if target < 1:
            raise ValueError(f"QHandoff target must be >= 1, got {target}")
        self.target = int(target)

    def pending(self) -> int:
        """The armed target, for oscar_decode's launch (it stays armed until take)."""
        if self.target is None:
            raise RuntimeError("oscar_decode(q_handoff=...) needs the KV write that rotated q to have been launched "
                               "with the same q_handoff just before (oscar_write_kv(..., q_out=..., q_handoff=...))")
        return self.target

    def take(self) -> int:
        """Called by oscar_decode once the history kernel is launched: the armed target, disarmed."""
        target = self.pending()
        self.target = None
        return target
