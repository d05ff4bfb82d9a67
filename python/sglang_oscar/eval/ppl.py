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


def window_nll(model, ids: Sequence[int], prefixes: Sequence[int] = ()):
    """Mean next-token NLL (nats) of one window, teacher-forced, under whatever attention is installed.

    With `prefixes`, also return {n: mean NLL of the first n tokens' window} from the same forward:
    attention is causal, so positions < n see exactly what an n-token window would.
    """
    if len(ids) < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {len(ids)}")
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    hidden = model.get_decoder()(input_ids=x, use_cache=False).last_hidden_state[0, :-1]
    target = x[0, 1:]
    head = model.get_output_embeddings()
    nll = torch.cat([F.cross_entropy(head(hidden[a : a + _HEAD_CHUNK]).float(), target[a : a + _HEAD_CHUNK],
                                     reduction="none") for a in range(0, target.shape[0], _HEAD_CHUNK)])
    mean = float(nll.mean())
    if not prefixes:
        return mean
    for n in prefixes:
        if not 2 <= n <= len(ids):
            raise ValueError(f"prefix {n} outside [2, {len(ids)}]")
    return mean, {n: float(nll[: n - 1].mean()) for n in prefixes}


@torch.no_grad()
def perplexity(model, windows: list[list[int]], sim: Optional[MixedCacheSimulator] = None, progress: bool = True,
               prefixes: Sequence[int] = ()) -> dict:
    """dict(mean, per_window, std, min, max) of per-window perplexities; sim=None: the exact model.

    prefixes: also report each window's first-n-token perplexity (same forward), under
    result["prefix"][n] with the same keys.
    """
    if not windows:
        raise ValueError("perplexity needs at least one window")
    ctx = sim.attach(model) if sim is not None else contextlib.nullcontext()
    ppls, pre = [], {n: [] for n in prefixes}
    with ctx:
        for w in tqdm(windows, desc="ppl", disable=not progress):
            if sim is not None:
                sim.reset()
            if prefixes:
                full, parts = window_nll(model, w, prefixes)
                for n in prefixes:
                    pre[n].append(math.exp(parts[n]))
            else:
                full = window_nll(model, w)
            ppls.append(math.exp(full))
    out = _summary(ppls)
    if prefixes:
        out["prefix"] = {n: _summary(v) for n, v in pre.items()}
    return out


def _summary(ppls: list[float]) -> dict:
    t = torch.tensor(ppls, dtype=torch.float64)
    return dict(mean=float(t.mean()), per_window=ppls, std=float(t.std(unbiased=False)),
                min=float(t.min()), max=float(t.max()))
