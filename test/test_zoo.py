"""Rotation zoo: add/list/get/verify round trip, corruption and model-shape mismatches (tiny bundles),
and the entries shipped in zoo/ (checksum, metadata, a corrupted copy)."""

import json
import pathlib
import shutil

import pytest

from sglang_oscar import zoo
from sglang_oscar.rotation import data_free_bundle, save_bundle


def _bundle(tmp_path, name="b.safetensors", layers=3, kv=2, d=16, method="hadamard"):
    b = data_free_bundle(method, layers, kv, d, 16, 8)
    b.model_id = "tiny/model"
    return save_bundle(b, tmp_path / name)


def _config(tmp_path, **kw):
    cfg = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    cfg.update(kw)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_round_trip(tmp_path, capsys):
    z = tmp_path / "zoo"
    e = zoo.add(_bundle(tmp_path), z, "tiny-had")
    zoo.add(_bundle(tmp_path, "c.safetensors", method="identity"), z, "tiny-id", model_id="other/model")
    assert e["layers"] == 3 and e["kv_heads"] == 2 and e["head_dim"] == 16 and e["k_group"] == 16
    assert e["model_id"] == "tiny/model" and len(e["sha256"]) == 64
    assert [x["name"] for x in zoo.read_index(str(z))] == ["tiny-had", "tiny-id"]

    assert zoo.main(["list", "--zoo", str(z)]) == 0
    out = capsys.readouterr().out
    assert "tiny-had" in out and "other/model" in out

    got = zoo.get("tiny-had", tmp_path / "out" / "x.safetensors", str(z))
    assert got.read_bytes() == (z / "tiny-had.safetensors").read_bytes()
    # An existing directory as --out keeps the zoo's file name.
    (tmp_path / "d").mkdir()
    assert zoo.main(["get", "tiny-id", "--zoo", str(z), "--out", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "tiny-id.safetensors").is_file()

    assert zoo.verify(str(z)) == [("tiny-had", "ok"), ("tiny-id", "ok")]
    assert zoo.main(["verify", "--zoo", str(z), "--model-config", str(_config(tmp_path))]) == 0


def test_add_refuses_duplicates_and_bad_names(tmp_path):
    z = tmp_path / "zoo"
    zoo.add(_bundle(tmp_path), z, "a")
    with pytest.raises(zoo.ZooError, match="exists"):
        zoo.add(_bundle(tmp_path), z, "a")
    zoo.add(_bundle(tmp_path, method="identity"), z, "a", force=True)
    assert zoo.read_index(str(z))[0]["method"] == "identity"
    with pytest.raises(zoo.ZooError, match="bad entry name"):
        zoo.add(_bundle(tmp_path), z, "../evil")
    (tmp_path / "junk.safetensors").write_bytes(b"not a bundle")
    with pytest.raises(zoo.ZooError, match="invalid bundle"):
        zoo.add(tmp_path / "junk.safetensors", z, "junk")


def test_corrupted_file_names_file_and_hashes(tmp_path, capsys):
    z = tmp_path / "zoo"
    zoo.add(_bundle(tmp_path), z, "good")
    e = zoo.add(_bundle(tmp_path, method="identity"), z, "bad")
    f = z / e["file"]
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes: only the hash can tell
    f.write_bytes(bytes(data))
    res = dict(zoo.verify(str(z)))
    assert res["good"] == "ok"
    assert "bad.safetensors" in res["bad"] and "sha256 mismatch" in res["bad"]
    assert e["sha256"] in res["bad"] and zoo.sha256_file(f) in res["bad"]
    assert zoo.main(["verify", "--zoo", str(z)]) == 1
    assert "1/2 entries ok" in capsys.readouterr().out
    with pytest.raises(zoo.ZooError, match="corrupted"):
        zoo.get("bad", tmp_path / "o.safetensors", str(z))
    assert not (tmp_path / "o.safetensors").exists()  # nothing handed out

    f.write_bytes(bytes(data[:100]))  # truncated
    assert "size 100 bytes" in dict(zoo.verify(str(z)))["bad"]
    f.unlink()
    assert "missing" in dict(zoo.verify(str(z)))["bad"]


def test_model_config_mismatch(tmp_path):
    z = tmp_path / "zoo"
    zoo.add(_bundle(tmp_path), z, "t")
    assert zoo.verify(str(z), model_config=_config(tmp_path)) == [("t", "ok")]
    msg = dict(zoo.verify(str(z), model_config=_config(tmp_path, num_hidden_layers=4)))["t"]
    assert "3 layers" in msg and "has 4" in msg
    assert "KV heads" in dict(zoo.verify(str(z), model_config=_config(tmp_path, num_key_value_heads=8)))["t"]
    # explicit head_dim wins over hidden_size / heads
    assert "head_dim" in dict(zoo.verify(str(z), model_config=_config(tmp_path, head_dim=32)))["t"]
    nested = tmp_path / "vlm.json"
    nested.write_text(json.dumps({"text_config": json.loads(_config(tmp_path).read_text())}))
    assert zoo.model_shape(nested) == dict(layers=3, kv_heads=2, head_dim=16)


def test_index_errors_and_sources(tmp_path, monkeypatch):
    z = tmp_path / "zoo"
    z.mkdir()
    with pytest.raises(zoo.ZooError, match="no index.json"):
        zoo.read_index(str(z))
    (z / "index.json").write_text("{")
    with pytest.raises(zoo.ZooError, match="not valid JSON"):
        zoo.read_index(str(z))
    (z / "index.json").write_text(json.dumps({"format": zoo.FORMAT, "version": 1, "entries": [{"name": "x"}]}))
    with pytest.raises(zoo.ZooError, match="lacks"):
        zoo.read_index(str(z))
    zoo.add(_bundle(tmp_path), tmp_path / "z2", "t")
    with pytest.raises(zoo.ZooError, match="no entry named 'nope'; entries: t"):
        zoo.get("nope", tmp_path / "o", str(tmp_path / "z2"))
    with pytest.raises(zoo.ZooError, match="neither a directory"):
        zoo.read_index(str(tmp_path / "missing" / "deeper" / "x"))
    # A hub repo id with no network (or no huggingface_hub) fails with a clear message, not a traceback.
    hub = pytest.importorskip("huggingface_hub")

    def unreachable(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(hub, "hf_hub_download", unreachable)
    with pytest.raises(zoo.ZooError, match="hf:nobody/nothing: cannot download index.json.*network unreachable"):
        zoo.read_index("hf:nobody/nothing")
    with pytest.raises(zoo.ZooError, match="cannot download"):
        zoo.read_index("nobody/nothing")  # a bare OWNER/REPO that is not a directory
    # The repo's own zoo directory is a valid (possibly empty) zoo.
    repo_zoo = pathlib.Path(__file__).resolve().parents[1] / "zoo"
    assert isinstance(zoo.read_index(str(repo_zoo)), list)


# ------------------------------------------------------------------ the shipped zoo/ entries
REPO_ZOO = pathlib.Path(__file__).resolve().parents[1] / "zoo"
SMOLLM2_ENTRY = "smollm2-135m-instruct_int2_best_g64"
# SmolLM2-135M-Instruct's attention shape, from the embedded GGUF's metadata (llama.block_count 30,
# attention.head_count 9, attention.head_count_kv 3, embedding_length 576; what AutoConfig derives).
SMOLLM2_CONFIG = dict(model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      hidden_size=576, head_dim=64)


def test_shipped_smollm2_entry_verifies(tmp_path, capsys):
    entries = {e["name"]: e for e in zoo.read_index(str(REPO_ZOO))}
    e = entries[SMOLLM2_ENTRY]
    # The index records what the accuracy doc calls int2_best (balanced K, K mean removed, OSCAR V, clip, G=64).
    assert e["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (e["method"], e["composition"], e["center_k"], e["per_head"]) == ("balanced", "u_h", True, False)
    assert (e["bits"], e["k_group"], e["v_group"]) == (2, 64, 64)
    assert (e["layers"], e["kv_heads"], e["head_dim"]) == (30, 3, 64)
    assert e["calibration"]["source"] == "python-stdlib-docstrings"  # calibration text, not the eval text
    assert e["calibration"]["v_method"] == "oscar"
    # fitted on the RoPE phases of the model's whole context (8k windows): see docs/results/accuracy.md
    assert max(e["calibration"].get("seq_len") or 0, e["calibration"].get("context") or 0) >= 8192
    path = REPO_ZOO / e["file"]
    assert path.stat().st_size == e["size"] < 1 << 20
    assert zoo.sha256_file(path) == e["sha256"]

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMOLLM2_CONFIG))
    assert zoo.verify(str(REPO_ZOO), name=SMOLLM2_ENTRY) == [(SMOLLM2_ENTRY, "ok")]
    assert zoo.verify(str(REPO_ZOO), name=SMOLLM2_ENTRY, model_config=cfg) == [(SMOLLM2_ENTRY, "ok")]
    assert zoo.main(["verify", "--zoo", str(REPO_ZOO), "--model-config", str(cfg)]) == 0
    assert f"{SMOLLM2_ENTRY}: ok" in capsys.readouterr().out
    b = zoo.load_checked(path, e, str(REPO_ZOO), zoo.model_shape(cfg))
    assert b.center_k and b.k_mean is not None and b.method == "balanced"

    # Another model's config is refused, naming the mismatch.
    other = tmp_path / "qwen3.json"
    other.write_text(json.dumps(dict(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                     hidden_size=4096, head_dim=128)))
    msg = dict(zoo.verify(str(REPO_ZOO), name=SMOLLM2_ENTRY, model_config=other))[SMOLLM2_ENTRY]
    assert "30 layers" in msg and "has 36" in msg

    (tmp_path / "out").mkdir()
    got = zoo.get(SMOLLM2_ENTRY, tmp_path / "out", str(REPO_ZOO), model_config=cfg)
    assert got.name == e["file"] and got.read_bytes() == path.read_bytes()


def test_shipped_smollm2_entry_corrupted_copy_fails(tmp_path, capsys):
    z = tmp_path / "zoo"
    shutil.copytree(REPO_ZOO, z)
    e = {x["name"]: x for x in zoo.read_index(str(z))}[SMOLLM2_ENTRY]
    f = z / e["file"]
    good = f.read_bytes()

    data = bytearray(good)
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: same size, only the hash can tell
    f.write_bytes(bytes(data))
    res = dict(zoo.verify(str(z)))
    msg = res[SMOLLM2_ENTRY]
    assert f"{e['file']} (entry {SMOLLM2_ENTRY!r}) is corrupted: sha256 mismatch" in msg
    assert e["sha256"] in msg and zoo.sha256_file(f) in msg and "re-download" in msg
    assert zoo.main(["verify", "--zoo", str(z)]) == 1
    out = capsys.readouterr().out
    assert "sha256 mismatch" in out and f"{len(res) - 1}/{len(res)} entries ok" in out
    with pytest.raises(zoo.ZooError, match="corrupted"):
        zoo.get(SMOLLM2_ENTRY, tmp_path / "o.safetensors", str(z))
    assert not (tmp_path / "o.safetensors").exists()  # nothing handed out

    f.write_bytes(good[:-1000])  # truncated download
    assert f"size {len(good) - 1000} bytes, index says {e['size']}" in dict(zoo.verify(str(z)))[SMOLLM2_ENTRY]

    # An index edited to match a tampered bundle still fails: the bundle's own validation runs too.
    f.write_bytes(good)
    assert dict(zoo.verify(str(z)))[SMOLLM2_ENTRY] == "ok"
    idx = json.loads((z / "index.json").read_text())
    for x in idx["entries"]:
        if x["name"] == SMOLLM2_ENTRY:
            x["kv_heads"] = 8
    (z / "index.json").write_text(json.dumps(idx))
    assert "disagrees with its bundle (kv_heads: index 8 vs bundle 3)" in dict(zoo.verify(str(z)))[SMOLLM2_ENTRY]


def test_find_for_model_matches_name_and_group(tmp_path):
    z = tmp_path / "zoo"
    b16 = data_free_bundle("hadamard", 3, 2, 16, 16, 16)
    b16.model_id = "Org/Tiny-Model"
    zoo.add(save_bundle(b16, tmp_path / "g16.safetensors"), z, "tiny-g16")
    b8 = data_free_bundle("hadamard", 3, 2, 16, 8, 8)
    b8.model_id = "Org/Tiny-Model"
    zoo.add(save_bundle(b8, tmp_path / "g8.safetensors"), z, "tiny-g8")
    assert zoo.model_key("Org/Tiny-Model") == zoo.model_key("/models/tiny-model/") == "tiny-model"
    assert zoo.model_key("/hf/hub/models--Org--Tiny-Model/snapshots/0a1b2c") == "tiny-model"
    entry, path = zoo.find_for_model("/models/tiny-model", 8, str(z))
    assert entry["name"] == "tiny-g8" and path == z / "tiny-g8.safetensors"
    assert zoo.find_for_model("Org/Tiny-Model", 16, str(z))[0]["name"] == "tiny-g16"
    assert zoo.find_for_model("Org/Tiny-Model", 32, str(z)) is None  # no entry at that group
    assert zoo.find_for_model("Org/Tiny-Model", None, str(z)) is None  # two groups, neither the served 64
    assert zoo.find_for_model("Org/Other-Model", 8, str(z)) is None
    local = tmp_path / "Tiny-Model"  # a local directory of the same name: its config must have the entry's shape
    local.mkdir()
    _config(local, head_dim=16)
    assert zoo.find_for_model(str(local), 8, str(z))[0]["name"] == "tiny-g8"
    _config(local, head_dim=16, num_hidden_layers=4)  # a same-name model of another shape: not its bundle
    assert zoo.find_for_model(str(local), 8, str(z)) is None
    (z / "tiny-g8.safetensors").write_bytes(b"x" * entry["size"])  # same size, other bytes
    with pytest.raises(zoo.ZooError, match="corrupted"):
        zoo.find_for_model("tiny-model", 8, str(z))


def test_server_zoo_is_the_env_else_the_checkout(monkeypatch):
    monkeypatch.setenv("SGLANG_OSCAR_ZOO", "/some/zoo")
    assert zoo.server_zoo() == "/some/zoo"
    monkeypatch.delenv("SGLANG_OSCAR_ZOO")
    repo_zoo = pathlib.Path(__file__).resolve().parents[1] / "zoo"
    assert zoo.server_zoo() == str(repo_zoo)
    entry, path = zoo.find_for_model("HuggingFaceTB/SmolLM2-135M-Instruct", None, zoo.server_zoo())
    assert entry["name"] == "smollm2-135m-instruct_int2_best_g64" and path == repo_zoo / entry["file"]
