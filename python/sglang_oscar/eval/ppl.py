"""Teacher-forced perplexity, exact or through a MixedCacheSimulator.

One forward per window, no KV cache. With a simulator the window runs in the simulator's mode
(use mode="decode": every position then sees the history the server would have quantized by the
time it decoded that position). The PPL of a window is exp(mean NLL of its len−1 predicted
tokens); the reported `mean` is the mean of the per-window PPLs (not exp of the pooled NLL), so
each window weighs the same whatever its content; `std` is the population std over windows.

The LM head is applied in chunks of positions: a full [S, vocab] fp32 logit tensor is 1.6 GB for
SmolLM2 at 8k, the chunks keep it at a few hundred MB.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .simulator import MixedCacheSimulator

_HEAD_CHUNK = 1024


def window_nll(model, ids: Sequence[int]) -> float:
    """Mean next-token NLL (nats) of one window, teacher-forced, under whatever attention is installed."""
    if len(ids) < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {len(ids)}")
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    hidden = model.get_decoder()(input_ids=x, use_cache=False).last_hidden_state[0, :-1]
    target = x[0, 1:]
    head = model.get_output_embeddings()
    total = 0.0
    for a in range(0, target.shape[0], _HEAD_CHUNK):
        logits = head(hidden[a : a + _HEAD_CHUNK]).float()
        total += F.cross_entropy(logits, target[a : a + _HEAD_CHUNK], reduction="sum").item()
    return total / target.shape[0]


@torch.no_grad()
def perplexity(model, windows: list[list[int]], sim: Optional[MixedCacheSimulator] = None, progress: bool = True) -> dict:
    """dict(mean, per_window, std, min, max) of per-window perplexities; sim=None: the exact model."""
    if not windows:
        raise ValueError("perplexity needs at least one window")
    ctx = sim.attach(model) if sim is not None else contextlib.nullcontext()
    ppls = []
    with ctx:
        for w in tqdm(windows, desc="ppl", disable=not progress):
            if sim is not None:
                sim.reset()
            ppls.append(math.exp(window_nll(model, w)))
    t = torch.tensor(ppls, dtype=torch.float64)
    return dict(mean=float(t.mean()), per_window=ppls, std=float(t.std(unbiased=False)),
                min=float(t.min()), max=float(t.max()))
