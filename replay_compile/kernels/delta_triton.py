"""Triton kernel of the delta-rule ReplaySSM step (GDN and KDA): the CUDA implementation of
``replay_compile::delta_step``, same signature and in-place contract as
:func:`~replay_compile.kernels.delta_reference.delta_replay_step_reference`.

The delta rule needs ``S'ᵀk`` as well as ``S'ᵀq``, so every step reads the checkpoint (there is no output-only
route); what replay saves is the write: non-flush steps append ``(d, k, g)`` and leave the checkpoint untouched.

Grid ``(cdiv(V, BLOCK_V), batch, HV)``. A program holds the checkpoint's ``K x BLOCK_V`` slice (K padded to a power
of two >= 16) and the window of up to ``L`` records on a power-of-two axis ``BLOCK_L >= 16``: keys ``[BLOCK_L, K]``
of its key head, its slice of the corrected values ``[BLOCK_L, BLOCK_V]``, the per-record log-gates ``g_j``
``[BLOCK_L]`` (GDN) or ``[BLOCK_L, BLOCK_K]`` (KDA), loaded one record ahead so that ``E_j = Σ_{j<i<=w} g_i`` is a
reverse cumulative sum (<= 0; :func:`~.delta_split_triton._gate_window`), ``E_tot = Σ_{i<=w} g_i`` and
``KE_j = k_j ⊙ exp(E_j)``::

    S'ᵀx = S_0ᵀ (exp(E_tot) ⊙ x) + Σ_{j<w} d_j (KE_j · x)        for x = k_t and x = q_t
    d_t  = beta (v_t - S'ᵀk_t) ;  o_t = S'ᵀq_t + d_t (k_t · q_t)
    flush: S_new = exp(E_tot) ⊙_K S_0 + KEᵀ D + k_t d_tᵀ           (one tl.dot, IEEE fp32), written once

That is the ``fused`` kernel below (small batches: one launch, the window recomputed per V-block); large batches
run the ``split`` launches of :mod:`.delta_split_triton` (the window once per row and head, then a checkpoint stream
of small slices, and the flush in a launch of its own).

Every load of the fused kernel is issued before the cursor is known (ring slots past ``w`` are discarded in
registers; the cursor atomic comes after the last load, so its round trip overlaps them), the cursor advance is folded
in with the arrival count of :func:`~replay_compile.kernels.mamba2_triton._arrive`, fp16 checkpoints are rounded
stochastically at the flush exactly as the reference does. No autotuning (the kernel writes its inputs in place);
constexpr loop bounds only (the interpreter's numpy>=2.4 limitation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .delta_split_triton import _gate_window, launch_split
from .host_math import cdiv, memo_unless_tuned, next_pow2
from .launch import launch
from .mamba2_triton import _ARRIVAL, _arrive, _step_row, _store_checkpoint
from .tuning import Tuning


@triton.jit
def _delta_replay_step_kernel(
    state_ptr, dr_ptr, kr_ptr, gr_ptr, cursor_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, o_ptr,
    HV, K, V, L, v_per_k, v_per_q, arrivals,
    s_sb, s_sh, s_sk, s_sv,                 # state [S, HV, K, V]
    s_drb, s_drh, s_drl, s_drv,             # d_ring [S, HV, L, V]
    s_krb, s_krh, s_krl, s_krk,             # k_ring [S, Hk, L, K]
    s_grb, s_grh, s_grl, s_grk,             # g_ring [S, HV, L(, K)] (s_grk unused for GDN)
    s_qb, s_qh, s_qk, s_kb, s_kh, s_kk,     # q [b, Hq, K], k [b, Hk, K]
    s_vb, s_vh, s_vv,                       # v [b, HV, V]
    s_gb, s_gh, s_gk,                       # g [b, HV(, K)]
    s_bb, s_bh,                             # beta [b, HV]
    s_ob, s_oh, s_ov,                       # o [b, HV, V]
    HAS_SLOT: tl.constexpr, KDA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_L: tl.constexpr, STOCHASTIC_FP16: tl.constexpr,
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

    hk = h // v_per_k
    hq = h // v_per_q
    offs_k = tl.arange(0, BLOCK_K)
    offs_l = tl.arange(0, BLOCK_L)
    mask_k = offs_k < K
    in_ring = offs_l < L
    tile_mask = mask_k[:, None] & mask_v[None, :]

    # loads that do not depend on w: the tiles first, the token's vectors last. A vector used in another layout is
    # converted (through shared memory, behind a barrier) as soon as it arrives, so a load issued after it would wait
    # for that round trip (the SASS had three in a row before this order)
    st_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    s0 = tl.load(st_ptrs, mask=tile_mask, other=0.0).to(tl.float32)                       # [BLOCK_K, BLOCK_V]
    kw = tl.load(kr_ptr + slot * s_krb + hk * s_krh + offs_l[:, None] * s_krl + offs_k[None, :] * s_krk,
                 mask=in_ring[:, None] & mask_k[None, :], other=0.0).to(tl.float32)          # [BLOCK_L, BLOCK_K]
    dw = tl.load(dr_ptr + slot * s_drb + h * s_drh + offs_l[:, None] * s_drl + offs_v[None, :] * s_drv,
                 mask=in_ring[:, None] & mask_v[None, :], other=0.0).to(tl.float32)          # [BLOCK_L, BLOCK_V]
    gr_base = gr_ptr + slot * s_grb + h * s_grh
    nxt = offs_l + 1                               # the gates one record ahead (see _gate_window)
    if KDA:
        g_next = tl.load(gr_base + nxt[:, None] * s_grl + offs_k[None, :] * s_grk,
                         mask=(nxt < L)[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_K]
        g_first = tl.load(gr_base + offs_k * s_grk, mask=mask_k, other=0.0).to(tl.float32)
    else:
        g_next = tl.load(gr_base + nxt * s_grl, mask=nxt < L, other=0.0).to(tl.float32)
        g_first = tl.load(gr_base).to(tl.float32)
    v = tl.load(v_ptr + row * s_vb + h * s_vh + offs_v * s_vv, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_bb + h * s_bh).to(tl.float32)
    q = tl.load(q_ptr + row * s_qb + hq * s_qh + offs_k * s_qk, mask=mask_k, other=0.0).to(tl.float32)
    k_raw = tl.load(k_ptr + row * s_kb + hk * s_kh + offs_k * s_kk, mask=mask_k, other=0.0)
    k = k_raw.to(tl.float32)
    if KDA:
        g_cur = tl.load(g_ptr + row * s_gb + h * s_gh + offs_k * s_gk, mask=mask_k, other=0.0).to(tl.float32)
    else:
        g_cur = tl.load(g_ptr + row * s_gb + h * s_gh).to(tl.float32)
    # the cursor only after every load is issued: the atomic's round trip (and the barrier that shares its result)
    # then overlaps the loads instead of preceding them
    w = _arrive(cursor_ptr, slot, arrivals, L)

    # the window: records j < w, this token at j == w; exponents are suffix sums of per-record gates (stale ring
    # slots never leak: where, not multiply)
    hist = offs_l < w
    E, dec = _gate_window(g_next, g_first, g_cur, w, offs_l, KDA)                           # dec: KDA [BLOCK_K]
    if KDA:
        ke = tl.where(hist[:, None], kw * tl.exp(E), 0.0)                                   # [BLOCK_L, BLOCK_K]
    else:
        ke = tl.where(hist[:, None], kw * tl.exp(E)[:, None], 0.0)
    ak = dec * k
    aq = dec * q
    dw = tl.where(hist[:, None], dw, 0.0)

    sk = tl.sum(s0 * ak[:, None], axis=0) + tl.sum(tl.sum(ke * k[None, :], axis=1)[:, None] * dw, axis=0)
    sq = tl.sum(s0 * aq[:, None], axis=0) + tl.sum(tl.sum(ke * q[None, :], axis=1)[:, None] * dw, axis=0)
    d = beta * (v - sk)                                                                       # [BLOCK_V]
    o = sq + d * tl.sum(k * q, axis=0)
    tl.store(o_ptrs, o, mask=mask_v)

    if w == L - 1:
        # flush: S_new = exp(E_tot) ⊙_K S_0 + KEᵀ D + k dᵀ, written once; nothing appended (w -> 0)
        if KDA:
            s_new = dec[:, None] * s0
        else:
            s_new = dec * s0
        s_new = s_new + tl.dot(tl.trans(ke), dw, input_precision="ieee") + k[:, None] * d[None, :]
        if KDA:
            key_gate = tl.sum(tl.where(offs_k == 0, g_cur, 0.0), axis=0)                   # g[..., 0], as the reference
        else:
            key_gate = g_cur
        _store_checkpoint(st_ptrs, s_new, tile_mask, key_gate, slot * HV + h,
                          offs_k[:, None] * V + offs_v[None, :], STOCHASTIC_FP16)
    else:
        tl.store(dr_ptr + slot * s_drb + h * s_drh + w * s_drl + offs_v * s_drv,
                 d.to(dr_ptr.dtype.element_ty), mask=mask_v)
        if pid_v == 0:
            if KDA:
                tl.store(gr_base + w * s_grl + offs_k * s_grk, g_cur, mask=mask_k)
            else:
                tl.store(gr_base + w * s_grl, g_cur)
            if h % v_per_k == 0:                       # one program per key head appends k_t
                tl.store(kr_ptr + slot * s_krb + hk * s_krh + w * s_krl + offs_k * s_krk,
                         k_raw.to(kr_ptr.dtype.element_ty), mask=mask_k)


# Launch configuration override for benchmarks and tests (``tuning.tuned``; split only: "window_warps"). Empty in use.
TUNING = Tuning(__name__, ("BLOCK_V", "num_warps", "window_warps"), variants=("fused", "split"))

# The split step's last compiled checkpoint-pass kernel (tests check its launch options; benchmarks its registers).
LAST_LAUNCH: dict = {}

# Rows x value heads above which the split variant runs (H200, HV = 32: fused wins at bs1 (GDN 3.9 vs 5.8
# µs, KDA 5.3 vs 9.2), split at bs8 (GDN 12.0 vs 14.5, KDA 15.5 vs 24.8); per-row growth puts the crossover near
# bs2-4).
FUSED_MAX_ROW_HEADS = 64
# Rows x value heads from which the split checkpoint pass is capped at 128 registers (see launch_config)
CAPPED_MIN_ROW_HEADS = 8192


@memo_unless_tuned(TUNING)
def launch_config(b: int, HV: int, K: int, V: int, L: int) -> dict:
    """Kernel variant and launch configuration for a step of ``b`` rows.

    * ``fused`` (latency, small batch): one launch; each program recomputes the window for its V-block.
    * ``split`` (bandwidth, large batch, :mod:`.delta_split_triton`): launch 1 computes the window once per (row,
      value head); launch 2 streams the checkpoint in ``K x BLOCK_V`` slices (as fla's fused recurrent kernel
      does) with little else live, so many programs fit per SM.
    K is held whole (padded to a power of two >= 16); the window sits on a power-of-two axis >= 16. GDN and KDA
    share the configuration (KDA's launch 1 of the split variant runs record by record:
    :func:`~.delta_split_triton.launch_split` picks by family).
    """
    block_k = max(16, next_pow2(K))
    block_l = max(16, next_pow2(L))
    variant = TUNING.get("variant") or ("fused" if b * HV <= FUSED_MAX_ROW_HEADS else "split")
    extra = {}
    if variant == "fused":
        block_v = TUNING.get("BLOCK_V") or (16 if V <= 16 else 32)
        # 4 warps for a 128 x 32 slice (H200, bs1: GDN 4.2 -> 3.9 µs L-avg). KDA ran 16-wide slices on 2 warps while
        # its window exponents were differences of summed gates (4.8 µs at bs1); with the per-record gates' suffix
        # scan those lost to 32-wide slices on 4 warps (one run: bs1 6.1 vs 5.5 µs, bs2 8.3 vs 7.8; 1 warp, or 8- to
        # 16-wide slices on 1-4 warps, 6.5-8.8 µs at bs1)
        warps = TUNING.get("num_warps") or max(1, min(8, max(block_k * block_v, block_l * block_k) // (32 * 32)))
    elif variant == "split":
        # H200: 32-wide slices on 2 warps (16 on 1 warp: GDN bs256 non-flush 206 -> 168 µs), the window
        # launch on 1 warp (4: GDN window 24 -> 16 µs, KDA 91 -> 54)
        block_v = TUNING.get("BLOCK_V") or (32 if V > 16 else 16)
        warps = TUNING.get("num_warps") or (2 if block_v >= 32 else 1)
        # H200, bs256 fp32: KDA's launch 1 record by record (window 46 -> 22 µs, L-avg 1.24 -> 1.38x of fla; GDN's
        # window 16 -> 17 µs, so GDN keeps the tile form: launch_split picks by family), and the flush's record
        # loop pipelined (4 deep: flush apply 570 -> 445 µs, both; 2 stages: 563). 5 deep with launch 1's scaled keys
        # read from L2: flush step -8 to -23 µs at bs 256-512 for KDA and GDN, equal at bs128, two rounds in one
        # call (KDA bs256 L-avg 178.7 -> 178.2 µs). Launch 1's scratch stored evict_last (L2), read by launch 2
        # after the checkpoint it streamed (H200, fp32, two calls, vs fla in the same call: KDA bs256 L-avg 186.0
        # -> 182.3 / 185.3 -> 181.4 µs (1.44 -> 1.47x), GDN-4B 178.9 -> 175.9 / 179.5 -> 176.9 (2.04 -> 2.07x); the
        # checkpoint stream, ring records or flush stores evict_first on top: within 1 µs either way). (Launch 2
        # as launch 1's programmatic dependent lost: H200, fp32, non-flush bs256 GDN-4B 169.7 -> 173.2 µs, KDA
        # 175.5 -> 183.3, presumably its waiting slices hold SM slots launch 1's last programs need.)
        extra = dict(window_warps=TUNING.get("window_warps") or 1, flush_stages=5,
                     # from 8192 rows x value heads the checkpoint pass is capped at 128 registers per thread
                     # (uncapped: 161 with triton 3.6). H200, fp32, same calls, KDA / GDN: flush step at bs256
                     # 485.6 -> 457.8 / 468.9 -> 433.8 µs, L-avg 1.40 -> 1.42x / 2.00 -> 2.02x, bs512 1.52 -> 1.56x /
                     # 1.99 -> 2.04x; at bs 8-128 equal or up to 2.2% slower (non-flush steps +0.3-1 µs); 96
                     # registers lost 30% and more (spills)
                     maxnreg=128 if b * HV >= CAPPED_MIN_ROW_HEADS else 0)
    else:
        raise ValueError(f"replay_compile.delta: unknown kernel variant {variant!r} (fused, split)")
    return dict(variant=variant, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_L=block_l, num_warps=warps, **extra)


def delta_replay_step_triton(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx=None):
    """Triton implementation of :func:`delta_replay_step_reference` (same arguments, same in-place contract)."""
    S, HV, K, V = state.shape
    b = v.shape[0]
    L = d_ring.shape[2]
    kda = g_ring.dim() == 4
    o = torch.empty((b, HV, V), dtype=torch.float32, device=v.device)
    if b == 0:
        return o
    cfg = launch_config(b, HV, K, V, L)
    n_vb = cdiv(V, cfg["BLOCK_V"])
    if n_vb * HV >= 1 << 15 or L >= _ARRIVAL:
        raise ValueError(f"replay_compile.delta: {HV} heads x {n_vb} V-blocks (or L={L}) exceed the cursor word's "
                         "arrival counter")
    has_slot = slot_idx is not None
    slot_arg = slot_idx if has_slot else None     # never the cursor: see mamba2_triton.replay_step_triton
    g_strides = tuple(g_ring.stride()) + ((0,) if not kda else ())
    gi_strides = tuple(g.stride()) + ((0,) if not kda else ())
    v_per_k, v_per_q = HV // k_ring.shape[1], HV // q.shape[1]
    common = dict(HAS_SLOT=has_slot, KDA=kda, BLOCK_K=cfg["BLOCK_K"], BLOCK_L=cfg["BLOCK_L"])
    if cfg["variant"] == "fused":
        launch(_delta_replay_step_kernel)[(n_vb, b, HV)](
            state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_arg, o,
            HV, K, V, L, v_per_k, v_per_q, n_vb * HV,
            *state.stride(), *d_ring.stride(), *k_ring.stride(), *g_strides,
            *q.stride(), *k.stride(), *v.stride(), *gi_strides, *beta.stride(), *o.stride(),
            BLOCK_V=cfg["BLOCK_V"], STOCHASTIC_FP16=state.dtype == torch.float16, num_warps=cfg["num_warps"],
            **common)
        return o
    # split: window once per (row, value head) into scratch, then the checkpoint pass
    LAST_LAUNCH["kernel"] = launch_split(cfg, state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_arg,
                                         has_slot, o)
    return o
