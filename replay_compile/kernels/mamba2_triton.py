"""Triton kernel of the Mamba-2 ReplaySSM step (the CUDA implementation of ``replay_compile::mamba2_step``).

Same signature and in-place contract as :func:`~replay_compile.kernels.mamba2_reference.replay_step_reference`.

One launch per step serves every row and every step: each program reads its row's cursor ``w`` and, on the device,
either folds and writes its checkpoint tile (``w == L-1``, the flush) or appends its record (any other ``w``), so
one captured CUDA graph replays every step.

Grid ``(cdiv(P, BLOCK_P), batch, H)``. A program holds one ``BLOCK_P x N`` tile of the checkpoint (N padded to a
power of two) and the window of up to ``L`` records on a power-of-two axis ``BLOCK_L`` (masked by the logical
index ``j <= w``); everything is computed in fp32 whatever the storage dtypes. Exponents are suffix sums of
log-decays, clamped at 0 from above, so nothing can overflow.

Latency is what matters at small batch, so nothing waits for the cursor that does not have to: the checkpoint
tile, the whole ring window (positions ``< L``, unmasked by ``w``; stale slots are discarded in registers), x, B, C
are all loaded while the cursor is still in flight, and the output ``y`` uses the same formula on both branches::

    y = exp(Σ la) (S_0 C) + Σ_j coef_j (B_j·C) x_j

The flush branch then writes ``exp(Σ la) S_0 + (coef X)ᵀ B`` (one ``tl.dot``, IEEE fp32) from the tile it holds.

Cursor advance without a second launch: the cursor word carries an arrival count in its high 16 bits while the
kernel runs. Every program reads ``w`` (the low half) with a plain load up front and, at its very end, counts its
arrival with ``atomic_add(1 << 16, sem="release")``; the program that arrives last (so every other one has read
``w``) stores the advanced cursor with the count cleared. Nothing waits on an atomic before the loads are issued
(an atomic up front cost ~25% of bandwidth: v2a in benchmarks/NOTES.md). Between launches the word is always the
plain cursor, so every other op and the Python side see ``0 <= w < L``.

fp16 checkpoints are rounded stochastically at the flush (unbiased: each value goes to one of its two fp16
neighbours with probability proportional to proximity), from a counter-based hash of (slot, head, element, the
token's log-decay bits): deterministic for given inputs, fresh at every flush, and computed bit-identically by
the CPU reference (:func:`~replay_compile.kernels.mamba2_reference.stochastic_round_fp16`).

No autotuning: the kernel writes its inputs in place. Loops have constexpr trip counts: the triton 3.6
interpreter (the CI's CPU test path) fails on runtime loop bounds with numpy >= 2.4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _mamba2_replay_step_kernel(
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
    if HAS_SLOT:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    else:
        slot = row
    if slot < 0:                                   # padding row: zero output, touch nothing else
        tl.store(y_ptrs, tl.zeros([BLOCK_P], dtype=tl.float32), mask=mask_p)
        return

    w = tl.load(cursor_ptr + slot) & (_ARRIVAL_C - 1)   # low half: other programs may have arrived already

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
    dt_w = tl.load(dtr_ptr + slot * s_drb + h * s_drh + offs_l * s_drl, mask=in_ring, other=0.0).to(tl.float32)

    # the window: held records j < w, this token at j == w, nothing after (stale ring slots never leak: where)
    hist = offs_l < w
    cur = offs_l == w
    la_w = tl.where(cur, la_cur.to(tl.float32), tl.where(hist, la_w, 0.0))
    dt_w = tl.where(cur, dt_cur.to(tl.float32), tl.where(hist, dt_w, 0.0))
    bw = tl.where(cur[:, None], b_cur.to(tl.float32)[None, :], tl.where(hist[:, None], bw, 0.0))
    xw = tl.where(cur[:, None], x_cur.to(tl.float32)[None, :], tl.where(hist[:, None], xw, 0.0))
    total = tl.sum(la_w, axis=0)
    after = tl.minimum(tl.cumsum(la_w, axis=0, reverse=True) - la_w, 0.0)   # Σ_{j<i<=w}: small terms only
    coef = tl.where(offs_l <= w, dt_w * tl.exp(after), 0.0)                # [BLOCK_L]
    decay = tl.exp(tl.minimum(total, 0.0))

    sc = tl.sum(s0 * c[None, :], axis=1)                                    # S_0 C      [BLOCK_P]
    bc = tl.sum(bw * c[None, :], axis=1)                                    # B_j·C      [BLOCK_L]
    y = decay * sc + tl.sum((coef * bc)[:, None] * xw, axis=0)
    tl.store(y_ptrs, y, mask=mask_p)

    if w == L - 1:
        # flush: S_new = exp(Σ la) S_0 + (coef X)ᵀ B, written once; nothing appended (w -> 0)
        s_new = decay * s0 + tl.dot(tl.trans(xw * coef[:, None]), bw, input_precision="ieee")
        if STOCHASTIC_FP16:
            key = _hash32(la_cur.to(tl.float32).to(tl.uint32, bitcast=True) ^ _hash32((slot * H + h).to(tl.uint32)))
            offs_e = (offs_p[:, None] * N + offs_n[None, :]).to(tl.uint32)
            tl.store(st_ptrs, _stochastic_round_fp16(s_new, key, offs_e), mask=tile_mask)
        else:
            tl.store(st_ptrs, s_new.to(state_ptr.dtype.element_ty), mask=tile_mask)
    else:
        tl.store(xr_ptr + slot * s_xrb + h * s_xrh + w * s_xrl + offs_p * s_xrp,
                 x_cur.to(xr_ptr.dtype.element_ty), mask=mask_p)
        if pid_p == 0:
            tl.store(dtr_ptr + slot * s_drb + h * s_drh + w * s_drl, dt_cur)
            tl.store(lar_ptr + slot * s_lrb + h * s_lrh + w * s_lrl, la_cur)
            if h % heads_per_g == 0:                  # one program per group appends B_t
                tl.store(br_base + w * s_brl + offs_n * s_brn, b_cur.to(Br_ptr.dtype.element_ty), mask=mask_n)

    # arrive (release: this program's read of the cursor is ordered before it); the last program of the row to
    # arrive knows every other one has read w, and advances the cursor with the count cleared
    word = tl.atomic_add(cursor_ptr + slot, _ARRIVAL_C, sem="release")
    if (word >> 16) == arrivals - 1:
        tl.atomic_xchg(cursor_ptr + slot, tl.where(w == L - 1, 0, w + 1), sem="relaxed")


# Launch configuration override for benchmarks: {"BLOCK_P": .., "num_warps": ..}. Empty in use.
TUNING: dict = {}


def launch_config(P: int, N: int, L: int) -> tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_N, BLOCK_L, num_warps) for a geometry.

    N is held whole (padded to a power of two); BLOCK_P is the largest of 16/32 dividing P (else 16): ``tl.dot``
    needs every dim >= 16. Warps are chosen so the fp32 checkpoint tile and the window each take <= 64 registers
    per thread (see benchmarks/NOTES.md for the sweep behind these numbers).
    """
    block_n = max(16, triton.next_power_of_2(N))
    block_l = max(16, triton.next_power_of_2(L))
    block_p = TUNING.get("BLOCK_P") or (32 if P % 32 == 0 else 16)
    elems = max(block_p, block_l) * block_n
    warps = TUNING.get("num_warps") or max(1, min(8, elems // (32 * 64)))
    return block_p, block_n, block_l, warps


def replay_step_triton(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    """Triton implementation of :func:`replay_step_reference` (same arguments, same in-place contract)."""
    S, H, P, N = state.shape
    b = x.shape[0]
    L = x_ring.shape[2]
    G, Gc = B_ring.shape[1], C.shape[1]
    y = torch.empty((b, H, P), dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    block_p, block_n, block_l, warps = launch_config(P, N, L)
    n_pb = triton.cdiv(P, block_p)
    if n_pb * H >= 1 << 15 or L >= _ARRIVAL:
        raise ValueError(f"replay_compile.mamba2: {H} heads x {n_pb} P-blocks (or L={L}) exceed the cursor word's "
                         "arrival counter; use fewer heads per layer")
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else cursor          # any pointer; unused when HAS_SLOT is False
    _mamba2_replay_step_kernel[(n_pb, b, H)](
        state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_arg, y,
        H, P, N, L, H // G, H // Gc, n_pb * H,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
        *x.stride(), *dt.stride(), *la.stride(), *B.stride(), *C.stride(), *y.stride(),
        HAS_SLOT=has_slot, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_L=block_l,
        STOCHASTIC_FP16=state.dtype == torch.float16,
        num_warps=warps,
    )
    return y
