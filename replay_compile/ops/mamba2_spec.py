"""``torch.library`` custom ops for speculative decoding with the Mamba-2 replay state.

``replay_compile::mamba2_spec_verify``  outputs of ``T`` tokens per row from checkpoint + committed history; writes
                                        the ``T`` records after the history (and, on flush rows, the folded
                                        checkpoint). Declares every tensor it mutates.
(The commit, cursor moves only, is family-agnostic: ``replay_compile::spec_commit`` in :mod:`.spec`.)

CPU implementation: :mod:`replay_compile.kernels.mamba2_spec_reference`, where the ring layout, the cursors and the
flush rule are documented. CUDA: the Triton verify kernel and the host-sync-free commit of
:mod:`replay_compile.kernels.mamba2_spec_triton` (``REPLAY_COMPILE_KERNELS=reference`` selects the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels import mamba2_spec_reference as ref
from .library import replay_op, use_triton
from .mamba2 import check_ring_args
from .spec import check_spec_cursors


def _fail(msg: str):
    raise ValueError(f"replay_compile.mamba2_spec: {msg}")


@replay_op("replay_compile::mamba2_spec_verify",
                         mutates_args=("state", "x_ring", "dt_ring", "la_ring", "B_ring"))
def mamba2_spec_verify(state: Tensor, x_ring: Tensor, dt_ring: Tensor, la_ring: Tensor, B_ring: Tensor,
                       w: Tensor, origin: Tensor, is_flush: Tensor, x: Tensor, dt: Tensor, la: Tensor, B: Tensor,
                       C: Tensor, slot_idx: Optional[Tensor] = None) -> Tensor:
    """Verify ``T`` tokens per row (x [b, T, H, P]; dt, la [b, T, H]; B [b, T, G, N]; C [b, T, Gc, N]);
    returns y [b, T, H, P]. See :func:`spec_verify_reference`."""
    check_ring_args(state, x_ring, dt_ring, la_ring, B_ring, w)
    check_spec_cursors("mamba2_spec", state, x_ring.shape[2], w, origin, is_flush)
    S, H, P, N = state.shape
    if x.dim() != 4 or tuple(x.shape[2:]) != (H, P):
        _fail(f"x must be [b, T, H={H}, P={P}], got {tuple(x.shape)}")
    b, T = x.shape[:2]
    for name, t in (("dt", dt), ("la", la)):
        if tuple(t.shape) != (b, T, H):
            _fail(f"{name} must be [b={b}, T={T}, H={H}], got {tuple(t.shape)}")
    if tuple(B.shape) != (b, T, B_ring.shape[1], N) or C.dim() != 4 or tuple(C.shape[:2]) != (b, T) \
            or C.shape[3] != N or H % C.shape[2]:
        _fail(f"B must be [b, T, G, N] and C [b, T, Gc, N] with H % Gc == 0; got {tuple(B.shape)}, {tuple(C.shape)}")
    from ..kernels.mamba2_reference import _compute_dtype

    if x.is_cuda and use_triton() and _compute_dtype(state, x, dt, la) == torch.float32:   # fp64 stays reference
        from ..kernels.mamba2_spec_triton import spec_verify_triton  # lazily: triton is only needed on GPUs
        return spec_verify_triton(state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush, x, dt, la, B, C,
                                  slot_idx)
    return ref.spec_verify_reference(state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush, x, dt, la, B, C,
                                     slot_idx)


@mamba2_spec_verify.register_fake
def _(state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush, x, dt, la, B, C, slot_idx=None):
    from ..kernels.mamba2_reference import _compute_dtype

    return x.new_empty(x.shape, dtype=_compute_dtype(state, x, dt, la))
