"""``replay_compile::decode_attention``: the new tokens of each row (one for a decode step, a window of ``T`` for a
speculative verify) attending over a key/value cache, grouped-query heads read once (shapes and semantics in
:mod:`replay_compile.kernels.decode_attention_reference`).

The CPU implementation is the reference; on CUDA the split-K Triton kernel of
:mod:`replay_compile.kernels.decode_attention_triton` (``REPLAY_COMPILE_KERNELS=reference`` bypasses it; float64
inputs always take the reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import decode_attention_reference as ref
from .library import replay_op, use_triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(f"replay_compile.decode_attention: {msg}")


def check_args(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> None:
    """Raise a ValueError naming the argument, its shape or dtype, and what is expected."""
    if q.dim() != 4:
        _fail(f"q must be [b, H, T, dk], got shape {tuple(q.shape)}")
    b, H, T, dk = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != dk:
        _fail(f"k must be [b={b}, KV, S, dk={dk}], got {tuple(k.shape)}")
    KV, S = k.shape[1], k.shape[2]
    if KV == 0 or H % KV:
        _fail(f"the {H} query heads must be a multiple of the {KV} key/value heads")
    if v.dim() != 4 or tuple(v.shape[:3]) != (b, KV, S):
        _fail(f"v must be [b={b}, KV={KV}, S={S}, dv], got {tuple(v.shape)}")
    if mask.dim() != 3 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, T) or mask.shape[2] != S:
        _fail(f"mask must be [b={b} or 1, T={T} or 1, S={S}], got {tuple(mask.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            _fail(f"{name} dtype {t.dtype} unsupported; use one of {FLOAT_DTYPES}")
        if t.stride(-1) != 1:
            _fail(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if not q.dtype == k.dtype == v.dtype:
        _fail(f"q, k and v must share a dtype (as for scaled_dot_product_attention), got {q.dtype} / {k.dtype} / "
              f"{v.dtype}")
    if mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
        _fail(f"mask must be bool (True: attend) or a float additive mask, got {mask.dtype}")
    if mask.stride(-1) != 1:
        _fail(f"mask must have a unit stride in its last dimension, got strides {mask.stride()}")
    devs = {t.device for t in (q, k, v, mask)}
    if len(devs) != 1:
        _fail(f"q, k, v and mask must share one device, got {sorted(map(str, devs))}")


@replay_op("replay_compile::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(scale * q k^T + mask) v per row, query head ``h`` over key/value head ``h // (H // KV)``."""
    check_args(q, k, v, mask)
    return ref.decode_attention_reference(q, k, v, mask, scale)


@decode_attention.register_kernel("cuda")
def _(q, k, v, mask, scale):
    check_args(q, k, v, mask)
    if not use_triton() or q.dtype == torch.float64:
        return ref.decode_attention_reference(q, k, v, mask, scale)
    from ..kernels.decode_attention_triton import decode_attention_triton  # lazily: triton is only needed on GPUs

    return decode_attention_triton(q, k, v, mask, scale)


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty((*q.shape[:3], v.shape[-1]))
