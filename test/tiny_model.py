"""Stand-ins for the CLI tests (no download, no model files): a byte tokenizer, and the CLIs' loaders patched to
answer the name "tiny" (calibrate: a tiny random Llama, models.tiny_llama; eval.bench: the byte tokenizer)."""

from sglang_oscar import models

TINY_NAME = "tiny"  # the --model name the patched loader answers to
TINY_ID = "tiny-llama (random, tests only)"


class ByteTokenizer:
    """ids = UTF-8 bytes (the tiny model's vocabulary of 512 covers them)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


def patch_calibrate_model(monkeypatch) -> None:
    """`python -m sglang_oscar.calibrate --model tiny` loads the tiny random Llama and reads its shape, in memory."""
    from sglang_oscar import calibrate

    model = models.tiny_llama()
    real_load, real_shape = models.load_model, calibrate.model_attention_shape

    def load(name, *args, device="cpu", **kwargs):
        if name != TINY_NAME:
            return real_load(name, *args, device=device, **kwargs)
        return model.to(device), ByteTokenizer(), TINY_ID

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(calibrate, "model_attention_shape",
                        lambda name: models.attention_shape(model) if name == TINY_NAME else real_shape(name))


def patch_bench_tokenizer(monkeypatch) -> None:
    """`python -m sglang_oscar.eval.bench ruler --tokenizer tiny` sizes its prompts with the byte tokenizer."""
    from sglang_oscar.eval import bench

    real = bench._tokenizer
    monkeypatch.setattr(bench, "_tokenizer", lambda name: ByteTokenizer() if name == TINY_NAME else real(name))
