"""``replay_compile::mamba2_step_rc``: the Mamba-2 replay step with a low-precision read copy of the checkpoint.

The same step as ``replay_compile::mamba2_step``, except that non-flush rows take their checkpoint term from a read
copy (bf16, fp8 e4m3 with row scales, or NVFP4; :mod:`replay_compile.quant.formats`) and never read the fp32
checkpoint; flush rows fold the fp32 checkpoint exactly and rewrite their slots of the copy. The copy's rounding
reaches the outputs of the current window only, never the recurrence. Semantics and shapes:
:func:`~replay_compile.kernels.mamba2_readcopy_reference.replay_step_readcopy_reference`.

A copy is up to three storage tensors (the format's ``storage_spec`` order: bf16 ``values``; fp8 ``values, scale``;
NVFP4 ``codes, block_scale, tensor_scale``). The op always takes three, unused ones empty, so one schema serves every
format; ``fmt`` names the format. CPU (and ``REPLAY_COMPILE_KERNELS=reference``): the reference; CUDA: the Triton
kernel of :mod:`replay_compile.kernels.mamba2_readcopy_triton`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import mamba2_readcopy_reference as rcref
from ..kernels import mamba2_reference as ref
from ..quant.formats import FORMATS, Encoded
from .library import replay_op, use_triton
from .mamba2 import _fail, check_step_args

COPY_TENSORS = 3      # the op's fixed number of copy storage tensors


def copy_names(fmt: str) -> tuple[str, ...]:
    """Storage tensor names of format ``fmt`` in the op's argument order."""
    if fmt not in FORMATS:
        _fail(f"unknown read-copy format {fmt!r}; choose one of {sorted(FORMATS)}")
    return tuple(FORMATS[fmt].storage_spec((1, 1, 1, 16)))


def allocate_copy(fmt: str, shape, device) -> tuple[Tensor, ...]:
    """Zeroed storage of a read copy of a ``shape`` = [S, H, P, N] state: three tensors, the unused ones empty."""
    names = copy_names(fmt)
    enc = FORMATS[fmt].allocate(tuple(shape), device=device)
    out = [enc.tensors[k] for k in names]
    out += [torch.empty(0, device=device) for _ in range(COPY_TENSORS - len(out))]    # distinct: never aliased
    return tuple(out)


def as_copy(fmt: str, state: Tensor, tensors, fail=_fail) -> Encoded:
    """The op's three tensors as an :class:`Encoded` of ``fmt`` for the checkpoint ``state``: checked against the
    format's storage spec, the checkpoint's dtype (no fp64) and device; ``fail`` raises with the family's prefix."""
    if state.dtype == torch.float64:
        fail("a read copy needs an fp32 / bf16 / fp16 checkpoint (fp64 states are for exactness tests)")
    names = copy_names(fmt)
    try:
        enc = rcref.as_encoded(dict(zip(names, tensors)), fmt, state.shape)
    except ValueError as e:
        fail(f"read copy: {e}")
    if enc.device != state.device:
        fail(f"read copy on {enc.device}, checkpoint on {state.device}: keep them on one device")
    return enc


def encode_copy(fmt: str, state: Tensor, tensors) -> None:
    """Rewrite the whole read copy from ``state`` (at bind, after an external write, after a flush)."""
    f = FORMATS[fmt]
    f.encode_into(as_copy(fmt, state, tensors), state.float())


def _check(state, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2, cursor, x, dt, la, B, C, slot_idx, fmt):
    check_step_args(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx)
    return as_copy(fmt, state, (copy0, copy1, copy2))


@replay_op(
    "replay_compile::mamba2_step_rc",
    mutates_args=("state", "x_ring", "dt_ring", "la_ring", "B_ring", "copy0", "copy1", "copy2", "cursor"),
)
def mamba2_step_rc(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, la_ring: Tensor, B_ring: Tensor,
    copy0: Tensor, copy1: Tensor, copy2: Tensor, cursor: Tensor,
    x: Tensor, dt: Tensor, la: Tensor, B: Tensor, C: Tensor, slot_idx: Optional[Tensor], fmt: str,
) -> Tensor:
    """One Mamba-2 replay step reading non-flush rows' checkpoint term from the read copy."""
    enc = _check(state, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2, cursor, x, dt, la, B, C, slot_idx, fmt)
    return rcref.replay_step_readcopy_reference(state, enc, fmt, x_ring, dt_ring, la_ring, B_ring, cursor,
                                                x, dt, la, B, C, slot_idx)


@mamba2_step_rc.register_kernel("cuda")
def _(state, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2, cursor, x, dt, la, B, C, slot_idx, fmt):
    enc = _check(state, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2, cursor, x, dt, la, B, C, slot_idx, fmt)
    if not use_triton():
        return rcref.replay_step_readcopy_reference(state, enc, fmt, x_ring, dt_ring, la_ring, B_ring, cursor,
                                                    x, dt, la, B, C, slot_idx)
    from ..kernels.mamba2_readcopy_triton import replay_step_readcopy_triton  # lazily: triton only on GPUs

    return replay_step_readcopy_triton(state, enc, fmt, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C,
                                       slot_idx)


@mamba2_step_rc.register_fake
def _(state, x_ring, dt_ring, la_ring, B_ring, copy0, copy1, copy2, cursor, x, dt, la, B, C, slot_idx, fmt):
    return x.new_empty(x.shape, dtype=ref._compute_dtype(state, x, dt, la))
