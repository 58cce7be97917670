"""Triton kernels of the delta-rule (GDN / KDA) replay step with a low-precision read copy.

Same signature and in-place contract as
:func:`~replay_compile.kernels.delta_readcopy_reference.delta_replay_step_readcopy_reference`. Launches, all routed on
the device from the cursor (one captured CUDA graph serves every step):

1. :func:`~.delta_split_triton._delta_window_kernel` (shared with the exact step), grid ``(b, HV)``: the window's
   scalars and decayed vectors once per (row, value head), and ``w`` per row.
2. :func:`_delta_rc_apply_kernel`, grid ``(cdiv(V, BLOCK_V), b, HV)``, a ``K x BLOCK_V`` slice per program:

   * non-flush rows decode their slice of the *copy* (bf16; fp8 e4m3 with a scale per K-row; NVFP4 codes, e4m3
     scale per 16 values of V, fp32 scale per slot) and compute ``S'ᵀk``, ``S'ᵀq``, ``d``, ``o`` exactly as the
     exact split kernel does from the checkpoint; they append ``d``, ``k``, ``g`` and the raw ``v``, ``β``;
   * flush rows run the *exact* recurrence over the raw window on their fp32 checkpoint slice, record by record (a
     slice of ``S`` holds whole columns, so ``Sᵀk`` and the update stay inside the program), then the current
     token; they write the checkpoint (fp16: stochastic rounding, keyed as the exact kernels) and ``o``.
3. :func:`_flush_encode_rows_list_kernel`, a fixed grid walking the flush rows launch 2 listed (``BLOCK_R`` rows of
   a head per item): flush rows rewrite their copy from the stored checkpoint (whole rows of V, as the fp8 row scale
   needs): bf16, fp8 and ``nvfp4_row`` (tensor scale per row) directly; ``nvfp4`` (tensor scale per slot) reduces
   the slot's amax (atomic max), and :func:`~.mamba2_readcopy_triton._nvfp4_flush_encode_list_kernel` encodes in a
   4th launch.
4. :func:`~.mamba2_triton._advance_cursor_kernel`: ``w -> w + 1`` or 0. Launches 2 and 3 read the cursor before
   it moves.

The encoders are those of :mod:`.mamba2_readcopy_triton` (software rounding, byte-identical to
``FORMATS[fmt].encode``). Interpreter constraints as in :mod:`.delta_triton` (vector masks in loops, constexpr trip
counts). The CUDA implementation of ``replay_compile::delta_step_rc`` (tests:
``tests/kernels/delta/test_delta_readcopy_triton.py``, interpreted in CI, compiled on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .delta_split_triton import _append_key, _delta_window_kernel, _window_readout
from .host_math import cdiv, memo_unless_tuned, next_pow2
from .launch import launch
from .mamba2_readcopy_reference import as_encoded
from .mamba2_readcopy_triton import (
    FORMAT_IDS,
    _bf16_bits,
    _copy_args,
    _e2m1_value,
    _e4m3_byte,
    _format_name,
    _load_copy_rows,
    _nvfp4_encode_body,
    _nvfp4_flush_encode_list_kernel,
    hw_fp8_cast,
)
from .mamba2_triton import (
    _advance_cursor_kernel,
    _list_item,
    _list_row,
    _row_slot,
    _step_row,
    _store_checkpoint,
    fixed_grid,
)
from .tuning import Tuning

__all__ = ["delta_replay_step_readcopy_triton"]

# Launch configuration override for benchmarks and tests (``tuning.tuned``). Empty in use.
TUNING = Tuning(__name__, ("BLOCK_R", "BLOCK_V", "flush_programs", "num_warps", "window_warps"))


@triton.jit
def _load_nvfp4_cols(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_k, offs_v, mask_k, tile_mask,
                     s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp):
    """Decoded ``[BLOCK_K, BLOCK_V]`` slice of an NVFP4 copy at any V offset (byte ``v // 2``, low nibble for even
    ``v``; block scale ``v // 16``; tensor scale per slot, or per K row for ``nvfp4_row``); 0 outside
    ``tile_mask``."""
    byte = tl.load(cv_ptr + slot * s_vb + h * s_vh + offs_k[:, None] * s_vp + (offs_v // 2)[None, :] * s_vn,
                   mask=tile_mask, other=0).to(tl.int32)
    code = (byte >> ((offs_v & 1) * 4)[None, :]) & 15
    bs = tl.load(cs_ptr + slot * s_qb + h * s_qh + offs_k[:, None] * s_qp + (offs_v // 16)[None, :] * s_qn,
                 mask=tile_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sg = tl.load(ct_ptr + slot * s_tb + h * s_th + offs_k * s_tp, mask=mask_k, other=1.0)
    return tl.where(tile_mask, (_e2m1_value(code) * bs) * sg[:, None], 0.0)


@triton.jit
def _load_copy_slice(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_k, offs_v, mask_k, tile_mask,
                     s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp, FMT: tl.constexpr):
    """The decoded ``[BLOCK_K, BLOCK_V]`` slice of the copy (NVFP4 by columns, bf16 / fp8 by rows)."""
    if FMT == 2:
        s0 = _load_nvfp4_cols(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_k, offs_v, mask_k, tile_mask,
                              s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp)
    else:
        s0 = _load_copy_rows(cv_ptr, cs_ptr, slot, h, offs_k, offs_v, mask_k, tile_mask,
                             s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, FMT)
    return s0


@triton.jit
def _exact_token(s, k, dec, v, beta, KDA: tl.constexpr):
    """One exact delta-rule update of a ``[BLOCK_K, BLOCK_V]`` slice: ``S' = dec ⊙ S``, ``d = β (v − S'ᵀk)``,
    ``S' + k dᵀ``. ``dec``: a scalar (GDN) or ``[BLOCK_K]`` (KDA)."""
    if KDA:
        s = s * dec[:, None]
    else:
        s = s * dec
    d = beta * (v - tl.sum(s * k[:, None], axis=0))
    return s + k[:, None] * d[None, :]


@triton.jit
def _exact_record(s, j, w, kr_base, vr_base, br_base, gr_base, offs_k, offs_v, mask_k, mask_v, L,
                  s_krl, s_krk, s_vrl, s_vrv, s_brl, s_grl, s_grk, KDA: tl.constexpr):
    """Record ``j`` of the raw window applied exactly to the slice ``s`` (:func:`_exact_token`), or ``s`` unchanged
    for ``j >= w``."""
    jj = tl.minimum(j, L - 1)                      # in-bounds address; records j >= w are not applied
    act = (offs_k * 0 + j) < w                     # vector mask (triton 3.9's interpreter: see delta_triton)
    k_j = tl.load(kr_base + jj * s_krl + offs_k * s_krk, mask=mask_k, other=0.0).to(tl.float32)
    v_j = tl.load(vr_base + jj * s_vrl + offs_v * s_vrv, mask=mask_v, other=0.0).to(tl.float32)
    b_j = tl.load(br_base + jj * s_brl).to(tl.float32)
    if KDA:
        g_j = tl.load(gr_base + jj * s_grl + offs_k * s_grk, mask=mask_k, other=0.0).to(tl.float32)
    else:
        g_j = tl.load(gr_base + jj * s_grl).to(tl.float32)
    dec_j = tl.exp(g_j)
    return tl.where(act[:, None], _exact_token(s, k_j, dec_j, v_j, b_j, KDA), s)


@triton.jit
def _delta_rc_apply_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, vr_ptr, br_ptr, cursor_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr,
    o_ptr, win_ptr, vec_ptr, wrow_ptr, cv_ptr, cs_ptr, ct_ptr,
    HV, K, V, L, v_per_k, v_per_q,
    s_sb, s_sh, s_sk, s_sv, s_drb, s_drh, s_drl, s_drv, s_krb, s_krh, s_krl, s_krk, s_grb, s_grh, s_grl, s_grk,
    s_vrb, s_vrh, s_vrl, s_vrv, s_brb, s_brh, s_brl,
    s_qb, s_qh, s_qk, s_kb, s_kh, s_kk, s_vb, s_vh, s_vv, s_gb, s_gh, s_gk, s_bb, s_bh, s_ob, s_oh, s_ov,
    s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp,
    FMT: tl.constexpr, HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_L: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, work_ptr, FLUSH_STAGES: tl.constexpr,
):
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
    hk = h // v_per_k
    v = tl.load(v_ptr + row * s_vb + h * s_vh + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_bb + h * s_bh).to(tl.float32)
    k_cur = tl.load(k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk, mask=mask_k, other=0.0).to(tl.float32)
    w = tl.load(wrow_ptr + row)
    kr_base = kr_ptr + slot * s_krb + hk * s_krh
    gr_base = gr_ptr + slot * s_grb + h * s_grh
    vr_base = vr_ptr + slot * s_vrb + h * s_vrh
    br_base = br_ptr + slot * s_brb + h * s_brh
    if w == L - 1:
        if (pid_v == 0) & (h == 0):                # the row's first program lists it for the encode launch
            _list_row(work_ptr, row)
        # the exact recurrence from the fp32 checkpoint over the raw window, then the current token
        st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
        s = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
        # the record loop software-pipelined FLUSH_STAGES deep (the record loads are L2 round trips on the critical
        # path; the exact split flush went 570 -> 445 µs with 4 stages). The flush holds w = L - 1 <= BLOCK_L - 1
        # records: BLOCK_L - 1 iterations (a masked one still computes)
        for j in tl.range(BLOCK_L - 1, num_stages=FLUSH_STAGES):
            s = _exact_record(s, j, w, kr_base, vr_base, br_base, gr_base, offs_k, offs_v, mask_k, mask_v, L,
                              s_krl, s_krk, s_vrl, s_vrv, s_brl, s_grl, s_grk, KDA)
        if KDA:
            g_cur = tl.load(g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, mask=mask_k, other=0.0).to(tl.float32)
        else:
            g_cur = tl.load(g_ptr + row * s_gb + h * s_gh).to(tl.float32)
        s = _exact_token(s, k_cur, tl.exp(g_cur), v, beta, KDA)
        q = tl.load(q_ptr + row * s_qb + (h // v_per_q) * s_qh + offs_k * s_qk, mask=mask_k, other=0.0)
        tl.store(o_ptrs, tl.sum(s * q.to(tl.float32)[:, None], axis=0), mask=mask_v)
        key_gate = tl.load(g_ptr + row * s_gb + h * s_gh).to(tl.float32)    # g (GDN) or g[..., 0] (KDA)
        _store_checkpoint(st_ptrs, s, tile_mask, key_gate, slot * HV + h, offs_k[:, None] * V + offs_v[None, :],
                          STOCHASTIC_FP16)
    else:
        s0 = _load_copy_slice(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_k, offs_v, mask_k, tile_mask,
                              s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp, FMT)
        dr_base = dr_ptr + slot * s_drb + h * s_drh
        d, o = _window_readout(s0, v, beta, w, win_ptr, vec_ptr, row * HV + h, dr_base, offs_l, offs_k, offs_v,
                               mask_v, s_drl, s_drv, BLOCK_L, BLOCK_K)
        tl.store(o_ptrs, o, mask=mask_v)
        tl.store(dr_base + w * s_drl + offs_v * s_drv, d.to(dr_ptr.dtype.element_ty), mask=mask_v)
        tl.store(vr_base + w * s_vrl + offs_v * s_vrv, v.to(vr_ptr.dtype.element_ty), mask=mask_v)
        if pid_v == 0:
            tl.store(br_base + w * s_brl, beta)
            _append_key(k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk, kr_base, w, h, v_per_k, offs_k, mask_k,
                        s_krl, s_krk)


@triton.jit
def _encode_rows_body(
    pid_r, row, h, slot, state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, K, V,
    s_sb, s_sh, s_sk, s_sv, s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp,
    FMT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, HW_E4M3: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """Rewrite ``BLOCK_R`` rows of a flushed slot's copy from the stored checkpoint (bf16, fp8 with its row scale,
    ``nvfp4_row`` with its row scales: :func:`~.mamba2_readcopy_triton._nvfp4_encode_body`), or, for ``nvfp4``,
    fold their amax into the slot's (the 4th launch encodes). No early returns (called in a loop)."""
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_V)
    mask_r = offs_r < K
    tile_mask = mask_r[:, None] & (offs_v < V)[None, :]
    x = tl.load(state_ptr + slot * s_sb + h * s_sh + offs_r[:, None] * s_sk + offs_v[None, :] * s_sv,
                mask=tile_mask, other=0.0).to(tl.float32)
    c_ptrs = cv_ptr + slot * s_cvb + h * s_cvh + offs_r[:, None] * s_cvp + offs_v[None, :] * s_cvn
    if FMT == 0:
        tl.store(c_ptrs, _bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=tile_mask)
    elif FMT == 1:
        scale = tl.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
        scale = tl.where(scale > 0.0, scale, 1.0)                      # zero rows: scale 1, zeros stored
        qv = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -448.0), 448.0)
        tl.store(c_ptrs, _e4m3_byte(qv, HW_E4M3), mask=tile_mask)
        tl.store(cs_ptr + slot * s_csb + h * s_csh + offs_r * s_csp, scale, mask=mask_r)
    elif ROW_SCALE:         # reloads the rows in the encoder's layout (x above is then dead: the compiler drops it)
        _nvfp4_encode_body(pid_r, row, h, slot, state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr,
                           K, V, s_sb, s_sh, s_sk, s_sv, s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp,
                           s_csn, s_ctb, s_cth, s_ctp, BLOCK_R, BLOCK_V // 16, True)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr + row, amax.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _flush_encode_rows_list_kernel(
    state_ptr, slot_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, work_ptr, HV, n_rb, K, V,
    s_sb, s_sh, s_sk, s_sv, s_cvb, s_cvh, s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp,
    FMT: tl.constexpr, HAS_SLOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    HW_E4M3: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """:func:`_encode_rows_body` over the rows the apply launch listed, on a fixed grid (a non-flush step then costs
    a few programs reading ``count = 0``, not a ``(K / BLOCK_R, b, HV)`` grid reading cursors: H200 bs256, the encode
    launch 40.5 -> 3.7 µs on non-flush steps, 170 -> 200 µs on the flush step)."""
    n_items = tl.load(work_ptr) * (HV * n_rb)
    t = tl.program_id(0)
    while t < n_items:
        row, h, tile = _list_item(work_ptr, t, HV, n_rb)
        _encode_rows_body(tile, row, h, _row_slot(slot_ptr, row, HAS_SLOT),
                          state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, K, V, s_sb, s_sh, s_sk, s_sv, s_cvb, s_cvh,
                          s_cvp, s_cvn, s_csb, s_csh, s_csp, s_csn, s_ctb, s_cth, s_ctp, FMT, BLOCK_R, BLOCK_V,
                          HW_E4M3, ROW_SCALE)
        t += tl.num_programs(0)


@memo_unless_tuned(TUNING)
def launch_config(K: int, V: int, L: int) -> dict:
    """``BLOCK_V`` 32 and 1 warp (H200), ``BLOCK_R`` rows per encode program."""
    return dict(BLOCK_K=max(16, next_pow2(K)), BLOCK_L=max(16, next_pow2(L)),
                # 32 columns on 1 warp (H200, Qwen3.5-4B bs256 fp8: the apply launch 177 -> 140 µs on
                # non-flush steps, 1179 -> 1059 on the flush; 32 on 2 warps lost: 239 / 1485)
                BLOCK_V=TUNING.get("BLOCK_V") or (32 if V > 16 else 16), num_warps=TUNING.get("num_warps") or 1,
                # the window launch on 1 warp (the exact step's H200 choice: 1 warp beat 4 on its [16, 128] tiles)
                window_warps=TUNING.get("window_warps") or 1,
                BLOCK_R=TUNING.get("BLOCK_R") or 16, BLOCK_VF=max(16, next_pow2(V)),
                flush_programs=TUNING.get("flush_programs"),         # the encode launches' grid; default 32 per SM
                # the flush's record loop pipelined 4 deep (H200, bs256 fp8: the flush apply 1061 -> 696 µs
                # for GDN, 1185 -> 752 for KDA; 2 stages: 703 / 758)
                # (loading the copy slice before the cursor branch was tried and removed, same conditions: GDN apply
                # 136.9 -> 136.0 µs, KDA 143.2 -> 146.9, KDA flush apply 751 -> 814)
                flush_stages=4)


def delta_replay_step_readcopy_triton(state, copy, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor,
                                      q, k, v, g, beta, slot_idx=None):
    """Triton implementation of :func:`delta_replay_step_readcopy_reference` (same arguments and contract)."""
    name = _format_name(fmt)
    S, HV, K, V = state.shape
    enc = as_encoded(copy, name, state.shape)
    b = v.shape[0]
    L = d_ring.shape[2]
    kda = g_ring.dim() == 4
    o = torch.empty((b, HV, V), dtype=torch.float32, device=v.device)
    if b == 0:
        return o
    if FORMAT_IDS[name] == 2 and V % 16:
        raise ValueError(f"replay_compile.delta read copy: {name} needs V % 16 == 0 (whole scale blocks), got V={V}")
    cfg = launch_config(K, V, L)
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else cursor
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    v_per_k, v_per_q = HV // k_ring.shape[1], HV // q.shape[1]
    win = torch.empty((b, HV, 3 * cfg["BLOCK_L"]), dtype=torch.float32, device=v.device)
    vec = torch.empty((b, HV, 3 * cfg["BLOCK_K"]), dtype=torch.float32, device=v.device)
    ke = torch.empty((b, HV, cfg["BLOCK_L"] * cfg["BLOCK_K"]), dtype=torch.float32, device=v.device)
    wrow = torch.empty((b,), dtype=cursor.dtype, device=v.device)
    common = dict(HAS_SLOT=has_slot, KDA=kda, BLOCK_K=cfg["BLOCK_K"], BLOCK_L=cfg["BLOCK_L"])
    launch(_delta_window_kernel)[(b, HV)](
        cursor, k_ring, g_ring, q, k, g, slot_arg, win, vec, ke, wrow, K, L, v_per_k, v_per_q,
        *k_ring.stride(), *g_strides, *q.stride(), *k.stride(), *gi_strides, SCRATCH_EVICT="",
        num_warps=cfg["window_warps"], **common)
    (cv, cs, ct), cstrides = _copy_args(enc, name, cursor)
    n_vb = cdiv(V, cfg["BLOCK_V"])
    work = torch.zeros((b + 1,), dtype=torch.int32, device=v.device)    # flush rows listed for the encode launches
    launch(_delta_rc_apply_kernel)[(n_vb, b, HV)](
        state, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor, q, k, v, g, beta, slot_arg, o, win, vec, wrow,
        cv, cs, ct, HV, K, V, L, v_per_k, v_per_q,
        *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides, *v_ring.stride(), *beta_ring.stride(),
        *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(), *cstrides,
        FMT=FORMAT_IDS[name], BLOCK_V=cfg["BLOCK_V"], STOCHASTIC_FP16=state.dtype == torch.float16,
        num_warps=cfg["num_warps"], work_ptr=work, FLUSH_STAGES=cfg["flush_stages"], **common)
    amax = torch.zeros(b, dtype=torch.int32, device=v.device) if name == "nvfp4" else cursor
    n_rb = cdiv(K, cfg["BLOCK_R"])
    # fp8 encode by the hardware conversion where compiled for sm_89+ (mamba2_readcopy_triton._e4m3_byte). H200,
    # bs256 fp8: the flush's encode launch 200.5 -> 180.7 µs (GDN), 200.4 -> 181.2 (KDA)
    enc_kw = dict(FMT=FORMAT_IDS[name], HAS_SLOT=has_slot, BLOCK_R=cfg["BLOCK_R"], BLOCK_V=cfg["BLOCK_VF"],
                  HW_E4M3=hw_fp8_cast(v.device), ROW_SCALE=name == "nvfp4_row")
    programs = cfg["flush_programs"] or fixed_grid(b * HV * n_rb, 1, v.device, 32)
    launch(_flush_encode_rows_list_kernel)[(programs,)](
        state, slot_arg, amax, cv, cs, ct, work, HV, n_rb, K, V, *state.stride(), *cstrides, **enc_kw)
    if name == "nvfp4":
        launch(_nvfp4_flush_encode_list_kernel)[(programs,)](
            state, cursor, slot_arg, amax, cv, cs, ct, work, HV, n_rb, K, V, L, *state.stride(), *cstrides,
            HAS_SLOT=has_slot, BLOCK_P=cfg["BLOCK_R"], NB=cfg["BLOCK_VF"] // 16, ENC_WORDS=False)
    launch(_advance_cursor_kernel)[(cdiv(b, 1024),)](cursor, slot_arg, b, L, HAS_SLOT=has_slot, BLOCK=1024)
    return o
