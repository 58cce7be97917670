"""``torch.library`` custom ops of Mamba-1 (mamba, falcon_mamba, jamba).

``replay_compile::mamba1_step``         one decode step: the held records run forward from the checkpoint, the
                                        current token applied, the output read; the token's record written at the
                                        cursor; the checkpoint written once per ``L`` steps. Mutates the checkpoint,
                                        the rings, ``A_keep`` and the cursor; all declared.
``replay_compile::mamba1_flush``        fold all held records into the checkpoint, cursor -> 0.
``replay_compile::mamba1_materialize``  the true state after ``count`` records, out of place.

The CPU implementation is the reference in :mod:`replay_compile.kernels.mamba1_reference`, where shapes and the
in-place contract are documented; on CUDA the step runs the Triton kernel of
:mod:`replay_compile.kernels.mamba1_triton` (``REPLAY_COMPILE_KERNELS=reference`` to bypass it).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..kernels import mamba1_reference as ref
from .checks import STATE_DTYPES, check_cursor_values, check_float_rings, check_token_args
from .library import replay_op, use_triton


def _fail(msg: str):
    raise ValueError(f"replay_compile.mamba1: {msg}")


def check_ring_args(state, u_ring, dt_ring, B_ring, A_keep, cursor):
    """Validate the persistent tensors; raise a ValueError naming the tensor, its shape and the fix."""
    import torch

    if state.dim() != 3:
        _fail(f"state must be [S, D, N], got shape {tuple(state.shape)}")
    if state.dtype not in STATE_DTYPES:
        _fail(f"state dtype {state.dtype} unsupported; use one of {STATE_DTYPES}")
    S, D, N = state.shape
    check_float_rings((("u_ring", u_ring), ("dt_ring", dt_ring), ("B_ring", B_ring), ("A_keep", A_keep)), _fail)
    if u_ring.dim() != 3 or u_ring.shape[0] != S or u_ring.shape[2] != D:
        _fail(f"u_ring must be [S={S}, L, D={D}], got {tuple(u_ring.shape)}")
    L = u_ring.shape[1]
    if tuple(dt_ring.shape) != (S, L, D):
        _fail(f"dt_ring must be [S={S}, L={L}, D={D}], got {tuple(dt_ring.shape)}")
    if tuple(B_ring.shape) != (S, L, N):
        _fail(f"B_ring must be [S={S}, L={L}, N={N}], got {tuple(B_ring.shape)}")
    if tuple(A_keep.shape) != (D, N):
        _fail(f"A_keep must be [D={D}, N={N}], got {tuple(A_keep.shape)}")
    if dt_ring.dtype not in (torch.float32, torch.float64) or A_keep.dtype not in (torch.float32, torch.float64):
        _fail(f"dt_ring and A_keep must be float32 (or float64), got {dt_ring.dtype} / {A_keep.dtype}: decays "
              "exp(A Σ dt) of low-precision time steps drift from the exact step")
    if tuple(cursor.shape) != (S,) or cursor.dtype != torch.int32:
        _fail(f"cursor must be int32 [S={S}], got {cursor.dtype} {tuple(cursor.shape)}")
    devs = {t.device for t in (state, u_ring, dt_ring, B_ring, A_keep, cursor)}
    if len(devs) != 1:
        _fail(f"state, rings and cursor must share one device, got {sorted(map(str, devs))}")


def check_step_args(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx):
    check_ring_args(state, u_ring, dt_ring, B_ring, A_keep, cursor)
    S, D, N = state.shape
    if u.dim() != 2 or u.shape[1] != D:
        _fail(f"u must be [b, D={D}], got {tuple(u.shape)}")
    b = u.shape[0]
    if tuple(dt.shape) != (b, D):
        _fail(f"dt must be [b={b}, D={D}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (D, N):
        _fail(f"A must be [D={D}, N={N}], got {tuple(A.shape)}")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (b, N):
            _fail(f"{name} must be [b={b}, N={N}], got {tuple(t.shape)}")
    check_token_args((("u", u), ("dt", dt), ("A", A), ("B", B), ("C", C)), slot_idx, b, S, _fail)
    check_cursor_values(cursor, u_ring.shape[1], slot_idx, S, _fail)


@replay_op("replay_compile::mamba1_step",
           mutates_args=("state", "u_ring", "dt_ring", "B_ring", "A_keep", "cursor"))
def mamba1_step(
    state: Tensor, u_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A_keep: Tensor, cursor: Tensor,
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, slot_idx: Optional[Tensor] = None,
) -> Tensor:
    """One ReplaySSM Mamba-1 decode step. See :func:`mamba1_replay_step_reference` for shapes and semantics."""
    check_step_args(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx)
    return ref.mamba1_replay_step_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx)


@mamba1_step.register_kernel("cuda")
def _(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx=None):
    check_step_args(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx)
    if not use_triton():
        return ref.mamba1_replay_step_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C,
                                                slot_idx)
    from ..kernels.mamba1_triton import mamba1_replay_step_triton  # lazily: triton is only needed on GPUs

    return mamba1_replay_step_triton(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx)


@mamba1_step.register_fake
def _(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx=None):
    from ..kernels.mamba2_reference import _compute_dtype

    return u.new_empty(u.shape, dtype=_compute_dtype(state, u, dt, A, B, C))


@replay_op("replay_compile::mamba1_flush", mutates_args=("state", "cursor"))
def mamba1_flush(state: Tensor, u_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A_keep: Tensor, cursor: Tensor,
                 slot_idx: Optional[Tensor] = None) -> None:
    """Fold every held record into the checkpoint, cursors to 0 (see :func:`mamba1_replay_flush_reference`)."""
    check_ring_args(state, u_ring, dt_ring, B_ring, A_keep, cursor)
    check_cursor_values(cursor, u_ring.shape[1], slot_idx, state.shape[0], _fail)
    ref.mamba1_replay_flush_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, slot_idx)


@mamba1_flush.register_fake
def _(state, u_ring, dt_ring, B_ring, A_keep, cursor, slot_idx=None):
    return None


@replay_op("replay_compile::mamba1_materialize", mutates_args=())
def mamba1_materialize(state: Tensor, u_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A_keep: Tensor,
                       cursor: Tensor, count: Optional[Tensor] = None, slot_idx: Optional[Tensor] = None) -> Tensor:
    """The true state after ``count`` records per row, out of place (see
    :func:`mamba1_replay_materialize_reference`)."""
    check_ring_args(state, u_ring, dt_ring, B_ring, A_keep, cursor)
    check_cursor_values(cursor, u_ring.shape[1], slot_idx, state.shape[0], _fail, count)
    return ref.mamba1_replay_materialize_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, count, slot_idx)


@mamba1_materialize.register_fake
def _(state, u_ring, dt_ring, B_ring, A_keep, cursor, count=None, slot_idx=None):
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    return state.new_empty((b,) + tuple(state.shape[1:]))
