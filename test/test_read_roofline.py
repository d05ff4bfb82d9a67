"""The read-only reference kernel of bench_decode (benchmark/read_roofline.py) reads every word once:
its per-program XORs fold to the XOR of the whole buffer (CPU: TRITON_INTERPRET=1)."""

import functools
import os
import sys

import pytest
import torch

import kernel_utils  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
from read_roofline import BLOCK, read_all  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def xor_all(t):
    return functools.reduce(lambda a, b: a ^ b, t.tolist(), 0)


@pytest.mark.parametrize("n", [1, 1000, BLOCK, 3 * BLOCK + 17, 9 * BLOCK])  # odd tails, several programs
@pytest.mark.parametrize("sms", [1, 2])
def test_read_all_folds_every_word(n, sms):
    g = torch.Generator().manual_seed(n + sms)
    x = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    out = torch.full((sms * 8,), 12345, dtype=torch.int32)
    got = read_all(x.to(DEVICE), out.to(DEVICE), sms).cpu()
    assert xor_all(got) == xor_all(x)
    # a word left unread changes the fold (so the check can fail)
    y = x.clone()
    y[n // 2] ^= 1
    assert xor_all(got) != xor_all(y)
