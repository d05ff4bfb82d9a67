"""benchmark/inspect_decode_sass.py: the decode kernel compiles for sm_90 on a machine without a GPU,
and the default configuration's INT2 loop keeps its shape (no register spill, tensor-core MMAs, no
fp16 shared-memory round trip of the V planes, see benchmark/NOTES.md v4). Static checks only; run
in a subprocess because the test session runs Triton in interpreter mode (conftest)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
    pytest.skip("triton without its bundled ptxas", allow_module_level=True)

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmark", "inspect_decode_sass.py")


@pytest.mark.parametrize("model", ["qwen3-8b", "smollm2"])
def test_default_config_compiles_without_spills(model):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, "--model", model], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["config"] == "128:2:3"  # oscar_decode's default
    # folded tiles by default for both shapes (NP = 4), capped at 168 registers: 6 CTAs per SM. SmolLM2
    # keeps one 4-byte value in local memory across the loop (stored before it, loaded after)
    assert res["fold"] and res["maxnreg"] == 168 and res["registers"] <= 168
    assert res["stack_bytes"] <= 8, "stage 1 spills registers at the default configuration"
    assert res["int2_loop"]["spill_ops"] == 0, "the INT2 loop touches local memory"
    loop = res["int2_loop"]
    assert loop is not None and loop["instructions"] > 0
    assert any(op.startswith("HMMA") for op in loop["top_opcodes"]), "the INT2 dots left the tensor cores"
    # the V codes reach the dots as bytes (LDS.U8), not as fp16 planes transposed through shared
    # memory (LDSM.16.MT88 per plane, the v3 layout)
    assert "LDS.U8" in loop["top_opcodes"]
    assert not any(op.startswith("LDSM.16.MT88") for op in loop["top_opcodes"])


@pytest.mark.parametrize("model,config", [("qwen3-32b", "128:2:3"), ("glm-4.7-tp8", "64:2:3")])
def test_large_gqa_defaults_compile_without_loop_spills(model, config):
    """GQA 8 (NP 8, unfolded) and GQA 12 (NP 16: 64 tokens per iteration by default, decode.default_block_n;
    at 128 its loop spilled 46 local-memory ops per iteration)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, "--model", model], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["config"] == config and not res["fold"]
    assert res["stack_bytes"] == 0 and res["int2_loop"]["spill_ops"] == 0, (res["stack_bytes"], res["int2_loop"])


@pytest.mark.parametrize("model,offset_form,subnormal", [("qwen3-8b", 1544, 1329), ("smollm2", 1057, 912)])
def test_subnormal_codes_shorten_the_loop(model, offset_form, subnormal):
    """The default code format (subnormal codes) keeps its instruction count: the byte spread is shared
    by the four planes (no shift among the loop's top 16 opcodes; 99 SHF with the offset form), and the
    loop is >= 10% shorter than with the offset
    form 1 + code/4 (counts of triton 3.6 / its ptxas when written: offset_form -> subnormal)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    loops = {}
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, SCRIPT, "--model", model, "--subnormal", flag, "--fold", "0"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout)
        # no spill in the loop; the offset form at D 128 (not a default: codebooks fold at NP < 8) keeps
        # 8 bytes of stack outside it since the sink programs count missing rows
        assert res["int2_loop"]["spill_ops"] == 0
        assert res["stack_bytes"] <= (8 if flag == "0" else 0), (flag, res["stack_bytes"])
        loops[flag] = res["int2_loop"]
    assert loops["1"]["instructions"] <= 0.9 * loops["0"]["instructions"], (loops["0"]["instructions"],
                                                                          loops["1"]["instructions"])
    assert not any(op.startswith("SHF") for op in loops["1"]["top_opcodes"]), loops["1"]["top_opcodes"]
    # not pinned exactly (another ptxas may schedule differently), only kept near what was measured
    assert loops["1"]["instructions"] <= subnormal * 1.05 and loops["0"]["instructions"] <= offset_form * 1.05


@pytest.mark.parametrize("model,unfolded_regs", [("qwen3-8b", 254), ("smollm2", 243)])
def test_folded_tiles_halve_the_padded_work(model, unfolded_regs):
    """Folded [BLOCK_N/2, 2·NP] tiles (FOLD_HALVES) carry no padded columns: the loop's fp32 multiplies
    drop (Qwen3 128 -> 72 FMUL per iteration when written) and the kernel fits 168 registers where the
    unfolded one takes ~250, so 6 CTAs fit per SM instead of 4."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = {}
    for fold in ("0", "1"):
        out = subprocess.run([sys.executable, SCRIPT, "--model", model, "--fold", fold], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        res[fold] = json.loads(out.stdout)
    assert res["0"]["registers"] >= unfolded_regs - 16 and res["1"]["registers"] <= 168
    assert res["1"]["int2_loop"]["spill_ops"] == 0
    fmul = {f: res[f]["int2_loop"]["top_opcodes"].get("FMUL", 0) for f in res}
    assert fmul["1"] <= 0.7 * fmul["0"], fmul


def test_ws_probe_compiles_for_sm90():
    """benchmark/probe_ws_keys.py (the Gluon warp-specialisation probe, NOTES "A first warp-specialised probe")
    still compiles for sm_90: both forms, the warp-specialised one with its register cap, no spills."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmark", "probe_ws_keys.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, script, "--compile-only", "--ws-maxnreg", "128"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert set(res) == {"ws", "ws_pf", "sr"}
    assert res["ws"]["registers"] <= 128 and res["ws"]["hmma"] > 0 and res["sr"]["hmma"] > 0
    assert res["ws"]["stack_bytes"] == 0 and res["sr"]["stack_bytes"] == 0
