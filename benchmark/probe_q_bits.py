"""How many bits of q the integer K dot needs (CPU, numpy; no GPU): the attention output over random INT2 keys with q
quantized as the CUDA history kernel quantizes it (per plane group of 64 dims, one scale per warp, i.e. over the 4
query heads of a KV head, or one per head), against exact q, as relative L2 error of the output.

Why: the paired tiles (int2_history.cu OSCAR_PAIR) would have been cheaper with an 8-bit q (half the K MMAs and no
hi / lo combine, and the zero-padded q operands would have fitted the 128 registers), but the kernel's GPU tests hold
the output to 1% of the oracle's. Result on 2026-12-01 (seeds 0-2): 8 bits 0.4-5.2% (worst with a peaked softmax or
outlier dims), 15 bits (the kernel's hi . 128 + lo) 1e-5-4e-4; so q stays at 14 bits plus sign.

    python benchmark/probe_q_bits.py [--tokens 4096] [--seeds 3]
"""

from __future__ import annotations

import argparse

import numpy as np

D, HEADS, GROUP = 128, 4, 64


def attention(q, codes, ksc, kmn, v, bits=0, per_head=False):
    """Softmax attention of q [H, D] over keys min + scale . code (groups of 64) and values v, with the code part of
    the dot taken with q quantized to `bits` (0: exact) per group, one scale over all heads or per head; the min
    term uses exact q sums, as in the kernel."""
    qq = q.copy()
    if bits:
        lim = 2 ** (bits - 1) - 1
        for g in range(D // GROUP):
            sl = slice(GROUP * g, GROUP * (g + 1))
            top = np.abs(q[:, sl]).max(axis=1, keepdims=True) if per_head else np.abs(q[:, sl]).max()
            scale = lim / top
            qq[:, sl] = np.round(q[:, sl] * scale) / scale
    s = np.zeros((q.shape[0], codes.shape[0]))
    for g in range(D // GROUP):
        sl = slice(GROUP * g, GROUP * (g + 1))
        s += (qq[:, sl] @ codes[:, sl].T) * ksc[None, :, g] + q[:, sl].sum(-1)[:, None] * kmn[None, :, g]
    s /= np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'seed':>4} {'q':<18} " + " ".join(f"{m + str(b):>10}" for m in ("warp", "head") for b in (8, 15)))
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        codes = rng.integers(0, 4, (args.tokens, D)).astype(float)
        ksc = np.abs(rng.standard_normal((args.tokens, D // GROUP))) * 0.7 + 0.2
        kmn = -1.5 * ksc
        v = rng.standard_normal((args.tokens, D))
        cases = {"randn * 0.5": rng.standard_normal((HEADS, D)) * 0.5,
                 "randn * 4 (peaked)": rng.standard_normal((HEADS, D)) * 4,
                 "head norms 1:8": rng.standard_normal((HEADS, D)) * np.array([[0.5], [1], [2], [4]]),
                 "outlier dims": rng.standard_normal((HEADS, D)) * np.where(np.arange(D) % 37 == 0, 8, 1)}
        for name, q in cases.items():
            ref = attention(q, codes, ksc, kmn, v)
            errs = [np.linalg.norm(attention(q, codes, ksc, kmn, v, b, ph) - ref) / np.linalg.norm(ref)
                    for ph in (False, True) for b in (8, 15)]
            print(f"{seed:>4} {name:<18} " + " ".join(f"{e:10.2e}" for e in errs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
