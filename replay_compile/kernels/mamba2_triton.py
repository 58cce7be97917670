"""Triton kernels of the Mamba-2 ReplaySSM step (the CUDA implementation of ``replay_compile::mamba2_step``).

Same signature and in-place contract as :func:`~replay_compile.kernels.mamba2_reference.replay_step_reference`.

One launch per step serves every row: each program reads its row's cursor ``w`` and takes the flush branch
(``w == L-1``: fold, write the checkpoint tile once) or the output-only branch (read the checkpoint, append the
record) on the device, so one captured CUDA graph replays every step. A second, tiny launch advances the cursors
afterwards: no program may change a cursor that programs of other heads are still reading.

Grid ``(cdiv(P, BLOCK_P), batch, H)``. A program holds a ``BLOCK_P x BLOCK_N`` tile of the checkpoint at a time
(streamed over N), the window of up to ``L`` records on a power-of-two axis ``BLOCK_L`` (masked by the logical
index ``j <= w``), and computes in fp32 whatever the storage dtypes. Exponents are suffix sums of log-decays,
clamped at 0 from above, so nothing can overflow. No autotuning: the kernel writes its inputs in place.
Loop trip counts are constexpr: the triton 3.6 interpreter (the CI's CPU test path) fails on runtime loop bounds
with numpy >= 2.4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mamba2_replay_step_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr,
    P, N, L, heads_per_g, heads_per_gc,
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
    N_TILES: tl.constexpr,
):
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    if HAS_SLOT:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    else:
        slot = row
    if slot < 0:                                   # padding row: zero output, touch nothing else
        tl.store(y_ptrs, tl.zeros([BLOCK_P], dtype=tl.float32), mask=mask_p)
        return
    g = h // heads_per_g
    gc = h // heads_per_gc
    w = tl.load(cursor_ptr + slot)
    offs_l = tl.arange(0, BLOCK_L)
    hist = offs_l < w
    cur = offs_l == w
    valid = offs_l <= w

    # window scalars: held records j < w from the ring, this token at j == w
    la_cur = tl.load(la_ptr + row * s_lb + h * s_lh).to(tl.float32)
    dt_cur = tl.load(dt_ptr + row * s_db + h * s_dh).to(tl.float32)
    la_w = tl.load(lar_ptr + slot * s_lrb + h * s_lrh + offs_l * s_lrl, mask=hist, other=0.0).to(tl.float32)
    dt_w = tl.load(dtr_ptr + slot * s_drb + h * s_drh + offs_l * s_drl, mask=hist, other=0.0).to(tl.float32)
    la_w = tl.where(cur, la_cur, tl.where(hist, la_w, 0.0))
    dt_w = tl.where(cur, dt_cur, tl.where(hist, dt_w, 0.0))
    total = tl.sum(la_w, axis=0)
    suffix = tl.cumsum(la_w, axis=0, reverse=True)           # Σ_{i>=j}
    after = tl.minimum(suffix - la_w, 0.0)                   # Σ_{j<i<=w}: small terms only, never a big difference
    coef = tl.where(valid, dt_w * tl.exp(after), 0.0)        # [BLOCK_L]
    decay = tl.exp(tl.minimum(total, 0.0))

    # x window [BLOCK_L, BLOCK_P]
    x_cur = tl.load(x_ptr + row * s_xb + h * s_xh + offs_p * s_xp, mask=mask_p, other=0.0)
    xw = tl.load(xr_ptr + slot * s_xrb + h * s_xrh + offs_l[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                 mask=hist[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    xw = tl.where(cur[:, None], x_cur.to(tl.float32)[None, :], xw)

    is_flush = w == L - 1
    st_base = state_ptr + slot * s_sb + h * s_sh
    br_base = Br_ptr + slot * s_brb + g * s_brg
    b_base = B_ptr + row * s_bb + g * s_bg
    c_base = C_ptr + row * s_cb + gc * s_cg
    if is_flush:
        # S_new = exp(total) S0 + (coef * X)^T B ; written once; y = S_new C
        xc = tl.trans(xw * coef[:, None])                    # [BLOCK_P, BLOCK_L]
        acc_y = tl.zeros([BLOCK_P], dtype=tl.float32)
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
            tl.store(s_ptrs, s_new.to(state_ptr.dtype.element_ty), mask=tile_mask)
            c = tl.load(c_base + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
            acc_y += tl.sum(s_new * c[None, :], axis=1)
        tl.store(y_ptrs, acc_y, mask=mask_p)
    else:
        # y = exp(total) (S0 C) + Σ_j coef_j (B_j·C) x_j ; the checkpoint is only read
        acc_sc = tl.zeros([BLOCK_P], dtype=tl.float32)
        bc = tl.zeros([BLOCK_L], dtype=tl.float32)
        for nt in range(N_TILES):                          # constexpr trip count (see module notes)
            offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            c = tl.load(c_base + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)
            s0 = tl.load(st_base + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
                         mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            acc_sc += tl.sum(s0 * c[None, :], axis=1)
            bw = tl.load(br_base + offs_l[:, None] * s_brl + offs_n[None, :] * s_brn,
                         mask=hist[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            b_cur = tl.load(b_base + offs_n * s_bn, mask=mask_n, other=0.0).to(tl.float32)
            bw = tl.where(cur[:, None], b_cur[None, :], bw)
            bc += tl.sum(bw * c[None, :], axis=1)
            if (pid_p == 0) & (h % heads_per_g == 0):        # one program per group appends B_t
                tl.store(br_base + w * s_brl + offs_n * s_brn, b_cur.to(Br_ptr.dtype.element_ty), mask=mask_n)
        y = decay * acc_sc + tl.sum((coef * bc)[:, None] * xw, axis=0)
        tl.store(y_ptrs, y, mask=mask_p)
        tl.store(xr_ptr + slot * s_xrb + h * s_xrh + w * s_xrl + offs_p * s_xrp,
                 x_cur.to(xr_ptr.dtype.element_ty), mask=mask_p)
        if pid_p == 0:
            tl.store(dtr_ptr + slot * s_drb + h * s_drh + w * s_drl, dt_cur)
            tl.store(lar_ptr + slot * s_lrb + h * s_lrh + w * s_lrl, la_cur)


@triton.jit
def _advance_cursor_kernel(cursor_ptr, slot_ptr, n_rows, L, HAS_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < n_rows
    if HAS_SLOT:
        slots = tl.load(slot_ptr + rows, mask=m, other=-1).to(tl.int64)
    else:
        slots = rows.to(tl.int64)
    m = m & (slots >= 0)
    w = tl.load(cursor_ptr + slots, mask=m, other=0)
    tl.store(cursor_ptr + slots, tl.where(w == L - 1, 0, w + 1), mask=m)


# Launch configuration override for benchmarks: {"BLOCK_P": .., "BLOCK_N": .., "num_warps": ..}. Empty in use.
TUNING: dict = {}


def _block_sizes(P: int, N: int, L: int) -> tuple[int, int, int, int]:
    # tl.dot needs every dim >= 16; the window sits on a power-of-two axis
    # From the H200 sweep (benchmarks/results/mamba2_kernel_configs.csv, bs256 fp32): 64 x 64 tiles, 2 warps where
    # 64 divides P (Nemotron-Super: 359 us non-flush vs 435 us at 4 warps); 32 x 32, 2 warps otherwise (Nano, P=80:
    # 391 us vs 522 us with a 75%-masked second 64-row block).
    block_l = max(16, triton.next_power_of_2(L))
    bp = 64 if P % 64 == 0 else 32
    block_p = TUNING.get("BLOCK_P") or max(16, min(bp, triton.next_power_of_2(P)))
    block_n = TUNING.get("BLOCK_N") or max(16, min(bp, triton.next_power_of_2(N)))
    return block_p, block_n, block_l, TUNING.get("num_warps", 2)


def replay_step_triton(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    """Triton implementation of :func:`replay_step_reference` (same arguments, same in-place contract)."""
    S, H, P, N = state.shape
    b = x.shape[0]
    L = x_ring.shape[2]
    G, Gc = B_ring.shape[1], C.shape[1]
    y = torch.empty((b, H, P), dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    block_p, block_n, block_l, warps = _block_sizes(P, N, L)
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else cursor          # any pointer; unused when HAS_SLOT is False
    grid = (triton.cdiv(P, block_p), b, H)
    _mamba2_replay_step_kernel[grid](
        state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_arg, y,
        P, N, L, H // G, H // Gc,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
        *x.stride(), *dt.stride(), *la.stride(), *B.stride(), *C.stride(), *y.stride(),
        HAS_SLOT=has_slot, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_L=block_l, N_TILES=triton.cdiv(N, block_n),
        num_warps=warps,
    )
    _advance_cursor_kernel[(triton.cdiv(b, 1024),)](cursor, slot_arg, b, L, HAS_SLOT=has_slot, BLOCK=1024)
    return y
