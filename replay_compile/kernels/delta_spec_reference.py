"""Reference math of speculative decoding with ReplaySSM for the delta rule (GDN, KDA): verify and commit.

Same ring, cursors, flush rule and commit as :mod:`.mamba2_spec_reference` (read its notes); the records are the
delta rule's ``(d, k, g)`` of :mod:`.delta_reference`. Verify computes, for each of the ``T`` tokens of a row, the
corrected value ``d_s = beta_s (v_s - S'_sᵀ k_s)`` and the output ``o_s`` from the committed state and the window's
earlier tokens, and writes the ``T`` records after the history. Here that is done by stepping a temporary copy of
the committed state through the window: the semantics the chunkwise (WY/UT) kernels must reproduce without
materialising any state. The checkpoint is written only by flush rows (history folded first, once).
"""

from __future__ import annotations

import torch

from .delta_readcopy_reference import delta_exact_fold
from .delta_reference import _compute_dtype, _per_value_head, _store_checkpoint, delta_exact_step
from .mamba2_spec_reference import spec_rows

__all__ = ["delta_spec_exact_fold", "delta_spec_materialize_reference", "delta_spec_verify_reference"]


def delta_spec_materialize_reference(state, d_ring, k_ring, g_ring, w, origin, slot: int):
    """The committed state of one slot (checkpoint + its ``w`` history records), compute dtype [HV, K, V]."""
    cdt = _compute_dtype(state, g_ring)
    buf = d_ring.shape[2]
    HV = state.shape[1]
    S = state[slot].to(cdt)
    for j in range(int(w[slot])):
        p = (int(origin[slot]) + j) & (buf - 1)
        a = torch.exp(g_ring[slot, :, p].to(cdt))
        a = a[:, None, None] if g_ring.dim() == 3 else a[..., None]
        kh = _per_value_head(k_ring[slot:slot + 1, :, p].to(cdt), HV)[0]            # [HV, K]
        S = a * S + kh[..., :, None] * d_ring[slot, :, p].to(cdt)[..., None, :]
    return S


def delta_spec_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, w, origin, slot: int):
    """The committed state of one slot by the exact recurrence over its ``w[slot]`` raw records ``(k, g, v, beta)``
    from ring index ``origin[slot]`` on, from the fp32 checkpoint (read-copy mode: the stored corrected values were
    computed from the copy and are not used). Compute dtype [HV, K, V]."""
    slots = torch.tensor([slot], device=state.device)
    return delta_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, slots, w[slots], _compute_dtype(state, g_ring),
                            origin=origin)[0]


def delta_spec_verify_reference(state, d_ring, k_ring, g_ring, w, origin, is_flush, q, k, v, g, beta,
                                slot_idx=None, read_state=None, read_format=None, v_ring=None, beta_ring=None):
    """Verify ``T`` tokens per row; returns ``o`` [b, T, HV, V].

    Args:
        state: [S, HV, K, V]; d_ring [S, HV, buf, V]; k_ring [S, Hk, buf, K]; g_ring [S, HV, buf(, K)];
            w, origin [S] int32; is_flush [S] bool (not changed here).
        q, k: [b, T, Hk, K]; v: [b, T, HV, V]; g: [b, T, HV] or [b, T, HV, K]; beta: [b, T, HV].
        read_state: optional [S, HV, K, V] low-precision *read copy* of the checkpoint (held decoded):
            ordinary rows compute their outputs (and the corrected values they store, used for outputs only)
            from it. The delta rule's corrected values depend on the state, so to keep the copy's rounding out of
            the recurrence the raw inputs are kept too (``v_ring`` [S, HV, buf, V], ``beta_ring`` [S, HV, buf]) and
            flush rows fold their history by the exact recurrence from the fp32 checkpoint
            (:func:`delta_spec_exact_fold`), then rewrite their copy as ``read_format(folded)``.
    """
    cdt = _compute_dtype(state, q, k, v, g, beta)
    b, T, HV, V = v.shape
    buf = d_ring.shape[2]
    mask = buf - 1
    o = torch.zeros(b, T, HV, V, dtype=cdt, device=v.device)
    copy = read_state is not None
    for r, s, ww, org in spec_rows(slot_idx, b, w, origin, T, buf):
        if copy and bool(is_flush[s]):
            S = delta_spec_exact_fold(state, k_ring, g_ring, v_ring, beta_ring, w, origin, s)
        else:
            S = delta_spec_materialize_reference(read_state if copy else state, d_ring, k_ring, g_ring, w, origin, s)
        if bool(is_flush[s]) and ww > 0:
            _store_checkpoint(state, torch.tensor([s]), S[None],
                              g_ring[s, :, (org + ww - 1) & mask].reshape(1, HV, -1)[..., 0])
            if copy:
                read_state[s] = read_format(S).to(read_state.dtype)
        S = S[None].clone()
        for t in range(T):
            before = S.clone()
            pick = lambda x: x[r:r + 1, t].to(cdt)  # noqa: E731
            o[r, t] = delta_exact_step(S, pick(q), pick(k), pick(v), pick(g), pick(beta))[0]
            # the record: the corrected value this token added (S = decayed before + k dᵀ)
            a = torch.exp(pick(g))
            a = a[..., None, None] if g.dim() == 3 else a[..., None]
            kh = _per_value_head(pick(k), HV)[0]                                            # [HV, K]
            dvec = beta[r, t].to(cdt)[:, None] * (v[r, t].to(cdt) - torch.einsum("hkv,hk->hv", (a * before)[0], kh))
            p = (org + ww + t) & mask
            d_ring[s, :, p] = dvec.to(d_ring.dtype)
            k_ring[s, :, p] = k[r, t].to(k_ring.dtype)
            g_ring[s, :, p] = g[r, t].to(g_ring.dtype)
            if copy:
                v_ring[s, :, p] = v[r, t].to(v_ring.dtype)
                beta_ring[s, :, p] = beta[r, t].to(beta_ring.dtype)
    return o
