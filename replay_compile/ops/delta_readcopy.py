"""Delta-rule (GDN / KDA) ops with a low-precision read copy of the checkpoint.

``replay_compile::delta_step_rc``         the replay step; non-flush rows read the copy, flushes re-run the exact
                                          recurrence over the raw window (``v_ring``, ``beta_ring``) and rewrite it
``replay_compile::delta_flush_rc``        exact fold of the held records, copy rewritten, cursor -> 0
``replay_compile::delta_materialize_rc``  the true state, exact from the raw rings, out of place

Semantics and shapes: :mod:`replay_compile.kernels.delta_readcopy_reference`. The copy is three storage tensors as
for ``mamba2_step_rc`` (:mod:`.mamba2_readcopy`). On CUDA the step runs the Triton kernels of
:mod:`replay_compile.kernels.delta_readcopy_triton` (H200: their tests pass compiled); explicit flushes and
materialisation, which run once per request rather than per token, use the PyTorch reference on every device.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import delta_readcopy_reference as rcref
from ..kernels.mamba2_reference import _compute_dtype
from .checks import check_cursor_values
from .delta import _fail, check_ring_args, check_step_args
from .library import replay_op, use_triton
from .mamba2_readcopy import as_copy

_MUTATED = ("state", "d_ring", "k_ring", "g_ring", "v_ring", "beta_ring", "copy0", "copy1", "copy2", "cursor")


def _check_raw(state, d_ring, v_ring, beta_ring):
    S, HV, _, V = state.shape
    L = d_ring.shape[2]
    if tuple(v_ring.shape) != (S, HV, L, V):
        _fail(f"v_ring must be [S={S}, HV={HV}, L={L}, V={V}], got {tuple(v_ring.shape)}")
    if tuple(beta_ring.shape) != (S, HV, L) or beta_ring.dtype not in (torch.float32, torch.float64):
        _fail(f"beta_ring must be float32 [S={S}, HV={HV}, L={L}], got {beta_ring.dtype} {tuple(beta_ring.shape)}")


def _check_step(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, q, k, v, g, beta,
                slot_idx, fmt):
    """The step's argument checks (every device); returns the copy as an ``Encoded``."""
    check_step_args(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)
    _check_raw(state, d_ring, v_ring, beta_ring)
    return as_copy(fmt, state, (copy0, copy1, copy2), _fail)


@replay_op("replay_compile::delta_step_rc", mutates_args=_MUTATED)
def delta_step_rc(
    state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, v_ring: Tensor, beta_ring: Tensor,
    copy0: Tensor, copy1: Tensor, copy2: Tensor, cursor: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slot_idx: Optional[Tensor], fmt: str,
) -> Tensor:
    """One delta-rule replay step reading non-flush rows' checkpoint term from the read copy."""
    enc = _check_step(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, q, k, v, g, beta,
                      slot_idx, fmt)
    return rcref.delta_replay_step_readcopy_reference(state, enc, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring,
                                                      cursor, q, k, v, g, beta, slot_idx)


@delta_step_rc.register_kernel("cuda")
def _(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, q, k, v, g, beta, slot_idx, fmt):
    enc = _check_step(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, q, k, v, g, beta,
                      slot_idx, fmt)
    if not use_triton():
        return rcref.delta_replay_step_readcopy_reference(state, enc, fmt, d_ring, k_ring, g_ring, v_ring,
                                                          beta_ring, cursor, q, k, v, g, beta, slot_idx)
    from ..kernels.delta_readcopy_triton import delta_replay_step_readcopy_triton  # lazily: triton only on GPUs

    return delta_replay_step_readcopy_triton(state, enc, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor,
                                             q, k, v, g, beta, slot_idx)


@delta_step_rc.register_fake
def _(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, q, k, v, g, beta, slot_idx, fmt):
    return v.new_empty(v.shape, dtype=_compute_dtype(state, q, k, v, g, beta))


@replay_op("replay_compile::delta_flush_rc",
                         mutates_args=("state", "copy0", "copy1", "copy2", "cursor"))
def delta_flush_rc(
    state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, v_ring: Tensor, beta_ring: Tensor,
    copy0: Tensor, copy1: Tensor, copy2: Tensor, cursor: Tensor, fmt: str, slot_idx: Optional[Tensor] = None,
) -> None:
    """Exact fold of every held record (raw rings), the copy rewritten, cursor to 0."""
    check_ring_args(state, d_ring, k_ring, g_ring, cursor)
    check_cursor_values(cursor, d_ring.shape[2], slot_idx, state.shape[0], _fail)
    _check_raw(state, d_ring, v_ring, beta_ring)
    enc = as_copy(fmt, state, (copy0, copy1, copy2), _fail)
    rcref.delta_flush_readcopy_reference(state, enc, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor, slot_idx)


@delta_flush_rc.register_fake
def _(state, d_ring, k_ring, g_ring, v_ring, beta_ring, copy0, copy1, copy2, cursor, fmt, slot_idx=None):
    return None


@replay_op("replay_compile::delta_materialize_rc", mutates_args=())
def delta_materialize_rc(
    state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, v_ring: Tensor, beta_ring: Tensor, cursor: Tensor,
    count: Optional[Tensor] = None, slot_idx: Optional[Tensor] = None,
) -> Tensor:
    """The true state after ``count`` records per row (exact, from the raw rings), out of place."""
    check_ring_args(state, d_ring, k_ring, g_ring, cursor)
    check_cursor_values(cursor, d_ring.shape[2], slot_idx, state.shape[0], _fail, count)
    _check_raw(state, d_ring, v_ring, beta_ring)
    return rcref.delta_materialize_readcopy_reference(state, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor,
                                                      count, slot_idx)


@delta_materialize_rc.register_fake
def _(state, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor, count=None, slot_idx=None):
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    return state.new_empty((b,) + tuple(state.shape[1:]))
