"""srt/startup_checks.py: bundle vs model / TP / group size, and which models V absorption knows."""

import dataclasses

import pytest
import torch

from sglang_oscar.rotation.bundle import BundleError, data_free_bundle, save_bundle
from sglang_oscar.srt import options as o
from sglang_oscar.srt import startup_checks as s

QWEN3 = s.ModelInfo("Qwen3ForCausalLM", num_layers=4, num_heads=32, kv_heads=8, head_dim=128)


def cfg(**kw):
    return dataclasses.replace(o.OscarServeConfig(bundle_path="builtin:hadamard"), **kw)


def test_kv_head_range_matches_qkv_parallel_linear():
    assert [s.kv_head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [s.kv_head_range(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4  # replicas
    with pytest.raises(o.OscarOptionError):
        s.kv_head_range(0, 3, 8)


def test_plan_builtin_and_tp_shard():
    plan = s.plan_rank(cfg(k_clip=0.9), dataclasses.replace(QWEN3, tp_size=2), tp_rank=1)
    assert (plan.kv_start, plan.kv_end, plan.k_group, plan.v_group) == (4, 8, 128, 128)
    assert torch.all(plan.bundle.k_clip == 0.9) and torch.all(plan.bundle.v_clip == 1.0)


def test_bundle_file_checked_against_model(tmp_path):
    p = save_bundle(data_free_bundle("hadamard", 4, 8, 128, 64, 64), tmp_path / "b.safetensors")
    plan = s.plan_rank(cfg(bundle_path=str(p)), QWEN3)
    assert plan.k_group == 64
    with pytest.raises(BundleError, match="4 layers but the model has 6"):
        s.plan_rank(cfg(bundle_path=str(p)), dataclasses.replace(QWEN3, num_layers=6))
    with pytest.raises(BundleError, match="KV heads"):
        s.plan_rank(cfg(bundle_path=str(p)), dataclasses.replace(QWEN3, kv_heads=4, num_heads=16))
    with pytest.raises(o.OscarOptionError, match="fitted for groups K=64"):
        s.plan_rank(cfg(bundle_path=str(p), group_size=128), QWEN3)


def test_seed_files(tmp_path):
    h = data_free_bundle("hadamard", 4, 1, 128, 128, 128).k_transform[:, 0]
    for side in ("k", "v"):
        torch.save({"format_version": 1, "layers": {i: {"rotation": h[i]} for i in range(4)}}, tmp_path / f"{side}.pt")
    c = cfg(bundle_path=None, k_rotation_path=str(tmp_path / "k.pt"), v_rotation_path=str(tmp_path / "v.pt"))
    plan = s.plan_rank(c, dataclasses.replace(QWEN3, tp_size=4), tp_rank=3)
    assert plan.k_group == 128 and plan.kv_heads_local == 2  # seed default group = head_dim
    with pytest.raises(BundleError, match="layers"):
        s.plan_rank(c, dataclasses.replace(QWEN3, num_layers=5))


def test_group_and_shape_limits():
    with pytest.raises(o.OscarOptionError, match="larger than the model's head_dim"):
        s.plan_rank(cfg(group_size=128), dataclasses.replace(QWEN3, head_dim=64))
    with pytest.raises(ValueError, match="head_dim 96"):
        s.plan_rank(cfg(), dataclasses.replace(QWEN3, head_dim=96))
    with pytest.raises(o.OscarOptionError, match="at most 16"):
        s.plan_rank(cfg(), dataclasses.replace(QWEN3, num_heads=72, kv_heads=4))


def test_v_absorption_architectures():
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        s.plan_rank(cfg(), dataclasses.replace(QWEN3, architecture=arch))
    gemma = dataclasses.replace(QWEN3, architecture="Gemma2ForCausalLM")
    with pytest.raises(o.OscarOptionError, match="SGLANG_OSCAR_ABSORB_V_ROTATION=0"):
        s.plan_rank(cfg(), gemma)
    s.plan_rank(cfg(absorb_v_rotation=False), gemma)  # runtime V rotation is allowed


def test_model_info_from_hf_config():
    class C:
        architectures = ["Qwen3ForCausalLM"]
        num_attention_heads, num_key_value_heads, num_hidden_layers, hidden_size, head_dim = 32, 8, 36, 4096, 128

    assert s.ModelInfo.from_hf_config(C, tp_size=2) == s.ModelInfo("Qwen3ForCausalLM", 36, 32, 8, 128, 2)


def test_max_gqa_matches_decode_kernel():
    decode = pytest.importorskip("sglang_oscar.kernels.decode")
    assert decode.MAX_GQA == s.MAX_GQA


def test_v_absorption_checks_only_the_v_transform(tmp_path):
    """A bundle marked non-orthogonal because of its K transform (method "balanced") is served with V
    absorbed (T_q = T_K^-T takes care of K); a non-orthogonal V is refused with a message naming V."""
    b = data_free_bundle("hadamard", 4, 8, 128, 64, 64)
    scale = torch.linspace(0.5, 2.0, 128)
    k_bad = dataclasses.replace(b, k_transform=b.k_transform * scale, orthogonal=False)
    plan = s.plan_rank(cfg(bundle_path=str(save_bundle(k_bad, tmp_path / "k.safetensors"))), QWEN3)
    assert plan.k_group == 64
    v_bad = dataclasses.replace(b, v_transform=b.v_transform * scale, orthogonal=False)
    p = save_bundle(v_bad, tmp_path / "v.safetensors")
    with pytest.raises(o.OscarOptionError, match="V transforms have max"):
        s.plan_rank(cfg(bundle_path=str(p)), QWEN3)
    assert s.plan_rank(cfg(bundle_path=str(p), absorb_v_rotation=False), QWEN3).k_group == 64


# ---- SGLANG_OSCAR_HISTORY_KERNEL at startup (check_history_kernel) ---------------------------------

QWEN3_8B_RANK = dict(head_dim=128, q_heads=32, kv_heads=8, k_group=64, v_group=64, codebook=False, page_size=64)


def test_history_kernel_triton_checks_nothing(monkeypatch):
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "library", lambda: pytest.fail("triton must not build the CUDA kernel"))
    s.check_history_kernel("triton", **{**QWEN3_8B_RANK, "head_dim": 64}, device="cpu")


def test_history_kernel_cuda_refused_on_cpu(monkeypatch):
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "library", lambda: pytest.fail("no build on a CPU server"))
    with pytest.raises(o.OscarOptionError, match="this server runs on cpu: set SGLANG_OSCAR_HISTORY_KERNEL=triton"):
        s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cpu")
    with pytest.raises(o.OscarOptionError, match="use triton or cuda"):
        s.check_history_kernel("cutlass", **QWEN3_8B_RANK, device="cpu")


@pytest.mark.parametrize("change,named", [
    (dict(head_dim=256), "head_dim 256"),                     # (SmolLM2's head_dim 64: covered since 4dda357)
    (dict(q_heads=136), "GQA 17"),                            # 136 query heads per 8 KV heads (GLM's 12: covered)
    (dict(k_group=32, v_group=32), "groups K=32 V=32"),
    (dict(v_group=32), "groups K=64 V=32"),
    (dict(codebook=True), "codebook"),
])
def test_history_kernel_cuda_refuses_shapes_it_does_not_cover(monkeypatch, change, named):
    """Shapes are checked before the device: on a CPU machine device='cuda' reaches the shape check only."""
    from sglang_oscar.kernels import history_cuda

    monkeypatch.setattr(history_cuda, "library", lambda: pytest.fail("no build for an unsupported shape"))
    with pytest.raises(o.OscarOptionError) as e:
        s.check_history_kernel("cuda", **{**QWEN3_8B_RANK, **change}, device="cuda")
    msg = str(e.value)
    assert named in msg and "set SGLANG_OSCAR_HISTORY_KERNEL=triton" in msg, msg
    assert "history_kernel='cuda' covers" in msg and "--kv-cache-quant-group-size" in msg, msg  # the kernel's reason


def test_history_kernel_cuda_builds_at_startup_and_warns_below_page_64(monkeypatch, caplog):
    """With the shape and device accepted (stubbed on CPU), the kernel is built here, once per call; a
    failed build names nvcc and the way out; --page-size < 64 is served with a warning."""
    import logging

    from sglang_oscar.kernels import history_cuda

    checked, built = [], []
    real_check = history_cuda.check_supported
    monkeypatch.setattr(history_cuda, "check_supported", lambda *a, **k: checked.append(a + (k,)))
    monkeypatch.setattr(history_cuda, "library", lambda: built.append(1))
    with caplog.at_level(logging.WARNING, logger="sglang_oscar.srt.startup_checks"):
        s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cuda")
    assert len(built) == 1 and checked[0][:5] == (128, 4, 64, 64, False) and not caplog.records  # GQA 32 / 8
    assert checked[0][-1] == {"window_dtype": torch.bfloat16}
    with caplog.at_level(logging.WARNING, logger="sglang_oscar.srt.startup_checks"):
        s.check_history_kernel("cuda", **{**QWEN3_8B_RANK, "page_size": 1}, device="cuda")
    assert len(built) == 2 and "measured (and is fast) with --page-size 64" in caplog.text

    def no_nvcc():
        raise history_cuda.CudaHistoryUnavailable("nvcc was not found")

    monkeypatch.setattr(history_cuda, "library", no_nvcc)
    with pytest.raises(o.OscarOptionError, match="nvcc was not found.*install the CUDA toolkit.*=triton"):
        s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cuda")
    with pytest.raises(o.OscarOptionError, match="not a multiple"):
        s.check_history_kernel("cuda", **{**QWEN3_8B_RANK, "q_heads": 30}, device="cuda")
    # the real shape check: a float16 window is refused before the device is looked at (the window CTAs read BF16)
    monkeypatch.setattr(history_cuda, "check_supported", real_check)
    with pytest.raises(o.OscarOptionError, match="window torch.float16.*rows as BF16 in its window CTAs.*=triton"):
        s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cuda", window_dtype=torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc)")
def test_history_kernel_cuda_real_build_on_gpu():
    """On a GPU: the real check and nvcc build (or a clear refusal naming what to change)."""
    if torch.cuda.get_device_capability()[0] < 8:
        with pytest.raises(o.OscarOptionError, match="sm_80"):
            s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cuda")
        return
    try:
        s.check_history_kernel("cuda", **QWEN3_8B_RANK, device="cuda")
    except o.OscarOptionError as e:
        assert "nvcc" in str(e), e
        pytest.skip(f"no CUDA toolkit here: {e}")
    from sglang_oscar.kernels import history_cuda

    assert history_cuda.library() is history_cuda.library()  # built once, cached
