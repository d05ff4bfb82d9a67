"""kernels/interpreter.py: the Triton-interpreter speed-up must leave results unchanged and be
active exactly where CI needs it (TRITON_INTERPRET=1, Triton 3.6)."""

import pytest
import torch
from kernel_utils import HAS_TRITON, INTERPRET, gen, randn, requires_triton

pytestmark = requires_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(x, s):
        return x * s + tl.zeros(x.shape, tl.float32)

    @triton.jit
    def _nested_kernel(X, OUT, N: tl.constexpr):
        row = tl.program_id(0)
        x = tl.load(X + row * N + tl.arange(0, N))
        y = _scaled(x, 2.0)
        tl.store(OUT + row * 2, tl.sum(y, 0))
        tl.store(OUT + row * 2 + 1, tl.max(_scaled(y, -1.0), 0))


def test_install_is_active_in_the_interpreter_only():
    from sglang_oscar.kernels import interpreter

    active = interpreter.install()
    assert active == (INTERPRET and triton.__version__.startswith(interpreter.SUPPORTED_PREFIX))
    assert interpreter.install() == active  # idempotent
    if active:
        from triton.runtime import interpreter as triton_interpreter

        assert hasattr(triton_interpreter._patch_lang, "__wrapped__")


@pytest.mark.skipif(not INTERPRET, reason="checks the interpreter")
def test_nested_jit_helpers_give_the_torch_result():
    """A kernel that calls our own @jit helper and tl.sum / tl.max / tl.zeros (the nested calls the
    wrapper stops re-patching), launched twice in a row: same numbers as torch each time."""
    from sglang_oscar.kernels import interpreter

    assert interpreter.install()
    x = randn(5, 16, g=gen(0), device="cpu")
    want = torch.stack([(2 * x).sum(1), (-2 * x).max(1).values], 1)
    for _ in range(2):
        out = torch.full((5, 2), float("nan"))
        _nested_kernel[(5,)](x, out, N=16)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
