"""The ``split`` delta step with its window computed inside the checkpoint pass (``window_inline=1``).

The default split step (:mod:`.delta_split_triton`) computes the window once per (row, value head) in a launch of its
own and hands it to the checkpoint pass through scratch. On the H200 that launch costs every non-flush step of KDA
at Kimi-Linear geometry ~25 µs beside a ~148 µs pass (bs256, fp32; session 20), and most of the step's excess over
its bandwidth floor is there. Here the pass computes the window terms itself, while its checkpoint slice is in
flight: each of the ``cdiv(V, BLOCK_V)`` programs of a (row, value head) recomputes them (the rings are read from L2
after the first), in chunks of ``CHUNK`` records on a ``[CHUNK, BLOCK_K]`` tile, so each chunk's two reductions over
K stay within a warp and no chunk past ``w`` computes anything. Two launches, routed on the device from the cursor
(one captured CUDA graph serves every step):

1. :func:`_delta_flush_prep_kernel`, grid ``(b, HV)``, 1 warp: snapshots ``w`` per row (launch 2 advances the cursor)
   and, for flushing rows only, writes the scaled keys ``KE`` the fold needs in the slice's row layout (one exp per
   element once per (row, head) rather than once per slice program). Non-flush programs stop after the cursor.
2. :func:`_delta_apply_inline_kernel`, grid ``(cdiv(V, BLOCK_V), b, HV)``: the pass of :func:`_delta_apply_kernel`
   with the window computed in-program; non-flush rows append ``d`` (and ``k``, ``G_w`` once per key / value head),
   flush rows fold as the default pass does.

Same math, same rings, same in-place contract as the default split step (see :mod:`.delta_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv
from .launch import launch, reg_options
from .delta_split_triton import _append_gate, _append_key, _fold_record
from .mamba2_triton import _row_slot, _step_row, _store_checkpoint


@triton.jit
def _gate_sum(gr_base, g_ptrs, w, offs_k, mask_k, offs_l, s_grl, s_grk, KDA: tl.constexpr):
    """This token's summed log-gate ``G_w = G_{w-1} + g_t`` (``G_{-1} = 0``): [BLOCK_K] for KDA, a scalar for GDN.
    ``g_ptrs``: the step's ``g_t`` ([K] pointers for KDA, one for GDN)."""
    if KDA:
        g_sum = tl.load(gr_base + (w - 1) * s_grl + offs_k * s_grk, mask=mask_k & ((offs_k * 0 + w) > 0),
                        other=0.0).to(tl.float32)
        g_sum += tl.load(g_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    else:
        g_prev = tl.load(gr_base + offs_l * s_grl, mask=offs_l == w - 1, other=0.0).to(tl.float32)
        g_sum = tl.sum(g_prev, axis=0) + tl.load(g_ptrs).to(tl.float32)
    return g_sum


@triton.jit
def _delta_flush_prep_kernel(
    cursor_ptr, kr_ptr, gr_ptr, g_ptr, slot_ptr, ke_ptr, wrow_ptr,
    K, L, v_per_k,
    s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk, s_gb, s_gh, s_gk,
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Launch 1, grid ``(batch, HV)``: ``wrow[row] = w`` (from head 0) and, where the row flushes (``w == L - 1``),
    ``ke[row, h, j] = KE_j = k_j ⊙ exp(G_w - G_j)`` for the ``w`` held records (slots past ``w`` unwritten: the fold
    reads them masked). Reads the cursor; launch 2 writes it, after this grid has finished."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    HV = tl.num_programs(1)
    slot = _row_slot(slot_ptr, row, HAS_SLOT)
    if slot < 0:
        return
    w = tl.load(cursor_ptr + slot)
    if h == 0:
        tl.store(wrow_ptr + row, w)
    if w == L - 1:
        offs_k = tl.arange(0, BLOCK_K)
        offs_l = tl.arange(0, BLOCK_L)
        mask_k = offs_k < K
        kr_base = kr_ptr + slot * s_krb + (h // v_per_k) * s_krh
        gr_base = gr_ptr + slot * s_grb + h * s_grh
        if KDA:
            g_sum = _gate_sum(gr_base, g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, w, offs_k, mask_k, offs_l,
                              s_grl, s_grk, KDA)
        else:
            g_sum = _gate_sum(gr_base, g_ptr + row * s_gb + h * s_gh, w, offs_k, mask_k, offs_l, s_grl, s_grk, KDA)
            gw = tl.load(gr_base + offs_l * s_grl, mask=offs_l < w, other=0.0).to(tl.float32)
        ke_base = ke_ptr + (row * HV + h) * (BLOCK_L * BLOCK_K)
        for j in tl.static_range(BLOCK_L - 1):     # a flush holds w = L - 1 <= BLOCK_L - 1 records
            live = (offs_k * 0 + j) < w
            k_j = tl.load(kr_base + j * s_krl + offs_k * s_krk, mask=live & mask_k, other=0.0).to(tl.float32)
            if KDA:
                G_j = tl.load(gr_base + j * s_grl + offs_k * s_grk, mask=live & mask_k, other=0.0).to(tl.float32)
            else:
                G_j = tl.sum(tl.where(offs_l == j, gw, 0.0), axis=0)
            if j < w:
                tl.store(ke_base + j * BLOCK_K + offs_k, k_j * tl.exp(tl.minimum(g_sum - G_j, 0.0)))


@triton.jit
def _window_terms(sk, sq, k, q, g_sum, w, kr_base, gr_base, dr_base, offs_k, mask_k, offs_v, mask_v,
                  s_krl, s_krk, s_grl, s_grk, s_drl, s_drv,
                  KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_L: tl.constexpr,
                  CHUNK: tl.constexpr):
    """``sk + Σ_{j<w} (KE_j·k_t) d_j`` and ``sq + Σ_{j<w} (KE_j·q_t) d_j`` over this program's V-slice
    ([BLOCK_V] each), the window computed in chunks of ``CHUNK`` records: a chunk's loads issue masked (no traffic
    past ``w``), its arithmetic only where it holds a record. The chunks' ``[CHUNK, BLOCK_V]`` products accumulate
    elementwise and are summed over records once at the end: a sum over the record axis crosses warps (a barrier
    each), one over K does not."""
    acc_k = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    acc_q = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    # the token's vectors broadcast once, outside the chunks' branches (converted inside them, every chunk paid a
    # shared-memory round trip for its layout)
    kb = k[None, :] + tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    qb = q[None, :] + tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    if KDA:
        gb = g_sum[None, :] + tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    else:
        gb = g_sum
    for c in tl.static_range(BLOCK_L // CHUNK):
        offs_c = c * CHUNK + tl.arange(0, CHUNK)
        live = offs_c < w
        kc = tl.load(kr_base + offs_c[:, None] * s_krl + offs_k[None, :] * s_krk,
                     mask=live[:, None] & mask_k[None, :], other=0.0).to(tl.float32)          # [CHUNK, BLOCK_K]
        if KDA:
            gc = tl.load(gr_base + offs_c[:, None] * s_grl + offs_k[None, :] * s_grk,
                         mask=live[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        else:
            gc = tl.load(gr_base + offs_c * s_grl, mask=live, other=0.0).to(tl.float32)        # [CHUNK]
        dc = tl.load(dr_base + offs_c[:, None] * s_drl + offs_v[None, :] * s_drv,
                     mask=live[:, None] & mask_v[None, :], other=0.0).to(tl.float32)          # [CHUNK, BLOCK_V]
        if c * CHUNK < w:
            if KDA:
                ke = kc * tl.exp(tl.minimum(gb - gc, 0.0))
            else:
                ke = kc * tl.exp(tl.minimum(gb - gc, 0.0))[:, None]
            u = tl.sum(ke * kb, axis=1)                                                         # [CHUNK]
            uq = tl.sum(ke * qb, axis=1)
            acc_k += u[:, None] * dc
            acc_q += uq[:, None] * dc
    return sk + tl.sum(acc_k, axis=0), sq + tl.sum(acc_q, axis=0)


@triton.jit
def _delta_apply_inline_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, cursor_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr,
    ke_ptr, wrow_ptr,
    HV, K, V, L, v_per_k, v_per_q,
    s_sb, s_sh, s_sk, s_sv, s_drb, s_drh, s_drl, s_drv, s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk,
    s_qb, s_qh, s_qk, s_kb, s_kh, s_kk, s_vb, s_vh, s_vv, s_gb, s_gh, s_gk, s_bb, s_bh, s_ob, s_oh, s_ov,
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_L: tl.constexpr, CHUNK: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, FLUSH_STAGES: tl.constexpr,
    WINDOW_FIRST: tl.constexpr,
):
    """Launch 2, grid ``(cdiv(V, BLOCK_V), batch, HV)``: the checkpoint slice is issued first; while it is in flight
    the program computes ``G_w``, ``exp(E_tot)`` and the window terms (:func:`_window_terms`), then::

        S'ᵀk_t = S_0ᵀ(exp(E_tot) ⊙ k_t) + Σ_j (KE_j·k_t) d_j ;  S'ᵀq_t likewise ;  d = β (v − S'ᵀk_t)
        o = S'ᵀq_t + d (k_t·q_t)

    Non-flush rows append ``d``, ``k`` (one value head per key head) and ``G_w`` (the slice-0 program), and one
    program per row advances the cursor; flush rows write ``exp(E_tot) ⊙_K S_0 + KEᵀ D + k dᵀ`` with launch 1's
    ``KE``, as the default pass does, and reset it. ``w`` comes from launch 1's snapshot, so nobody reads the cursor
    after its write."""
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
    if not WINDOW_FIRST:
        s0 = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                  # [BLOCK_K, BLOCK_V]
    v = tl.load(v_ptr + row * s_vb + h * s_vh + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_bb + h * s_bh).to(tl.float32)
    hk = h // v_per_k
    k_ptrs = k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk
    k = tl.load(k_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * s_qb + (h // v_per_q) * s_qh + offs_k * s_qk, mask=mask_k, other=0.0).to(tl.float32)
    w = tl.load(wrow_ptr + row)
    kr_base = kr_ptr + slot * s_krb + hk * s_krh
    gr_base = gr_ptr + slot * s_grb + h * s_grh
    dr_base = dr_ptr + slot * s_drb + h * s_drh
    if KDA:
        g_sum = _gate_sum(gr_base, g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, w, offs_k, mask_k, offs_l,
                          s_grl, s_grk, KDA)
    else:
        g_sum = _gate_sum(gr_base, g_ptr + row * s_gb + h * s_gh, w, offs_k, mask_k, offs_l, s_grl, s_grk, KDA)
    dec = tl.exp(tl.minimum(g_sum, 0.0))                                         # KDA [BLOCK_K], GDN scalar
    sk = tl.zeros([BLOCK_V], dtype=tl.float32)
    sq = tl.zeros([BLOCK_V], dtype=tl.float32)
    sk, sq = _window_terms(sk, sq, k, q, g_sum, w, kr_base, gr_base, dr_base, offs_k, mask_k, offs_v, mask_v,
                           s_krl, s_krk, s_grl, s_grk, s_drl, s_drv, KDA, BLOCK_K, BLOCK_V, BLOCK_L, CHUNK)
    if WINDOW_FIRST:
        s0 = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    sk += tl.sum(s0 * (dec * k)[:, None], axis=0)
    sq += tl.sum(s0 * (dec * q)[:, None], axis=0)
    d = beta * (v - sk)
    tl.store(o_ptrs, sq + d * tl.sum(k * q, axis=0), mask=mask_v)

    if w == L - 1:
        if KDA:
            s_new = dec[:, None] * s0 + k[:, None] * d[None, :]
        else:
            s_new = dec * s0 + k[:, None] * d[None, :]
        ke_base = ke_ptr + (row * HV + h) * (BLOCK_L * BLOCK_K)
        # KEᵀ D as L - 1 outer products from launch 1's scaled keys, pipelined as the default pass's fold
        if FLUSH_STAGES > 0:
            for j in tl.range(BLOCK_L - 1, num_stages=FLUSH_STAGES):
                s_new = _fold_record(s_new, ke_base, dr_base, j, w, offs_k, offs_v, mask_v, s_drl, s_drv, BLOCK_K)
        else:
            for j in range(BLOCK_L - 1):
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
            _append_gate(gr_base, w, g_sum, offs_k, mask_k, s_grl, s_grk, KDA)
            if h == 0:
                tl.store(cursor_ptr + slot, w + 1)


def launch_inline_window(cfg: dict, state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_arg, has_slot, o):
    """Launch the inline-window split step (launches 1-2 above) into ``o`` [b, HV, V]; ``cfg`` from
    :func:`~.delta_triton.launch_config` (``window_chunk``: records per window chunk). Returns launch 2's compiled
    kernel (``None`` under the interpreter)."""
    S, HV, K, V = state.shape
    b, L = v.shape[0], d_ring.shape[2]
    kda = g_ring.dim() == 4
    bk, bl = cfg["BLOCK_K"], cfg["BLOCK_L"]
    chunk = min(int(cfg["window_chunk"]), bl)
    if chunk < 1 or bl % chunk:
        raise ValueError(f"replay_compile.delta: window_chunk={cfg['window_chunk']} must divide the window axis ({bl})")
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    v_per_k, v_per_q = HV // k_ring.shape[1], HV // q.shape[1]
    ke = torch.empty((b, HV, bl * bk), dtype=torch.float32, device=v.device)
    wrow = torch.empty((b,), dtype=cursor.dtype, device=v.device)
    launch(_delta_flush_prep_kernel)[(b, HV)](
        cursor, k_ring, g_ring, g, slot_arg, ke, wrow, K, L, v_per_k,
        *k_ring.stride(), *g_strides, *gi_strides,
        HAS_SLOT=has_slot, KDA=kda, BLOCK_K=bk, BLOCK_L=bl, num_warps=cfg["window_warps"])
    return launch(_delta_apply_inline_kernel)[(cdiv(V, cfg["BLOCK_V"]), b, HV)](
        state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_arg, o, ke, wrow,
        HV, K, V, L, v_per_k, v_per_q,
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
        *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
        HAS_SLOT=has_slot, KDA=kda, BLOCK_K=bk, BLOCK_V=cfg["BLOCK_V"], BLOCK_L=bl, CHUNK=chunk,
        STOCHASTIC_FP16=state.dtype == torch.float16, FLUSH_STAGES=cfg["flush_stages"],
        WINDOW_FIRST=cfg["window_first"], num_warps=cfg["num_warps"], **reg_options(cfg["maxnreg"]))
