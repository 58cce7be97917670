"""Triton kernel of the Mamba-1 ReplaySSM step: the CUDA implementation of ``replay_compile::mamba1_step``, same
signature and in-place contract as :func:`~replay_compile.kernels.mamba1_reference.mamba1_replay_step_reference`.

Grid ``(cdiv(D, BLOCK_D), batch)``. A program holds its row's checkpoint slice ``[BLOCK_D, N]`` (N padded to a power
of two) in fp32, runs it forward over the ``w`` held records one at a time, ``h = exp(dt_j A) h + u_j B_j`` (the
exact step's own arithmetic: a Mamba-1 decay is per (channel, state), so there is no closed form over the window
that is cheaper), applies the current token, writes ``y = h C`` and its record ``(u, dt)`` slice and ``B`` at the
cursor, and writes the checkpoint slice when the row's ring is full. ``A_keep`` (the decay parameter the records are
folded with outside the step) is written by the programs of batch index 0, padding or not. The cursors advance in a
second launch, after every program of the step has read them.

The step is bound by its exponentials and their latency, not by bytes: every held record costs an ``exp2`` per
(channel, state) entry in a dependent chain. Each record's loads are issued one record ahead of its use, and the
token's own inputs before the loop (H200, Falcon-Mamba-7B dims, fp32 checkpoint, L = 4, bs 256: 71.2 µs L-avg
against 76.3 with the loads in the loop; a fully unrolled, masked loop was slower still, 76-103 µs). Measured
against mamba_ssm's ``selective_state_update`` in ``docs/design/mamba1.md``.

On a GPU the record loop's trip count is the row's cursor; Triton's interpreter (CI's CPU path) cannot take a
runtime loop bound with numpy >= 2.4, so there the loop runs ``L - 1`` times with the records past the cursor
masked out (same results).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch
from .tuning import Tuning


@triton.jit
def _record(h, A2, u_ring_ptr, dt_ring_ptr, B_ring_ptr, slot, j, w, offs_d, offs_n, mask_d, mask_n,
            s_ub, s_ul, s_ud, s_db, s_dl, s_dd, s_bb, s_bl, s_bn):
    """``h`` run forward over record ``j`` of ``slot`` if ``j < w`` (masks as vectors: the interpreter refuses a
    mask combined with a scalar)."""
    live_d = mask_d & ((offs_d * 0 + j) < w)
    live_n = mask_n & ((offs_n * 0 + j) < w)
    dt = tl.load(dt_ring_ptr + slot * s_db + j * s_dl + offs_d * s_dd, mask=live_d, other=0.0).to(tl.float32)
    u = tl.load(u_ring_ptr + slot * s_ub + j * s_ul + offs_d * s_ud, mask=live_d, other=0.0).to(tl.float32)
    b = tl.load(B_ring_ptr + slot * s_bb + j * s_bl + offs_n * s_bn, mask=live_n, other=0.0).to(tl.float32)
    nxt = tl.exp2(dt[:, None] * A2) * h + u[:, None] * b[None, :]
    return tl.where(((offs_d * 0 + j) < w)[:, None], nxt, h)


@triton.jit
def _mamba1_step_kernel(
    state_ptr, u_ring_ptr, dt_ring_ptr, B_ring_ptr, A_keep_ptr, cursor_ptr,
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, slot_ptr, y_ptr,
    D, N, L,
    s_sb, s_sd, s_sn,                       # state [S, D, N]
    s_ub, s_ul, s_ud,                       # u_ring [S, L, D]
    s_db, s_dl, s_dd,                       # dt_ring [S, L, D]
    s_bb, s_bl, s_bn,                       # B_ring [S, L, N]
    s_kd, s_kn,                             # A_keep [D, N]
    s_xb, s_xd, s_tb, s_td,                 # u, dt [b, D]
    s_ad, s_an,                             # A [D, N]
    s_Bb, s_Bn, s_Cb, s_Cn,                 # B, C [b, N]
    s_yb, s_yd,                             # y [b, D]
    HAS_SLOT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, L_MAX: tl.constexpr,
    RUNTIME_LOOP: tl.constexpr,
):
    pid_d = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < D
    mask_n = offs_n < N
    mask = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + offs_d[:, None] * s_ad + offs_n[None, :] * s_an, mask=mask, other=0.0).to(tl.float32)
    if row == 0:
        tl.store(A_keep_ptr + offs_d[:, None] * s_kd + offs_n[None, :] * s_kn, A, mask=mask)
    A2 = A * 1.4426950408889634             # exp(dt A) = exp2(dt A log2(e)): one multiply less per record
    if HAS_SLOT:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    else:
        slot = row
    real = slot >= 0                        # padding rows: output zero, nothing of theirs read or written
    # (as vectors: the interpreter refuses a mask combined with a scalar)
    mask_d = mask_d & ((offs_d * 0 + slot) >= 0)
    mask_n = mask_n & ((offs_n * 0 + slot) >= 0)
    mask = mask_d[:, None] & mask_n[None, :]
    slot = tl.maximum(slot, 0)
    w = tl.where(real, tl.load(cursor_ptr + slot), 0)     # slot clamped to 0: a valid address either way
    h = tl.load(state_ptr + slot * s_sb + offs_d[:, None] * s_sd + offs_n[None, :] * s_sn, mask=mask,
                other=0.0).to(tl.float32)
    # this token's inputs, loaded before the record loop (they depend on nothing it computes)
    dt = tl.load(dt_ptr + row * s_tb + offs_d * s_td, mask=mask_d, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * s_xb + offs_d * s_xd, mask=mask_d, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + row * s_Bb + offs_n * s_Bn, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + row * s_Cb + offs_n * s_Cn, mask=mask_n, other=0.0).to(tl.float32)
    if RUNTIME_LOOP:                        # each record's loads issued one record ahead
        live_d = mask_d & ((offs_d * 0) < w)
        live_n = mask_n & ((offs_n * 0) < w)
        rdt = tl.load(dt_ring_ptr + slot * s_db + offs_d * s_dd, mask=live_d, other=0.0).to(tl.float32)
        ru = tl.load(u_ring_ptr + slot * s_ub + offs_d * s_ud, mask=live_d, other=0.0).to(tl.float32)
        rb = tl.load(B_ring_ptr + slot * s_bb + offs_n * s_bn, mask=live_n, other=0.0).to(tl.float32)
        for j in range(0, w):
            cdt, cu, cb = rdt, ru, rb
            live_d = mask_d & ((offs_d * 0 + j + 1) < w)
            live_n = mask_n & ((offs_n * 0 + j + 1) < w)
            rdt = tl.load(dt_ring_ptr + slot * s_db + (j + 1) * s_dl + offs_d * s_dd, mask=live_d,
                          other=0.0).to(tl.float32)
            ru = tl.load(u_ring_ptr + slot * s_ub + (j + 1) * s_ul + offs_d * s_ud, mask=live_d,
                         other=0.0).to(tl.float32)
            rb = tl.load(B_ring_ptr + slot * s_bb + (j + 1) * s_bl + offs_n * s_bn, mask=live_n,
                         other=0.0).to(tl.float32)
            h = tl.exp2(cdt[:, None] * A2) * h + cu[:, None] * cb[None, :]
    else:
        for j in range(0, L_MAX - 1):
            h = _record(h, A2, u_ring_ptr, dt_ring_ptr, B_ring_ptr, slot, j, w, offs_d, offs_n, mask_d, mask_n,
                        s_ub, s_ul, s_ud, s_db, s_dl, s_dd, s_bb, s_bl, s_bn)
    h = tl.exp2(dt[:, None] * A2) * h + u[:, None] * b[None, :]
    y = tl.where(real, tl.sum(h * c[None, :], 1), 0.0)
    tl.store(y_ptr + row * s_yb + offs_d * s_yd, y, mask=offs_d < D)
    tl.store(u_ring_ptr + slot * s_ub + w * s_ul + offs_d * s_ud, u, mask=mask_d)
    tl.store(dt_ring_ptr + slot * s_db + w * s_dl + offs_d * s_dd, dt, mask=mask_d)
    tl.store(B_ring_ptr + slot * s_bb + w * s_bl + offs_n * s_bn, b, mask=mask_n)   # every D-block: same values
    if w == L - 1:                          # (padding rows: masked out)
        sp = state_ptr + slot * s_sb + offs_d[:, None] * s_sd + offs_n[None, :] * s_sn
        tl.store(sp, h.to(sp.dtype.element_ty), mask=mask)


@triton.jit
def _mamba1_advance_kernel(cursor_ptr, slot_ptr, b, L, HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < b
    if HAS_SLOT:
        slots = tl.load(slot_ptr + rows, mask=live, other=-1).to(tl.int64)
    else:
        slots = rows.to(tl.int64)
    live = live & (slots >= 0)
    w = tl.load(cursor_ptr + slots, mask=live, other=0)
    tl.store(cursor_ptr + slots, tl.where(w == L - 1, 0, w + 1), mask=live)


# Launch configuration override for benchmarks and tests (``tuning.tuned``). Empty in use.
TUNING = Tuning(__name__, ("tile", "warps"))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def mamba1_replay_step_triton(state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx=None):
    """Triton implementation of :func:`mamba1_replay_step_reference` (same arguments, same in-place contract)."""
    S, D, N = state.shape
    b, L = u.shape[0], u_ring.shape[1]
    y = torch.empty((b, D), dtype=torch.float32, device=u.device)
    if b == 0:
        return y
    BLOCK_N = max(next_pow2(N), 2)
    # [BLOCK_D, N] tiles of 1024 values on 2 warps for fp32 checkpoints, 2048 for 2-byte ones (H200, Falcon-Mamba-7B
    # dims, L = 4, bs 256 / 512: fp32 71.2 / 137.1 µs L-avg against 72.0 / 138.7 at 2048 on 4 warps and 77.9 /
    # 149.7 at 512 on 1; bf16 65.5 / 125.1 against 74.3 / 143.2 at 1024 on 2 warps)
    narrow = state.element_size() <= 2
    tile = TUNING.get("tile", 2048 if narrow else 1024)
    BLOCK_D = max(min(next_pow2(D), tile // BLOCK_N), 16)
    has_slot = slot_idx is not None
    launch(_mamba1_step_kernel)[(cdiv(D, BLOCK_D), b)](
        state, u_ring, dt_ring, B_ring, A_keep, cursor, u, dt, A, B, C, slot_idx if has_slot else None, y,
        D, N, L, *state.stride(), *u_ring.stride(), *dt_ring.stride(), *B_ring.stride(), *A_keep.stride(),
        *u.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *y.stride(),
        HAS_SLOT=has_slot, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, L_MAX=L, RUNTIME_LOOP=not _interpreting(),
        num_warps=TUNING.get("warps", 2))
    BLOCK = 128
    launch(_mamba1_advance_kernel)[(cdiv(b, BLOCK),)](cursor, slot_idx if has_slot else None, b, L,
                                                      HAS_SLOT=has_slot, BLOCK=BLOCK)
    return y
