"""RoPE offsets in calibration capture: the rotated rows are the keys/queries of later positions."""

import torch

from sglang_oscar.models import tiny_llama
from sglang_oscar.rotation.capture import _run_windows, apply_rope, capture_statistics, rope_rotation, window_offsets


def _keys(model, ids, positions=None, offsets=None):
    got = {}

    def on_layer(layer, q, k, v, o, scaling):
        got[layer] = (q.clone(), k.clone(), o.clone())

    if positions is None:
        _run_windows(model, [ids], on_layer, False, "t", offsets)
        return got
    # reference: the model itself run at shifted positions
    from sglang_oscar.hf_attention import attention_override

    def attn(module, query, key, value, scaling):
        got[module.layer_idx] = (query[0].float().clone(), key[0].float().clone(), None)
        from sglang_oscar.hf_attention import causal_attention
        return causal_attention(query, key, value, scaling, module.num_key_value_groups)

    with attention_override(model, attn), torch.inference_mode():
        model(input_ids=torch.tensor([ids]), position_ids=positions, use_cache=False)
    return got


def test_rope_offset_equals_later_positions():
    torch.manual_seed(0)
    model = tiny_llama(num_layers=2, q_heads=4, kv_heads=2, head_dim=64, seed=3)
    ids = torch.randint(0, 512, (37,)).tolist()
    d = 1234
    turned = _keys(model, ids, offsets=[d])
    plain = _keys(model, ids)
    for layer in (0, 1):
        # layer 0's input does not depend on positions: its q/k at positions p + d are exactly R(d)
        # applied to those at p; deeper layers see identical attention (relative positions), so the
        # same holds there too
        ref = _keys(model, ids, positions=torch.arange(d, d + len(ids))[None])
        assert torch.allclose(turned[layer][1], ref[layer][1], atol=2e-4), layer
        assert torch.allclose(turned[layer][0], ref[layer][0], atol=2e-4), layer
        # attention (hence the outputs the statistics use) is unchanged by the offset
        assert torch.allclose(turned[layer][2], plain[layer][2], atol=1e-4), layer
        assert not torch.allclose(turned[layer][1], plain[layer][1], atol=1e-2)  # the phases did move


def test_apply_rope_composes_and_preserves_dot_products():
    model = tiny_llama(num_layers=1, q_heads=2, kv_heads=1, head_dim=64, seed=1)
    a, b = rope_rotation(model, 300, 64, "cpu"), rope_rotation(model, 700, 64, "cpu")
    ab = rope_rotation(model, 1000, 64, "cpu")
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    assert torch.allclose(apply_rope(apply_rope(x, a), b), apply_rope(x, ab), atol=1e-4)
    assert torch.allclose((apply_rope(x, a) * apply_rope(y, a)).sum(-1), (x * y).sum(-1), atol=1e-4)


def test_window_offsets_spread_over_context():
    w = [[0] * 100] * 5
    assert window_offsets(w, None) == [0] * 5
    off = window_offsets(w, 1000)
    assert off[0] == 0 and off[-1] == 900 and off == sorted(off)
    assert window_offsets([[0] * 100], 1000) == [0]
    assert window_offsets([[0] * 2000], 1000) == [0]  # windows longer than the context: no offset


def test_capture_with_context_changes_key_statistics_only_by_phase():
    model = tiny_llama(num_layers=2, q_heads=4, kv_heads=2, head_dim=64, seed=3)
    g = torch.Generator().manual_seed(5)
    wins = [torch.randint(0, 512, (48,), generator=g).tolist() for _ in range(3)]
    plain = capture_statistics(model, wins, [], progress=False)
    far = capture_statistics(model, wins, [], progress=False, context=50_000)
    for layer in range(2):
        # rotations preserve norms: the traces of C_K and C_Q match, the matrices do not
        assert torch.allclose(torch.diagonal(plain.c_k(layer), dim1=-2, dim2=-1).sum(-1),
                              torch.diagonal(far.c_k(layer), dim1=-2, dim2=-1).sum(-1), rtol=1e-5)
        assert not torch.allclose(plain.c_k(layer), far.c_k(layer), atol=1e-3)
        # C_S comes from attention outputs, which the offsets leave alone
        assert torch.allclose(plain.c_s(layer), far.c_s(layer), rtol=1e-4, atol=1e-6)
