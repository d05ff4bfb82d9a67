"""Accuracy harness: fake-quantized KV-cache simulator, perplexity, attention errors, NIAH."""

from .attention_metrics import attention_errors
from .niah import NiahSample, make_samples, run_niah, string_match_all
from .ppl import perplexity
from .simulator import MixedCacheSimulator

__all__ = ["MixedCacheSimulator", "NiahSample", "attention_errors", "make_samples", "perplexity", "run_niah",
           "string_match_all"]
