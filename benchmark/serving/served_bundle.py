"""The served format for a dummy-weight model: a bundle of the served cache format without calibration data.

A calibrated bundle stores INT4 keys on a quarter of the (layer, KV head) pairs (the pairs whose INT2 keys disturb
attention most) and INT2 keys elsewhere; a model served with dummy weights has no calibration, and the server's
data-free default (builtin:hadamard) has INT2 keys everywhere: fewer bytes and a faster decode than the format whose
accuracy is published. The speed benchmarks therefore serve this bundle: Hadamard rotations, groups of 64, INT4 keys
on a quarter of the (layer, KV head) pairs (which pairs does not change the speed; spread so that every
tensor-parallel rank holds its share).

    python benchmark/serving/served_bundle.py MODEL_DIR OUT.safetensors
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LABEL = "served format without calibration (hadamard, groups of 64, INT4 keys on a quarter of the (layer, KV head) pairs)"


def k4_pairs(num_layers: int, kv_heads: int) -> list[tuple[int, int]]:
    """max_k4_heads (layer, KV head) pairs: in layer l the heads h with (l + h) % K4_HEAD_SHARE == 0, so that over
    every K4_HEAD_SHARE consecutive layers each head is INT4 once (every tensor-parallel rank, a contiguous block of
    heads, holds the same share)."""
    from sglang_oscar.config import K4_HEAD_SHARE, max_k4_heads

    pairs = [(layer, h) for layer in range(num_layers) for h in range(kv_heads) if (layer + h) % K4_HEAD_SHARE == 0]
    return pairs[: max_k4_heads(num_layers, kv_heads)]


def write_served_bundle(model_dir, out) -> Path:
    """The served-format bundle for the model whose config.json is in model_dir, saved at out."""
    from sglang_oscar.config import SERVED_GROUP
    from sglang_oscar.rotation.bundle import data_free_bundle, save_bundle

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise SystemExit(f"{cfg_path} not found: pass the model directory (config.json)")
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    layers, heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    bundle = data_free_bundle("hadamard", layers, heads, head_dim, SERVED_GROUP, SERVED_GROUP,
                              k4_heads=k4_pairs(layers, heads))
    return save_bundle(bundle, out)


def int2_bundle(model_dir, work_dir) -> tuple[str, str]:
    """(SGLANG_OSCAR_BUNDLE for the int2 servers, its label for the results): the user's $SGLANG_OSCAR_BUNDLE if set,
    else the served-format bundle of the model, written into work_dir."""
    user = os.environ.get("SGLANG_OSCAR_BUNDLE", "").strip()
    if user:
        return user, user
    out = Path(work_dir) / f"served_format_{Path(model_dir).name}.safetensors"
    return str(write_served_bundle(model_dir, out)), LABEL


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmark/serving/served_bundle.py MODEL_DIR OUT.safetensors")
    print(write_served_bundle(sys.argv[1], sys.argv[2]))
