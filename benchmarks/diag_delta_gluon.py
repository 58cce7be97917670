"""The KDA flush fold on the tensor cores, written in Gluon (KDA, batch 256).

    python benchmarks/diag_delta_gluon.py [--batch 256] [--heads 32]          # on the GPU machine (triton 3.6)
    python benchmarks/diag_delta_gluon.py --compile-only                      # anywhere: sm_90 resources

``docs/design/delta_kernel.md``: the flush pass's record fold was found issue-bound on CUDA-core fp32 (two thirds of
its instructions; its FMAs alone ~64 µs at bs256), and ``tl.dot`` no faster: the accumulator's layout is not the
slice's, so every program converts the slice through shared memory, and the dots stalled at 4-5 programs per SM.
Gluon (``triton.experimental.gluon``) lets the slice be loaded and stored in the MMA accumulator's own layout and
the operands be loaded straight into theirs, so the fold becomes ``mma_v2`` instructions with no conversion of the
``K x BV`` slice at all. The scaled keys are fp32 (tf32 split into a high and a low part, two MMAs); the corrected
values ``d_j`` are bf16 records, exact in tf32, so ``KEᵀ D`` comes out at about fp32 accuracy.

:func:`_gl_flush_kernel` does what ``diag_delta_stream.py``'s ``_flush_like_kernel`` does (every row flushing, the
scratch and rings laid out as there); this script checks it against that kernel on the same inputs and times both.
A diagnostic (H200 results: ``benchmarks/results/delta_kernel_designs_h200/gluon_*.txt``): no baseline, no speed
claim. Gluon kernels do not run under the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, os.path.dirname(__file__))


@gluon.jit
def _tf32_parts(x):
    """``x = hi + lo`` with ``hi`` exact in tf32 (its low 13 mantissa bits cleared)."""
    hi = (x.to(gl.uint32, bitcast=True) & 0xFFFFE000).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _gl_slice_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, w, pid_v, K, V, L,
                      BK: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, NW: gl.constexpr, LAYOUT: gl.constexpr):
    """A flushing slice's prologue, shared by the forms below: the ``BK x BV`` slice loaded in ``LAYOUT``, the
    readout (``o`` stored) from launch 1's window (its sums in a plain layout, a ``[BV]`` vector converted once).
    Returns ``(slice pointers, S_0, d, row offsets, column offsets, d ring base)``."""
    WIN: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    rows = gl.arange(0, BK, layout=gl.SliceLayout(1, LAYOUT))
    cols = pid_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, LAYOUT))
    st = s_ptr + rh * K * V + rows[:, None] * V + cols[None, :]
    s0 = gl.load(st)
    v = gl.load(v_ptr + rh * V + cols).to(gl.float32)
    beta = gl.load(beta_ptr + rh)
    ak = gl.load(vec_ptr + rh * 3 * BK + rows)
    aq = gl.load(vec_ptr + rh * 3 * BK + BK + rows)
    dr_base = dr_ptr + rh * L * V
    lw = gl.arange(0, BL, layout=gl.SliceLayout(1, WIN))
    cw = pid_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, WIN))
    dw = gl.load(dr_base + lw[:, None] * V + cw[None, :], mask=(lw < w)[:, None], other=0.0).to(gl.float32)
    u = gl.load(win_ptr + rh * 3 * BL + lw)
    uq = gl.load(win_ptr + rh * 3 * BL + BL + lw)
    kq = gl.load(win_ptr + rh * 3 * BL + 2 * BL)
    su = gl.convert_layout(gl.sum(u[:, None] * dw, axis=0), gl.SliceLayout(0, LAYOUT))
    suq = gl.convert_layout(gl.sum(uq[:, None] * dw, axis=0), gl.SliceLayout(0, LAYOUT))
    d = beta * (v - gl.sum(s0 * ak[:, None], axis=0) - su)
    gl.store(y_ptr + rh * 2 * V + cols, gl.sum(s0 * aq[:, None], axis=0) + suq + d * kq)
    return st, s0, d, rows, cols, dr_base


@gluon.jit
def _gl_flush_kernel(s_ptr, vec_ptr, win_ptr, wrow_ptr, v_ptr, beta_ptr, k_ptr, dr_ptr, ke_ptr, y_ptr, HV, K, V, L,
                     BK: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr):
    """One ``BK x BV`` slice of a flushing row: the readout (``o`` stored, ``d``), then
    ``exp(E_tot) ⊙ S_0 + k dᵀ + KEᵀ D`` in the accumulator's layout, stored in place. ``SPLIT``: the scaled keys as
    tf32 high + low parts (two MMAs; ``d`` is bf16, exact in tf32); otherwise one tf32 MMA (about 1e-3 relative)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=1)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=1)
    pid_v = gl.program_id(0)
    row = gl.program_id(1).to(gl.int64)
    h = gl.program_id(2).to(gl.int64)
    w = gl.load(wrow_ptr + row)
    if w != L - 1:
        return
    rh = row * HV + h
    # the slice in the accumulator's layout; the records again below, as the MMA's B operand
    st, s0, d, rows, cols, dr_base = _gl_slice_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, w,
                                                       pid_v, K, V, L, BK, BV, BL, NW, ACC)
    dec = gl.load(vec_ptr + rh * 3 * BK + 2 * BK + rows)
    k = gl.load(k_ptr + rh * K + rows).to(gl.float32)
    acc = dec[:, None] * s0 + k[:, None] * d[None, :]
    ka = gl.arange(0, BK, layout=gl.SliceLayout(1, OPA))
    la = gl.arange(0, BL, layout=gl.SliceLayout(0, OPA))
    a = gl.load(ke_ptr + rh * BL * BK + la[None, :] * BK + ka[:, None], mask=(la < w)[None, :], other=0.0)
    lb = gl.arange(0, BL, layout=gl.SliceLayout(1, OPB))
    cb = pid_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, OPB))
    b = gl.load(dr_base + lb[:, None] * V + cb[None, :], mask=(lb < w)[:, None], other=0.0).to(gl.float32)
    if SPLIT:
        a_hi, a_lo = _tf32_parts(a)
        acc = mma_v2(a_lo, b, acc, input_precision="tf32")
        acc = mma_v2(a_hi, b, acc, input_precision="tf32")
    else:
        acc = mma_v2(a, b, acc, input_precision="tf32")
    gl.store(st, acc)


@gluon.jit
def _gl_rows_flush_kernel(s_ptr, vec_ptr, win_ptr, wrow_ptr, v_ptr, beta_ptr, k_ptr, dr_ptr, kr_ptr, gr_ptr, gw_ptr,
                          y_ptr, HV, K, V, L, BK: gl.constexpr, BV: gl.constexpr, BL: gl.constexpr, NW: gl.constexpr,
                          FOLD: gl.constexpr):
    """The flush-only pass with each thread owning whole rows of its ``BK x BV`` slice (``[1, BV]`` per thread, 32
    rows per warp), so that a row's scaled key ``KE_j[r] = k_j[r] exp(G_w[r] - G_j[r])`` is computed once, by the
    thread that folds it, straight from the rings (``kr`` bf16 and ``gr`` fp32 ``[rh, L, K]``, ``gw = G_w [rh, K]``):
    no scaled-key scratch for launch 1 to write and this pass to read back, 2 exps per thread and record instead of
    the row layout's 16 (each of its rows sits on 8 lanes). The readout's sums over K cross lanes instead.
    ``FOLD=False``: the read, readout and write alone. On the H200 (bs256): correct (1.2e-7), but 691-1787 µs
    against the record loop's 432, and 612 µs without the fold: a warp's loads then touch 32 rows 16 bytes each and
    the readout shuffles every column across 32 lanes."""
    ROWS: gl.constexpr = gl.BlockedLayout([1, BV], [32, 1], [NW, 1], [1, 0])
    pid_v = gl.program_id(0)
    row = gl.program_id(1).to(gl.int64)
    h = gl.program_id(2).to(gl.int64)
    w = gl.load(wrow_ptr + row)
    if w != L - 1:
        return
    rh = row * HV + h
    st, s0, d, rows, cols, dr_base = _gl_slice_readout(s_ptr, vec_ptr, win_ptr, v_ptr, beta_ptr, dr_ptr, y_ptr, rh, w,
                                                       pid_v, K, V, L, BK, BV, BL, NW, ROWS)
    k = gl.load(k_ptr + rh * K + rows).to(gl.float32)
    g_w = gl.load(gw_ptr + rh * K + rows)
    s_new = gl.exp(gl.minimum(g_w, 0.0))[:, None] * s0 + k[:, None] * d[None, :]
    if FOLD:
        kr_base = kr_ptr + rh * L * K
        gr_base = gr_ptr + rh * L * K
        for j in gl.static_range(BL - 1):
            live = (rows * 0 + j) < w
            k_j = gl.load(kr_base + j * K + rows, mask=live, other=0.0).to(gl.float32)
            g_j = gl.load(gr_base + j * K + rows, mask=live, other=0.0)
            d_j = gl.load(dr_base + j * V + cols, mask=(cols * 0 + j) < w, other=0.0).to(gl.float32)
            ke_j = k_j * gl.exp(gl.minimum(g_w - g_j, 0.0))
            s_new = s_new + ke_j[:, None] * d_j[None, :]
    gl.store(st, s_new)


# (BV, warps, fold) of the rows-layout flush timed and compiled: two whole rows per thread on 2 warps, one on 4
ROWS_FORMS = ((32, 2, True), (32, 4, True), (64, 4, True), (16, 2, True))


def _compile_report(fn, const: dict, warps: int, ptrs: dict, label: str):
    """``fn`` compiled for sm_90 without a GPU (``diag_registers.compile_cuda``, specialised as a launch
    specialises it); prints its resources and most frequent SASS opcodes after ``label``."""
    from diag_registers import compile_cuda, resources, sass_census
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = compile_cuda(fn, const, warps, ptrs, aligned=True, source=GluonASTSource)
    n, ops = sass_census(kernel)
    top = ", ".join(f"{op} {c}" for op, c in ops.most_common(12))
    print(f"{fn.__name__} {label}: {resources(kernel)}; {n} SASS instructions: {top}", flush=True)


def compile_only():
    """Compile both kernels' forms for sm_90 without a GPU and print their resources."""
    ptrs = {"wrow_ptr": "i32", "v_ptr": "bf16", "k_ptr": "bf16", "dr_ptr": "bf16"}
    for bv, warps, split in ((32, 2, True), (32, 2, False), (32, 4, True), (32, 4, False), (64, 4, True)):
        _compile_report(_gl_flush_kernel, dict(BK=128, BV=bv, BL=16, NW=warps, SPLIT=split), warps, ptrs,
                        f"{bv} wide, {warps} warps, split={split}")
    ptrs = dict(ptrs, kr_ptr="bf16")
    for bv, warps, fold in ROWS_FORMS + ((32, 2, False),):
        _compile_report(_gl_rows_flush_kernel, dict(BK=128, BV=bv, BL=16, NW=warps, FOLD=fold), warps, ptrs,
                        f"{bv} wide, {warps} warps, fold={fold}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    from bench_mamba2_kernel import copy_bandwidth, reported, warm_clocks
    from diag_delta_stream import _flush_like_kernel, flush_inputs, rotating_time

    K = V = 128
    L = BL = 16
    bs, HV = args.batch, args.heads
    warm_clocks()
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; fp32 state [{bs}, {HV}, {K}, {V}], "
          f"every row flushing")
    dev = "cuda"
    copies = 2
    states = [torch.randn(bs * HV, K, V, device=dev) for _ in range(copies)]
    vec, win, vin, beta, kin, drs, ke = flush_inputs(bs, HV, K, V, L, BL, copies, dev)
    wr = torch.full((bs,), L - 1, device=dev, dtype=torch.int32)
    ys = [torch.empty(bs * HV, 2, V, device=dev) for _ in range(copies)]
    floor_us = 2 * states[0].numel() * 4 / bw * 1e6

    def loop(i):
        _flush_like_kernel[(V // 32, bs, HV)](states[i], vec, win, wr, vin, beta, kin, drs[i], ke, ys[i], HV, K, V, L,
                                              BK=K, BV=32, BL=BL, STAGES=4, num_warps=2)

    def mma(i, warps, split, bv=32):
        _gl_flush_kernel[(V // bv, bs, HV)](states[i], vec, win, wr, vin, beta, kin, drs[i], ke, ys[i], HV, K, V, L,
                                            BK=K, BV=bv, BL=BL, NW=warps, SPLIT=split, num_warps=warps)

    # rings for the rows form, which scales the keys itself: k records, summed log-gates G_j (<= 0, decreasing) and
    # G_w; the record loop's scaled keys and exp(E_tot) are made from the same, so both fold the same records
    n = bs * HV
    kr = (torch.randn(n, L, K, device=dev) / K ** 0.5).to(torch.bfloat16)
    steps = -torch.rand(n, L + 1, K, device=dev) * 0.1
    gcum = steps.cumsum(1)
    gr, gw = gcum[:, :L].contiguous(), gcum[:, L - 1].contiguous()
    held = (torch.arange(BL, device=dev) < L - 1).view(1, BL, 1)
    ke_true = torch.where(held, kr.float() * torch.exp(torch.clamp(gw[:, None] - gr, max=0.0)), 0.0)
    ke.copy_(ke_true.reshape(n, BL * K))
    vec[:, 2 * K:].copy_(torch.exp(torch.clamp(gw, max=0.0)))

    def rows(i, bv, warps, fold=True):
        _gl_rows_flush_kernel[(V // bv, bs, HV)](states[i], vec, win, wr, vin, beta, kin, drs[i], kr, gr, gw, ys[i],
                                                 HV, K, V, L, BK=K, BV=bv, BL=BL, NW=warps, FOLD=fold,
                                                 num_warps=warps)

    # same inputs, one flush each: the fold's result and the outputs against the FMA record loop
    base = states[0].clone()
    loop(0)
    want_s, want_o = states[0].clone(), ys[0][:, 0].clone()
    forms = {"record loop 32/2": loop}
    for warps in (2, 4):
        for split in (True, False):
            forms[f"mma {warps} warps split={split}"] = lambda i, w=warps, s=split: mma(i, w, s)
    forms["mma 64 wide, 4 warps split=True"] = lambda i: mma(i, 4, True, 64)
    for bv, warps, fold in ROWS_FORMS:
        forms[f"rows {bv} wide, {warps} warps"] = lambda i, b=bv, w=warps: rows(i, b, w)
    no_fold = {"rows 32/2 without the fold": lambda i: rows(i, 32, 2, False)}
    def errors(fn):
        """Relative errors of one flush by ``fn`` from the same checkpoint, against the record loop's."""
        states[0].copy_(base)
        fn(0)
        torch.cuda.synchronize()
        return (float((states[0] - want_s).norm() / want_s.norm()),
                float((ys[0][:, 0] - want_o).norm() / want_o.norm()))

    for label, fn in list(forms.items())[1:]:
        err = reported(label, errors, fn)           # None: failed (reported); the other forms still run
        if err is None:
            del forms[label]
            continue
        print(f"{label:28s} rel err vs the record loop: checkpoint {err[0]:.1e}, o {err[1]:.1e}", flush=True)
    forms.update(no_fold)                          # timed only: it skips the records, so it differs by design
    for label, fn in forms.items():
        us = reported(label, rotating_time, fn, copies)
        if us is not None:
            print(f"{label:28s} {us:8.1f} us  {floor_us / us * 100:5.1f}% of the read+write floor", flush=True)


if __name__ == "__main__":
    main()
