"""Run model-written Python in a subprocess with a wall-clock timeout and resource limits.

Limits (POSIX rlimits set in the child before exec): CPU seconds, address space, file size (the
program's stdout/stderr go to files, so RLIMIT_FSIZE also caps runaway output without buffering
it in this process), and no core dumps. The child runs in a fresh session in an empty temporary
directory with `python -I` (no user site-packages, no PYTHON* variables) and a minimal
environment; on timeout the whole process group is killed.

This contains accidents (infinite loops, memory blowups, endless printing), not an adversary:
there is no network or filesystem isolation. Run untrusted evaluations inside a container.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from typing import Optional

DEFAULT_TIMEOUT = 10.0
DEFAULT_MEMORY_MB = 2048
DEFAULT_MAX_OUTPUT = 1 << 20  # bytes per stream


@dataclasses.dataclass
class RunResult:
    status: str  # "ok" (exit 0), "error" (non-zero exit / signal), "timeout", "output_limit"
    returncode: Optional[int]
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _limits(cpu_s: int, memory_mb: int, max_output: int):
    def apply():  # runs in the child between fork and exec
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        if memory_mb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_output, max_output))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, stdin: str = "", timeout: float = DEFAULT_TIMEOUT, memory_mb: int = DEFAULT_MEMORY_MB,
               max_output: int = DEFAULT_MAX_OUTPUT) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="oscar_sandbox_") as tmp:
        src = os.path.join(tmp, "main.py")
        with open(src, "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", src], stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=tmp, env=env,
                start_new_session=True, preexec_fn=_limits(int(timeout) + 1, memory_mb, max_output))
            timed_out = False
            try:
                proc.communicate(stdin.encode("utf-8"), timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:  # the program exited without reading its input
                proc.wait(timeout=timeout)
            finally:
                if proc.poll() is None or timed_out:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the program's children too
                    except ProcessLookupError:
                        pass
                    proc.wait()
        stdout = _read(out_path, max_output)
        stderr = _read(err_path, max_output)
    rc = proc.returncode
    if timed_out or rc == -signal.SIGXCPU:
        status = "timeout"  # SIGXCPU: the CPU limit caught a busy loop before the wall clock did
    elif rc == -signal.SIGXFSZ or (rc != 0 and "File too large" in stderr):
        status = "output_limit"
    elif rc == 0:
        status = "ok"
    else:
        status = "error"
    return RunResult(status, rc, stdout, stderr)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")
