"""``torch.library`` custom ops of the delta-rule families (Gated DeltaNet, Kimi Delta Attention).

``replay_compile::delta_step``         one decode step: output from checkpoint + ring (the checkpoint is read every
                                       step: the delta rule needs S·k as well as S·q), corrected value appended,
                                       flush (checkpoint written once) when the ring is full. Mutates the
                                       checkpoint, the three rings and the cursor; all declared.
``replay_compile::delta_flush``        fold all held records into the checkpoint, cursor -> 0.
``replay_compile::delta_materialize``  the true state after ``count`` records, out of place.

GDN and KDA share the ops: the log-gate's shape tells them apart (``g: [b, HV]`` and ``g_ring: [S, HV, L]`` for
GDN; ``g: [b, HV, K]`` and ``g_ring: [S, HV, L, K]`` for KDA's per-key-channel gate). The CPU implementation is the
vectorised reference in :mod:`replay_compile.kernels.delta_reference`, where shapes and the in-place contract are
documented; on CUDA the step runs the Triton kernel of :mod:`replay_compile.kernels.delta_triton`
(``REPLAY_COMPILE_KERNELS=reference`` to bypass it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import delta_reference as ref
from .checks import STATE_DTYPES, check_cursor_values, check_float_rings, check_token_args
from .library import replay_op, use_triton


def _fail(msg: str):
    raise ValueError(f"replay_compile.delta: {msg}")


def check_ring_args(state, d_ring, k_ring, g_ring, cursor):
    """Validate the persistent tensors; raise a ValueError naming the tensor, its shape and the fix."""
    if state.dim() != 4:
        _fail(f"state must be [S, HV, K, V], got shape {tuple(state.shape)}")
    if state.dtype not in STATE_DTYPES:
        _fail(f"state dtype {state.dtype} unsupported; use one of {STATE_DTYPES}")
    check_float_rings((("d_ring", d_ring), ("k_ring", k_ring)), _fail)
    S, HV, K, V = state.shape
    if d_ring.dim() != 4 or tuple(d_ring.shape[:2]) != (S, HV) or d_ring.shape[3] != V:
        _fail(f"d_ring must be [S={S}, HV={HV}, L, V={V}], got {tuple(d_ring.shape)}")
    L = d_ring.shape[2]
    if k_ring.dim() != 4 or k_ring.shape[0] != S or k_ring.shape[2] != L or k_ring.shape[3] != K:
        _fail(f"k_ring must be [S={S}, Hk, L={L}, K={K}], got {tuple(k_ring.shape)}")
    if HV % k_ring.shape[1]:
        _fail(f"value heads HV={HV} must be a multiple of key heads Hk={k_ring.shape[1]}")
    if tuple(g_ring.shape) not in ((S, HV, L), (S, HV, L, K)):
        _fail(f"g_ring must be [S={S}, HV={HV}, L={L}] (GDN) or [S, HV, L, K={K}] (KDA), got {tuple(g_ring.shape)}")
    if g_ring.dtype not in (torch.float32, torch.float64):
        _fail(f"g_ring must be float32 (or float64), got {g_ring.dtype}: decays exp(Σ g) of low-precision gates "
              "drift from the exact step")
    if tuple(cursor.shape) != (S,) or cursor.dtype != torch.int32:
        _fail(f"cursor must be int32 [S={S}], got {cursor.dtype} {tuple(cursor.shape)}")
    devs = {t.device for t in (state, d_ring, k_ring, g_ring, cursor)}
    if len(devs) != 1:
        _fail(f"state, rings and cursor must share one device, got {sorted(map(str, devs))}")


def check_step_args(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx):
    check_ring_args(state, d_ring, k_ring, g_ring, cursor)
    S, HV, K, V = state.shape
    Hk = k_ring.shape[1]
    if v.dim() != 3 or tuple(v.shape[1:]) != (HV, V):
        _fail(f"v must be [b, HV={HV}, V={V}], got {tuple(v.shape)}")
    b = v.shape[0]
    if tuple(k.shape) != (b, Hk, K):
        _fail(f"k must be [b={b}, Hk={Hk}, K={K}], got {tuple(k.shape)}")
    if q.dim() != 3 or q.shape[0] != b or q.shape[2] != K or HV % q.shape[1]:
        _fail(f"q must be [b={b}, Hq, K={K}] with HV % Hq == 0, got {tuple(q.shape)}")
    want_g = (b, HV) if g_ring.dim() == 3 else (b, HV, K)
    if tuple(g.shape) != want_g:
        _fail(f"g must be {list(want_g)} to match g_ring {tuple(g_ring.shape)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (b, HV):
        _fail(f"beta must be [b={b}, HV={HV}], got {tuple(beta.shape)}")
    check_token_args((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)), slot_idx, b, S, _fail)
    check_cursor_values(cursor, d_ring.shape[2], slot_idx, S, _fail)


@replay_op("replay_compile::delta_step", mutates_args=("state", "d_ring", "k_ring", "g_ring", "cursor"))
def delta_step(
    state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, cursor: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slot_idx: Optional[Tensor] = None,
) -> Tensor:
    """One ReplaySSM delta-rule decode step. See :func:`delta_replay_step_reference` for shapes and semantics."""
    check_step_args(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)
    return ref.delta_replay_step_reference(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)


def _latency_launch(state, d_ring, k_ring, g_ring, cursor, q, k, v, *_, **__) -> bool:
    """Whether the step launches its latency kernel (``fused``): where the op is inlined with
    ``REPLAY_COMPILE_INLINE_KERNELS=latency`` (library.py; by default it is inlined everywhere)."""
    from ..kernels.delta_triton import launch_config

    _, HV, K, V = state.shape
    return launch_config(v.shape[0], HV, K, V, d_ring.shape[2])["variant"] == "fused"


@delta_step.register_kernel("cuda", inline=_latency_launch)
def _(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx=None):
    check_step_args(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)
    if not use_triton():
        return ref.delta_replay_step_reference(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)
    from ..kernels.delta_triton import delta_replay_step_triton  # imported lazily: triton is only needed on GPUs

    return delta_replay_step_triton(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx)


@delta_step.register_fake
def _(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx=None):
    from ..kernels.mamba2_reference import _compute_dtype

    return v.new_empty(v.shape, dtype=_compute_dtype(state, q, k, v, g, beta))


@replay_op("replay_compile::delta_flush", mutates_args=("state", "cursor"))
def delta_flush(state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, cursor: Tensor,
                slot_idx: Optional[Tensor] = None) -> None:
    """Fold every held record into the checkpoint and reset the cursor (see :func:`delta_replay_flush_reference`)."""
    check_ring_args(state, d_ring, k_ring, g_ring, cursor)
    check_cursor_values(cursor, d_ring.shape[2], slot_idx, state.shape[0], _fail)
    ref.delta_replay_flush_reference(state, d_ring, k_ring, g_ring, cursor, slot_idx)


@delta_flush.register_fake
def _(state, d_ring, k_ring, g_ring, cursor, slot_idx=None):
    return None


@replay_op("replay_compile::delta_materialize", mutates_args=())
def delta_materialize(state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, cursor: Tensor,
                      count: Optional[Tensor] = None, slot_idx: Optional[Tensor] = None) -> Tensor:
    """The true state after ``count`` records per row, out of place (see :func:`delta_replay_materialize_reference`)."""
    check_ring_args(state, d_ring, k_ring, g_ring, cursor)
    check_cursor_values(cursor, d_ring.shape[2], slot_idx, state.shape[0], _fail, count)
    return ref.delta_replay_materialize_reference(state, d_ring, k_ring, g_ring, cursor, count, slot_idx)


@delta_materialize.register_fake
def _(state, d_ring, k_ring, g_ring, cursor, count=None, slot_idx=None):
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    return state.new_empty((b,) + tuple(state.shape[1:]))
