"""``torch.library`` custom op for speculative verification with the delta-rule replay state (GDN, KDA).

``replay_compile::delta_spec_verify``  outputs of ``T`` tokens per row from checkpoint + committed history; writes
                                       the ``T`` records ``(d, k, g)`` after the history (and, on flush rows, the
                                       folded checkpoint). Declares every tensor it mutates.

The commit is the family-agnostic ``replay_compile::spec_commit`` (:mod:`.spec`). CPU (and fp64):
:func:`~replay_compile.kernels.delta_spec_reference.delta_spec_verify_reference`; CUDA: the Triton kernel of
:mod:`replay_compile.kernels.delta_spec_triton` (``REPLAY_COMPILE_KERNELS=reference`` selects the reference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.delta_reference import _compute_dtype
from ..kernels.delta_spec_reference import delta_spec_verify_reference
from .delta import check_step_args
from .library import replay_op, use_triton
from .spec import check_spec_cursors


@replay_op("replay_compile::delta_spec_verify", mutates_args=("state", "d_ring", "k_ring", "g_ring"))
def delta_spec_verify(state: Tensor, d_ring: Tensor, k_ring: Tensor, g_ring: Tensor, w: Tensor, origin: Tensor,
                      is_flush: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      slot_idx: Optional[Tensor] = None) -> Tensor:
    """Verify ``T`` tokens per row (q, k [b, T, Hk, K]; v [b, T, HV, V]; g [b, T, HV(, K)]; beta [b, T, HV]);
    returns o [b, T, HV, V]. See :func:`delta_spec_verify_reference`."""
    if v.dim() != 4:
        raise ValueError(f"replay_compile.delta_spec: v must be [b, T, HV, V], got {tuple(v.shape)}")
    b, T = v.shape[:2]
    for name, t in (("q", q), ("k", k), ("g", g), ("beta", beta)):
        if t.dim() < 3 or tuple(t.shape[:2]) != (b, T):
            raise ValueError(f"replay_compile.delta_spec: {name} must start with [b={b}, T={T}], got {tuple(t.shape)}")
    check_step_args(state, d_ring, k_ring, g_ring, w, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], slot_idx)
    check_spec_cursors("delta_spec", state, d_ring.shape[2], w, origin, is_flush)
    if v.is_cuda and use_triton() and _compute_dtype(state, q, k, v, g, beta) == torch.float32:
        from ..kernels.delta_spec_triton import delta_spec_verify_triton  # lazily: triton is only needed on GPUs
        return delta_spec_verify_triton(state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta,
                                        slot_idx)
    return delta_spec_verify_reference(state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta,
                                       slot_idx)


@delta_spec_verify.register_fake
def _(state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta, slot_idx=None):
    return v.new_empty(v.shape, dtype=_compute_dtype(state, q, k, v, g, beta))
