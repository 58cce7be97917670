"""The ``pre`` variant of the Mamba-2 replay step (bandwidth: large batches), the default above
``mamba2_triton.WHOLE_MAX_ROW_HEADS`` rows x heads. Same contract as
:func:`~replay_compile.kernels.mamba2_reference.replay_step_reference`; launched by
:func:`~replay_compile.kernels.mamba2_triton.replay_step_triton`, whose module holds the shared helpers, the
configuration (:func:`~replay_compile.kernels.mamba2_triton.launch_config`, ``TUNING``) and the other variants.

Launches, all routed on the device from the cursor (one captured CUDA graph serves every step):

0. :func:`_zero_count_kernel` zeroes the flush list's count; launch 1 is its programmatic dependent (Hopper).
1. :func:`_mamba2_prepass_window_kernel`, grid ``(b, H / HPP)``: per row and group of ``HPP`` heads, the window's
   per-record weights ``cb_j = coef_j (B_j·C)`` and the decay into fp32 scratch; appends the ``dt``, ``log a``,
   ``B`` records; lists flushing rows in ``work = [count, rows...]``.
2. :func:`_mamba2_prepass_apply_kernel`, grid ``(cdiv(P, BLOCK_P), b, H)`` (``(.., H, b)`` where 64 does not divide
   P): streams the ``BLOCK_P x N`` checkpoint tile of non-flush rows (fp32: 64 rows on 2 warps where 64 divides P,
   else 16 on 1 warp; 2-byte checkpoints: 32 rows on 1 warp), ``y = decay (S_0 C) + Σ_j cb_j x_j`` over its slice
   of the held x records, appends ``x``.
   A read-only stream of an fp32 checkpoint on the H200 reaches 97-100% of copy bandwidth; this pass alone runs
   there (docs/design/mamba2_kernel.md). A bf16 checkpoint's stream reaches 88-93% at bs128. (A persistent form of this
   pass, a fixed grid looping over the tiles with loads pipelined through shared memory, lost at every point
   measured.)
3. :func:`_mamba2_flush_list_kernel`: a fixed grid (32 warps per SM) advances the cursors and walks the listed
   rows' tiles with the tiled fold (:func:`~replay_compile.kernels.mamba2_triton._fold_tile`); a non-flush step pays
   ~2 µs for it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch, pdl_on, pdl_options
from .mamba2_triton import _fold_tile, _list_item, _list_row, _row_slot, _step_row, fixed_grid

__all__ = ["launch_window", "replay_step_pre", "window_heads"]


@triton.jit
def _list_flush_row(work_ptr, row, hb, PDL_WAIT: tl.constexpr):
    """Append a flushing row to ``work = [count, rows...]`` once (from its first window program); ``PDL_WAIT``:
    after the launch that zeroes the count (:func:`_zero_count_kernel`) has finished."""
    if hb == 0:
        if PDL_WAIT:
            tl.extra.cuda.gdc_wait()
        _list_row(work_ptr, row)


@triton.jit
def _zero_count_kernel(work_ptr, PDL: tl.constexpr):
    """``work[0] = 0`` (the listed flush's row count; the rows after it are written before they are read), as the
    programmatic primary of the window launch: the window launch starts at once instead of after a ``torch.zeros``
    of the whole list."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(work_ptr, 0)


@triton.jit
def _mamba2_prepass_window_kernel(
    dtr_ptr, lar_ptr, Br_ptr, cursor_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, win_ptr, dec_ptr,
    work_ptr, H, N, L, heads_per_g, heads_per_gc,
    s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl, s_brb, s_brg, s_brl, s_brn,
    s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn,
    HAS_SLOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    HB: tl.constexpr, PDL: tl.constexpr, HPP: tl.constexpr, PDL_WAIT: tl.constexpr, SCRATCH_EVICT: tl.constexpr,
):
    """``pre`` variant, launch 1, grid ``(batch, H // HPP)``: the window's per-record weights for ``HPP`` heads of
    one group (they share ``B_j·C``, computed once), ``cb[h, j] = coef_hj (B_j·C)`` (zero past ``w``) into
    ``win_ptr`` (``[b, H, BLOCK_L]``) and ``decay_h = exp(Σ la_h)`` into ``dec_ptr`` (``[b, H]``), both fp32, and
    the non-flush rows' ``dt``, ``log a`` and ``B`` records appended. The x window and ``x`` are not touched: the
    checkpoint pass reads each program's own ``BLOCK_P`` slice of the x window (6% of its tile's bytes) and appends
    ``x``, and reads neither the other rings nor B.

    Every ring load is issued before the cursor arrives (whole ``L`` windows, stale slots discarded in registers):
    one memory round trip per program instead of two. Flush rows return; the row's first program appends the row
    to ``work = [count, rows...]`` for the flush launch.

    ``PDL``: the checkpoint pass is launched as this launch's programmatic dependent; every program lets it start
    at once (it streams its tiles, then waits for this grid before reading ``cb`` and ``decay``).

    ``PDL_WAIT``: this launch is itself the programmatic dependent of :func:`_zero_count_kernel`, which zeroes
    ``work``'s count; a flush row waits for it (``gdc_wait``) before appending itself. Nothing else here reads or
    writes ``work``, and the zeroing launch started after every earlier writer had finished.

    ``HPP`` heads per program on an ``HB``-long (power-of-two) head axis (:func:`window_heads`: ``HPP == HB`` but
    where the group size is not a power of two: Nano's 12 heads per group on a 16-long axis, one program per group
    instead of three of 4 heads); padded lanes are masked everywhere.

    ``SCRATCH_EVICT``: the ``cb`` and decay stores' L2 eviction hint, ``"evict_last"`` for the fp32 step (kept in
    L2 while the checkpoint pass streams its tiles through it: non-flush 0-1.9 µs faster at bs 128-512, H200),
    ``""`` for the read copy's window, where it is unmeasured.
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    if slot < 0:
        return
    h0 = hb.to(tl.int64) * HPP
    mask_h = tl.arange(0, HB) < HPP
    offs_h = h0 + tl.arange(0, HB)                  # HPP divides the heads of a group: one g, one gc; lanes >= HPP
    lane_h = tl.where(mask_h, offs_h, h0)           # masked, their addresses kept in range
    g = h0 // heads_per_g
    gc = h0 // heads_per_gc
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_l = tl.arange(0, BLOCK_L)
    in_l = offs_l < L                               # every load before the cursor: stale slots read, then dropped
    la_w = tl.load(lar_ptr + slot * s_lrb + lane_h[:, None] * s_lrh + offs_l[None, :] * s_lrl,
                   mask=mask_h[:, None] & in_l[None, :], other=0.0).to(tl.float32)   # [HB, BLOCK_L]
    nxt = offs_l + 1                                # one record ahead (mamba2_triton._suffix_after)
    la_next = tl.load(lar_ptr + slot * s_lrb + lane_h[:, None] * s_lrh + nxt[None, :] * s_lrl,
                      mask=mask_h[:, None] & (nxt < L)[None, :], other=0.0).to(tl.float32)
    dt_w = tl.load(dtr_ptr + slot * s_drb + lane_h[:, None] * s_drh + offs_l[None, :] * s_drl,
                   mask=mask_h[:, None] & in_l[None, :], other=0.0).to(tl.float32)
    br_base = Br_ptr + slot * s_brb + g * s_brg
    bw = tl.load(br_base + offs_l[:, None] * s_brl + offs_n[None, :] * s_brn,
                 mask=in_l[:, None] & mask_n[None, :], other=0.0).to(tl.float32)      # [BLOCK_L, BLOCK_N]
    la_cur = tl.load(la_ptr + row * s_lb + lane_h * s_lh, mask=mask_h, other=0.0)    # [HB]
    dt_cur = tl.load(dt_ptr + row * s_db + lane_h * s_dh, mask=mask_h, other=0.0)
    b_cur = tl.load(B_ptr + row * s_bb + g * s_bg + offs_n * s_bn, mask=mask_n, other=0.0)
    c = tl.load(C_ptr + row * s_cb + gc * s_cg + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
    w = tl.load(cursor_ptr + slot)
    if w == L - 1:                                  # flush rows: the flush launch computes their window
        _list_flush_row(work_ptr, row, hb, PDL_WAIT)
        return
    hist = offs_l < w
    cur = offs_l == w
    la_w = tl.where(cur[None, :], la_cur.to(tl.float32)[:, None], tl.where(hist[None, :], la_w, 0.0))
    dt_w = tl.where(cur[None, :], dt_cur.to(tl.float32)[:, None], tl.where(hist[None, :], dt_w, 0.0))
    # Σ_{j<i<=w} per head: a reverse cumulative sum of the decays one record ahead (mamba2_triton._suffix_after)
    la_next = tl.where((nxt < w)[None, :], la_next,
                       tl.where((nxt == w)[None, :], la_cur.to(tl.float32)[:, None], 0.0))
    after = tl.minimum(tl.cumsum(la_next, axis=1, reverse=True), 0.0)
    coef = tl.where((offs_l <= w)[None, :], dt_w * tl.exp(after), 0.0)              # [HB, BLOCK_L]
    decay = tl.exp(tl.minimum(tl.sum(la_w, axis=1), 0.0))                           # [HB]
    bw = tl.where(cur[:, None], b_cur.to(tl.float32)[None, :], tl.where(hist[:, None], bw, 0.0))
    bc = tl.sum(bw * c[None, :], axis=1)                                             # [BLOCK_L]
    tl.store(win_ptr + (row * H + lane_h[:, None]) * BLOCK_L + offs_l[None, :], coef * bc[None, :],
             mask=mask_h[:, None], eviction_policy=SCRATCH_EVICT)
    tl.store(dec_ptr + row * H + lane_h, decay, mask=mask_h, eviction_policy=SCRATCH_EVICT)
    tl.store(dtr_ptr + slot * s_drb + lane_h * s_drh + w * s_drl, dt_cur, mask=mask_h)
    tl.store(lar_ptr + slot * s_lrb + lane_h * s_lrh + w * s_lrl, la_cur, mask=mask_h)
    if h0 % heads_per_g == 0:                         # one program per group appends B_t
        tl.store(br_base + w * s_brl + offs_n * s_brn, b_cur.to(Br_ptr.dtype.element_ty), mask=mask_n)


def window_heads(H: int, G: int, Gc: int, P: int, block_l: int) -> tuple[int, int]:
    """``(heads per program, head-axis length)`` of the window launch. The heads of a program divide both a B and a
    C group (so they share ``B_j·C``); at most 16 of them and at most 16K window elements (``axis x BLOCK_L x P``):
    the largest such divisor, on an axis padded to the next power of two (Nano's 12 heads per group: one program of
    12 on 16 lanes, not three of 4; H200, Nano non-flush bs128 143.0 -> 141.4 µs fp32, 84.1 -> 82.0 bf16)."""
    common = math.gcd(H // G, H // Gc)
    per_elems = block_l * max(16, next_pow2(P))
    hpp = max(d for d in range(1, min(16, common) + 1)
              if common % d == 0 and (d == 1 or next_pow2(d) * per_elems <= 16384))
    return hpp, next_pow2(hpp)


def launch_window(dt_ring, la_ring, B_ring, cursor, dt, la, B, C, slot_arg, has_slot, block_n, block_l, work,
                  pdl=False, pdl_wait=False, scratch_evict=False):
    """Launch 1 of the ``pre`` variants (the fp32 step and the read-copy step): returns fp32 scratch, the per-record
    weights ``cb [b, H, block_l]`` and ``dec [b, H]``; flush rows are appended to ``work``. ``pdl``: the next
    launch is its programmatic dependent (the checkpoint pass); ``pdl_wait``: it is itself the dependent of
    :func:`_zero_count_kernel`; ``scratch_evict``: the scratch is stored ``evict_last`` (kept in L2 for the pass
    through the tile stream)."""
    b, H = dt.shape
    N = B.shape[-1]
    G, Gc = B_ring.shape[1], C.shape[1]
    win = torch.empty((b, H, block_l), dtype=torch.float32, device=dt.device)
    dec = torch.empty((b, H), dtype=torch.float32, device=dt.device)
    hpp, hb = window_heads(H, G, Gc, 16, block_l)         # the weights have no P axis: the bound's smallest
    launch(_mamba2_prepass_window_kernel)[(b, H // hpp)](
        dt_ring, la_ring, B_ring, cursor, dt, la, B, C, slot_arg, win, dec,
        work, H, N, la_ring.shape[2], H // G, H // Gc,
        *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
        *dt.stride(), *la.stride(), *B.stride(), *C.stride(),
        HAS_SLOT=has_slot, BLOCK_N=block_n, BLOCK_L=block_l, HB=hb, PDL=pdl, HPP=hpp, PDL_WAIT=pdl_wait,
        SCRATCH_EVICT="evict_last" if scratch_evict else "", num_warps=1, **pdl_options(pdl_wait))
    return win, dec


@triton.jit
def _x_slice(xr_base, x_ptrs, n, offs_l, offs_p, mask_p, s_xrl, s_xrp):
    """A pass program's ``[BLOCK_L, BLOCK_P]`` slice of the x window at ``xr_base`` (one slot and head), records
    ``j < n`` (the held ``w``, or the whole ``L``: :func:`_cb_window` then drops the stale ones), and its slice of
    the current ``x`` at ``x_ptrs``. Shared by the fp32 step's pass and the read copies' copy pass."""
    xw = tl.load(xr_base + offs_l[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                 mask=(offs_l < n)[:, None] & mask_p[None, :], other=0.0)
    return xw, tl.load(x_ptrs, mask=mask_p, other=0.0)


@triton.jit
def _cb_window(cbv, xw, x_cur, w, offs_l, x_append_ptrs, mask_p):
    """A pass program's window term from the window launch's per-record weights ``cbv`` [BLOCK_L] (zero past
    ``w``): ``Σ_j cb_j x_j`` over its ``[BLOCK_L, BLOCK_P]`` slice ``xw`` of the x window, the current ``x_cur``
    [BLOCK_P] in slot ``w`` (slots past ``w`` dropped: stale ones may be NaN); appends ``x_cur`` at
    ``x_append_ptrs`` (the ring's slot ``w``). Shared by the fp32 step's pass and the read copies' copy pass."""
    xw = tl.where((offs_l == w)[:, None], x_cur.to(tl.float32)[None, :],
                  tl.where((offs_l < w)[:, None], xw.to(tl.float32), 0.0))
    tl.store(x_append_ptrs, x_cur.to(x_append_ptrs.dtype.element_ty), mask=mask_p)
    return tl.sum(cbv[:, None] * xw, axis=0)


@triton.jit
def _mamba2_prepass_apply_kernel(
    state_ptr, xr_ptr, cursor_ptr, x_ptr, C_ptr, slot_ptr, y_ptr, win_ptr, dec_ptr,
    H, P, N, L, heads_per_gc,
    s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_xb, s_xh, s_xp, s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr, ROWS_OUTER: tl.constexpr,
):
    """``pre`` variant, launch 2, grid ``(cdiv(P, BLOCK_P), batch, H)``: a ``BLOCK_P x N`` checkpoint tile, loaded
    after the cursor (before it: 18-20% slower at Super bf16, H200). Non-flush rows: ``y = decay (S_0 C) + win``
    with ``win = Σ_j cb_j x_j`` over this program's slice of the x ring and launch 1's per-record weights ``cb``,
    only the held records ``j < w`` read, issued with the tile (non-flush 2-6% faster than the whole window read
    before the cursor at bs 128-512, H200). Flush rows return: the listed flush launch folds them.

    ``PDL`` (launched as the window launch's programmatic dependent): everything up to the cursor is read while
    launch 1 may still run (launch 1 writes none of it, and it started after every earlier writer had finished);
    ``gdc_wait`` comes before launch 1's outputs (``cb``, ``decay``) and before every store but a padding row's
    zero output.

    ``ROWS_OUTER``: grid ``(n_pb, H, b)``, consecutive programs walk a row's heads in memory order (where 64 does
    not divide P: Nano non-flush -1 to -9 µs at bs 128-512, H200; Super's whole-head tiles lost 0-3 µs).
    (Nano's five tiles of a head streamed by one program in a pipelined loop lost: bf16 bs128 non-flush 75.6 ->
    80-91 µs; and so did this pass computing its head's window weights itself, with no launch 1: Super bf16 bs256
    155.5 -> 229 µs, the window's loads and reductions in every program's critical path; H200.)"""
    pid_p = tl.program_id(0)
    if ROWS_OUTER:                                  # grid (n_pb, H, b): programs in a row's memory order
        row = tl.program_id(2).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
    else:                                           # grid (n_pb, b, H)
        row = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    slot = _step_row(slot_ptr, row, y_ptrs, mask_p, HAS_SLOT, BLOCK_P)
    if slot < 0:                                   # padding row: zero output (stored above), touch nothing else
        return
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tile_mask = mask_p[:, None] & mask_n[None, :]
    s_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    gc = h // heads_per_gc
    c = tl.load(C_ptr + row * s_cb + gc * s_cg + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
    offs_l = tl.arange(0, BLOCK_L)
    xr_base = xr_ptr + slot * s_xrb + h * s_xrh
    x_ptrs = x_ptr + row * s_xb + h * s_xh + offs_p * s_xp
    w = tl.load(cursor_ptr + slot)                  # advanced afterwards by the flush launch
    if w == L - 1:                                  # flush rows are the flush launch's
        return
    s0 = tl.load(s_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    # only the held records, issued with the tile, before the wait (launch 1 writes no x here)
    xw, x_cur = _x_slice(xr_base, x_ptrs, w, offs_l, offs_p, mask_p, s_xrl, s_xrp)
    if PDL:
        tl.extra.cuda.gdc_wait()                    # launch 1 complete: its outputs are visible from here on
    cbv = tl.load(win_ptr + (row * H + h) * BLOCK_L + offs_l)                        # zero past w
    decay = tl.load(dec_ptr + row * H + h)
    win = _cb_window(cbv, xw, x_cur, w, offs_l, xr_base + w * s_xrl + offs_p * s_xrp, mask_p)
    tl.store(y_ptrs, decay * tl.sum(s0 * c[None, :], axis=1) + win, mask=mask_p)


@triton.jit
def _walk_listed_folds(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr, work_ptr, amax_ptr,
    H, P, N, L, heads_per_g, heads_per_gc, n_pb,
    s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
    s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
    s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    N_TILES: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, n_rows, AMAX: tl.constexpr,
):
    """The body of the listed flush launches: this program's share of the cursor advance and of the
    ``count x H x n_pb`` fold tiles of the rows in ``work = [count, rows...]`` (:func:`_fold_tile`; ``AMAX``: the
    nvfp4 read copy's slot amax into ``amax_ptr``)."""
    # the cursor advance, folded in (one launch fewer; 1-3% faster at bs128, H200): every earlier launch has read w,
    # and the folds below take w = L - 1 from the list, not from the cursor
    r = tl.program_id(0)
    while r < n_rows:
        s = _row_slot(slot_ptr, r.to(tl.int64), HAS_SLOT)
        if s >= 0:
            wr = tl.load(cursor_ptr + s)
            tl.store(cursor_ptr + s, tl.where(wr == L - 1, 0, wr + 1))
        r += tl.num_programs(0)
    n_items = tl.load(work_ptr) * (H * n_pb)
    t = tl.program_id(0)
    while t < n_items:
        row, h, tile = _list_item(work_ptr, t, H, n_pb)
        slot = _row_slot(slot_ptr, row, HAS_SLOT)
        if slot >= 0:           # never listed; guarded so that no list can make a fold address slot -1
            _fold_tile(state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, y_ptr,
                       row, slot, h, tile, L - 1, H, P, N, heads_per_g, heads_per_gc,
                       s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
                       s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
                       s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
                       BLOCK_P, BLOCK_N, BLOCK_L, N_TILES, STOCHASTIC_FP16, amax_ptr, AMAX)
        t += tl.num_programs(0)


@triton.jit
def _mamba2_flush_list_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr, work_ptr,
    H, P, N, L, heads_per_g, heads_per_gc, n_pb,
    s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
    s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
    s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    N_TILES: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, n_rows,
):
    """``pre`` variant, flush launch: a fixed grid (a few programs per SM) advances the cursors and walks the
    ``count x H x n_pb`` flush tiles of the rows the window launch listed in ``work = [count, rows...]``, each folded
    by :func:`_fold_tile`.
    On the 15 of 16 steps where no row flushes, every program reads ``count = 0`` and exits: a ``(n_pb, b, H)`` grid
    of programs that each read a cursor and return cost 21-45 µs per step at bs256 (H200). (No
    defaulted parameters here or in any kernel launched inside a compiled graph: ``wrap_triton`` needs every
    argument passed.) (As the checkpoint pass's programmatic dependent, waiting for it before reading anything, the
    flush step was 2-16% slower and a non-flush step 0-1.4 µs faster: H200, docs/design/mamba2_kernel.md.)"""
    _walk_listed_folds(state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr,
                       slot_ptr, y_ptr, work_ptr, y_ptr, H, P, N, L, heads_per_g, heads_per_gc, n_pb,
                       s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
                       s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
                       s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
                       HAS_SLOT, BLOCK_P, BLOCK_N, BLOCK_L, N_TILES, STOCHASTIC_FP16, n_rows, False)


def replay_step_pre(cfg: dict, args: tuple, common: dict, has_slot: bool, slot_arg, n_pb: int):
    """Launch the ``pre`` step; ``args`` is :func:`~replay_compile.kernels.mamba2_triton.replay_step_triton`'s
    argument tuple (tensors, sizes, strides). Returns the checkpoint pass's compiled kernel."""
    state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, _, y = args[:13]
    H, P, N, L = args[13:17]
    b = x.shape[0]
    pdl = pdl_on(x.device)
    # the listed flush's row list: [count, rows...]. (One flag per row written by the window launch instead, no
    # memset: non-flush steps 0-1.9 µs faster at bs 128 / 256, the flush step 26-34% slower with the flags ranked
    # per fold item and up to 29% with them ranked once per program; H200, docs/design/mamba2_kernel.md.)
    # Only the count is zeroed, by a launch of ours whose programmatic dependent is the window launch, instead of a
    # torch.zeros of the list before it (L-avg 0.1-1.3 µs lower at all 8 points of bs 128 / 256 x Super / Nano x
    # fp32 / bf16, H200)
    work = torch.empty((b + 1,), dtype=torch.int32, device=x.device)
    launch(_zero_count_kernel)[(1,)](work, PDL=pdl, **pdl_options(pdl))
    # launch 2 is launch 1's programmatic dependent (pdl); the window's scratch is kept in L2 for the pass
    # (scratch_evict: non-flush 0-1.9 µs faster at bs 128-512, never slower beyond noise; H200)
    win, dec = launch_window(dt_ring, la_ring, B_ring, cursor, dt, la, B, C, slot_arg, has_slot, cfg["BLOCK_N"],
                             cfg["BLOCK_L"], work, pdl=pdl, pdl_wait=pdl, scratch_evict=True)
    rows_outer = cfg["rows_outer"] and b < 1 << 16                 # the grid's z axis holds at most 65535 rows
    k = launch(_mamba2_prepass_apply_kernel)[(n_pb, H, b) if rows_outer else (n_pb, b, H)](
        state, x_ring, cursor, x, C, slot_arg, y, win, dec, H, P, N, L, H // C.shape[1],
        *state.stride(), *x_ring.stride(), *x.stride(), *C.stride(), *y.stride(),
        HAS_SLOT=has_slot, BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], BLOCK_L=cfg["BLOCK_L"],
        PDL=pdl, ROWS_OUTER=rows_outer, num_warps=cfg["num_warps"], **pdl_options(pdl))
    fl = dict(common, BLOCK_P=cfg["FLUSH_P"], BLOCK_N=cfg["FLUSH_N"], num_warps=cfg["flush_warps"],
              N_TILES=cdiv(N, cfg["FLUSH_N"]))
    n_fp = cdiv(P, cfg["FLUSH_P"])
    # 32 warps per SM (H200: 4 programs of 2 warps per SM made Nano's flush 1.6x slower)
    programs = fixed_grid(b * H * n_fp, cfg["flush_warps"], x.device, cfg["flush_programs_per_sm"])
    launch(_mamba2_flush_list_kernel)[(programs,)](
        *args[:13], work, *args[13:19], n_fp, *args[20:], **fl, n_rows=b)
    return k
