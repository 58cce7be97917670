r"""Read-copy storage formats for the SSM checkpoint: bf16, fp8 e4m3 with per-row scales, NVFP4.

The state is split into an fp32 checkpoint, updated only by the recurrence (flush), and a low-precision *read
copy* that the flush writes and the non-flush steps read. The copy is never read back into the recurrence, so its
rounding error touches only the outputs of the current window. This module is the reference (plain PyTorch, any
device) for the three copy formats: encode, decode, storage allocation and the slot-wise write a flush performs.
Kernels that decode the copy in registers must match :meth:`ReadCopyFormat.decode` here.

Shapes
------
A state tensor ``x`` has shape ``[..., R, C]``; the last dim is a *row* of ``C`` values, the unit along which the
scales are taken and along which a readout ``S @ q`` reduces: the Mamba-2 state ``[S, H, P, N]`` has rows of ``N``
(dstate) values, the delta-rule state ``[S, HV, K, V]`` rows of ``V`` values. Dim 0 is the *slot* dim of a cache
(one sequence's state per slot); :meth:`ReadCopyFormat.encode_into` writes selected slots only. Inputs of any
floating dtype are read as fp32. ``C`` may be any positive size (odd, not a multiple of 16).

Formats (``FORMATS`` registry; every encoding is an :class:`Encoded`, a dict of tensors plus the logical shape)
-----------------------------------------------------------------------------------------------------------------
``"bf16"`` -- :class:`BF16Format`
    ``values [..., R, C] bfloat16 = x.to(bfloat16)`` (round to nearest even). ``decode = values.float()``.
    Relative error <= 2^-8 per element (half an ulp; bf16 has fp32's exponent range). 2 bytes per value.

``"fp8_e4m3"`` -- :class:`FP8E4M3RowFormat`
    ``scale [..., R] float32 = amax(|row|) / 448`` (448 = largest e4m3fn value; a zero row gets scale 1, so it
    stores zeros, never NaN; so does a row with amax below ``448 * 2^-149``),
    ``values [..., R, C] float8_e4m3fn = clamp(x / scale, -448, 448).to(e4m3fn)`` (round to nearest even; the clamp
    only catches fp32 rounding of the scale and makes the result independent of the backend's overflow behaviour).
    ``decode = values.float() * scale[..., None]``. This is FlashInfer's quantized
    checkpoint layout (one scale per ``(slot, head, dim)`` row, amax over dstate). Error per element
    <= ``2^-4 |x| + 2^-10 * scale`` (half an ulp of a 3-mantissa-bit value; the second term covers e4m3 subnormals,
    values below ``2^-6 * scale``). ``1 + 4/C`` bytes per value.

``"nvfp4"`` -- :class:`NVFP4Format` (NVIDIA's NVFP4: e2m1 values, an e4m3 scale per 16 values, an fp32 scale)
    Recipe (NVIDIA's published two-level scaling), in fp32:

    * tensor scale ``s_g = amax(|x_t|) / (448 * 6)`` where ``x_t`` is one *scale group*: by default one slot
      (``tensor_scale_dims=1``: one ``s_g`` per index of dim 0, shape ``[S]``). A zero group gets ``s_g = 1``.
      Per slot, not per whole cache tensor, because the flush writes slots independently: a single scale over the
      cache would need re-encoding of every other slot whenever one slot's amax grows. ``NVFP4Format(
      tensor_scale_dims=0)`` gives one scalar per tensor (then ``encode_into`` must rewrite everything), ``2`` one
      per ``(slot, head)``, ``-1`` one per row (``"nvfp4_row"``, :class:`NVFP4RowFormat`: what lets a flush kernel
      encode the rows it holds without a slot-wide amax).
    * block scale ``s_b = amax(|block|) / (6 * s_g)``, clamped to 448, stored as ``float8_e4m3fn`` (round to
      nearest even). Blocks are 16 consecutive values of a row; the last block of a row is zero-padded when
      ``C % 16 != 0`` (padding never changes an amax).
    * values ``q = round_e2m1(x * (1 / (s_b * s_g)))`` with ``s_b`` the *stored* e4m3 value (product, reciprocal
      and product in fp32: one division per block, as NVIDIA's quantizers multiply by the block's reciprocal
      scale; it can differ from ``x / (s_b s_g)`` by an ulp, so a value next to a rounding midpoint may take the
      other code). ``round_e2m1`` rounds to nearest, ties to the even code (= IEEE round-half-even, as
      ``cvt.rn.satfinite.e2m1x2.f32``), and saturates at 6 (the rounded ``s_b`` can be up to ``2^-4`` below the
      exact one, so ``|x / (s_b s_g)|`` can reach ``6 * 17/16``).
    * ``decode = (e2m1_value(q) * s_b) * s_g`` in fp32: the first product is exact, the second rounds once (a
      kernel may instead apply ``s_g``, constant over a slot, after its row reduction).
    * Small blocks: a block with ``amax(block) < 2^-6 * 6 * s_g`` (below ``3.5e-5`` of the group amax) gets a
      subnormal e4m3 scale, so its effective precision is coarser; one with ``amax(block) <= 2^-10 * 6 * s_g``
      (``2.2e-6`` of the group amax) gets scale 0 and codes 0 and decodes to zeros. The per-element bound below,
      stated with the stored scale, covers both.

    e2m1 code (4 bits): bit 3 = sign, bits 0-2 = magnitude index into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (code 8 is
    -0). Packed two codes per byte, **low nibble = even column**: ``byte[j] = code[2j] | code[2j + 1] << 4``; for odd
    ``C`` the high nibble of the last byte is 0.

    Storage: ``codes [..., R, ceil(C/2)] uint8``, ``block_scale [..., R, ceil(C/16)] float8_e4m3fn``,
    ``tensor_scale x.shape[:tensor_scale_dims] float32`` (torch's ``float4_e2m1fn_x2`` dtype exists but has no CPU
    copy/cast kernels in torch 2.13, hence plain uint8 codes; the bytes are the same layout).

    Error per element, with ``s = s_b * s_g`` and ``y = |x| / s``: ``<= s * h(y)`` where the half spacing of the e2m1
    grid is ``h = 0.25`` on ``[0, 2]``, ``0.5`` on ``(2, 4]``, ``1`` on ``(4, 6]``; above 6 the error is the
    saturation ``|x| - 6 s <= 0.375 s``. Relative to the block: ``<= amax(block) * 17/96`` while ``s_b`` is an e4m3
    normal (``s_b >= 2^-6``). Bytes per value: ``ceil(C/2)/C + ceil(C/16)/C + 4 / (values per scale group)``,
    i.e. ``0.5 + 1/16 + tiny`` for ``C % 16 == 0`` (0.5625 at C = 128: 7.1x fewer bytes than fp32, 1.8x fewer than
    fp8).

Checks
------
Inputs with NaN or inf raise ``ValueError`` naming the format (a copy written from a poisoned checkpoint must not be
silently clamped: torch's CPU e4m3fn cast saturates inf to +-448). So does a finite fp32 value that overflows bf16.
The check synchronises with the device; ``check_finite=False`` turns it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

__all__ = ["BF16Format", "E2M1_MAX", "E2M1_VALUES", "Encoded", "FORMATS", "FP8E4M3RowFormat", "FP8_E4M3_MAX",
           "NVFP4Format", "ReadCopyFormat", "e2m1_decode", "e2m1_encode", "get_format", "pack_nibbles",
           "quantize_dequantize", "unpack_nibbles"]

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: Magnitudes of the e2m1 codes 0..7 (code | 8 is the negative).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
# Midpoints between consecutive e2m1 magnitudes; a value exactly on one is a tie.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

Index = Union[None, int, slice, Sequence[int], torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# e2m1 codes and nibble packing
# ----------------------------------------------------------------------------------------------------------------
def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` to e2m1 codes (uint8 in 0..15): nearest, ties to even code, saturating at +-6.

    The sign bit (bit 3) is ``signbit(y)``, so negative values that round to 0 give code 8 (-0), as the hardware
    conversion does. ``y`` must not contain NaN.
    """
    y = y.float()
    a = y.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=y.device)
    lo = torch.bucketize(a, mids, right=False)   # a tie goes to the smaller magnitude
    hi = torch.bucketize(a, mids, right=True)    # a tie goes to the larger magnitude
    mag = torch.where(lo % 2 == 0, lo, hi)       # differ only on a tie: keep the even code
    return (mag | (torch.signbit(y).to(mag.dtype) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (any integer dtype, values 0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., n]`` into ``[..., ceil(n/2)]`` uint8; low nibble = even index, odd tail padded 0."""
    codes = codes.to(torch.uint8)
    n = codes.shape[-1]
    if n % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., ceil(n/2)]`` -> codes ``[..., n]`` uint8."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)[..., :n]


# ----------------------------------------------------------------------------------------------------------------
# Encoded storage
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Encoded:
    """An encoding (or preallocated storage) of a state of logical shape ``shape`` in format ``format``.

    ``tensors`` maps the format's storage names to tensors; ``enc["codes"]`` works too. Dim 0 of every tensor
    whose shape starts with the slot dim is the slot dim (all of them, except nvfp4's ``tensor_scale`` with
    ``tensor_scale_dims=0``).
    """

    format: str
    shape: torch.Size
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def keys(self):
        return self.tensors.keys()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device) -> "Encoded":
        return Encoded(self.format, self.shape, {k: v.to(device) for k, v in self.tensors.items()})

    def clone(self) -> "Encoded":
        return Encoded(self.format, self.shape, {k: v.clone() for k, v in self.tensors.items()})


def _slot_index(index: Index, n_slots: int, device: torch.device) -> torch.Tensor:
    if isinstance(index, slice):
        return torch.arange(n_slots, device=device)[index]
    if isinstance(index, int):
        index = [index]
    if not isinstance(index, torch.Tensor) and len(index) == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    idx = torch.as_tensor(index, device=device)
    if idx.dtype == torch.bool:
        if idx.shape != (n_slots,):
            raise ValueError(f"boolean slot mask has shape {tuple(idx.shape)}, expected ({n_slots},)")
        return idx.nonzero().flatten()
    if idx.dim() != 1 or idx.is_floating_point():
        raise ValueError(f"slot index must be a 1-D integer tensor, a sequence of ints, a slice or an int; "
                         f"got dtype {idx.dtype}, shape {tuple(idx.shape)}")
    idx = idx.long()
    if idx.numel() and (idx.min() < -n_slots or idx.max() >= n_slots):
        raise ValueError(f"slot index out of range for {n_slots} slots")
    return idx % n_slots if idx.numel() else idx


# ----------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------
class ReadCopyFormat:
    """A read-copy storage format. Subclasses define :meth:`storage_spec`, :meth:`_encode` and :meth:`_decode`."""

    name: str = ""

    def __init__(self, check_finite: bool = True):
        self.check_finite = check_finite

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # -- layout -------------------------------------------------------------------------------------------------
    def storage_spec(self, shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Storage tensor name -> (shape, dtype) for a state of logical ``shape``."""
        raise NotImplementedError

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of the encoding of a state of ``shape`` (all storage tensors, scales included)."""
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in self.storage_spec(shape).values())

    def bytes_per_value(self, shape_or_cols: Union[int, Sequence[int]]) -> float:
        """Effective bytes per state value, scales included.

        An int is the row length ``C``: per-row storage only (:meth:`row_nbytes` / C; nvfp4's fp32 tensor scale,
        4 bytes per scale group, is left out). A shape gives the exact ``nbytes(shape) / numel``.
        """
        if isinstance(shape_or_cols, int):
            return self.row_nbytes(shape_or_cols) / shape_or_cols
        shape = tuple(shape_or_cols)
        return self.nbytes(shape) / math.prod(shape)

    def row_nbytes(self, cols: int) -> int:
        """Bytes one row of ``cols`` values takes, its per-row and per-block scales included."""
        raise NotImplementedError

    def allocate(self, shape: Sequence[int], device=None) -> Encoded:
        """Zero-filled storage for a state of ``shape`` (decodes to zeros until written)."""
        shape = torch.Size(shape)
        self._check_shape(shape)
        return Encoded(self.name, shape, {k: torch.zeros(s, dtype=d, device=device)
                                          for k, (s, d) in self.storage_spec(shape).items()})

    # -- encode / decode ----------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Encoded:
        """Encode ``x`` [..., R, C] (any floating dtype, read as fp32)."""
        self._check_input(x)
        enc = Encoded(self.name, x.shape, self._encode(x.float()) if x.numel() else {
            k: torch.zeros(s, dtype=d, device=x.device) for k, (s, d) in self.storage_spec(x.shape).items()})
        return enc

    def decode(self, enc: Encoded, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode ``enc`` to a tensor of its logical shape, computed in fp32 and cast to ``dtype``."""
        if enc.format != self.name:
            raise ValueError(f"{self.name}: cannot decode an encoding in format {enc.format!r}")
        if math.prod(enc.shape) == 0:
            return torch.zeros(enc.shape, dtype=dtype, device=enc.device)
        return self._decode(enc).to(dtype)

    def encode_into(self, storage: Encoded, x: torch.Tensor, index: Index = None) -> None:
        """Write the encoding of ``x`` into ``storage`` in place, at slots ``index`` of dim 0.

        ``index=None``: ``x`` has ``storage.shape``. Otherwise ``index`` selects slots (1-D long tensor, bool mask,
        sequence of ints, slice, or an int) and ``x`` has shape ``[n_selected, *storage.shape[1:]]`` (for an int
        also ``storage.shape[1:]``). Slots not selected are left bit-for-bit unchanged. Duplicate indices: the
        last write is not guaranteed to win (as ``index_copy_``).
        """
        if storage.format != self.name:
            raise ValueError(f"{self.name}: storage is in format {storage.format!r}")
        if index is None:
            if tuple(x.shape) != tuple(storage.shape):
                raise ValueError(f"{self.name}: x has shape {tuple(x.shape)}, storage holds {tuple(storage.shape)}")
            enc = self.encode(x)
            for k, t in storage.tensors.items():
                t.copy_(enc.tensors[k])
            return
        if len(storage.shape) < 2:
            raise ValueError(f"{self.name}: slot-wise writes need a slot dim and a row dim; storage shape "
                             f"{tuple(storage.shape)}")
        self._check_slot_writes()
        if isinstance(index, int) and tuple(x.shape) == tuple(storage.shape[1:]):
            x = x.unsqueeze(0)
        idx = _slot_index(index, storage.shape[0], storage.device)
        if tuple(x.shape) != (idx.numel(), *storage.shape[1:]):
            raise ValueError(f"{self.name}: x has shape {tuple(x.shape)}, expected "
                             f"{(idx.numel(), *tuple(storage.shape[1:]))} for {idx.numel()} selected slots")
        if idx.numel() == 0:
            return
        enc = self.encode(x)
        for k, t in storage.tensors.items():
            src = enc.tensors[k].to(t.device)
            if t.element_size() == 1:  # index_copy_ has no float8 kernel on CPU: copy the bytes
                t, src = t.view(torch.uint8), src.view(torch.uint8)
            t.index_copy_(0, idx, src)

    def _check_slot_writes(self) -> None:
        pass

    # -- checks -------------------------------------------------------------------------------------------------
    def _check_shape(self, shape) -> None:
        if len(shape) < 1 or shape[-1] < 1:
            raise ValueError(f"{self.name}: state shape must be [..., R, C] with C >= 1, got {tuple(shape)}")

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{self.name}: expected a floating-point tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
        self._check_shape(x.shape)
        if self.check_finite and x.numel() and not bool(torch.isfinite(x).all()):
            n_nan = int(torch.isnan(x).sum())
            n_inf = int(torch.isinf(x).sum())
            raise ValueError(f"{self.name}: cannot encode a state with {n_nan} NaN and {n_inf} inf values "
                             f"(shape {tuple(x.shape)}); the read copy would hide a poisoned checkpoint")

    # -- per format ---------------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError


class BF16Format(ReadCopyFormat):
    """``values = x.to(bfloat16)``; decode ``values.float()``. 2 bytes per value."""

    name = "bf16"

    def storage_spec(self, shape):
        return {"values": (tuple(shape), torch.bfloat16)}

    def row_nbytes(self, cols):
        return 2 * cols

    def _encode(self, x):
        values = x.to(torch.bfloat16)
        if self.check_finite and not bool(torch.isfinite(values).all()):
            raise ValueError(f"{self.name}: {int(torch.isinf(values).sum())} finite fp32 values overflow bf16 "
                             f"(|x| > {torch.finfo(torch.bfloat16).max:.4g})")
        return {"values": values}

    def _decode(self, enc):
        return enc["values"].float()


class FP8E4M3RowFormat(ReadCopyFormat):
    """fp8 e4m3fn values with one fp32 scale per row: ``scale = amax(|row|) / 448``. ``1 + 4/C`` bytes per value."""

    name = "fp8_e4m3"

    def storage_spec(self, shape):
        shape = tuple(shape)
        return {"values": (shape, torch.float8_e4m3fn), "scale": (shape[:-1], torch.float32)}

    def row_nbytes(self, cols):
        return cols + 4

    def _encode(self, x):
        amax = x.abs().amax(dim=-1)
        scale = amax / FP8_E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows (or amax < 448 * 2^-149): 1
        y = (x / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return {"values": y.to(torch.float8_e4m3fn), "scale": scale}

    def _decode(self, enc):
        return enc["values"].float() * enc["scale"].unsqueeze(-1)


class NVFP4Format(ReadCopyFormat):
    """NVFP4: e2m1 codes packed 2 per byte, an e4m3 scale per 16 values of a row, an fp32 scale per group.

    ``tensor_scale_dims`` = number of leading dims that index the fp32 tensor scale: 1 (default) = one per slot,
    0 = one per tensor (slot-wise ``encode_into`` is then refused), 2 = one per (slot, head).
    """

    name = "nvfp4"

    def __init__(self, tensor_scale_dims: int = 1, check_finite: bool = True):
        super().__init__(check_finite=check_finite)
        if tensor_scale_dims < -1:
            raise ValueError(f"nvfp4: tensor_scale_dims must be >= 0, or -1 (one per row), got {tensor_scale_dims}")
        self.tensor_scale_dims = tensor_scale_dims

    def __repr__(self) -> str:
        return f"NVFP4Format(tensor_scale_dims={self.tensor_scale_dims})"

    def _check_shape(self, shape) -> None:
        super()._check_shape(shape)
        if len(shape) < self.tensor_scale_dims + 1:
            raise ValueError(f"{self.name}: tensor_scale_dims={self.tensor_scale_dims} needs a state of at least "
                             f"{self.tensor_scale_dims + 1} dims, got shape {tuple(shape)}")

    def _check_slot_writes(self) -> None:
        if self.tensor_scale_dims == 0:
            raise ValueError(f"{self.name}: one tensor scale for the whole cache (tensor_scale_dims=0) cannot be "
                             f"written slot by slot; use tensor_scale_dims >= 1 or index=None")

    def storage_spec(self, shape):
        shape = tuple(shape)
        c = shape[-1]
        return {"codes": (shape[:-1] + ((c + 1) // 2,), torch.uint8),
                "block_scale": (shape[:-1] + (-(-c // NVFP4_BLOCK),), torch.float8_e4m3fn),
                "tensor_scale": (shape[:self.tensor_scale_dims], torch.float32)}

    def row_nbytes(self, cols):
        return (cols + 1) // 2 + -(-cols // NVFP4_BLOCK)

    def _tensor_scale_view(self, s_g: torch.Tensor, ndim: int) -> torch.Tensor:
        return s_g.reshape(tuple(s_g.shape) + (1,) * (ndim - s_g.dim()))

    def _encode(self, x):
        k = self.tensor_scale_dims
        c = x.shape[-1]
        nb = -(-c // NVFP4_BLOCK)
        amax_t = x.abs().reshape(*x.shape[:k], -1).amax(dim=-1)
        s_g = amax_t / (FP8_E4M3_MAX * E2M1_MAX)
        s_g = torch.where(s_g > 0, s_g, torch.ones_like(s_g))  # zero group: scale 1 (all block scales 0)
        xb = torch.nn.functional.pad(x, (0, nb * NVFP4_BLOCK - c)).reshape(*x.shape[:-1], nb, NVFP4_BLOCK)
        s_g_b = self._tensor_scale_view(s_g, xb.dim() - 1)  # broadcasts over [..., R, nb]
        s_b = (xb.abs().amax(dim=-1) / (E2M1_MAX * s_g_b)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        eff = s_b.float() * s_g_b
        inv = 1.0 / torch.where(eff > 0, eff, torch.ones_like(eff))
        y = torch.where(eff.unsqueeze(-1) > 0, xb * inv.unsqueeze(-1), torch.zeros_like(xb))
        codes = e2m1_encode(y).reshape(*x.shape[:-1], nb * NVFP4_BLOCK)[..., :c]
        return {"codes": pack_nibbles(codes), "block_scale": s_b, "tensor_scale": s_g}

    def _decode(self, enc):
        c = enc.shape[-1]
        vals = e2m1_decode(unpack_nibbles(enc["codes"], c))
        bs = enc["block_scale"].float().repeat_interleave(NVFP4_BLOCK, dim=-1)[..., :c]
        # e2m1 * e4m3 is exact in fp32; then one rounding by the tensor scale
        return (vals * bs) * self._tensor_scale_view(enc["tensor_scale"], bs.dim())


class NVFP4RowFormat(NVFP4Format):
    """NVFP4 with the fp32 tensor scale per row of ``C`` values (``tensor_scale_dims=-1``, storage
    ``tensor_scale [..., R]``): everything else as :class:`NVFP4Format`. A kernel that holds whole rows then encodes
    them on the spot (no amax over a slot spread over many programs, no second pass over the fp32 checkpoint), at 4
    more bytes per row (0.59 instead of 0.5625 bytes per value at C = 128); the finer scale groups can only lower
    the error."""

    name = "nvfp4_row"

    def __init__(self, check_finite: bool = True):
        super().__init__(tensor_scale_dims=-1, check_finite=check_finite)

    def __repr__(self) -> str:
        return "NVFP4RowFormat()"

    def row_nbytes(self, cols):
        return super().row_nbytes(cols) + 4


FORMATS: dict[str, ReadCopyFormat] = {
    "bf16": BF16Format(),
    "fp8_e4m3": FP8E4M3RowFormat(),
    "nvfp4": NVFP4Format(),
    "nvfp4_row": NVFP4RowFormat(),
}


def get_format(fmt: Union[str, ReadCopyFormat]) -> ReadCopyFormat:
    """A format by name (``FORMATS`` key) or the format itself."""
    if isinstance(fmt, ReadCopyFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown read-copy format {fmt!r}; known: {sorted(FORMATS)}") from None


def quantize_dequantize(x: torch.Tensor, fmt: Union[str, ReadCopyFormat], dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """``decode(encode(x))`` in ``dtype`` (default: ``x.dtype``): what a reader of the copy sees."""
    f = get_format(fmt)
    return f.decode(f.encode(x), dtype=x.dtype if dtype is None else dtype)
