"""V-rotation absorption (hook #9) on SGLang 0.5.17's own Llama / Qwen2 / Qwen3 attention blocks, on CPU.

Skipped without SGLang (.venv); CI runs it in .venv-serve (scripts/test.sh part 2), by hand:
.venv-serve/bin/python -m pytest -q test/test_srt_absorb_v_sglang.py.
The real attention modules (QKVParallelLinear + RoPE + Qwen3's q/k norms + RowParallelLinear) are
built per TP rank with get_parallel().override and loaded through SGLang's own weight loaders, so
the shard layout is SGLang's, not ours. Only RadixAttention is replaced (by causal SDPA, which is
basis-agnostic like the real kernels) and o_proj's all-reduce (by summing the ranks' partials).
The hook itself (hooks.load_model_after) absorbs a saved rotation bundle into every rank; the
block's output must not change, and the V it hands to attention (what the pool stores) must be
v·T_V of the rank's KV heads. The end-to-end check on a real server is the slow test at the end.
"""

import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed here (these tests run in .venv-serve: scripts/test.sh part 2)",
                allow_module_level=True)
_SHIM = str(Path(__file__).resolve().parent / "sglang_cpu_shim")
if not torch.cuda.is_available():  # before the first sglang import (see test_srt_plugin.py)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if _SHIM not in sys.path:
        sys.path.insert(0, _SHIM)

pytest.importorskip("sglang.srt.plugins.hook_registry")

from sglang_oscar.rotation.bundle import RotationBundle, save_bundle  # noqa: E402
from sglang_oscar.srt import hooks, options  # noqa: E402
from sglang_oscar.srt.absorb_v import ABSORB_ATTR  # noqa: E402
from sglang_oscar.srt.capacity import kv_head_range  # noqa: E402

HIDDEN, D, LAYERS = 256, 64, 2


def _orth(n, gen):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


class _SDPA(torch.nn.Module):
    """Stands in for RadixAttention: causal GQA over the step's own tokens; records the V it gets."""

    def __init__(self, layer_id, hq, hkv):
        super().__init__()
        self.layer_id, self.hq, self.hkv, self.seen_v = layer_id, hq, hkv, None

    def forward(self, q, k, v, forward_batch=None, save_kv_cache=True):
        t = q.shape[0]
        self.seen_v = v.reshape(t, self.hkv, D).clone()
        o = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(t, self.hq, D).transpose(0, 1), k.reshape(t, self.hkv, D).transpose(0, 1),
            v.reshape(t, self.hkv, D).transpose(0, 1), is_causal=True, enable_gqa=self.hq != self.hkv)
        return o.transpose(0, 1).reshape(t, -1)


def _no_reduce(o_proj):
    """o_proj's forward without the all-reduce (no process group here): this rank's partial sum;
    RowParallelLinear adds its bias on rank 0 only."""
    def fwd(x, *a, **k):
        return o_proj.quant_method.apply(o_proj, x, bias=None if o_proj.tp_rank else o_proj.bias), None
    return fwd


def _full_weights(hq, hkv, bias, gen):
    w = lambda *s: torch.randn(*s, generator=gen) * 0.08  # noqa: E731
    return [dict(q=w(hq * D, HIDDEN), k=w(hkv * D, HIDDEN), v=w(hkv * D, HIDDEN), o=w(HIDDEN, hq * D),
                 qb=w(hq * D) if bias else None, kb=w(hkv * D) if bias else None, vb=w(hkv * D) if bias else None,
                 qn=1 + w(D), kn=1 + w(D)) for _ in range(LAYERS)]


def _attention(arch, layer_id, hq, hkv, bias):
    from sglang.srt.models.llama import LlamaAttention
    from sglang.srt.models.qwen2 import Qwen2Attention
    from sglang.srt.models.qwen3 import Qwen3Attention
    from transformers import LlamaConfig

    if arch == "llama":
        cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D)
        return LlamaAttention(cfg, HIDDEN, hq, hkv, layer_id=layer_id, bias=bias)
    if arch == "qwen2":  # qkv bias always on
        return Qwen2Attention(HIDDEN, hq, hkv, head_dim=D, layer_id=layer_id)
    return Qwen3Attention(HIDDEN, hq, hkv, layer_id=layer_id, head_dim=D, rms_norm_eps=1e-6, attention_bias=bias)


ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@contextlib.contextmanager
def _as_rank(tp_rank, tp_size):
    """SGLang's runtime context of one TP rank (published config + parallel topology): the modules
    read it when built and, for Qwen3, in forward."""
    from sglang.srt.runtime_context import get_context, get_parallel

    par = dict(tp_size=tp_size, tp_rank=tp_rank, attn_tp_size=tp_size, attn_tp_rank=tp_rank)
    with get_context().override_server_args(device="cpu"), get_parallel().override(**par):
        yield


def _rank_model(arch, weights, hq, hkv, bias, tp_rank, tp_size):
    """One rank's model: the real attention blocks of all layers, loaded with SGLang's loaders, in a
    module named like SGLang's model class (the hook checks the class name)."""
    with _as_rank(tp_rank, tp_size):
        blocks = torch.nn.ModuleList()
        for lid, w in enumerate(weights):
            a = _attention(arch, lid, hq, hkv, bias or arch == "qwen2")
            qkv = a.qkv_proj
            for shard, name in (("q", "q"), ("k", "k"), ("v", "v")):
                qkv.weight_loader(qkv.weight, w[name], shard)
                if qkv.bias is not None:
                    qkv.weight_loader(qkv.bias, w[name + "b"], shard)
            a.o_proj.weight_loader(a.o_proj.weight, w["o"])
            if arch == "qwen3":
                a.q_norm.weight.data.copy_(w["qn"])
                a.k_norm.weight.data.copy_(w["kn"])
            a.attn = _SDPA(lid, a.num_heads, a.num_kv_heads)
            a.o_proj.forward = _no_reduce(a.o_proj)
            blocks.append(a)
    model = type(ARCH[arch], (torch.nn.Module,), {})()
    model.layers, model.start_layer, model.end_layer = blocks, 0, LAYERS
    return model


def _run(model, x):
    """Every layer's block output for the same input (independent blocks: enough to test each)."""
    pos = torch.arange(x.shape[0])
    with torch.no_grad():
        return [blk(pos, x, None) for blk in model.layers]


def _bundle_file(tmp_path, hkv, per_head, gen):
    eye = torch.eye(D).expand(LAYERS, 1, D, D).clone()
    heads = hkv if per_head else 1
    tv = torch.stack([torch.stack([_orth(D, gen) for _ in range(heads)]) for _ in range(LAYERS)])
    ones = torch.ones(LAYERS)
    b = RotationBundle(eye, tv, ones, ones.clone(), 64, 64, 2, hkv, method="test")
    return save_bundle(b, tmp_path / "rot.safetensors"), tv


def _runner(model, arch, hq, hkv, **sa):
    hf = types.SimpleNamespace(architectures=[ARCH[arch]], num_hidden_layers=LAYERS, num_attention_heads=hq,
                               num_key_value_heads=hkv, head_dim=D, hidden_size=HIDDEN)
    mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, head_dim=D, v_head_dim=D)
    args = dict(kv_cache_dtype="int2", weight_cache_mode="off", cpu_offload_gb=0, offload_group_size=-1,
                quantization=None)
    return types.SimpleNamespace(model=model, model_config=mc, is_draft_worker=False,
                                 server_args=types.SimpleNamespace(**{**args, **sa}))


@pytest.fixture
def oscar_env(monkeypatch):
    for name in options.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,hq,hkv", [(1, 4, 4), (1, 8, 2), (2, 4, 2), (2, 8, 2), (2, 4, 1), (4, 8, 2)])
@pytest.mark.parametrize("per_head,bias", [(False, False), (True, True)])
def test_hook_absorption_leaves_block_output_unchanged(oscar_env, tmp_path, arch, tp, hq, hkv, per_head, bias):
    gen = torch.Generator().manual_seed(tp * 100 + hq * 10 + hkv + 1000 * per_head)
    weights = _full_weights(hq, hkv, True, gen)
    path, tv = _bundle_file(tmp_path, hkv, per_head, gen)
    oscar_env.setenv(options.ENV_BUNDLE, str(path))  # SGLANG_OSCAR_ABSORB_V_ROTATION unset: on by default
    x = torch.randn(9, HIDDEN, generator=gen)
    want, got = None, None
    for r in range(tp):
        model = _rank_model(arch, weights, hq, hkv, bias, r, tp)
        with _as_rank(r, tp):
            before = _run(model, x)
            v_before = [blk.attn.seen_v for blk in model.layers]
            assert hooks.load_model_after(None, _runner(model, arch, hq, hkv)) is None
            after = _run(model, x)
        rec = getattr(model, ABSORB_ATTR)
        kv0, kv1 = kv_head_range(r, tp, hkv)
        assert rec.layers == (0, 1) and (rec.kv_start, rec.kv_end) == (kv0, kv1)
        for lid, blk in enumerate(model.layers):  # what the pool receives: v·T_V of this rank's KV heads
            t = tv[lid] if tv.shape[1] == 1 else tv[lid, kv0:kv1]
            t = t.expand(kv1 - kv0, D, D)
            torch.testing.assert_close(blk.attn.seen_v, torch.einsum("thd,hde->the", v_before[lid], t),
                                       rtol=1e-5, atol=1e-5)
        want = before if want is None else [a + b for a, b in zip(want, before)]  # the all-reduce
        got = after if got is None else [a + b for a, b in zip(got, after)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_hook_is_a_noop_unless_int2_with_absorption(oscar_env, tmp_path):
    gen = torch.Generator().manual_seed(5)
    path, _ = _bundle_file(tmp_path, 2, False, gen)
    oscar_env.setenv(options.ENV_BUNDLE, str(path))
    weights = _full_weights(4, 2, False, gen)

    def untouched(**kw):
        model = _rank_model("qwen3", weights, 4, 2, False, 0, 1)
        w = model.layers[0].qkv_proj.weight.clone()
        runner = _runner(model, "qwen3", 4, 2, **kw.pop("sa", {}))
        for k, v in kw.items():
            setattr(runner, k, v)
        hooks.load_model_after(None, runner)
        return torch.equal(model.layers[0].qkv_proj.weight, w) and getattr(model, ABSORB_ATTR, None) is None

    assert untouched(sa=dict(kv_cache_dtype="auto"))  # stock server: never touch the weights
    assert untouched(is_draft_worker=True)
    oscar_env.setenv(options.ENV_ABSORB_V, "0")
    assert untouched()  # runtime V rotation
    oscar_env.delenv(options.ENV_ABSORB_V)
    assert not untouched()


def test_hook_refuses_unsupported_models_and_options(oscar_env, tmp_path):
    gen = torch.Generator().manual_seed(6)
    path, _ = _bundle_file(tmp_path, 2, False, gen)
    oscar_env.setenv(options.ENV_BUNDLE, str(path))
    model = _rank_model("llama", _full_weights(4, 2, False, gen), 4, 2, False, 0, 1)
    other = type("Phi3ForCausalLM", (torch.nn.Module,), {})()  # a Llama subclass in SGLang, not absorbed
    other.layers, other.start_layer, other.end_layer = model.layers, 0, LAYERS
    with pytest.raises(options.OscarOptionError, match="Phi3ForCausalLM.*SGLANG_OSCAR_ABSORB_V_ROTATION=0"):
        hooks.load_model_after(None, _runner(other, "llama", 4, 2))
    with pytest.raises(options.OscarOptionError, match="cpu-offload-gb"):
        hooks.load_model_after(None, _runner(model, "llama", 4, 2, cpu_offload_gb=2))
    runner = _runner(model, "llama", 4, 2)
    runner.model_config.hf_config.architectures = ["MistralForCausalLM"]  # HF arch checked too (plan_rank)
    with pytest.raises(options.OscarOptionError, match="MistralForCausalLM"):
        hooks.load_model_after(None, runner)
    assert getattr(model, ABSORB_ATTR, None) is None


def test_weight_updates_and_exports_refused_while_v_is_absorbed(oscar_env, tmp_path):
    """Loading new weights would undo the absorption on some or all layers (V stored un-rotated or
    half-rotated) and an export would write rotated weights as if they were the model: both answer
    with a failure naming the option, instead of silently changing outputs."""
    from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from sglang_oscar.srt import plugin

    plugin.register()  # applies the hooks (idempotent)
    gen = torch.Generator().manual_seed(8)
    path, _ = _bundle_file(tmp_path, 2, False, gen)
    oscar_env.setenv(options.ENV_BUNDLE, str(path))
    model = _rank_model("qwen3", _full_weights(4, 2, False, gen), 4, 2, False, 0, 1)
    updater = types.SimpleNamespace(get_model=lambda: model, device="cpu", tp_rank=0,
                                    _assert_weight_cache_inactive=lambda op: None)
    assert WeightUpdater.update_weights_from_tensor(updater, [], load_format="direct") == (True, "Success")
    with _as_rank(0, 1):
        hooks.load_model_after(None, _runner(model, "qwen3", 4, 2))
    ok, msg = WeightUpdater.update_weights_from_tensor(updater, [], load_format="direct")
    assert not ok and "SGLANG_OSCAR_ABSORB_V_ROTATION=0" in msg and "update_weights_from_tensor" in msg
    ok, msg = WeightUpdater.update_weights_from_disk(updater, "/nowhere", "auto")
    assert not ok and "absorbed V rotation" in msg
    exporter = types.SimpleNamespace(get_model=lambda: model)
    with pytest.raises(RuntimeError, match="save_sharded_model refused.*exported checkpoint"):
        WeightExporter.save_sharded_model(exporter, str(tmp_path / "out"))


# ---- real CPU server: absorbed vs runtime V rotation (slow) ---------------------------------------

def _generate(srv, ids, n):
    import json
    import urllib.request

    body = json.dumps({"input_ids": ids, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": n, "temperature": 0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _server_bundle(path, gen):
    """Random orthogonal K and per-KV-head V transforms for the tiny model (2 layers, 2 KV heads,
    head_dim 64). Not Hadamard: a Hadamard matrix is symmetric, so T and Tᵀ mix-ups would not show."""
    kt = torch.stack([torch.stack([_orth(64, gen)]) for _ in range(2)])
    vt = torch.stack([torch.stack([_orth(64, gen) for _ in range(2)]) for _ in range(2)])
    ones = torch.ones(2)
    return save_bundle(RotationBundle(kt, vt, ones, ones.clone(), 64, 64, 2, 2, method="test"), path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2"])
def test_cpu_server_absorbed_v_equals_runtime_v_rotation(arch, tmp_path):
    """Two oscar_int2 servers on the same tiny model and bundle, S=4 and W=16: one rotates V in the
    write kernel and un-rotates the output (ABSORB=0), the other has T_V folded into the weights
    (ABSORB=1, the default). Qwen2 only: its qkv_proj has a bias, which absorption must rotate too, so it is the
    architecture with the most to get wrong; every architecture's absorbed block is checked against the runtime
    rotation above (test_hook_absorption_leaves_block_output_unchanged), and the Qwen3 servers of
    test_srt_server_sglang.py run absorbed against an unrotated HF reference. An 8-token prompt + 12 tokens stays inside sink + ring (exact), 40- and
    100-token prompts read INT2 history. Absorption only moves where v·T_V is computed (same fp32
    math, other rounding), so the greedy tokens must agree and the logprobs nearly so."""
    import random
    import runpy

    from test_srt_plugin import _REPO, _Server

    make = runpy.run_path(str(_REPO / "scripts" / "make_tiny_model.py"))["make_tiny_model"]
    model = make(tmp_path / f"tiny_{arch}", arch=arch)
    bundle = _server_bundle(tmp_path / "rot.safetensors", torch.Generator().manual_seed(1))
    env = {options.ENV_BUNDLE: str(bundle), options.ENV_HP_DTYPE: "float32", options.ENV_PREFIX: "4",
           options.ENV_RECENT: "16"}
    flags = ("--attention-backend", "oscar_int2", "--dtype", "float32", "--kv-cache-dtype", "int2",
             "--max-running-requests", "4")
    runtime = _Server(model, tmp_path / "runtime.log", *flags, env={**env, options.ENV_ABSORB_V: "0"})
    absorbed = _Server(model, tmp_path / "absorbed.log", *flags, env=env)  # default: absorbed
    try:
        runtime.wait_ready(600)
        absorbed.wait_ready(600)
        assert "V rotation absorbed into qkv_proj/o_proj of layers 0..1" in absorbed.text()
        assert "V rotation absorbed" not in runtime.text()
        rnd = random.Random(0)
        # Inside the windows the two differ by fp32 rounding only (measured <= 2e-6). With INT2 history a
        # v element within rounding of a code boundary can flip its 2-bit code: measured <= 3.4e-6 for
        # Qwen3/Llama, 8.7e-3 for Qwen2 at 100 tokens. A wrong absorption is off by O(1).
        for n_prompt, tol in ((8, 1e-4), (40, 5e-2), (100, 5e-2)):
            prompt = [rnd.randrange(3, 1024) for _ in range(n_prompt)]
            want_ids, want_lp = _generate(runtime, prompt, 12)
            got_ids, got_lp = _generate(absorbed, prompt, 12)
            diff = max(abs(a - b) for a, b in zip(got_lp, want_lp))
            print(f"{arch} prompt {n_prompt}: max |logprob diff| {diff:.2e}")
            assert got_ids == want_ids, (arch, n_prompt, got_ids, want_ids)
            assert diff <= tol, (arch, n_prompt, diff)
    finally:
        absorbed.stop()
        runtime.stop()
