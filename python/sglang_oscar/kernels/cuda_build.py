"""Build the CUDA sources of kernels/cuda/ with nvcc, once per (source, GPU arch, nvcc), and cache them on disk.

The libraries are loaded with ctypes (no Python extension, no ninja): history_cuda.py loads int2_history.cu and
write_cuda.py int2_write.cu. nvcc is looked up on PATH, in $CUDA_HOME/bin and /usr/local/cuda/bin; the cache is
$SGLANG_OSCAR_CACHE (default ~/.cache/sglang_oscar). TP ranks share the cache: each writes its own temporary file and
renames it into place, so concurrent builds are safe.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import torch

CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
ENV_CACHE = "SGLANG_OSCAR_CACHE"  # the build cache (srt/options.py lists it with the server's variables)


class CudaUnavailable(RuntimeError):
    """A CUDA kernel cannot be built or run here (no nvcc, nvcc failed, GPU too old); the message says why."""


def nvcc() -> str:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    raise CudaUnavailable("the CUDA kernels are built with nvcc, which was not found on PATH, in $CUDA_HOME/bin or "
                          "/usr/local/cuda/bin: install the CUDA toolkit")


def build(source: str) -> str:
    """Path of the compiled library of `source` for the current GPU, built with nvcc on first use and cached on disk
    by (source text, GPU arch, nvcc version), named after the source file."""
    compiler = nvcc()
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with open(source, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + arch.encode() + version.encode()).hexdigest()[:16]
    cache = os.environ.get(ENV_CACHE, os.path.join(os.path.expanduser("~"), ".cache", "sglang_oscar"))
    os.makedirs(cache, exist_ok=True)
    stem = os.path.splitext(os.path.basename(source))[0]
    so = os.path.join(cache, f"{stem}_{key}.so")
    if not os.path.exists(so):
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = [compiler, "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared", "-Xcompiler", "-fPIC",
               "-o", tmp, source]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise CudaUnavailable(f"nvcc failed to build {source}:\n{res.stderr[-2000:]}")
        os.replace(tmp, so)  # atomic: concurrent builders (TP ranks) each write their own tmp file
    return so
