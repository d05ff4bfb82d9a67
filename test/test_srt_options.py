"""srt/options.py: flags and seed env vars -> OscarServeConfig, and clear errors."""

import pytest

from sglang_oscar.srt import options as o


@pytest.fixture
def files(tmp_path):
    paths = {}
    for n in ("b.safetensors", "k.pt", "v.pt"):
        p = tmp_path / n
        p.write_bytes(b"x")
        paths[n] = str(p)
    return paths


def env(**kw):
    return {getattr(o, "ENV_" + k): str(v) for k, v in kw.items()}


def test_defaults_with_bundle(files):
    c = o.from_env(env(BUNDLE=files["b.safetensors"]))
    assert (c.sink, c.recent, c.window_dtype, c.scale_dtype) == (64, 256, "bfloat16", "float8_e4m3fn")
    assert c.group_size is None and c.absorb_v_rotation and c.k_clip is None
    assert c.rotation_source == "bundle" and c.resolve_group(128) == 64


def test_seed_variables(files):
    c = o.from_env(env(K_PATH=files["k.pt"], V_PATH=files["v.pt"], K_CLIP="0.96", V_CLIP="0", ABSORB_V="1",
                       PREFIX=64, RECENT=256, WINDOWS=1, HP_DTYPE="bf16", SCALE_DTYPE="float8_e4m3fn"))
    assert c.rotation_source == "seed" and c.k_clip == 0.96 and c.v_clip == 1.0  # seed's 0 = no clip


def test_current_parses_once_per_process(monkeypatch, files):
    """options.current(): one parse per process, reused by every hook, the pool and the backend; parsed again only
    when an int2 variable changes (the launcher's hook sets the group's)."""
    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(o.ENV_BUNDLE, "builtin:hadamard")
    parses = []
    real = o.from_env
    monkeypatch.setattr(o, "from_env", lambda *a, **k: parses.append(1) or real(*a, **k))
    monkeypatch.setattr(o, "_CURRENT", [])  # a fresh process
    first = o.current()
    assert o.current() is first and o.current() is first and len(parses) == 1
    monkeypatch.setenv(o.ENV_GROUP, "64")
    assert o.current().group_size == 64 and len(parses) == 2
    assert o.current().group_size == 64 and len(parses) == 2


@pytest.mark.parametrize("kw, msg", [
    (dict(SCALE_DTYPE="float32"), "store scale and min as float8 e4m3"),
    (dict(SCALE_DTYPE="bfloat16"), "store scale and min as float8 e4m3"),
    (dict(GROUP=16), "not supported by the OSCAR kernels"),
    (dict(GROUP=96), "not supported by the OSCAR kernels"),
    (dict(K_CLIP="1.5"), "outside (0, 1]"),
    (dict(V_CLIP="-0.1"), "outside (0, 1]"),
    (dict(K_CLIP="abc"), "not a number"),
    (dict(WINDOWS="0"), "windows are part of the format"),
    (dict(RECENT="0"), "must be >= 1"),
    (dict(PREFIX="-1"), "must be >= 0"),
    (dict(HP_DTYPE="int8"), "not a dtype"),
    (dict(ABSORB_V="maybe"), "not a boolean"),
    (dict(GROUP="x"), "not an integer"),
])
def test_bad_values(kw, msg):
    with pytest.raises(o.OscarOptionError, match=__import__("re").escape(msg)):
        o.from_env({**env(BUNDLE="builtin:identity"), **env(**kw)})


def test_rotation_sources(files):
    with pytest.raises(o.OscarOptionError, match="K and V pair"):
        o.from_env(env(K_PATH=files["k.pt"]))
    with pytest.raises(o.OscarOptionError, match="K and V pair"):
        o.from_env(env(V_PATH=files["v.pt"]))
    with pytest.raises(o.OscarOptionError, match="give one rotation source"):
        o.from_env(env(BUNDLE=files["b.safetensors"], K_PATH=files["k.pt"], V_PATH=files["v.pt"]))
    with pytest.raises(o.OscarOptionError, match="needs rotations"):
        o.from_env({})
    with pytest.raises(o.OscarOptionError, match="file not found"):
        o.from_env(env(BUNDLE="/nonexistent.safetensors"))
    with pytest.raises(o.OscarOptionError, match="unknown builtin"):
        o.from_env(env(BUNDLE="builtin:pca"))


def test_group_vs_head_dim():
    c = o.from_env(env(BUNDLE="builtin:identity", GROUP=128))
    with pytest.raises(o.OscarOptionError, match=r"--kv-cache-quant-group-size 128 is larger than head_dim 64; use one of \[32, 64\]$"):
        c.resolve_group(64)


def test_default_rotation_source_gives_way_to_the_users(monkeypatch, files, tmp_path):
    for name in o.ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGLANG_OSCAR_ZOO", str(tmp_path / "no_zoo_here"))
    with pytest.raises(o.OscarOptionError, match="the zoo it would be read from failed"):
        o.ensure_rotation_source("org/some-model")
    monkeypatch.delenv("SGLANG_OSCAR_ZOO")  # the checkout's zoo: no bundle for this model
    line = o.ensure_rotation_source("org/some-model", 64)
    assert line.startswith("rotations: data-free Hadamard") and "some-model at groups of 64" in line
    assert o.from_env().bundle_path == "builtin:hadamard"
    assert o.ensure_rotation_source("org/some-model", 64) is None  # already chosen: nothing new to say
    monkeypatch.setenv(o.ENV_K_PATH, files["k.pt"])  # the user's seed pair, set afterwards, wins
    monkeypatch.setenv(o.ENV_V_PATH, files["v.pt"])
    assert o.ensure_rotation_source("org/some-model", 64) is None
    assert o.from_env().rotation_source == "seed"
    monkeypatch.delenv(o.ENV_K_PATH)
    monkeypatch.delenv(o.ENV_V_PATH)
    monkeypatch.setenv(o.ENV_BUNDLE, files["b.safetensors"])  # and so does a bundle
    assert o.ensure_rotation_source("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert o.from_env().bundle_path == files["b.safetensors"]
    monkeypatch.delenv(o.ENV_BUNDLE)
    line = o.ensure_rotation_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "smollm2-135m-instruct_int2_best_g64" in line and o.from_env().bundle_path.endswith("_g64.safetensors")


def test_env_group_is_the_one_parse_of_the_group_variable():
    """The launcher's hook (rotation default) and from_env read the group variable through env_group: unset or
    blank is None, a supported group passes, anything else fails with the variable's name."""
    assert o.env_group({}) is None and o.env_group({o.ENV_GROUP: " "}) is None
    assert o.env_group({o.ENV_GROUP: "64"}) == 64
    with pytest.raises(o.OscarOptionError, match=o.ENV_GROUP):
        o.env_group({o.ENV_GROUP: "sixty-four"})
    with pytest.raises(o.OscarOptionError, match="not supported"):
        o.env_group({o.ENV_GROUP: "48"})
    assert o.from_env({o.ENV_GROUP: "128", o.ENV_BUNDLE: "builtin:hadamard"}).group_size == 128


def test_every_variable_is_in_the_serving_doc():
    """docs/serving.md's table lists every variable the server reads: the options (ALL_ENV) and the two read where
    they are used (the zoo, the CUDA build cache)."""
    from pathlib import Path

    from sglang_oscar import zoo
    from sglang_oscar.kernels import cuda_build

    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    missing = [n for n in o.ALL_ENV + (zoo.ENV_ZOO, cuda_build.ENV_CACHE) if f"`{n}`" not in doc]
    assert not missing, missing
