"""Rotation zoo: a directory (or a Hugging Face repo) of validated rotation bundles plus an index.

    python -m sglang_oscar.zoo list   [--zoo DIR|hf:OWNER/REPO]
    python -m sglang_oscar.zoo get    NAME --out PATH [--zoo ...]
    python -m sglang_oscar.zoo verify [--zoo ...] [--name NAME] [--model-config config.json]
    python -m sglang_oscar.zoo add    BUNDLE --zoo DIR --name NAME [--model MODEL_ID] [--force]

Layout: <zoo>/index.json and the bundle files it names (paths relative to the zoo). The index
repeats the bundle's shape (layers, kv_heads, head_dim, groups, bits, method) so a user can pick
an entry without downloading anything, and a sha256 + size so a truncated or tampered download
is caught before the bundle reaches the server. The bundle's own validation (rotation.load_bundle)
runs on top of that: the checksum proves the file is the one that was published, the validation
proves the published file is usable.

The zoo location is a local directory, or `hf:OWNER/REPO` (also a bare OWNER/REPO that is not an
existing directory) read through huggingface_hub when it is installed and the hub is reachable.
The default is $SGLANG_OSCAR_ZOO, else ./zoo. A server started with no rotation source looks its
model up (find_for_model) in $SGLANG_OSCAR_ZOO, else in the zoo of the source checkout the package
runs from (server_zoo).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from .models import shape_from_config
from .rotation.bundle import BundleError, load_bundle

ENV_ZOO = "SGLANG_OSCAR_ZOO"  # the default zoo (srt/options.py lists it with the server's variables)
INDEX = "index.json"
FORMAT = "sglang-oscar-zoo"
VERSION = 1
ENTRY_FIELDS = ("name", "model_id", "file", "sha256", "size", "bits", "k_group", "v_group", "method",
                "layers", "kv_heads", "head_dim", "created")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # also the file stem: no slashes, no spaces
_HF_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ZooError(RuntimeError):
    """A zoo that cannot be used; the message names the zoo, the entry or the file, and what to do."""


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------- sources
class _LocalSource:
    def __init__(self, root: Path):
        self.root = root
        self.label = str(root)

    def index_text(self) -> str:
        p = self.root / INDEX
        if not p.is_file():
            raise ZooError(f"{self.label}: no {INDEX}; create the zoo with "
                           f"`python -m sglang_oscar.zoo add BUNDLE --zoo {self.label} --name NAME`")
        return p.read_text(encoding="utf-8")

    def fetch(self, rel: str) -> Path:
        p = self.root / rel
        if not p.is_file():
            raise ZooError(f"{self.label}: file {rel} listed in {INDEX} is missing")
        return p


class _HubSource:
    """A zoo published as a Hugging Face model repo (index.json at its root)."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.label = f"hf:{repo_id}"
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise ZooError(f"{self.label}: huggingface_hub is not installed; `pip install huggingface_hub`, "
                           "or download the zoo directory and pass --zoo DIR") from None

    def _download(self, rel: str) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.repo_id, rel))
        except Exception as e:  # offline, 404, auth: hub errors share no useful base class
            raise ZooError(f"{self.label}: cannot download {rel} from the Hugging Face hub "
                           f"({type(e).__name__}: {e}); check the network / HF_TOKEN, or download the "
                           "zoo directory elsewhere and pass --zoo DIR") from None

    def index_text(self) -> str:
        return self._download(INDEX).read_text(encoding="utf-8")

    def fetch(self, rel: str) -> Path:
        return self._download(rel)


def _source(zoo: Optional[str]):
    zoo = zoo or os.environ.get(ENV_ZOO) or "zoo"
    if zoo.startswith("hf:"):
        return _HubSource(zoo[3:])
    p = Path(zoo)
    if p.is_dir():
        return _LocalSource(p)
    if _HF_RE.match(zoo) and not p.exists():
        return _HubSource(zoo)
    raise ZooError(f"zoo {zoo!r} is neither a directory nor a Hugging Face repo id (hf:OWNER/REPO)")


# ------------------------------------------------------------------------------------ index
def _parse_index(text: str, label: str) -> list[dict]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ZooError(f"{label}/{INDEX}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("entries"), list):
        raise ZooError(f"{label}/{INDEX}: expected {{\"format\": \"{FORMAT}\", \"entries\": [...]}}")
    if obj.get("version") != VERSION:
        raise ZooError(f"{label}/{INDEX}: index version {obj.get('version')!r} is not supported (this tool "
                       f"reads version {VERSION})")
    names = set()
    for i, e in enumerate(obj["entries"]):
        missing = [k for k in ENTRY_FIELDS if not isinstance(e, dict) or k not in e]
        if missing:
            raise ZooError(f"{label}/{INDEX}: entry {i} lacks {missing}")
        if e["name"] in names:
            raise ZooError(f"{label}/{INDEX}: entry name {e['name']!r} appears twice")
        if Path(e["file"]).is_absolute() or ".." in Path(e["file"]).parts:
            raise ZooError(f"{label}/{INDEX}: entry {e['name']!r} file {e['file']!r} must be relative to the zoo")
        names.add(e["name"])
    return obj["entries"]


def read_index(zoo: Optional[str] = None) -> list[dict]:
    src = _source(zoo)
    return _parse_index(src.index_text(), src.label)


def _write_index(root: Path, entries: list[dict]) -> None:
    body = {"format": FORMAT, "version": VERSION, "entries": sorted(entries, key=lambda e: e["name"])}
    tmp = root / (INDEX + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, root / INDEX)  # a crash never leaves a half-written index


def _entry(entries: list[dict], name: str, label: str) -> dict:
    for e in entries:
        if e["name"] == name:
            return e
    known = ", ".join(e["name"] for e in entries) or "(empty)"
    raise ZooError(f"{label}: no entry named {name!r}; entries: {known}")


# ----------------------------------------------------------------------------- checks
def check_file(path: Path, entry: dict, label: str) -> None:
    """Size and sha256 of one file against its index entry (size first: it is free)."""
    size = path.stat().st_size
    if size != entry["size"]:
        raise ZooError(f"{label}: {entry['file']} (entry {entry['name']!r}) is corrupted: size {size} bytes, "
                       f"index says {entry['size']}; re-download it")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ZooError(f"{label}: {entry['file']} (entry {entry['name']!r}) is corrupted: sha256 mismatch\n"
                       f"  expected {entry['sha256']}\n  actual   {digest}\nre-download it")


def model_shape(config_path) -> dict:
    """(layers, kv_heads, head_dim) of a transformers config.json; multimodal text_config understood."""
    try:
        shape = shape_from_config(json.loads(Path(config_path).read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:  # ModelError is a ValueError
        raise ZooError(f"{config_path}: cannot read the model config ({e})") from None
    return dict(layers=shape["num_layers"], kv_heads=shape["kv_heads"], head_dim=shape["head_dim"])


def load_checked(path: Path, entry: dict, label: str, shape: Optional[dict] = None):
    """Checksum, full bundle validation, index-vs-bundle agreement and (optional) model agreement."""
    check_file(path, entry, label)
    try:
        kw = {} if shape is None else dict(expect_layers=shape["layers"], expect_kv_heads=shape["kv_heads"],
                                           expect_head_dim=shape["head_dim"])
        b = load_bundle(path, **kw)
    except BundleError as e:
        raise ZooError(f"{label}: entry {entry['name']!r}: {e}") from None
    have = dict(layers=b.num_layers, kv_heads=b.kv_heads, head_dim=b.head_dim, bits=b.bits, k_group=b.k_group,
                v_group=b.v_group)
    wrong = {k: (entry[k], v) for k, v in have.items() if entry[k] != v}
    if wrong:
        detail = ", ".join(f"{k}: index {a} vs bundle {v}" for k, (a, v) in wrong.items())
        raise ZooError(f"{label}/{INDEX}: entry {entry['name']!r} disagrees with its bundle ({detail})")
    return b


# -------------------------------------------------------------------------------- commands
def add(bundle_path, zoo_dir, name: str, model_id: Optional[str] = None, force: bool = False) -> dict:
    """Copy a (validated) bundle into a local zoo and record it; returns the new index entry."""
    if not _NAME_RE.match(name):
        raise ZooError(f"bad entry name {name!r}: letters, digits, '.', '_' and '-' only")
    root = Path(zoo_dir)
    entries = _parse_index((root / INDEX).read_text(encoding="utf-8"), str(root)) if (root / INDEX).exists() else []
    if any(e["name"] == name for e in entries) and not force:
        raise ZooError(f"{root}: entry {name!r} exists; pass --force to replace it")
    try:
        b = load_bundle(bundle_path)
    except BundleError as e:
        raise ZooError(f"refusing to add an invalid bundle: {e}") from None
    root.mkdir(parents=True, exist_ok=True)  # only once the bundle is known to be good
    rel = f"{name}.safetensors"
    dest = root / rel
    tmp = root / (rel + ".tmp")
    shutil.copyfile(bundle_path, tmp)
    os.replace(tmp, dest)
    entry = dict(name=name, model_id=model_id or b.model_id, file=rel, sha256=sha256_file(dest),
                 size=dest.stat().st_size, bits=b.bits, k_group=b.k_group, v_group=b.v_group, method=b.method,
                 composition=b.composition, per_head=b.per_head, center_k=b.center_k, layers=b.num_layers,
                 kv_heads=b.kv_heads, head_dim=b.head_dim, created=b.created or _now(),
                 added=_now(), calibration=b.calibration)
    _write_index(root, [e for e in entries if e["name"] != name] + [entry])
    return entry


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def get(name: str, out, zoo: Optional[str] = None, model_config=None) -> Path:
    """Fetch one entry to `out` (a file path, or a directory to put <file> in), verified."""
    shape = model_shape(model_config) if model_config else None  # before any download
    src = _source(zoo)
    entry = _entry(_parse_index(src.index_text(), src.label), name, src.label)
    path = src.fetch(entry["file"])
    load_checked(path, entry, src.label, shape)  # verify before copying: never hand out a bad file
    out = Path(out)
    if out.is_dir():
        out = out / Path(entry["file"]).name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copyfile(path, tmp)
    os.replace(tmp, out)
    check_file(out, entry, str(out.parent))  # the copy, too (a full disk truncates silently)
    return out


# The zoo a server reads when no rotation source is given: $SGLANG_OSCAR_ZOO, else the one beside this package in
# a source checkout or editable install (<repo>/zoo; a wheel has none).
PACKAGED_ZOO = Path(__file__).resolve().parents[2] / "zoo"


def server_zoo() -> Optional[str]:
    """The zoo a server without a rotation source looks its model up in, or None where there is none."""
    zoo = os.environ.get(ENV_ZOO, "").strip()
    if zoo:
        return zoo
    return str(PACKAGED_ZOO) if (PACKAGED_ZOO / INDEX).is_file() else None


def model_key(model: str) -> str:
    """The name a served model and a zoo entry's model_id are matched by: the last path part, lower case
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/smollm2-135m-instruct/" -> "smollm2-135m-instruct"); in a
    Hugging Face cache path (.../models--ORG--NAME/snapshots/<sha>) the NAME."""
    parts = Path(str(model).strip().rstrip("/\\")).parts
    for part in reversed(parts):
        if part.startswith("models--") and part.count("--") >= 2:
            return part.split("--", 2)[2].lower()
    return parts[-1].lower() if parts else ""


def _local_shape(model: str) -> Optional[dict]:
    """(layers, kv_heads, head_dim) of a local model directory's config.json, or None (a hub id, a file)."""
    cfg = Path(str(model).strip()) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return model_shape(cfg)
    except ZooError:
        return None


def find_for_model(model: str, group: Optional[int] = None, zoo: Optional[str] = None) -> Optional[tuple]:
    """(entry, verified local path) of the zoo's bundle for `model` (model_key match; for a local directory also the
    same layers, KV heads and head_dim as its config.json) with K and V groups of `group` (None: the served group 64
    if the zoo has it, else the model's only entry), or None where the zoo has none. A checksum mismatch raises
    ZooError: a corrupted published bundle is never served, nor silently skipped."""
    from .config import SERVED_GROUP

    src = _source(zoo)
    key = model_key(model)
    shape = _local_shape(model)
    found = [e for e in _parse_index(src.index_text(), src.label) if model_key(e["model_id"]) == key
             and e["k_group"] == e["v_group"] and (group is None or e["k_group"] == group)
             and (shape is None or all(e[k] == v for k, v in shape.items()))]
    if group is None and len(found) > 1:
        found = [e for e in found if e["k_group"] == SERVED_GROUP]
    if len(found) != 1:
        return None
    path = src.fetch(found[0]["file"])
    check_file(path, found[0], src.label)
    return found[0], path


def verify(zoo: Optional[str] = None, name: Optional[str] = None, model_config=None) -> list[tuple[str, str]]:
    """[(entry name, "ok" or the error)] for every entry (or one); never stops at the first failure."""
    shape = model_shape(model_config) if model_config else None  # before any download
    src = _source(zoo)
    entries = _parse_index(src.index_text(), src.label)
    if name is not None:
        entries = [_entry(entries, name, src.label)]
    out = []
    for e in entries:
        try:
            load_checked(src.fetch(e["file"]), e, src.label, shape)
            out.append((e["name"], "ok"))
        except ZooError as err:
            out.append((e["name"], str(err)))
    return out


def format_table(entries: list[dict]) -> str:
    cols = ("name", "model_id", "method", "bits", "k_group", "v_group", "layers", "kv_heads", "head_dim", "size")
    rows = [[str(e.get(c, "")) for c in cols] for e in entries]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_oscar.zoo", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    zoo_help = f"zoo directory or hf:OWNER/REPO (default ${ENV_ZOO}, else ./zoo)"
    s = sub.add_parser("list", help="print the entries")
    s.add_argument("--zoo", default=None, help=zoo_help)
    s.add_argument("--json", action="store_true", help="print the index entries as JSON")
    s = sub.add_parser("get", help="fetch one bundle, verified")
    s.add_argument("name")
    s.add_argument("--out", required=True, help="output file (or an existing directory)")
    s.add_argument("--zoo", default=None, help=zoo_help)
    s.add_argument("--model-config", default=None, help="config.json of the model to check the bundle against")
    s = sub.add_parser("verify", help="checksum and validate every entry")
    s.add_argument("--zoo", default=None, help=zoo_help)
    s.add_argument("--name", default=None, help="only this entry")
    s.add_argument("--model-config", default=None, help="config.json of the model to check the bundles against")
    s = sub.add_parser("add", help="add a bundle to a local zoo")
    s.add_argument("bundle")
    s.add_argument("--zoo", required=True, help="local zoo directory (created if missing)")
    s.add_argument("--name", required=True)
    s.add_argument("--model", default=None, help="model id to record (default: the bundle's model_id)")
    s.add_argument("--force", action="store_true", help="replace an existing entry of that name")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "list":
            entries = read_index(args.zoo)
            print(json.dumps(entries, indent=2) if args.json else format_table(entries))
        elif args.cmd == "get":
            print(f"wrote {get(args.name, args.out, args.zoo, args.model_config)} (sha256 and bundle verified)")
        elif args.cmd == "verify":
            results = verify(args.zoo, args.name, args.model_config)
            for name, status in results:
                print(f"{name}: {status}")
            bad = sum(s != "ok" for _, s in results)
            print(f"{len(results) - bad}/{len(results)} entries ok")
            return 1 if bad else 0
        elif args.cmd == "add":
            e = add(args.bundle, args.zoo, args.name, args.model, args.force)
            print(f"added {e['name']} -> {Path(args.zoo) / e['file']} sha256={e['sha256']}")
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
