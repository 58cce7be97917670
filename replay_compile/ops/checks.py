"""Argument checks shared by every family's ops.

Each raises a ``ValueError`` that names the op, the argument, what it got and what it must be, before the op writes
anything: an op that fails its checks leaves the checkpoint, the rings and the cursor exactly as they were.

Shapes and dtypes are checked on every call. Values held on the device (cursors, ``slot_idx``, ``count``) are
checked where reading them is free or where the caller is outside the decode loop: always on the CPU; on CUDA with
one host synchronisation, except while a CUDA graph is being captured (a synchronisation is illegal there) and while
the op is being traced (the values do not exist yet). The compiled decode step never reaches these checks at run
time: it launches the kernels from Inductor's code with cursors the library itself keeps in range.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
STATE_DTYPES = FLOATS


def check_token_args(named, slot_idx, b: int, S: int, fail: Callable[[str], None]) -> None:
    """Per-token tensors are floats; ``slot_idx`` is int32/int64 [b], or absent with b == S. ``fail`` raises with
    the family's prefix."""
    for name, t in named:
        if t.dtype not in FLOATS:
            fail(f"{name} dtype {t.dtype} unsupported; use one of {FLOATS}")
    if slot_idx is None:
        if b != S:
            fail(f"without slot_idx the batch ({b}) must equal the number of state slots ({S})")
    elif tuple(slot_idx.shape) != (b,) or slot_idx.dtype not in (torch.int32, torch.int64):
        fail(f"slot_idx must be int32/int64 [b={b}], got {slot_idx.dtype} {tuple(slot_idx.shape)}")


def check_float_rings(named: Iterable[tuple[str, Tensor]], fail: Callable[[str], None]) -> None:
    """Record rings hold floating-point values (an integer ring would truncate every record)."""
    for name, t in named:
        if t.dtype not in FLOATS:
            fail(f"{name} must be a floating-point tensor ({FLOATS}), got {t.dtype}")


def _values_readable(t: Tensor) -> bool:
    """Whether the op may read device values of ``t`` now (see the module docstring)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t) or torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_cursor_values(cursor: Tensor, L: int, slot_idx: Optional[Tensor], S: int, fail: Callable[[str], None],
                        count: Optional[Tensor] = None) -> None:
    """Every cursor in ``[0, L)`` (records held before this op); ``slot_idx`` below ``S`` with no slot twice (two
    rows on one slot would both write it; negative entries are padding rows); ``count`` (materialize) in
    ``[0, cursor]`` of its row's slot."""
    if not _values_readable(cursor):
        return
    slots = None if slot_idx is None else slot_idx.long()
    stats = [cursor.min().long(), cursor.max().long()] if cursor.numel() else []
    if slots is not None and slots.numel():
        stats.append(slots.max())
    vals = torch.stack(stats).tolist() if stats else []     # one host synchronisation
    if cursor.numel() and (vals[0] < 0 or vals[1] >= L):
        fail(f"cursor values must be in [0, L={L}) (records held per slot), got min {vals[0]} max {vals[1]}; a "
             "cursor outside that range means the replay state was corrupted or not made by this library")
    if slots is not None and slots.numel():
        if vals[2] >= S:
            fail(f"slot_idx values must be below S={S} (negative: a padding row), got {vals[2]}")
        real = slots[slots >= 0]
        dups = real.numel() - torch.unique(real).numel()
        if dups:
            fail(f"slot_idx names {dups} slot(s) more than once: two rows of one call cannot update the same slot")
    if count is not None and _values_readable(count):
        b = cursor.shape[0] if slots is None else slots.shape[0]
        if tuple(count.shape) != (b,):
            fail(f"count must be [b={b}] (one per row), got {tuple(count.shape)}")
        rows = torch.arange(b, device=cursor.device) if slots is None else (slots >= 0).nonzero().flatten()
        held = cursor.long()[rows if slots is None else slots[rows]]
        n = count.long()[rows]
        bad = (n < 0) | (n > held)
        if bool(bad.any()):
            fail(f"count must be in [0, cursor] per row (records held); rows {rows[bad].tolist()} are out of range")
