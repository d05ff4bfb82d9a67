"""A read-only streaming kernel: the share of copy bandwidth that merely reading N bytes reaches.

bench_decode.py times it on exactly the bytes of one oscar call (impl read_same_bytes), as the
ceiling of each point: at small sizes (batch 1) launch, ramp-up and tail dominate, so no kernel of
those bytes reaches the bandwidth of a 1 GiB copy. Each program reads a contiguous range of int32
words in 16 KB blocks (16-byte loads), folds them with XOR and stores one word, so the loads
cannot be optimised away. Checked against torch on the CPU under TRITON_INTERPRET=1
(test/test_read_roofline.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words per iteration (16 KB)
PROGRAMS_PER_SM = 8


@triton.jit
def _read_words(X, OUT, META, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # ITERS blocks per program (a constexpr: one compile per size, fine for a benchmark); META = [n]
    n = tl.load(META)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for i in range(ITERS):
        idx = (pid * ITERS + i) * BLOCK + offs
        acc ^= tl.load(X + idx, mask=idx < n, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


def read_plan(n: int, sms: int):
    """(programs, blocks per program, meta) for n words: up to PROGRAMS_PER_SM programs per SM."""
    programs = min(sms * PROGRAMS_PER_SM, max(1, triton.cdiv(n, BLOCK)))
    iters = triton.cdiv(triton.cdiv(n, BLOCK), programs)
    return triton.cdiv(triton.cdiv(n, BLOCK), iters), iters, torch.tensor([n], dtype=torch.int32)


def read_all(x: torch.Tensor, out: torch.Tensor, sms: int, plan=None) -> torch.Tensor:
    """XOR of each program's range of the int32 words of x into out[program]; returns those words."""
    programs, iters, meta = plan or read_plan(x.numel(), sms)
    _read_words[(programs,)](x, out, meta.to(x.device), ITERS=iters, BLOCK=BLOCK, num_warps=8)
    return out[:programs]


def read_fns(nbytes: int, copies: int, sms: int):
    """One read of nbytes per copy (rotated to defeat L2), as callables for bench_decode.bench."""
    words = max(nbytes // 4, 1)
    programs, iters, meta = read_plan(words, sms)
    plan = (programs, iters, meta.cuda())  # on the device before the graph capture
    bufs = [(torch.ones(words, dtype=torch.int32, device="cuda"),
             torch.empty(sms * PROGRAMS_PER_SM, dtype=torch.int32, device="cuda")) for _ in range(copies)]
    return [lambda x=x, o=o: read_all(x, o, sms, plan) for x, o in bufs], (bufs, plan)
