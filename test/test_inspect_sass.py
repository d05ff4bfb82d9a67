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
    assert res["stack_bytes"] == 0, "stage 1 spills registers at the default configuration"
    assert res["registers"] <= 255
    loop = res["int2_loop"]
    assert loop is not None and loop["instructions"] > 0
    assert any(op.startswith("HMMA") for op in loop["top_opcodes"]), "the INT2 dots left the tensor cores"
    # the V codes reach the dots as bytes (LDS.U8), not as fp16 planes transposed through shared
    # memory (LDSM.16.MT88 per plane, the v3 layout)
    assert "LDS.U8" in loop["top_opcodes"]
    assert not any(op.startswith("LDSM.16.MT88") for op in loop["top_opcodes"])
