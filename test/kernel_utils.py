"""Shared helpers of the kernel tests (write, gather, decode).

Import this module (or rely on test/conftest.py, which imports it first) BEFORE triton: without a
CUDA device it sets TRITON_INTERPRET=1 so the Triton kernels run on the CPU interpreter.
Interpreter rules: fp32 inputs only (it computes bf16 arithmetic and bf16 tl.dot wrongly; bf16
loads/stores are fine) and small sizes (it is slow).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # after TRITON_INTERPRET is set
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# dtype of activations / window buffers the kernels see: bf16 on GPU, fp32 under the interpreter
ACT_DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

FLOAT_POISON = float("nan")
UINT8_POISON = 0xA5
INT_POISON = -7


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape, g: torch.Generator, dtype=torch.float32, device=DEVICE, scale: float = 1.0) -> torch.Tensor:
    """Random normal on the CPU generator (same numbers on every device), then moved."""
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def random_orthogonal(*batch_and_d, g: torch.Generator, device=DEVICE) -> torch.Tensor:
    """fp32 orthogonal matrix/matrices [..., D, D] (QR of a Gaussian)."""
    *batch, d = batch_and_d
    q, r = torch.linalg.qr(torch.randn(*batch, d, d, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.float().to(device)


def random_invertible(*batch_and_d, g: torch.Generator, device=DEVICE) -> torch.Tensor:
    """A well-conditioned non-orthogonal fp32 transform (orthogonal times a diagonal in [0.5, 2])."""
    q = random_orthogonal(*batch_and_d, g=g, device="cpu")
    diag = 0.5 + 1.5 * torch.rand(*batch_and_d, generator=g)
    return (q * diag.unsqueeze(-2)).to(device)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with a value no kernel writes by accident: NaN for floats, a pattern for ints."""
    if t.dtype.is_floating_point:
        t.fill_(FLOAT_POISON)
    elif t.dtype == torch.uint8:
        t.fill_(UINT8_POISON)
    else:
        t.fill_(INT_POISON)
    return t


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal, or both NaN (poison)."""
    if a.dtype.is_floating_point:
        return (a == b) | (a.isnan() & b.isnan())
    return a == b


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (as fp32); 2^-133 for zero."""
    a = x.float().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float) -> None:
    """|got − want| <= rel · max|want row| (+ one unit in the last place of got's dtype when it is 16-bit)."""
    g, w = got.float(), want.float()
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    tol = rel * scale
    if got.dtype in (torch.bfloat16, torch.float16):
        tol = tol + (bf16_ulp(w) if got.dtype == torch.bfloat16 else w.abs() * 2.0**-10)
    bad = ~((g - w).abs() <= tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} values off; first at {bad.nonzero()[0].tolist()}: got {g[bad][0].item()}, want {w[bad][0].item()}"


def assert_codes_match(
    got: torch.Tensor,
    want: torch.Tensor,
    t_exact: torch.Tensor,
    thresholds,
    what: str,
    rel: float = 1e-4,
    max_fraction: float = 1e-3,
) -> None:
    """Unpacked INT2 codes equal, except boundary cases.

    t_exact: the pre-rounding value t = (x' − min)/scale computed in float64 (same shape as the
    codes). A mismatch is allowed only where t is within rel·max(1, |t|) of a decision threshold,
    and then the codes must differ by exactly one; mismatches must also be rare (max_fraction).
    """
    got, want = got.long(), want.long()
    diff = got != want
    if not diff.any():
        return
    th = torch.tensor(list(thresholds), dtype=torch.float64, device=t_exact.device)
    dist = (t_exact.unsqueeze(-1) - th).abs().amin(-1)
    near = dist <= rel * t_exact.abs().clamp_min(1.0)
    bad = diff & ~(near & ((got - want).abs() == 1))
    assert not bad.any(), f"{what}: {int(bad.sum())} code mismatches are not threshold boundary cases; first at {bad.nonzero()[0].tolist()}: got {got[bad][0].item()}, want {want[bad][0].item()}, t={t_exact[bad][0].item()}"
    frac = diff.float().mean().item()
    assert frac <= max_fraction, f"{what}: {frac:.2e} of the codes differ (boundary cases, but too many)"


def e4m3_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float8 e4m3 numbers at |x| (as fp32): 2^(e − 3) for normals (|x| >= 2^-6), 2^-9 below."""
    a = x.float().abs().clamp_min(2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def assert_within_e4m3_ulp(got: torch.Tensor, want: torch.Tensor, what: str, ulps: int = 1) -> None:
    """float8 e4m3 (or any float) tensors equal up to `ulps` e4m3 units in the last place (of the larger magnitude)."""
    g, w = got.float(), want.float()
    tol = ulps * e4m3_ulp(torch.maximum(g.abs(), w.abs()))
    bad = ~((g - w).abs() <= tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} values differ by more than {ulps} e4m3 ulp; first at {bad.nonzero()[0].tolist()}: got {g[bad][0].item()}, want {w[bad][0].item()}"


def int4_thresholds() -> tuple:
    """The decision thresholds of INT4 codes on uniform levels 0..15 (INT4 keys): k + 0.5, k = 0..14."""
    return tuple(k + 0.5 for k in range(15))


def threshold_rows(d: int, group: int) -> torch.Tensor:
    """[4, d] rows for exact INT4 code checks. Every group holds 0 and 15 (scale 1, min 0: t = x exactly) or -3 and 12
    (min -3), then as many as fit of: 0.5 − 2^-25 (t + 0.5 rounds to 1.0 there: floor(t + 0.5) would say code 1, the
    count says 0) and its neighbours, the thresholds k + 0.5 themselves (ties: code k + 1) and the fp32 numbers either
    side of them; the rest of the group is its min. Row 2 is row 0 reversed, row 3 constant (scale 0)."""
    th = torch.arange(15, dtype=torch.float32) + 0.5
    vals = torch.cat([torch.tensor([0.5 - 2.0**-25, 0.5 - 2.0**-24, 2.0**-30, 14.999999]), th,
                      torch.nextafter(th, torch.zeros(15)), torch.nextafter(th, torch.full((15,), 16.0))])
    rows = []
    for lo, hi in ((0.0, 15.0), (-3.0, 12.0)):
        g = torch.cat([torch.tensor([lo, hi]), vals + lo])[:group]
        reps = -(-d // group)
        rows.append(torch.cat([torch.cat([g, torch.full((group - g.numel(),), lo)]) for _ in range(reps)])[:d])
    rows.append(rows[0].flip(0))
    rows.append(torch.full((d,), 1.25))
    return torch.stack(rows)
