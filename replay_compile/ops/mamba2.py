"""``torch.library`` custom ops of the Mamba-2 ReplaySSM family.

``replay_compile::mamba2_step``         one decode step: output from checkpoint + ring, record appended, flush
                                        (checkpoint written once) when the ring is full. Mutates the checkpoint,
                                        the four rings and the cursor; everything it mutates is declared.
``replay_compile::mamba2_flush``        fold all held records into the checkpoint, cursor -> 0.
``replay_compile::mamba2_materialize``  the true state after ``count`` records, out of place.

The CPU implementation is the vectorised reference in :mod:`replay_compile.kernels.mamba2_reference` (also used
on any device without a dedicated kernel); on CUDA the step runs the Triton kernels of
:mod:`replay_compile.kernels.mamba2_triton`. Shapes and the in-place contract are documented in the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import mamba2_reference as ref
from .checks import STATE_DTYPES, check_cursor_values, check_float_rings, check_token_args
from .library import replay_op, use_triton


def _fail(msg: str):
    raise ValueError(f"replay_compile.mamba2: {msg}")


def check_ring_args(state, x_ring, dt_ring, la_ring, B_ring, cursor):
    """Validate the persistent tensors; raise a ValueError naming the tensor, its shape and the fix."""
    if state.dim() != 4:
        _fail(f"state must be [S, H, P, N], got shape {tuple(state.shape)}")
    if state.dtype not in STATE_DTYPES:
        _fail(f"state dtype {state.dtype} unsupported; use one of {STATE_DTYPES}")
    check_float_rings((("x_ring", x_ring), ("B_ring", B_ring)), _fail)
    S, H, P, N = state.shape
    if x_ring.dim() != 4 or tuple(x_ring.shape[:2]) != (S, H) or x_ring.shape[3] != P:
        _fail(f"x_ring must be [S={S}, H={H}, L, P={P}], got {tuple(x_ring.shape)}")
    L = x_ring.shape[2]
    for name, t in (("dt_ring", dt_ring), ("la_ring", la_ring)):
        if tuple(t.shape) != (S, H, L):
            _fail(f"{name} must be [S={S}, H={H}, L={L}], got {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float64):
            _fail(f"{name} must be float32 (or float64), got {t.dtype}")
    if B_ring.dim() != 4 or B_ring.shape[0] != S or B_ring.shape[2] != L or B_ring.shape[3] != N:
        _fail(f"B_ring must be [S={S}, G, L={L}, N={N}], got {tuple(B_ring.shape)}")
    if H % B_ring.shape[1]:
        _fail(f"heads H={H} must be a multiple of B groups G={B_ring.shape[1]}")
    if tuple(cursor.shape) != (S,) or cursor.dtype != torch.int32:
        _fail(f"cursor must be int32 [S={S}], got {cursor.dtype} {tuple(cursor.shape)}")
    devs = {t.device for t in (state, x_ring, dt_ring, la_ring, B_ring, cursor)}
    if len(devs) != 1:
        _fail(f"state, rings and cursor must share one device, got {sorted(map(str, devs))}")


def check_step_args(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx):
    check_ring_args(state, x_ring, dt_ring, la_ring, B_ring, cursor)
    S, H, P, N = state.shape
    if x.dim() != 3 or tuple(x.shape[1:]) != (H, P):
        _fail(f"x must be [b, H={H}, P={P}], got {tuple(x.shape)}")
    b = x.shape[0]
    for name, t in (("dt", dt), ("la", la)):
        if tuple(t.shape) != (b, H):
            _fail(f"{name} must be [b={b}, H={H}], got {tuple(t.shape)}")
    if tuple(B.shape) != (b, B_ring.shape[1], N):
        _fail(f"B must be [b={b}, G={B_ring.shape[1]}, N={N}], got {tuple(B.shape)}")
    if C.dim() != 3 or C.shape[0] != b or C.shape[2] != N or H % C.shape[1]:
        _fail(f"C must be [b={b}, Gc, N={N}] with H % Gc == 0, got {tuple(C.shape)}")
    check_token_args((("x", x), ("dt", dt), ("la", la), ("B", B), ("C", C)), slot_idx, b, S, _fail)
    check_cursor_values(cursor, x_ring.shape[2], slot_idx, S, _fail)


@replay_op(
    "replay_compile::mamba2_step",
    mutates_args=("state", "x_ring", "dt_ring", "la_ring", "B_ring", "cursor"),
)
def mamba2_step(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, la_ring: Tensor, B_ring: Tensor, cursor: Tensor,
    x: Tensor, dt: Tensor, la: Tensor, B: Tensor, C: Tensor, slot_idx: Optional[Tensor] = None,
) -> Tensor:
    """One ReplaySSM Mamba-2 decode step. See :func:`replay_step_reference` for shapes and semantics."""
    check_step_args(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)
    return ref.replay_step_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)


def _latency_launch(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, *_, **__) -> bool:
    """Whether the step launches its latency kernel (``whole``): where the op is inlined with
    ``REPLAY_COMPILE_INLINE_KERNELS=latency`` (library.py; by default it is inlined everywhere)."""
    from ..kernels.mamba2_triton import launch_config

    _, H, P, N = state.shape
    return launch_config(x.shape[0], H, P, N, x_ring.shape[2])["variant"] == "whole"


@mamba2_step.register_kernel("cuda", inline=_latency_launch)
def _(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    check_step_args(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)
    if not use_triton():
        return ref.replay_step_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)
    from ..kernels.mamba2_triton import replay_step_triton  # imported lazily: triton is only needed on GPUs

    return replay_step_triton(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)


@mamba2_step.register_fake
def _(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    cdt = ref._compute_dtype(state, x, dt, la)
    return x.new_empty(x.shape, dtype=cdt)


@replay_op("replay_compile::mamba2_flush", mutates_args=("state", "cursor"))
def mamba2_flush(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, la_ring: Tensor, B_ring: Tensor, cursor: Tensor,
    slot_idx: Optional[Tensor] = None,
) -> None:
    """Fold every held record into the checkpoint and reset the cursor (see :func:`replay_flush_reference`)."""
    check_ring_args(state, x_ring, dt_ring, la_ring, B_ring, cursor)
    check_cursor_values(cursor, x_ring.shape[2], slot_idx, state.shape[0], _fail)
    ref.replay_flush_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, slot_idx)


@mamba2_flush.register_fake
def _(state, x_ring, dt_ring, la_ring, B_ring, cursor, slot_idx=None):
    return None


@replay_op("replay_compile::mamba2_materialize", mutates_args=())
def mamba2_materialize(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, la_ring: Tensor, B_ring: Tensor, cursor: Tensor,
    count: Optional[Tensor] = None, slot_idx: Optional[Tensor] = None,
) -> Tensor:
    """The true state after ``count`` records per row, out of place (see :func:`replay_materialize_reference`)."""
    check_ring_args(state, x_ring, dt_ring, la_ring, B_ring, cursor)
    check_cursor_values(cursor, x_ring.shape[2], slot_idx, state.shape[0], _fail, count)
    return ref.replay_materialize_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, count, slot_idx)


@mamba2_materialize.register_fake
def _(state, x_ring, dt_ring, la_ring, B_ring, cursor, count=None, slot_idx=None):
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    return state.new_empty((b,) + tuple(state.shape[1:]))
