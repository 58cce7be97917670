"""Triton kernel of the delta-rule speculative verify step (GDN and KDA): the CUDA implementation of
``replay_compile::delta_spec_verify``, same signature and in-place contract as
:func:`~replay_compile.kernels.delta_spec_reference.delta_spec_verify_reference` (ring, cursors and flush rule:
:mod:`.mamba2_spec_reference`; the commit is the family-agnostic ``spec_commit``).

Grid ``(cdiv(V, BLOCK_V), batch, HV)``. The corrected values are independent across value columns
(``d_t[v] = beta_t (v_t[v] - Σ_k S'_t[k, v] k_t[k])``), so a program owns a ``K x BLOCK_V`` slice of the checkpoint,
read once for all ``T`` tokens, and solves the window's ``T`` corrected values for its columns in matrix form
(chunkwise, every product a ``tl.dot``; no per-token loop). With the window's tokens on a ``BLOCK_T = 16`` axis, the
committed history ``j < w`` on a ``BLOCK_W >= buf`` axis, ``h_j = Σ_{j<i<w} g_i``, ``c_t = Σ_{s<=t} g_s`` (sums of
nonpositive gates: no differences of large sums anywhere) and ``S_l`` the checkpoint slice::

    Kd = k_t ⊙ exp(Σ_hist g + c_t)                     (rows t; GDN: a scalar per row, KDA: per key channel)
    Ch[t, j] = Σ_K k_t e^{c_t} k_j e^{h_j}             history coefficients (GDN: e^{c_t + h_j} (k_t·k_j))
    A[t, s]  = beta_t Σ_K k_t k_s e^{c_t - c_s}, s < t   the window's own coefficients (strictly lower)
    r = beta ⊙ (V - Kd S_l - Ch D_hist) ;  (I + A) d = r ;  d = (I - A)(I + A²)(I + A⁴)(I + A⁸) r
    O = Qd S_l + Chq D_hist + Aqk d                    (Aqk with its diagonal q_t·k_t)

The inverse is exact because ``A`` is nilpotent (strictly lower triangular, T <= 16). Ordinary rows use the
checkpoint and the history as they are; flush rows first fold their history into the checkpoint (one ``tl.dot``;
written once, fp16 rounded stochastically as the reference does) and then see an empty history. The ``T`` new
records go to ring slots ``(origin + w + t) & (buf - 1)``, which never hold committed history (``w + T <= buf``).
Products are IEEE fp32 by default (``TUNING["PREC"]`` selects e.g. ``"tf32x3"`` for the large ones).

A row whose history and window do not fit the ring (which the commit's flush rule prevents) gets NaN outputs and
touches nothing: the kernel cannot raise, so the error is made impossible to miss. No autotuning (the kernel
writes its inputs in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mamba2_triton import _store_checkpoint


@triton.jit
def _delta_spec_verify_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, w_ptr, origin_ptr, flush_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr,
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
    PREC: tl.constexpr,
):
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    offs_t = tl.arange(0, BLOCK_T)
    tt = offs_t < T
    o_tile = o_ptr + row * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_v[None, :] * s_ov      # [BLOCK_T, BLOCK_V]
    o_mask = tt[:, None] & mask_v[None, :]
    if HAS_SLOT:
        slot = tl.load(slot_ptr + row).to(tl.int64)
    else:
        slot = row
    if slot < 0:                                   # padding row: zero output, touch nothing else
        tl.store(o_tile, tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32), mask=o_mask)
        return
    w = tl.load(w_ptr + slot)
    if w + T > BUF:                                # cannot happen after a commit; never silently wrong
        tl.store(o_tile, tl.full([BLOCK_T, BLOCK_V], float("nan"), tl.float32), mask=o_mask)
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
    tk = tt[:, None] & mask_k[None, :]

    # this verify's tokens, on the T axis
    Kt = tl.load(k_ptr + row * s_kb + offs_t[:, None] * s_kt + hk * s_kh + offs_k[None, :] * s_kk, mask=tk,
                 other=0.0).to(tl.float32)                                                  # [BLOCK_T, BLOCK_K]
    Qt = tl.load(q_ptr + row * s_qb + offs_t[:, None] * s_qt + hq * s_qh + offs_k[None, :] * s_qk, mask=tk,
                 other=0.0).to(tl.float32)
    Vt = tl.load(v_ptr + row * s_vb + offs_t[:, None] * s_vt + h * s_vh + offs_v[None, :] * s_vv, mask=o_mask,
                 other=0.0).to(tl.float32)                                                  # [BLOCK_T, BLOCK_V]
    beta = tl.load(beta_ptr + row * s_bb + offs_t * s_bt + h * s_bh, mask=tt, other=0.0).to(tl.float32)
    # the committed history, on the window axis
    KW = tl.load(kr_ptr + slot * s_krb + hk * s_krh + ring_j[:, None] * s_krl + offs_k[None, :] * s_krk,
                 mask=hist[:, None] & mask_k[None, :], other=0.0).to(tl.float32)           # [BLOCK_W, BLOCK_K]
    DW = tl.load(dr_ptr + slot * s_drb + h * s_drh + ring_j[:, None] * s_drl + offs_v[None, :] * s_drv,
                 mask=hist[:, None] & mask_v[None, :], other=0.0).to(tl.float32)           # [BLOCK_W, BLOCK_V]
    if KDA:
        gn = tl.load(g_ptr + row * s_gb + offs_t[:, None] * s_gt + h * s_gh + offs_k[None, :] * s_gk, mask=tk,
                     other=0.0).to(tl.float32)                                              # [BLOCK_T, BLOCK_K]
        gh = tl.load(gr_ptr + slot * s_grb + h * s_grh + ring_j[:, None] * s_grl + offs_k[None, :] * s_grk,
                     mask=hist[:, None] & mask_k[None, :], other=0.0).to(tl.float32)       # [BLOCK_W, BLOCK_K]
    else:
        gn = tl.load(g_ptr + row * s_gb + offs_t * s_gt + h * s_gh, mask=tt, other=0.0).to(tl.float32)
        gh = tl.load(gr_ptr + slot * s_grb + h * s_grh + ring_j * s_grl, mask=hist, other=0.0).to(tl.float32)
    # history suffix sums h_j = Σ_{j<i<w} g_i and their total; prefix sums of the new gates c_t = Σ_{s<=t} g_s.
    # Every exponent below is a sum of such nonpositive terms (no differences of large sums).
    hafter = tl.minimum(tl.cumsum(gh, axis=0, reverse=True) - gh, 0.0)
    htot = tl.sum(gh, axis=0)
    cnew = tl.minimum(tl.cumsum(gn, axis=0), 0.0)

    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    base = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                    # [BLOCK_K, BLOCK_V]
    if KDA:
        KE = tl.where(hist[:, None], KW * tl.exp(hafter), 0.0)                             # k_j ⊙ exp(h_j)
    else:
        KE = tl.where(hist[:, None], KW * tl.exp(hafter)[:, None], 0.0)
    live_h = hist
    if fl:
        # fold the history into the checkpoint (written once) and read the window from there only
        if KDA:
            base = tl.exp(tl.minimum(htot, 0.0))[:, None] * base
            key_gate = tl.sum(tl.sum(tl.where((offs_j == w - 1)[:, None] & (offs_k == 0)[None, :], gh, 0.0),
                                     axis=1), axis=0)                     # last record's g[..., 0], as the reference
        else:
            base = tl.exp(tl.minimum(htot, 0.0)) * base
            key_gate = tl.sum(tl.where(offs_j == w - 1, gh, 0.0), axis=0)
        base = base + tl.dot(tl.trans(KE), DW, input_precision="ieee")
        if w > 0:
            _store_checkpoint(st_ptrs, base, tile_mask, key_gate, slot * HV + h,
                              offs_k[:, None] * V + offs_v[None, :], STOCHASTIC_FP16)
        htot = htot * 0.0
        live_h = offs_j < 0

    lower = offs_t[:, None] > offs_t[None, :]                                               # s < t
    eye = offs_t[:, None] == offs_t[None, :]
    if KDA:
        dec = tl.exp(tl.minimum(htot[None, :] + cnew, 0.0))                                # [BLOCK_T, BLOCK_K]
        Kd = Kt * dec
        Qd = Qt * dec
        ec = tl.exp(cnew)
        Ch_k = tl.dot(Kt * ec, tl.trans(KE), input_precision=PREC)                         # [BLOCK_T, BLOCK_W]
        Ch_q = tl.dot(Qt * ec, tl.trans(KE), input_precision=PREC)
        # new-new coefficients Σ_K x_t k_s exp(c_t - c_s) for s < t (c_t - c_s <= 0): one key column at a time
        Akk = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        Aqk = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for s in range(BLOCK_T):
            if s < T:
                sel = (offs_t == s)[:, None]
                k_s = tl.sum(tl.where(sel, Kt, 0.0), axis=0)
                c_s = tl.sum(tl.where(sel, cnew, 0.0), axis=0)
                e = tl.exp(tl.minimum(cnew - c_s[None, :], 0.0)) * k_s[None, :]           # [BLOCK_T, BLOCK_K]
                col = offs_t[None, :] == s
                Akk = tl.where(col, tl.sum(Kt * e, axis=1)[:, None], Akk)
                Aqk = tl.where(col, tl.sum(Qt * e, axis=1)[:, None], Aqk)
        Akk = tl.where(lower, Akk, 0.0)
        Aqk = tl.where(lower | eye, Aqk, 0.0)
    else:
        dec = tl.exp(tl.minimum(htot + cnew, 0.0))                                          # [BLOCK_T]
        Kd = Kt * dec[:, None]
        Qd = Qt * dec[:, None]
        Eh = tl.where(live_h[None, :], tl.exp(tl.minimum(cnew[:, None] + hafter[None, :], 0.0)), 0.0)
        Ch_k = Eh * tl.dot(Kt, tl.trans(KW), input_precision=PREC)                        # [BLOCK_T, BLOCK_W]
        Ch_q = Eh * tl.dot(Qt, tl.trans(KW), input_precision=PREC)
        # Σ_{s<i<=t} g_i as a masked product (no differences of prefix sums)
        gsum = tl.dot(tl.where(offs_t[None, :] <= offs_t[:, None], gn[None, :], 0.0), tl.where(lower, 1.0, 0.0),
                      input_precision="ieee")                                               # [t, s]
        En = tl.exp(tl.minimum(gsum, 0.0))
        Akk = tl.where(lower, En * tl.dot(Kt, tl.trans(Kt), input_precision=PREC), 0.0)
        Aqk = tl.where(lower | eye, En * tl.dot(Qt, tl.trans(Kt), input_precision=PREC), 0.0)
    if KDA:
        Ch_k = tl.where(live_h[None, :], Ch_k, 0.0)
        Ch_q = tl.where(live_h[None, :], Ch_q, 0.0)

    # r_t = beta_t (v_t - S'ᵀk_t without this window's corrections); (I + A) d = r with A = beta ⊙ Akk
    # strictly lower triangular, so (I + A)^-1 = (I - A)(I + A²)(I + A⁴)(I + A⁸) exactly for T <= 16
    r = beta[:, None] * (Vt - tl.dot(Kd, base, input_precision=PREC) - tl.dot(Ch_k, DW, input_precision=PREC))
    A = beta[:, None] * Akk
    A2 = tl.dot(A, A, input_precision="ieee")
    A4 = tl.dot(A2, A2, input_precision="ieee")
    A8 = tl.dot(A4, A4, input_precision="ieee")
    eyef = tl.where(eye, 1.0, 0.0)
    inv = tl.dot(tl.dot(eyef - A, eyef + A2, input_precision="ieee"),
                 tl.dot(eyef + A4, eyef + A8, input_precision="ieee"), input_precision="ieee")
    d = tl.dot(inv, r, input_precision="ieee")                                              # [BLOCK_T, BLOCK_V]
    o = tl.dot(Qd, base, input_precision=PREC) + tl.dot(Ch_q, DW, input_precision=PREC) + \
        tl.dot(Aqk, d, input_precision="ieee")
    tl.store(o_tile, o, mask=o_mask)

    # this verify's records after the history: ring slots (origin + w + t) & (buf - 1)
    slot_t = (org + w + offs_t) & (BUF - 1)
    tl.store(dr_ptr + slot * s_drb + h * s_drh + slot_t[:, None] * s_drl + offs_v[None, :] * s_drv,
             d.to(dr_ptr.dtype.element_ty), mask=o_mask)
    if pid_v == 0:
        if KDA:
            tl.store(gr_ptr + slot * s_grb + h * s_grh + slot_t[:, None] * s_grl + offs_k[None, :] * s_grk,
                     gn.to(gr_ptr.dtype.element_ty), mask=tk)
        else:
            tl.store(gr_ptr + slot * s_grb + h * s_grh + slot_t * s_grl, gn.to(gr_ptr.dtype.element_ty), mask=tt)
        if h % v_per_k == 0:                       # one program per key head appends k
            tl.store(kr_ptr + slot * s_krb + hk * s_krh + slot_t[:, None] * s_krl + offs_k[None, :] * s_krk,
                     Kt.to(kr_ptr.dtype.element_ty), mask=tk)


# launch knobs, for benchmarks/tuning only (the defaults are what the op uses)
TUNING: dict = {}


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
    if T > 16:
        raise ValueError(f"replay_compile.delta_spec: at most 16 tokens per verify on CUDA, got T={T}")
    block_k = max(16, triton.next_power_of_2(K))
    block_v = TUNING.get("BLOCK_V") or (32 if V > 16 else 16)
    block_w = max(16, buf)
    has_slot = slot_idx is not None
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    warps = TUNING.get("num_warps") or 4
    _delta_spec_verify_kernel[(triton.cdiv(V, block_v), b, HV)](
        state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta, slot_idx if has_slot else w, o,
        HV, K, V, T, HV // k_ring.shape[1], HV // q.shape[2],
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
        *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
        HAS_SLOT=has_slot, KDA=kda, BUF=buf, BLOCK_W=block_w, BLOCK_T=max(16, triton.next_power_of_2(T)),
        BLOCK_K=block_k, BLOCK_V=block_v, STOCHASTIC_FP16=state.dtype == torch.float16, num_warps=warps,
        PREC=TUNING.get("PREC", "ieee"),
    )
    return o
