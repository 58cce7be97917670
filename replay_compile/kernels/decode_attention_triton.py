"""Decode attention in Triton: split-K ("flash decoding") over the cache, grouped-query heads read once.

Same signature and contract as :func:`~.decode_attention_reference.decode_attention_reference` (shapes there).

Bytes. A decode step's attention must read each key/value head's filled positions once: ``b * KV * S_filled *
(dk + dv) * itemsize``. transformers' compiled path first copies every static position of the cache into ``H``
expanded heads (``repeat_kv``), then SDPA reads the copy: ``(1 + 2G)`` times the whole static cache. Here one
program owns one (row, key/value head) pair and a range of positions; its ``G`` query heads are the rows of one
``tl.dot`` tile, so each key and value is loaded once for all of them. A tile of positions whose mask is all off
is skipped without loading its keys or values, and the loads of a partly filled tile are predicated by the mask:
only filled positions are read, whatever the static cache's length.

Parallelism. ``b * KV`` programs fill an H200's 132 SMs from batch 17 on (8 key/value heads); below that the
positions are split ``n_split`` ways, each split keeping its running maximum, normaliser and weighted sum in
float32, and a second launch combines them (the log-sum-exp rule). With one split the first launch writes the
output itself.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreting, launch

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_split(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, ws_m, ws_l, ws_acc,
                  KV, S, G, DK, DV, tiles_per_split, scale_log2,
                  sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, so_b, so_h,
                  G_PAD: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                  FLOAT_MASK: tl.constexpr, N_SPLIT: tl.constexpr, IEEE: tl.constexpr):
    pair = tl.program_id(0)                       # row * KV + key/value head
    split = tl.program_id(1)
    row = pair // KV
    kvh = pair % KV
    g = tl.arange(0, G_PAD)
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    pos = tl.arange(0, BLOCK_S)
    heads = kvh * G + g
    q = tl.load(q_ptr + row * sq_b + heads[:, None] * sq_h + dk[None, :],
                mask=(g[:, None] < G) & (dk[None, :] < DK), other=0.0)
    k_base = k_ptr + row * sk_b + kvh * sk_h
    v_base = v_ptr + row * sv_b + kvh * sv_h
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, DV_PAD), tl.float32)
    first = split * tiles_per_split * BLOCK_S
    for t in range(tiles_per_split):
        s = first + t * BLOCK_S + pos
        inside = s < S
        if FLOAT_MASK:
            bias = tl.load(mask_ptr + row * sm_b + s, mask=inside, other=float("-inf")).to(tl.float32)
            live = bias > float("-inf")
        else:
            live = tl.load(mask_ptr + row * sm_b + s, mask=inside, other=0) != 0
        if tl.max(live.to(tl.int32), axis=0) > 0:            # a tile with nothing to attend to is never loaded
            kt = tl.load(k_base + s[:, None] * sk_s + dk[None, :], mask=live[:, None] & (dk[None, :] < DK),
                         other=0.0)
            if IEEE:
                scores = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(kt))
            scores = scores * scale_log2
            if FLOAT_MASK:
                scores = scores + bias[None, :] * 1.4426950408889634
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_base + s[:, None] * sv_s + dv[None, :], mask=live[:, None] & (dv[None, :] < DV),
                         other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    if N_SPLIT == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * so_b + heads[:, None] * so_h + dv[None, :], res.to(out_ptr.dtype.element_ty),
                 mask=(g[:, None] < G) & (dv[None, :] < DV))
    else:
        base = (pair * N_SPLIT + split) * G_PAD
        tl.store(ws_m + base + g, m_i)
        tl.store(ws_l + base + g, l_i)
        tl.store(ws_acc + (base + g[:, None]) * DV_PAD + dv[None, :], acc)


@triton.jit
def _decode_attention_combine(out_ptr, ws_m, ws_l, ws_acc, KV, G, DV, so_b, so_h,
                    G_PAD: tl.constexpr, DV_PAD: tl.constexpr, N_SPLIT: tl.constexpr):
    pair = tl.program_id(0)
    row = pair // KV
    kvh = pair % KV
    g = tl.arange(0, G_PAD)
    dv = tl.arange(0, DV_PAD)
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, DV_PAD), tl.float32)
    for i in range(N_SPLIT):
        base = (pair * N_SPLIT + i) * G_PAD
        m_s = tl.load(ws_m + base + g)
        l_s = tl.load(ws_l + base + g)
        a_s = tl.load(ws_acc + (base + g[:, None]) * DV_PAD + dv[None, :])
        m_new = tl.maximum(m, m_s)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)     # splits with nothing to attend to weigh 0
        w_old = tl.exp2(m - ref)
        w_s = tl.exp2(m_s - ref)
        l_i = l_i * w_old + l_s * w_s
        acc = acc * w_old[:, None] + a_s * w_s[:, None]
        m = m_new
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    heads = kvh * G + g
    tl.store(out_ptr + row * so_b + heads[:, None] * so_h + dv[None, :], res.to(out_ptr.dtype.element_ty),
             mask=(g[:, None] < G) & (dv[None, :] < DV))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(b: int, KV: int, S: int, dk_pad: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_S, n_split, tiles_per_split)``: 64-position tiles (32 for heads wider than 128, whose key and
    value tiles would not fit a program's registers), and enough splits that the ``b * KV`` pairs make two waves
    of programs over the SMs (4 "SMs" under the interpreter)."""
    block = 64 if dk_pad <= 128 else 32
    tiles = max(1, -(-S // block))
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
    n_split = max(1, min(tiles, -(-2 * sms // (b * KV))))
    per = -(-tiles // n_split)
    n_split = -(-tiles // per)                                  # no split left without a tile
    return block, n_split, per


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    b, H, dk = q.shape
    KV, S, dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // KV
    G_PAD, DK_PAD, DV_PAD = _pow2(G), _pow2(dk), _pow2(dv)
    block, n_split, per = launch_config(b, KV, S, DK_PAD, q.device)
    float_mask = mask.dtype != torch.bool
    mask_t = mask if float_mask else mask.view(torch.uint8)
    out = torch.empty((b, H, dv), dtype=q.dtype, device=q.device)
    if n_split > 1:
        ws_m = torch.empty((b * KV, n_split, G_PAD), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((b * KV, n_split, G_PAD, DV_PAD), dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out                               # unused
    # float32 inputs: IEEE dots (TF32 would round the scores to 10 bits). Under the interpreter every dot is an
    # IEEE float32 one: its bfloat16 dot returns garbage (triton 3.9)
    ieee = q.dtype == torch.float32 or interpreting()
    launch(_decode_attention_split)[(b * KV, n_split)](
           q, k, v, mask_t, out, ws_m, ws_l, ws_acc, KV, S, G, dk, dv, per, scale * _LOG2E,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           mask_t.stride(0) if mask_t.shape[0] > 1 else 0, out.stride(0), out.stride(1),
           G_PAD=G_PAD, DK_PAD=DK_PAD, DV_PAD=DV_PAD, BLOCK_S=block, FLOAT_MASK=float_mask, N_SPLIT=n_split,
           IEEE=ieee, num_warps=4)
    if n_split > 1:
        launch(_decode_attention_combine)[(b * KV,)](out, ws_m, ws_l, ws_acc, KV, G, dv, out.stride(0), out.stride(1),
               G_PAD=G_PAD, DV_PAD=DV_PAD, N_SPLIT=n_split, num_warps=4)
    return out


def bytes_floor(b: int, KV: int, filled: int, dk: int, dv: int, itemsize: int) -> int:
    """Bytes a decode step's attention must move: each key/value head's filled positions read once."""
    return b * KV * filled * (dk + dv) * itemsize

