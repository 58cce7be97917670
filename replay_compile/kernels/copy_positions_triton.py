"""Triton kernel of ``replay_compile::copy_positions``: each row's ``T`` source positions of a static key or value
cache copied to that row's destination positions, in place (same contract as the op's eager form, which the CPU
runs).

Grid ``(batch, heads, cdiv(D, BLOCK_D))``: a program loads its ``[T, BLOCK_D]`` source tile before it stores, so
destinations may overlap the source positions; programs touch disjoint (row, head, column) slices. PyTorch's
``scatter_`` with the index expanded over heads and head dims read 8 index bytes per 2-byte element through its
generic strided path. A destination outside ``[0, S)`` is not written (the op's eager form raises for it; a kernel
cannot, and the speculative rounds build their destinations inside the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch


@triton.jit
def _copy_positions_kernel(cache_ptr, dest_ptr, start, S, T, D,
                           s_cb, s_ch, s_cs, s_cd, s_db, s_dt,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    base = cache_ptr + row * s_cb + h * s_ch
    src = tl.load(base + (start + offs_t)[:, None] * s_cs + offs_d[None, :] * s_cd, mask=mask)
    pos = tl.load(dest_ptr + row * s_db + offs_t * s_dt, mask=offs_t < T, other=-1)
    ok = mask & ((pos >= 0) & (pos < S))[:, None]
    tl.store(base + pos[:, None] * s_cs + offs_d[None, :] * s_cd, src, mask=ok)


def copy_positions_triton(cache: torch.Tensor, start: int, dest: torch.Tensor) -> None:
    """``cache`` [b, H, S, D]: positions ``[start, start + T)`` of each row copied to ``dest`` [b, T] (int64), in
    place; arguments checked by the op."""
    b, H, S, D = cache.shape
    T = dest.shape[1]
    if b == 0 or T == 0 or H == 0 or D == 0:
        return
    block_d = min(next_pow2(D), 128)
    launch(_copy_positions_kernel)[(b, H, cdiv(D, block_d))](
        cache, dest, start, S, T, D, *cache.stride(), *dest.stride(),
        BLOCK_T=max(next_pow2(T), 1), BLOCK_D=block_d, num_warps=1 if block_d * T <= 1024 else 4)
