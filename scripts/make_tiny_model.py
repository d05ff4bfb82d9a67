#!/usr/bin/env python
"""Write a tiny random Llama / Qwen2 / Qwen3 checkpoint + a trained byte-level BPE tokenizer (no downloads).

For CPU integration tests of the SGLang plugin: the real server needs a model directory with a
config, weights and a tokenizer (text routes, chat template). The weights are random (seeded), so
outputs are meaningless but deterministic; the tokenizer is trained on this repository's own
Python sources, so it is a real BPE with merges, not a toy character map.

    python scripts/make_tiny_model.py OUT_DIR [--arch qwen3|llama|qwen2] [--layers 2] [--head-dim 64]
                                      [--heads 4] [--kv-heads 2]

Defaults keep head_dim, GQA and layer count inside what the OSCAR kernels support (head_dim 64,
4 query heads over 2 KV heads), and the model small enough that a CPU server starts in seconds.
--heads 8 --kv-heads 8 gives every rank of a TP=8 server one KV head (hidden stays 256: Qwen3 and
Llama take head_dim explicitly, so heads x head_dim need not equal hidden).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # id 0 = eos/pad
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_REPO = Path(__file__).resolve().parents[1]


def _training_text() -> list[str]:
    """This repository's Python sources: enough varied text for ~1k merges, always present."""
    files = sorted((_REPO / "python").rglob("*.py")) + sorted((_REPO / "test").glob("*.py"))
    text = [f.read_text(errors="ignore") for f in files]
    if sum(map(len, text)) < 100_000:
        raise RuntimeError(f"too little training text under {_REPO}/python for a BPE tokenizer")
    return text


def make_tokenizer(vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   bos_token=None, unk_token=None, chat_template=CHATML)


def make_tiny_model(out_dir, *, arch: str = "qwen3", layers: int = 2, hidden: int = 256, heads: int = 4,
                    kv_heads: int = 2, head_dim: int = 64, intermediate: int = 512, vocab_size: int = 1024,
                    max_positions: int = 4096, seed: int = 0) -> Path:
    """Create the model directory and return its path."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
                  bos_token_id=None)
    if arch == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":  # q/k/v biases (the V-absorption tests need a nonzero v bias)
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"arch must be qwen3, llama or qwen2, got {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.bfloat16)
    with torch.no_grad():  # random init at a scale that keeps logits varied but finite
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
            elif name.endswith("_proj.bias"):  # zero by default: make them matter
                p.normal_(0.0, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # SGLang reads generation defaults from here; make greedy stop on id 0 like the tokenizer.
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 0}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama", "qwen2"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads (divides --heads)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        ap.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    print(make_tiny_model(a.out_dir, arch=a.arch, layers=a.layers, head_dim=a.head_dim, heads=a.heads,
                          kv_heads=a.kv_heads, seed=a.seed))


if __name__ == "__main__":
    main()
