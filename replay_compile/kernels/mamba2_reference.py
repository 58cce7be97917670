"""Reference math for the Mamba-2 family, in plain PyTorch.

Two things live here:

* :func:`mamba2_exact_step` — the exact recurrent decode step (the oracle), written the way
  ``selective_state_update`` defines it.
* ``replay_*_reference`` — the ReplaySSM form of the same recurrence. These are the CPU implementations of the
  custom ops in :mod:`replay_compile.ops.mamba2` and the references the Triton kernels are tested against; they
  have the ops' exact signatures and in-place contracts.

Notation (per sequence row, per head ``h``, group ``g(h) = h // (H // G)``)::

    S_t = a_t * S_{t-1} + dt_t * x_t B_tᵀ          S: [P, N], x: [P], B: [N], a_t = exp(la_t), la_t <= 0
    y_t = S_t C_t                                  C: [N]

ReplaySSM keeps the checkpoint ``S_0`` (the cache tensor) and a ring of the last ``w < L`` records
``(x_j, dt_j, la_j, B_j)``. With the current token placed at index ``w``::

    y_t = exp(Σ_{i<=w} la_i) (S_0 C_t) + Σ_{j<=w} dt_j exp(Σ_{j<i<=w} la_i) (B_j·C_t) x_j

Every exponent is a *suffix sum* of log-decays, so it is <= 0 whenever the decays are <= 1 and cannot overflow;
it is never formed as the difference of two large prefix sums. The log-decay ``la`` is stored per record (not
recomputed from ``A``) so that a flush needs nothing but the ring: any caller can fold at any time.

Ring layout (``S`` slots in the pool, ``L`` the buffer length)::

    state   [S, H, P, N]  checkpoint, fp32 / bf16 / fp16 (fp64 in tests)
    x_ring  [S, H, L, P]  activation dtype
    dt_ring [S, H, L]     fp32 (fp64 in tests)
    la_ring [S, H, L]     fp32 (fp64 in tests)
    B_ring  [S, G, L, N]  activation dtype
    cursor  [S]           int32, records held (0 <= w < L)

A step with ``w == L-1`` is a flush: it folds the ``L-1`` records and the current token into the checkpoint,
writes it once and sets ``w = 0``. Flushes round an fp16 checkpoint stochastically (:func:`stochastic_round_fp16`)
so that rounding errors do not accumulate with a bias over many flushes; bf16 and fp32 round to nearest. Any other
step writes only its record. Rows whose ``slot_idx`` is negative are padding: nothing of theirs is read or written and
their output is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "mamba2_exact_step",
    "mamba2_plain_step",
    "replay_step_reference",
    "replay_flush_reference",
    "replay_materialize_reference",
    "stochastic_round_fp16",
]


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """[r, G, ..., N] -> [r, H, ..., N] by repeating each group over its H // G heads."""
    G = t.shape[1]
    return t if G == H else t.repeat_interleave(H // G, dim=1)


def mamba2_exact_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True):
    """Exact Mamba-2 decode step; updates ``state`` in place and returns ``y``.

    Args:
        state: [b, H, P, N] recurrent state (updated in place).
        x: [b, H, P]; dt: [b, H] raw time step; A: [H] (negative); B, C: [b, G, N] with H % G == 0;
        D: [H] skip; z: [b, H, P] gate (``y *= silu(z)``); dt_bias: [H]; dt_softplus: apply softplus
        (threshold 20, as ``F.softplus``) to ``dt + dt_bias``.
    Returns:
        y: [b, H, P] in the compute dtype (fp64 if any input is fp64, else fp32).
    """
    cdt = _compute_dtype(state, x, dt, A, B, C)
    H = x.shape[1]
    delta = dt.to(cdt)
    if dt_bias is not None:
        delta = delta + dt_bias.to(cdt)
    if dt_softplus:
        delta = F.softplus(delta)
    dA = torch.exp(delta * A.to(cdt))                                   # [b, H]
    Bh, Ch = _per_head(B.to(cdt), H), _per_head(C.to(cdt), H)           # [b, H, N]
    new = state.to(cdt) * dA[..., None, None] + (delta[..., None] * x.to(cdt))[..., None] * Bh[:, :, None, :]
    state.copy_(new.to(state.dtype))
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + D.to(cdt)[:, None] * x.to(cdt)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y


def mamba2_plain_step(state, x, dt, la, B, C):
    """One plain step in the ops' terms (``S = exp(la) S + dt x Bᵀ; y = S C``), in place; returns ``y``.

    Shapes as :func:`replay_step_reference` without the ring; ``state`` rows correspond to batch rows.
    """
    cdt = _compute_dtype(state, x, dt, la)
    H = x.shape[1]
    Bh, Ch = _per_head(B.to(cdt), H), _per_head(C.to(cdt), H)
    new = state.to(cdt) * torch.exp(la.to(cdt))[..., None, None] + \
        (dt.to(cdt)[..., None] * x.to(cdt))[..., None] * Bh[:, :, None, :]
    state.copy_(new.to(state.dtype))
    return torch.einsum("bhpn,bhn->bhp", new, Ch)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values (the Triton kernel computes the same)."""
    def mul32(v, c):                         # v * c mod 2**32 without overflowing int64
        return (v * (c & 0xFFFF) + (((v * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fp32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def stochastic_round_fp16(v: torch.Tensor, la: torch.Tensor, slots: torch.Tensor, H: int) -> torch.Tensor:
    """Round a folded checkpoint to fp16 stochastically (unbiased), exactly as the Triton kernel does.

    Each value goes to one of its two fp16 neighbours with probability proportional to proximity; the uniform
    number is a hash of (slot, head, element offset within the head, bits of the fp32 log-decay ``la``), so the
    result is deterministic for given inputs, differs from flush to flush, and leaves the global RNG alone.

    Args:
        v: [r, H, P, N] folded state (any float dtype; rounded from its fp32 value).
        la: [r, H] log-decay whose bits key the hash (the flushing token's); slots: [r] slot of each row.
    Returns:
        [r, H, P, N] float16.
    """
    v = v.to(torch.float32)
    r, _, P, N = v.shape
    rn = v.to(torch.float16)
    bits = rn.view(torch.int16)
    lo_bits = torch.where(rn.to(torch.float32).abs() > v.abs(), bits - 1, bits)
    lo, hi = lo_bits.view(torch.float16), (lo_bits + 1).view(torch.float16)
    lo_f = lo.to(torch.float32)
    frac = (v.abs() - lo_f.abs()) / (hi.to(torch.float32).abs() - lo_f.abs())
    head = slots.to(torch.int64)[:, None] * H + torch.arange(H, device=v.device)[None, :]        # [r, H]
    key = _hash32(_fp32_bits(la) ^ _hash32(head & 0xFFFFFFFF))
    offs = torch.arange(P * N, device=v.device, dtype=torch.int64).view(P, N)
    u = (_hash32(key[:, :, None, None] ^ offs) >> 8).to(torch.float32) * (1.0 / 16777216.0)
    return torch.where(u < frac, hi, lo)


def _store_checkpoint(state, slots, S_new, la_key):
    """Write folded states into the checkpoint: stochastic rounding for fp16, round-to-nearest otherwise."""
    if state.dtype == torch.float16:
        state[slots] = stochastic_round_fp16(S_new, la_key, slots, state.shape[1])
    else:
        state[slots] = S_new.to(state.dtype)


def _window_coefficients(la_win, dt_win, valid):
    """Suffix-sum decay coefficients of a window.

    Args:
        la_win, dt_win: [r, H, L] log-decays and step scales (garbage where not ``valid``).
        valid: [r, L] bool, a prefix of the window per row.
    Returns:
        total: [r, H] = Σ_valid la; coef: [r, H, L] = dt_j exp(Σ_{i>j, valid} la_i), 0 where not valid.
    """
    v = valid[:, None, :]
    la = torch.where(v, la_win, torch.zeros((), dtype=la_win.dtype))
    suffix = la.flip(-1).cumsum(-1).flip(-1)                     # Σ_{i>=j} la_i over the valid prefix
    after = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)   # Σ_{i>j}
    coef = torch.where(v, dt_win * torch.exp(after), torch.zeros((), dtype=la.dtype))
    return suffix[..., 0], coef


def _rows(slot_idx, batch, device):
    """(row indices, slot indices) of the non-padded rows."""
    if slot_idx is None:
        r = torch.arange(batch, device=device)
        return r, r
    keep = slot_idx >= 0
    rows = keep.nonzero().flatten()
    return rows, slot_idx[rows].long()


def _gather_window(rings, slots, cdt):
    x_ring, dt_ring, la_ring, B_ring = rings
    return (x_ring[slots].to(cdt), dt_ring[slots].to(cdt), la_ring[slots].to(cdt), B_ring[slots].to(cdt))


def replay_step_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, x, dt, la, B, C, slot_idx=None):
    """One ReplaySSM decode step, in place on the checkpoint, rings and cursor; returns ``y``.

    Args:
        state: [S, H, P, N] checkpoint (written only by flush rows, ``cursor == L-1``).
        x_ring: [S, H, L, P]; dt_ring, la_ring: [S, H, L]; B_ring: [S, G, L, N]; cursor: [S] int32.
        x: [b, H, P]; dt, la: [b, H] step scale and log-decay of this token; B: [b, G, N]; C: [b, Gc, N]
            (``H % G == 0``, ``H % Gc == 0``).
        slot_idx: [b] integer slot of each row, negative for padding; ``None`` means row i uses slot i.
    Returns:
        y: [b, H, P] = S_t C_t in the compute dtype; zero for padded rows.
    """
    cdt = _compute_dtype(state, x, dt, la)
    b, H, P = x.shape
    L = x_ring.shape[2]
    y = torch.zeros(b, H, P, dtype=cdt, device=x.device)
    rows, slots = _rows(slot_idx, b, x.device)
    if rows.numel() == 0:
        return y
    r = rows.numel()
    ar = torch.arange(r, device=x.device)
    w = cursor[slots].long()                                            # [r]
    X, DT, LA, BW = _gather_window((x_ring, dt_ring, la_ring, B_ring), slots, cdt)
    X[ar, :, w] = x[rows].to(cdt)                                       # current token at index w
    DT[ar, :, w] = dt[rows].to(cdt)
    LA[ar, :, w] = la[rows].to(cdt)
    BW[ar, :, w] = B[rows].to(cdt)
    valid = torch.arange(L, device=x.device)[None, :] <= w[:, None]     # [r, L]
    total, coef = _window_coefficients(LA, DT, valid)
    X = torch.where(valid[:, None, :, None], X, torch.zeros((), dtype=cdt))
    Bh = _per_head(torch.where(valid[:, None, :, None], BW, torch.zeros((), dtype=cdt)), H)   # [r, H, L, N]
    Ch = _per_head(C[rows].to(cdt), H)                                  # [r, H, N]
    S0 = state[slots].to(cdt)

    flush = w == L - 1
    out = torch.exp(total)[..., None] * torch.einsum("rhpn,rhn->rhp", S0, Ch) + \
        torch.einsum("rhl,rhlp->rhp", coef * torch.einsum("rhln,rhn->rhl", Bh, Ch), X)
    if bool(flush.any()):
        f = flush.nonzero().flatten()
        S_new = torch.exp(total[f])[..., None, None] * S0[f] + torch.einsum("rhl,rhlp,rhln->rhpn", coef[f], X[f], Bh[f])
        out[f] = torch.einsum("rhpn,rhn->rhp", S_new, Ch[f])            # read out the folded state itself
        _store_checkpoint(state, slots[f], S_new, la[rows[f]])
    nf = (~flush).nonzero().flatten()
    if nf.numel():
        s, wn, rn = slots[nf], w[nf], rows[nf]
        x_ring[s, :, wn] = x[rn].to(x_ring.dtype)
        dt_ring[s, :, wn] = dt[rn].to(dt_ring.dtype)
        la_ring[s, :, wn] = la[rn].to(la_ring.dtype)
        B_ring[s, :, wn] = B[rn].to(B_ring.dtype)
    cursor[slots] = torch.where(flush, torch.zeros_like(w), w + 1).to(cursor.dtype)
    y[rows] = out
    return y


def _fold_rows(state, cursor, count, slot_idx):
    """(rows, slots, n) for folding the first ``n = count`` (default: all held) records of each non-padded row;
    raises if a count lies outside ``[0, cursor]``. Shared by the families' fold/materialize references."""
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    rows, slots = _rows(slot_idx, b, state.device)
    w = cursor[slots].long()
    n = w if count is None else count[rows].long()
    if bool((n < 0).any() or (n > w).any()):
        raise ValueError(f"replay_compile: materialize count must lie in [0, cursor]; got count={n.tolist()}, "
                         f"cursor={w.tolist()}")
    return rows, slots, n


def fold_terms(x_rows, dt_rows, la_rows, B_rows, n, H: int):
    """``(dec, XC, Bh)`` of the fold of the first ``n`` [r] records of each row, so that the folded state is
    ``dec ⊙ S0 + XCᵀ Bh``: ``dec = exp(Σ_{j<n} la_j)`` [r, H, 1, 1], ``XC = dt_j exp(Σ_{j<i<n} la_i) x_j`` [r, H, L,
    P], ``Bh`` [r, H, L, N] (the group's B per head), zeros past ``n``. Rows of x [r, H, L, P], dt, la [r, H, L],
    B [r, G, L, N] in logical order and in the compute dtype."""
    valid = torch.arange(x_rows.shape[2], device=x_rows.device)[None, :] < n[:, None]
    total, coef = _window_coefficients(la_rows, dt_rows, valid)
    keep = valid[:, None, :, None]
    zero = torch.zeros((), dtype=x_rows.dtype)
    XC = coef[..., None] * torch.where(keep, x_rows, zero)
    Bh = _per_head(torch.where(keep, B_rows, zero), H)
    return torch.exp(total)[..., None, None], XC, Bh


def _fold(state, x_ring, dt_ring, la_ring, B_ring, cursor, count, slot_idx):
    """(rows, slots, S) with S [r, H, P, N] the state after ``count`` records of each non-padded row, in the
    compute dtype (the checkpoint itself, converted exactly, where ``count == 0``)."""
    H = state.shape[1]
    cdt = _compute_dtype(state, dt_ring)
    rows, slots, n = _fold_rows(state, cursor, count, slot_idx)
    if rows.numel() == 0:
        return rows, slots, state.new_zeros((0,) + tuple(state.shape[1:]), dtype=cdt)
    dec, XC, Bh = fold_terms(*_gather_window((x_ring, dt_ring, la_ring, B_ring), slots, cdt), n, H)
    S0 = state[slots].to(cdt)
    S = dec * S0 + torch.einsum("rhlp,rhln->rhpn", XC, Bh)
    return rows, slots, torch.where((n == 0)[:, None, None, None], S0, S)     # no records: bit-exact copy


def replay_materialize_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, count=None, slot_idx=None):
    """The true state after the first ``count`` records of each slot; reads only, returns a new tensor.

    Args:
        state, x_ring, dt_ring, la_ring, B_ring, cursor: as :func:`replay_step_reference`.
        count: [b] records to apply per row (``0 <= count <= cursor``); ``None`` applies all ``cursor``
            records. ``count == 0`` is an exact copy of the checkpoint.
        slot_idx: [b] slots to materialise (negative: padding, zero output); ``None`` means all slots in order.
    Returns:
        [b, H, P, N] in ``state.dtype`` (rounded to nearest: a read, not a flush).
    """
    b = state.shape[0] if slot_idx is None else slot_idx.shape[0]
    out = torch.zeros((b,) + tuple(state.shape[1:]), dtype=state.dtype, device=state.device)
    rows, _, S = _fold(state, x_ring, dt_ring, la_ring, B_ring, cursor, count, slot_idx)
    out[rows] = S.to(state.dtype)
    return out


def replay_flush_reference(state, x_ring, dt_ring, la_ring, B_ring, cursor, slot_idx=None):
    """Fold every held record into the checkpoint (in place) and set the cursor to 0.

    Afterwards ``state`` holds the true current state. Rows with no records are left bit-unchanged.
    ``slot_idx``: [b] slots to flush (negative ignored); ``None`` flushes every slot.
    """
    if slot_idx is None:
        slots = torch.arange(state.shape[0], device=state.device)
    else:
        slots = slot_idx[slot_idx >= 0].long()
    if slots.numel() == 0:
        return
    has = cursor[slots] > 0
    slots = slots[has]
    if slots.numel() == 0:
        return
    _, _, S = _fold(state, x_ring, dt_ring, la_ring, B_ring, cursor, None, slots)
    last = (cursor[slots].long() - 1)[:, None, None].expand(-1, state.shape[1], 1)
    _store_checkpoint(state, slots, S, la_ring[slots].gather(2, last)[..., 0])    # key: the last record's la
    cursor[slots] = 0
