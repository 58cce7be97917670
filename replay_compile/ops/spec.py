"""The family-agnostic half of speculative decoding with the replay state.

``replay_compile::spec_commit``  accept ``n`` tokens per row of the last verify (Mamba-2 or delta rule): cursor
                                 moves only; rejected drafts are simply not counted (rollback without a copy).
``replay_compile::copy_positions``  the attention side of a commit: copy a verify's ``T`` scratch positions of a
                                 static key or value cache to each row's own positions, in place (CUDA:
                                 :mod:`~replay_compile.kernels.copy_positions_triton`).

CPU: :func:`~replay_compile.kernels.mamba2_spec_reference.spec_commit_reference` (the ring, cursors and flush rule
are documented there); CUDA: :func:`~replay_compile.kernels.mamba2_spec_triton.spec_commit_triton` (one launch, no
host synchronisation, so it can sit in a CUDA graph; an invalid accepted count poisons the row's cursor so that its
next verify returns NaN, since a kernel cannot raise).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import mamba2_spec_reference as ref
from .library import replay_op, use_triton


def check_spec_cursors(op: str, state: Tensor, buf: int, w: Tensor, origin: Tensor, is_flush: Tensor) -> None:
    """Cursor dtypes/shapes and a power-of-two ring length; a clear ``ValueError`` naming the op otherwise."""
    S = state.shape[0]
    for name, t, dt in (("w", w, torch.int32), ("origin", origin, torch.int32), ("is_flush", is_flush, torch.bool)):
        if tuple(t.shape) != (S,) or t.dtype != dt:
            raise ValueError(f"replay_compile.{op}: {name} must be {dt} [S={S}], got {t.dtype} {tuple(t.shape)}")
    if buf & (buf - 1):
        raise ValueError(f"replay_compile.{op}: the ring length must be a power of two (spec_buf_len(B, T)), "
                         f"got {buf}")


@replay_op("replay_compile::spec_commit", mutates_args=("w", "origin", "is_flush"))
def spec_commit(w: Tensor, origin: Tensor, is_flush: Tensor, n_accepted: Tensor, B: int, T: int,
                slot_idx: Optional[Tensor] = None) -> None:
    """Accept ``n_accepted`` [b] (each in 1..T) tokens of the last verify; see :func:`spec_commit_reference`."""
    if n_accepted.dim() != 1:
        raise ValueError(f"replay_compile.spec_commit: n_accepted must be [b], got {tuple(n_accepted.shape)}")
    if w.is_cuda and use_triton():
        from ..kernels.mamba2_spec_triton import spec_commit_triton  # one launch, no host sync: CUDA-graph safe
        return spec_commit_triton(w, origin, is_flush, n_accepted, B, T, ref.spec_buf_len(B, T), slot_idx)
    ref.spec_commit_reference(w, origin, is_flush, n_accepted, B, T, ref.spec_buf_len(B, T), slot_idx)


@spec_commit.register_fake
def _(w, origin, is_flush, n_accepted, B, T, slot_idx=None):
    return None


@replay_op("replay_compile::copy_positions", mutates_args=("cache",))
def copy_positions(cache: Tensor, start: int, dest: Tensor) -> None:
    """Copy the ``T`` positions ``[start, start + T)`` of ``cache`` [b, H, S, D] to each row's positions ``dest``
    [b, T] (int64, each in ``[0, S)``), in place. The source positions are read before any is written, so ``dest``
    may overlap them.

    An op rather than the same two torch calls in the traced round: functionalised, ``cache.scatter_`` became a
    clone of the whole cache, a scatter into the clone and a copy back, which Inductor did not re-inplace (the
    slice read beside it kept the original alive). At batch 256 with a 1,056-position cache (Qwen3.5-4B dims, 8
    attention layers, H100) that was 11.3 ms of a 45 ms round for the ``T = 4`` positions a row keeps."""
    if cache.dim() != 4 or dest.dim() != 2 or dest.shape[0] != cache.shape[0] or dest.dtype != torch.long:
        raise ValueError(f"replay_compile.copy_positions: cache must be [b, H, S, D] and dest int64 [b, T], got cache "
                         f"{tuple(cache.shape)}, dest {dest.dtype} {tuple(dest.shape)}")
    b, H, S, D = cache.shape
    T = dest.shape[1]
    if not 0 <= start <= S - T:
        raise ValueError(f"replay_compile.copy_positions: source positions [{start}, {start + T}) outside the "
                         f"cache's {S}")
    if cache.is_cuda and use_triton():
        from ..kernels.copy_positions_triton import copy_positions_triton  # one launch, CUDA-graph safe
        return copy_positions_triton(cache, start, dest)
    src = cache[:, :, start:start + T].clone()
    cache.scatter_(2, dest[:, None, :, None].expand(b, H, T, D), src)


@copy_positions.register_fake
def _(cache, start, dest):
    return None
