"""What a read-only stream of a delta-rule checkpoint reaches, by tile shape (KDA, batch 256).

    python benchmarks/diag_delta_stream.py [--batch 256] [--heads 32] [--forms slice,apply,flushparts]

The delta apply pass streams ``[b, HV, K, V]`` checkpoints (V contiguous) and reduces them over K twice
(``S_0ᵀa`` and ``S_0ᵀb``, the step's decayed key and query). Today it reads ``K x 32`` slices: 128 runs of 128 bytes,
512 bytes apart. This measures the same two GEMVs, outputs checked against torch, for:

* ``slice BV/warps``: one program per ``K x BV`` slice (the apply pass's tiles);
* ``chunk BK/warps``: one program per ``BK x V`` chunk (contiguous ``BK * V * 4`` bytes), partial sums written per
  chunk (the bound of a K-split pass, no combine);
* ``chunk+last BK/warps``: the same, the last-arriving chunk of each (row, head) (an atomic counter) summing the
  partials, as a K-split pass would finish ``d`` and ``o``;
* ``head BK/warps/stages``: one program per (row, head) looping over its K chunks, software-pipelined;
* ``apply-like``: the apply pass's non-flush work added feature by feature to the 32-wide slice (timed only), and
  the same pass skipping flush rows after reading ``w`` first;
* ``flush-like BV/warps/stages``: a flush-only pass (readout, fold of the records with launch 1's scaled keys, store
  in place) with every row flushing, and with none (the early exits a full grid pays on a non-flush step);
* ``flush-dot``: the same with the fold as one ``tl.dot`` (tf32x3, tf32, ieee);
* ``persist``: the flush pass as a fixed grid walking its items in a software-pipelined loop;
* ``flushparts``: where a flush pass's time goes: the in-place read-modify-write alone (``rmw``), the pass without
  the fold, the fold over 3 / 7 / 15 records, and the fold with an L2-resident scaled-key scratch.

A diagnostic for ``docs/design/delta_kernel.md`` (H200 results in
``benchmarks/results/delta_kernel_designs_h200/``): no baseline, no speed claim.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import copy_bandwidth, reported, time_graph, warm_clocks  # noqa: E402


@triton.jit
def _slice_kernel(s_ptr, a_ptr, b_ptr, y_ptr, K, V, BK: tl.constexpr, BV: tl.constexpr):
    pid_v = tl.program_id(0)
    rh = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    s = tl.load(s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :])
    a = tl.load(a_ptr + rh * K + offs_k)
    b = tl.load(b_ptr + rh * K + offs_k)
    tl.store(y_ptr + rh * 2 * V + offs_v, tl.sum(s * a[:, None], axis=0))
    tl.store(y_ptr + rh * 2 * V + V + offs_v, tl.sum(s * b[:, None], axis=0))


@triton.jit
def _chunk_kernel(s_ptr, a_ptr, b_ptr, part_ptr, cnt_ptr, y_ptr, K, V, NKB: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, LAST: tl.constexpr):
    kb = tl.program_id(0)
    rh = tl.program_id(1).to(tl.int64)
    offs_k = kb * BK + tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    s = tl.load(s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :])
    a = tl.load(a_ptr + rh * K + offs_k)
    b = tl.load(b_ptr + rh * K + offs_k)
    pk = tl.sum(s * a[:, None], axis=0)
    pq = tl.sum(s * b[:, None], axis=0)
    pb = part_ptr + (rh * NKB + kb) * 2 * V
    tl.store(pb + offs_v, pk)
    tl.store(pb + V + offs_v, pq)
    if LAST:
        tl.debug_barrier()                          # every thread's partial stored before the release below
        old = tl.atomic_add(cnt_ptr + rh, 1, sem="acq_rel", scope="gpu")
        if old == NKB - 1:
            offs_c = tl.arange(0, NKB)
            base = part_ptr + rh * NKB * 2 * V + offs_c[:, None] * 2 * V + offs_v[None, :]
            tk = tl.sum(tl.load(base, cache_modifier=".cg"), axis=0)
            tq = tl.sum(tl.load(base + V, cache_modifier=".cg"), axis=0)
            tl.store(y_ptr + rh * 2 * V + offs_v, tk)
            tl.store(y_ptr + rh * 2 * V + V + offs_v, tq)
            tl.store(cnt_ptr + rh, 0)


@triton.jit
def _head_kernel(s_ptr, a_ptr, b_ptr, y_ptr, K, V, NKB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 STAGES: tl.constexpr):
    rh = tl.program_id(0).to(tl.int64)
    offs_v = tl.arange(0, BV)
    acc_k = tl.zeros([BV], dtype=tl.float32)
    acc_q = tl.zeros([BV], dtype=tl.float32)
    for kb in tl.range(NKB, num_stages=STAGES):
        offs_k = kb * BK + tl.arange(0, BK)
        s = tl.load(s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :])
        acc_k += tl.sum(s * tl.load(a_ptr + rh * K + offs_k)[:, None], axis=0)
        acc_q += tl.sum(s * tl.load(b_ptr + rh * K + offs_k)[:, None], axis=0)
    tl.store(y_ptr + rh * 2 * V + offs_v, acc_k)
    tl.store(y_ptr + rh * 2 * V + V + offs_v, acc_q)


@triton.jit
def _apply_like_kernel(s_ptr, vec_ptr, win_ptr, wrow_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, HV, K, V, L,
                       BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr, VB: tl.constexpr, WIN: tl.constexpr,
                       EARLY_D: tl.constexpr, SKIP: tl.constexpr = False):
    """The apply pass's non-flush work, feature by feature: ``VB`` adds v / beta and the d / o stores (d into the
    ring at slot w), ``WIN`` the cursor copy, launch 1's window scalars and the held d records (masked on w),
    ``EARLY_D`` loads all L d slots before w instead; ``SKIP``: w first, and a flush row (w = L - 1) loads and
    stores nothing (as a pass that leaves flush rows to another launch must)."""
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    rh = row * HV + h
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    offs_l = tl.arange(0, BL)
    if SKIP:
        w = tl.load(wrow_ptr + row)
        if w == L - 1:
            return
    s0 = tl.load(s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :])
    dr_base = dr_ptr + rh * L * V
    if VB:
        v = tl.load(v_ptr + rh * V + offs_v).to(tl.float32)
        beta = tl.load(beta_ptr + rh)
    if EARLY_D:
        dall = tl.load(dr_base + offs_l[:, None] * V + offs_v[None, :], mask=(offs_l < L)[:, None], other=0.0)
    if not SKIP:
        w = 0
        if WIN:
            w = tl.load(wrow_ptr + row)
    ak = tl.load(vec_ptr + rh * 3 * BK + offs_k)
    aq = tl.load(vec_ptr + rh * 3 * BK + BK + offs_k)
    sk = tl.sum(s0 * ak[:, None], axis=0)
    sq = tl.sum(s0 * aq[:, None], axis=0)
    kq = 0.0
    if WIN:
        u = tl.load(win_ptr + rh * 3 * BL + offs_l)
        uq = tl.load(win_ptr + rh * 3 * BL + BL + offs_l)
        kq = tl.load(win_ptr + rh * 3 * BL + 2 * BL)
        hist = offs_l < w
        if EARLY_D:
            dw = tl.where(hist[:, None], dall, 0.0).to(tl.float32)
        else:
            dw = tl.load(dr_base + offs_l[:, None] * V + offs_v[None, :], mask=hist[:, None], other=0.0).to(
                tl.float32)
        sk += tl.sum(u[:, None] * dw, axis=0)
        sq += tl.sum(uq[:, None] * dw, axis=0)
    if VB:
        d = beta * (v - sk)
        tl.store(y_ptr + rh * 2 * V + offs_v, sq + d * kq)
        tl.store(dr_base + w * V + offs_v, d.to(dr_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + rh * 2 * V + offs_v, sk)
        tl.store(y_ptr + rh * 2 * V + V + offs_v, sq)


@triton.jit
def _flush_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, K, V, L, offs_k, offs_v, offs_l, hist,
                   BK: tl.constexpr, BL: tl.constexpr):
    """A flushing slice's loads and readout: stores ``o`` and returns ``(st, s0, d, dec, dr_base, dw)`` (the slice's
    pointers and values, ``d``, ``exp(E_tot)``, the d ring's base and its held records)."""
    st = s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :]
    s0 = tl.load(st)
    v = tl.load(v_ptr + rh * V + offs_v).to(tl.float32)
    beta = tl.load(beta_ptr + rh)
    ak = tl.load(vec_ptr + rh * 3 * BK + offs_k)
    aq = tl.load(vec_ptr + rh * 3 * BK + BK + offs_k)
    dec = tl.load(vec_ptr + rh * 3 * BK + 2 * BK + offs_k)
    u = tl.load(win_ptr + rh * 3 * BL + offs_l)
    uq = tl.load(win_ptr + rh * 3 * BL + BL + offs_l)
    kq = tl.load(win_ptr + rh * 3 * BL + 2 * BL)
    dr_base = dr_ptr + rh * L * V
    dw = tl.load(dr_base + offs_l[:, None] * V + offs_v[None, :], mask=hist[:, None], other=0.0).to(tl.float32)
    d = beta * (v - tl.sum(s0 * ak[:, None], axis=0) - tl.sum(u[:, None] * dw, axis=0))
    tl.store(y_ptr + rh * 2 * V + offs_v, tl.sum(s0 * aq[:, None], axis=0) + tl.sum(uq[:, None] * dw, axis=0) +
             d * kq)
    return st, s0, d, dec, dr_base, dw


@triton.jit
def _fold_loop(s_new, ke_base, dr_base, lo, hi, n_live, offs_k, offs_v, V, BK: tl.constexpr,
               STAGES: tl.constexpr):
    """``s_new + Σ_{lo <= j < hi, j < n_live} KE_j ⊗ d_j``, record by record (``STAGES`` > 0: ``tl.range`` with that
    many stages; 0: a plain loop, the compiler's default pipelining)."""
    if STAGES > 0:
        for j in tl.range(lo, hi, num_stages=STAGES):
            ke_j = tl.load(ke_base + j * BK + offs_k, mask=(offs_k * 0 + j) < n_live, other=0.0)
            d_j = tl.load(dr_base + j * V + offs_v, mask=(offs_v * 0 + j) < n_live, other=0.0)
            s_new += ke_j[:, None] * d_j.to(tl.float32)[None, :]
    else:
        for j in range(lo, hi):
            ke_j = tl.load(ke_base + j * BK + offs_k, mask=(offs_k * 0 + j) < n_live, other=0.0)
            d_j = tl.load(dr_base + j * V + offs_v, mask=(offs_v * 0 + j) < n_live, other=0.0)
            s_new += ke_j[:, None] * d_j.to(tl.float32)[None, :]
    return s_new


@triton.jit
def _flush_like_kernel(s_ptr, vec_ptr, win_ptr, wrow_ptr, v_ptr, beta_ptr, k_ptr, dr_ptr, ke_ptr, y_ptr, HV, K, V,
                       L, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr, STAGES: tl.constexpr,
                       FOLD: tl.constexpr = True, KE_HEADS: tl.constexpr = 0, HALVES: tl.constexpr = False,
                       PREC: tl.constexpr = "", SEPARATE: tl.constexpr = False):
    """A flush-only pass (what a launch of its own for flush rows would do per ``K x BV`` slice): the readout, then
    ``exp(E_tot) ⊙ S_0 + k dᵀ + Σ_j KE_j ⊗ d_j`` from launch 1's scaled keys, stored in place. Non-flush rows return
    after reading w (the cost of the launch on a non-flush step). ``FOLD=False`` leaves the records out (the pass's
    read, readout and write alone). ``KE_HEADS > 0``: every (row, head) folds the scaled keys of (row, head) modulo
    that many (an L2-resident scratch: the fold's instructions without its DRAM traffic). ``HALVES``: the record loop
    as two loops of ``BL / 2`` records.

    ``PREC`` (``"tf32x3"``, ``"tf32"``, ``"ieee"``): the fold as one ``tl.dot`` in that precision instead
    (``KEᵀ [BK, BL] x D [BL, BV]`` accumulated onto ``exp(E_tot) ⊙ S_0 + k dᵀ``; in a launch of its own its layouts
    cannot reach a non-flush pass); ``SEPARATE``: the dot alone, its product added in the slice's own layout (one
    layout conversion, of the product, instead of the slice's there and back)."""
    pid_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    w = tl.load(wrow_ptr + row)
    if w != L - 1:
        return
    rh = row * HV + h
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    offs_l = tl.arange(0, BL)
    hist = offs_l < w
    st, s0, d, dec, dr_base, dw = _flush_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, K, V, L,
                                                 offs_k, offs_v, offs_l, hist, BK, BL)
    k = tl.load(k_ptr + rh * K + offs_k).to(tl.float32)
    ke_base = ke_ptr + (rh % KE_HEADS if KE_HEADS else rh) * BL * BK
    if PREC != "":
        ke_t = tl.load(ke_base + offs_l[None, :] * BK + offs_k[:, None], mask=hist[None, :], other=0.0)
        if SEPARATE:
            s_new = dec[:, None] * s0 + k[:, None] * d[None, :] + tl.dot(ke_t, dw, input_precision=PREC)
        else:
            s_new = tl.dot(ke_t, dw, acc=dec[:, None] * s0 + k[:, None] * d[None, :], input_precision=PREC)
    else:
        s_new = dec[:, None] * s0 + k[:, None] * d[None, :]
        if HALVES:
            s_new = _fold_loop(s_new, ke_base, dr_base, 0, BL // 2, w, offs_k, offs_v, V, BK, STAGES)
            s_new = _fold_loop(s_new, ke_base, dr_base, BL // 2, BL, w, offs_k, offs_v, V, BK, STAGES)
        elif FOLD:
            s_new = _fold_loop(s_new, ke_base, dr_base, 0, BL, w, offs_k, offs_v, V, BK, STAGES)
    tl.store(st, s_new)


@triton.jit
def _rmw_kernel(s_ptr, c_ptr, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """``S *= c`` per ``K x BV`` slice, in place: the flush's read-modify-write pattern with nothing else."""
    pid_v = tl.program_id(0)
    rh = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    st = s_ptr + rh * K * V + offs_k[:, None] * V + offs_v[None, :]
    tl.store(st, tl.load(st) * tl.load(c_ptr + rh * K + offs_k)[:, None])


@triton.jit
def _flush_persist_kernel(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, k_ptr, dr_ptr, ke_ptr, y_ptr, HV, K, V, L,
                          n_items, n_vb, BK: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
                          STAGES: tl.constexpr):
    """:func:`_flush_like_kernel` (every row flushing) as a fixed grid, each program walking items ``(V-block,
    row, head)`` ``pid, pid + nprog, ...`` in a software-pipelined loop: the next item's loads are issued while this
    one reduces, folds and stores (the flush pass is latency-bound per program, not bandwidth-bound)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_k = tl.arange(0, BK)
    offs_l = tl.arange(0, BL)
    for it in tl.range(pid, n_items, nprog, num_stages=STAGES):
        pid_v = it % n_vb
        rh = (it // n_vb).to(tl.int64)
        offs_v = pid_v * BV + tl.arange(0, BV)
        st, s0, d, dec, dr_base, dw = _flush_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, K,
                                                     V, L, offs_k, offs_v, offs_l, offs_l < L - 1, BK, BL)
        k = tl.load(k_ptr + rh * K + offs_k).to(tl.float32)
        s_new = dec[:, None] * s0 + k[:, None] * d[None, :]
        s_new = _fold_loop(s_new, ke_ptr + rh * BL * BK, dr_base, 0, BL, L - 1, offs_k, offs_v, V, BK, 0)
        tl.store(st, s_new)


def rotating_time(launch, copies: int, once: bool = False) -> float:
    """µs per call of ``launch(i)``, ``i`` rotating over ``copies`` buffer sets (cold L2), inside a CUDA graph; NaN
    after one plain launch with ``once`` (for Nsight Compute)."""
    if once:
        launch(0)
        torch.cuda.synchronize()
        return float("nan")
    it = [0]

    def step():
        launch(it[0] % copies)
        it[0] += 1
    return time_graph(step, inner=8 * copies)


def flush_inputs(bs: int, HV: int, K: int, V: int, L: int, BL: int, copies: int, dev: str = "cuda"):
    """Random stand-ins for what the split step's passes read beside the checkpoint, laid out as there: launch 1's
    scratch ``vec [bs*HV, 3K]`` and ``win [bs*HV, 3BL]``, ``v [bs*HV, V]`` (bf16), ``beta [bs*HV]``, ``k [bs*HV, K]``
    (bf16), ``copies`` d rings ``[bs*HV, L, V]`` (bf16) and the scaled keys ``ke [bs*HV, BL*K]``."""
    n = bs * HV
    return (torch.randn(n, 3 * K, device=dev), torch.randn(n, 3 * BL, device=dev),
            torch.randn(n, V, device=dev, dtype=torch.bfloat16), torch.rand(n, device=dev),
            torch.randn(n, K, device=dev, dtype=torch.bfloat16),
            [torch.randn(n, L, V, device=dev, dtype=torch.bfloat16) for _ in range(copies)],
            torch.randn(n, BL * K, device=dev))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--forms", default="slice,chunk,head,apply,flush,flushdot,flushparts,persist",
                   help="which of the forms above to time (also: dotsep, the separate-product dots only; w4, the "
                        "4-warp rows of flushparts only; ncu, one record-loop and two dot flushes)")
    p.add_argument("--once", action="store_true",
                   help="launch each form once instead of timing it (for Nsight Compute: ncu --kernel-name ...)")
    args = p.parse_args(argv)
    forms = args.forms.split(",")
    K = V = 128
    bs, HV = args.batch, args.heads
    warm_clocks()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; fp32 state "
          f"[{bs}, {HV}, {K}, {V}]")
    copies = 2
    states = [torch.randn(bs * HV, K, V, device="cuda") for _ in range(copies)]
    a = torch.randn(bs * HV, K, device="cuda")
    b = torch.randn(bs * HV, K, device="cuda")
    ref = [torch.stack([torch.einsum("rkv,rk->rv", s, a), torch.einsum("rkv,rk->rv", s, b)], 1) for s in states]
    ys = [torch.full((bs * HV, 2, V), float("nan"), device="cuda") for _ in range(copies)]
    floor_us = (states[0].numel() * 4 + 2 * a.numel() * 4 + ys[0].numel() * 4) / bw * 1e6

    def timed(launch):
        return rotating_time(launch, copies, args.once)

    def line(label, us, floor=floor_us, what="of floor", extra=""):
        print(f"{label:28s} {us:8.1f} us  {floor / us * 100:5.1f}% {what}{extra}", flush=True)

    def checked(label, launch, result=None):
        """Run ``launch`` on every buffer set, compare with torch (``result(i)`` reads the output), then time it."""
        for i in range(copies):
            ys[i].fill_(float("nan"))
            launch(i)
            torch.cuda.synchronize()
            if result is not None:
                ys[i].copy_(result(i))
        err = max(((ys[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(copies))
        line(label, timed(launch), extra=f"  rel err {err:.1e}")

    for bv, warps in () if "slice" not in forms else ((32, 2), (32, 1), (64, 2), (64, 4), (16, 1)):
        checked(f"slice {bv}/{warps}", lambda i, bv=bv, w=warps: _slice_kernel[(V // bv, bs * HV)](
            states[i], a, b, ys[i], K, V, BK=K, BV=bv, num_warps=w))
    chunks = ((16, 1, 0), (16, 2, 0), (32, 2, 0), (32, 4, 0), (64, 4, 0), (16, 2, 1), (32, 2, 1), (32, 4, 1))
    for bk, warps, last in () if "chunk" not in forms else chunks:
        nkb = K // bk
        part = torch.empty(bs * HV, nkb, 2, V, device="cuda")
        cnt = torch.zeros(bs * HV, dtype=torch.int32, device="cuda")
        checked(f"{'chunk+last' if last else 'chunk'} {bk}/{warps}",
                lambda i, bk=bk, w=warps, nkb=nkb, part=part, cnt=cnt, last=last: _chunk_kernel[(nkb, bs * HV)](
                    states[i], a, b, part, cnt, ys[i], K, V, NKB=nkb, BK=bk, BV=V, LAST=bool(last), num_warps=w),
                None if last else lambda i, part=part: part.sum(1))   # without the combine the partials are out
    heads = ((16, 2, 3), (32, 4, 2), (32, 4, 3), (16, 4, 4), (32, 8, 2))
    for bk, warps, stages in () if "head" not in forms else heads:
        checked(f"head {bk}/{warps}/{stages}", lambda i, bk=bk, w=warps, st=stages: _head_kernel[(bs * HV,)](
            states[i], a, b, ys[i], K, V, NKB=K // bk, BK=bk, BV=V, STAGES=st, num_warps=w))

    # the passes below use launch 1's scratch and the rings as the real step lays them out; their outputs are not
    # checked (d is written back into the ring, the checkpoint folded in place), only timed
    L, BL = 16, 16
    vec, win, vin, beta, kin, drs, ke = flush_inputs(bs, HV, K, V, L, BL, copies)
    wrow = torch.randint(0, L - 1, (bs,), device="cuda", dtype=torch.int32)
    rw = 2 * floor_us                               # the read + write floor of a flush pass
    features = ((0, 0, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 0, 128), (0, 1, 0, 0))
    for vb, wn, ed, nreg in () if "apply" not in forms else features:
        opts = {"maxnreg": nreg} if nreg else {}
        line(f"apply-like vb={vb} win={wn} early_d={ed} maxnreg={nreg}", timed(
            lambda i, vb=vb, wn=wn, ed=ed, opts=opts: _apply_like_kernel[(V // 32, bs, HV)](
                states[i], vec, win, wrow, vin, beta, drs[i], ys[i], HV, K, V, L, BK=K, BV=32, BL=BL, VB=vb, WIN=wn,
                EARLY_D=ed, num_warps=2, **opts)), what="of the state floor")
    for frac in () if "apply" not in forms else (0.0, 0.5):   # skipping flush rows: none, then half of them
        wr = torch.where(torch.rand(bs, device="cuda") < frac, L - 1, wrow).to(torch.int32)
        us = timed(lambda i, wr=wr: _apply_like_kernel[(V // 32, bs, HV)](
            states[i], vec, win, wr, vin, beta, drs[i], ys[i], HV, K, V, L, BK=K, BV=32, BL=BL, VB=1, WIN=1,
            EARLY_D=0, SKIP=True, num_warps=2))
        print(f"{f'apply-like skip, {frac:.0%} flush rows':28s} {us:8.1f} us", flush=True)
    for frac in () if "flush" not in forms else (1.0, 0.0):   # flush-only passes: every row flushing, then none
        wr = torch.full((bs,), L - 1 if frac else 0, device="cuda", dtype=torch.int32)
        for bv, warps, stages in ((32, 2, 4), (32, 2, 2), (16, 1, 4), (16, 1, 2), (8, 1, 4), (16, 2, 4)):
            line(f"flush-like {bv}/{warps}/{stages}, {frac:.0%} flush", timed(
                lambda i, wr=wr, bv=bv, w=warps, st=stages: _flush_like_kernel[(V // bv, bs, HV)](
                    states[i], vec, win, wr, vin, beta, kin, drs[i], ke, ys[i], HV, K, V, L, BK=K, BV=bv, BL=BL,
                    STAGES=st, num_warps=w)), rw, "of the read+write floor")

    dots = ((32, 4, "tf32x3", 0), (64, 4, "tf32x3", 0), (32, 2, "tf32x3", 0), (32, 4, "tf32", 0),
            (32, 4, "ieee", 0), (64, 8, "tf32x3", 0), (32, 4, "tf32x3", 1), (32, 2, "tf32x3", 1),
            (32, 4, "tf32", 1), (32, 2, "tf32", 1), (64, 4, "tf32x3", 1), (32, 4, "ieee", 1))
    dots = dots if "flushdot" in forms else [x for x in dots if x[3]] if "dotsep" in forms else ()
    if "ncu" in forms:                              # one record-loop flush (below), a tf32 and a tf32x3 dot
        dots = ((32, 4, "tf32", 1), (32, 4, "tf32x3", 1))
    wr_all = torch.full((bs,), L - 1, device="cuda", dtype=torch.int32)
    for bv, warps, prec, sep in dots:               # the fold as one dot, in a flush-only pass, every row flushing
        line(f"flush-dot {bv}/{warps} {prec} separate={sep}", timed(
            lambda i, bv=bv, w=warps, prec=prec, sep=sep: _flush_like_kernel[(V // bv, bs, HV)](
                states[i], vec, win, wr_all, vin, beta, kin, drs[i], ke, ys[i], HV, K, V, L, BK=K, BV=bv, BL=BL,
                STAGES=4, PREC=prec, SEPARATE=bool(sep), num_warps=w)), rw, "of the read+write floor")

    parts_on = "flushparts" in forms or "w4" in forms   # where a flush pass's time goes
    for bv, warps in () if not parts_on else ((32, 4),) if "w4" in forms else ((32, 2), (8, 1), (16, 1), (32, 4)):
        line(f"rmw {bv}/{warps}", timed(lambda i, bv=bv, w=warps: _rmw_kernel[(V // bv, bs * HV)](
            states[i], a, K, V, BK=K, BV=bv, num_warps=w)), rw, "of the read+write floor")
    parts = ((16, False, 32, 2, 0, 0), (16, False, 16, 1, 0, 0), (8, True, 32, 2, 0, 0), (4, True, 32, 2, 0, 0),
             (16, True, 32, 2, 0, 0), (16, True, 64, 4, 0, 0), (16, True, 32, 2, 64, 0), (8, True, 32, 2, 64, 0),
             (16, True, 32, 2, 0, 1), (16, True, 32, 2, 64, 1), (16, False, 32, 4, 0, 0), (16, True, 32, 4, 0, 0),
             (16, True, 32, 4, 64, 0), (8, True, 32, 4, 0, 0))
    parts = () if not parts_on else [x for x in parts if x[3] == 4] if "w4" in forms else parts
    parts = ((16, True, 32, 2, 0, 0),) if "ncu" in forms else parts
    for bl, fold, bv, warps, keh, halves in parts:  # ring length = window: every record folded (w = L - 1)
        wr = torch.full((bs,), bl - 1, device="cuda", dtype=torch.int32)
        vec_l = torch.randn(bs * HV, 3 * K, device="cuda")
        win_l = torch.randn(bs * HV, 3 * bl, device="cuda")
        drs_l = [torch.randn(bs * HV, bl, V, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        line(f"flush-like {bv}/{warps} L={bl} fold={int(fold)} ke_heads={keh} halves={halves}", timed(
            lambda i, wr=wr, bv=bv, w=warps, bl=bl, fold=fold, vec_l=vec_l, win_l=win_l, drs_l=drs_l, keh=keh,
            halves=halves: _flush_like_kernel[(V // bv, bs, HV)](
                states[i], vec_l, win_l, wr, vin, beta, kin, drs_l[i], ke, ys[i], HV, K, V, bl, BK=K, BV=bv, BL=bl,
                STAGES=4, FOLD=fold, KE_HEADS=keh, HALVES=bool(halves), num_warps=w)), rw, "of the read+write floor")

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    persists = ((32, 2, 8, 2), (32, 2, 16, 2), (32, 2, 8, 3), (32, 2, 4, 2), (16, 1, 16, 2), (16, 1, 32, 2),
                (32, 4, 8, 2), (32, 2, 8, 1))
    for bv, warps, per_sm, stages in () if "persist" not in forms else persists:
        n_vb = V // bv                              # the flush pass as a fixed, software-pipelined grid
        us = reported(f"persist {bv}/{warps} x{per_sm}/SM stages {stages}", timed,
                      lambda i, bv=bv, w=warps, per_sm=per_sm, st=stages, n_vb=n_vb: _flush_persist_kernel[
                          (n_sm * per_sm,)](states[i], vec, win, vin, beta, kin, drs[i], ke, ys[i], HV, K, V, L,
                                            bs * HV * n_vb, n_vb, BK=K, BV=bv, BL=BL, STAGES=st, num_warps=w))
        if us is not None:
            line(f"flush-persist {bv}/{warps} {per_sm}/SM st{stages}", us, rw, "of the read+write floor")


if __name__ == "__main__":
    main()
