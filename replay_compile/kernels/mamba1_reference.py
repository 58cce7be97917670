"""Reference math for Mamba-1 (mamba, falcon_mamba, jamba), in plain PyTorch.

* :func:`mamba1_exact_step` — the exact recurrent decode step (the oracle), as transformers'
  ``mamba_selective_state_update`` writes it once ``dt`` is discretised.
* ``mamba1_replay_*_reference`` — the ReplaySSM form: the CPU implementations of the custom ops in
  :mod:`replay_compile.ops.mamba1` and the references of the Triton kernel; same signatures, same in-place contracts.

Per sequence row, channel ``d < D`` and state index ``n < N``, with ``u = dt x`` the update's channel factor (the
model's ``dt * x``, whatever it multiplies in)::

    S[d, n] = exp(dt[d] A[d, n]) S[d, n] + u[d] B[n]
    y[d]    = Σ_n S[d, n] C[n]                         (``D x`` and the gate stay graph ops after the step)

Mamba-1's decay is per (channel, state), so a window's decay from record ``j`` is ``exp(A[d, n] Σ_{j<i<=w} dt[i, d])``
and depends on both indices: the replay runs the recurrence forward over the held records from the checkpoint,
one record at a time, in the exact step's own order of operations (bit-for-bit the exact step's arithmetic). Its
records are ``(u, dt)`` per channel and ``B`` per token, ``2D + N`` values against the state's ``D N``
(``docs/design/mamba1.md``: the byte model that bounds this at 1.28-1.44x over the exact step at 16 states).

Ring layout (``S`` slots, ``L`` the buffer length)::

    state   [S, D, N]   checkpoint, fp32 / bf16 / fp16 (fp64 in tests)
    u_ring  [S, L, D]   update channel factors u = dt x (fp32)
    dt_ring [S, L, D]   discretised time steps dt (fp32)
    B_ring  [S, L, N]   input projections B (fp32)
    A_keep  [D, N]      the decay parameter the held records were taken with (written by every step, a layer's
                        parameter, not a slot's): folds outside the step (a read of the cache, a flush) need it
    cursor  [S]         int32, records held (0 <= w < L)

A step with ``w == L-1`` is a flush: it folds the ``L-1`` records and the current token into the checkpoint and
writes it once; ``w`` returns to 0. Rows whose ``slot_idx`` is negative are padding: nothing of theirs is read or
written and their output is zero.
"""

from __future__ import annotations

import torch

from .mamba2_reference import _compute_dtype, _rows

__all__ = ["mamba1_exact_step", "mamba1_replay_step_reference", "mamba1_replay_materialize_reference",
           "mamba1_replay_flush_reference"]


def _advance(h, dt, A, u, B):
    """One token: ``exp(dt[:, :, None] A) h + u[:, :, None] B[:, None, :]`` for rows ``h`` [r, D, N]."""
    return torch.exp(dt[:, :, None] * A) * h + u[:, :, None] * B[:, None, :]


def mamba1_exact_step(state, u, dt, A, B, C):
    """Exact Mamba-1 decode step; updates ``state`` [b, D, N] in place and returns ``y`` [b, D].

    Args:
        u, dt: [b, D]. A: [D, N]. B, C: [b, N]. Computed in fp64 if any input is fp64, else fp32.
    """
    cdt = _compute_dtype(state, u, dt, A, B, C)
    h = _advance(state.to(cdt), dt.to(cdt), A.to(cdt), u.to(cdt), B.to(cdt))
    state.copy_(h.to(state.dtype))
    return (h * C.to(cdt)[:, None, :]).sum(-1)


def _fold_held(h, u_rows, dt_rows, B_rows, A, n, cdt):
    """Run ``h`` [r, D, N] forward over the first ``n[r]`` records of each row (rows [r, L, D] / [r, L, N])."""
    for j in range(u_rows.shape[1]):
        live = (j < n)[:, None, None]
        if not bool(live.any()):
            break
        h = torch.where(live, _advance(h, dt_rows[:, j].to(cdt), A, u_rows[:, j].to(cdt), B_rows[:, j].to(cdt)), h)
    return h


def mamba1_replay_step_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx=None):
    """One replay step. Shapes as in the module docstring; ``u``, ``dt`` [b, D], ``A`` [D, N], ``B``, ``C`` [b, N],
    ``slot_idx`` [b] int (row i uses slot ``slot_idx[i]``; default ``arange(b)``). Returns ``y`` [b, D] in the
    compute dtype; writes each real row's record at its cursor and advances it; a row at ``L - 1`` records writes
    its checkpoint and returns to 0."""
    cdt = _compute_dtype(state, u, dt, A, B, C)
    b, L = u.shape[0], u_ring.shape[1]
    rows, slots = _rows(slot_idx, b, u.device)
    y = torch.zeros(u.shape, dtype=cdt, device=u.device)
    if rows.numel() == 0:
        return y
    w = cursor[slots].long()
    A_ = A.to(cdt)
    A_keep.copy_(A.to(A_keep.dtype))
    h = _fold_held(state[slots].to(cdt), u_ring[slots], dt_ring[slots], B_ring[slots], A_, w, cdt)
    h = _advance(h, dt[rows].to(cdt), A_, u[rows].to(cdt), B[rows].to(cdt))
    y[rows] = (h * C[rows].to(cdt)[:, None, :]).sum(-1)
    u_ring[slots, w] = u[rows].to(u_ring.dtype)
    dt_ring[slots, w] = dt[rows].to(dt_ring.dtype)
    B_ring[slots, w] = B[rows].to(B_ring.dtype)
    full = w == L - 1
    if bool(full.any()):
        state[slots[full]] = h[full].to(state.dtype)
    cursor[slots] = torch.where(full, 0, w + 1).to(cursor.dtype)
    return y


def mamba1_replay_materialize_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, count=None, slot_idx=None):
    """The true state after ``count`` [b] records per row (default: the cursor), out of place, ``[b, D, N]`` in the
    state's dtype."""
    cdt, A = _compute_dtype(state, A_keep), A_keep
    rows, slots = _rows(slot_idx, state.shape[0] if slot_idx is None else slot_idx.shape[0], state.device)
    out = torch.zeros((rows.shape[0] if slot_idx is None else slot_idx.shape[0],) + tuple(state.shape[1:]),
                      dtype=state.dtype, device=state.device)
    n = cursor[slots].long() if count is None else count.to(state.device).long()[rows]
    h = _fold_held(state[slots].to(cdt), u_ring[slots], dt_ring[slots], B_ring[slots], A.to(cdt), n, cdt)
    out[rows] = h.to(state.dtype)
    return out


def mamba1_replay_flush_reference(state, u_ring, dt_ring, B_ring, A_keep, cursor, slot_idx=None):
    """Fold every held record into the checkpoint (all slots, or ``slot_idx``), cursors to 0."""
    rows, slots = _rows(slot_idx, state.shape[0] if slot_idx is None else slot_idx.shape[0], state.device)
    if slots.numel() == 0:
        return
    cdt, A = _compute_dtype(state, A_keep), A_keep
    w = cursor[slots].long()
    h = _fold_held(state[slots].to(cdt), u_ring[slots], dt_ring[slots], B_ring[slots], A.to(cdt), w, cdt)
    state[slots] = h.to(state.dtype)
    cursor[slots] = 0
