"""Triton kernel of the Mamba-2 ReplaySSM step (the CUDA implementation of ``replay_compile::mamba2_step``).

Same signature and in-place contract as :func:`~replay_compile.kernels.mamba2_reference.replay_step_reference`.

One launch per step serves every row and every step: each program reads its row's cursor ``w`` and, on the device,
either folds and writes its checkpoint tile (``w == L-1``, the flush) or appends its record (any other ``w``), so
one captured CUDA graph replays every step. Grid ``(cdiv(P, BLOCK_P), batch, H)``; everything is computed in fp32
whatever the storage dtypes; exponents are suffix sums of log-decays clamped at 0, so nothing can overflow; the
window of up to ``L`` records sits on a power-of-two axis ``BLOCK_L``, masked by the logical index ``j <= w``.

Variants of the same contract, picked by :func:`launch_config` from the batch (``whole`` small, ``pre`` large):

* ``whole`` (latency: small batches). A program holds a ``BLOCK_P x N`` checkpoint tile (N padded to a power of
  two) and issues every load (tile, whole ring window, x, B, C) before it needs ``w``; stale ring slots are
  discarded in registers. ``y = exp(Σ la)(S_0 C) + Σ_j coef_j (B_j·C) x_j`` on both branches; the flush then writes
  ``exp(Σ la) S_0 + (coef X)ᵀ B`` (one ``tl.dot``, IEEE fp32) from the tile it holds.
* ``pre`` (bandwidth: large batches; its kernels are in :mod:`.mamba2_pre_triton`). The window is what kept the
  one-launch kernels from streaming: every program re-read its group's ``[L, N]`` B window and recomputed ``B_j·C``
  (5 KB of L2 reads per 16 KB tile). A first launch computes, once per (row, group of heads), the per-record weights
  ``cb_j = coef_j (B_j·C)`` and the decay into fp32 scratch, appends the ``dt``, ``log a`` and ``B`` records and
  lists the flushing rows; the checkpoint pass is then a streamed ``S_0 C`` per ``16 x N`` tile on 1 warp plus ``Σ_j
  cb_j x_j`` over its own slice of the x window (it appends ``x``). Flush rows skip both and are folded by a third
  launch that walks the listed rows on a fixed grid (:func:`_fold_tile` per tile: the checkpoint streamed over N
  in ``BLOCK_P x BLOCK_N`` tiles with one tile live), so the fold's ``tl.dot`` registers never weigh on the
  streaming pass and a non-flush step pays nothing for it; every launch routes on the device from the cursor. (A
  read-only GEMV stream of the checkpoint reaches 99% of copy bandwidth on the H200; the checkpoint pass alone
  reaches it, the rest of a non-flush step is launch 1 and three small launches.)

Cursor advance in the ``whole`` variant, without a second launch (one launch matters at small batch): the cursor
word carries an arrival count in its high 16 bits while the kernel runs. Every program reads ``w`` and counts its
arrival in one relaxed ``atomic_add(1 << 16)``; the program that arrives last (so every other one has read ``w``)
stores the advanced cursor with the count cleared. Between launches the word is always the plain cursor, so every
other op and the Python side see ``0 <= w < L``. (Counting the arrival at the end with a release atomic instead was
slower: docs/design/mamba2_kernel.md, v2b.) The ``pre`` variant reads the cursor with a plain load and its flush
launch advances it: at large batch the atomic cost more than a launch.

fp16 checkpoints are rounded stochastically at the flush (unbiased: each value goes to one of its two fp16
neighbours with probability proportional to proximity), from a counter-based hash of (slot, head, element, the
token's log-decay bits): deterministic for given inputs, fresh at every flush, and computed bit-identically by
the CPU reference (:func:`~replay_compile.kernels.mamba2_reference.stochastic_round_fp16`).

No autotuning: the kernel writes its inputs in place. Loops have constexpr trip counts: the triton 3.6
interpreter (the CI's CPU test path) fails on runtime loop bounds with numpy >= 2.4.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .host_math import cdiv, memo_unless_tuned, next_pow2
from .launch import launch
from .tuning import Tuning, tuned  # noqa: F401  (tuned: re-exported for kt.tuned)

_ARRIVAL = 1 << 16          # one arrival in the cursor word's high half; w lives in the low 16 bits
_ARRIVAL_C = tl.constexpr(_ARRIVAL)


@triton.jit
def _hash32(x):
    """lowbias32 integer hash (uint32 -> uint32); the CPU reference computes the same function."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _stochastic_round_fp16(v, key, offs):
    """fp32 -> fp16, rounding to one of the two neighbours with probability proportional to proximity.

    ``key``: uint32 scalar (per program); ``offs``: uint32 element offsets, same shape as ``v``.
    """
    rn = v.to(tl.float16)                                      # round to nearest, then step toward zero if
    bits = rn.to(tl.int16, bitcast=True)                       # it went away from zero: lo = truncation of v
    lo_bits = tl.where(tl.abs(rn.to(tl.float32)) > tl.abs(v), bits - 1, bits)
    hi_bits = lo_bits + 1                                      # next magnitude, same sign (max finite -> inf)
    lo = lo_bits.to(tl.float16, bitcast=True)
    hi = hi_bits.to(tl.float16, bitcast=True)
    lo_f = lo.to(tl.float32)
    frac = (tl.abs(v) - tl.abs(lo_f)) / (tl.abs(hi.to(tl.float32)) - tl.abs(lo_f))   # in [0, 1); NaN for NaN/inf
    u = (_hash32(key ^ offs) >> 8).to(tl.float32) * (1.0 / 16777216.0)              # 24-bit uniform in [0, 1)
    return tl.where(u < frac, hi, lo)


@triton.jit
def _row_slot(slot_ptr, row, HAS_SLOT: tl.constexpr):
    """The cache slot of batch row ``row`` (negative: a padding row); row ``i`` uses slot ``i`` without a slot index.
    Shared by every step kernel of both families."""
    if HAS_SLOT:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    else:
        slot = row
    return slot


@triton.jit
def _suffix_after(la_next, la_cur, w, offs):
    """``min(Σ_{j<i<=w} la_i, 0)`` for every ``j`` of a window whose current token sits at index ``w``
    (``offs``: the window's arange), from the ring's log-decays loaded one record ahead (``la_next[j]`` = ring
    ``j + 1``) and the token's ``la_cur``: a reverse cumulative sum of them. The inclusive scan minus ``la_j`` gives
    the same sum as a difference: the log-decays are <= 0, so the sum never cancels, but ``(la_j + s) - la_j``
    loses ``s`` to rounding once ``la_j`` is large (a -1e5 decay left ~1% error in the record's weight) and is NaN
    for ``la_j = -inf``."""
    nxt = offs + 1
    h = tl.where(nxt < w, la_next, tl.where(nxt == w, la_cur, 0.0))
    return tl.minimum(tl.cumsum(h, axis=0, reverse=True), 0.0)


@triton.jit
def _step_row(slot_ptr, row, out_ptrs, out_mask, HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_row_slot` for a program that owns ``BLOCK`` outputs of the row: a padding row gets zeros there; the
    caller then returns (a padding row touches nothing else)."""
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    if slot < 0:
        tl.store(out_ptrs, tl.zeros([BLOCK], dtype=tl.float32), mask=out_mask)
    return slot


@triton.jit
def _list_row(work_ptr, row):
    """Append ``row`` to ``work = [count, rows...]`` (zeroed by the caller; one relaxed atomic): how a step lists
    its flushing rows for a launch that walks only those (the order is arbitrary, each row's work independent)."""
    i = tl.atomic_add(work_ptr, 1, sem="relaxed")
    tl.store(work_ptr + 1 + i, row.to(tl.int32))


@triton.jit
def _list_item(work_ptr, t, H, n_tiles):
    """Item ``t`` of a walk over the listed rows' ``H x n_tiles`` tiles (consecutive items: neighbouring tiles of
    one row and head, which share its window in L2): ``(row, head, tile)``."""
    row = tl.load(work_ptr + 1 + t // (H * n_tiles)).to(tl.int64)
    return row, ((t // n_tiles) % H).to(tl.int64), t % n_tiles


@triton.jit
def _arrive(cursor_ptr, slot, arrivals, L):
    """Read this row's cursor and count the program's arrival in one relaxed atomic; returns ``w``.

    The program that arrives last (every other program of the row has read ``w``) stores the advanced cursor
    with the count cleared.
    """
    word = tl.atomic_add(cursor_ptr + slot, _ARRIVAL_C, sem="relaxed")
    w = word & (_ARRIVAL_C - 1)
    if (word >> 16) == arrivals - 1:
        tl.atomic_xchg(cursor_ptr + slot, tl.where(w == L - 1, 0, w + 1), sem="relaxed")
    return w


@triton.jit
def _round_checkpoint(s_new, st_ptrs, la_cur, key_base, offs_e, STOCHASTIC_FP16: tl.constexpr):
    """A folded checkpoint tile as the checkpoint ``st_ptrs`` stores it (its dtype): stochastic rounding for fp16
    (see module notes), round to nearest otherwise."""
    if STOCHASTIC_FP16:
        key = _hash32(la_cur.to(tl.float32).to(tl.uint32, bitcast=True) ^ _hash32(key_base.to(tl.uint32)))
        out = _stochastic_round_fp16(s_new, key, offs_e.to(tl.uint32))
    else:
        out = s_new.to(st_ptrs.dtype.element_ty)
    return out


@triton.jit
def _store_checkpoint(st_ptrs, s_new, tile_mask, la_cur, key_base, offs_e, STOCHASTIC_FP16: tl.constexpr):
    """Write a folded checkpoint tile, rounded by :func:`_round_checkpoint`."""
    tl.store(st_ptrs, _round_checkpoint(s_new, st_ptrs, la_cur, key_base, offs_e, STOCHASTIC_FP16), mask=tile_mask)


@triton.jit
def _mamba2_replay_whole_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr,
    H, P, N, L, heads_per_g, heads_per_gc, arrivals,
    s_sb, s_sh, s_sp, s_sn,                 # state [S, H, P, N]
    s_xrb, s_xrh, s_xrl, s_xrp,             # x_ring [S, H, L, P]
    s_drb, s_drh, s_drl,                    # dt_ring [S, H, L]
    s_lrb, s_lrh, s_lrl,                    # la_ring [S, H, L]
    s_brb, s_brg, s_brl, s_brn,             # B_ring [S, G, L, N]
    s_xb, s_xh, s_xp,                       # x [b, H, P]
    s_db, s_dh, s_lb, s_lh,                 # dt, la [b, H]
    s_bb, s_bg, s_bn,                       # B [b, G, N]
    s_cb, s_cg, s_cn,                       # C [b, Gc, N]
    s_yb, s_yh, s_yp,                       # y [b, H, P]
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    STOCHASTIC_FP16: tl.constexpr,
):
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    slot = _step_row(slot_ptr, row, y_ptrs, mask_p, HAS_SLOT, BLOCK_P)
    if slot < 0:                                   # padding row: zero output (stored above), touch nothing else
        return

    g = h // heads_per_g
    gc = h // heads_per_gc
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    in_ring = offs_l < L
    mask_n = offs_n < N
    tile_mask = mask_p[:, None] & mask_n[None, :]

    # loads that do not depend on w: checkpoint tile, whole ring window, this token
    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    s0 = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + row * s_cb + gc * s_cg + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
    b_cur = tl.load(B_ptr + row * s_bb + g * s_bg + offs_n * s_bn, mask=mask_n, other=0.0)
    x_cur = tl.load(x_ptr + row * s_xb + h * s_xh + offs_p * s_xp, mask=mask_p, other=0.0)
    la_cur = tl.load(la_ptr + row * s_lb + h * s_lh)
    dt_cur = tl.load(dt_ptr + row * s_db + h * s_dh)
    br_base = Br_ptr + slot * s_brb + g * s_brg
    bw = tl.load(br_base + offs_l[:, None] * s_brl + offs_n[None, :] * s_brn,
                 mask=in_ring[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    xw = tl.load(xr_ptr + slot * s_xrb + h * s_xrh + offs_l[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                 mask=in_ring[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    la_w = tl.load(lar_ptr + slot * s_lrb + h * s_lrh + offs_l * s_lrl, mask=in_ring, other=0.0).to(tl.float32)
    la_next = tl.load(lar_ptr + slot * s_lrb + h * s_lrh + (offs_l + 1) * s_lrl, mask=offs_l + 1 < L,
                      other=0.0).to(tl.float32)
    dt_w = tl.load(dtr_ptr + slot * s_drb + h * s_drh + offs_l * s_drl, mask=in_ring, other=0.0).to(tl.float32)
    # the cursor only after every load is issued: the atomic's round trip (and the barrier that shares its result)
    # then overlaps the loads instead of preceding them
    w = _arrive(cursor_ptr, slot, arrivals, L)

    # the window: held records j < w, this token at j == w, nothing after (stale ring slots never leak: where)
    hist = offs_l < w
    cur = offs_l == w
    la_w = tl.where(cur, la_cur.to(tl.float32), tl.where(hist, la_w, 0.0))
    dt_w = tl.where(cur, dt_cur.to(tl.float32), tl.where(hist, dt_w, 0.0))
    bw = tl.where(cur[:, None], b_cur.to(tl.float32)[None, :], tl.where(hist[:, None], bw, 0.0))
    xw = tl.where(cur[:, None], x_cur.to(tl.float32)[None, :], tl.where(hist[:, None], xw, 0.0))
    total = tl.sum(la_w, axis=0)
    after = _suffix_after(la_next, la_cur.to(tl.float32), w, offs_l)       # Σ_{j<i<=w}
    coef = tl.where(offs_l <= w, dt_w * tl.exp(after), 0.0)                # [BLOCK_L]
    decay = tl.exp(tl.minimum(total, 0.0))

    sc = tl.sum(s0 * c[None, :], axis=1)                                    # S_0 C      [BLOCK_P]
    bc = tl.sum(bw * c[None, :], axis=1)                                    # B_j·C      [BLOCK_L]
    y = decay * sc + tl.sum((coef * bc)[:, None] * xw, axis=0)
    tl.store(y_ptrs, y, mask=mask_p)

    if w == L - 1:
        # flush: S_new = exp(Σ la) S_0 + (coef X)ᵀ B, written once; nothing appended (w -> 0)
        s_new = decay * s0 + tl.dot(tl.trans(xw * coef[:, None]), bw, input_precision="ieee")
        _store_checkpoint(st_ptrs, s_new, tile_mask, la_cur, slot * H + h, offs_p[:, None] * N + offs_n[None, :],
                          STOCHASTIC_FP16)
    else:
        tl.store(xr_ptr + slot * s_xrb + h * s_xrh + w * s_xrl + offs_p * s_xrp,
                 x_cur.to(xr_ptr.dtype.element_ty), mask=mask_p)
        if pid_p == 0:
            tl.store(dtr_ptr + slot * s_drb + h * s_drh + w * s_drl, dt_cur)
            tl.store(lar_ptr + slot * s_lrb + h * s_lrh + w * s_lrl, la_cur)
            if h % heads_per_g == 0:                  # one program per group appends B_t
                tl.store(br_base + w * s_brl + offs_n * s_brn, b_cur.to(Br_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _step_window(lar_ptr, dtr_ptr, xr_ptr, la_ptr, dt_ptr, x_ptr, slot, row, h, w, offs_l, offs_p, mask_p,
                 s_lrb, s_lrh, s_lrl, s_drb, s_drh, s_drl, s_xrb, s_xrh, s_xrl, s_xrp,
                 s_lb, s_lh, s_db, s_dh, s_xb, s_xh, s_xp):
    """The window of a decode step, the current token at index ``w`` after the ``w`` held records:
    ``(la_cur, dt_cur, x_cur, coef [BLOCK_L], decay, xw [BLOCK_L, BLOCK_P])`` with ``coef_j = dt_j exp(Σ_{j<i<=w}
    la_i)`` (suffix sums, <= 0) and ``decay = exp(Σ_{i<=w} la_i)``. Shared by the flush fold and the read-copy step."""
    hist = offs_l < w
    cur = offs_l == w
    la_cur = tl.load(la_ptr + row * s_lb + h * s_lh)
    dt_cur = tl.load(dt_ptr + row * s_db + h * s_dh)
    la_w = tl.load(lar_ptr + slot * s_lrb + h * s_lrh + offs_l * s_lrl, mask=hist, other=0.0).to(tl.float32)
    la_next = tl.load(lar_ptr + slot * s_lrb + h * s_lrh + (offs_l + 1) * s_lrl, mask=offs_l + 1 < w,
                      other=0.0).to(tl.float32)
    dt_w = tl.load(dtr_ptr + slot * s_drb + h * s_drh + offs_l * s_drl, mask=hist, other=0.0).to(tl.float32)
    la_w = tl.where(cur, la_cur.to(tl.float32), la_w)
    dt_w = tl.where(cur, dt_cur.to(tl.float32), dt_w)
    total = tl.sum(la_w, axis=0)
    after = _suffix_after(la_next, la_cur.to(tl.float32), w, offs_l)
    coef = tl.where(offs_l <= w, dt_w * tl.exp(after), 0.0)
    decay = tl.exp(tl.minimum(total, 0.0))

    x_cur = tl.load(x_ptr + row * s_xb + h * s_xh + offs_p * s_xp, mask=mask_p, other=0.0)
    xw = tl.load(xr_ptr + slot * s_xrb + h * s_xrh + offs_l[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                 mask=hist[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    xw = tl.where(cur[:, None], x_cur.to(tl.float32)[None, :], xw)     # masked loads: zeros past w already
    return la_cur, dt_cur, x_cur, coef, decay, xw


@triton.jit
def _fold_tile(state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, y_ptr,
               row, slot, h, pid_p, w, H, P, N, heads_per_g, heads_per_gc,
               s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
               s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
               s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, N_TILES: tl.constexpr,
               STOCHASTIC_FP16: tl.constexpr, amax_ptr, AMAX: tl.constexpr):
    """The flush of one ``BLOCK_P``-row slice of head ``h`` of a row at cursor ``w``: the window folded into the
    checkpoint over N in ``BLOCK_P x BLOCK_N`` tiles, each written once; ``y = S_new C``. The ``pre`` variant's flush
    launch. ``AMAX`` (the nvfp4 read copy's flush): also ``atomic_max`` the slice's largest stored magnitude into
    ``amax_ptr[row]`` (int32 bits of a non-negative fp32: the same order), for the copy's per-slot tensor scale, one
    atomic per row of the slice (no cross-warp reduction)."""
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    offs_l = tl.arange(0, BLOCK_L)
    hist = offs_l < w
    cur = offs_l == w
    g = h // heads_per_g
    gc = h // heads_per_gc
    la_cur, dt_cur, x_cur, coef, decay, xw = _step_window(
        lar_ptr, dtr_ptr, xr_ptr, la_ptr, dt_ptr, x_ptr, slot, row, h, w, offs_l, offs_p, mask_p,
        s_lrb, s_lrh, s_lrl, s_drb, s_drh, s_drl, s_xrb, s_xrh, s_xrl, s_xrp, s_lb, s_lh, s_db, s_dh, s_xb, s_xh, s_xp)
    st_base = state_ptr + slot * s_sb + h * s_sh
    br_base = Br_ptr + slot * s_brb + g * s_brg
    b_base = B_ptr + row * s_bb + g * s_bg
    c_base = C_ptr + row * s_cb + gc * s_cg
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    # flush: S_new = exp(Σ la) S_0 + (coef X)ᵀ B, tile by tile, written once; y = S_new C
    xc = tl.trans(xw * coef[:, None])                    # [BLOCK_P, BLOCK_L]
    acc_y = tl.zeros([BLOCK_P], dtype=tl.float32)
    amax = tl.zeros([BLOCK_P], dtype=tl.float32)     # AMAX: per row over the N tiles (an elementwise running max
    # reduced once was slower, H200: the fold 900 -> 954 µs at Super bs256, its registers)
    for nt in range(N_TILES):                          # constexpr trip count (see module notes)
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        bw = tl.load(br_base + offs_l[:, None] * s_brl + offs_n[None, :] * s_brn,
                     mask=hist[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        b_cur = tl.load(b_base + offs_n * s_bn, mask=mask_n, other=0.0).to(tl.float32)
        bw = tl.where(cur[:, None], b_cur[None, :], bw)
        s_ptrs = st_base + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
        tile_mask = mask_p[:, None] & mask_n[None, :]
        s0 = tl.load(s_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
        s_new = decay * s0 + tl.dot(xc, bw, input_precision="ieee")
        s_st = _round_checkpoint(s_new, s_ptrs, la_cur, slot * H + h, offs_p[:, None] * N + offs_n[None, :],
                                 STOCHASTIC_FP16)
        tl.store(s_ptrs, s_st, mask=tile_mask)
        if AMAX:                                        # masked lanes hold zeros (zero loads and operands)
            amax = tl.maximum(amax, tl.max(tl.abs(s_st.to(tl.float32)), axis=1))
        c = tl.load(c_base + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
        acc_y += tl.sum(s_new * c[None, :], axis=1)
    tl.store(y_ptrs, acc_y, mask=mask_p)
    if AMAX:
        tl.atomic_max(amax_ptr + row + offs_p * 0, amax.to(tl.int32, bitcast=True), mask=mask_p, sem="relaxed")


@triton.jit
def _advance_cursor_kernel(cursor_ptr, slot_ptr, n_rows, L, HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    """w -> w + 1, or 0 after a flush, for every non-padded row (the read-copy steps' last launch)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < n_rows
    if HAS_SLOT:
        slots = tl.load(slot_ptr + rows, mask=m, other=-1).to(tl.int64)
    else:
        slots = rows.to(tl.int64)
    m = m & (slots >= 0)
    w = tl.load(cursor_ptr + slots, mask=m, other=0)
    tl.store(cursor_ptr + slots, tl.where(w == L - 1, 0, w + 1), mask=m)


# Launch configuration override for benchmarks and tests (``tuning.tuned`` strings): the variant, tile sizes, warps
# and the flush grid's programs per SM. Empty in use.
TUNING = Tuning(__name__, ("BLOCK_P", "FLUSH_N", "FLUSH_P", "flush_per_sm", "flush_warps", "num_warps"),
                variants=("whole", "pre"))

# The last compiled step kernel launched (benchmarks print its registers / spills / shared memory).
LAST_LAUNCH: dict = {}

# Rows x heads up to which the latency variant runs (H200 sweep: at bs8 whole beat pre on both
# geometries, 1.34x / 1.30x vs 1.27x / 1.16x; at bs32 pre wins, 1.70x vs 1.46x).
WHOLE_MAX_ROW_HEADS = 1024


def fold_tile_shape(P: int, N: int, block_l: int) -> tuple[int, int, int]:
    """``(rows, columns, warps)`` of the tiled fold (:func:`_fold_tile`: the listed flush launches, the nvfp4 read
    copy's too): 64 x 64 tiles on 4 warps where 64 divides P (Super's P = 64), else 32 x 32
    on 2 (4 for a window longer than 16); never below 16 (``tl.dot``)."""
    bp = 64 if P % 64 == 0 else 32
    return (max(16, min(bp, next_pow2(P))), max(16, min(bp, next_pow2(N))),
            4 if bp == 64 or block_l > 16 else 2)


def fixed_grid(items: int, warps: int, device: torch.device, per_sm: int | None = None) -> int:
    """Programs of a launch that walks ``items`` on a fixed grid (the listed flush and encode launches): ``per_sm``
    per SM (default 32 warps per SM), never more than there are items."""
    return min(items, (per_sm or max(1, 32 // warps)) * _sm_count(device))


@memo_unless_tuned(TUNING)
def launch_config(b: int, H: int, P: int, N: int, L: int, state_bytes: int = 4) -> dict:
    """Kernel variant and launch configuration for a step of ``b`` rows (H200 sweeps: docs/design/mamba2_kernel.md).

    * ``whole`` (latency, ``b * H <= WHOLE_MAX_ROW_HEADS``): ``BLOCK_P`` = 16 rows of P (or 32), all of N in one
      tile, 1 warp per 2048 tile elements; every load issued before ``w`` is known; one launch (bs1 Super 1.23x).
    * ``pre`` (bandwidth, the default above; :mod:`.mamba2_pre_triton`): a launch zeroes the flush list's count, and
      launch 1, its programmatic dependent, per (row, group of heads) issues every ring load before the cursor,
      writes ``cb = coef (B·C)`` and the decay to scratch (stored ``evict_last``, kept in L2 for the pass), appends
      the records and lists flush rows; launch 2 (launch 1's programmatic dependent) streams ``BLOCK_P x N``
      checkpoint tiles of non-flush rows, ``y = decay (S_0 C) + Σ_j cb_j x_j`` over the held x records only, loaded
      after the cursor with the tile; launch 3 walks the listed flush rows on 32 warps per SM (:func:`_fold_tile`,
      64 x 64 tiles and 4 warps where 64 divides P, else 32 x 32 and 2 warps) and advances the cursors. Super fp32
      bs256 2.11x, bs128 2.10x (H200). Launch 2's tiles are 64 x N on 2 warps where 64 divides P (Super), else
      16 x N on 1 warp; for 2-byte checkpoints (``state_bytes``) 32 x N on 1 warp. ``rows_outer`` (where 64 does
      not divide P): launch 2's grid is ``(n_pb, H, b)``, programs in memory order.
    ``tl.dot`` needs every dim >= 16; the window sits on a power-of-two axis >= 16.
    """
    block_l = max(16, next_pow2(L))
    block_n_whole = max(16, next_pow2(N))
    variant = TUNING.get("variant") or ("whole" if b * H <= WHOLE_MAX_ROW_HEADS else "pre")
    if variant == "whole":
        block_p = TUNING.get("BLOCK_P") or (32 if P % 32 == 0 and P > 64 else 16)
        cfg = dict(BLOCK_P=block_p, BLOCK_N=block_n_whole,
                   num_warps=TUNING.get("num_warps") or max(1, min(8, max(block_p, block_l) * block_n_whole // 2048)))
    elif variant == "pre":
        # the checkpoint pass's tile: 64 x N on 2 warps where 64 divides P (H200, Super bs256: fp32
        # L-avg 319.0 -> 311.6 µs, mostly fewer programs that return at the flush; bf16 194.0 -> 187.8), else
        # 16 x N on 1 warp (Nano's P = 80: 64-row tiles leave 48 rows masked, 3-6% slower). 2-byte checkpoints:
        # 32 x N on 1 warp at both (H200, bf16 bs 128 / 256 / 512: Super non-flush 82.2 -> 80.4 /
        # 155.5 -> 152.3 / 305.1 -> 295.6 µs, its flush 3-5% slower, L-avg 1-1.5% lower; Nano non-flush equal,
        # flush 3-4% faster, L-avg 1% lower; fp32 checkpoints lost 2-10% with it)
        p64 = P % 64 == 0
        narrow = state_bytes <= 2
        flush_p, flush_n, flush_warps = fold_tile_shape(P, N, block_l)
        cfg = dict(BLOCK_P=TUNING.get("BLOCK_P") or (32 if narrow else 64 if p64 else 16), BLOCK_N=block_n_whole,
                   num_warps=TUNING.get("num_warps") or (2 if p64 and not narrow else 1),
                   FLUSH_P=TUNING.get("FLUSH_P") or flush_p, FLUSH_N=TUNING.get("FLUSH_N") or flush_n,
                   flush_warps=TUNING.get("flush_warps") or flush_warps,
                   flush_programs_per_sm=TUNING.get("flush_per_sm"),
                   # the pass's grid (n_pb, H, b), a row's programs in memory order, where 64 does not divide P
                   # (16-row tiles: Nano non-flush -1 to -9 µs at bs 128-512, H200); (n_pb, b, H) for Super's
                   # whole-head tiles, where the other order lost 0-3 µs
                   rows_outer=not p64)
        # (Capping the pass's registers for more programs per SM lost: ncu showed 6 programs, 12 warps per SM at
        # 158 / 140 registers, but 128 spilled and made Super's non-flush steps 14-33% slower; H200. The pass's tile
        # loads through L2 only, ld.global.cg, moved nothing beyond 0.5 µs. No evict_first on the tile stream: in a
        # one-layer benchmark it keeps the last step's ring records in L2, which a model's other layers would
        # evict; docs/design/mamba2_kernel.md)
    else:
        raise ValueError(f"replay_compile.mamba2: unknown kernel variant {variant!r} (whole, pre)")
    return dict(cfg, variant=variant, BLOCK_L=block_l)


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter then walks the list in a loop)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def replay_step_triton(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    """Triton implementation of :func:`replay_step_reference` (same arguments, same in-place contract)."""
    S, H, P, N = state.shape
    b = x.shape[0]
    L = x_ring.shape[2]
    G, Gc = B_ring.shape[1], C.shape[1]
    y = torch.empty((b, H, P), dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    cfg = launch_config(b, H, P, N, L, state.element_size())
    n_pb = cdiv(P, cfg["BLOCK_P"])
    if n_pb * H >= 1 << 15 or L >= _ARRIVAL:
        raise ValueError(f"replay_compile.mamba2: {H} heads x {n_pb} P-blocks (or L={L}) exceed the cursor word's "
                         "arrival counter; use fewer heads per layer")
    has_slot = slot_idx is not None
    # None when absent (HAS_SLOT False: never dereferenced). Not the cursor as a stand-in: traced into a compiled
    # graph (ops/library.py), torch's mutation analysis counts a pointer whose loaded values address a store as
    # written, and one tensor passed as two written arguments is copied on every step
    slot_arg = slot_idx if has_slot else None
    args = (state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_arg, y,
            H, P, N, L, H // G, H // Gc, n_pb * H,
            *state.stride(), *x_ring.stride(), *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
            *x.stride(), *dt.stride(), *la.stride(), *B.stride(), *C.stride(), *y.stride())
    common = dict(HAS_SLOT=has_slot, BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], BLOCK_L=cfg["BLOCK_L"],
                  STOCHASTIC_FP16=state.dtype == torch.float16, num_warps=cfg["num_warps"])
    if cfg["variant"] == "whole":
        k = launch(_mamba2_replay_whole_kernel)[(n_pb, b, H)](*args, **common)
    else:                                          # pre: launches in mamba2_pre_triton
        from .mamba2_pre_triton import replay_step_pre

        k = replay_step_pre(cfg, args, common, has_slot, slot_arg, n_pb)
    LAST_LAUNCH["kernel"] = k
    return y


def kernel_resources(k) -> str:
    """``"regs R, spills S, smem B"`` of a compiled Triton kernel (what a launch returns), for benchmark logs;
    ``""`` under the interpreter, whose launches return nothing."""
    try:
        return f"regs {k.n_regs}, spills {k.n_spills}, smem {k.metadata.shared}"
    except AttributeError:
        return ""
