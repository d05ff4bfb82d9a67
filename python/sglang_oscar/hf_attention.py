"""Run our own attention function inside a transformers model (calibration capture, simulator).

transformers calls the registered function with post-norm, post-RoPE tensors, exactly what a
serving engine's attention backend receives:
    query [B, Hq, T, D], key/value [B, Hkv, S, D] (S includes cached positions; the T queries
    are the last T positions). The function given to attention_override returns output [B, T, Hq, D].
Models are run unpadded (batch of equal-length rows), so causality comes from positions.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

_NAME = "sglang_oscar"
_stack: list[Callable] = []


def _dispatch(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _stack:
        raise RuntimeError("sglang_oscar attention called outside attention_override()")
    return _stack[-1](module, query, key, value, scaling=scaling), None


def causal_attention(query, key, value, scaling, num_kv_groups: int) -> torch.Tensor:
    """Reference attention in fp32 for unpadded rows; returns [B, T, Hq, D]."""
    T, S = query.shape[-2], key.shape[-2]
    k = key.repeat_interleave(num_kv_groups, dim=1)
    v = value.repeat_interleave(num_kv_groups, dim=1)
    scores = (query.float() @ k.float().transpose(-1, -2)) * scaling
    qpos = torch.arange(S - T, S, device=query.device)[:, None]
    kpos = torch.arange(S, device=query.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float()
    return out.transpose(1, 2).to(query.dtype)


@contextlib.contextmanager
def attention_override(model, fn: Callable):
    """Inside the block, every attention layer of `model` calls fn(module, q, k, v, scaling=...) -> out."""
    from transformers import AttentionInterface

    AttentionInterface.register(_NAME, _dispatch)
    previous = model.config._attn_implementation
    _stack.append(fn)
    model.set_attn_implementation(_NAME)
    try:
        yield
    finally:
        _stack.pop()
        model.set_attn_implementation(previous)
