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


# Run in a fresh interpreter that imports only the product (not test_decode.py, conftest.py or kernel_utils.py):
# whatever the interpreted decode needs (the __index__ fix of kernels/interpreter.py for its runtime loop bounds
# range(lo, hi) under numpy >= 2.4) must come from importing sglang_oscar.kernels.
_DECODE_ALONE = r'''
import math, sys
import numpy as np
import torch
from triton.runtime import interpreter as triton_interpreter
from sglang_oscar.kernels import interpreter
from sglang_oscar.kernels.decode import oscar_decode
from sglang_oscar.kernels.layout import LayerCache
from sglang_oscar.quant.attention import mixed_decode_reference
from sglang_oscar.quant.intq import round_param

assert "test_decode" not in sys.modules and "kernel_utils" not in sys.modules
wrapper = triton_interpreter._patch_lang_tensor
needed = not interpreter._index_takes_one_element_arrays(getattr(wrapper, "__wrapped__", wrapper))
assert hasattr(wrapper, "__wrapped__") == needed, (needed, np.__version__)
g = torch.Generator().manual_seed(0)
hkv, gqa, d, sink, window, lens = 2, 3, 64, 8, 16, [37, 5]
max_ctx, b = 48, len(lens)
num_slots = b * max_ctx + 1
cache = LayerCache.empty(num_slots, hkv, d, k_group=64, v_group=32, num_sink_rows=b * sink + 1, max_reqs=b,
                         window=window, sink=sink, window_dtype=torch.float32, device="cpu")
cache.k_codes.copy_(torch.randint(0, 256, cache.k_codes.shape, generator=g, dtype=torch.uint8))
cache.v_codes.copy_(torch.randint(0, 256, cache.v_codes.shape, generator=g, dtype=torch.uint8))
for prm in (cache.k_params, cache.v_params):
    prm[..., 0] = round_param(torch.rand(prm.shape[:-1], generator=g) * 0.6 + 0.05)
    prm[..., 1] = round_param(-1.5 * torch.rand(prm.shape[:-1], generator=g) - 0.2)
for buf in (cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v):
    buf.fill_(float("nan"))
cache.sink_table.fill_(-1)
req_to_token = (torch.randperm(num_slots - 1, generator=g)[:b * max_ctx] + 1).int().view(b, max_ctx)
row = 1
for r, L in enumerate(lens):
    for p in range(min(sink, L)):
        cache.sink_table[req_to_token[r, p]] = row
        cache.sink_k[row] = torch.randn(hkv, d, generator=g)
        cache.sink_v[row] = torch.randn(hkv, d, generator=g)
        row += 1
    for p in range(max(L - window, 0), L):
        cache.ring_k[r * window + p % window] = torch.randn(hkv, d, generator=g)
        cache.ring_v[r * window + p % window] = torch.randn(hkv, d, generator=g)
case = dict(q=torch.randn(b, hkv * gqa, d, generator=g) * 0.5, cache=cache, req_to_token=req_to_token,
            req_pool_indices=torch.arange(b, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
            ring_start=torch.zeros(b, dtype=torch.int32), sink=sink, window=window, sm_scale=1 / math.sqrt(d))
ref = mixed_decode_reference(**case)
out = torch.full_like(case["q"], float("nan"))
oscar_decode(**case, out=out, num_splits=2, block_n=16)
assert torch.isfinite(out).all()
err = ((out.double() - ref).norm() / ref.norm()).item()
assert err < 1e-4, err
print("ok", np.__version__, "fix needed:", needed, "rel err %.2e" % err)
'''


def test_decode_runs_in_the_interpreter_on_the_product_path_alone():
    """oscar_decode (two requests over the sink, the window and a 16-token-block INT2 history; lengths 37 and 5) in a
    fresh process with TRITON_INTERPRET=1, against the oracle (fp32: rel. error < 1e-4, NaN-poisoned output). The
    __index__ fix is installed exactly where this Triton's own __index__ refuses a one-element array."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _DECODE_ALONE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("ok "), res.stdout
