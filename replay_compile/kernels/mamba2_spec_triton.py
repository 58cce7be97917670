"""Triton kernel of the Mamba-2 speculative verify step and a device-side commit, the CUDA implementations of
``replay_compile::mamba2_spec_verify`` / ``spec_commit``. Same signatures and in-place contracts as
:func:`~replay_compile.kernels.mamba2_spec_reference.spec_verify_reference` and
:func:`~replay_compile.kernels.mamba2_spec_reference.spec_commit_reference`, where the ring, the cursors and the
flush rule are documented.

Verify, grid ``(cdiv(P, BLOCK_P), batch, H)``. A program holds its ``BLOCK_P x N`` checkpoint tile and the whole
window on one power-of-two axis ``BLOCK_W >= buf``: logical position ``k < w`` is a history record (ring slot
``(origin + k) & (buf - 1)``), ``w <= k < w + T`` is the ``k - w``-th token of this verify (read from the inputs).
The checkpoint is read once for all ``T`` outputs::

    y_t = exp(Σ_{lo<=i<=w+t} la_i) (S C_t) + Σ_{lo<=k<=w+t} dt_k exp(Σ_{k<i<=w+t} la_i) (B_k·C_t) x_k

with ``S = S_0, lo = 0`` on ordinary rows and, on flush rows, ``S = exp(Σ_{i<w} la_i) S_0 + Σ_{k<w} dt_k
exp(Σ_{k<i<w} la_i) x_k ⊗ B_k`` (the history folded in, written once when there is history) and ``lo = w``. Each
output takes its own suffix sums over the masked window (no differences of prefix sums, every exponent <= 0), as
the reference does.

Two launches. Everything that does not touch the checkpoint (the window's decay coefficients, ``B_k·C_t`` and a
flush row's fold coefficients) is computed once per (row, head) by launch 1 into a small scratch (``T x BLOCK_W``
weights per head, all ``T`` tokens as one tile); launch 2 streams
the checkpoint tile by tile, and its per-token work is what a plain decode step does (``S C_t`` and a short weighted
sum of the window's ``x``). A first single-launch kernel that redid the window work in every tile program ran at
12% of the copy bandwidth on the H200 (docs/design/speculative_rounds.md). The ``T`` new records go to ring slots
``(origin + w + t) & (buf - 1)``; cursors are left to the commit.

A row whose history and window do not fit the ring (``w + T > buf``, which the commit's flush rule prevents) gets
NaN outputs and touches nothing: the kernel cannot raise, so the error is made impossible to miss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch
from .mamba2_triton import _row_slot
from .tuning import Tuning


@triton.jit
def _spec_row(slot_ptr, w_ptr, row, T, HAS_SLOT: tl.constexpr, BUF: tl.constexpr):
    """(slot, w, overflow): the row's slot (negative: padding), its committed count, and whether the history and a
    window of T tokens overflow the ring (which the commit's flush rule prevents)."""
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    w = tl.load(w_ptr + tl.maximum(slot, 0))
    return slot, w, w + T > BUF


@triton.jit
def _spec_row_done(slot, w, T, out_tile, out_mask, BUF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Whether a checkpoint-pass program has nothing else to do: a padding row (``slot < 0``) gets zero outputs; a
    row whose window overflows the ring (which a commit never allows) NaN outputs, never a silently wrong one."""
    overflow = w + T > BUF
    if slot < 0:
        tl.store(out_tile, tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32), mask=out_mask)
    elif overflow:
        tl.store(out_tile, tl.full([BLOCK_T, BLOCK_C], float("nan"), tl.float32), mask=out_mask)
    return (slot < 0) | overflow


@triton.jit
def _spec_apply_row(slot_ptr, w_ptr, row, T, out_tile, out_mask, HAS_SLOT: tl.constexpr, BUF: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """(slot, w, done) for a checkpoint-pass program (:func:`_spec_row_done`)."""
    slot, w, _ = _spec_row(slot_ptr, w_ptr, row, T, HAS_SLOT, BUF)
    return slot, w, _spec_row_done(slot, w, T, out_tile, out_mask, BUF, BLOCK_T, BLOCK_C)


@triton.jit
def _mamba2_spec_window_kernel(
    dtr_ptr, lar_ptr, Br_ptr, w_ptr, origin_ptr, flush_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr,
    wgt_ptr, tot_ptr, fold_ptr, fdec_ptr,
    H, N, T, heads_per_g, heads_per_gc,
    s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,   # dt_ring, la_ring [S, H, buf]
    s_brb, s_brg, s_brl, s_brn,                 # B_ring [S, G, buf, N]
    s_db, s_dt, s_dh, s_lb, s_lt, s_lh,         # dt, la [b, T, H]
    s_bb, s_bt, s_bg, s_bn,                     # B [b, T, G, N]
    s_cb, s_ct, s_cg, s_cn,                     # C [b, T, Gc, N]
    HAS_SLOT: tl.constexpr, BUF: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
):
    """Launch 1 of 2, grid ``(batch, H // HEADS)``: everything that does not touch the checkpoint, for ``HEADS``
    consecutive heads that share their B and C groups (``B_k·C_t`` computed once for them). Writes
    ``wgt[row, h, t, k] = coef_{t,k} (B_k·C_t)`` and ``tot[row, h, t] = Σ_{lo<=i<=w+t} la_i`` for all ``T``
    tokens at once (``[BLOCK_T, BLOCK_W]`` tiles), and on flush rows the fold's per-record coefficients
    ``fold[row, h, k] = dt_k exp(Σ_{k<i<w} la_i)`` (k < w) and ``fdec[row, h] = Σ_{i<w} la_i``."""
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * HEADS
    slot, w, overflow = _spec_row(slot_ptr, w_ptr, row, T, HAS_SLOT, BUF)
    if (slot < 0) | overflow:
        return
    o = tl.load(origin_ptr + slot)
    fl = tl.load(flush_ptr + slot).to(tl.int32) != 0
    g = h0 // heads_per_g
    gc = h0 // heads_per_gc
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_W)
    hist = offs_k < w
    new = (offs_k >= w) & (offs_k < w + T)
    ring_k = (o + offs_k) & (BUF - 1)
    t_k = tl.where(new, offs_k - w, 0)
    bh = tl.load(Br_ptr + slot * s_brb + g * s_brg + ring_k[:, None] * s_brl + offs_n[None, :] * s_brn,
                 mask=hist[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    bn = tl.load(B_ptr + row * s_bb + t_k[:, None] * s_bt + g * s_bg + offs_n[None, :] * s_bn,
                 mask=new[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    bw = tl.where(hist[:, None], bh, bn)                                                    # [BLOCK_W, BLOCK_N]
    bc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)                                    # B_k·C_t
    for t in tl.static_range(BLOCK_T):
        c = tl.load(C_ptr + row * s_cb + t * s_ct + gc * s_cg + offs_n * s_cn, mask=mask_n & (offs_n * 0 + t < T),
                    other=0.0).to(tl.float32)
        bc = tl.where(offs_t[:, None] == t, tl.sum(bw * c[None, :], axis=1)[None, :], bc)
    lo = tl.where(fl, w, 0)
    end = w + offs_t                               # token t's window ends at position w + t
    live = (offs_k[None, :] >= lo) & (offs_k[None, :] <= end[:, None])                    # [BLOCK_T, BLOCK_W]
    nxt = offs_k + 1                               # window positions one ahead, for the suffix sums
    live_n = (nxt[None, :] >= lo) & (nxt[None, :] <= end[:, None])
    hist_n = nxt < w
    new_n = (nxt >= w) & (nxt < w + T)
    ring_n = (o + nxt) & (BUF - 1)
    t_n = tl.where(new_n, nxt - w, 0)
    for hh in tl.static_range(HEADS):
        h = h0 + hh
        la_w = tl.where(hist, tl.load(lar_ptr + slot * s_lrb + h * s_lrh + ring_k * s_lrl, mask=hist, other=0.0),
                        tl.load(la_ptr + row * s_lb + t_k * s_lt + h * s_lh, mask=new, other=0.0)).to(tl.float32)
        dt_w = tl.where(hist, tl.load(dtr_ptr + slot * s_drb + h * s_drh + ring_k * s_drl, mask=hist, other=0.0),
                        tl.load(dt_ptr + row * s_db + t_k * s_dt + h * s_dh, mask=new, other=0.0)).to(tl.float32)
        la_n = tl.where(hist_n, tl.load(lar_ptr + slot * s_lrb + h * s_lrh + ring_n * s_lrl, mask=hist_n,
                                        other=0.0),
                        tl.load(la_ptr + row * s_lb + t_n * s_lt + h * s_lh, mask=new_n, other=0.0)).to(tl.float32)
        # Σ_{k<i<=w+t}: a reverse cumulative sum of the decays one position ahead, never a difference
        # (mamba2_triton._suffix_after)
        after = tl.minimum(tl.cumsum(tl.where(live_n, la_n[None, :], 0.0), axis=1, reverse=True), 0.0)
        coef = tl.where(live, dt_w[None, :] * tl.exp(after), 0.0)
        base_idx = row * H + h
        tl.store(wgt_ptr + (base_idx * BLOCK_T + offs_t[:, None]) * BLOCK_W + offs_k[None, :], coef * bc)
        tl.store(tot_ptr + base_idx * BLOCK_T + offs_t,
                 tl.minimum(tl.sum(tl.where(live, la_w[None, :], 0.0), axis=1), 0.0))
        if fl:                                     # the fold of the history, k < w: Σ_{k<i<w}
            after_f = tl.minimum(tl.cumsum(tl.where(hist_n, la_n, 0.0), axis=0, reverse=True), 0.0)
            tl.store(fold_ptr + base_idx * BLOCK_W + offs_k, tl.where(hist, dt_w * tl.exp(after_f), 0.0))
            tl.store(fdec_ptr + base_idx, tl.minimum(tl.sum(tl.where(hist, la_w, 0.0), axis=0), 0.0))


@triton.jit
def _mamba2_spec_apply_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, w_ptr, origin_ptr, flush_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr, wgt_ptr, tot_ptr, fold_ptr, fdec_ptr,
    H, P, N, T, heads_per_g, heads_per_gc,
    s_sb, s_sh, s_sp, s_sn,                 # state [S, H, P, N]
    s_xrb, s_xrh, s_xrl, s_xrp,             # x_ring [S, H, buf, P]
    s_drb, s_drh, s_drl,                    # dt_ring [S, H, buf]
    s_lrb, s_lrh, s_lrl,                    # la_ring [S, H, buf]
    s_brb, s_brg, s_brl, s_brn,             # B_ring [S, G, buf, N]
    s_xb, s_xt, s_xh, s_xp,                 # x [b, T, H, P]
    s_db, s_dt, s_dh, s_lb, s_lt, s_lh,     # dt, la [b, T, H]
    s_bb, s_bt, s_bg, s_bn,                 # B [b, T, G, N]
    s_cb, s_ct, s_cg, s_cn,                 # C [b, T, Gc, N]
    s_yb, s_yt, s_yh, s_yp,                 # y [b, T, H, P]
    HAS_SLOT: tl.constexpr, BUF: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Launch 2 of 2, grid ``(cdiv(P, BLOCK_P), batch, H)``: the checkpoint pass (read once; flush rows fold and
    write it), the outputs and this verify's records. The tile and the new tokens' x are loaded before the cursor."""
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    offs_t = tl.arange(0, BLOCK_T)
    tt = offs_t < T
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tile_mask = mask_p[:, None] & mask_n[None, :]
    y_mask = tt[:, None] & mask_p[None, :]
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    sl = tl.maximum(slot, 0)
    live_p = offs_p * 0 + slot >= 0                # False on a padding row
    # issued first: nothing here depends on the cursor (a padding row's masks fetch nothing)
    st_ptrs = state_ptr + sl * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    base = tl.load(st_ptrs, mask=tile_mask & live_p[:, None], other=0.0).to(tl.float32)
    x_new = tl.load(x_ptr + row * s_xb + offs_t[:, None] * s_xt + h * s_xh + offs_p[None, :] * s_xp,
                    mask=y_mask & live_p[None, :], other=0.0)                                # [BLOCK_T, BLOCK_P]
    w = tl.load(w_ptr + sl)
    y_tile = y_ptr + row * s_yb + offs_t[:, None] * s_yt + h * s_yh + offs_p[None, :] * s_yp
    if _spec_row_done(slot, w, T, y_tile, y_mask, BUF, BLOCK_T, BLOCK_P):     # padding (zeros) or overflow (NaN)
        return
    o = tl.load(origin_ptr + slot)
    fl = tl.load(flush_ptr + slot).to(tl.int32) != 0
    g = h // heads_per_g
    gc = h // heads_per_gc
    offs_k = tl.arange(0, BLOCK_W)
    hist = offs_k < w
    ring_k = (o + offs_k) & (BUF - 1)
    xh = tl.load(xr_ptr + slot * s_xrb + h * s_xrh + ring_k[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                 mask=hist[:, None] & mask_p[None, :], other=0.0).to(tl.float32)       # [BLOCK_W, BLOCK_P]
    base_idx = row * H + h
    if fl:
        # the history folded into the checkpoint with launch 1's per-record coefficients, written once
        # (no tl.dot: its shared memory costs every program occupancy; H200, Nano bs256: a flush 1159 -> 1415 µs,
        # a non-flush verify 487 -> 599 µs)
        # Each record's loads are issued one iteration ahead, so their latency overlaps the previous rank-1 update
        # (H100, Nano bs256: a flushing verify 1423 -> 1299 µs, non-flushing equal, registers equal); ring slots are
        # always in bounds, and the load one past the history is never used.
        base = tl.exp(tl.load(fdec_ptr + base_idx)) * base
        xr_h = xr_ptr + slot * s_xrb + h * s_xrh
        br_h = Br_ptr + slot * s_brb + g * s_brg
        r0 = o & (BUF - 1)
        f_n = tl.load(fold_ptr + base_idx * BLOCK_W)
        x_n = tl.load(xr_h + r0 * s_xrl + offs_p * s_xrp, mask=mask_p, other=0.0).to(tl.float32)
        b_n = tl.load(br_h + r0 * s_brl + offs_n * s_brn, mask=mask_n, other=0.0).to(tl.float32)
        for k in range(0, w):
            f_k = f_n
            x_k = x_n
            b_k = b_n
            rn = (o + k + 1) & (BUF - 1)
            f_n = tl.load(fold_ptr + base_idx * BLOCK_W + tl.minimum(k + 1, BLOCK_W - 1))
            x_n = tl.load(xr_h + rn * s_xrl + offs_p * s_xrp, mask=mask_p, other=0.0).to(tl.float32)
            b_n = tl.load(br_h + rn * s_brl + offs_n * s_brn, mask=mask_n, other=0.0).to(tl.float32)
            base += (f_k * x_k)[:, None] * b_k[None, :]
        if w > 0:
            tl.store(st_ptrs, base.to(state_ptr.dtype.element_ty), mask=tile_mask)
    xn = x_new.to(tl.float32)
    for t in tl.static_range(BLOCK_T):
        c = tl.load(C_ptr + row * s_cb + t * s_ct + gc * s_cg + offs_n * s_cn, mask=mask_n & (offs_n * 0 + t < T),
                    other=0.0).to(tl.float32)
        sc = tl.sum(base * c[None, :], axis=1)                                             # S C_t [BLOCK_P]
        wrow = wgt_ptr + (base_idx * BLOCK_T + t) * BLOCK_W
        wh = tl.load(wrow + offs_k, mask=hist, other=0.0)                                  # held records
        wn = tl.load(wrow + w + offs_t, mask=tt, other=0.0)                                # this verify's tokens
        y = tl.exp(tl.load(tot_ptr + base_idx * BLOCK_T + t)) * sc + tl.sum(wh[:, None] * xh, axis=0) \
            + tl.sum(wn[:, None] * xn, axis=0)
        tl.store(y_ptr + row * s_yb + t * s_yt + h * s_yh + offs_p * s_yp, y, mask=mask_p & (offs_p * 0 + t < T))

    # this verify's records after the history (ring slots (origin + w + t) & (buf - 1))
    slot_t = (o + w + offs_t) & (BUF - 1)
    tl.store(xr_ptr + slot * s_xrb + h * s_xrh + slot_t[:, None] * s_xrl + offs_p[None, :] * s_xrp,
             x_new.to(xr_ptr.dtype.element_ty), mask=y_mask)
    if pid_p == 0:
        la_new = tl.load(la_ptr + row * s_lb + offs_t * s_lt + h * s_lh, mask=tt, other=0.0)
        dt_new = tl.load(dt_ptr + row * s_db + offs_t * s_dt + h * s_dh, mask=tt, other=0.0)
        tl.store(lar_ptr + slot * s_lrb + h * s_lrh + slot_t * s_lrl, la_new.to(lar_ptr.dtype.element_ty), mask=tt)
        tl.store(dtr_ptr + slot * s_drb + h * s_drh + slot_t * s_drl, dt_new.to(dtr_ptr.dtype.element_ty), mask=tt)
        if h % heads_per_g == 0:                   # one program per group appends B
            b_new = tl.load(B_ptr + row * s_bb + offs_t[:, None] * s_bt + g * s_bg + offs_n[None, :] * s_bn,
                            mask=tt[:, None] & mask_n[None, :], other=0.0)
            tl.store(Br_ptr + slot * s_brb + g * s_brg + slot_t[:, None] * s_brl + offs_n[None, :] * s_brn,
                     b_new.to(Br_ptr.dtype.element_ty), mask=tt[:, None] & mask_n[None, :])


# Launch configuration override for benchmarks and tests (``tuning.tuned``). Empty in use.
TUNING = Tuning(__name__, ("BLOCK_P", "num_warps", "window_heads", "window_warps"))


def spec_verify_triton(state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush, x, dt, la, B, C,
                       slot_idx=None):
    """Triton implementation of :func:`spec_verify_reference` (same arguments, same in-place contract); returns
    fp32 ``y`` [b, T, H, P]."""
    S, H, P, N = state.shape
    b, T = x.shape[:2]
    buf = x_ring.shape[2]
    G, Gc = B_ring.shape[1], C.shape[2]
    y = torch.empty((b, T, H, P), dtype=torch.float32, device=x.device)
    if b == 0 or T == 0:
        return y
    block_n = max(16, next_pow2(N))
    block_p = TUNING.get("BLOCK_P") or 16
    block_w, block_t = max(16, buf), next_pow2(T)
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else w
    # scratch of launch 1 (every entry a live row reads is written first)
    wgt = torch.empty((b, H, block_t, block_w), dtype=torch.float32, device=x.device)
    tot = torch.empty((b, H, block_t), dtype=torch.float32, device=x.device)
    fold = torch.empty((b, H, block_w), dtype=torch.float32, device=x.device)
    fdec = torch.empty((b, H), dtype=torch.float32, device=x.device)
    common = dict(HAS_SLOT=has_slot, BUF=buf, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_N=block_n)
    # heads per window program: they must share their B and C groups (1 always does). 4 from batch 64 up (H200,
    # Super bs256: 853.6 -> 790.8 us, 1.80x -> 1.95x over per-draft snapshots; smaller batches not measured, so they
    # keep one head per program and all their window parallelism)
    heads = TUNING.get("window_heads") or (4 if b >= 64 else 1)
    if (H // G) % heads or (H // Gc) % heads:
        heads = 1
    launch(_mamba2_spec_window_kernel)[(b, H // heads)](
        dt_ring, la_ring, B_ring, w, origin, is_flush, dt, la, B, C, slot_arg, wgt, tot, fold, fdec,
        H, N, T, H // G, H // Gc, *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(), *dt.stride(),
        *la.stride(), *B.stride(), *C.stride(), HEADS=heads,
        # 1 warp from batch 64 up (H200, Super bs256: 784 -> 738 µs, 1.94x -> 2.05x; 2 warps 2.02x)
        num_warps=TUNING.get("window_warps") or (1 if b >= 64 else 4), **common)
    launch(_mamba2_spec_apply_kernel)[(cdiv(P, block_p), b, H)](
        state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush,
        x, dt, la, B, C, slot_arg, y, wgt, tot, fold, fdec,
        H, P, N, T, H // G, H // Gc,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
        *x.stride(), *dt.stride(), *la.stride(), *B.stride(), *C.stride(), *y.stride(),
        # 1 warp, 16 x N tiles: best on the H200 (Nano bs256 non-flush: 487 µs; 32 x N on 2 warps 683)
        BLOCK_P=block_p, num_warps=TUNING.get("num_warps") or 1, **common)
    return y


POISONED = 1 << 30          # the cursor of a row whose commit was invalid: every later verify of it gives NaN


@triton.jit
def _spec_commit_kernel(w_ptr, origin_ptr, flush_ptr, n_ptr, slot_ptr, b, B, T, poisoned,
                        HAS_SLOT: tl.constexpr, BUF: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < b
    if HAS_SLOT:
        slot = tl.load(slot_ptr + rows, mask=live, other=-1).to(tl.int64)
    else:
        slot = rows.to(tl.int64)
    live = live & (slot >= 0)
    n = tl.load(n_ptr + rows, mask=live, other=1).to(tl.int32)
    w = tl.load(w_ptr + slot, mask=live, other=0)
    o = tl.load(origin_ptr + slot, mask=live, other=0)
    fl = tl.load(flush_ptr + slot, mask=live, other=0).to(tl.int32) != 0
    new_w = tl.where(fl, n, w + n)
    new_o = tl.where(fl, (o + w) & (BUF - 1), o)
    bad = (n < 1) | (n > T)
    new_w = tl.where(bad, poisoned, new_w)
    tl.store(w_ptr + slot, new_w, mask=live)
    tl.store(origin_ptr + slot, new_o, mask=live)
    tl.store(flush_ptr + slot, (new_w + T > B).to(tl.int1), mask=live)


def spec_commit_triton(w, origin, is_flush, n_accepted, B: int, T: int, buf: int, slot_idx=None):
    """:func:`spec_commit_reference` as one Triton launch (CUDA-graph safe, no host synchronisation). A row whose
    accepted count is outside ``1..T`` cannot raise from the device: its cursor is poisoned (``POISONED``), so every
    later verify of that slot returns NaN (never a silently wrong output) until the slot is reset."""
    b = n_accepted.shape[0]
    if b == 0:
        return
    block = 128
    has_slot = slot_idx is not None
    launch(_spec_commit_kernel)[(cdiv(b, block),)](
        w, origin, is_flush, n_accepted, slot_idx if has_slot else n_accepted, b, B, T, POISONED,
        HAS_SLOT=has_slot, BUF=buf, BLOCK=block, num_warps=4)
