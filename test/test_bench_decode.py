"""benchmark/bench_decode.py's CPU-testable parts: the commit its results name (OSCAR_COMMIT where the staging
command sets it, since the device machine's copy of the tree can carry stale git metadata; else this checkout's
HEAD), its impl names, and its read-of-the-same-bytes kernel (the ceiling column), which must read every word once
(TRITON_INTERPRET=1 on CPU)."""

import functools
import os
import subprocess
import sys

import pytest
import torch

import kernel_utils  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
from bench_decode import IMPL_RE, READ_BLOCK, read_all, versions  # noqa: E402
from bench_write import git_commit  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_versions_name_oscar_commit_when_set(monkeypatch):
    monkeypatch.setenv("OSCAR_COMMIT", "0123abc")
    assert git_commit() == "0123abc"
    assert versions()["git_commit"] == "0123abc"


def test_versions_fall_back_to_head(monkeypatch):
    monkeypatch.delenv("OSCAR_COMMIT", raising=False)
    try:
        head = subprocess.check_output(["git", "-C", REPO, "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    assert versions()["git_commit"] == head


def test_impl_names():
    for name in ("oscar", "oscar_page64", "oscar_cuda", "oscar_cuda_page64", "oscar_cuda_page64_k4", "oscar_k4",
                 "read_same_bytes", "copy_same_traffic", "flashinfer_bf16", "flashinfer_fp8", "sglang_triton_bf16"):
        assert IMPL_RE.fullmatch(name), name
    for name in ("oscar_prev", "oscar_cuda_groups4_page64", "flashinfer", "oscar_page", "oscar_k4_page64"):
        assert not IMPL_RE.fullmatch(name), name


def xor_all(t):
    return functools.reduce(lambda a, b: a ^ b, t.tolist(), 0)


@pytest.mark.parametrize("n", [1, 1000, READ_BLOCK, 3 * READ_BLOCK + 17, 9 * READ_BLOCK])  # odd tails, several programs
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
