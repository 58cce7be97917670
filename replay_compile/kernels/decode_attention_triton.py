"""Decode attention in Triton: split-K ("flash decoding") over the cache, grouped-query heads read once.

Same signature and contract as :func:`~.decode_attention_reference.decode_attention_reference` (shapes there).

Bytes. A decode step's attention must read each key/value head's filled positions once: ``b * KV * S_filled *
(dk + dv) * itemsize``. transformers' compiled path first copies every static position of the cache into ``H``
expanded heads (``repeat_kv``), then SDPA reads the copy: ``(1 + 2G)`` times the whole static cache. Here one
program owns one (row, key/value head) pair and a range of positions; its ``G`` query heads times ``T`` window
tokens are the rows of one ``tl.dot`` tile, so each key and value is loaded once for all of them. The loop runs over
the positions between the first and the last one the row's mask keeps (found by a scan of the mask first), a tile
that the mask hides for every query row is skipped, and the loads are predicated by the mask: only kept positions
are read, whatever the static cache's length. (A speculative round's mask keeps each row's tokens and a scratch
window at the cache's end; without the skip its tiles between them cost 5x a decode step's attention: 2.18 ms per
round for 8 layers at batch 256, T = 4, Qwen3.5-4B dims, H100.)

Parallelism. ``b * KV`` programs fill the SMs from batch 17 on (8 key/value heads, 132 SMs); below that the
positions are split ``n_split`` ways, each split keeping its running maximum, normaliser and weighted sum in
float32, and a second launch combines them (the log-sum-exp rule), one program per (pair, block of value columns).
With one split the first launch writes the output itself.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .launch import interpreting, launch

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_split(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, ws_m, ws_l, ws_acc,
                            KV, S, G, T, DK, DV, tiles_per_split, scale_log2,
                            sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_t, so_b, so_h, so_t,
                            ROWS: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                            MASK_ROWS: tl.constexpr, SCAN: tl.constexpr, FLOAT_MASK: tl.constexpr,
                            N_SPLIT: tl.constexpr, IEEE: tl.constexpr):
    pair = tl.program_id(0)                       # row * KV + key/value head
    split = tl.program_id(1)
    row = pair // KV
    kvh = pair % KV
    r = tl.arange(0, ROWS)                        # query rows of the tile: head-major, window token minor
    g = r // T
    t = r % T
    valid = r < G * T
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    heads = kvh * G + g
    q = tl.load(q_ptr + row * sq_b + heads[:, None] * sq_h + t[:, None] * sq_t + dk[None, :],
                mask=valid[:, None] & (dk[None, :] < DK), other=0.0)
    m_base = mask_ptr + row * sm_b
    # the kept extent [lo, hi) of this row's mask, over every window token's mask row
    lo = S
    hi = 0
    sc = tl.arange(0, SCAN)
    for mr in range(MASK_ROWS):
        for c in range(0, S, SCAN):
            s = c + sc
            if FLOAT_MASK:
                keep = tl.load(m_base + mr * sm_t + s, mask=s < S, other=float("-inf")) > float("-inf")
            else:
                keep = tl.load(m_base + mr * sm_t + s, mask=s < S, other=0) != 0
            lo = tl.minimum(lo, tl.min(tl.where(keep, s, S), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(keep, s + 1, 0), axis=0))
    first = tl.maximum(split * tiles_per_split * BLOCK_S, (lo // BLOCK_S) * BLOCK_S)
    last = tl.minimum((split + 1) * tiles_per_split * BLOCK_S, hi)
    pos = tl.arange(0, BLOCK_S)
    k_base = k_ptr + row * sk_b + kvh * sk_h
    v_base = v_ptr + row * sv_b + kvh * sv_h
    m_rows = m_base + t * sm_t                   # sm_t is 0 for a mask shared by the window's tokens
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DV_PAD), tl.float32)
    for start in range(first, last, BLOCK_S):
        s = start + pos
        inside = s < last
        if FLOAT_MASK:
            bias = tl.load(m_rows[:, None] + s[None, :], mask=inside[None, :], other=float("-inf")).to(tl.float32)
            live = bias > float("-inf")
        else:
            live = tl.load(m_rows[:, None] + s[None, :], mask=inside[None, :], other=0) != 0
        any_live = tl.max(live.to(tl.int32), axis=0) > 0      # [BLOCK_S]: some query row keeps the position
        # a tile the mask hides for every query row is skipped whole (see the module docstring)
        if tl.max(any_live.to(tl.int32), axis=0) > 0:
            kt = tl.load(k_base + s[:, None] * sk_s + dk[None, :], mask=any_live[:, None] & (dk[None, :] < DK),
                         other=0.0)
            if IEEE:
                scores = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(kt))
            scores = scores * scale_log2
            if FLOAT_MASK:
                scores = scores + bias * 1.4426950408889634
            scores = tl.where(live, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)   # a query row with nothing kept yet adds nothing
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(scores - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_base + s[:, None] * sv_s + dv[None, :], mask=any_live[:, None] & (dv[None, :] < DV),
                         other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    if N_SPLIT == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * so_b + heads[:, None] * so_h + t[:, None] * so_t + dv[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < DV))
    else:
        base = (pair * N_SPLIT + split) * ROWS
        tl.store(ws_m + base + r, m_i, mask=valid)
        tl.store(ws_l + base + r, l_i, mask=valid)
        tl.store(ws_acc + (base + r[:, None]) * DV_PAD + dv[None, :], acc, mask=valid[:, None])


@triton.jit
def _decode_attention_combine(out_ptr, ws_m, ws_l, ws_acc, KV, G, T, DV, n_split, so_b, so_h, so_t,
                              ROWS: tl.constexpr, DV_PAD: tl.constexpr, DV_BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * DV_BLOCK + tl.arange(0, DV_BLOCK)
    row = pair // KV
    kvh = pair % KV
    r = tl.arange(0, ROWS)
    valid = r < G * T
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DV_BLOCK), tl.float32)
    for i in range(n_split):
        base = (pair * n_split + i) * ROWS
        m_s = tl.load(ws_m + base + r, mask=valid, other=float("-inf"))
        l_s = tl.load(ws_l + base + r, mask=valid, other=0.0)
        a_s = tl.load(ws_acc + (base + r[:, None]) * DV_PAD + cols[None, :], mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)     # splits with nothing to attend to weigh 0
        w_old = tl.exp2(m - ref)
        w_s = tl.exp2(m_s - ref)
        l_i = l_i * w_old + l_s * w_s
        acc = acc * w_old[:, None] + a_s * w_s[:, None]
        m = m_new
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    heads = kvh * G + r // T
    tl.store(out_ptr + row * so_b + heads[:, None] * so_h + (r % T)[:, None] * so_t + cols[None, :],
             res.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < DV))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block: int            # positions per tile
    n_split: int          # programs per (row, key/value head) pair
    tiles_per_split: int
    num_warps: int
    num_stages: int


def launch_config(b: int, KV: int, S: int, rows: int, dk_pad: int, device: torch.device) -> LaunchConfig:
    """64-position tiles (32 for heads wider than 128, whose key and value tiles would not fit a program's
    registers beside a tile of query rows), 4 warps; enough splits that the ``b * KV`` pairs make two waves of
    programs over the SMs (4 "SMs" under the interpreter), each split at least 4 tiles long so that the combine
    stays cheap."""
    block = 64 if dk_pad <= 128 else 32
    tiles = max(1, -(-S // block))
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    n_split = max(1, min(max(1, tiles // 4), -(-2 * sms // (b * KV))))
    per = -(-tiles // n_split)
    n_split = -(-tiles // per)                                  # no split left without a tile
    return LaunchConfig(block, n_split, per, 4, 3)


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float, config: LaunchConfig | None = None) -> torch.Tensor:
    """``config``: a launch configuration other than :func:`launch_config`'s (for tuning)."""
    b, H, T, dk = q.shape
    KV, S, dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // KV
    ROWS, DK_PAD, DV_PAD = _pow2(G * T), _pow2(dk), _pow2(dv)
    cfg = config or launch_config(b, KV, S, ROWS, DK_PAD, q.device)
    float_mask = mask.dtype != torch.bool
    mask_t = mask if float_mask else mask.view(torch.uint8)
    mask_rows = mask_t.shape[1]
    out = torch.empty((b, H, T, dv), dtype=q.dtype, device=q.device)
    if cfg.n_split > 1:
        ws_m = torch.empty((b * KV, cfg.n_split, ROWS), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((b * KV, cfg.n_split, ROWS, DV_PAD), dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out                               # unused
    # float32 inputs: IEEE dots (TF32 would round the scores to 10 bits). Under the interpreter every dot is an
    # IEEE float32 one: its bfloat16 dot returns garbage (triton 3.9)
    ieee = q.dtype == torch.float32 or interpreting()
    launch(_decode_attention_split)[(b * KV, cfg.n_split)](
        q, k, v, mask_t, out, ws_m, ws_l, ws_acc, KV, S, G, T, dk, dv, cfg.tiles_per_split, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), mask_t.stride(0) if mask_t.shape[0] > 1 else 0, mask_t.stride(1) if mask_rows > 1 else 0,
        out.stride(0), out.stride(1), out.stride(2),
        ROWS=ROWS, DK_PAD=DK_PAD, DV_PAD=DV_PAD, BLOCK_S=cfg.block, MASK_ROWS=mask_rows, SCAN=1024,
        FLOAT_MASK=float_mask, N_SPLIT=cfg.n_split, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.n_split > 1:
        dv_block = min(DV_PAD, 64)
        launch(_decode_attention_combine)[(b * KV, DV_PAD // dv_block)](
            out, ws_m, ws_l, ws_acc, KV, G, T, dv, cfg.n_split, out.stride(0), out.stride(1), out.stride(2),
            ROWS=ROWS, DV_PAD=DV_PAD, DV_BLOCK=dv_block, num_warps=4)
    return out


def bytes_floor(b: int, KV: int, filled: int, dk: int, dv: int, itemsize: int) -> int:
    """Bytes a decode step's attention must move: each key/value head's filled positions read once."""
    return b * KV * filled * (dk + dv) * itemsize
