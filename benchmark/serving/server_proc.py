"""The `python -m sglang.launch_server` child process every serving driver runs (bench_serving.py, tp_serve.py,
smollm2_serve.py): started in its own process session, so that stop() ends the server's whole tree (scheduler and
detokenizer included); logged to one file; ready when SGLang logs "fired up and ready"."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

READY = "fired up and ready"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """launch_server with `server_args` (the flags after the module name) and `env`, its output in log_path."""

    def __init__(self, server_args: list, env: dict, log_path: Path, port: int, cwd: str | None = None):
        self.port, self.log_path = port, Path(log_path)
        cmd = [sys.executable, "-m", "sglang.launch_server", *map(str, server_args)]
        self.cmd = " ".join(cmd[1:])
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=cwd)

    def text(self) -> str:
        return self.log_path.read_text(errors="ignore")

    def wait_ready(self, timeout: float, poll: float = 2.0) -> float:
        """Seconds until the server is ready; RuntimeError if it exits first or takes longer than timeout."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if READY in self.text():
                return time.time() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup (rc {self.proc.returncode})")
            time.sleep(poll)
        raise RuntimeError(f"server not ready after {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 60 s; the log is closed either way."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except Exception:  # noqa: BLE001 - still running, or the group is already gone
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(30)
                except Exception:  # noqa: BLE001
                    pass
        self.log.close()
