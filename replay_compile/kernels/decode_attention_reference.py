"""Decode attention over a key/value cache with grouped-query heads: the reference.

A decode step attends one new token per row; a speculative verify attends a window of ``T`` tokens (the last token
and its drafts), each under its own mask row (its causal order within the window). Shapes (``G = H // KV`` query
heads share one key/value head, head ``h`` reads key/value head ``h // G``: the mapping of transformers'
``repeat_kv`` and of ``scaled_dot_product_attention(enable_gqa=True)``):

    q     [b, H, T, dk]         the queries of each row's ``T`` new tokens (``T = 1`` for a decode step)
    k     [b, KV, S, dk]        the cache's keys (every static position, filled or not)
    v     [b, KV, S, dv]        the cache's values
    mask  [b or 1, T or 1, S]   bool (True: attend) or float, added to the scaled scores (-inf: skip the position)
    scale                       the scores' factor (``1 / sqrt(dk)`` for standard attention)

    out   [b, H, T, dv]         softmax(scale * q k^T + mask) v, in q's dtype

A query whose every position is masked gets zeros (no position to average), as PyTorch's SDPA does for boolean
masks. Computed in float32 (float64 for float64 inputs); no input is written.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as scores to add: 0 / -inf for a boolean mask, the values themselves for a float one."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                               scale: float) -> torch.Tensor:
    b, H, T, dk = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    ct = compute_dtype(q, k, v)
    qg = q.to(ct).view(b, KV, G, T, dk)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k.to(ct)) * scale                   # [b, KV, G, T, S]
    scores = scores + additive_mask(mask, ct).view(mask.shape[0], 1, 1, mask.shape[1], S)
    top = scores.amax(-1, keepdim=True)
    dead = torch.isneginf(top)                                                          # every position masked
    p = torch.exp(scores - torch.where(dead, 0.0, top))
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bkgts,bksd->bkgtd", p, v.to(ct)) / torch.where(dead, 1.0, denom)
    return out.reshape(b, H, T, v.shape[-1]).to(q.dtype)
