"""The commit the benchmark results name: OSCAR_COMMIT where the staging command sets it (the device
machine's copy of the tree can carry stale git metadata), else this checkout's HEAD (CPU)."""

import os
import subprocess
import sys

import kernel_utils  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmark"))
from bench_decode import versions  # noqa: E402
from bench_write import git_commit  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..")


def test_versions_name_oscar_commit_when_set(monkeypatch):
    monkeypatch.setenv("OSCAR_COMMIT", "0123abc")
    assert git_commit() == "0123abc"
    assert versions()["git_commit"] == "0123abc"


def test_versions_fall_back_to_head(monkeypatch):
    monkeypatch.delenv("OSCAR_COMMIT", raising=False)
    try:
        head = subprocess.check_output(["git", "-C", REPO, "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    assert versions()["git_commit"] == head
