"""srt/extend_attention.py: the ragged causal attention of int2 extend steps.

Oracle: quant/attention.py:ragged_causal_reference, float64 with an explicit bottom-right causal mask, one request at a time. CPU
checks the torch SDPA path (the CI one); the GPU test checks FlashInfer's ragged prefill (the CUDA
default) against the same oracle in bf16, with a poisoned output buffer, prefixes that are empty,
short and long, odd lengths, GQA 1/3/4/8, head dims 64/128/256, batch 1, 16 and 24."""

from __future__ import annotations

import pytest
import torch

from sglang_oscar.quant.attention import ragged_causal_reference as oracle
from sglang_oscar.srt.extend_attention import ExtendAttention, check_ragged, ragged_causal_sdpa


def ragged(q_lens, prefixes, hq, h, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    kv_lens = [e + p for e, p in zip(q_lens, prefixes)]
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    k = torch.randn(sum(kv_lens), h, d, generator=g)
    v = torch.randn(sum(kv_lens), h, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], kv_lens


CASES = [  # (q_lens, prefixes, q heads, kv heads, head dim)
    ([1], [0], 4, 4, 64),  # one token, no prefix
    ([37], [0], 8, 2, 64),  # plain causal, GQA 4
    ([5, 1, 33], [0, 70, 130], 8, 1, 64),  # GQA 8, decode-like row, prefixes
    ([17, 64, 3], [300, 0, 1], 6, 2, 128),  # GQA 3 (SmolLM2's ratio), D 128
    # batch 16 of odd lengths, prefixes empty, short and long, GQA 3
    ([1, 3, 7, 9, 13, 15, 17, 21, 25, 27, 31, 33, 37, 41, 45, 63],
     [0, 5, 0, 11, 1, 63, 0, 129, 7, 0, 33, 255, 3, 0, 17, 99], 9, 3, 64),
    ([9, 1, 23], [0, 41, 7], 8, 2, 256),  # D 256 (SUPPORTED_HEAD_DIMS), GQA 4
]


@pytest.mark.parametrize("q_lens,prefixes,hq,h,d", CASES)
def test_sdpa_path_matches_the_oracle(q_lens, prefixes, hq, h, d):
    (q, k, v), kv_lens = ragged(q_lens, prefixes, hq, h, d, torch.float32, "cpu", seed=len(q_lens) + d)
    scale = d ** -0.5
    att = ExtendAttention("auto", "cpu")
    assert att.impl == "sdpa"
    att.plan(q_lens, kv_lens, hq, h, d, torch.float32, scale)
    out = torch.full((q.shape[0], hq, d), float("nan"))
    got = att.run(q, k, v, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double(), oracle(q, k, v, q_lens, kv_lens, scale), atol=2e-5, rtol=2e-5)


def test_mask_is_bottom_right_aligned():
    """With a prefix, the first new token must see the whole prefix (a top-left mask would hide it)."""
    (q, k, v), kv_lens = ragged([2], [5], 1, 1, 64, torch.float32, "cpu", seed=3)
    v = torch.zeros_like(v)
    v[:5] = 1.0  # only prefix rows carry value: a top-left mask would give token 0 just key 0 (value 1)
    v[5] = -7.0  # the first new token's own key: visible to it under bottom-right alignment
    got = ragged_causal_sdpa(q, k, v, [2], kv_lens, 0.0)  # scale 0: uniform weights over visible keys
    assert torch.allclose(got[0], torch.full_like(got[0], (5 - 7.0) / 6))
    assert torch.allclose(got[1], torch.full_like(got[1], (5 - 7.0) / 7))


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="use one of"):
        ExtendAttention("xformers", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ExtendAttention("flashinfer", "cpu")
    att = ExtendAttention("sdpa", "cpu")
    with pytest.raises(RuntimeError, match="before plan"):
        att.run(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
    with pytest.raises(ValueError, match="request 1: 4 new tokens but 3 keys"):
        check_ragged([1, 4], [1, 3])
    att.plan([2], [3], 2, 1, 64, torch.float32, 0.1)
    with pytest.raises(ValueError, match="planned 2 query rows and 3 key rows"):
        att.run(torch.zeros(3, 2, 64), torch.zeros(3, 1, 64), torch.zeros(3, 1, 64))
    assert not att.needs_plan(2, 1, 64, torch.float32, 0.1) and att.needs_plan(2, 1, 64, torch.float32, 0.2)
    att.reset()
    assert att.needs_plan(2, 1, 64, torch.float32, 0.1)


def _flashinfer_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pytest.skip("needs flashinfer (part b of the device runtime)")


GPU_CASES = CASES + [
    ([1] * 24, [int(x) for x in torch.randint(0, 3000, (24,), generator=torch.Generator().manual_seed(5))], 32, 8,
     128),  # batch 24 of one-token extends (radix hits of short prompts)
    ([4096, 513], [0, 9000], 32, 8, 128),  # Qwen3-8B heads: a long chunk, and a chunk after a long prefix
]


@pytest.mark.parametrize("q_lens,prefixes,hq,h,d", GPU_CASES)
def test_flashinfer_matches_the_oracle_gpu(q_lens, prefixes, hq, h, d):
    _flashinfer_or_skip()
    (q, k, v), kv_lens = ragged(q_lens, prefixes, hq, h, d, torch.bfloat16, "cuda", seed=7 + d)
    scale = d ** -0.5
    att = ExtendAttention("auto", "cuda")
    assert att.impl == "flashinfer"
    att.plan(q_lens, kv_lens, hq, h, d, torch.bfloat16, scale)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = att.run(q, k, v, out=out).double().cpu()
    ref = oracle(q.cpu(), k.cpu(), v.cpu(), q_lens, kv_lens, scale)
    assert torch.isfinite(got).all()
    # bf16 inputs/outputs, fp32 accumulation: relative error of a few bf16 ulps (2^-8 = 3.9e-3)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 8e-3, err
    # and the torch SDPA path on the same inputs agrees as well (the option users may pick), into a poisoned out
    sd = ExtendAttention("sdpa", "cuda")
    sd.plan(q_lens, kv_lens, hq, h, d, torch.bfloat16, scale)
    out_sdpa = torch.full((q.shape[0], hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    got_sdpa = sd.run(q, k, v, out=out_sdpa)
    assert got_sdpa.data_ptr() == out_sdpa.data_ptr() and torch.isfinite(out_sdpa).all()
    err_sdpa = ((out_sdpa.double().cpu() - ref).norm() / ref.norm()).item()
    assert err_sdpa < 8e-3, err_sdpa
