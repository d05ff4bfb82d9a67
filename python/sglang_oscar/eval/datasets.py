"""Load evaluation records from a local file or, when reachable, a Hugging Face dataset repo.

Spec forms:
  path/to/file.{jsonl,json,csv,parquet}   local (parquet needs pyarrow)
  hf:OWNER/REPO/path/in/repo.ext           one file of a dataset repo, via huggingface_hub
Nothing is downloaded unless a hf: spec is given (or a task's default is used); the error says
how to get the file another way when the hub cannot be reached (gated repos such as GPQA need
HF_TOKEN and an accepted licence).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


class DatasetError(RuntimeError):
    """A dataset that cannot be loaded; the message says where it looked and what to do."""


def load_records(spec: str) -> list[dict]:
    path = _resolve(spec)
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if suffix == ".json":
            obj = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(obj, dict):  # {"data": [...]} / {"rows": [...]}-style wrappers
                obj = next((v for v in obj.values() if isinstance(v, list)), None)
            if not isinstance(obj, list):
                raise DatasetError(f"{spec}: expected a JSON list of records")
            return obj
        if suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as f:
                return list(csv.DictReader(f))
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DatasetError(f"{spec}: reading parquet needs pyarrow (`pip install pyarrow`), "
                                   "or convert the file to JSONL") from None
            return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as e:
        raise DatasetError(f"{spec}: cannot read ({e})") from None
    raise DatasetError(f"{spec}: unsupported extension {suffix!r} (use .jsonl, .json, .csv or .parquet)")


def _resolve(spec: str) -> Path:
    if not spec.startswith("hf:"):
        p = Path(spec)
        if not p.is_file():
            raise DatasetError(f"{spec}: no such file")
        return p
    parts = spec[3:].split("/", 2)
    if len(parts) != 3 or not all(parts):
        raise DatasetError(f"{spec}: expected hf:OWNER/REPO/path/in/repo.ext")
    repo, filename = "/".join(parts[:2]), parts[2]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise DatasetError(f"{spec}: huggingface_hub is not installed; download the file and pass its path") from None
    try:
        return Path(hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as e:  # offline, gated, missing: all end the same way for the user
        raise DatasetError(f"{spec}: cannot download from the Hugging Face hub ({type(e).__name__}: {e}). "
                           "Check the network and HF_TOKEN (gated sets need an accepted licence), or "
                           "download the file elsewhere and pass --data PATH") from None


def field(rec: dict, *names, default=None):
    """The first present, non-empty field among `names` (datasets spell the same column differently)."""
    for n in names:
        v = rec.get(n)
        if v is not None and v != "":
            return v
    if default is not None:
        return default
    raise DatasetError(f"record has none of the fields {names}; it has {sorted(rec)}")
