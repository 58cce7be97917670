"""A depthwise 1-D convolution with few taps as shifted multiply-adds, for Inductor to fuse.

``F.conv1d(x, weight, bias, padding=p, groups=C)`` with a depthwise weight ``[C, 1, K]``, stride 1 and dilation 1
is, per channel, ``out[t] = bias + sum_j x_pad[t + j] * weight[j]``: ``K`` shifted multiply-adds. Written that way
Inductor fuses them (and whatever produced ``x``: the decode step's concatenation of conv state and new input) into
one elementwise kernel, where the convolution itself is a separate cuDNN / aten launch that moves several times its
bytes at decode sizes (``docs/design/whole_step.md``).

The same arithmetic serves real tensors (:func:`shifted_conv1d`, the speculative verify's conv window) and FX
proxies (:mod:`.decode_conv` calls :func:`shifted_taps` on them to write it into a graph), so every size it uses is
a Python int.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the taps are summed in: float32 for 16-bit floats and float32, float64 for float64 (as ``F.conv1d``'s
    kernels accumulate)."""
    return torch.promote_types(dtype, torch.float32)


def shifted_taps(x, w, bias, padding: tuple[int, int], taps: int, length: int, acc: torch.dtype,
                 out_dtype: torch.dtype):
    """The arithmetic, on tensors or FX proxies: ``x`` [b, C, L], ``w`` [C, K] (``taps = K``), ``bias`` [C] or None,
    ``padding`` (left, right) zeros, ``length = L + left + right - K + 1`` -> [b, C, length] in ``out_dtype``,
    summed in ``acc`` (tap 0 first, the bias last) and rounded once."""
    xs = x.to(acc)
    left, right = padding
    if left or right:
        xs = F.pad(xs, (left, right))
    w = w.to(acc)
    out = xs[..., 0:length] * w[:, 0, None]
    for j in range(1, taps):
        out = out + xs[..., j:j + length] * w[:, j, None]
    if bias is not None:
        out = out + bias.to(acc)[:, None]
    return out.to(out_dtype)


def shifted_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, padding=..., groups=C)`` for a depthwise weight, stride 1, dilation 1.

    Args:
        x: input [b, C, L].
        weight: depthwise weight [C, 1, K].
        bias: [C] or None.
        padding: zeros added (left, right); ``F.conv1d``'s ``padding=p`` is ``(p, p)``.

    Returns:
        [b, C, L + left + right - K + 1] in ``weight``'s dtype (``F.conv1d`` takes ``x``, ``weight`` and ``bias``
        of one dtype), accumulated in :func:`accumulation_dtype`.
    """
    C, _, K = weight.shape
    length = x.shape[-1] + padding[0] + padding[1] - K + 1
    return shifted_taps(x, weight.reshape(C, K), bias, padding, K, length, accumulation_dtype(weight.dtype),
                        weight.dtype)
