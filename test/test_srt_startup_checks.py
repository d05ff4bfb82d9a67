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


def test_plan_builtin_and_tp_shard():
    plan = s.plan_rank(cfg(k_clip=0.9), dataclasses.replace(QWEN3, tp_size=2), tp_rank=1)
    assert (plan.kv_start, plan.kv_end, plan.k_group, plan.v_group) == (4, 8, 64, 64)
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


def test_every_rank_is_sized_for_the_rank_with_the_most_int4_key_heads(tmp_path):
    """INT4 keys on (layer, KV head) (0, 1), (1, 2), (2, 6), (3, 1): heads 0-3 hold 3 of them at TP 2, heads 4-7 one;
    both ranks' plans carry 3, and their bundle shards their own heads' widths; with one KV head per rank (TP 16) the
    most is 2 (head 1)."""
    pairs = [(0, 1), (1, 2), (2, 6), (3, 1)]
    p = save_bundle(data_free_bundle("hadamard", 4, 8, 128, 64, 64, k4_heads=pairs), tmp_path / "k4.safetensors")
    tp2 = [s.plan_rank(cfg(bundle_path=str(p)), dataclasses.replace(QWEN3, tp_size=2), tp_rank=r) for r in (0, 1)]
    assert [pl.k4_heads_max for pl in tp2] == [3, 3]
    assert [pl.bundle.k4_count for pl in tp2] == [3, 1] and tp2[1].bundle.k4_heads(2) == (2,)
    tp16 = dataclasses.replace(QWEN3, num_heads=64, tp_size=16)
    assert s.plan_rank(cfg(bundle_path=str(p)), tp16, tp_rank=0).k4_heads_max == 2
    assert s.plan_rank(cfg(), QWEN3).k4_heads_max == 0  # builtin: INT2 keys everywhere


def test_seed_files(tmp_path):
    h = data_free_bundle("hadamard", 4, 1, 128, 128, 128).k_transform[:, 0]
    for side in ("k", "v"):
        torch.save({"format_version": 1, "layers": {i: {"rotation": h[i]} for i in range(4)}}, tmp_path / f"{side}.pt")
    c = cfg(bundle_path=None, k_rotation_path=str(tmp_path / "k.pt"), v_rotation_path=str(tmp_path / "v.pt"))
    plan = s.plan_rank(c, dataclasses.replace(QWEN3, tp_size=4), tp_rank=3)
    assert plan.k_group == 64 and plan.kv_heads_local == 2  # the default group at every head_dim: 64
    with pytest.raises(BundleError, match="layers"):
        s.plan_rank(c, dataclasses.replace(QWEN3, num_layers=5))


def test_group_and_shape_limits():
    with pytest.raises(o.OscarOptionError, match="--kv-cache-quant-group-size 128 is larger than head_dim 64"):
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


def test_one_definition_of_the_shape_rules():
    """MAX_GQA and the group rules come from config.py (kernels/shapes.py adds the CUDA paths'), imported, not copied."""
    from sglang_oscar import config
    from sglang_oscar.kernels import history_cuda, shapes

    assert s.MAX_GQA is config.MAX_GQA and shapes.MAX_GQA is config.MAX_GQA
    assert history_cuda.HEAD_DIMS == tuple(shapes.CUDA_HISTORY_GROUPS)
    decode = pytest.importorskip("sglang_oscar.kernels.decode")
    assert decode.MAX_GQA is config.MAX_GQA


@pytest.mark.parametrize("head_dim,group", [(64, 64), (128, 64), (256, 64)])
def test_default_group_per_head_dim(head_dim, group):
    """The default group (no flag, builtin or seed rotations) is 64 at every supported head_dim: the published
    configuration (2.5 bits/element), and head_dim 256 starts with it (not 256, which no kernel takes)."""
    from sglang_oscar.config import default_group

    assert default_group(head_dim) == group
    model = dataclasses.replace(QWEN3, head_dim=head_dim, num_heads=16, kv_heads=8)
    plan = s.plan_rank(cfg(), model)  # builtin:hadamard, no --kv-cache-quant-group-size
    assert (plan.k_group, plan.v_group) == (group, group)
    assert cfg().resolve_group(head_dim) == group
    with pytest.raises(ValueError, match="head_dim 96"):
        default_group(96)


def test_head_dim_256_default_group_serves_with_the_kernels():
    """A head_dim-256 model with the default group runs a supported kernel path end to end on the CPU: the pool
    layout and the Triton decode take its groups at D 256."""
    from sglang_oscar.config import default_group
    from sglang_oscar.kernels.layout import LayerCache

    g = default_group(256)
    cache = LayerCache.empty(16, 1, 256, k_group=g, v_group=g, device="cpu")
    cache.validate()
    path = s.decode_path(head_dim=256, q_heads=8, kv_heads=1, k_group=g, v_group=g,
                         window_dtype=torch.bfloat16, x_dtype=torch.bfloat16, device="cpu", page_size=None)
    assert path.history == "triton" and path.page_size == 1


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


# ---- the decode path (decode_path): no option, the fastest the shape supports on the device -------------

QWEN3_8B_RANK = dict(head_dim=128, q_heads=32, kv_heads=8, k_group=128, v_group=128, window_dtype=torch.bfloat16,
                     x_dtype=torch.bfloat16)


@pytest.fixture
def hopper(monkeypatch):
    """A mocked H100 (sm_90) behind torch.cuda.get_device_capability, and nvcc found."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return monkeypatch


def test_decode_path_hopper_supported_shape_takes_cuda_and_page_64(hopper):
    path = s.decode_path(**QWEN3_8B_RANK, device="cuda", page_size=None, nvcc=True)
    assert (path.history, path.write, path.page_size) == ("cuda", "cuda", 64)
    line = path.line()
    assert line == ("decode: CUDA history stage and CUDA KV write up to 8 tokens, page size 64 (Hopper sm_90, "
                    "head_dim 128, GQA 4, groups 128/128)"), line
    # SmolLM2 (head_dim 64): the CUDA history, the Triton write (the CUDA write covers head_dim 128), page 64
    path = s.decode_path(**{**QWEN3_8B_RANK, "head_dim": 64, "q_heads": 9, "kv_heads": 3, "k_group": 64,
                            "v_group": 64}, device="cuda:0", page_size=None, nvcc=True)
    assert (path.history, path.write, path.page_size) == ("cuda", "triton", 64)
    assert "Triton KV write (the CUDA write covers head_dim 128" in path.line()
    # an explicit page size of at least 64 is kept
    assert s.decode_path(**QWEN3_8B_RANK, device="cuda", page_size=128, nvcc=True).page_size == 128


@pytest.mark.parametrize("change,why", [
    (dict(device="cpu"), "it needs an NVIDIA GPU, this server runs on cpu"),
    (dict(head_dim=256), "it covers head_dim 128 with K/V groups 64 or 128"),
    (dict(k_group=32, v_group=32), "groups 32/32"),
    (dict(q_heads=136), "GQA 17"),
    (dict(window_dtype=torch.float16), "this window is torch.float16"),
    (dict(page_size=16), "--page-size 16 kept; it needs pages of 64 (drop --page-size to get them)"),
    (dict(page_size=1), "--page-size 1 kept"),
    (dict(page_refusal="--kv-canary hash reads one row per slot"), "--kv-canary hash reads one row per slot, and it"),
    (dict(nvcc=False), "nvcc, which is not on PATH"),
])
def test_decode_path_falls_back_to_triton_and_says_why(hopper, change, why):
    kw = {**QWEN3_8B_RANK, "device": "cuda", "page_size": None, "nvcc": True, **change}
    path = s.decode_path(**kw)
    assert path.history == path.write == "triton"
    assert path.page_size == (change.get("page_size") or 1)  # the user's page size, else SGLang's 1
    line = path.line()
    assert line.startswith(f"decode: Triton history and KV write, page size {path.page_size} (no CUDA history "
                           "stage: ") and why in line, line
    assert "\n" not in line


def test_decode_path_other_gpus_keep_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    path = s.decode_path(**QWEN3_8B_RANK, device="cuda", page_size=None, nvcc=True)
    assert path.history == "triton" and "built and measured for Hopper GPUs (sm_90), this GPU is sm_80" in path.line()
    with pytest.raises(o.OscarOptionError, match="not a multiple"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        s.decode_path(**{**QWEN3_8B_RANK, "q_heads": 30}, device="cuda", page_size=None, nvcc=True)


def test_build_cuda_path_falls_back_with_the_reason(hopper):
    """A CUDA path whose build fails becomes the Triton path whose line names the failure (the backend logs it as a
    warning): never a silent fallback. A CUDA write that fails to build leaves the CUDA history stage."""
    from sglang_oscar.kernels import cuda_build, history_cuda, write_cuda

    path = s.decode_path(**QWEN3_8B_RANK, device="cuda", page_size=None, nvcc=True)

    def fail():
        raise cuda_build.CudaUnavailable("nvcc failed to build int2_history.cu:\nerror")

    hopper.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    hopper.setattr(history_cuda, "library", fail)
    got = s.build_cuda_path(path, "cuda")
    assert (got.history, got.page_size) == ("triton", 64)
    assert "no CUDA history stage: its build failed: nvcc failed to build int2_history.cu:" in got.line()
    hopper.setattr(history_cuda, "library", lambda: None)
    hopper.setattr(write_cuda, "library", fail)
    got = s.build_cuda_path(path, "cuda")
    assert (got.history, got.write) == ("cuda", "triton") and "its build failed" in got.line()
    hopper.setattr(write_cuda, "library", lambda: None)
    assert s.build_cuda_path(path, "cuda") is path
    triton = s.decode_path(**QWEN3_8B_RANK, device="cpu", page_size=None)
    assert s.build_cuda_path(triton, "cpu") is triton


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc)")
def test_decode_path_real_build_on_gpu():
    """On a GPU: the real choice, and on Hopper with nvcc the real build (cached once built)."""
    path = s.build_cuda_path(s.decode_path(**QWEN3_8B_RANK, device="cuda", page_size=None), "cuda")
    if torch.cuda.get_device_capability()[0] != 9:
        assert path.history == "triton"
        return
    if path.history == "triton":
        pytest.skip(f"no CUDA toolkit here: {path.line()}")
    from sglang_oscar.kernels import history_cuda

    assert path.page_size == 64 and history_cuda.library() is history_cuda.library()


# ---- the launcher's choice (hooks.from_cli_args_after -> _choose_decode_path) ------------------------------------

class _FakeServerArgs:
    """What the launcher's hook reads of SGLang's ServerArgs, with its one audited setter (override)."""

    def __init__(self, model_config, **kw):
        self.model_config = model_config
        self.tp_size, self.dp_size, self.enable_dp_attention = 1, 1, False
        self.device, self.base_gpu_id, self.page_size = "cuda", 0, 1
        self.kv_canary, self.chunked_prefill_size = "none", 8192
        self.overrides = []
        self.__dict__.update(kw)

    def override(self, source, **fields):
        self.overrides.append((source, fields))
        self.__dict__.update(fields)


class _FakeModelConfig:
    def __init__(self, head_dim=128, heads=32, kv_heads=8, layers=4):
        import types

        self.hf_config = self.hf_text_config = types.SimpleNamespace(
            architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim)
        self.head_dim = self.v_head_dim = head_dim
        self.dtype = torch.bfloat16


@pytest.mark.parametrize("user_page,extra,want_page,history", [
    (None, {}, 64, "cuda"),  # no --page-size: the fast path's 64
    (128, {}, 128, "cuda"),  # the user's, usable: kept
    (16, {}, 16, "triton"),  # the user's, too small: kept, and said
    (None, {"kv_canary": "hash"}, 1, "triton"),  # pages of 1 needed elsewhere: said
    (None, {"chunked_prefill_size": 1000}, 1, "triton"),
])
def test_launcher_picks_cuda_and_page_64_on_hopper_without_any_variable(monkeypatch, caplog, user_page, extra,
                                                                        want_page, history):
    """With no variable set and only --kv-cache-dtype int2, on a (mocked) H100 with a shape the CUDA stage covers
    (Qwen3-8B), the launcher's hook sets --page-size 64 and logs one line naming the CUDA history stage; an explicit
    --page-size is kept (with the reason where the CUDA stage cannot use it)."""
    import types

    from sglang_oscar.kernels import cuda_build
    from sglang_oscar.srt import hooks

    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(o.ENV_BUNDLE, "builtin:hadamard")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cuda_build, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    sa = _FakeServerArgs(_FakeModelConfig(), page_size=user_page or 1, **extra)
    with caplog.at_level("INFO", logger="sglang_oscar.srt.hooks"):
        hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=user_page), o.current())
    assert sa.page_size == want_page
    assert sa.overrides == ([("sglang_oscar", {"page_size": 64})] if want_page == 64 and user_page is None else [])
    lines = [r.getMessage() for r in caplog.records if "decode:" in r.getMessage()]
    assert len(lines) == 1 and lines[0] == "sglang_oscar: " + getattr(sa, hooks.DECODE_LINE_ATTR)
    want_group = 64  # config.default_group: no flag, builtin rotation
    if history == "cuda":
        assert lines[0].startswith(f"sglang_oscar: decode: CUDA history stage and CUDA KV write up to 8 tokens, page "
                                   f"size {want_page} (Hopper sm_90, head_dim 128, GQA 4, groups {want_group}/{want_group})")
    else:
        assert lines[0].startswith(f"sglang_oscar: decode: Triton history and KV write, page size {want_page} (no CUDA "
                                   "history stage: ")
        why = {16: "--page-size 16 kept"}.get(user_page) or ("--kv-canary hash" if extra.get("kv_canary") else
                                                             "--chunked-prefill-size 1000 is not a multiple of 64")
        assert why in lines[0]


def test_launcher_keeps_triton_on_cpu_and_other_shapes(monkeypatch, caplog):
    """No GPU, or a shape the CUDA stage does not cover (head_dim 256 with its default group 128): Triton on page 1,
    and the line says why."""
    import types

    from sglang_oscar.srt import hooks

    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(o.ENV_BUNDLE, "builtin:hadamard")
    sa = _FakeServerArgs(_FakeModelConfig(), device="cpu")
    hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=None), o.current())
    assert sa.page_size == 1 and not sa.overrides and "this server runs on cpu" in getattr(sa, hooks.DECODE_LINE_ATTR)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    sa = _FakeServerArgs(_FakeModelConfig(head_dim=256, heads=16, kv_heads=8))
    hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=None), o.current())
    line = getattr(sa, hooks.DECODE_LINE_ATTR)
    assert sa.page_size == 1 and "this is head_dim 256, GQA 2, groups 64/64" in line, line


def test_launcher_refuses_a_base_gpu_id_past_the_visible_gpus(monkeypatch):
    """--base-gpu-id indexes the visible GPUs (SGLang's schedulers index them with it too): one past them is a one-line
    error, not a probe of GPU 0."""
    import types

    from sglang_oscar.srt import hooks

    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(o.ENV_BUNDLE, "builtin:hadamard")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    sa = _FakeServerArgs(_FakeModelConfig(), base_gpu_id=2)
    with pytest.raises(o.OscarOptionError, match=r"^--base-gpu-id 2 names no GPU: 2 are visible here; pass one below 2$"):
        hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=None), o.current())


def test_launcher_refuses_a_bad_bundle_before_loading(monkeypatch, tmp_path):
    """hooks._choose_decode_path runs int2_setup.check_before_load first: the bundle against the model's config, for
    every TP rank, before anything is spawned or loaded (the hook turns the error into one line and status 1)."""
    import types

    from sglang_oscar.srt import hooks

    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    p = save_bundle(data_free_bundle("hadamard", 3, 8, 128, 64, 64), tmp_path / "b.safetensors")
    monkeypatch.setenv(o.ENV_BUNDLE, str(p))
    sa = _FakeServerArgs(_FakeModelConfig(), device="cpu")
    with pytest.raises(BundleError, match="3 layers but the model has 4"):
        hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=None), o.current())
    sa = _FakeServerArgs(_FakeModelConfig(), device="cpu", tp_size=3)
    monkeypatch.setenv(o.ENV_BUNDLE, "builtin:hadamard")
    with pytest.raises(o.OscarOptionError, match="8 KV heads do not split evenly over tp_size 3"):
        hooks._choose_decode_path(sa, types.SimpleNamespace(page_size=None), o.current())
