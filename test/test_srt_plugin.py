"""The SGLang plugin (srt/plugin.py, hooks.py, pool.py) against the real SGLang 0.5.17 modules, on CPU.

Skipped where SGLang is not installed (.venv). Runs in a venv with sglang==0.5.17 + `pip install -e . --no-deps`:
CI's .venv-serve (scripts/setup_serve.sh; scripts/test.sh part 2 runs this file there), or by hand:

    .venv-serve/bin/python -m pytest -q test/test_srt_plugin.py

SGLang is imported the way the CPU test server runs it (shared/reference/sglang-on-cpu.md, Path A):
SGLANG_USE_CPU_ENGINE=1 and our sgl_kernel stand-in (test/sglang_cpu_shim) first on sys.path, both
set before the first sglang import. No server is started here except in the `slow` test at the end.
"""

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
if not torch.cuda.is_available():  # before the first sglang import: module-level `if _is_cpu:` imports
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if _SHIM not in sys.path:
        sys.path.insert(0, _SHIM)

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.plugins.hook_registry")

from sglang_oscar.rotation.bundle import BundleError, data_free_bundle, save_bundle  # noqa: E402
from sglang_oscar.srt import capacity, hooks, options, plugin  # noqa: E402
from sglang_oscar.srt.int2_setup import build_setup, model_info, setup_for_kvc  # noqa: E402
from sglang_oscar.srt.launch import plugin_env  # noqa: E402

TINY = dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, hidden_size=256)
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, hidden_size=4096)


@pytest.fixture(scope="module")
def registered():
    plugin.register()
    return plugin


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only model directory: ServerArgs.__post_init__ reads the HF config, nothing more."""
    from transformers import Qwen3Config

    d = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3Config(vocab_size=1024, intermediate_size=512, max_position_embeddings=4096,
                **TINY).save_pretrained(d)
    return str(d)


@pytest.fixture
def int2_env(monkeypatch):
    for name in options.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(options.ENV_BUNDLE, "builtin:hadamard")
    return monkeypatch


class FakeModelConfig:
    """The part of SGLang's ModelConfig the int2 hooks read."""

    def __init__(self, **hf):
        self.hf_config = types.SimpleNamespace(**hf)
        self.hf_text_config = self.hf_config
        self.head_dim = hf["head_dim"]
        self.v_head_dim = hf["head_dim"]
        self.num_hidden_layers = hf["num_hidden_layers"]

    def get_num_kv_heads(self, tp_size):
        return max(1, self.hf_config.num_key_value_heads // tp_size)


def fake_kvc(hf=TINY, max_running_requests=4, tp=1, dp=1, dtype_str="int2"):
    layers = hf["num_hidden_layers"]
    return types.SimpleNamespace(
        kv_cache_dtype_str=dtype_str, kv_cache_dtype=torch.uint8, model_config=FakeModelConfig(**hf),
        server_args=types.SimpleNamespace(kv_cache_dtype=dtype_str, max_running_requests=max_running_requests,
                                          attention_backend="oscar_int2", dcp_size=1),
        ps=types.SimpleNamespace(attn_tp_size=tp, attn_tp_rank=0, attn_dp_size=dp),
        layer_info=types.SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers),
        use_mla_backend=False, is_hybrid_swa=False, post_capture_kv_active=False, pool_page_size=1, device="cpu")


# ---- registration and self-check -----------------------------------------------------------------

def test_hooks_applied_and_self_checked(registered):
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert plugin.check_signatures() == []
    assert plugin.missing_targets() == []
    assert set(plugin.HOOKS) <= HookRegistry._patched
    plugin.self_check()
    plugin.register()  # idempotent: a second load_plugins() in the same process changes nothing
    from sglang.srt.server_args import ServerArgs

    assert getattr(ServerArgs.add_cli_args, "__wrapped__", None) is not None


def test_self_check_names_a_missing_target(registered, monkeypatch):
    bogus = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._no_such_method"
    monkeypatch.setitem(plugin.HOOKS, bogus, ("AFTER", hooks.resolve_max_num_reqs_after, ("self",)))
    with pytest.raises(plugin.OscarPluginError) as e:
        plugin.self_check()
    assert bogus in str(e.value) and "sglang==0.5.17" in str(e.value)
    assert isinstance(e.value, SystemExit)  # load_plugins() swallows Exception, not SystemExit
    with pytest.raises(plugin.OscarPluginError):
        plugin.register()  # refuses before registering anything


def test_self_check_catches_a_changed_signature(registered, monkeypatch):
    target = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
    kind, fn, _ = plugin.HOOKS[target]
    monkeypatch.setitem(plugin.HOOKS, target, (kind, fn, ("self", "kvc", "num_layers", "renamed")))
    assert any(target in p for p in plugin.check_signatures())


# ---- CLI -----------------------------------------------------------------------------------------

_MODEL = {}


@pytest.fixture(autouse=True)
def _model_path(model_dir):
    _MODEL["path"] = model_dir


def _args(*extra):
    return ["--model-path", _MODEL["path"], "--device", "cpu", *extra]


def test_prepare_server_args_accepts_int2(registered, int2_env):
    from sglang.srt.server_args import prepare_server_args

    from sglang_oscar.srt.hooks import DECODE_LINE_ATTR

    logged = []  # (prepare_server_args resets the root logger's handlers: caplog sees nothing)
    for level in ("info", "warning"):
        int2_env.setattr(hooks.logger, level, lambda msg, *a: logged.append(msg % a))
    sa = prepare_server_args(_args("--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", "64",
                                   "--max-running-requests", "8", "--attention-backend", "oscar_int2"))
    assert sa.kv_cache_dtype == "int2"
    assert os.environ[options.ENV_GROUP] == "64"  # carried to the scheduler through the environment
    assert options.current().group_size == 64
    # a CPU server: the Triton path on SGLang's page size, named with the reason in one line, carried to the schedulers
    assert sa.page_size == 1
    line = ("decode: Triton history and KV write, page size 1 (no CUDA history stage: it needs an NVIDIA GPU, this "
            "server runs on cpu)")
    assert getattr(sa, DECODE_LINE_ATTR) == line and [m for m in logged if "decode:" in m] == [f"sglang_oscar: {line}"]
    assert prepare_server_args(_args("--kv-cache-dtype", "int2", "--max-running-requests", "8", "--attention-backend",
                                     "oscar_int2", "--page-size", "16")).page_size == 16  # the user's, kept


def test_plain_int2_command_selects_the_backend_and_leaves_r_to_the_budget(registered, int2_env):
    """`--kv-cache-dtype int2` alone: the __post_init__ hook selects oscar_int2 before SGLang picks its own default
    (the CLI and the Engine API both construct ServerArgs), and R stays unset for the pool sizing hook."""
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    sa = prepare_server_args(_args("--kv-cache-dtype", "int2"))
    assert sa.attention_backend == "oscar_int2" and sa.max_running_requests is None
    assert sa.prefill_attention_backend in (None, "oscar_int2") and sa.decode_attention_backend in (None, "oscar_int2")
    engine_style = ServerArgs(model_path=_MODEL["path"], device="cpu", kv_cache_dtype="int2")
    assert engine_style.attention_backend == "oscar_int2"
    assert ServerArgs(model_path=_MODEL["path"], device="cpu").attention_backend != "oscar_int2"  # stock: untouched


def test_int2_with_its_backend_absorbs_v_by_default(registered, int2_env):
    from sglang.srt.server_args import prepare_server_args

    args = _args("--kv-cache-dtype", "int2", "--max-running-requests", "8", "--attention-backend", "oscar_int2")
    assert prepare_server_args(args).attention_backend == "oscar_int2"
    assert options.current().absorb_v_rotation  # the default: hook #9 folds T_V into the weights
    # options under which the weights cannot be rewritten in place fail at the command line...
    with pytest.raises(options.OscarStartupError, match="cpu-offload-gb.*SGLANG_OSCAR_ABSORB_V_ROTATION=0"):
        prepare_server_args(args + ["--cpu-offload-gb", "1"])
    int2_env.setenv(options.ENV_ABSORB_V, "0")  # ...and are fine with runtime V rotation
    assert prepare_server_args(args + ["--cpu-offload-gb", "1"]).cpu_offload_gb == 1


def test_stock_dtypes_unchanged(registered, int2_env):
    from sglang.srt.server_args import prepare_server_args

    assert prepare_server_args(_args("--kv-cache-dtype", "bf16")).kv_cache_dtype == "bf16"
    assert prepare_server_args(_args()).kv_cache_dtype == "auto"
    with pytest.raises(options.OscarStartupError, match="only applies to --kv-cache-dtype int2"):
        prepare_server_args(_args("--kv-cache-quant-group-size", "64"))


@pytest.mark.parametrize("extra,match", [
    (("--attention-backend", "torch_native", "--max-running-requests", "8"), "oscar_int2"),
    (("--attention-backend", "torch_native"), "read only by --attention-backend oscar_int2 \\(got torch_native\\)"),
    (("--decode-attention-backend", "triton"), "oscar_int2 \\(got .*triton\\)"),
    (("--max-running-requests", "8", "--kv-cache-quant-group-size", "48"), "not supported"),
    (("--max-running-requests", "8", "--enable-mixed-chunk"), "enable-mixed-chunk"),
])
def test_prepare_server_args_rejects(registered, int2_env, extra, match):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(options.OscarStartupError, match=match):
        prepare_server_args(_args("--kv-cache-dtype", "int2", *extra))


def test_no_rotation_source_serves_the_zoo_bundle_else_hadamard(registered, int2_env, tmp_path, monkeypatch):
    """`--kv-cache-dtype int2` with no rotation source: the zoo's calibrated bundle for the model (matched by name, at
    the served group) when the zoo has one, else builtin:hadamard, put in the environment the schedulers inherit and
    named in one startup line; the group flag re-picks, and a source the user set is never replaced."""
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from sglang_oscar import zoo

    logged = []
    monkeypatch.setattr(hooks.logger, "info", lambda msg, *a: logged.append(msg % a))
    int2_env.delenv(options.ENV_BUNDLE)
    int2_env.setenv("SGLANG_OSCAR_ZOO", str(tmp_path / "zoo"))
    base = ("--kv-cache-dtype", "int2", "--max-running-requests", "8")
    with pytest.raises(options.OscarStartupError, match="neither a directory"):  # a zoo the user named must exist
        prepare_server_args(_args(*base))
    other = data_free_bundle("hadamard", 2, 2, 64, 64, 64)
    other.model_id = "org/another-model"
    zoo.add(save_bundle(other, tmp_path / "o.safetensors"), tmp_path / "zoo", "another-g64")
    prepare_server_args(_args(*base))  # no entry for this model: the data-free default, and why
    assert os.environ[options.ENV_BUNDLE] == "builtin:hadamard" and options.current().bundle_path == "builtin:hadamard"
    assert any("rotations: data-free Hadamard" in m and Path(_MODEL["path"]).name.lower() in m
               for m in logged), logged

    b = data_free_bundle("hadamard", TINY["num_hidden_layers"], TINY["num_key_value_heads"], 64, 64, 64)
    b.model_id = "org/" + Path(_MODEL["path"]).name
    zoo.add(save_bundle(b, tmp_path / "b.safetensors"), tmp_path / "zoo", "tiny-g64")
    logged.clear()
    prepare_server_args(_args(*base))
    assert os.environ[options.ENV_BUNDLE] == str(tmp_path / "zoo" / "tiny-g64.safetensors")
    assert any("the zoo's calibrated bundle tiny-g64" in m for m in logged), logged
    # the Engine API never runs from_cli_args: ServerArgs alone chooses nothing, the schedulers' hooks choose
    int2_env.delenv(options.ENV_BUNDLE)
    engine_args = ServerArgs(model_path=_MODEL["path"], device="cpu", kv_cache_dtype="int2")
    assert options.ENV_BUNDLE not in os.environ
    hooks.ensure_rotations(engine_args)  # what load_model_after / setup_for_kvc run first in a scheduler
    assert os.environ[options.ENV_BUNDLE] == str(tmp_path / "zoo" / "tiny-g64.safetensors")
    prepare_server_args(_args(*base, "--kv-cache-quant-group-size", "32"))  # no entry at 32: re-picked
    assert os.environ[options.ENV_BUNDLE] == "builtin:hadamard"
    assert sum("rotations:" in m for m in logged) == 3  # one line per choice: hadamard at 32 was a new one
    int2_env.setenv(options.ENV_BUNDLE, "builtin:identity")  # the user's choice stays
    prepare_server_args(_args(*base))
    assert os.environ[options.ENV_BUNDLE] == "builtin:identity"
    (tmp_path / "zoo" / "tiny-g64.safetensors").write_bytes(b"x")  # a corrupted zoo file is refused, not skipped
    int2_env.delenv(options.ENV_BUNDLE)
    int2_env.delenv(options.ENV_GROUP)  # the group flag's, from the call above
    with pytest.raises(options.OscarStartupError, match="corrupted"):
        prepare_server_args(_args(*base))


def test_bundle_checked_against_the_model_before_anything_is_loaded(registered, int2_env, tmp_path, monkeypatch):
    """A rotation bundle that does not fit the model is refused by the launcher's from_cli_args hook, from the model's
    config alone: before any scheduler is spawned or any weight loaded (no ModelRunner, no pool), as one line
    (OscarStartupError: SystemExit, status 1). Every TP rank's shard is checked there, and the group flag too."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(ModelRunner, "load_model", lambda self: pytest.fail("the weights must not be loaded"))
    args = ("--kv-cache-dtype", "int2", "--max-running-requests", "8", "--attention-backend", "oscar_int2")
    other = save_bundle(data_free_bundle("hadamard", 3, 2, 64, 64, 64), tmp_path / "other.safetensors")
    int2_env.setenv(options.ENV_BUNDLE, str(other))
    with pytest.raises(options.OscarStartupError) as e:
        prepare_server_args(_args(*args))
    msg = str(e.value)
    assert msg.startswith("sglang_oscar: ") and "3 layers but the model has 2" in msg and isinstance(e.value, SystemExit)
    g32 = save_bundle(data_free_bundle("hadamard", 2, 2, 64, 32, 32), tmp_path / "g32.safetensors")
    int2_env.setenv(options.ENV_BUNDLE, str(g32))
    with pytest.raises(options.OscarStartupError, match="fitted for groups K=32"):
        prepare_server_args(_args(*args, "--kv-cache-quant-group-size", "64"))
    int2_env.setenv(options.ENV_BUNDLE, "builtin:hadamard")
    with pytest.raises(options.OscarStartupError, match="tp_size 3 is not a multiple of the 2 KV heads"):
        prepare_server_args(_args(*args, "--tp-size", "3"))


def test_refused_start_exits_1_with_one_line(model_dir, tmp_path):
    """`python -m sglang_oscar.launch_server` with a bundle for another model: status 1 and the plugin's one line on
    stderr, no traceback, nothing spawned (before: ~47 lines of scheduler traceback after the weights loaded, and the
    launcher killed with SIGKILL, status 137)."""
    import subprocess

    other = save_bundle(data_free_bundle("hadamard", 3, 2, 64, 64, 64), tmp_path / "other.safetensors")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([_SHIM, os.environ.get("PYTHONPATH", "")]),
               **{options.ENV_BUNDLE: str(other)})
    for name in options.ALL_ENV:
        if name != options.ENV_BUNDLE:
            env.pop(name, None)
    cmd = [sys.executable, "-m", "sglang_oscar.launch_server", "--model-path", model_dir, "--device", "cpu",
           "--kv-cache-dtype", "int2", "--attention-backend", "oscar_int2", "--max-running-requests", "4"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(_REPO))
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_oscar: ") and "3 layers but the model has 2" in last, res.stderr[-3000:]


def test_configure_kv_cache_dtype(registered):
    from sglang.srt.mem_cache import kv_cache_dtype

    kw = dict(model=None, model_dtype=torch.bfloat16, is_draft_worker=False, is_dflash=False,
              speculative_draft_attention_backend=None)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="int2", **kw) == ("int2", torch.uint8)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="auto", **kw) == (None, torch.bfloat16)
    with pytest.raises(options.OscarOptionError, match="draft"):
        kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="int2", **{**kw, "is_draft_worker": True})


# ---- capacity ------------------------------------------------------------------------------------

@pytest.mark.parametrize("group,reqs,page", [(128, 32, 1), (64, 16, 16), (32, 128, 1)])
def test_pool_sizing_equals_capacity_model(registered, int2_env, group, reqs, page):
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    int2_env.setenv(options.ENV_GROUP, str(group))
    kvc = fake_kvc(QWEN3_8B, max_running_requests=reqs)
    conf = object.__new__(DefaultPoolConfigurator)  # the hooks only need the instance as a stash
    cell = DefaultPoolConfigurator._compute_cell_size(conf, kvc, 36)
    shape = capacity.ModelShape(36, 8, 128)
    layout = capacity.layout_for(64, 256, group)
    assert cell == capacity.int2_cell_bytes(shape, layout)
    conf._cell_size, conf._zero_kv_max_tokens = cell, 0
    budget = 55 * 2**30
    got = DefaultPoolConfigurator.calculate_pool_sizes(conf, budget, page).max_total_num_tokens
    assert got == capacity.max_total_num_tokens(budget, shape, layout, reqs, page_size=page)
    assert got == (budget - capacity.fixed_bytes(shape, layout, reqs).total) // cell // page * page
    assert hooks.resolve_max_num_reqs_after(4096, kvc, got) == reqs  # never more requests than rings
    assert hooks.resolve_max_num_reqs_after(reqs - 1, kvc, got) is None


def test_pool_sizing_without_max_running_requests_sizes_r_from_the_budget(registered, int2_env, monkeypatch):
    """No --max-running-requests: the sizing hook fixes R from the budget (capacity.auto_max_running_requests), the
    tokens are what fits beside those windows, SGLang's request limit comes down to R, the pool is built for R, and
    rank 0 logs the one capacity line."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    kvc = fake_kvc(QWEN3_8B, max_running_requests=None)
    kvc.model_config.context_len = 131072
    conf = object.__new__(DefaultPoolConfigurator)
    conf._cell_size = DefaultPoolConfigurator._compute_cell_size(conf, kvc, 36)
    conf._zero_kv_max_tokens = 0
    shape, layout = capacity.ModelShape(36, 8, 128), capacity.layout_for(64, 256, 64)
    budget = 100 * 2**30
    reqs = capacity.auto_max_running_requests(budget, shape, layout)
    got = DefaultPoolConfigurator.calculate_pool_sizes(conf, budget, 64).max_total_num_tokens
    assert got == capacity.max_total_num_tokens(budget, shape, layout, reqs, page_size=64)
    logged = []
    monkeypatch.setattr(hooks.logger, "info", lambda msg, *a: logged.append(msg % a))
    assert hooks.resolve_max_num_reqs_after(2048, kvc, got) == reqs  # SGLang's own 2048 -> the windows' R
    (line,) = [m for m in logged if "windows reserved" in m]
    # builtin:hadamard keys are INT2 on every head (2.25 bits per element; a calibrated bundle's INT4 heads take more)
    assert line.startswith(f"sglang_oscar: int2 KV: {got:,} tokens (6.4x BF16's ") and f"R={reqs} requests" in line
    assert f"fits {reqs} requests of 4k, {min(reqs, got // 32768)} of 32k" in line and "(context length)" in line
    assert setup_for_kvc(kvc).max_running_requests == reqs  # what the pool build hook allocates rings for
    kvc.ps.world_rank = 1  # other ranks cap the same way and stay quiet
    logged.clear()
    assert hooks.resolve_max_num_reqs_after(2048, kvc, got) == reqs and not logged


def test_windows_larger_than_budget_fail_clearly(registered, int2_env):
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    conf = object.__new__(DefaultPoolConfigurator)
    conf._cell_size = DefaultPoolConfigurator._compute_cell_size(conf, fake_kvc(QWEN3_8B, 256), 36)
    with pytest.raises(ValueError, match="lower --max-running-requests"):
        DefaultPoolConfigurator.calculate_pool_sizes(conf, 2**30, 1)


def test_stock_cell_size_path_untouched(registered):
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    conf = object.__new__(DefaultPoolConfigurator)
    conf._cell_size, conf._zero_kv_max_tokens = 1000, 0
    assert DefaultPoolConfigurator.calculate_pool_sizes(conf, 10_500, 1).max_total_num_tokens == 10


# ---- pool ----------------------------------------------------------------------------------------

def _tiny_setup(int2_env, reqs=3, group=64, window_dtype="bfloat16"):
    int2_env.setenv(options.ENV_RECENT, "16")
    int2_env.setenv(options.ENV_PREFIX, "4")
    int2_env.setenv(options.ENV_HP_DTYPE, window_dtype)
    int2_env.setenv(options.ENV_GROUP, str(group))
    return build_setup(options.current(), model_info(FakeModelConfig(**TINY), 1), tp_rank=0, num_layers=2,
                       max_running_requests=reqs)


def _pool(setup, size=96, page=1):
    from sglang_oscar.srt.pool import OscarKVPool

    return OscarKVPool(size, page_size=page, dtype=torch.uint8, head_num=2, head_dim=64, layer_num=2, device="cpu",
                       enable_memory_saver=False, v_head_dim=64, start_layer=0, end_layer=1, setup=setup)


def test_pool_buffers_follow_layer_cache(int2_env):
    s = _tiny_setup(int2_env)
    pool = _pool(s, size=96)
    slots = 97
    assert len(pool.layers) == 2
    for lc in pool.layers:
        lc.validate()
        assert lc.k_codes.shape == (slots, 2, 16) and lc.k_codes.dtype == torch.uint8
        assert lc.k_params.shape == (slots, 2, 1, 2) and lc.v_params.shape == (slots, 2, 1, 2)
        assert lc.sink_k.shape == (s.num_sink_rows, 2, 64) == (2 * 3 * 4, 2, 64)
        assert lc.ring_k.shape == ((3 + 1) * 16, 2, 64) and lc.ring_k.dtype == torch.bfloat16
        assert lc.sink_table is pool.sink_table and lc.window == 16 and lc.sink == 4
    assert pool.sink_table.shape == (slots,) and bool((pool.sink_table == -1).all())
    assert pool.ring_start.shape == (4,)
    assert pool.k_buffer[1] is pool.layers[1].k_codes and pool.layer_cache(1) is pool.layers[1]
    with pytest.raises(RuntimeError, match="only the oscar_int2 attention backend"):
        pool.get_key_buffer(1)  # a stock backend must not read codes as K
    assert pool.dtype == pool.store_dtype == torch.uint8
    assert len(pool._slot_move_pointer_buffers()) == 8  # codes + params, K and V, 2 layers


@pytest.mark.parametrize("window_dtype", ["bfloat16", "float32"])
def test_pool_bytes_equal_capacity_model(int2_env, window_dtype):
    s = _tiny_setup(int2_env, reqs=5, window_dtype=window_dtype)
    pool = _pool(s, size=200)
    k, v = pool.get_kv_size_bytes()
    assert k + v == (200 + 1) * s.cell_bytes + s.fixed.total  # SGLang allocates size + page_size slots


def test_pool_set_kv_buffer_writes_int2(int2_env):
    from sglang_oscar.quant.cache_ops import write_reference

    s = _tiny_setup(int2_env)
    pool = _pool(s)
    torch.manual_seed(0)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    loc = torch.tensor([3, 9, 10, 40, 96])
    ref = pool.layers[1].clone()
    layer = types.SimpleNamespace(layer_id=1)
    pool.set_kv_buffer(layer, loc, k.clone(), v.clone())
    r = pool.rotations[1]
    none = torch.full((5,), -1, dtype=torch.int32)
    write_reference(k, v, loc, none, none, ref, k_transform=r.k_transform, k_mean=r.k_mean, v_transform=None,
                    k_clip=r.k_clip, v_clip=r.v_clip)
    got = pool.layers[1]
    assert r.v_transform is None  # V absorbed (default): the model emits V in the rotated basis
    torch.testing.assert_close(got.k_params[loc].float(), ref.k_params[loc].float())
    torch.testing.assert_close(got.v_params[loc].float(), ref.v_params[loc].float())
    assert (got.k_codes[loc] == ref.k_codes[loc]).float().mean() > 0.99
    assert (got.v_codes[loc] == ref.v_codes[loc]).float().mean() > 0.99
    assert bool((pool.layers[0].k_params == 0).all())  # other layer untouched
    assert bool((got.ring_k == 0).all()) and bool((pool.sink_table == -1).all())  # phase 1: no windows here


@pytest.mark.parametrize("page", [1, 64])
def test_pool_with_int4_key_heads(int2_env, tmp_path, page):
    """A bundle with INT4 keys on some (layer, KV head) pairs: each layer's k_hi holds just its INT4 heads, the bytes
    equal the capacity model (sized for the rank with the most INT4 heads), and set_kv_buffer stores what the oracle
    stores."""
    from sglang_oscar.quant.cache_ops import write_reference
    from sglang_oscar.rotation import save_bundle
    from sglang_oscar.rotation.bundle import data_free_bundle

    path = save_bundle(data_free_bundle("hadamard", 2, 2, 64, 64, 64, k4_heads=[(0, 1), (1, 0), (1, 1)]),
                       tmp_path / "k4.safetensors")
    int2_env.setenv(options.ENV_BUNDLE, str(path))
    s = _tiny_setup(int2_env)
    assert s.plan.k4_heads_max == 3 and s.layout.k4_heads == 3
    assert s.cell_bytes == 2 * 2 * 2 * (16 + 2) + 3 * 16 + 4  # codes + float8 (scale, min), 3 high planes, sink table
    size = 128 if page == 64 else 96
    pool = _pool(s, size=size, page=page)
    assert [lc.k4_heads for lc in pool.layers] == [(1,), (0, 1)]
    assert pool.layers[0].k_hi.shape[-3 if page > 1 else 1] == 1 and pool.layers[1].k4_index.tolist() == [0, 1]
    k, v = pool.get_kv_size_bytes()
    assert k + v == (size + page) * s.cell_bytes + s.fixed.total
    assert len(pool._slot_move_pointer_buffers() if page == 1 else []) == (10 if page == 1 else 0)
    torch.manual_seed(0)
    kk, vv = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    loc = torch.tensor([3, 9, 10, 40, 96])
    for layer_id in (0, 1):
        ref = pool.layers[layer_id].clone()
        pool.set_kv_buffer(types.SimpleNamespace(layer_id=layer_id), loc, kk.clone(), vv.clone())
        r = pool.rotations[layer_id]
        none = torch.full((5,), -1, dtype=torch.int32)
        write_reference(kk, vv, loc, none, none, ref, k_transform=r.k_transform, k_mean=r.k_mean, v_transform=None,
                        k_clip=r.k_clip, v_clip=r.v_clip)
        got = pool.layers[layer_id]
        for name in ("k_params", "v_params"):
            assert torch.equal(got.rows(name, loc).float(), ref.rows(name, loc).float()), name
        for name in ("k_codes", "k_hi", "v_codes"):
            assert (got.rows(name, loc) == ref.rows(name, loc)).float().mean() > 0.99, name


def test_pool_refuses_paths_that_move_partial_slots(int2_env):
    pool = _pool(_tiny_setup(int2_env))
    for call in (pool.move_kv_cache, pool.get_cpu_copy, pool.load_cpu_copy):
        with pytest.raises(NotImplementedError, match="int2"):
            call(None, None)


@pytest.fixture
def published(monkeypatch):
    """The process-wide settings a server publishes before it builds pools, which the pool hook reads (as the stock
    branch does): memory saver and pdmux off."""
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_mod

    monkeypatch.setattr(kvc_mod, "get_exec",
                        lambda: types.SimpleNamespace(features=types.SimpleNamespace(enable_memory_saver=False)))
    monkeypatch.setattr(kvc_mod, "get_disagg", lambda: types.SimpleNamespace(enable_pdmux=False))


def test_build_mha_kv_pool_hook_builds_oscar_pool(registered, int2_env, published):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oscar.srt.pool import OscarKVPool

    _tiny_setup(int2_env)
    kvc = fake_kvc(TINY, max_running_requests=3)
    pool = KVCacheConfigurator._build_mha_kv_pool(kvc, max_total_num_tokens=64, mha_pool_class=MHATokenToKVPool)
    assert isinstance(pool, OscarKVPool) and isinstance(pool, MHATokenToKVPool)
    assert pool.size == 64 and pool.ring_start.shape == (4,)
    with pytest.raises(options.OscarOptionError, match="quant method"):
        KVCacheConfigurator._build_mha_kv_pool(kvc, max_total_num_tokens=64, mha_pool_class=MHATokenToKVPool,
                                               quant_method=object())


def test_freed_slots_release_their_sink_rows(int2_env):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    pool = _pool(_tiny_setup(int2_env), size=96)  # 24 sink rows
    alloc = TokenToKVPoolAllocator(96, torch.uint8, "cpu", pool, need_sort=False)
    hooks.init_pools_after(types.SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=alloc,
                                                 req_to_token_pool=types.SimpleNamespace()), None)
    slots = alloc.alloc(30)
    rows = pool.alloc_sink_rows(slots)
    assert (rows[:24] >= 0).all() and (rows[24:] == -1).all()  # exhausted -> INT2 only
    assert int(pool.sink_row_free[:-1].sum()) == 0
    alloc.free(slots[:10])
    assert (pool.sink_table[slots[:10]] == -1).all() and int(pool.sink_row_free[:-1].sum()) == 10
    alloc.free_group_begin()  # grouped frees go through free() twice: release must be idempotent
    alloc.free(slots[10:20])
    alloc.free_group_end()
    assert int(pool.sink_row_free[:-1].sum()) == 20 and not bool(pool.sink_row_free[:-1].all())
    alloc.free_segment(slots[20:], start_pos=20)
    assert bool(pool.sink_row_free[:-1].all()) and (pool.sink_table == -1).all()
    pool.alloc_sink_rows(alloc.alloc(5))
    alloc.clear()
    assert bool(pool.sink_row_free.all()) and (pool.sink_table == -1).all()


def test_paged_free_releases_whole_pages(int2_env):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    pool = _pool(_tiny_setup(int2_env), size=96, page=16)
    alloc = PagedTokenToKVPoolAllocator(96, 16, torch.uint8, "cpu", pool, need_sort=False)
    pool.attach(types.SimpleNamespace(), alloc)
    slots = torch.arange(16, 32)
    pool.alloc_sink_rows(slots[:8])
    alloc.free(slots[:1])  # SGLang may name one slot per page; the whole page is freed
    assert (pool.sink_table == -1).all() and bool(pool.sink_row_free.all())


def test_paged_pool_layer_caches_follow_pool_shape(int2_env):
    """--page-size 64: every LayerCache is paged ([pages, Hkv, 64, .], kernels/layout.py pool_shape), the windows
    and the sink table are not, the bytes still equal the capacity model, and set_kv_buffer's records land at
    row s % 64 of page s // 64 with the same bytes a flat pool stores for slot s."""
    from sglang_oscar.kernels.layout import pool_shape

    s = _tiny_setup(int2_env)
    pool, flat = _pool(s, size=128, page=64), _pool(s, size=191, page=1)
    slots = 192  # size + page_size: 3 pages
    for lc in pool.layers:
        lc.validate()
        assert lc.page == 64 and lc.num_slots == slots
        assert lc.k_codes.shape == pool_shape(slots, 2, (16,), 64) == (3, 2, 64, 16)
        assert lc.v_codes.shape == lc.k_codes.shape
        assert lc.k_params.shape == lc.v_params.shape == pool_shape(slots, 2, (1, 2), 64) == (3, 2, 64, 1, 2)
        assert lc.sink_k.shape == (s.num_sink_rows, 2, 64) and lc.ring_k.shape == ((3 + 1) * 16, 2, 64)
        assert lc.sink_table is pool.sink_table and pool.sink_table.shape == (slots,)
    assert [b.data_ptr() for b in pool.k_buffer] == [lc.k_codes.data_ptr() for lc in pool.layers]
    assert flat.layers[0].page == 1 and flat.layers[0].k_codes.shape == (slots, 2, 16)
    k, v = pool.get_kv_size_bytes()
    assert k + v == (128 + 64) * s.cell_bytes + s.fixed.total
    torch.manual_seed(1)
    loc = torch.tensor([3, 63, 64, 130, 191])
    kk, vv = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    for p in (pool, flat):
        p.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc, kk.clone(), vv.clone())
    got, ref = pool.layers[1], flat.layers[1]
    for name in ("k_codes", "v_codes", "k_params", "v_params"):
        t = getattr(got, name)
        assert torch.equal(t[loc // 64, :, loc % 64], getattr(ref, name)[loc]), name
        assert torch.equal(got.rows(name, loc), ref.rows(name, loc)), name
        written = t.reshape(-1, *t.shape[3:]).flatten(1).ne(0).any(1)  # records (page, head, row) touched
        assert int(written.sum()) <= 5 * 2 and bool(getattr(pool.layers[0], name).eq(0).all()), name
    assert int(got.k_params.reshape(-1, 2).ne(0).any(1).sum()) == 5 * 2  # 5 slots x 2 heads, one group each


def test_paged_pool_refuses_slot_indexed_paths(int2_env):
    """What SGLang reads or moves by slot cannot work on [pages, Hkv, P, .] buffers: the per-slot pointer /
    stride tables and every slot-move entry point raise, naming the page size or the feature."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = _pool(_tiny_setup(int2_env), size=128, page=64)
    for name in ("data_ptrs", "data_strides", "k_data_ptrs", "v_data_ptrs"):
        table = getattr(pool, name)
        for use in (lambda t: t.numel(), lambda t: t.data_ptr(), lambda t: t[0], lambda t: len(t), lambda t: list(t)):
            with pytest.raises(RuntimeError, match="--page-size 64.*not supported with --kv-cache-dtype int2"):
                use(table)
    with pytest.raises(RuntimeError, match="--page-size 64: slot moves"):
        pool._slot_move_pointer_buffers()
    with pytest.raises(RuntimeError, match="--page-size 64"):  # SGLang's own slot move, if anything reached it
        pool.use_native_move_kv_cache = False
        pool._kv_copy_config = {"num_locs_upper": 4, "bytes_per_tile": 128, "byte_tiles": 1, "num_warps": 4}
        MHATokenToKVPool._move_kv_cache_impl(pool, torch.tensor([5]), torch.tensor([6]))
    for call, args in ((pool.move_kv_cache, (None, None)), (pool.get_cpu_copy, (None,)),
                       (pool.load_cpu_copy, (None, None)), (pool.get_contiguous_buf_infos, ()),
                       (pool.set_kv_buffer_prefix_valid, (None, None, None, None, None))):
        with pytest.raises(NotImplementedError, match="int2"):
            call(*args)
    with pytest.raises(RuntimeError, match="only the oscar_int2 attention backend"):
        pool.get_value_buffer(0)
    flat = _pool(_tiny_setup(int2_env), size=96)  # page 1: SGLang's own tables, as before
    # codes [slot, 2 heads, 16 B], float8 (scale, min) [slot, 2 heads, 1 group, 2 x 1 B]
    assert flat.data_ptrs.numel() == 8 and flat.data_strides.tolist() == [2 * 16] * 4 + [2 * 1 * 2 * 1] * 4


@pytest.mark.parametrize("page,size,match", [(3, 96, "--page-size 3 is not supported"),
                                             (512, 1024, "--page-size 512 is not supported"),
                                             (64, 100, "not a whole number of --page-size 64 pages")])
def test_pool_refuses_pages_it_cannot_store(int2_env, page, size, match):
    with pytest.raises((options.OscarOptionError, RuntimeError), match=match):
        _pool(_tiny_setup(int2_env), size=size, page=page)


def test_build_mha_kv_pool_hook_builds_pages_of_the_page_size(registered, int2_env, published):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    _tiny_setup(int2_env)
    kvc = fake_kvc(TINY, max_running_requests=3)
    kvc.pool_page_size = 64
    pool = KVCacheConfigurator._build_mha_kv_pool(kvc, max_total_num_tokens=128, mha_pool_class=MHATokenToKVPool)
    assert pool.page_size == 64 and all(lc.page == 64 and lc.k_codes.shape[:3] == (3, 2, 64) for lc in pool.layers)


def test_init_pools_hook_rejects_a_foreign_pool_for_int2():
    res = types.SimpleNamespace(token_to_kv_pool=object(), req_to_token_pool=None, token_to_kv_pool_allocator=None)
    with pytest.raises(RuntimeError, match="a pool path this plugin does not hook"):
        hooks.init_pools_after(res, types.SimpleNamespace(kv_cache_dtype_str="int2"))
    assert hooks.init_pools_after(res, types.SimpleNamespace(kv_cache_dtype_str="auto")) is None


def _reference_plan(rows, prefix, ext, S, W):
    """Token-by-token statement of the rules in srt/write_plan.py."""
    pos, ring = [], []
    for r, p, e in zip(rows, prefix, ext):
        for q in range(p, p + e):
            pos.append(q)
            ring.append(r * W + q % W if q >= S and q >= p + e - W else -1)
    return pos, ring


def test_write_plan_follows_the_reader_rules(int2_env):
    from sglang_oscar.srt.write_plan import RingStartTracker, plan_writes

    s = _tiny_setup(int2_env, reqs=3)  # S=4, W=16, 24 sink rows
    pool = _pool(s, size=96)
    tracker = RingStartTracker(4)
    rows, prefix, ext = [1, 2, 3], [0, 2, 10], [20, 3, 1]  # fresh prompt, radix hit of 2, a decode
    slots = torch.arange(1, 25)
    plan = plan_writes(pool, tracker, rows, prefix, ext, slots, generations=[5, 7, 9])
    pos, ring = _reference_plan(rows, prefix, ext, 4, 16)
    assert plan.ring_dst.tolist() == ring
    live = [x for x in ring if x >= 0]
    assert len(live) == len(set(live))  # unique destinations within one call (write.py contract)
    sink_pos = [i for i, q in enumerate(pos) if q < 4]
    assert (plan.sink_dst[sink_pos] >= 0).all() and (plan.sink_dst[[i for i in range(24) if i not in sink_pos]] == -1).all()
    assert (pool.sink_table[slots[sink_pos]] == plan.sink_dst[sink_pos]).all()
    assert plan.ring_starts.tolist() == [0, 2, 10] and pool.ring_start[[1, 2, 3]].tolist() == [0, 2, 10]
    # next step: decodes of the same requests keep ring_start; row 2 now serves a new request
    plan = plan_writes(pool, tracker, [1, 2], [20, 0], [1, 2], torch.tensor([40, 41, 42]), generations=[5, 8])
    assert plan.ring_starts.tolist() == [0, 0] and plan.new_requests == [2]
    assert plan.ring_dst.tolist() == [1 * 16 + 20 % 16, -1, -1]  # positions 0, 1 of row 2 are sink positions
    assert (plan.sink_dst[1:] >= 0).all()


def test_write_plan_runs_out_of_sink_rows_gracefully(int2_env):
    from sglang_oscar.srt.write_plan import RingStartTracker, plan_writes

    pool = _pool(_tiny_setup(int2_env, reqs=1), size=96)  # 2 x 1 x 4 = 8 sink rows
    tracker = RingStartTracker(2)
    plan = plan_writes(pool, tracker, [0, 1], [0, 0], [6, 6], torch.arange(1, 13), generations=[1, 1])
    assert (plan.sink_dst >= 0).sum() == 8  # positions 0..3 of both requests
    assert pool.sink_rows_missing == 0
    plan = plan_writes(pool, tracker, [1], [0], [5], torch.arange(20, 25), generations=[2])
    assert (plan.sink_dst == -1).all()  # no rows left (slots 1..12 still hold theirs): stays INT2
    assert pool.sink_rows_missing == 4  # positions 0..3 of the new request: counted (and logged)
    pool.release_sink_rows(torch.arange(1, 7))  # SGLang frees request 0's slots
    plan = plan_writes(pool, tracker, [1], [0], [2], torch.tensor([30, 31]), generations=[3])
    assert (plan.sink_dst >= 0).all()


# ---- startup errors ------------------------------------------------------------------------------

def test_bundle_for_another_model_fails_at_startup(registered, int2_env, tmp_path):
    path = save_bundle(data_free_bundle("hadamard", 3, 2, 64, 64, 64), tmp_path / "other.safetensors")
    int2_env.setenv(options.ENV_BUNDLE, str(path))
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    conf = object.__new__(DefaultPoolConfigurator)
    with pytest.raises(BundleError, match="3 layers but the model has 2"):
        DefaultPoolConfigurator._compute_cell_size(conf, fake_kvc(TINY, max_running_requests=7), 2)
    path = save_bundle(data_free_bundle("hadamard", 2, 2, 64, 32, 32), tmp_path / "g32.safetensors")
    int2_env.setenv(options.ENV_BUNDLE, str(path))
    int2_env.setenv(options.ENV_GROUP, "64")
    with pytest.raises(options.OscarOptionError, match="fitted for groups K=32"):
        setup_for_kvc(fake_kvc(TINY, max_running_requests=9))


def test_launcher_selects_the_plugin():
    assert plugin_env({}) == {"SGLANG_PLUGINS": "sglang_oscar"}
    assert plugin_env({"SGLANG_PLUGINS": "a, sglang_oscar"}) == {"SGLANG_PLUGINS": "a,sglang_oscar"}
    assert plugin_env({"SGLANG_PLUGINS": "other"}) == {"SGLANG_PLUGINS": "other,sglang_oscar"}


# ---- real server on CPU (slow: ~40 s per start on 2 cores) --------------------------------------

_REPO = Path(__file__).resolve().parents[1]


# Server ports come from below Linux's ephemeral range (32768-60999 by default). A port from bind(("", 0)) is
# ephemeral, and any outgoing connection can take it before the server binds it; on 2 busy cores that is tens of
# seconds later. CI saw EADDRINUSE on the torch.distributed store port of one of two servers starting side by side,
# when SGLang chose that port itself. So every server gets --port and --nccl-port from here.
_PORT_LO, _PORT_HI = 20000, 32000
_ports_given: set = set()


def _binds(port):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port():
    """A port in [_PORT_LO, _PORT_HI) that binds now and that this process has not handed out before. The walk
    starts at an offset from the pid, so concurrent pytest processes (scripts/test.sh runs two) try different
    ports."""
    span = _PORT_HI - _PORT_LO
    start = (os.getpid() * 7919) % span
    for i in range(span):
        port = _PORT_LO + (start + i) % span
        if port in _ports_given or not _binds(port):
            continue
        _ports_given.add(port)
        return port
    raise RuntimeError(f"no free port in [{_PORT_LO}, {_PORT_HI})")


def test_server_ports_below_the_ephemeral_range_and_never_reused(monkeypatch):
    """_free_port: ports in [_PORT_LO, _PORT_HI), none handed out twice by one process, a port bound by someone
    else skipped, and a clear error once the range is spent (here a range of three ports, one of them held)."""
    import socket

    got = [_free_port() for _ in range(6)]
    assert len(set(got)) == 6 and all(_PORT_LO <= p < _PORT_HI for p in got)
    # three consecutive ports that bind now, the middle one then held by "another process"
    base = next(p for p in range(_PORT_LO, _PORT_HI - 3) if all(_binds(p + i) for i in range(3)))
    held = socket.socket()
    held.bind(("127.0.0.1", base + 1))
    try:
        monkeypatch.setattr(sys.modules[__name__], "_PORT_LO", base)
        monkeypatch.setattr(sys.modules[__name__], "_PORT_HI", base + 3)
        monkeypatch.setattr(sys.modules[__name__], "_ports_given", set())
        assert sorted([_free_port(), _free_port()]) == [base, base + 2]
        with pytest.raises(RuntimeError, match="no free port"):
            _free_port()
    finally:
        held.close()


class _Server:
    """`python -m sglang_oscar.launch_server` on CPU (sglang-on-cpu.md Path A), killed at exit."""

    def __init__(self, model, log_path, *extra, env=None):
        self.log_path = log_path
        self._spawn_args = (model, extra, env)
        self.restarts = 0
        self._launch()

    def _launch(self):
        import subprocess

        model, extra, env = self._spawn_args
        self.port, nccl_port = _free_port(), _free_port()
        e = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", TRITON_INTERPRET="1",
                 PYTHONPATH=os.pathsep.join([_SHIM, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        cmd = [sys.executable, "-m", "sglang_oscar.launch_server", "--model-path", str(model), "--device", "cpu",
               "--max-total-tokens", "4096", "--sleep-on-idle", "--host", "127.0.0.1", "--port", str(self.port),
               "--nccl-port", str(nccl_port), *extra]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(_REPO))

    def startup_warmup_timed_out(self):
        """SGLang's own startup warmup polls /model_info with a fixed 5 s timeout (http_server.py
        _execute_server_warmup) and exits when it never answers: on 2 busy cores (TP ranks over gloo,
        another server starting) that is the machine, not our code. Only this exit is retried."""
        return self.proc.poll() is not None and "Initialization failed. warmup error" in self.text()

    def restart(self):
        """Launch again (new port), keeping the failed attempt's log next to the new one."""
        self.stop()
        Path(self.log_path).rename(f"{self.log_path}.attempt{self.restarts}")
        self.restarts += 1
        self._launch()

    def text(self):
        return Path(self.log_path).read_text(errors="ignore")

    def wait_ready(self, timeout=240):
        import time

        t0 = time.time()
        while time.time() - t0 < timeout:
            if "fired up and ready" in self.text():
                return
            if self.proc.poll() is not None:
                raise AssertionError("server exited during startup:\n" + self.text()[-3000:])
            time.sleep(1)
        raise AssertionError("server not ready in time:\n" + self.text()[-3000:])

    def generate(self, ids, n=8, timeout=120):
        import json
        import urllib.request

        body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher tears down its scheduler and detokenizer
            try:
                self.proc.wait(60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import runpy

    make = runpy.run_path(str(_REPO / "scripts" / "make_tiny_model.py"))["make_tiny_model"]
    return make(tmp_path_factory.mktemp("tinyq_full"))


@pytest.mark.slow
def test_cpu_server_stock_backend_with_plugin_loaded(tiny_model, tmp_path):
    srv = _Server(tiny_model, tmp_path / "stock.log", "--attention-backend", "torch_native")
    try:
        srv.wait_ready()
        out = srv.generate(list(range(1, 9)), n=8)
        assert len(out["output_ids"]) == 8
        # The plugin is loaded here too (the launcher selects it; the int2 test proves the hooks are
        # live in both processes) and must leave a BF16 cache exactly as SGLang builds it.
        assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096" in srv.text()
    finally:
        srv.stop()


@pytest.mark.slow
def test_cpu_server_int2_matches_fp32_while_everything_is_in_the_windows(tiny_model, tmp_path):
    """oscar_int2 end to end (Triton interpreter, fp32 model and windows). Prompts + outputs shorter
    than S + W never reach the INT2 history, so greedy tokens must equal torch_native's exactly; a
    radix hit of a prefix shorter than S reads the shared sink rows and must match too."""
    import random

    ref = _Server(tiny_model, tmp_path / "ref.log", "--attention-backend", "torch_native", "--dtype", "float32")
    env = {options.ENV_BUNDLE: "builtin:hadamard", options.ENV_ABSORB_V: "0", options.ENV_HP_DTYPE: "float32"}
    srv = _Server(tiny_model, tmp_path / "int2.log", "--attention-backend", "oscar_int2", "--dtype", "float32",
                  "--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", "64", "--max-running-requests", "4",
                  env=env)
    try:
        ref.wait_ready(400)
        srv.wait_ready(400)
        rnd = random.Random(0)
        p40 = [rnd.randrange(3, 1024) for _ in range(40)]
        for prompt in (list(range(1, 9)), p40, [rnd.randrange(3, 1024) for _ in range(100)], p40 + [5, 6, 7]):
            want, got = ref.generate(prompt, n=8)["output_ids"], srv.generate(prompt, n=8)
            assert got["output_ids"] == want, (len(prompt), got["output_ids"], want)
        assert got["meta_info"]["cached_tokens"] == 40  # the last one was a radix hit
    finally:
        srv.stop()
        ref.stop()


@pytest.mark.slow
def test_cpu_server_int2_history_matches_the_simulator(tiny_model, tmp_path):
    """Small windows (S=4, W=16) put most of the history in INT2: the server's greedy tokens must equal
    eval/simulator.py (HF model + fake-quantized attention, server semantics) and differ from exact."""
    import random

    from transformers import AutoModelForCausalLM

    from sglang_oscar.eval.simulator import MixedCacheSimulator

    env = {options.ENV_BUNDLE: "builtin:hadamard", options.ENV_ABSORB_V: "0", options.ENV_HP_DTYPE: "float32",
           options.ENV_PREFIX: "4", options.ENV_RECENT: "16"}
    srv = _Server(tiny_model, tmp_path / "int2_small.log", "--attention-backend", "oscar_int2", "--dtype", "float32",
                  "--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", "64", "--max-running-requests", "4",
                  env=env)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        b = data_free_bundle("hadamard", 2, 2, 64, 64, 64)
        sim = MixedCacheSimulator([b.layer_quantizers(i) for i in range(2)], sink=4, recent=16, mode="prefill")
        rnd = random.Random(0)
        prompts = [[rnd.randrange(3, 1024) for _ in range(n)] for n in (40, 100)]
        kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        want, exact = [], []
        with torch.no_grad():
            for p in prompts:
                with sim.attach(model):
                    want.append(model.generate(torch.tensor([p]), **kw)[0, len(p):].tolist())
                exact.append(model.generate(torch.tensor([p]), **kw)[0, len(p):].tolist())
        srv.wait_ready(400)
        for p, w, e in zip(prompts, want, exact):
            got = srv.generate(p, n=12)["output_ids"]
            assert got == w, (len(p), got, w)
            assert got != e  # the INT2 history really was read
    finally:
        srv.stop()

