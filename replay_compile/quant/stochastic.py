"""Stochastic rounding of quantized checkpoints: unbiased rounding applied only at a flush.

A checkpoint stored in fp16 or fp8 is rewritten once per ``L`` tokens (the flush) from an fp32 fold. Rounding to
nearest there loses every increment smaller than half an ulp, so slowly changing states stall; rounding each value
to one of its two neighbours with probability proportional to proximity is unbiased (``E[round(x)] = x``), so the
error behaves like noise that the decay damps instead of a bias that accumulates.

Uniform numbers come from a counter-based hash of an integer key per value (:func:`uniform_from_key`): deterministic
for given inputs, no global RNG state touched, reproducible on every device (the fp16 kernels hash the same way,
:func:`replay_compile.kernels.mamba2_reference.stochastic_round_fp16`).

* :func:`sr_fp16` — fp16 values.
* :func:`sr_e4m3_rows` — fp8 e4m3 values with one fp32 scale per row (``amax / 448``), the layout of the
  ``fp8_e4m3`` read-copy format (:mod:`replay_compile.quant.formats`).
* :func:`quantize_checkpoint` — either, dequantized back to fp32 (for experiments such as ``benchmarks/drift.py``).
"""

from __future__ import annotations

import torch

from ..kernels.mamba2_reference import _hash32
from .formats import FP8_E4M3_MAX

__all__ = ["uniform_from_key", "sr_fp16", "sr_e4m3_rows", "quantize_checkpoint", "CHECKPOINT_FORMATS"]

CHECKPOINT_FORMATS = ("fp16", "fp8_e4m3")
_E4M3_MAX_CODE = 0x7E            # 448; 0x7F is NaN in e4m3fn


def uniform_from_key(key: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 numbers in ``[0, 1)`` from integer keys (any int dtype, same shape out): lowbias32 of the key,
    top 24 bits."""
    h = _hash32(key.to(torch.int64) & 0xFFFFFFFF)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def element_keys(shape, seed: int, device=None) -> torch.Tensor:
    """One key per element: its flat index mixed with ``seed`` (a new seed per flush gives fresh numbers)."""
    idx = torch.arange(int(torch.Size(shape).numel()), device=device, dtype=torch.int64).view(shape)
    return idx ^ (_hash32(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64)).to(device) << 1)


def _pick(v_abs, lo_abs, hi_abs, u):
    """True where ``v`` goes up to ``hi``: with probability ``(v - lo) / (hi - lo)``."""
    gap = hi_abs - lo_abs
    frac = torch.where(gap > 0, (v_abs - lo_abs) / torch.where(gap > 0, gap, torch.ones_like(gap)),
                       torch.zeros_like(gap))
    return u < frac


def sr_fp16(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded stochastically to fp16 with uniforms ``u`` (same shape). Values beyond fp16's range
    saturate to ±65504 (a checkpoint must stay finite)."""
    v = x.to(torch.float32).clamp(-65504.0, 65504.0)
    rn = v.to(torch.float16)
    bits = rn.view(torch.int16)
    below = rn.to(torch.float32).abs() > v.abs()                          # rn is the upper neighbour in magnitude
    lo_bits = torch.where(below, bits - 1, bits)                          # magnitude order = bit order per sign
    lo = lo_bits.view(torch.float16)
    hi = torch.where(lo.to(torch.float32).abs() >= 65504.0, lo_bits, lo_bits + 1).view(torch.float16)
    lo_a, hi_a = lo.to(torch.float32).abs(), hi.to(torch.float32).abs()
    up = _pick(v.abs(), lo_a, hi_a, u)
    # -0.0 and +0.0: bits - 1 on a zero of either sign would wrap; zeros are exact, keep them
    out = torch.where(up, hi, lo)
    return torch.where(v == 0, rn, out)


def sr_e4m3_rows(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., C]`` (fp32) as fp8 e4m3fn values with one fp32 scale per row (``amax / 448``, 1 for zero rows),
    each value rounded stochastically between its two e4m3 neighbours with uniforms ``u``. Returns (values, scale)."""
    v = x.to(torch.float32)
    amax = v.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (v / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    rn = q.to(torch.float8_e4m3fn)
    code = rn.view(torch.uint8).to(torch.int16)
    mag, sign = code & 0x7F, code & 0x80
    lo_mag = torch.where(rn.to(torch.float32).abs() > q.abs(), mag - 1, mag)
    hi_mag = torch.clamp(lo_mag + 1, max=_E4M3_MAX_CODE)
    sgn = torch.where(q < 0, torch.full_like(sign, 0x80), torch.zeros_like(sign))   # q's sign (rn may be -0)
    lo = (lo_mag | sgn).to(torch.uint8).view(torch.float8_e4m3fn)
    hi = (hi_mag | sgn).to(torch.uint8).view(torch.float8_e4m3fn)
    up = _pick(q.abs(), lo.to(torch.float32).abs(), hi.to(torch.float32).abs(), u)
    vals = torch.where(up, hi.view(torch.uint8), lo.view(torch.uint8)).view(torch.float8_e4m3fn)
    vals = torch.where(q == 0, rn.view(torch.uint8), vals.view(torch.uint8)).view(torch.float8_e4m3fn)
    return vals, scale


def quantize_checkpoint(x: torch.Tensor, fmt: str, stochastic: bool = True, seed: int = 0) -> torch.Tensor:
    """``x`` stored as a ``fmt`` checkpoint (``"fp16"`` or ``"fp8_e4m3"`` with row scales) and read back as fp32;
    ``stochastic=False`` rounds to nearest (the baseline that stalls)."""
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f"replay_compile: checkpoint format {fmt!r} unsupported; choose one of {CHECKPOINT_FORMATS}")
    v = x.to(torch.float32)
    if not stochastic:
        if fmt == "fp16":
            return v.clamp(-65504.0, 65504.0).to(torch.float16).to(torch.float32)
        from .formats import quantize_dequantize
        return quantize_dequantize(v, "fp8_e4m3")
    u = uniform_from_key(element_keys(v.shape, seed, v.device))
    if fmt == "fp16":
        return sr_fp16(v, u).to(torch.float32)
    vals, scale = sr_e4m3_rows(v, u)
    return vals.to(torch.float32) * scale.unsqueeze(-1)
