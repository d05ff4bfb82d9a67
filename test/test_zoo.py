"""Rotation zoo: add/list/get/verify round trip, corruption and model-shape mismatches (tiny bundles)."""

import json

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
    import pathlib

    repo_zoo = pathlib.Path(__file__).resolve().parents[1] / "zoo"
    assert isinstance(zoo.read_index(str(repo_zoo)), list)
