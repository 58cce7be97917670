"""The ``split`` variant of the delta-rule replay step (GDN, KDA) for large batches: the CUDA implementation behind
:func:`~replay_compile.kernels.delta_triton.delta_replay_step_triton` when ``b * HV`` is large. Two launches, routed on
the device from the cursor (one captured CUDA graph serves every step):

1. :func:`_delta_window_kernel`, grid ``(b, HV)``, 1 warp: everything that does not touch the checkpoint, once per
   (row, value head): the window scalars and decayed vectors, ``w`` per row, the scaled keys ``KE`` of flushing rows.
2. :func:`_delta_apply_kernel`, grid ``(cdiv(V, BLOCK_V), b, HV)``: streams ``K x BLOCK_V`` checkpoint slices (32
   wide, 2 warps), writes ``o``, appends the records of non-flush rows and folds flush rows.

Measured on the H200 (``docs/design/delta_kernel.md``; bs256 fp32, L-avg vs fla): the window launch on 1 warp instead
of 4 (its ``[16, 128]`` tiles; GDN window 24 -> 16 µs, KDA 91 -> 54) and 32-wide slices instead of 16 (the checkpoint
stream 182 -> ~150 µs) took GDN from 1.61x to 1.94x and KDA from 0.92x to 1.20x. The rest of the configuration: KDA's
launch 1 record by record (:func:`_delta_window_rows_kernel`: 46 -> 22 µs; GDN keeps the tile form, 16 vs 17 µs); the
flush's record loop software-pipelined (``flush_stages``, ``tl.range(num_stages=...)``): 4 deep took the flush apply
570 -> 445 µs for both, 5 deep instead of 4 the flush step -8 to -23 µs at bs 256-512; launch 1's scratch stored
``evict_last`` (KDA bs256 L-avg -3.7 to -3.9 µs, GDN -3 µs). Tried and dropped: a launch
of its own walking listed flush rows with one ``tl.dot`` (flush 986 µs vs 570, and the early return it needs in
launch 2 delayed the slice load: +13 µs per non-flush step), the window's ring loads issued before the cursor, the
``d`` window loaded before ``w``, the flush's L outer products unrolled (all within noise or worse); the flush's
``KEᵀ D`` as one ``tl.dot`` (IEEE: spills, 8 ms per flush step; tf32x3: flush 468 -> 534 µs and non-flush +10%, the
dot's layout reaching the slice); launch 1 with 2 or 4 value heads per program (one wave at bs256 instead of two: KDA
non-flush 171.2 -> 173.8-175.1 µs, GDN 162.6 -> 164.3-164.4); a deeper flush record pipeline than 4
(8 or 16: flush 468 -> 483 µs GDN, 485 -> 501 KDA); launch 2 as launch 1's programmatic dependent (GDN non-flush
169.7 -> 173.2 µs, KDA 175.5 -> 183.3 at bs256); the window computed inside launch 2 instead (each
slice program repeating it in 4-16-record chunks while or before its slice loads; launch 1 only snapshotting the
cursor and scaling a flush's keys: KDA bs256 non-flush 165 -> 229-321 µs, GDN 159 -> 203-248); the rows in 2-8
chunks whose window launches overlap the previous chunk's pass on CUDA streams, which lost at every point (KDA bs256
+7 to +49 µs: the step is bound by its total bytes, not by the window's latency). The flush fold on the tensor cores
(Gluon ``mma_v2``, the slice in the accumulator layout) moved a flush-only pass by 0.7-5%
(``benchmarks/diag_delta_gluon.py``): the fold is bound by its loads' latency, not its FMAs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv
from .launch import launch, reg_options
from .mamba2_triton import _row_slot, _step_row, _store_checkpoint


@triton.jit
def _store_window(win_ptr, vec_ptr, rh, u, uq, k, q, dec, flushing, offs_l, offs_k, BLOCK_L: tl.constexpr,
                  BLOCK_K: tl.constexpr, SCRATCH_EVICT: tl.constexpr):
    """Launch 1's outputs for (row, value head) ``rh``: ``win = (u [L], uq [L], k·q)``, ``vec = (dec ⊙ k, dec ⊙ q)``
    and, where ``flushing`` (a [BLOCK_K] mask), ``dec`` itself (``dec``: [BLOCK_K] for KDA, a scalar for GDN).
    ``SCRATCH_EVICT``: the stores' L2 eviction hint (``"evict_last"``: kept in L2 for launch 2, see launch_split)."""
    wb = win_ptr + rh * (3 * BLOCK_L)
    tl.store(wb + offs_l, u, eviction_policy=SCRATCH_EVICT)
    tl.store(wb + BLOCK_L + offs_l, uq, eviction_policy=SCRATCH_EVICT)
    tl.store(wb + 2 * BLOCK_L + offs_l, tl.where(offs_l == 0, tl.sum(k * q, axis=0), 0.0),
             eviction_policy=SCRATCH_EVICT)
    vb = vec_ptr + rh * (3 * BLOCK_K)
    tl.store(vb + offs_k, dec * k, eviction_policy=SCRATCH_EVICT)
    tl.store(vb + BLOCK_K + offs_k, dec * q, eviction_policy=SCRATCH_EVICT)
    tl.store(vb + 2 * BLOCK_K + offs_k, dec + tl.zeros([BLOCK_K], dtype=tl.float32), mask=flushing,
             eviction_policy=SCRATCH_EVICT)


@triton.jit
def _gate_window(g_next, g_first, g_cur, w, offs_l, KDA: tl.constexpr):
    """The window's exponents from the ring's per-record log-gates, with the current token at index ``w``.

    ``g_next`` [BLOCK_L] (GDN) or [BLOCK_L, BLOCK_K] (KDA): the ring loaded one record ahead (``g_{j+1}`` at ``j``),
    ``g_first``: the ring's ``g_0``, ``g_cur``: this token's gate. Returns ``E`` (same shape) ``= min(Σ_{j<i<=w} g_i,
    0)`` (callers mask it to ``j < w``) and ``dec = exp(min(Σ_{i<=w} g_i, 0))``. Both are suffix sums of the gates,
    never a difference of running sums: every gate is <= 0, so nothing cancels, a gate of -1e5 or -inf in the window
    leaves the later records' exponents exact, and no ``-inf - -inf`` makes a NaN.
    """
    nxt = offs_l + 1
    if KDA:
        h = tl.where((nxt < w)[:, None], g_next, tl.where((nxt == w)[:, None], g_cur[None, :], 0.0))
    else:
        h = tl.where(nxt < w, g_next, tl.where(nxt == w, g_cur, 0.0))
    E = tl.minimum(tl.cumsum(h, axis=0, reverse=True), 0.0)
    total = tl.where(w > 0, g_first + tl.sum(h, axis=0), g_cur)
    return E, tl.exp(tl.minimum(total, 0.0))


@triton.jit
def _delta_window_kernel(
    cursor_ptr, kr_ptr, gr_ptr, q_ptr, k_ptr, g_ptr, slot_ptr, win_ptr, vec_ptr, ke_ptr, wrow_ptr,
    K, L, v_per_k, v_per_q,
    s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk,
    s_qb, s_qh, s_qk, s_kb, s_kh, s_kk, s_gb, s_gh, s_gk,
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    SCRATCH_EVICT: tl.constexpr,
):
    """Launch 1, grid ``(batch, HV)``: everything of the step that does not touch the checkpoint, once per (row,
    value head) instead of once per V-block. Writes ``w`` [b] (from head 0), the window scalars
    ``win[row, h] = (u_j = KE_j·k_t, v_j = KE_j·q_t, k_t·q_t)``, the decayed vectors
    ``vec[row, h] = (exp(E_tot) ⊙ k_t, exp(E_tot) ⊙ q_t, exp(E_tot))`` and, for flushing rows only, the scaled keys
    ``ke[row, h] = KE [BLOCK_L, BLOCK_K]`` (zero past the window). The ring holds each record's log-gate ``g_j``
    (:func:`_gate_window`); a non-flush row's ``g_t`` is appended here (one program per row and value head; nothing
    else reads or writes that slot in this step). Reads the cursor. GDN's exact step and both families' read-copy
    step (KDA's exact step runs :func:`_delta_window_rows_kernel`). ``SCRATCH_EVICT``: the stores' L2 eviction hint,
    ``"evict_last"`` for the exact step, ``""`` for the read copy (unmeasured there)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    HV = tl.num_programs(1)
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    if slot < 0:
        return
    hk = h // v_per_k
    hq = h // v_per_q
    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < K
    q = tl.load(q_ptr + row * s_qb + hq * s_qh + offs_k * s_qk, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
    kr_ptrs = kr_ptr + slot * s_krb + hk * s_krh + offs_l[:, None] * s_krl + offs_k[None, :] * s_krk
    gr_base = gr_ptr + slot * s_grb + h * s_grh
    nxt = offs_l + 1
    if KDA:
        g_cur = tl.load(g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, mask=mask_k, other=0.0).to(tl.float32)
    else:
        g_cur = tl.load(g_ptr + row * s_gb + h * s_gh).to(tl.float32)
    w = tl.load(cursor_ptr + slot)
    hist = offs_l < w
    kw = tl.load(kr_ptrs, mask=hist[:, None] & mask_k[None, :], other=0.0).to(tl.float32)       # [BLOCK_L, BLOCK_K]
    if KDA:
        g_next = tl.load(gr_base + nxt[:, None] * s_grl + offs_k[None, :] * s_grk,
                         mask=(nxt < w)[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        g_first = tl.load(gr_base + offs_k * s_grk, mask=mask_k & ((offs_k * 0 + w) > 0), other=0.0).to(tl.float32)
    else:
        g_next = tl.load(gr_base + nxt * s_grl, mask=nxt < w, other=0.0).to(tl.float32)
        g_first = tl.load(gr_base, mask=w > 0, other=0.0).to(tl.float32)
    if h == 0:
        tl.store(wrow_ptr + row, w)
    E, dec = _gate_window(g_next, g_first, g_cur, w, offs_l, KDA)                        # dec: KDA [BLOCK_K]
    if KDA:
        ke = tl.where(hist[:, None], kw * tl.exp(E), 0.0)
    else:
        ke = tl.where(hist[:, None], kw * tl.exp(E)[:, None], 0.0)
    _store_window(win_ptr, vec_ptr, row * HV + h, tl.sum(ke * k[None, :], axis=1), tl.sum(ke * q[None, :], axis=1),
                  k, q, dec, (offs_k * 0 + w) == L - 1, offs_l, offs_k, BLOCK_L, BLOCK_K, SCRATCH_EVICT)
    if w == L - 1:
        tl.store(ke_ptr + (row * HV + h) * (BLOCK_L * BLOCK_K) + offs_l[:, None] * BLOCK_K + offs_k[None, :], ke,
                 eviction_policy=SCRATCH_EVICT)
    else:
        _append_gate(gr_base, w, g_cur, offs_k, mask_k, s_grl, s_grk, KDA)


@triton.jit
def _delta_window_rows_kernel(
    cursor_ptr, kr_ptr, gr_ptr, q_ptr, k_ptr, g_ptr, slot_ptr, win_ptr, vec_ptr, ke_ptr, wrow_ptr,
    K, L, v_per_k, v_per_q,
    s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk,
    s_qb, s_qh, s_qk, s_kb, s_kh, s_kk, s_gb, s_gh, s_gk,
    HAS_SLOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, SCRATCH_EVICT: tl.constexpr,
):
    """KDA's launch 1, record by record (the outputs of :func:`_delta_window_kernel`, except that a flushing row's
    ``KE`` slots past ``w`` stay unwritten: launch 2 reads them masked): the window's key and gate rows are separate
    ``[K]`` vectors, walked from the newest record back: ``E_j = Σ_{j<i<=w} g_i`` is then one running sum (a vector
    add per record, never a difference), so the 2-D reductions become L vector steps, about a third of the
    operations, and only the ``w`` held records compute. Unrolled: every row load can be in flight at once. Appends
    ``g_t`` as :func:`_delta_window_kernel`. (GDN, whose gates are scalars, keeps the tile form: 16 vs 17 µs.)"""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    HV = tl.num_programs(1)
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    if slot < 0:
        return
    hk = h // v_per_k
    hq = h // v_per_q
    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < K
    q = tl.load(q_ptr + row * s_qb + hq * s_qh + offs_k * s_qk, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
    w = tl.load(cursor_ptr + slot)
    if h == 0:
        tl.store(wrow_ptr + row, w)
    kr_base = kr_ptr + slot * s_krb + hk * s_krh
    gr_base = gr_ptr + slot * s_grb + h * s_grh
    g_cur = tl.load(g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, mask=mask_k, other=0.0).to(tl.float32)
    after = g_cur                                  # Σ_{j<i<=w} g_i for the record j about to be visited
    u = tl.zeros([BLOCK_L], dtype=tl.float32)
    uq = tl.zeros([BLOCK_L], dtype=tl.float32)
    flushing = (offs_k * 0 + w) == L - 1
    ke_base = ke_ptr + (row * HV + h) * (BLOCK_L * BLOCK_K)
    for i in tl.static_range(BLOCK_L):
        j = BLOCK_L - 1 - i                        # newest first
        live = (offs_k * 0 + j) < w                # vector masks (the interpreter rejects scalar loop-index ones)
        k_j = tl.load(kr_base + j * s_krl + offs_k * s_krk, mask=live & mask_k, other=0.0).to(tl.float32)
        g_j = tl.load(gr_base + j * s_grl + offs_k * s_grk, mask=live & mask_k, other=0.0).to(tl.float32)
        # the loads above issue unconditionally (masked: no traffic past w), the arithmetic only for held records:
        # a non-flush step holds w = 0 .. L - 2 of them, so most of the BLOCK_L exps and reductions were for nothing.
        # Records past w keep u_j = uq_j = 0 and leave their KE slot unwritten (the flush reads it masked to j < w)
        if j < w:
            ke_j = k_j * tl.exp(tl.minimum(after, 0.0))
            u = tl.where(offs_l == j, tl.sum(ke_j * k, axis=0), u)
            uq = tl.where(offs_l == j, tl.sum(ke_j * q, axis=0), uq)
            tl.store(ke_base + j * BLOCK_K + offs_k, ke_j, mask=flushing, eviction_policy=SCRATCH_EVICT)
        after = after + g_j                        # zero past w (masked loads)
    dec = tl.exp(tl.minimum(after, 0.0))           # Σ_{i<=w} g_i [BLOCK_K]
    _store_window(win_ptr, vec_ptr, row * HV + h, u, uq, k, q, dec, flushing, offs_l, offs_k, BLOCK_L, BLOCK_K,
                  SCRATCH_EVICT)
    if w < L - 1:
        _append_gate(gr_base, w, g_cur, offs_k, mask_k, s_grl, s_grk, True)


@triton.jit
def _append_gate(gr_base, w, g_cur, offs_k, mask_k, s_grl, s_grk, KDA: tl.constexpr):
    """A non-flush row's gate record at ring position ``w``: its log-gate ``g_t`` ([K] for KDA). Launch 1 writes it
    (one program per row and value head, after reading the slots before ``w``)."""
    if KDA:
        tl.store(gr_base + w * s_grl + offs_k * s_grk, g_cur, mask=mask_k)
    else:
        tl.store(gr_base + w * s_grl, g_cur)


@triton.jit
def _fold_record(s_new, ke_base, dr_base, j, w, offs_k, offs_v, mask_v, s_drl, s_drv, BLOCK_K: tl.constexpr):
    """``s_new + KE_j ⊗ d_j`` for record ``j`` (zero past ``w``). Vector masks built from vectors: triton 3.9's
    interpreter rejects a mask combined from a scalar comparison of the loop index."""
    ke_j = tl.load(ke_base + j * BLOCK_K + offs_k, mask=(offs_k * 0 + j) < w, other=0.0)
    d_j = tl.load(dr_base + j * s_drl + offs_v * s_drv, mask=mask_v & ((offs_v * 0 + j) < w), other=0.0)
    return s_new + ke_j[:, None] * d_j.to(tl.float32)[None, :]


@triton.jit
def _window_readout(s0, v, beta, w, win_ptr, vec_ptr, rh, dr_base, offs_l, offs_k, offs_v, mask_v, s_drl, s_drv,
                    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    """A non-flush readout of one ``K x BLOCK_V`` slice from its checkpoint term ``s0`` (the checkpoint, or the
    decoded read copy) and launch 1's window for (row, value head) ``rh``::

        S'ᵀk_t = s0ᵀ(exp(E_tot) ⊙ k_t) + Σ_{j<w} u_j d_j ;  S'ᵀq_t likewise with uq_j ;  d = β (v − S'ᵀk_t)

    Returns ``(d, o)`` [BLOCK_V], ``o = S'ᵀq_t + d (k_t·q_t)``."""
    wb = win_ptr + rh * (3 * BLOCK_L)
    u = tl.load(wb + offs_l)
    uq = tl.load(wb + BLOCK_L + offs_l)
    kq = tl.load(wb + 2 * BLOCK_L)
    vb = vec_ptr + rh * (3 * BLOCK_K)
    ak = tl.load(vb + offs_k)
    aq = tl.load(vb + BLOCK_K + offs_k)
    hist = offs_l < w
    dw = tl.load(dr_base + offs_l[:, None] * s_drl + offs_v[None, :] * s_drv,
                 mask=hist[:, None] & mask_v[None, :], other=0.0).to(tl.float32)          # [BLOCK_L, BLOCK_V]
    sk = tl.sum(s0 * ak[:, None], axis=0) + tl.sum(u[:, None] * dw, axis=0)
    sq = tl.sum(s0 * aq[:, None], axis=0) + tl.sum(uq[:, None] * dw, axis=0)
    d = beta * (v - sk)
    return d, sq + d * kq


@triton.jit
def _append_key(k_ptrs, kr_base, w, h, v_per_k, offs_k, mask_k, s_krl, s_krk):
    """A non-flush row's key record ``k_t`` (``k_ptrs``: the step's ``k_t``) at ring position ``w``, from one value
    head per key head. (Its gate record ``g_t`` was appended by launch 1.)"""
    if h % v_per_k == 0:                           # one program per key head appends k_t
        k_raw = tl.load(k_ptrs, mask=mask_k, other=0.0)
        tl.store(kr_base + w * s_krl + offs_k * s_krk, k_raw.to(kr_base.dtype.element_ty), mask=mask_k)


@triton.jit
def _delta_apply_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, cursor_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr,
    win_ptr, vec_ptr, ke_ptr, wrow_ptr,
    HV, K, V, L, v_per_k,
    s_sb, s_sh, s_sk, s_sv, s_drb, s_drh, s_drl, s_drv, s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk,
    s_kb, s_kh, s_kk, s_vb, s_vh, s_vv, s_gb, s_gh, s_gk, s_bb, s_bh, s_ob, s_oh, s_ov,
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_L: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, FLUSH_STAGES: tl.constexpr,
):
    """Launch 2, grid ``(cdiv(V, BLOCK_V), batch, HV)``: reads its ``K x BLOCK_V`` checkpoint slice (issued first)
    and the window's corrected values, takes the rest from launch 1::

        S'ᵀk_t = S_0ᵀ(exp(E_tot) ⊙ k_t) + Σ_j u_j d_j     (same for q_t with v_j)

    Non-flush rows append ``d`` (and ``k``, ``g`` once per key / value head); flush rows write
    ``exp(E_tot) ⊙_K S_0 + KEᵀ D + k dᵀ`` once, as L outer products with launch 1's scaled keys (no ``tl.dot`` in
    this kernel: its operand layouts slowed the non-flush path by 20% on the H200, docs/design/delta_kernel.md). Only
    what a branch needs is loaded in it. One program per row advances the cursor: launch 1 has already read it and this
    launch reads ``w`` from launch 1's copy, so nobody reads it after the write."""
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    o_ptrs = o_ptr + row * s_ob + h * s_oh + offs_v * s_ov
    slot = _step_row(slot_ptr, row, o_ptrs, mask_v, HAS_SLOT, BLOCK_V)
    if slot < 0:                                   # padding row: zero output (stored above), touch nothing else
        return
    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < K
    tile_mask = mask_k[:, None] & mask_v[None, :]
    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    s0 = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                      # [BLOCK_K, BLOCK_V]
    v = tl.load(v_ptr + row * s_vb + h * s_vh + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_bb + h * s_bh).to(tl.float32)
    dr_base = dr_ptr + slot * s_drb + h * s_drh
    w = tl.load(wrow_ptr + row)
    d, o = _window_readout(s0, v, beta, w, win_ptr, vec_ptr, row * HV + h, dr_base, offs_l, offs_k, offs_v, mask_v,
                           s_drl, s_drv, BLOCK_L, BLOCK_K)
    tl.store(o_ptrs, o, mask=mask_v)

    hk = h // v_per_k
    kr_base = kr_ptr + slot * s_krb + hk * s_krh
    k_ptrs = k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk
    if w == L - 1:
        k_cur = tl.load(k_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        dec = tl.load(vec_ptr + (row * HV + h) * (3 * BLOCK_K) + 2 * BLOCK_K + offs_k)     # launch 1's exp(E_tot)
        s_new = dec[:, None] * s0 + k_cur[:, None] * d[None, :]
        ke_base = ke_ptr + (row * HV + h) * (BLOCK_L * BLOCK_K)
        # KEᵀ D as L outer products (no tl.dot here, see above), the record loop software-pipelined FLUSH_STAGES
        # deep (the flush is latency-bound: an L2 round trip per record at ~12 resident warps per SM). A flush holds
        # w = L - 1 <= BLOCK_L - 1 records, so BLOCK_L - 1 iterations cover them: a masked last iteration would
        # still issue its FMAs (1/16 of the fold at L = 16; the bound stays constexpr for the interpreter)
        for j in tl.range(BLOCK_L - 1, num_stages=FLUSH_STAGES):
            s_new = _fold_record(s_new, ke_base, dr_base, j, w, offs_k, offs_v, mask_v, s_drl, s_drv, BLOCK_K)
        key_gate = tl.load(g_ptr + row * s_gb + h * s_gh).to(tl.float32)    # g (GDN) or g[..., 0] (KDA)
        _store_checkpoint(st_ptrs, s_new, tile_mask, key_gate, slot * HV + h,
                          offs_k[:, None] * V + offs_v[None, :], STOCHASTIC_FP16)
        if (pid_v == 0) & (h == 0):
            tl.store(cursor_ptr + slot, 0)
    else:
        tl.store(dr_base + w * s_drl + offs_v * s_drv, d.to(dr_ptr.dtype.element_ty), mask=mask_v)
        if pid_v == 0:
            _append_key(k_ptrs, kr_base, w, h, v_per_k, offs_k, mask_k, s_krl, s_krk)
            if h == 0:
                tl.store(cursor_ptr + slot, w + 1)


def launch_split(cfg: dict, state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_arg, has_slot, o):
    """Launch the split step (launches 1-2 above) into ``o`` [b, HV, V]; ``cfg`` from
    :func:`~.delta_triton.launch_config`. Returns launch 2's compiled kernel (``None`` under the interpreter)."""
    S, HV, K, V = state.shape
    b, L = v.shape[0], d_ring.shape[2]
    kda = g_ring.dim() == 4
    bk, bl = cfg["BLOCK_K"], cfg["BLOCK_L"]
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    v_per_k, v_per_q = HV // k_ring.shape[1], HV // q.shape[1]
    common = dict(HAS_SLOT=has_slot, BLOCK_K=bk, BLOCK_L=bl)
    # launch 1 writes its scratch (win, vec and a flush's scaled keys: 14 / 77 MB at bs256, HV = 32) evict_last, so
    # that launch 2 finds it in L2 instead of in DRAM behind the checkpoint it has streamed since (see
    # delta_triton.launch_config). Every line stored so is read back by launch 2 with plain loads (the default,
    # evict_normal, policy), so none keeps its evict_last priority past the step
    stochastic = state.dtype == torch.float16
    win = torch.empty((b, HV, 3 * bl), dtype=torch.float32, device=v.device)
    vec = torch.empty((b, HV, 3 * bk), dtype=torch.float32, device=v.device)
    ke = torch.empty((b, HV, bl * bk), dtype=torch.float32, device=v.device)
    wrow = torch.empty((b,), dtype=cursor.dtype, device=v.device)
    win_args = (cursor, k_ring, g_ring, q, k, g, slot_arg, win, vec, ke, wrow, K, L, v_per_k, v_per_q,
                *k_ring.stride(), *g_strides, *q.stride(), *k.stride(), *gi_strides)
    if kda:                                        # record by record (see delta_triton.launch_config)
        launch(_delta_window_rows_kernel)[(b, HV)](*win_args, num_warps=cfg["window_warps"],
                                                   SCRATCH_EVICT="evict_last", **common)
    else:
        launch(_delta_window_kernel)[(b, HV)](*win_args, KDA=False, num_warps=cfg["window_warps"],
                                              SCRATCH_EVICT="evict_last", **common)
    n_vb = cdiv(V, cfg["BLOCK_V"])
    return launch(_delta_apply_kernel)[(n_vb, b, HV)](
        state, d_ring, k_ring, g_ring, cursor, k, v, g, beta, slot_arg, o, win, vec, ke, wrow,
        HV, K, V, L, v_per_k,
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
        *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
        KDA=kda, BLOCK_V=cfg["BLOCK_V"], STOCHASTIC_FP16=stochastic, FLUSH_STAGES=cfg["flush_stages"],
        num_warps=cfg["num_warps"], **common, **reg_options(cfg["maxnreg"]))
