"""The ``pre`` step's checkpoint pass as a persistent, software-pipelined loop (``persist=1``; off by default).

The default pass (:func:`~replay_compile.kernels.mamba2_pre_triton._mamba2_prepass_apply_kernel`) gives every
``BLOCK_P x N`` checkpoint tile a program of its own: it loads the tile, reduces it against ``C`` and exits, so the
bytes one SM has in flight are bounded by how many such programs fit in its registers. With bf16 checkpoints that
left the non-flush step at 77-85% of the bandwidth floor (issue 3 asks 90% at bs >= 128; H200 sessions 12-14).

Here a fixed grid of programs walks the ``b x H x cdiv(P, BLOCK_P)`` tiles in a ``tl.range(..., num_stages=S)``
loop. Triton pipelines the loop's loads through shared memory (``cp.async`` on Hopper): the next ``S - 1`` tiles
stream in while this one is reduced, without the registers a second resident tile would take. The body is
branch-free (a loop cannot ``return`` per tile): padding rows and rows that flush this step are masked out of every
load and store, and a padding row's output is stored as zeros, exactly as the per-tile pass does.

Same arguments and contract as the per-tile pass with ``ROUTE=1`` and a window of per-record weights (``WIN_X`` 1 or
2): flush rows are left to the listed flush launch; the x record is appended here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import launch, pdl_options


@triton.jit
def _mamba2_prepass_persistent_kernel(
    state_ptr, xr_ptr, cursor_ptr, x_ptr, C_ptr, slot_ptr, y_ptr, win_ptr, dec_ptr,
    H, P, N, L, heads_per_gc, n_pb, n_items,
    s_sb, s_sh, s_sp, s_sn, s_xrb, s_xrh, s_xrl, s_xrp, s_xb, s_xh, s_xp, s_cb, s_cg, s_cn, s_yb, s_yh, s_yp,
    HAS_SLOT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    EARLY_TILE: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
):
    """Grid ``(programs,)``; item ``t`` of ``n_items = b * H * n_pb`` is tile ``t % n_pb`` of head
    ``(t // n_pb) % H`` of row ``t // (n_pb * H)`` (consecutive items of a program are ``programs`` apart).
    Per item: ``y = decay (S_0 C) + Σ_j cb_j x_j`` over the window's weights ``cb`` (``win_ptr``, ``[b, H,
    BLOCK_L]``, zero past the cursor) and decay (``dec_ptr``, ``[b, H]``) from the window launch; ``x`` appended at
    the cursor's slot. ``EARLY_TILE``: the tile's load does not wait for the cursor (a flushing row's tile is then
    read and dropped). ``PDL``: the window launch's outputs are read only after ``gdc_wait``, issued once before
    the loop."""
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_l = tl.arange(0, BLOCK_L)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for t in tl.range(tl.program_id(0), n_items, tl.num_programs(0), num_stages=STAGES):
        item = tl.cast(t, tl.int64)                  # (the interpreter's loop index is a Python int)
        row = item // (n_pb * H)
        h = (item // n_pb) % H
        offs_p = (item % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        if HAS_SLOT:
            slot_raw = tl.load(slot_ptr + row).to(tl.int64)
        else:
            slot_raw = row
        pad = slot_raw < 0
        slot = tl.maximum(slot_raw, 0)
        w = tl.load(cursor_ptr + slot)               # slot 0 stands in for a padding row: read, never used
        run = (slot_raw >= 0) & (w != L - 1)         # a padding row or one that flushes this step: nothing to read
        # per-item masks as bounds (P or 0 ...): a scalar condition never broadcast into a vector mask (the
        # interpreter turns such masks into integers)
        mask_pr = offs_p < tl.where(run, P, 0)
        s_ptrs = state_ptr + slot * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
        if EARLY_TILE:
            s0 = tl.load(s_ptrs, mask=(offs_p < tl.where(pad, 0, P))[:, None] & mask_n[None, :], other=0.0)
        else:
            s0 = tl.load(s_ptrs, mask=mask_pr[:, None] & mask_n[None, :], other=0.0)
        c = tl.load(C_ptr + row * s_cb + (h // heads_per_gc) * s_cg + offs_n * s_cn,
                    mask=offs_n < tl.where(run, N, 0), other=0.0).to(tl.float32)
        xr_row = xr_ptr + slot * s_xrb + h * s_xrh
        # history slots only: the ones at and past the cursor are stale (may be NaN) and weigh nothing
        xw = tl.load(xr_row + offs_l[:, None] * s_xrl + offs_p[None, :] * s_xrp,
                     mask=(offs_l < w)[:, None] & mask_pr[None, :], other=0.0).to(tl.float32)
        x_cur = tl.load(x_ptr + row * s_xb + h * s_xh + offs_p * s_xp, mask=mask_pr, other=0.0)
        cbv = tl.load(win_ptr + (row * H + h) * BLOCK_L + offs_l, mask=offs_l < tl.where(run, BLOCK_L, 0), other=0.0)
        decay = tl.where(run, tl.load(dec_ptr + row * H + h), 0.0)
        xw = tl.where((offs_l == w)[:, None], x_cur.to(tl.float32)[None, :], xw)
        tl.store(xr_row + w * s_xrl + offs_p * s_xrp, x_cur.to(xr_ptr.dtype.element_ty), mask=mask_pr)
        y = decay * tl.sum(s0.to(tl.float32) * c[None, :], axis=1) + tl.sum(cbv[:, None] * xw, axis=0)
        # padding rows: every load above was masked, so y is 0 (stored); flush rows: the flush launch writes y
        tl.store(y_ptr + row * s_yb + h * s_yh + offs_p * s_yp, y, mask=offs_p < tl.where(run | pad, P, 0))


def persistent_programs(n_items: int, block_p: int, block_n: int, state_bytes: int, stages: int, warps: int,
                        sms: int, per_sm: int | None) -> int:
    """Programs of the persistent pass: ``per_sm`` per SM if given, else as many as the SM's shared memory holds
    with ``stages`` tile buffers each (~200 KB usable of the H200's 228 KB) and at most 32 warps per SM; never more
    than there are tiles."""
    if not per_sm:
        smem = max(1, stages) * block_p * block_n * state_bytes
        per_sm = max(1, min(32 // warps, (200 * 1024) // smem))
    return max(1, min(n_items, per_sm * sms))


def launch_persistent_pass(cfg: dict, args: tuple, win, dec, has_slot: bool, n_pb: int, early_tile: bool,
                           pdl: bool, sms: int):
    """Launch :func:`_mamba2_prepass_persistent_kernel` for the ``pre`` step; ``args`` is the tiled kernel's argument
    tuple (see :func:`~replay_compile.kernels.mamba2_pre_triton.replay_step_pre`). Returns the compiled kernel."""
    state, x_ring, _, _, _, cursor, x, _, _, _, C, slot_arg, y = args[:13]
    S, H, P, N = state.shape
    b, L = x.shape[0], x_ring.shape[2]
    n_items = b * H * n_pb
    stages = cfg["persist_stages"]
    programs = persistent_programs(n_items, cfg["BLOCK_P"], cfg["BLOCK_N"], state.element_size(), stages,
                                   cfg["num_warps"], sms, cfg["persist_per_sm"])
    return launch(_mamba2_prepass_persistent_kernel)[(programs,)](
        state, x_ring, cursor, x, C, slot_arg, y, win, dec,
        H, P, N, L, H // C.shape[1], n_pb, n_items,
        *state.stride(), *x_ring.stride(), *x.stride(), *C.stride(), *y.stride(),
        HAS_SLOT=has_slot, BLOCK_P=cfg["BLOCK_P"], BLOCK_N=cfg["BLOCK_N"], BLOCK_L=cfg["BLOCK_L"],
        EARLY_TILE=early_tile, PDL=pdl, STAGES=stages, num_warps=cfg["num_warps"], **pdl_options(pdl))
