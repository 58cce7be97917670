"""Triton kernel of the Mamba-2 ReplaySSM step with a low-precision read copy.

Same signature and in-place contract as
:func:`~replay_compile.kernels.mamba2_readcopy_reference.replay_step_readcopy_reference`: non-flush rows compute the
checkpoint term from the read copy, decoded in registers, and never touch the fp32 ``state``; flush rows fold from the
fp32 ``state``, write it, and rewrite their slot of the copy. Formats: ``"bf16"``, ``"fp8_e4m3"``, ``"nvfp4"``,
``"nvfp4_row"`` as defined (bit for bit) by :mod:`replay_compile.quant.formats`.

Shapes and layouts (``S`` slots, ``b`` rows, ``L`` ring length)::

    state   [S, H, P, N]  checkpoint, fp32 (bf16 / fp16 accepted: the copy encodes the value as stored)
    x_ring  [S, H, L, P]; dt_ring, la_ring [S, H, L]; B_ring [S, G, L, N]; cursor [S] int32
    x [b, H, P]; dt, la [b, H]; B [b, G, N]; C [b, Gc, N]; slot_idx [b] (negative: padding) or None
    copy    bf16:     values [S, H, P, N] bfloat16
            fp8_e4m3: values [S, H, P, N] float8_e4m3fn, scale [S, H, P] fp32 (amax over N / 448)
            nvfp4:    codes [S, H, P, ceil(N/2)] uint8 (low nibble = even column), block_scale [S, H, P, ceil(N/16)]
                      float8_e4m3fn (one per 16 values of N), tensor_scale [S] fp32 (one per slot)
            nvfp4_row: the same with tensor_scale [S, H, P] (one per row)

Bytes one non-flush step reads per (slot, head) for the checkpoint term (rings, x, B, C, y not counted):

    fp32 state   P*N*4
    bf16 copy    P*N*2
    fp8 copy     P*N + P*4                    (values + per-row scales)
    nvfp4 copy   P*N/2 + P*N/16 + 4           (codes + block scales + the slot's tensor scale; N % 16 == 0)

At Nemotron-Super geometry (P = 64, N = 128): 32768 / 16384 / 8448 / 4612 bytes: 3.9x (fp8) and 7.1x (nvfp4) fewer.

Design
------
The ``pre`` variant of :mod:`.mamba2_pre_triton`, each launch routed on the device from the cursor: its window launch
(per-record weights, the records, the flush rows listed in ``work = [count, rows...]``); a copy pass over the
non-flush rows, grid ``(cdiv(P, APPLY_P), batch, H)``, a program holding all of N in one ``BLOCK_P x BLOCK_N`` tile
(``BLOCK_N = next_pow2(N)``, >= 16: nvfp4's blocks of 16 need the tile aligned to them); a flush launch on a fixed
grid walking the listed rows; the cursor advance. Everything is computed in fp32.

* Non-flush programs load the copy tile and decode in registers exactly as ``FORMATS[fmt].decode`` does (bit for bit;
  tested through :func:`decode_read_copy_triton`, which runs the same decode helpers):

  - bf16: ``values.to(fp32)``;
  - fp8: the e4m3 bytes, bitcast to ``float8e4nv``, ``.to(fp32) * row_scale``;
  - nvfp4: a ``[BLOCK_P, BLOCK_N/16, 8]`` tile of code bytes (block, byte within the block), so that each block's
    e4m3 scale broadcasts over the last axis and no shuffle is needed: the low nibble decodes the even column,
    the high nibble the odd one, and ``S_0 C`` is summed as ``Σ even * C[0::2] + Σ odd * C[1::2]``. The e2m1
    magnitude ``m`` (3 bits) decodes arithmetically: ``m / 2`` for ``m < 4``, else ``(2 if m < 6 else 4) *
    (1 + (m & 1) / 2)`` (= 0, .5, 1, 1.5, 2, 3, 4, 6); bit 3 is the sign; then ``(e2m1 * block_scale) *
    tensor_scale`` in fp32, the formats' order (the first product is exact). Where N % 8 == 0 the copy pass instead
    reads int32 words of 8 codes whose codes become fp16 bits equal to ``e2m1 / 2^14``, two per ``lop3``
    (:func:`_nvfp4_pairs_dot`): per copy pass at Super bs256 on the H200, 357 µs byte by byte, 94 with the pairs.

* Flush programs fold the fp32 state tile (``tl.dot``, IEEE fp32), write it, read ``y`` out of the folded tile, and
  encode the copy of the value *as stored*:

  - bf16, fp8 and ``nvfp4_row`` in the same program (``FLUSH_P`` rows of whole N): every scale is per row and the
    program holds whole rows, as the fp8 row scale needs (``nvfp4_row`` stores the tile, ``tl.debug_barrier()``, and
    re-reads it from L2 in the encoder's 3-D layout);
  - nvfp4: the per-slot tensor scale needs the amax of the whole slot ``[H, P, N]``, and no whole rows: the listed
    rows are folded by the fp32 step's fold on its own tiles (:func:`_nvfp4_fold_list_kernel`), which
    ``atomic_max`` each folded row's amax (fp32 bits of a non-negative value, as int32: same order) into a per-row
    int32 scratch zeroed by the launcher and advance the cursors; a listed encode launch
    (:func:`_nvfp4_flush_encode_list_kernel`) then reads the slot amax, reloads the just-written fp32 tile
    (``P*N*4`` extra bytes per flushing slot and head, once per ``L`` steps) and writes codes (int32 words of 8
    codes where N % 8 == 0, :func:`_nvfp4_encode_words_body`), block scales and (one program per slot) the tensor
    scale: the flush step 1817 -> 1162 µs at Super bs256 (H200).

  All encoders round in software (integer ops on the fp32 bits), the same code compiled and interpreted, and
  reproduce ``FORMATS[fmt].encode`` bit for bit: fp32 -> bf16 and fp32 -> e4m3 by round-to-nearest-even on the bit
  pattern (e4m3 subnormals, multiples of 2^-9, by the ``+ 2^23 - 2^23`` trick), e2m1 by one half-even rounding on
  the grid's spacing (ties to the even code), quotients with ``tl.div_rn`` (IEEE division, as torch; nvfp4 values
  are multiplied by the block's reciprocal, as the format defines). Software, not
  ``.to(tl.float8e4nv)``: triton 3.6's interpreter rounds fp32 -> fp8 half-up and mishandles mantissa carries and
  subnormals (351 of 4096 random values differ from torch), and the flush is rare enough that a few integer ops
  cost nothing; compiled for sm_89+ the fp8 flush uses the hardware conversion (:func:`_e4m3_byte`).

Interpreter constraints kept (see :mod:`.mamba2_triton`): no runtime loop bounds (there are no loops here), no
Python globals other than ``tl.constexpr`` and jit functions inside ``@triton.jit``, no autotuning (in-place writes).
No ``tl.join`` / ``tl.interleave`` / ``tl.split`` / ``tl.reshape`` either: the nvfp4 paths use 3-D tiles instead.

Status: registered as the CUDA implementation of ``replay_compile::mamba2_step_rc`` (the pass inserts it with
``read_copy``); compiled and run on the H200. Over ``selective_state_update`` at batch 256
(docs/design/read_copies.md): bf16 3.22x, fp8 3.45x, NVFP4 4.00x. Not done: a small-batch variant (below batch 8 the
read copies lose to the exact step), N-tiling.
Portability notes (all held on the H200):

* ``float8e4nv`` (bitcast from uint8, then ``.to(fp32)``) needs sm_89+ (Ada / Hopper); on sm_80 Triton refuses the
  type. Software decode would lift that if it matters.
* 3-D tiles ``[BLOCK_P, BLOCK_N/16, 8]`` with reductions over the last axes, and ``tl.arange(0, 1)`` when N <= 16.
* ``tl.div_rn`` (``div.rn.f32``) and the ``(t + 2^23) - 2^23`` rounding rely on no reassociation (Triton enables
  only FMA contraction, which leaves every rounding here unchanged: no encoded or decoded value is formed by an
  add of two products).
* ``tl.atomic_max`` on int32 with ``sem="relaxed"``; the scratch ``torch.zeros(b)`` is one more allocation and
  memset per nvfp4 step (fine in a CUDA graph).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..quant.formats import Encoded, get_format
from .host_math import cdiv, memo_unless_tuned, next_pow2
from .launch import interpreting, launch
from .mamba2_pre_triton import _cb_window, _walk_listed_folds, _x_slice, launch_window
from .mamba2_readcopy_reference import as_encoded
from .mamba2_triton import (
    _advance_cursor_kernel,
    _list_item,
    _round_checkpoint,
    _row_slot,
    _step_row,
    _step_window,
    fixed_grid,
    fold_tile_shape,
)
from .tuning import Tuning, parse_tuning

__all__ = ["FORMAT_IDS", "TUNING", "decode_read_copy_triton", "launch_config", "replay_step_readcopy_triton",
           "tuned"]

#: Format name -> the kernels' ``FMT`` constexpr.
FORMAT_IDS = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2, "nvfp4_row": 2}     # nvfp4_row: FMT 2 with ROW_SCALE

# Launch configuration override for tests and benchmarks (:func:`tuned`). Empty in use.
TUNING = Tuning(__name__, ("APPLY_P", "BLOCK_P", "FLUSH_P", "apply_warps", "enc_per_sm", "enc_warps",
                           "flush_programs", "flush_warps", "fold_warps", "num_warps"))

# The last compiled step kernel launched (benchmarks print its registers / spills / shared memory).
LAST_LAUNCH: dict = {}


# ----------------------------------------------------------------------------------------------------------------
# Software rounding and the format codecs (jit helpers)
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _bf16_bits(v):
    """fp32 -> bfloat16 bit pattern (in a uint32), round to nearest even (finite input)."""
    b = v.to(tl.uint32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@triton.jit
def _e4m3_code(a):
    """Magnitude ``0 <= a <= 448`` (fp32) -> e4m3fn code 0..126 (uint32), round to nearest even, subnormals too."""
    b = a.to(tl.uint32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960     # (exp32 << 3 | 3 mantissa bits), exponent 127 -> 7
    t = a * 512.0                                               # subnormal range: multiples of 2^-9, exact scaling
    sub = ((t + 8388608.0) - 8388608.0).to(tl.uint32)          # round to an integer, ties to even (0..8; 8 = 2^-6)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _e4m3_value(code):
    """e4m3fn code 0..126 (uint32, sign clear) -> fp32 value (exact)."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e4m3_encode(v):
    """fp32 ``|v| <= 448`` -> e4m3fn byte (uint32 0..255, sign in bit 7; -0 and negatives that round to 0 give 0x80,
    as torch's cast)."""
    return _e4m3_code(tl.abs(v)) | ((v.to(tl.uint32, bitcast=True) >> 31) << 7)


@triton.jit
def _e4m3_byte(v, HW: tl.constexpr):
    """fp32 ``|v| <= 448`` -> e4m3fn byte (uint8), round to nearest even, as torch's cast. ``HW``: the hardware
    conversion (``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+; a few instructions per pair instead of ~15 integer ops
    per value); else :func:`_e4m3_encode` (the interpreter's own fp8 cast rounds wrongly, see the module notes)."""
    if HW:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return _e4m3_encode(v).to(tl.uint8)


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 code 0..15 (uint32): nearest, ties to the even code, saturating at 6; bit 3 = signbit(y).

    One rounding on the grid's spacing instead of seven comparisons: ``a = min(|y|, 6)`` times ``2`` on ``[0, 2)``,
    ``1`` on ``[2, 4)``, ``1/2`` on ``[4, 6]`` (exact), rounded half-even to an integer ``q`` by ``+ 2^23`` (its low
    bits), plus the code of the segment's start: ``q`` (0..4), ``q + 2`` (2..4 -> 4..6), ``q + 4`` (2..3 -> 6..7).
    A tie of the grid is a tie of the scaled value, so ties go to the even code as before."""
    a = tl.minimum(tl.abs(y), 6.0)
    low = a < 2.0
    mid = a < 4.0
    t = a * tl.where(low, 2.0, tl.where(mid, 1.0, 0.5))
    q = (t + 8388608.0).to(tl.uint32, bitcast=True) & 7
    mag = q + tl.where(low, 0, tl.where(mid, 2, 4)).to(tl.uint32)
    return mag | ((y.to(tl.uint32, bitcast=True) >> 31) << 3)


@triton.jit
def _e2m1_value(code):
    """e2m1 code 0..15 (int32) -> fp32: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign (code 8 = -0)."""
    m = code & 7
    hi = tl.where(m < 6, 2.0, 4.0) * (1.0 + (m & 1).to(tl.float32) * 0.5)
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5, hi)
    # the sign as a bit (``-mag`` is ``0 - mag`` in Triton: +0 for code 8, where the format decodes -0)
    return (mag.to(tl.uint32, bitcast=True) | ((code & 8).to(tl.uint32) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _load_copy_rows(cv_ptr, cs_ptr, slot, h, offs_p, offs_n, mask_p, tile_mask,
                    s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, FMT: tl.constexpr):
    """Decoded ``[BLOCK_P, BLOCK_N]`` tile of a bf16 (FMT 0) or fp8 (FMT 1) copy; 0 outside ``tile_mask``."""
    v_ptrs = cv_ptr + slot * s_vb + h * s_vh + offs_p[:, None] * s_vp + offs_n[None, :] * s_vn
    if FMT == 0:
        out = tl.load(v_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        q = tl.load(v_ptrs, mask=tile_mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(cs_ptr + slot * s_qb + h * s_qh + offs_p * s_qp, mask=mask_p, other=1.0)
        out = q * scale[:, None]
    return out


@triton.jit
def _nvfp4_offsets(offs_p, NB: tl.constexpr):
    """3-D index tiles of a row block: p [BP, 1, 1], block [1, NB, 1], byte within the block k [1, 1, 8];
    even column = 16 block + 2 k, byte = 8 block + k."""
    p3 = offs_p[:, None, None]
    blk = tl.arange(0, NB)[None, :, None]
    k = tl.arange(0, 8)[None, None, :]
    return p3, blk, k


@triton.jit
def _load_nvfp4(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_p, P, N,
                s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, NB: tl.constexpr):
    """Decoded nvfp4 tile as (even columns, odd columns), each ``[BLOCK_P, NB, 8]``; 0 outside the state."""
    p3, blk, k = _nvfp4_offsets(offs_p, NB)
    col_e = blk * 16 + 2 * k
    m_e = (p3 < P) & (col_e < N)
    m_o = (p3 < P) & (col_e + 1 < N)
    byte = tl.load(cv_ptr + slot * s_vb + h * s_vh + p3 * s_vp + (blk * 8 + k) * s_vn, mask=m_e, other=0)
    byte = byte.to(tl.int32)
    offs_b = tl.arange(0, NB)
    bmask = (offs_p[:, None] < P) & (offs_b[None, :] * 16 < N)
    bs = tl.load(cs_ptr + slot * s_qb + h * s_qh + offs_p[:, None] * s_qp + offs_b[None, :] * s_qn, mask=bmask,
                 other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)        # [BLOCK_P, NB]
    sg = tl.load(ct_ptr + slot * s_tb + h * s_th + offs_p * s_tp, mask=offs_p < P, other=1.0)[:, None, None]
    bs3 = bs[:, :, None]
    even = tl.where(m_e, (_e2m1_value(byte & 15) * bs3) * sg, 0.0)
    odd = tl.where(m_o, (_e2m1_value(byte >> 4) * bs3) * sg, 0.0)
    return even, odd


@triton.jit
def _half_pair(t):
    """fp16 bit patterns ``(low half, high half)`` of the int32 ``t``'s nibbles 3 and 7 (bits 12-15 and 28-31):
    each ``s ee m`` placed at fp16 bits 15 and 9-11 is ``e2m1 / 2^14`` exactly (subnormal for ``ee = 0``). Two codes
    per ``(t & M1) | ((t >> 3) & M2)`` (one ``lop3`` after the shift)."""
    u = t.to(tl.uint32, bitcast=True)
    h2 = (u & 0x80008000) | ((u >> 3) & 0x0E000E00)
    lo = (h2 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (h2 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _nvfp4_pairs_dot(cw_ptr, cs_ptr, ct_ptr, c_base, s_cn, slot, h, offs_p, P, N,
                     s_wb, s_wh, s_wp, s_wn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, NW: tl.constexpr):
    """``Σ_n S[p, n] c[n]`` for the nvfp4 copy of rows ``offs_p`` [BLOCK_P], the codes read as int32 words (8
    codes each, code ``j`` of a word in bits ``4j..4j+3``: little-endian bytes, low nibble first); needs N % 8 == 0.

    Fewer instructions per value than :func:`_load_nvfp4` (the non-flush NVFP4 step is ALU-bound there, 362 µs at
    Super bs256 vs 135 for fp8): per word and shift, :func:`_half_pair` gives the fp16 ``e2m1 / 2^14`` of two codes
    for one ``lop3`` and a shift, each converted and multiplied by its ``C`` column in fp32. Per-word sums times the
    word's block scale (word ``i`` is in block ``i // 2``), then ``2^14`` and the tensor scale, once per row. Same
    value as decoding first, summed in another order (fp32 rounding only)."""
    offs_w = tl.arange(0, NW)
    words = tl.load(cw_ptr + slot * s_wb + h * s_wh + offs_p[:, None] * s_wp + offs_w[None, :] * s_wn,
                    mask=(offs_p < P)[:, None] & (offs_w < N // 8)[None, :], other=0)           # [BLOCK_P, NW]
    acc = tl.zeros(words.shape, dtype=tl.float32)
    for sh in tl.static_range(4):
        a_lo, a_hi = _half_pair(words << (4 * sh))  # codes 3 - sh and 7 - sh of every word
        c_lo = tl.load(c_base + (offs_w * 8 + 3 - sh) * s_cn, mask=offs_w * 8 < N, other=0.0).to(tl.float32)
        c_hi = tl.load(c_base + (offs_w * 8 + 7 - sh) * s_cn, mask=offs_w * 8 < N, other=0.0).to(tl.float32)
        acc += a_lo.to(tl.float32) * c_lo[None, :] + a_hi.to(tl.float32) * c_hi[None, :]
    bsw = tl.load(cs_ptr + slot * s_qb + h * s_qh + offs_p[:, None] * s_qp + (offs_w // 2)[None, :] * s_qn,
                  mask=(offs_p[:, None] < P) & (offs_w[None, :] * 8 < N),
                  other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)            # [BLOCK_P, NW]
    sg = tl.load(ct_ptr + slot * s_tb + h * s_th + offs_p * s_tp, mask=offs_p < P, other=1.0)
    return tl.sum(acc * bsw, axis=1) * (sg * 16384.0)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _rc_body(
    pid_p, row, h, slot, w,
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr,
    cv_ptr, cs_ptr, ct_ptr, amax_ptr,       # copy: values/codes, row scale/block scale, tensor scale; amax scratch
    H, P, N, L, heads_per_g, heads_per_gc,
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
    s_vb, s_vh, s_vp, s_vn,                 # copy values [S, H, P, N] / nvfp4 codes [S, H, P, ceil(N/2)]
    s_qb, s_qh, s_qp, s_qn,                 # fp8 scale [S, H, P] (s_qn unused) / nvfp4 block_scale [S, H, P, NB]
    s_tb, s_th, s_tp,                       # nvfp4 tensor_scale [S] (0, 0) / nvfp4_row [S, H, P]
    FMT: tl.constexpr, HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, HW_E4M3: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """The flush of one ``BLOCK_P``-row slice of a listed row (cursor ``w = L - 1``) for bf16, fp8 and
    ``nvfp4_row``: fold the fp32 checkpoint (one IEEE ``tl.dot``), write it, ``y = S_new C``, rewrite the copy from the
    stored value. No early returns: the flush-list kernel calls it inside a loop. (Per-slot ``nvfp4`` is folded by
    :func:`_nvfp4_fold_list_kernel` instead.)"""
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    g = h // heads_per_g
    gc = h // heads_per_gc
    offs_l = tl.arange(0, BLOCK_L)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    tile_mask = mask_p[:, None] & mask_n[None, :]
    hist = offs_l < w
    cur = offs_l == w

    la_cur, dt_cur, x_cur, coef, decay, xw = _step_window(
        lar_ptr, dtr_ptr, xr_ptr, la_ptr, dt_ptr, x_ptr, slot, row, h, w, offs_l, offs_p, mask_p,
        s_lrb, s_lrh, s_lrl, s_drb, s_drh, s_drl, s_xrb, s_xrh, s_xrl, s_xrp, s_lb, s_lh, s_db, s_dh, s_xb, s_xh, s_xp)
    br_base = Br_ptr + slot * s_brb + g * s_brg
    b_cur = tl.load(B_ptr + row * s_bb + g * s_bg + offs_n * s_bn, mask=mask_n, other=0.0)
    bw = tl.load(br_base + offs_l[:, None] * s_brl + offs_n[None, :] * s_brn,
                 mask=hist[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    bw = tl.where(cur[:, None], b_cur.to(tl.float32)[None, :], bw)
    c_base = C_ptr + row * s_cb + gc * s_cg
    c = tl.load(c_base + offs_n * s_cn, mask=mask_n, other=0.0).to(tl.float32)

    if w == L - 1:
        # fold the fp32 checkpoint, write it, y = S_new C, rewrite the copy from the stored value
        s_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
        s0 = tl.load(s_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
        s_new = decay * s0 + tl.dot(tl.trans(xw * coef[:, None]), bw, input_precision="ieee")
        s_st = _round_checkpoint(s_new, s_ptrs, la_cur, slot * H + h, offs_p[:, None] * N + offs_n[None, :],
                                 STOCHASTIC_FP16)
        tl.store(s_ptrs, s_st, mask=tile_mask)
        tl.store(y_ptrs, tl.sum(s_new * c[None, :], axis=1), mask=mask_p)
        v = tl.where(tile_mask, s_st.to(tl.float32), 0.0)
        v_ptrs = cv_ptr + slot * s_vb + h * s_vh + offs_p[:, None] * s_vp + offs_n[None, :] * s_vn
        if FMT == 0:
            tl.store(v_ptrs, _bf16_bits(v).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=tile_mask)
        elif FMT == 1:
            scale = tl.div_rn(tl.max(tl.abs(v), axis=1), 448.0)
            scale = tl.where(scale > 0.0, scale, 1.0)                      # zero rows: scale 1, zeros stored
            q = tl.minimum(tl.maximum(tl.div_rn(v, scale[:, None]), -448.0), 448.0)
            tl.store(v_ptrs, _e4m3_byte(q, HW_E4M3), mask=tile_mask)
            tl.store(cs_ptr + slot * s_qb + h * s_qh + offs_p * s_qp, scale, mask=mask_p)
        else:
            # nvfp4_row (ROW_SCALE): every scale is per row and this program holds whole rows: encode them here,
            # from the values just stored (read back in the encoder's 3-D layout; the barrier makes every thread's
            # stores visible to the others)
            tl.debug_barrier()
            _nvfp4_encode_body(pid_p, row, h, slot, state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr,
                               P, N, s_sb, s_sh, s_sp, s_sn, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn,
                               s_tb, s_th, s_tp, BLOCK_P, BLOCK_N // 16, ROW_SCALE)


@triton.jit
def _readcopy_flush_list_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr,
    cv_ptr, cs_ptr, ct_ptr, amax_ptr,       # copy: values/codes, row scale/block scale, tensor scale; amax scratch
    work_ptr, n_pb,                         # [count, rows...] from the window launch; P blocks per head
    H, P, N, L, heads_per_g, heads_per_gc,
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
    s_vb, s_vh, s_vp, s_vn,                 # copy values [S, H, P, N] / nvfp4 codes [S, H, P, ceil(N/2)]
    s_qb, s_qh, s_qp, s_qn,                 # fp8 scale [S, H, P] (s_qn unused) / nvfp4 block_scale [S, H, P, NB]
    s_tb, s_th, s_tp,                       # nvfp4 tensor_scale [S] (0, 0) / nvfp4_row [S, H, P]
    FMT: tl.constexpr, HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, HW_E4M3: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """Read-copy flush launch on a fixed grid: walks the ``count x H x n_pb`` tiles of the rows the window launch
    listed in ``work = [count, rows...]`` (:func:`_rc_body` per tile; as
    :func:`~.mamba2_pre_triton._mamba2_flush_list_kernel`: a non-flush step then costs a few programs that read
    ``count = 0``, not a full grid that reads cursors)."""
    n_items = tl.load(work_ptr) * (H * n_pb)
    t = tl.program_id(0)
    while t < n_items:
        row, h, tile = _list_item(work_ptr, t, H, n_pb)
        _rc_body(tile, row, h, _row_slot(slot_ptr, row, HAS_SLOT), L - 1,         # listed: a flush row
                 state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr,
                 slot_ptr, y_ptr, cv_ptr, cs_ptr, ct_ptr, amax_ptr, H, P, N, L, heads_per_g, heads_per_gc, s_sb,
                 s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl, s_brb,
                 s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn,
                 s_yb, s_yh, s_yp, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, FMT, HAS_SLOT,
                 BLOCK_P, BLOCK_N, BLOCK_L, STOCHASTIC_FP16, HW_E4M3, ROW_SCALE)
        t += tl.num_programs(0)


@triton.jit
def _nvfp4_fold_list_kernel(
    state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr,
    x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr, slot_ptr, y_ptr, work_ptr, amax_ptr,
    H, P, N, L, heads_per_g, heads_per_gc, n_pb,
    s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
    s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
    s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    N_TILES: tl.constexpr, STOCHASTIC_FP16: tl.constexpr, n_rows,
):
    """nvfp4's flush: the fp32 step's listed fold
    (:func:`~replay_compile.kernels.mamba2_pre_triton._mamba2_flush_list_kernel`, a fixed grid walking the
    ``count x H x n_pb`` tiles of the listed rows) whose folds also gather each row's amax into ``amax_ptr``, one
    atomic per folded row (``AMAX``, :func:`~replay_compile.kernels.mamba2_triton._fold_tile`), and the cursor
    advance. A per-slot tensor scale needs no whole rows in a flush program, so the fp32 step's tiles and warps
    serve; the copy is encoded by the next launch from the stored checkpoint."""
    _walk_listed_folds(state_ptr, xr_ptr, dtr_ptr, lar_ptr, Br_ptr, cursor_ptr, x_ptr, dt_ptr, la_ptr, B_ptr, C_ptr,
                       slot_ptr, y_ptr, work_ptr, amax_ptr, H, P, N, L, heads_per_g, heads_per_gc, n_pb,
                       s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_drb, s_drh, s_drl, s_lrb, s_lrh, s_lrl,
                       s_brb, s_brg, s_brl, s_brn, s_xb, s_xh, s_xp, s_db, s_dh, s_lb, s_lh, s_bb, s_bg, s_bn,
                       s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
                       HAS_SLOT, BLOCK_P, BLOCK_N, BLOCK_L, N_TILES, STOCHASTIC_FP16, n_rows, True)


@triton.jit
def _copy_dot(cv_ptr, cs_ptr, ct_ptr, c_base, c, s_cn, slot, h, offs_p, mask_p, P, N,
              s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
              FMT: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr):
    """``S_copy C`` [BLOCK_P] for rows ``offs_p`` of the copy of (slot, head ``h``): nvfp4 as int32 words decoded two
    codes at a time (``PAIRS``, :func:`_nvfp4_pairs_dot`: N % 8 == 0 and codes that can be viewed as words) or byte by
    byte (:func:`_load_nvfp4`), each reading ``C`` in its own layout from ``c_base``; bf16 / fp8 as decoded rows
    against ``c`` [BLOCK_N] (the caller's load; unused, and so dropped by the compiler, on the nvfp4 paths)."""
    if PAIRS:
        sc = _nvfp4_pairs_dot(cv_ptr, cs_ptr, ct_ptr, c_base, s_cn, slot, h, offs_p, P, N, s_vb, s_vh, s_vp, s_vn,
                              s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, BLOCK_N // 8)
    elif FMT == 2:
        p3, blk, k = _nvfp4_offsets(offs_p, BLOCK_N // 16)
        col_e = blk * 16 + 2 * k
        even, odd = _load_nvfp4(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_p, P, N, s_vb, s_vh, s_vp, s_vn,
                                s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, BLOCK_N // 16)
        c_e = tl.load(c_base + col_e * s_cn, mask=col_e < N, other=0.0).to(tl.float32)
        c_o = tl.load(c_base + (col_e + 1) * s_cn, mask=col_e + 1 < N, other=0.0).to(tl.float32)
        sc = tl.sum(tl.sum(even * c_e + odd * c_o, axis=2), axis=1)
    else:
        offs_n = tl.arange(0, BLOCK_N)
        s0 = _load_copy_rows(cv_ptr, cs_ptr, slot, h, offs_p, offs_n, mask_p, mask_p[:, None] & (offs_n < N)[None, :],
                             s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, FMT)
        sc = tl.sum(s0 * c[None, :], axis=1)
    return sc


@triton.jit
def _readcopy_apply_kernel(
    cursor_ptr, C_ptr, slot_ptr, y_ptr, win_ptr, dec_ptr, cv_ptr, cs_ptr, ct_ptr, xr_ptr, x_ptr,
    H, P, N, L, heads_per_gc,
    s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
    s_xrb, s_xrh, s_xrl, s_xrp, s_xb, s_xh, s_xp,
    FMT: tl.constexpr, HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """The copy pass, grid ``(cdiv(P, BLOCK_P), batch, H)``: for non-flush rows ``y = decay (S_copy C) + win`` from
    the decoded copy and the window launch's scratch
    (:func:`~replay_compile.kernels.mamba2_pre_triton._mamba2_prepass_window_kernel`); flush rows return at once.
    ``PAIRS`` (nvfp4): ``cv_ptr`` is the codes viewed as int32 (strides in words), decoded by
    :func:`_nvfp4_pairs_dot`.

    As the fp32 step's pass: ``win_ptr`` holds the per-record weights ``cb [b, H, BLOCK_L]`` (zero past ``w``), and
    this program reads its own ``BLOCK_P`` slice of the x window, forms ``win = Σ_j cb_j x_j`` and appends ``x``
    (the window launch then reads no x window: at Super bs256 it took 29 µs of a ~200 µs nvfp4 step reading all of
    it)."""
    pid_p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    y_ptrs = y_ptr + row * s_yb + h * s_yh + offs_p * s_yp
    slot = _step_row(slot_ptr, row, y_ptrs, mask_p, HAS_SLOT, BLOCK_P)
    if slot < 0:                                   # padding row: zero output (stored above), touch nothing else
        return
    c_base = C_ptr + row * s_cb + (h // heads_per_gc) * s_cg
    offs_n = tl.arange(0, BLOCK_N)
    c = tl.load(c_base + offs_n * s_cn, mask=offs_n < N, other=0.0).to(tl.float32)
    w = tl.load(cursor_ptr + slot)
    if w == L - 1:
        return
    sc = _copy_dot(cv_ptr, cs_ptr, ct_ptr, c_base, c, s_cn, slot, h, offs_p, mask_p, P, N,
                   s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, FMT, BLOCK_N, PAIRS)
    decay = tl.load(dec_ptr + row * H + h)
    offs_l = tl.arange(0, BLOCK_L)
    cbv = tl.load(win_ptr + (row * H + h) * BLOCK_L + offs_l)                    # zero past w
    xr_base = xr_ptr + slot * s_xrb + h * s_xrh
    xw, x_cur = _x_slice(xr_base, x_ptr + row * s_xb + h * s_xh + offs_p * s_xp, w, offs_l, offs_p, mask_p,
                         s_xrl, s_xrp)
    win = _cb_window(cbv, xw, x_cur, w, offs_l, xr_base + w * s_xrl + offs_p * s_xrp, mask_p)
    tl.store(y_ptrs, decay * sc + win, mask=mask_p)


@triton.jit
def _nvfp4_block_scales(amax_b, s_g):
    """Block scales of nvfp4 blocks with maxima ``amax_b`` under the tensor scale ``s_g`` (0 -> 1): ``(s_g, the e4m3
    codes, the fp32 reciprocal of the effective scale (0 where the block scale rounds to 0))``, as
    ``NVFP4Format.encode``: one IEEE division per block, the values are then multiplied."""
    s_g = tl.where(s_g > 0.0, s_g, 1.0)                              # zero groups: scale 1
    sb_code = _e4m3_code(tl.minimum(tl.div_rn(amax_b, 6.0 * s_g), 448.0))
    eff = _e4m3_value(sb_code) * s_g
    inv = tl.where(eff > 0.0, tl.div_rn(1.0, tl.where(eff > 0.0, eff, 1.0)), 0.0)   # 1 / eff > 0 where eff > 0
    return s_g, sb_code, inv


@triton.jit
def _nvfp4_encode_body(
    pid_p, row, h, slot,
    state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr,
    P, N,
    s_sb, s_sh, s_sp, s_sn, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
    BLOCK_P: tl.constexpr, NB: tl.constexpr, ROW_SCALE: tl.constexpr,
):
    """Encode one flushed program's copy tile (no early returns: called inside the list kernel's loop) from the
    stored checkpoint rows. ``ROW_SCALE`` (``nvfp4_row``): each row's tensor scale from its own amax, stored per row;
    else the slot's from the amax the flush programs gathered (``amax_ptr``), stored by one program per slot."""
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p3, blk, k = _nvfp4_offsets(offs_p, NB)
    col_e = blk * 16 + 2 * k
    m_e = (p3 < P) & (col_e < N)
    m_o = (p3 < P) & (col_e + 1 < N)
    st = state_ptr + slot * s_sb + h * s_sh + p3 * s_sp
    xe = tl.load(st + col_e * s_sn, mask=m_e, other=0.0).to(tl.float32)
    xo = tl.load(st + (col_e + 1) * s_sn, mask=m_o, other=0.0).to(tl.float32)
    amax_b = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))        # [BLOCK_P, NB]
    if ROW_SCALE:
        s_g = tl.div_rn(tl.max(amax_b, axis=1), 2688.0)[:, None]     # [BLOCK_P, 1]: amax / (448 * 6) per row
    else:
        s_g = tl.div_rn(tl.load(amax_ptr + row).to(tl.float32, bitcast=True), 2688.0)
    s_g, sb_code, inv = _nvfp4_block_scales(amax_b, s_g)
    inv = inv[:, :, None]
    ye = tl.where(inv > 0.0, xe * inv, 0.0)                         # a zero block scale: codes +0 (not -0)
    yo = tl.where(inv > 0.0, xo * inv, 0.0)
    byte = _e2m1_code(ye) | (_e2m1_code(yo) << 4)                 # padding columns: +0 -> code 0
    tl.store(cv_ptr + slot * s_vb + h * s_vh + p3 * s_vp + (blk * 8 + k) * s_vn, byte.to(tl.uint8), mask=m_e)
    offs_b = tl.arange(0, NB)
    tl.store(cs_ptr + slot * s_qb + h * s_qh + offs_p[:, None] * s_qp + offs_b[None, :] * s_qn,
             sb_code.to(tl.uint8), mask=(offs_p[:, None] < P) & (offs_b[None, :] * 16 < N))
    if ROW_SCALE:
        tl.store(ct_ptr + slot * s_tb + h * s_th + offs_p[:, None] * s_tp, s_g, mask=offs_p[:, None] < P)
    elif (pid_p == 0) & (h == 0):
        tl.store(ct_ptr + slot * s_tb, s_g)


@triton.jit
def _nvfp4_encode_words_body(
    pid_p, row, h, slot,
    state_ptr, amax_ptr, cw_ptr, cs_ptr, ct_ptr,
    P, N,
    s_sb, s_sh, s_sp, s_sn, s_wb, s_wh, s_wp, s_wn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
    BLOCK_P: tl.constexpr, NB: tl.constexpr,
):
    """:func:`_nvfp4_encode_body` (per-slot tensor scale) with the codes written as int32 words (``cw_ptr``, word
    strides; N % 8 == 0): the tile is read in its natural order as ``[BLOCK_P, NB, 2, 8]`` (row, block, word of the
    block, code of the word: contiguous, vectorised loads instead of even / odd column gathers), each word's 8 codes
    shifted into place and summed (disjoint bits), one 4-byte store per 8 codes instead of one per 2. Same bytes."""
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p4 = offs_p[:, None, None, None]
    blk = tl.arange(0, NB)[None, :, None, None]
    half = tl.arange(0, 2)[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    col = blk * 16 + half * 8 + j
    m = (p4 < P) & (col < N)
    x = tl.load(state_ptr + slot * s_sb + h * s_sh + p4 * s_sp + col * s_sn, mask=m, other=0.0).to(tl.float32)
    amax_b = tl.max(tl.max(tl.abs(x), axis=3), axis=2)                               # [BLOCK_P, NB]
    s_g, sb_code, inv = _nvfp4_block_scales(amax_b, tl.div_rn(tl.load(amax_ptr + row).to(tl.float32, bitcast=True),
                                                               2688.0))
    inv = inv[:, :, None, None]
    y = tl.where(inv > 0.0, x * inv, 0.0)                           # a zero block scale: codes +0 (not -0)
    code = _e2m1_code(y)                                             # padding columns: +0 -> code 0
    word = tl.sum(code << (4 * j).to(tl.uint32), axis=3)                                # [BLOCK_P, NB, 2]
    p3 = offs_p[:, None, None]
    wi = tl.arange(0, NB)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    tl.store(cw_ptr + slot * s_wb + h * s_wh + p3 * s_wp + wi * s_wn, word.to(tl.int32, bitcast=True),
             mask=(p3 < P) & (wi * 8 < N))
    offs_b = tl.arange(0, NB)
    tl.store(cs_ptr + slot * s_qb + h * s_qh + offs_p[:, None] * s_qp + offs_b[None, :] * s_qn,
             sb_code.to(tl.uint8), mask=(offs_p[:, None] < P) & (offs_b[None, :] * 16 < N))
    if (pid_p == 0) & (h == 0):
        tl.store(ct_ptr + slot * s_tb, s_g)


@triton.jit
def _nvfp4_flush_encode_list_kernel(
    state_ptr, cursor_ptr, slot_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, work_ptr, H, n_pb,
    P, N, L,
    s_sb, s_sh, s_sp, s_sn, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, NB: tl.constexpr, ENC_WORDS: tl.constexpr,
):
    """Encode an nvfp4 launch's copy (one tensor scale per slot) of every listed flush row, on a fixed grid, from the
    stored checkpoint and the slot amax the fold gathered, exactly as ``NVFP4Format.encode``. ``ENC_WORDS``:
    ``cv_ptr`` is the codes as int32 words (word strides), :func:`_nvfp4_encode_words_body` (N % 8 == 0 and codes
    that can be viewed as words; 784 -> 420 µs at Super bs256, H200); else the byte encode,
    :func:`_nvfp4_encode_body`."""
    n_items = tl.load(work_ptr) * (H * n_pb)
    t = tl.program_id(0)
    while t < n_items:
        row, h, tile = _list_item(work_ptr, t, H, n_pb)
        if ENC_WORDS:
            _nvfp4_encode_words_body(tile, row, h, _row_slot(slot_ptr, row, HAS_SLOT),
                                     state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, P, N, s_sb, s_sh,
                                     s_sp, s_sn, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
                                     BLOCK_P, NB)
        else:
            _nvfp4_encode_body(tile, row, h, _row_slot(slot_ptr, row, HAS_SLOT),
                               state_ptr, amax_ptr, cv_ptr, cs_ptr, ct_ptr, P, N, s_sb, s_sh,
                               s_sp, s_sn, s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp,
                               BLOCK_P, NB, False)
        t += tl.num_programs(0)


@triton.jit
def _decode_kernel(cv_ptr, cs_ptr, ct_ptr, out_ptr, P, N,
                   s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, s_ob, s_oh, s_op, s_on,
                   FMT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Decode a whole copy with the step kernel's decode helpers (tests check them against ``FORMATS.decode``)."""
    pid_p = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_base = out_ptr + slot * s_ob + h * s_oh
    if FMT == 2:
        p3, blk, k = _nvfp4_offsets(offs_p, BLOCK_N // 16)
        col_e = blk * 16 + 2 * k
        even, odd = _load_nvfp4(cv_ptr, cs_ptr, ct_ptr, slot, h, offs_p, P, N, s_vb, s_vh, s_vp, s_vn,
                                s_qb, s_qh, s_qp, s_qn, s_tb, s_th, s_tp, BLOCK_N // 16)
        tl.store(o_base + p3 * s_op + col_e * s_on, even, mask=(p3 < P) & (col_e < N))
        tl.store(o_base + p3 * s_op + (col_e + 1) * s_on, odd, mask=(p3 < P) & (col_e + 1 < N))
    else:
        offs_n = tl.arange(0, BLOCK_N)
        tile_mask = (offs_p[:, None] < P) & (offs_n[None, :] < N)
        s0 = _load_copy_rows(cv_ptr, cs_ptr, slot, h, offs_p, offs_n, offs_p < P, tile_mask,
                             s_vb, s_vh, s_vp, s_vn, s_qb, s_qh, s_qp, FMT)
        tl.store(o_base + offs_p[:, None] * s_op + offs_n[None, :] * s_on, s0, mask=tile_mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def tuned(spec: str):
    """Force this module's launch configuration (``"BLOCK_P=16,APPLY_P=32"``, or ``"pre:..."``: the one variant) for
    the duration of the block."""
    TUNING.clear()
    name, _, rest = spec.rpartition(":") if ":" in spec else ("", "", spec)
    if name not in ("", "pre"):
        raise ValueError(f"replay_compile.mamba2 read copy: unknown kernel variant {name!r} (pre)")
    TUNING.update({k: v for k, v in parse_tuning("x:" + rest).items() if k != "variant"})
    try:
        yield
    finally:
        TUNING.clear()


def _nvfp4_apply_rows(P: int) -> int:
    """Rows per program of the nvfp4 copy pass: the largest of 64 / 32 / 16 that divides P (no masked rows)."""
    return next((r for r in (64, 32) if P % r == 0), 16)


@memo_unless_tuned(TUNING)
def launch_config(P: int, N: int, L: int, fmt: str = "") -> dict:
    """``BLOCK_N = next_pow2(N)`` (>= 16: whole rows per program), ``BLOCK_P`` 32 where ``P % 32 == 0`` and P > 64,
    else 16 (the nvfp4 encode's rows and the decode's; not tuned on a GPU), ``BLOCK_L = max(16, next_pow2(L))``.
    ``fmt`` (the format's name) picks the copy pass's and the flush launch's tiles and warps."""
    block_n = max(16, next_pow2(N))
    block_l = max(16, next_pow2(L))
    nvfp4 = fmt in ("nvfp4", "nvfp4_row")
    block_p = TUNING.get("BLOCK_P") or (32 if P % 32 == 0 and P > 64 else 16)
    warps = TUNING.get("num_warps") or max(1, min(8, max(block_p, block_l) * block_n // (32 * 64)))
    return dict(BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_L=block_l, num_warps=warps,
                # the non-flush copy pass's tile, 1 warp: 32 rows for fp8 (H200, Super bs256: non-flush
                # 131.1 -> 119.9 µs, 64 registers); the nvfp4 pair decode (H200, Super bs256, apply launch):
                # 152.5 µs on 16 rows, 100.6 on 32, 93.6 on 64 (128 registers)
                APPLY_P=TUNING.get("APPLY_P") or (32 if fmt == "fp8_e4m3" else _nvfp4_apply_rows(P) if nvfp4 else 16),
                apply_warps=TUNING.get("apply_warps") or 1,
                flush_programs=TUNING.get("flush_programs"),         # default: 32 warps per SM
                # the flush launch (its own launch: a tile shape, warps and a tl.dot there cost the non-flush steps
                # nothing), folding with one IEEE tl.dot. H200, Super bs256 flush step: bf16 1477 -> 1077 µs with
                # 16 x N tiles on 1 warp, fp8 1951 -> 1840 with 32 x N on 4 warps (its software e4m3 rounding wants
                # threads: 16 on 1 warp took 3348), nvfp4 2425 -> 2158 (16, 1 warp). 2 warps with the dot took
                # 5-20 ms for every format: avoid
                FLUSH_P=TUNING.get("FLUSH_P") or (32 if fmt == "fp8_e4m3" else 16),
                flush_warps=TUNING.get("flush_warps") or (4 if fmt == "fp8_e4m3" else 1),
                # nvfp4 (per-slot scale): the flush by the fp32 step's listed fold on its own tiles, gathering the
                # slot amax with one atomic per folded row, and the cursor advance (H200, Super bs256: the fold
                # 969 -> 711 µs; one atomic per slice after a cross-warp reduction: 912)
                fold_warps=TUNING.get("fold_warps"),                 # default: the fp32 step's flush warps
                enc_per_sm=TUNING.get("enc_per_sm"),                 # default: 32 warps per SM
                # warps of the nvfp4 encode launch: 1 (H200, Super bs256: the word encode 420 µs on 1 warp, 443 on 2,
                # 533 on 4). (Issuing the non-flush copy pass's loads before the cursor's was tried and removed, same
                # conditions: fp8 131.1 -> 129.8 µs, nvfp4_row 200.9 -> 208.2)
                enc_warps=TUNING.get("enc_warps") or 1)


def _format_name(fmt) -> str:
    f = get_format(fmt)
    if f.name not in FORMAT_IDS:
        raise ValueError(f"replay_compile.mamba2 read copy: no Triton kernel for format {f.name!r}")
    dims = getattr(f, "tensor_scale_dims", None)
    if dims is not None and dims != (-1 if f.name == "nvfp4_row" else 1):
        raise ValueError("replay_compile read copy: the Triton kernels support nvfp4 with one tensor scale per slot "
                         "(\"nvfp4\", tensor_scale_dims=1) or per row (\"nvfp4_row\") only, got "
                         f"{f!r}")
    return f.name


def _copy_args(enc: Encoded, name: str, dummy: torch.Tensor):
    """(values/codes, row/block scale, tensor scale) pointers and their strides (4 + 4 + 3) for the kernels;
    fp8 tensors as uint8 views (the kernels bitcast), unused pointers ``dummy`` with zero strides. The tensor
    scale's strides are (slot, head, row): ``nvfp4``'s one per slot is ``[S]`` (head and row strides 0), that of
    ``nvfp4_row`` ``[S, H, rows]``."""
    t = enc.tensors
    if name == "bf16":
        v = t["values"]
        return (v, dummy, dummy), (*v.stride(), 0, 0, 0, 0, 0, 0, 0)
    if name == "fp8_e4m3":
        v, s = t["values"].view(torch.uint8), t["scale"]
        return (v, s, dummy), (*v.stride(), *s.stride(), 0, 0, 0, 0)
    v, s, g = t["codes"], t["block_scale"].view(torch.uint8), t["tensor_scale"]
    return (v, s, g), (*v.stride(), *s.stride(), *(g.stride() + (0, 0))[:3])


def hw_fp8_cast(device: torch.device) -> bool:
    """Whether kernels on ``device`` may round fp32 -> e4m3 with the hardware conversion: compiled (not under the
    interpreter, :func:`~.launch.interpreting`, whose cast rounds half-up) on a CUDA device of compute capability 8.9
    or newer."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _code_words(codes: torch.Tensor):
    """nvfp4 codes ``[S, H, P, N/2]`` uint8 viewed as int32 words ``[S, H, P, N/8]``, or None where the layout
    does not allow it (a last stride other than 1, or strides / offset not multiples of 4 bytes)."""
    if codes.stride(-1) != 1 or codes.shape[-1] % 4 or any(st % 4 for st in codes.stride()[:-1]) \
            or codes.storage_offset() % 4:
        return None
    return codes.view(torch.int32)


def replay_step_readcopy_triton(state, copy, fmt, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C,
                                slot_idx=None):
    """Triton implementation of :func:`replay_step_readcopy_reference` (same arguments, same in-place contract).

    Launches: the window launch (shared with the fp32 step, listing the flush rows); the copy pass of the non-flush
    rows; the flush launch walking the listed rows; for nvfp4 (one tensor scale per slot) the listed encode launch
    (``nvfp4_row`` encodes inside the flush); the cursor advance (nvfp4: inside its flush). ``y`` is fp32.
    """
    name = _format_name(fmt)
    S, H, P, N = state.shape
    enc = as_encoded(copy, name, state.shape)
    b = x.shape[0]
    L = x_ring.shape[2]
    G, Gc = B_ring.shape[1], C.shape[1]
    y = torch.empty((b, H, P), dtype=torch.float32, device=x.device)
    if b == 0:
        return y
    cfg = launch_config(P, N, L, name)
    n_pb = cdiv(P, cfg["BLOCK_P"])
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else cursor          # any pointer; unused when HAS_SLOT is False
    # int32 scratch zeroed by one fill: the listed flush rows ``work = [count, rows...]`` and the nvfp4 slot amax
    # (one memset kernel per step fewer than two separate buffers: ~1 µs). Listed flush rows, walked by fixed grids
    # (H200 Super bs256: non-flush fp8 213 -> 135 us, bf16 264 -> 187, NVFP4 516 -> 362 against a full grid of
    # programs that return; the flush step 10-25% slower; L-avg 1.2-1.3x better)
    n_work = b + 1
    scratch = torch.zeros((n_work + (b if name == "nvfp4" else 0),), dtype=torch.int32, device=x.device)
    work = scratch[:n_work]
    amax = scratch[n_work:] if name == "nvfp4" else cursor
    (cv, cs, ct), cstrides = _copy_args(enc, name, cursor)
    # launch 1: the window's per-record weights per (row, head) and the records (shared with the fp32 step); the
    # copy pass forms the window term from them (H200, Super bs256: the window launch 29 -> 7 µs; non-flush bf16
    # 168.8 -> 157.8 µs, fp8 108.2 -> 101.5)
    win, dec = launch_window(dt_ring, la_ring, B_ring, cursor, dt, la, B, C, slot_arg, has_slot, cfg["BLOCK_N"],
                             cfg["BLOCK_L"], work)
    # launch 2: the copy pass of the non-flush rows. nvfp4 codes read as int32 words where N % 8 == 0 and the
    # layout allows it (H200, Super bs256: the non-flush step 357 -> 203 µs), decoded two codes per lop3 into
    # fp16 and multiplied in fp32 (the copy pass 163 -> 101 µs on 32-row tiles); byte by byte otherwise
    words = _code_words(cv) if FORMAT_IDS[name] == 2 and N % 8 == 0 else None
    av, astrides = (cv, cstrides) if words is None else (words, (*words.stride(), *cstrides[4:]))
    k = launch(_readcopy_apply_kernel)[(cdiv(P, cfg["APPLY_P"]), b, H)](
        cursor, C, slot_arg, y, win, dec, av, cs, ct, x_ring, x, H, P, N, L, H // Gc, *C.stride(), *y.stride(),
        *astrides, *x_ring.stride(), *x.stride(),
        FMT=FORMAT_IDS[name], HAS_SLOT=has_slot, BLOCK_P=cfg["APPLY_P"], BLOCK_N=cfg["BLOCK_N"],
        PAIRS=words is not None, BLOCK_L=cfg["BLOCK_L"], num_warps=cfg["apply_warps"])
    LAST_LAUNCH["kernel"] = k
    step_args = (state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_arg, y, cv, cs, ct, amax)
    strides = (H, P, N, L, H // G, H // Gc,
               *state.stride(), *x_ring.stride(), *dt_ring.stride(), *la_ring.stride(), *B_ring.stride(),
               *x.stride(), *dt.stride(), *la.stride(), *B.stride(), *C.stride(), *y.stride(), *cstrides)
    if name == "nvfp4":
        # nvfp4 (one tensor scale per slot) needs no whole rows in its flush: the fp32 step's listed fold (its
        # tiles and warps) gathering the slot amax; it also advances the cursors (the encode below walks the list)
        fp, fn, fw = fold_tile_shape(P, N, cfg["BLOCK_L"])
        fw = cfg["fold_warps"] or fw
        n_fp = cdiv(P, fp)
        programs = cfg["flush_programs"] or fixed_grid(b * H * n_fp, fw, x.device)
        launch(_nvfp4_fold_list_kernel)[(programs,)](
            *step_args[:13], work, amax, *strides[:6], n_fp, *strides[6:-11],
            HAS_SLOT=has_slot, BLOCK_P=fp, BLOCK_N=fn, BLOCK_L=cfg["BLOCK_L"], N_TILES=cdiv(N, fn),
            STOCHASTIC_FP16=state.dtype == torch.float16, n_rows=b, num_warps=fw)
        # the encode reading tiles in order and writing int32 words of 8 codes where N % 8 == 0 and the layout
        # allows it, else the byte encode
        enc_programs = cfg["flush_programs"] or fixed_grid(b * H * n_pb, cfg["enc_warps"], x.device,
                                                           cfg["enc_per_sm"])
        ew = _code_words(cv) if N % 8 == 0 else None
        enc_args, estrides = ((state, cursor, slot_arg, amax, ew, cs, ct), (*ew.stride(), *cstrides[4:])) \
            if ew is not None else ((state, cursor, slot_arg, amax, cv, cs, ct), cstrides)
        launch(_nvfp4_flush_encode_list_kernel)[(enc_programs,)](
            *enc_args, work, H, n_pb, P, N, L, *state.stride(), *estrides, HAS_SLOT=has_slot, BLOCK_P=cfg["BLOCK_P"],
            NB=cfg["BLOCK_N"] // 16, ENC_WORDS=ew is not None, num_warps=cfg["enc_warps"])
        return y
    # the flush rows' launch, with its own tile (FLUSH_P rows of whole N), warps and fold
    n_fp = cdiv(P, cfg["FLUSH_P"])
    programs = cfg["flush_programs"] or fixed_grid(b * H * n_fp, cfg["flush_warps"], x.device)
    # fp8 flush encode by the hardware conversion where compiled for sm_89+ (the interpreter keeps the software
    # rounding). H200, Super bs256: the fp8 flush step 1837 -> 1724 µs (L-avg 3.02 -> 3.12x)
    launch(_readcopy_flush_list_kernel)[(programs,)](
        *step_args, work, n_fp, *strides, FMT=FORMAT_IDS[name], HAS_SLOT=has_slot, BLOCK_P=cfg["FLUSH_P"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_L=cfg["BLOCK_L"], STOCHASTIC_FP16=state.dtype == torch.float16,
        HW_E4M3=hw_fp8_cast(x.device), ROW_SCALE=name == "nvfp4_row", num_warps=cfg["flush_warps"])
    launch(_advance_cursor_kernel)[(cdiv(b, 1024),)](cursor, slot_arg, b, L, HAS_SLOT=has_slot, BLOCK=1024)
    return y


def decode_read_copy_triton(copy, fmt, shape=None) -> torch.Tensor:
    """Decode a whole read copy ``[S, H, P, N]`` to fp32 with the step kernel's decode helpers."""
    name = _format_name(fmt)
    if isinstance(copy, Encoded):
        shape = copy.shape
    elif shape is None:
        raise ValueError("decode_read_copy_triton: pass the logical shape with a dict copy")
    enc = as_encoded(copy, name, shape)
    S, H, P, N = enc.shape
    out = torch.empty(tuple(enc.shape), dtype=torch.float32, device=enc.device)
    if out.numel() == 0:
        return out
    cfg = launch_config(P, N, 1)
    (cv, cs, ct), cstrides = _copy_args(enc, name, out)
    launch(_decode_kernel)[(cdiv(P, cfg["BLOCK_P"]), S, H)](
        cv, cs, ct, out, P, N, *cstrides, *out.stride(), FMT=FORMAT_IDS[name], BLOCK_P=cfg["BLOCK_P"],
        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return out
