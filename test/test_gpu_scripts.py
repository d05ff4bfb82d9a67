"""The device scripts under benchmark/ (run on the lent GPU machine, never in CI): every one parses, and
run_gpu_table.sh stops with a clear message where the SGLang / FlashInfer runtime is not staged, before it times
anything (a table without its baselines would be no table)."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmark", "**", "*.sh"), recursive=True))


def test_there_are_device_scripts():
    assert os.path.join(ROOT, "benchmark", "run_gpu_table.sh") in SCRIPTS
    assert os.path.join(ROOT, "benchmark", "serving", "run_gpu.sh") in SCRIPTS  # the subfolders' scripts too


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "benchmark")))
def test_device_script_parses(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_table_refuses_without_the_runtime(tmp_path):
    # a copy of the two scripts it needs in an empty tree: no .devb parts to stage, a HOME of its own
    (tmp_path / "benchmark").mkdir()
    for name in ("run_gpu_table.sh", "stage_runtime_parts.sh"):
        shutil.copy(os.path.join(ROOT, "benchmark", name), tmp_path / "benchmark" / name)
    out = tmp_path / "out"
    # a python3 in which neither imports (whatever venv runs this test: .venv-serve has both)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text("#!/bin/sh\nexit 1\n")
    (shim / "python3").chmod(0o755)
    env = dict(os.environ, HOME=str(tmp_path / "home"), OUT=str(out), OSCAR_COMMIT="0000000",
               PATH=f"{shim}:{os.environ['PATH']}")
    r = subprocess.run(["bash", "benchmark/run_gpu_table.sh"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "stage both runtime parts first" in r.stdout
    assert not list(out.glob("decode_kernel_*")), "nothing may be timed without the baselines"
