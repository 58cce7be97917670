"""Reference of the delta-rule (GDN / KDA) replay step with a low-precision *read copy* of the checkpoint.

As for Mamba-2 (:mod:`.mamba2_readcopy_reference`), non-flush steps take the checkpoint term from a copy in a storage
format of :mod:`replay_compile.quant.formats` and never read the fp32 checkpoint; flushes rewrite the copy from the new
checkpoint. One difference: the delta rule's record is the *corrected value* ``d = β (v − S'ᵀ k)``, which depends on
the state. Computed from the copy, it carries the copy's rounding, so folding those records would let the rounding
into the recurrence. The read-copy form therefore also keeps each token's raw ``v`` and ``β`` (``v_ring``,
``beta_ring``), and every flush re-runs the *exact* recurrence over the raw window from the fp32 checkpoint
(:func:`delta_exact_fold`). The corrected values in ``d_ring`` (from the copy) serve only the outputs of the steps
inside the window, as in the plain replay step.

Extra rings (slot-major, ``L`` the buffer length)::

    v_ring    [S, HV, L, V]   raw values (the d_ring dtype)
    beta_ring [S, HV, L]      raw write strengths (fp32)

Contract (in place on ``state``, the copy, the rings and ``cursor``; returns ``o [b, HV, V]`` in the compute dtype):

* non-flush rows (``cursor < L-1``): ``delta_replay_step_reference`` run on the *decoded copy* (output, record
  appended, cursor advanced), plus ``v`` / ``β`` appended to their rings; ``state`` is not read;
* flush rows (``cursor == L-1``): the exact recurrence from ``state`` over the held raw records and the current
  token (``o`` from it), the result written to ``state`` (fp16: stochastic rounding, keyed as in the plain step),
  the copy's slots rewritten from the stored value, cursor to 0;
* padded rows (``slot_idx < 0``): nothing read or written, ``o = 0``.

:func:`delta_flush_readcopy_reference` / :func:`delta_materialize_readcopy_reference` are the explicit flush and the
out-of-place state, both exact from the raw rings.
"""

from __future__ import annotations

import torch

from ..quant.formats import get_format
from .delta_reference import delta_exact_step, delta_replay_step_reference
from .mamba2_readcopy_reference import as_encoded, decode_slots
from .mamba2_reference import _compute_dtype, _fold_rows, _rows, _store_checkpoint

__all__ = ["delta_exact_fold", "delta_replay_step_readcopy_reference", "delta_flush_readcopy_reference",
           "delta_materialize_readcopy_reference"]


def delta_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, slots, n, cdt, origin=None):
    """The exact recurrence over the first ``n[r]`` raw records of slot ``slots[r]`` from the checkpoint:
    ``[r, HV, K, V]`` in ``cdt`` (the checkpoint itself, converted exactly, where ``n == 0``).

    Record ``j`` of a slot sits at ring index ``j``, or ``(origin[slot] + j) mod buf`` with ``origin`` (``[S]``:
    the speculative rings, whose window starts anywhere in the ring)."""
    S = state[slots].to(cdt)
    if slots.numel() == 0:
        return S
    Hk, K = k_ring.shape[1], k_ring.shape[3]
    buf = k_ring.shape[2]
    rows = torch.arange(slots.numel(), device=slots.device)
    start = origin[slots].long() if origin is not None else torch.zeros_like(slots)
    zeros_q = torch.zeros(slots.numel(), Hk, K, dtype=cdt, device=state.device)
    for j in range(int(n.max())):
        pos = (start + j) % buf

        def at(ring):                                # [r, H, ...] at each row's ring index
            return ring[slots][rows, :, pos].to(cdt)
        nxt = S.clone()
        delta_exact_step(nxt, zeros_q, at(k_ring), at(v_ring), at(g_ring), at(beta_ring))
        S = torch.where((n > j)[:, None, None, None], nxt, S)
    return S


def _stored(state, slots, S, key, enc, f):
    """Write folded states (fp16: stochastic rounding) and rewrite the copy of those slots from the stored value."""
    _store_checkpoint(state, slots, S, key)
    f.encode_into(enc, state[slots].to(torch.float32), slots)


def delta_replay_step_readcopy_reference(state, copy, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor,
                                         q, k, v, g, beta, slot_idx=None):
    """One delta-rule replay step reading non-flush rows' checkpoint term from the read copy.

    Args:
        state: [S, HV, K, V] checkpoint (fp32 / bf16 / fp16); read and written only by flush rows.
        copy: the read copy (``FORMATS[fmt].allocate(state.shape)``'s tensors, an ``Encoded`` or a dict).
        fmt: ``"bf16"``, ``"fp8_e4m3"``, ``"nvfp4"`` or a ``ReadCopyFormat``.
        d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx: as ``delta_replay_step_reference``.
        v_ring: [S, HV, L, V]; beta_ring: [S, HV, L] (raw inputs for the exact flush).
    Returns:
        o: [b, HV, V] in the compute dtype; zero for padded rows.
    """
    f = get_format(fmt)
    enc = as_encoded(copy, f, state.shape)
    cdt = _compute_dtype(state, q, k, v, g, beta)
    b, HV, V = v.shape
    L = d_ring.shape[2]
    o = torch.zeros(b, HV, V, dtype=cdt, device=v.device)
    rows, slots = _rows(slot_idx, b, v.device)
    if rows.numel() == 0:
        return o
    w = cursor[slots].long()
    flush = w == L - 1
    # both parts see the cursor before either advances it (disjoint slots: a slot has one row)
    nf = (~flush).nonzero().flatten()
    if nf.numel():
        s_nf, r_nf, w_nf = slots[nf], rows[nf], w[nf]
        proxy = torch.zeros(state.shape, dtype=cdt, device=state.device)         # decoded copy of the reading slots
        proxy[s_nf] = decode_slots(f, enc, s_nf).to(cdt)
        idx = torch.full((b,), -1, dtype=torch.int64, device=v.device)
        idx[r_nf] = s_nf
        o_nf = delta_replay_step_reference(proxy, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, idx)
        o[r_nf] = o_nf[r_nf]
        v_ring[s_nf, :, w_nf] = v[r_nf].to(v_ring.dtype)
        beta_ring[s_nf, :, w_nf] = beta[r_nf].to(beta_ring.dtype)
    fl = flush.nonzero().flatten()
    if fl.numel():
        s_f, r_f = slots[fl], rows[fl]
        S = delta_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, s_f, w[fl], cdt)
        o[r_f] = delta_exact_step(S, q[r_f], k[r_f], v[r_f], g[r_f], beta[r_f]).to(cdt)    # S updated in place
        key = g[r_f] if g.dim() == 2 else g[r_f][..., 0]
        _stored(state, s_f, S, key, enc, f)
        cursor[s_f] = 0
    return o


def delta_flush_readcopy_reference(state, copy, fmt, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor,
                                   slot_idx=None):
    """Fold every held record exactly (from the raw rings) into the checkpoint, rewrite those slots' copy, cursor to
    0; slots without records are left bit-unchanged. ``slot_idx``: slots to flush (negative ignored; None: all)."""
    f = get_format(fmt)
    enc = as_encoded(copy, f, state.shape)
    slots = torch.arange(state.shape[0], device=state.device) if slot_idx is None else slot_idx[slot_idx >= 0].long()
    slots = slots[cursor[slots] > 0] if slots.numel() else slots
    if slots.numel() == 0:
        return
    n = cursor[slots].long()
    S = delta_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, slots, n, _compute_dtype(state, g_ring))
    key = g_ring[slots, :, n - 1]
    _stored(state, slots, S, key if key.dim() == 2 else key[..., 0], enc, f)
    cursor[slots] = 0


def delta_materialize_readcopy_reference(state, d_ring, k_ring, g_ring, v_ring, beta_ring, cursor, count=None,
                                         slot_idx=None):
    """The true state after the first ``count`` records (default all) of each slot, exact from the raw rings; reads
    only. Returns [b, HV, K, V] in ``state.dtype`` (zeros for padded rows)."""
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    out = torch.zeros((b,) + tuple(state.shape[1:]), dtype=state.dtype, device=state.device)
    rows, slots, n = _fold_rows(state, cursor, count, slot_idx)
    if rows.numel():
        S = delta_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, slots, n, _compute_dtype(state, g_ring))
        out[rows] = S.to(state.dtype)
    return out
