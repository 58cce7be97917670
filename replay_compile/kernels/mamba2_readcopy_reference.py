"""Reference of the Mamba-2 ReplaySSM step with a low-precision *read copy* of the checkpoint, plain PyTorch.

The checkpoint ``state`` (fp32) is written only by the recurrence (the flush); at every flush the flushing slots'
read copy is rewritten from the new checkpoint in a storage format of :mod:`replay_compile.quant.formats`
(``"bf16"``, ``"fp8_e4m3"``, ``"nvfp4"``). Non-flush steps read only the copy: their checkpoint term
``exp(Σ la) (S_0 C_t)`` takes ``S_0 = decode(copy)``, so the copy's rounding error reaches the outputs of the current
window but never the recurrence. :mod:`replay_compile.kernels.mamba2_readcopy_triton` is the Triton kernel of this
reference (same signature, same in-place contract).

Shapes and layouts: as :func:`~replay_compile.kernels.mamba2_reference.replay_step_reference` (state
``[S, H, P, N]``, rings ``[S, H, L, P]`` / ``[S, H, L]`` / ``[S, G, L, N]``, cursor ``[S]`` int32) plus the copy:
the storage tensors that ``FORMATS[fmt].allocate((S, H, P, N))`` gives (an :class:`~replay_compile.quant.formats.
Encoded`, or a plain dict of the same tensors). A row of the copy is the last dim (N, dstate): fp8's scale is per
``(slot, head, p)``, nvfp4's e4m3 block scales are per 16 values of N and its fp32 tensor scale is per slot::

    bf16      values       [S, H, P, N]          bfloat16
    fp8_e4m3  values       [S, H, P, N]          float8_e4m3fn     scale        [S, H, P]  float32
    nvfp4     codes        [S, H, P, ceil(N/2)]  uint8 (2 e2m1 codes per byte, low nibble = even column)
              block_scale  [S, H, P, ceil(N/16)] float8_e4m3fn     tensor_scale [S]        float32

Bytes a non-flush step reads from the checkpoint term per (slot, head) (rings, x, B, C not counted): fp32 state
``P*N*4``; bf16 copy ``P*N*2``; fp8 ``P*N + P*4``; nvfp4 ``P*N/2 + P*N/16 + 4`` (the 4-byte tensor scale is per
slot; ``N % 16 == 0``).

Contract (in place on ``state``, ``copy``, rings and ``cursor``; returns ``y [b, H, P]`` in the compute dtype):

* non-flush rows (``cursor < L-1``): ``y`` from the *decoded copy* and the ring window; ``state`` is not read; the
  record is appended and the cursor advanced, exactly as in ``replay_step_reference``;
* flush rows (``cursor == L-1``): exactly ``replay_step_reference`` on those rows (fold from the fp32 ``state``,
  write it, ``y`` read out of the folded state, cursor to 0), then their slots of the copy are rewritten with
  ``encode_into(copy, state[slots], slots)``: the copy encodes the checkpoint *as stored* (for an fp16 checkpoint
  the stochastically rounded value);
* padded rows (``slot_idx < 0``): nothing read or written, ``y = 0``.

The op is ``replay_compile::mamba2_step_rc`` (:mod:`replay_compile.ops.mamba2_readcopy`); the delta-rule families'
read copy is :mod:`replay_compile.kernels.delta_readcopy_reference`.
"""

from __future__ import annotations

from typing import Mapping, Union

import torch

from ..quant.formats import Encoded, ReadCopyFormat, get_format
from .mamba2_reference import _compute_dtype, replay_step_reference

__all__ = ["as_encoded", "decode_slots", "init_read_copy", "replay_step_readcopy_reference"]

CopyArg = Union[Encoded, Mapping[str, torch.Tensor]]


def as_encoded(copy: CopyArg, fmt: Union[str, ReadCopyFormat], shape) -> Encoded:
    """``copy`` as an :class:`Encoded` of format ``fmt`` and logical ``shape`` sharing its tensors (writes through).

    Raises ``ValueError`` if the tensors do not match ``fmt.storage_spec(shape)`` (names, shapes, dtypes).
    """
    f = get_format(fmt)
    shape = torch.Size(shape)
    if isinstance(copy, Encoded):
        if copy.format != f.name:
            raise ValueError(f"read copy is in format {copy.format!r}, expected {f.name!r}")
        enc = copy
    else:
        enc = Encoded(f.name, shape, copy if isinstance(copy, dict) else dict(copy))
    spec = f.storage_spec(shape)
    if set(spec) != set(enc.tensors):
        raise ValueError(f"{f.name} read copy needs tensors {sorted(spec)}, got {sorted(enc.tensors)}")
    for k, (s, d) in spec.items():
        t = enc.tensors[k]
        if tuple(t.shape) != tuple(s) or t.dtype != d:
            raise ValueError(f"{f.name} read copy: {k} is {tuple(t.shape)} {t.dtype}, expected {tuple(s)} {d} "
                             f"for a state of shape {tuple(shape)}")
    return enc


def decode_slots(fmt: Union[str, ReadCopyFormat], copy: Encoded, slots: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode the copy's slots ``slots`` (1-D long): ``[n, *copy.shape[1:]]`` in ``dtype`` (computed in fp32)."""
    f = get_format(fmt)
    n_slots = copy.shape[0]
    sub = {}
    for k, t in copy.tensors.items():
        if t.dim() >= 1 and t.shape[0] == n_slots:
            sub[k] = t[slots]
        else:                      # nvfp4 with tensor_scale_dims=0: one scale for every slot
            sub[k] = t
    return f.decode(Encoded(f.name, torch.Size((slots.numel(),) + tuple(copy.shape[1:])), sub), dtype=dtype)


def init_read_copy(state: torch.Tensor, fmt: Union[str, ReadCopyFormat]) -> Encoded:
    """Allocate the read copy of ``state`` [S, H, P, N] in format ``fmt`` and fill every slot from it."""
    f = get_format(fmt)
    enc = f.allocate(state.shape, device=state.device)
    f.encode_into(enc, state)
    return enc


def replay_step_readcopy_reference(state, copy, fmt, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C,
                                   slot_idx=None):
    """One ReplaySSM decode step reading the checkpoint term of non-flush rows from the read copy.

    Args:
        state: [S, H, P, N] fp32 checkpoint (bf16 / fp16 / fp64 accepted as in ``replay_step_reference``); read and
            written only by flush rows.
        copy: the read copy, ``FORMATS[fmt].allocate(state.shape)``'s tensors (an ``Encoded`` or a dict of them);
            read by non-flush rows, the flushing slots rewritten.
        fmt: format name (``"bf16"``, ``"fp8_e4m3"``, ``"nvfp4"``) or a ``ReadCopyFormat``.
        x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx: as ``replay_step_reference``.
    Returns:
        y: [b, H, P] in the compute dtype (fp64 if state / x / dt / la are fp64, else fp32); zero for padded rows.
    """
    f = get_format(fmt)
    enc = as_encoded(copy, f, state.shape)
    b, H, P = x.shape
    L = x_ring.shape[2]
    dev = x.device
    idx = torch.arange(b, device=dev) if slot_idx is None else slot_idx.to(dev).long()
    active = idx >= 0
    w = torch.where(active, cursor[idx.clamp(min=0)].long(), torch.full_like(idx, -1))
    flush = active & (w == L - 1)
    reads = active & ~flush
    cdt = _compute_dtype(state, x, dt, la)
    y = torch.zeros(b, H, P, dtype=cdt, device=dev)
    rings = (x_ring, dt_ring, la_ring, B_ring, cursor)
    # Both passes see the cursor before either advances it (they touch disjoint slots: a slot has one row).
    if bool(reads.any()):
        slots = idx[reads]
        # proxy checkpoint: the decoded copy of the reading slots (same compute dtype as the fp32 state gives)
        read = torch.zeros(state.shape, dtype=torch.float64 if state.dtype == torch.float64 else torch.float32,
                           device=state.device)
        read[slots] = decode_slots(f, enc, slots).to(read.dtype)
        y_r = replay_step_reference(read, *rings, x, dt, la, B, C, torch.where(reads, idx, -1))
        y = torch.where(reads[:, None, None], y_r.to(cdt), y)
    if bool(flush.any()):
        y_f = replay_step_reference(state, *rings, x, dt, la, B, C, torch.where(flush, idx, -1))
        y = torch.where(flush[:, None, None], y_f.to(cdt), y)
        slots = idx[flush]
        f.encode_into(enc, state[slots], slots)
    return y
