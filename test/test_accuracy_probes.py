"""The key quantizers of benchmark/accuracy_diagnosis.py (docs/results/accuracy.md, "What was tried"): --set channel's
per channel over token blocks and per-channel block mean plus the per-token INT2 residual, --set headbits' 4-bit keys
on chosen heads, and RowSim, the --ppl harness's simulator with those knobs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
diag = pytest.importorskip("accuracy_diagnosis")

from sglang_oscar.quant.kv import SideQuantizer  # noqa: E402


def _keys(seed: int, S: int = 333, D: int = 64, H: int = 3) -> torch.Tensor:
    """Row noise plus a per-channel part that drifts slowly with position (what a turning RoPE pair does)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S, dtype=torch.float32)[:, None]
    freq = torch.rand(H, 1, D, generator=g) * 0.02
    drift = 4.0 * torch.cos(pos[None] * freq + torch.rand(H, 1, D, generator=g) * 6.28)
    return (drift + 0.5 * torch.randn(H, S, D, generator=g))[None]


@pytest.mark.parametrize("block", [32, 64])
def test_channel_quantized_levels_and_error(block):
    ke = _keys(1)
    kq = diag.channel_quantized(ke, block=block)
    n = (ke.shape[2] // block) * block
    assert torch.equal(kq[:, :, n:], ke[:, :, n:]), "rows past the last whole block must stay exact"
    x = ke[:, :, :n].reshape(1, 3, n // block, block, 64)
    q = kq[:, :, :n].reshape(1, 3, n // block, block, 64)
    # four levels per (block, channel), each within half a step (plus bf16 rounding of scale and min) of its value
    step = (x.amax(3, keepdim=True) - x.amin(3, keepdim=True)) / 3
    assert int(max(len(torch.unique(q[0, h, b, :, c])) for h in range(3) for b in range(n // block)
                   for c in range(0, 64, 7))) <= 4
    assert bool(((q - x).abs() <= step / 2 + 0.02 * x.abs().amax()).all())


def test_blockmean_beats_per_token_on_drifting_keys():
    ke = _keys(2)
    qk = SideQuantizer(matrix=torch.eye(64), clip_ratio=1.0)
    kq = diag.blockmean_quantized(ke, qk, block=64)
    n = (ke.shape[2] // 64) * 64
    assert torch.equal(kq[:, :, n:], ke[:, :, n:])
    err_bm = (kq - ke)[:, :, :n].pow(2).mean()
    err_tok = (qk.fake_transformed(ke) - ke)[:, :, :n].pow(2).mean()
    assert err_bm < 0.25 * err_tok, (float(err_bm), float(err_tok))


def test_blockmean_of_per_row_noise_is_no_worse():
    # without a shared drift the block mean removes nothing and the residual is the rows' own: the same error
    g = torch.Generator().manual_seed(3)
    ke = torch.randn(1, 2, 256, 64, generator=g)
    qk = SideQuantizer(matrix=torch.eye(64), clip_ratio=1.0)
    e_bm = (diag.blockmean_quantized(ke, qk) - ke).pow(2).mean()
    e_tok = (qk.fake_transformed(ke) - ke).pow(2).mean()
    assert float(e_bm) == pytest.approx(float(e_tok), rel=0.1)


def test_short_rows_are_returned_exact():
    ke = torch.randn(1, 1, 40, 64)
    qk = SideQuantizer(matrix=torch.eye(64))
    assert torch.equal(diag.channel_quantized(ke, block=64), ke)
    assert torch.equal(diag.blockmean_quantized(ke, qk, block=64), ke)


def test_row_sim_reconstructs_the_rows_its_knobs_name():
    """--ppl's RowSim: without knobs it is the PPL harness's decode simulator (same NLL); k_exact / v_exact read that
    side exact, which on a tiny random model moves the NLL toward bf16's; a block-mean K changes it."""
    from sglang_oscar.eval.ppl import window_nll
    from sglang_oscar.eval.simulator import MixedCacheSimulator
    from sglang_oscar.models import tiny_llama
    from sglang_oscar.quant import hadamard_matrix

    torch.manual_seed(0)
    model = tiny_llama(num_layers=2, q_heads=4, kv_heads=2, head_dim=64, seed=0)
    ids = torch.randint(0, 512, (1200,), generator=torch.Generator().manual_seed(1)).tolist()
    h = hadamard_matrix(64).float()
    layers = [(SideQuantizer(h, bits=2, group=64, clip_ratio=0.95), SideQuantizer(h, bits=2, group=64))] * 2

    def nll(sim):
        if sim is None:
            return window_nll(model, ids)
        with sim.attach(model):
            return window_nll(model, ids)

    exact = nll(None)
    base = nll(MixedCacheSimulator(layers, sink=diag.SINK, recent=diag.RECENT, mode="decode"))
    assert nll(diag.RowSim(layers)) == pytest.approx(base, abs=1e-6)
    both = nll(diag.RowSim(layers, k_exact=True, v_exact=True))
    assert both == pytest.approx(exact, abs=1e-5) and abs(base - exact) > 5e-5
    k_only, v_only = nll(diag.RowSim(layers, v_exact=True)), nll(diag.RowSim(layers, k_exact=True))
    assert abs(k_only - exact) < abs(base - exact) and abs(v_only - exact) < abs(base - exact)
    kbm = nll(diag.RowSim(layers, k_blockmean=dict(block=64)))
    assert abs(kbm - base) > 1e-5


def test_k4_heads_replace_only_the_named_heads_rows():
    """--set headbits: k4_heads re-quantizes the named KV heads' keys at 4 bits (no clip), the other heads keep the
    INT2 rows (a quantizer's own INT4-key heads dropped: {} is INT2 keys everywhere), and V is untouched; a 4-bit head
    is closer to the exact keys."""
    import types

    from sglang_oscar.quant import hadamard_matrix

    ke = _keys(3)  # [1, 3 heads, S, 64]
    ve = _keys(4)
    qk = SideQuantizer(hadamard_matrix(64).float(), bits=2, group=64, clip_ratio=0.9)
    qv = SideQuantizer(hadamard_matrix(64).float(), bits=2, group=64)
    kq, vq = qk.fake_transformed(ke), qv.fake_transformed(ve)
    knobs = dict(k_channel=None, k_blockmean=None, k_exact=False, v_exact=False)
    sim = types.SimpleNamespace(k4_heads={5: [1]}, **knobs)
    k2, v2 = diag.row_knobs(sim, qk, qv, ke, kq, ve, vq, 5)
    assert torch.equal(k2[:, 0], kq[:, 0]) and torch.equal(k2[:, 2], kq[:, 2]) and v2 is vq
    err = lambda a: float((a - ke[:, 1]).pow(2).mean())  # noqa: E731
    assert err(k2[:, 1]) < 0.1 * err(kq[:, 1])
    k_other, _ = diag.row_knobs(sim, qk, qv, ke, kq, ve, vq, 4)  # a layer without 4-bit heads
    assert torch.equal(k_other, kq)
    # a quantizer with its own INT4-key head 0: the knob's heads replace it
    qk0 = SideQuantizer(hadamard_matrix(64).float(), bits=2, group=64, clip_ratio=0.9, k4_heads=(0,))
    kq0 = qk0.fake_transformed(ke.transpose(1, 2)).transpose(1, 2)  # the simulator's rows (fake_rows)
    assert not torch.equal(kq0[:, 0], kq[:, 0])
    k3, _ = diag.row_knobs(sim, qk0, qv, ke, kq0, ve, vq, 5)
    assert torch.equal(k3, k2)
    k_int2, _ = diag.row_knobs(types.SimpleNamespace(k4_heads={}, **knobs), qk0, qv, ke, kq0, ve, vq, 5)
    assert torch.equal(k_int2, kq)
