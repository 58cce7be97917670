"""Triton kernel of the delta-rule speculative verify step (GDN and KDA): the CUDA implementation of
``replay_compile::delta_spec_verify``, same signature and in-place contract as
:func:`~replay_compile.kernels.delta_spec_reference.delta_spec_verify_reference` (ring, cursors and flush rule:
:mod:`.mamba2_spec_reference`; the commit is the family-agnostic ``spec_commit``).

Two launches. Launch 1, grid ``(batch, HV / heads)``, computes what does not touch the checkpoint once per (row,
value head), the key products once per key head for GDN: for token ``t`` at window position ``m = w + t`` (the
committed history ``j < w`` and this verify's tokens on one power-of-two axis ``BLOCK_W >= buf``, the history's
gates from the ring beside the new ones), with
``E_j = Σ_{j<i<=m} g_i`` (suffix sums over the live window, every exponent <= 0, never a difference: the gates are
loaded a second time one position ahead, so the exclusive sum is a plain reverse cumulative sum) and
``KE_j = k_j ⊙ exp(E_j)``, the coefficients ``ck[t, j] = KE_j · k_t`` (j < m),
``cq[t, j] = KE_j · q_t`` (``cq[t, m] = k_t · q_t``) and the checkpoint's decay ``exp(Σ_{lo<=i<=m} g_i)`` (a vector
over K for KDA), into a small scratch. Launch 2, grid ``(cdiv(V, BLOCK_V), batch, HV)``: the corrected values are
independent across value columns, so a program reads its ``K x BLOCK_V`` slice of the checkpoint once for all
``T`` tokens and runs the forward substitution of the window (the WY system, one token at a time)::

    d_t = beta_t (v_t - S_lᵀ (dec_t ⊙ k_t) - Σ_j ck[t, j] d_j) ;   o_t = S_lᵀ (dec_t ⊙ q_t) + Σ_j cq[t, j] d_j

where ``d_j`` are the history's records and the window's values solved so far. Ordinary rows use ``S_l = S_0`` and
``lo = 0``; flush rows first fold their history into the checkpoint (record by record, the recurrence itself;
written once, fp16 rounded stochastically as the reference does) and use ``lo = w``. The ``T`` new records go to ring
slots ``(origin + w + t) & (buf - 1)``, which never hold committed history (``w + T <= buf``). Lost against this
(docs/design/speculative_rounds.md): a single launch that redid the window in every value-tile program (10% of the
copy bandwidth on the H200), and a pass that streamed the checkpoint in row chunks, with or without the window's key
products accumulated in it (H100, Qwen3.5-4B dims, batch 256, non-flushing: 306 µs for the streamed pass against
277 µs for this one; 690 µs for the best single launch against 376 µs for both launches of this design).

A row whose history and window do not fit the ring (which the commit's flush rule prevents) gets NaN outputs and
touches nothing: the kernel cannot raise, so the error is made impossible to miss. No autotuning (the kernel
writes its inputs in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch
from .mamba2_spec_triton import _spec_apply_row, _spec_row
from .mamba2_triton import _store_checkpoint
from .tuning import Tuning


@triton.jit
def _spec_gates(gr_h, g_row, hist, new, ring_j, t_j, offs_k, mask_k, s_grl, s_grk, s_gt, s_gk, KDA: tl.constexpr):
    """The log-gates of window positions ``j`` ([BLOCK_W], or [BLOCK_W, BLOCK_K] for KDA): the ring's record at
    ``ring_j`` where ``hist``, the verify's token ``t_j`` where ``new``, 0 elsewhere."""
    if KDA:
        gh = tl.load(gr_h + ring_j[:, None] * s_grl + offs_k[None, :] * s_grk, mask=hist[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)
        gn = tl.load(g_row + t_j[:, None] * s_gt + offs_k[None, :] * s_gk, mask=new[:, None] & mask_k[None, :],
                     other=0.0).to(tl.float32)
        return tl.where(hist[:, None], gh, gn)
    else:
        gh = tl.load(gr_h + ring_j * s_grl, mask=hist, other=0.0).to(tl.float32)
        gn = tl.load(g_row + t_j * s_gt, mask=new, other=0.0).to(tl.float32)
        return tl.where(hist, gh, gn)


@triton.jit
def _delta_spec_window_kernel(
    kr_ptr, gr_ptr, w_ptr, origin_ptr, flush_ptr, q_ptr, k_ptr, g_ptr, slot_ptr, ck_ptr, cq_ptr, dec_ptr,
    HV, K, T, v_per_k, v_per_q,
    s_krb, s_krh, s_krl, s_krk,             # k_ring [S, Hk, buf, K]
    s_grb, s_grh, s_grl, s_grk,             # g_ring [S, HV, buf(, K)]
    s_qb, s_qt, s_qh, s_qk,                 # q [b, T, Hq, K]
    s_kb, s_kt, s_kh, s_kk,                 # k [b, T, Hk, K]
    s_gb, s_gt, s_gh, s_gk,                 # g [b, T, HV(, K)]
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BUF: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HEADS: tl.constexpr,
):
    """Launch 1 of 2, grid ``(batch, HV // HEADS)``: the window's coefficients, once per (row, value head), for
    ``HEADS`` consecutive value heads that read the same key and query head. For token ``t`` at window position
    ``m = w + t`` and ``E_j = Σ_{j<i<=m} g_i`` over the live window (``lo <= j``; ``lo = w`` on flush rows, whose
    history is folded first)::

        ck[t, j] = (k_j ⊙ exp(E_j)) · k_t   (lo <= j < m)      cq[t, j] = (k_j ⊙ exp(E_j)) · q_t, cq[t, m] = k_t · q_t
        dec[t]   = exp(Σ_{lo<=i<=m} g_i)    (a vector over K for KDA)

    GDN's gate is one scalar per position, so ``ck[t, j] = exp(E_j) (k_j · k_t)``: the key products are formed once
    for the ``HEADS`` value heads of a key head (the key window read once), then scaled by each head's gates. KDA's
    gates weigh each key channel (``HEADS = 1``)."""
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1).to(tl.int64) * HEADS
    slot, w, overflow = _spec_row(slot_ptr, w_ptr, row, T, HAS_SLOT, BUF)
    if (slot < 0) | overflow:
        return
    org = tl.load(origin_ptr + slot)
    fl = tl.load(flush_ptr + slot).to(tl.int32) != 0
    hk = h0 // v_per_k
    hq = h0 // v_per_q
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_j = tl.arange(0, BLOCK_W)
    hist = offs_j < w
    new = (offs_j >= w) & (offs_j < w + T)
    ring_j = (org + offs_j) & (BUF - 1)
    t_j = tl.where(new, offs_j - w, 0)
    kh = tl.load(kr_ptr + slot * s_krb + hk * s_krh + ring_j[:, None] * s_krl + offs_k[None, :] * s_krk,
                 mask=hist[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    kn = tl.load(k_ptr + row * s_kb + t_j[:, None] * s_kt + hk * s_kh + offs_k[None, :] * s_kk,
                 mask=new[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    kw = tl.where(hist[:, None], kh, kn)                                                   # [BLOCK_W, BLOCK_K]
    # the window's gates at position j (history from the ring, then the new tokens), and again at j + 1
    nxt = offs_j + 1
    hist_n = nxt < w
    new_n = (nxt >= w) & (nxt < w + T)
    ring_n = (org + nxt) & (BUF - 1)
    t_n = tl.where(new_n, nxt - w, 0)
    lo = tl.where(fl, w, 0)
    if KDA:                                        # one value head per program: its [BLOCK_W, BLOCK_K] gates once
        gr_h = gr_ptr + slot * s_grb + h0 * s_grh
        g_row = g_ptr + row * s_gb + h0 * s_gh
        gw = _spec_gates(gr_h, g_row, hist, new, ring_j, t_j, offs_k, mask_k, s_grl, s_grk, s_gt, s_gk, KDA)
        gw_next = _spec_gates(gr_h, g_row, hist_n, new_n, ring_n, t_n, offs_k, mask_k, s_grl, s_grk, s_gt, s_gk, KDA)
    for t in tl.static_range(BLOCK_T):
        if t < T:
            m = w + t
            live = (offs_j >= lo) & (offs_j <= m)
            prior = live & (offs_j < m)
            live_n = (nxt >= lo) & (nxt <= m)
            q_t = tl.load(q_ptr + row * s_qb + t * s_qt + hq * s_qh + offs_k * s_qk, mask=mask_k,
                          other=0.0).to(tl.float32)
            k_t = tl.load(k_ptr + row * s_kb + t * s_kt + hk * s_kh + offs_k * s_kk, mask=mask_k,
                          other=0.0).to(tl.float32)
            kself = tl.sum(k_t * q_t, axis=0)
            if KDA:
                idx = (row * HV + h0) * BLOCK_T + t
                after = tl.minimum(tl.cumsum(tl.where(live_n[:, None], gw_next, 0.0), axis=0, reverse=True), 0.0)
                ke = tl.where(prior[:, None], kw * tl.exp(after), 0.0)                       # [BLOCK_W, BLOCK_K]
                tl.store(dec_ptr + idx * BLOCK_K + offs_k,
                         tl.exp(tl.minimum(tl.sum(tl.where(live[:, None], gw, 0.0), axis=0), 0.0)))
                tl.store(ck_ptr + idx * BLOCK_W + offs_j, tl.sum(ke * k_t[None, :], axis=1))
                tl.store(cq_ptr + idx * BLOCK_W + offs_j, tl.sum(ke * q_t[None, :], axis=1) +
                         tl.where(offs_j == m, kself, 0.0))
            else:
                kk = tl.sum(kw * k_t[None, :], axis=1)                                      # k_j · k_t [BLOCK_W]
                kq = tl.sum(kw * q_t[None, :], axis=1)                                      # k_j · q_t
                for i in tl.static_range(HEADS):
                    h = h0 + i
                    gr_h = gr_ptr + slot * s_grb + h * s_grh
                    g_row = g_ptr + row * s_gb + h * s_gh
                    gw = _spec_gates(gr_h, g_row, hist, new, ring_j, t_j, offs_k, mask_k, s_grl, s_grk, s_gt, s_gk,
                                     KDA)
                    gw_next = _spec_gates(gr_h, g_row, hist_n, new_n, ring_n, t_n, offs_k, mask_k, s_grl, s_grk,
                                          s_gt, s_gk, KDA)
                    idx = (row * HV + h) * BLOCK_T + t
                    e = tl.where(prior, tl.exp(tl.minimum(tl.cumsum(tl.where(live_n, gw_next, 0.0), axis=0,
                                                                    reverse=True), 0.0)), 0.0)
                    tl.store(dec_ptr + idx, tl.exp(tl.minimum(tl.sum(tl.where(live, gw, 0.0), axis=0), 0.0)))
                    tl.store(ck_ptr + idx * BLOCK_W + offs_j, e * kk)
                    tl.store(cq_ptr + idx * BLOCK_W + offs_j, e * kq + tl.where(offs_j == m, kself, 0.0))


@triton.jit
def _delta_spec_apply_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, w_ptr, origin_ptr, flush_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr, ck_ptr, cq_ptr, dec_ptr,
    HV, K, V, T, v_per_k, v_per_q,
    s_sb, s_sh, s_sk, s_sv,                 # state [S, HV, K, V]
    s_drb, s_drh, s_drl, s_drv,             # d_ring [S, HV, buf, V]
    s_krb, s_krh, s_krl, s_krk,             # k_ring [S, Hk, buf, K]
    s_grb, s_grh, s_grl, s_grk,             # g_ring [S, HV, buf(, K)] (s_grk unused for GDN)
    s_qb, s_qt, s_qh, s_qk,                 # q [b, T, Hq, K]
    s_kb, s_kt, s_kh, s_kk,                 # k [b, T, Hk, K]
    s_vb, s_vt, s_vh, s_vv,                 # v [b, T, HV, V]
    s_gb, s_gt, s_gh, s_gk,                 # g [b, T, HV(, K)]
    s_bb, s_bt, s_bh,                       # beta [b, T, HV]
    s_ob, s_ot, s_oh, s_ov,                 # o [b, T, HV, V]
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BUF: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, STOCHASTIC_FP16: tl.constexpr,
):
    """Launch 2 of 2, grid ``(cdiv(V, BLOCK_V), batch, HV)``: the checkpoint pass (read once; flush rows fold and
    write it), the forward substitution of the window's corrected values for this program's value columns, the
    outputs and this verify's records."""
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    offs_t = tl.arange(0, BLOCK_T)
    tt = offs_t < T
    o_tile = o_ptr + row * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_v[None, :] * s_ov      # [BLOCK_T, BLOCK_V]
    o_mask = tt[:, None] & mask_v[None, :]
    slot, w, done = _spec_apply_row(slot_ptr, w_ptr, row, T, o_tile, o_mask, HAS_SLOT, BUF, BLOCK_T, BLOCK_V)
    if done:                                       # padding (zeros) or an overflowing window (NaN)
        return
    org = tl.load(origin_ptr + slot)
    fl = tl.load(flush_ptr + slot).to(tl.int32) != 0
    hk = h // v_per_k
    hq = h // v_per_q
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    tile_mask = mask_k[:, None] & mask_v[None, :]
    offs_j = tl.arange(0, BLOCK_W)
    hist = offs_j < w
    ring_j = (org + offs_j) & (BUF - 1)
    DW = tl.load(dr_ptr + slot * s_drb + h * s_drh + ring_j[:, None] * s_drl + offs_v[None, :] * s_drv,
                 mask=hist[:, None] & mask_v[None, :], other=0.0).to(tl.float32)           # [BLOCK_W, BLOCK_V]
    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    base = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                    # [BLOCK_K, BLOCK_V]
    if fl:
        # fold the history into the checkpoint, record by record (the recurrence S = a_j ⊙_K S + k_j d_jᵀ itself; no
        # tl.dot, whose shared memory would cost every program occupancy); written once
        key_gate = w.to(tl.float32) * 0.0
        for j in range(BLOCK_W):
            if j < w:
                rj = (org + j) & (BUF - 1)
                k_j = tl.load(kr_ptr + slot * s_krb + hk * s_krh + rj * s_krl + offs_k * s_krk, mask=mask_k,
                              other=0.0).to(tl.float32)
                d_j = tl.load(dr_ptr + slot * s_drb + h * s_drh + rj * s_drl + offs_v * s_drv, mask=mask_v,
                              other=0.0).to(tl.float32)
                if KDA:
                    g_j = tl.load(gr_ptr + slot * s_grb + h * s_grh + rj * s_grl + offs_k * s_grk, mask=mask_k,
                                  other=0.0).to(tl.float32)
                    base = tl.exp(g_j)[:, None] * base + k_j[:, None] * d_j[None, :]
                    key_gate = tl.sum(tl.where(offs_k == 0, g_j, 0.0), axis=0)   # last record's g[..., 0]
                else:
                    g_j = tl.load(gr_ptr + slot * s_grb + h * s_grh + rj * s_grl).to(tl.float32)
                    base = tl.exp(g_j) * base + k_j[:, None] * d_j[None, :]
                    key_gate = g_j
        if w > 0:
            _store_checkpoint(st_ptrs, base, tile_mask, key_gate, slot * HV + h,
                              offs_k[:, None] * V + offs_v[None, :], STOCHASTIC_FP16)

    base_idx = row * HV + h
    for t in range(BLOCK_T):                       # forward substitution, one token at a time
        if t < T:
            q_t = tl.load(q_ptr + row * s_qb + t * s_qt + hq * s_qh + offs_k * s_qk, mask=mask_k,
                          other=0.0).to(tl.float32)
            k_t = tl.load(k_ptr + row * s_kb + t * s_kt + hk * s_kh + offs_k * s_kk, mask=mask_k,
                          other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + row * s_vb + t * s_vt + h * s_vh + offs_v * s_vv, mask=mask_v,
                          other=0.0).to(tl.float32)
            beta_t = tl.load(beta_ptr + row * s_bb + t * s_bt + h * s_bh).to(tl.float32)
            if KDA:
                dec = tl.load(dec_ptr + (base_idx * BLOCK_T + t) * BLOCK_K + offs_k)
            else:
                dec = tl.load(dec_ptr + base_idx * BLOCK_T + t)
            c_off = (base_idx * BLOCK_T + t) * BLOCK_W + offs_j
            ck = tl.load(ck_ptr + c_off)
            cq = tl.load(cq_ptr + c_off)
            sk = tl.sum(base * (dec * k_t)[:, None], axis=0) + tl.sum(ck[:, None] * DW, axis=0)    # S'ᵀk [BLOCK_V]
            d = beta_t * (v_t - sk)
            DW = tl.where((offs_j == w + t)[:, None], d[None, :], DW)      # later tokens read this record
            o = tl.sum(base * (dec * q_t)[:, None], axis=0) + tl.sum(cq[:, None] * DW, axis=0)
            tl.store(o_ptr + row * s_ob + t * s_ot + h * s_oh + offs_v * s_ov, o, mask=mask_v)
            tl.store(dr_ptr + slot * s_drb + h * s_drh + ((org + w + t) & (BUF - 1)) * s_drl + offs_v * s_drv,
                     d.to(dr_ptr.dtype.element_ty), mask=mask_v)

    # this verify's keys and gates after the history (its corrected values were stored above)
    slot_t = (org + w + offs_t) & (BUF - 1)
    tk = tt[:, None] & mask_k[None, :]
    if pid_v == 0:
        gr_h = gr_ptr + slot * s_grb + h * s_grh
        if KDA:
            tg = tt[:, None] & mask_k[None, :]
            g_new = tl.load(g_ptr + row * s_gb + offs_t[:, None] * s_gt + h * s_gh + offs_k[None, :] * s_gk, mask=tg,
                            other=0.0)
            tl.store(gr_h + slot_t[:, None] * s_grl + offs_k[None, :] * s_grk, g_new.to(gr_ptr.dtype.element_ty),
                     mask=tg)
        else:
            g_new = tl.load(g_ptr + row * s_gb + offs_t * s_gt + h * s_gh, mask=tt, other=0.0)
            tl.store(gr_h + slot_t * s_grl, g_new.to(gr_ptr.dtype.element_ty), mask=tt)
        if h % v_per_k == 0:                       # one program per key head appends k
            k_new = tl.load(k_ptr + row * s_kb + offs_t[:, None] * s_kt + hk * s_kh + offs_k[None, :] * s_kk,
                            mask=tk, other=0.0)
            tl.store(kr_ptr + slot * s_krb + hk * s_krh + slot_t[:, None] * s_krl + offs_k[None, :] * s_krk,
                     k_new.to(kr_ptr.dtype.element_ty), mask=tk)


# Launch configuration override for benchmarks and tests (``tuning.tuned``). Empty in use.
TUNING = Tuning(__name__, ("BLOCK_V", "num_warps", "window_warps"))


def delta_spec_verify_triton(state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta, slot_idx=None):
    """Triton implementation of :func:`delta_spec_verify_reference` (same arguments, same in-place contract);
    returns fp32 ``o`` [b, T, HV, V]."""
    S, HV, K, V = state.shape
    b, T = v.shape[:2]
    buf = d_ring.shape[2]
    kda = g_ring.dim() == 4
    o = torch.empty((b, T, HV, V), dtype=torch.float32, device=v.device)
    if b == 0 or T == 0:
        return o
    block_k = max(16, next_pow2(K))
    # from batch 64 up, 32 columns on 1 warp and the window launch on 1 warp (H200, Qwen3.5-4B bs256:
    # 492 -> 450 µs, 1.74x -> 1.91x over per-draft snapshots; 32 columns on 2 warps lost: 596 µs); smaller batches
    # keep 16 columns and 4 window warps
    big = b >= 64
    block_v = TUNING.get("BLOCK_V") or (32 if big and V > 16 else 16)
    block_w, block_t = max(16, buf), next_pow2(T)
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else w
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    v_per_k, v_per_q = HV // k_ring.shape[1], HV // q.shape[2]
    # scratch of launch 1 (every entry a live row reads is written first)
    ck = torch.empty((b, HV, block_t, block_w), dtype=torch.float32, device=v.device)
    cq = torch.empty_like(ck)
    dec = torch.empty((b, HV, block_t) + ((block_k,) if kda else ()), dtype=torch.float32, device=v.device)
    common = dict(HAS_SLOT=has_slot, KDA=kda, BUF=buf, BLOCK_W=block_w, BLOCK_T=block_t, BLOCK_K=block_k)
    # GDN: the value heads of one key head (and query head) in one window program, which reads its keys and forms
    # their products once (H100, Qwen3.5-4B dims bs256, 2 value heads per key head: 104 -> 73 µs non-flushing,
    # 113 -> 81 µs flushing)
    heads = v_per_k if not kda and v_per_q == v_per_k and v_per_k <= 8 else 1
    launch(_delta_spec_window_kernel)[(b, HV // heads)](
        k_ring, g_ring, w, origin, is_flush, q, k, g, slot_arg, ck, cq, dec, HV, K, T, v_per_k, v_per_q,
        *k_ring.stride(), *g_strides, *q.stride(), *k.stride(), *gi_strides,
        HEADS=heads, num_warps=TUNING.get("window_warps") or (1 if big else 4), **common)
    launch(_delta_spec_apply_kernel)[(cdiv(V, block_v), b, HV)](
        state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta, slot_arg, o, ck, cq, dec,
        HV, K, V, T, v_per_k, v_per_q,
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
        *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
        BLOCK_V=block_v, STOCHASTIC_FP16=state.dtype == torch.float16, num_warps=TUNING.get("num_warps") or 1,
        **common)
    return o
