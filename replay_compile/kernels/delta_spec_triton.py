"""Triton kernel of the delta-rule speculative verify step (GDN and KDA): the CUDA implementation of
``replay_compile::delta_spec_verify``, same signature and in-place contract as
:func:`~replay_compile.kernels.delta_spec_reference.delta_spec_verify_reference` (ring, cursors and flush rule:
:mod:`.mamba2_spec_reference`; the commit is the family-agnostic ``spec_commit``).

Grid ``(cdiv(V, BLOCK_V), batch, HV)``. The corrected values are independent across value columns
(``d_t[v] = beta_t (v_t[v] - Σ_k S'_t[k, v] k_t[k])``), so a program owns a ``K x BLOCK_V`` slice of the checkpoint,
read once for all ``T`` tokens, and solves the window's ``T`` corrected values for its columns. The window sits on
one power-of-two axis ``BLOCK_W >= buf``: logical position ``j < w`` is a history record (ring slot
``(origin + j) & (buf - 1)``), ``w <= j < w + T`` is token ``j - w`` of this verify (keys and gates read from the
inputs, corrected values filled in as they are solved). For token ``t`` at position ``m = w + t``, with
``E_j = Σ_{j<i<=m} g_i`` (suffix sums over the live window, every exponent <= 0) and ``KE_j = k_j ⊙ exp(E_j)``::

    S'_mᵀ x = S_lᵀ (exp(Σ_{lo<=i<=m} g_i) ⊙ x) + Σ_{lo<=j<m} d_j (KE_j · x)       x = k_m and x = q_m
    d_m = beta_m (v_m - S'_mᵀ k_m) ;  o_m = S'_mᵀ q_m + d_m (k_m · q_m)

(the forward substitution of the window's unit-triangular WY system, one row per token, T <= 8). Ordinary rows
use ``S_l = S_0, lo = 0``; flush rows first fold their history into the checkpoint (one ``tl.dot``, IEEE fp32;
written once, fp16 rounded stochastically as the reference does) and use ``lo = w``. The ``T`` new records go to
ring slots ``(origin + w + t) & (buf - 1)``, which never hold committed history (``w + T <= buf``).

A row whose history and window do not fit the ring (which the commit's flush rule prevents) gets NaN outputs and
touches nothing: the kernel cannot raise, so the error is made impossible to miss. No autotuning (the kernel
writes its inputs in place); constexpr loop bounds only (the interpreter's numpy>=2.4 limitation).
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
):
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    offs_t = tl.arange(0, BLOCK_T)
    o_tile = o_ptr + row * s_ob + offs_t[:, None] * s_ot + h * s_oh + offs_v[None, :] * s_ov      # [BLOCK_T, BLOCK_V]
    o_mask = (offs_t < T)[:, None] & mask_v[None, :]
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

    # the window on one axis: history from the ring, then this verify's tokens from the inputs
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
    if KDA:
        gh = tl.load(gr_ptr + slot * s_grb + h * s_grh + ring_j[:, None] * s_grl + offs_k[None, :] * s_grk,
                     mask=hist[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        gn = tl.load(g_ptr + row * s_gb + t_j[:, None] * s_gt + h * s_gh + offs_k[None, :] * s_gk,
                     mask=new[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        gw = tl.where(hist[:, None], gh, gn)                                               # [BLOCK_W, BLOCK_K]
    else:
        gh = tl.load(gr_ptr + slot * s_grb + h * s_grh + ring_j * s_grl, mask=hist, other=0.0).to(tl.float32)
        gn = tl.load(g_ptr + row * s_gb + t_j * s_gt + h * s_gh, mask=new, other=0.0).to(tl.float32)
        gw = tl.where(hist, gh, gn)                                                        # [BLOCK_W]
    dw = tl.load(dr_ptr + slot * s_drb + h * s_drh + ring_j[:, None] * s_drl + offs_v[None, :] * s_drv,
                 mask=hist[:, None] & mask_v[None, :], other=0.0).to(tl.float32)           # [BLOCK_W, BLOCK_V]

    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    base = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                    # [BLOCK_K, BLOCK_V]
    lo = w * 0                                     # a tensor on both branches
    if fl:
        # fold the history into the checkpoint: S_1 = exp(Σ g) ⊙_K S_0 + Σ_{j<w} (k_j ⊙ exp(E_j)) d_jᵀ
        if KDA:
            g_h = tl.where(hist[:, None], gw, 0.0)
            after_h = tl.minimum(tl.cumsum(g_h, axis=0, reverse=True) - g_h, 0.0)
            ke_h = tl.where(hist[:, None], kw * tl.exp(after_h), 0.0)
            base = tl.exp(tl.minimum(tl.sum(g_h, axis=0), 0.0))[:, None] * base
            key_gate = tl.sum(tl.sum(tl.where((offs_j == w - 1)[:, None] & (offs_k == 0)[None, :], gw, 0.0),
                                     axis=1), axis=0)                     # last record's g[..., 0], as the reference
        else:
            g_h = tl.where(hist, gw, 0.0)
            after_h = tl.minimum(tl.cumsum(g_h, axis=0, reverse=True) - g_h, 0.0)
            ke_h = tl.where(hist[:, None], kw * tl.exp(after_h)[:, None], 0.0)
            base = tl.exp(tl.minimum(tl.sum(g_h, axis=0), 0.0)) * base
            key_gate = tl.sum(tl.where(offs_j == w - 1, gw, 0.0), axis=0)
        base = base + tl.dot(tl.trans(ke_h), dw, input_precision="ieee")
        if w > 0:
            _store_checkpoint(st_ptrs, base, tile_mask, key_gate, slot * HV + h,
                              offs_k[:, None] * V + offs_v[None, :], STOCHASTIC_FP16)
        lo = w

    for t in range(BLOCK_T):                       # forward substitution, one token at a time (T <= 8)
        if t < T:
            m = w + t
            live = (offs_j >= lo) & (offs_j <= m)
            prior = live & (offs_j < m)
            q_t = tl.load(q_ptr + row * s_qb + t * s_qt + hq * s_qh + offs_k * s_qk, mask=mask_k,
                          other=0.0).to(tl.float32)
            k_t = tl.load(k_ptr + row * s_kb + t * s_kt + hk * s_kh + offs_k * s_kk, mask=mask_k,
                          other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + row * s_vb + t * s_vt + h * s_vh + offs_v * s_vv, mask=mask_v,
                          other=0.0).to(tl.float32)
            beta_t = tl.load(beta_ptr + row * s_bb + t * s_bt + h * s_bh).to(tl.float32)
            if KDA:
                g_t = tl.where(live[:, None], gw, 0.0)
                after = tl.minimum(tl.cumsum(g_t, axis=0, reverse=True) - g_t, 0.0)          # Σ_{j<i<=m}
                ke = tl.where(prior[:, None], kw * tl.exp(after), 0.0)                       # [BLOCK_W, BLOCK_K]
                dec = tl.exp(tl.minimum(tl.sum(g_t, axis=0), 0.0))                           # [BLOCK_K]
            else:
                g_t = tl.where(live, gw, 0.0)
                after = tl.minimum(tl.cumsum(g_t, axis=0, reverse=True) - g_t, 0.0)
                ke = tl.where(prior[:, None], kw * tl.exp(after)[:, None], 0.0)
                dec = tl.exp(tl.minimum(tl.sum(g_t, axis=0), 0.0))
            sk = tl.sum(base * (dec * k_t)[:, None], axis=0) + \
                tl.sum(tl.sum(ke * k_t[None, :], axis=1)[:, None] * dw, axis=0)              # S'ᵀk [BLOCK_V]
            sq = tl.sum(base * (dec * q_t)[:, None], axis=0) + \
                tl.sum(tl.sum(ke * q_t[None, :], axis=1)[:, None] * dw, axis=0)              # S'ᵀq
            d = beta_t * (v_t - sk)
            o = sq + d * tl.sum(k_t * q_t, axis=0)
            tl.store(o_ptr + row * s_ob + t * s_ot + h * s_oh + offs_v * s_ov, o, mask=mask_v)
            dw = tl.where((offs_j == m)[:, None], d[None, :], dw)          # later tokens read this record
            tl.store(dr_ptr + slot * s_drb + h * s_drh + ((org + m) & (BUF - 1)) * s_drl + offs_v * s_drv,
                     d.to(dr_ptr.dtype.element_ty), mask=mask_v)

    # this verify's keys and gates after the history (its corrected values were stored above)
    tt = offs_t < T
    slot_t = (org + w + offs_t) & (BUF - 1)
    if pid_v == 0:
        if KDA:
            g_new = tl.load(g_ptr + row * s_gb + offs_t[:, None] * s_gt + h * s_gh + offs_k[None, :] * s_gk,
                            mask=tt[:, None] & mask_k[None, :], other=0.0)
            tl.store(gr_ptr + slot * s_grb + h * s_grh + slot_t[:, None] * s_grl + offs_k[None, :] * s_grk,
                     g_new.to(gr_ptr.dtype.element_ty), mask=tt[:, None] & mask_k[None, :])
        else:
            g_new = tl.load(g_ptr + row * s_gb + offs_t * s_gt + h * s_gh, mask=tt, other=0.0)
            tl.store(gr_ptr + slot * s_grb + h * s_grh + slot_t * s_grl, g_new.to(gr_ptr.dtype.element_ty),
                     mask=tt)
        if h % v_per_k == 0:                       # one program per key head appends k
            k_new = tl.load(k_ptr + row * s_kb + offs_t[:, None] * s_kt + hk * s_kh + offs_k[None, :] * s_kk,
                            mask=tt[:, None] & mask_k[None, :], other=0.0)
            tl.store(kr_ptr + slot * s_krb + hk * s_krh + slot_t[:, None] * s_krl + offs_k[None, :] * s_krk,
                     k_new.to(kr_ptr.dtype.element_ty), mask=tt[:, None] & mask_k[None, :])


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
    block_k = max(16, triton.next_power_of_2(K))
    block_v = TUNING.get("BLOCK_V") or (32 if V > 16 else 16)
    block_w = max(16, buf)
    has_slot = slot_idx is not None
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    warps = TUNING.get("num_warps") or max(1, min(8, max(block_k * block_v, block_w * block_k) // 2048))
    _delta_spec_verify_kernel[(triton.cdiv(V, block_v), b, HV)](
        state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta, slot_idx if has_slot else w, o,
        HV, K, V, T, HV // k_ring.shape[1], HV // q.shape[2],
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
        *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
        HAS_SLOT=has_slot, KDA=kda, BUF=buf, BLOCK_W=block_w, BLOCK_T=max(1, triton.next_power_of_2(T)),
        BLOCK_K=block_k, BLOCK_V=block_v, STOCHASTIC_FP16=state.dtype == torch.float16, num_warps=warps,
    )
    return o
