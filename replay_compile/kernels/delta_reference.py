"""Reference math for the delta-rule families (Gated DeltaNet and Kimi Delta Attention), in plain PyTorch.

* :func:`delta_exact_step` — the exact recurrent decode step (the oracle), written the way transformers'
  ``torch_recurrent_gated_delta_rule`` (Qwen3-Next, Qwen3.5) and ``recurrent_kimi_delta_attention`` (Kimi-Linear)
  define it.
* ``delta_replay_*_reference`` — the ReplaySSM form. These are the CPU implementations of the custom ops in
  :mod:`replay_compile.ops.delta` and the references for the Triton kernels; same signatures, same in-place
  contracts.

Notation (per sequence row, value head ``h``, key head ``kh(h) = h // (HV // Hk)``), state in transformers' layout
``S: [K, V]``; ``q``, ``k`` arrive normalised and scaled (the model does that upstream)::

    S' = Diag(exp(g_t)) S_{t-1}              g_t <= 0: a scalar per head (GDN) or a vector over K (KDA)
    d_t = beta_t (v_t - S'ᵀ k_t)             the corrected value
    S_t = S' + k_t d_tᵀ                      linear in S once d_t is known
    o_t = S_tᵀ q_t = S'ᵀ q_t + d_t (k_t·q_t)

ReplaySSM keeps the checkpoint ``S_0`` and a ring of the last ``w < L`` records ``(d_j, k_j, g_j)``. With the
current token at index ``w`` and ``E_j = Σ_{j<i<=w} g_i`` (every exponent <= 0; clamped there)::

    S'ᵀ x = S_0ᵀ (exp(E_tot) ⊙ x) + Σ_{j<w} d_j ((k_j ⊙ exp(E_j)) · x),     E_tot = Σ_{i<=w} g_i

for ``x = k_t`` and ``x = q_t``: one read of ``S_0`` gives both, so GDN/KDA read the checkpoint every step and skip
only the write. The record stores the corrected value ``d`` (not ``v``), which is what makes the update linear and
the replay parallel over the window. It stores each token's own log-gate ``g_j``, not a running sum: every ``E_j`` is
then a sum of the gates after ``j`` alone. A running sum ``G_j`` would give ``E_j = G_w - G_j``, a difference of two
large numbers once a gate near -1e5 sits in the window (1% relative error in fp32 where the exact step is exact to
1e-7) and ``-inf - -inf = NaN`` for a gate of -inf; suffix sums of gates that are all <= 0 never cancel.

Ring layout (``S`` slots, ``L`` the buffer length)::

    state  [S, HV, K, V]   checkpoint, fp32 / bf16 / fp16 (fp64 in tests)
    d_ring [S, HV, L, V]   corrected values (record dtype, fp32 by default)
    k_ring [S, Hk, L, K]   normalised keys, one copy per key head
    g_ring [S, HV, L]      log-gates g_j, fp32 (GDN)   or   [S, HV, L, K] (KDA, per key channel)
    cursor [S]             int32, records held (0 <= w < L)

A step with ``w == L-1`` is a flush: it folds the ``L-1`` records and the current token into the checkpoint and
writes it once; ``w`` returns to 0. Rows whose ``slot_idx`` is negative are padding: nothing of theirs is read or
written and their output is zero.
"""

from __future__ import annotations

import torch

from .mamba2_reference import _compute_dtype, _fold_rows, _rows, _store_checkpoint

__all__ = [
    "delta_exact_step",
    "delta_replay_step_reference",
    "delta_replay_materialize_reference",
    "delta_replay_flush_reference",
]


def _per_value_head(t: torch.Tensor, HV: int) -> torch.Tensor:
    """[r, Hk, ...] -> [r, HV, ...]: value head h reads key head h // (HV // Hk) (transformers' repeat_interleave)."""
    Hk = t.shape[1]
    return t if Hk == HV else t.repeat_interleave(HV // Hk, dim=1)


def delta_exact_step(state, q, k, v, g, beta):
    """Exact delta-rule decode step; updates ``state`` in place and returns ``o``.

    Args:
        state: [b, HV, K, V]. q, k: [b, Hk, K] (normalised and scaled), HV % Hk == 0. v: [b, HV, V].
        g: [b, HV] log-gate (GDN) or [b, HV, K] (KDA). beta: [b, HV].
    Returns:
        o: [b, HV, V] in the compute dtype (fp64 if any input is fp64, else fp32).
    """
    cdt = _compute_dtype(state, q, k, v, g, beta)
    HV = v.shape[1]
    qh, kh = _per_value_head(q.to(cdt), HV), _per_value_head(k.to(cdt), HV)
    a = torch.exp(g.to(cdt))
    a = a[..., None, None] if g.dim() == 2 else a[..., None]            # decays rows (K) of S: [K, V]
    s = state.to(cdt) * a
    d = beta.to(cdt)[..., None] * (v.to(cdt) - torch.einsum("bhkv,bhk->bhv", s, kh))
    s = s + kh[..., :, None] * d[..., None, :]
    state.copy_(s.to(state.dtype))
    return torch.einsum("bhkv,bhk->bhv", s, qh)


def _suffix_after(g):
    """``E_j = Σ_{i>j} g_i`` along dim 2 of ``g`` [r, HV, L(, K)] (zeros where a record is absent), ``E_tot = Σ_i g_i``.

    Suffix sums, never a difference: the gates are <= 0, so no term cancels another whatever their size (a gate of
    -1e5 or -inf in the window leaves the exponents of the records after it exact).
    """
    incl = g.flip(2).cumsum(2).flip(2)                                  # Σ_{i>=j}
    after = torch.cat([incl[:, :, 1:], torch.zeros_like(incl[:, :, :1])], dim=2)
    return incl[:, :, 0], after


def _window(g_ring_rows, g_cur, w, L, cdt):
    """Log-gates of the window with the current token at index ``w``; returns (E_tot, E, hist).

    Args:
        g_ring_rows: [r, HV, L] or [r, HV, L, K] ring contents ``g_j`` (garbage at j >= w); g_cur: [r, HV] or
            [r, HV, K]. w: [r] cursors.
    Returns:
        E_tot: [r, HV(, K)] = Σ_{i<=w} g_i; E: [r, HV, L(, K)] = min(Σ_{j<i<=w} g_i, 0) (0 where j >= w);
        hist: [r, L] bool, j < w.
    """
    r = w.shape[0]
    ar = torch.arange(L + 1, device=w.device)
    shape = (r, 1, L + 1) + ((1,) if g_ring_rows.dim() == 4 else ())
    padded = torch.cat([g_ring_rows.to(cdt), torch.zeros_like(g_ring_rows[:, :, :1], dtype=cdt)], dim=2)
    padded = torch.where((ar[None, :] < w[:, None]).view(shape), padded, torch.zeros((), dtype=cdt))
    padded = torch.where((ar[None, :] == w[:, None]).view(shape), g_cur.to(cdt).unsqueeze(2), padded)
    E_tot, after = _suffix_after(padded)                                # the current token at index w
    hist = ar[None, :L] < w[:, None]                                    # [r, L]
    E = torch.where(hist.view((r, 1, L) + shape[3:]), after[:, :, :L].clamp(max=0), torch.zeros((), dtype=cdt))
    return E_tot, E, hist


def _fold_window(g_ring_rows, n, L, cdt):
    """(E_tot, E, valid) of a fold of the first ``n`` records (token ``n - 1`` the last): ``E_j = min(Σ_{j<i<n} g_i,
    0)`` for j < n, else 0; ``E_tot = Σ_{i<n} g_i`` (0 where n == 0)."""
    r = n.shape[0]
    ar = torch.arange(L, device=n.device)
    valid = ar[None, :] < n[:, None]
    shape = (r, 1, L) + ((1,) if g_ring_rows.dim() == 4 else ())
    G = torch.where(valid.view(shape), g_ring_rows.to(cdt), torch.zeros((), dtype=cdt))
    E_tot, after = _suffix_after(G)
    E = torch.where(valid.view(shape), after.clamp(max=0), torch.zeros((), dtype=cdt))
    return E_tot, E, valid


def _scale_keys(E, Kh):
    """k_j ⊙ exp(E_j): E [r, HV, L] or [r, HV, L, K], Kh [r, HV, L, K]."""
    return Kh * (torch.exp(E)[..., None] if E.dim() == 3 else torch.exp(E))


def _decay_vec(E_tot, x):
    """exp(E_tot) ⊙ x for x [r, HV, K]; E_tot [r, HV] or [r, HV, K]."""
    return x * (torch.exp(E_tot)[..., None] if E_tot.dim() == 2 else torch.exp(E_tot))


def delta_replay_step_reference(state, d_ring, k_ring, g_ring, cursor, q, k, v, g, beta, slot_idx=None):
    """One ReplaySSM delta-rule decode step, in place on the checkpoint, rings and cursor; returns ``o``.

    Args:
        state: [S, HV, K, V] checkpoint (written only by flush rows, ``cursor == L-1``).
        d_ring: [S, HV, L, V]; k_ring: [S, Hk, L, K]; g_ring: [S, HV, L] (GDN) or [S, HV, L, K] (KDA);
            cursor: [S] int32.
        q, k: [b, Hk, K] normalised (and for q scaled); v: [b, HV, V]; g: [b, HV] or [b, HV, K] log-gate;
            beta: [b, HV].
        slot_idx: [b] slot of each row, negative for padding; ``None``: row i uses slot i.
    Returns:
        o: [b, HV, V] in the compute dtype; zero for padded rows.
    """
    cdt = _compute_dtype(state, q, k, v, g, beta)
    b, HV, V = v.shape
    L = d_ring.shape[2]
    o = torch.zeros(b, HV, V, dtype=cdt, device=v.device)
    rows, slots = _rows(slot_idx, b, v.device)
    if rows.numel() == 0:
        return o
    w = cursor[slots].long()
    E_tot, E, hist = _window(g_ring[slots], g[rows], w, L, cdt)
    E_tot = E_tot.clamp(max=0)
    D = torch.where(hist[:, None, :, None], d_ring[slots].to(cdt), torch.zeros((), dtype=cdt))      # [r, HV, L, V]
    KE = _scale_keys(E, _per_value_head(k_ring[slots].to(cdt), HV))                                 # [r, HV, L, K]
    KE = torch.where(hist[:, None, :, None], KE, torch.zeros((), dtype=cdt))
    qh, kh = _per_value_head(q[rows].to(cdt), HV), _per_value_head(k[rows].to(cdt), HV)           # [r, HV, K]
    S0 = state[slots].to(cdt)

    def decayed_read(x):                                                # S'ᵀ x, from checkpoint + records
        return torch.einsum("rhkv,rhk->rhv", S0, _decay_vec(E_tot, x)) + \
            torch.einsum("rhlv,rhl->rhv", D, torch.einsum("rhlk,rhk->rhl", KE, x))

    d = beta[rows].to(cdt)[..., None] * (v[rows].to(cdt) - decayed_read(kh))                         # [r, HV, V]
    out = decayed_read(qh) + d * (kh * qh).sum(-1, keepdim=True)

    flush = w == L - 1
    if bool(flush.any()):
        f = flush.nonzero().flatten()
        dec = torch.exp(E_tot[f])
        dec = dec[..., None, None] if dec.dim() == 2 else dec[..., None]
        S_new = dec * S0[f] + torch.einsum("rhlk,rhlv->rhkv", KE[f], D[f]) + kh[f][..., :, None] * d[f][..., None, :]
        la_key = g[rows[f]] if g.dim() == 2 else g[rows[f]][..., 0]
        _store_checkpoint(state, slots[f], S_new, la_key)
    nf = (~flush).nonzero().flatten()
    if nf.numel():
        s, wn, rn = slots[nf], w[nf], rows[nf]
        d_ring[s, :, wn] = d[nf].to(d_ring.dtype)
        k_ring[s, :, wn] = k[rn].to(k_ring.dtype)
        g_ring[s, :, wn] = g[rn].to(g_ring.dtype)
    cursor[slots] = torch.where(flush, torch.zeros_like(w), w + 1).to(cursor.dtype)
    o[rows] = out
    return o


def fold_terms(d_rows, k_rows, g_rows, n, HV: int, cdt):
    """``(dec, KE, D)`` of the fold of the first ``n`` [r] records of each row (the window as if token ``n - 1``
    were the last one), so that the folded state is ``dec ⊙ S0 + KEᵀ D``: ``dec`` [r, HV, 1, 1] (GDN) or
    [r, HV, K, 1] (KDA), ``KE = k_j ⊙ exp(E_j)`` [r, HV, L, K], ``D`` [r, HV, L, V], zeros past ``n``. Rows of
    d [r, HV, L, V], k [r, Hk, L, K], g [r, HV, L(, K)] in logical order."""
    E_tot, after, valid = _fold_window(g_rows, n, d_rows.shape[2], cdt)
    keep = valid[:, None, :, None]
    zero = torch.zeros((), dtype=cdt)
    D = torch.where(keep, d_rows.to(cdt), zero)
    KE = torch.where(keep, _scale_keys(after, _per_value_head(k_rows.to(cdt), HV)), zero)
    dec = torch.exp(E_tot.clamp(max=0))
    return (dec[..., None, None] if dec.dim() == 2 else dec[..., None]), KE, D


def _fold(state, d_ring, k_ring, g_ring, cursor, count, slot_idx):
    """(rows, slots, S): the state after ``count`` records of each non-padded row, in the compute dtype."""
    HV = state.shape[1]
    cdt = _compute_dtype(state, g_ring)
    rows, slots, n = _fold_rows(state, cursor, count, slot_idx)
    if rows.numel() == 0:
        return rows, slots, state.new_zeros((0,) + tuple(state.shape[1:]), dtype=cdt)
    dec, KE, D = fold_terms(d_ring[slots], k_ring[slots], g_ring[slots], n, HV, cdt)
    S0 = state[slots].to(cdt)
    S = dec * S0 + torch.einsum("rhlk,rhlv->rhkv", KE, D)
    return rows, slots, torch.where((n == 0)[:, None, None, None], S0, S)     # no records: bit-exact copy


def delta_replay_materialize_reference(state, d_ring, k_ring, g_ring, cursor, count=None, slot_idx=None):
    """The true state after the first ``count`` records of each slot; reads only, returns a new tensor.

    Args as :func:`delta_replay_step_reference`; ``count``: [b] in ``[0, cursor]`` (``None``: all held records);
    ``slot_idx``: [b] slots (negative: padding, zero output; ``None``: every slot in order).
    Returns:
        [b, HV, K, V] in ``state.dtype``.
    """
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    out = torch.zeros((b,) + tuple(state.shape[1:]), dtype=state.dtype, device=state.device)
    rows, _, S = _fold(state, d_ring, k_ring, g_ring, cursor, count, slot_idx)
    out[rows] = S.to(state.dtype)
    return out


def delta_replay_flush_reference(state, d_ring, k_ring, g_ring, cursor, slot_idx=None):
    """Fold every held record into the checkpoint (in place) and set the cursor to 0; rows without records are
    left bit-unchanged. ``slot_idx``: [b] slots to flush (negative ignored); ``None``: every slot."""
    slots = torch.arange(state.shape[0], device=state.device) if slot_idx is None else slot_idx[slot_idx >= 0].long()
    slots = slots[cursor[slots] > 0] if slots.numel() else slots
    if slots.numel() == 0:
        return
    _, _, S = _fold(state, d_ring, k_ring, g_ring, cursor, None, slots)
    last = cursor[slots].long() - 1
    key = g_ring[slots, :, last]                                         # [r, HV] (GDN) or [r, HV, K] (KDA)
    key = key if key.dim() == 2 else key[..., 0]                        # stochastic-rounding key: last record's g
    _store_checkpoint(state, slots, S, key)
    cursor[slots] = 0
