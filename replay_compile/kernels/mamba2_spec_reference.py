"""Reference math of speculative decoding with ReplaySSM for Mamba-2: output-only verify, commit by cursor moves.

This is the plain-PyTorch reference: the semantics the verify/commit ops and their kernels are tested against.
Notation as in :mod:`.mamba2_reference`; per slot:

* a checkpoint ``S_0`` and a *true ring* of ``buf = next_pow2(B + T)`` records ``(x, dt, la, B)``, read from
  ``origin``: committed history is at ring positions ``(origin + j) & (buf - 1)`` for ``j < w``;
* ``B``: the history budget (the non-speculative buffer length), ``T``: tokens per verify step (the last accepted
  token plus ``T - 1`` drafts);
* cursors ``w`` (committed records), ``origin`` and ``is_flush`` (decided at the previous commit).

A **verify** step takes ``T`` tokens per row and returns the output after each of them, as sequential decoding of
those tokens from the committed state would. It writes the ``T`` new records after the history
(``(origin + w + s) & mask``) and nothing else — except on flush rows, where it first folds the ``w`` history
records into the checkpoint (written once) and reads the window from there. It never needs a copy of the state.

**Commit** with ``n`` accepted tokens (``1 <= n <= T``; the first token is always accepted) only moves cursors::

    flush row:  origin <- (origin + w) & mask ;  w <- n      # folded history leaves; accepted records are history
    otherwise:  w <- w + n                                  # rejected drafts are simply not counted: rollback
    is_flush <- w + T > B                                   # next verify must fit: w + T <= B, or flush first

so every non-flush verify has ``w + T <= B <= buf`` and a flush verify ``w + T <= B + T <= buf``: the ring never
overwrites a record it still needs. Exponents are suffix sums of log-decays (<= 0), as everywhere.
"""

from __future__ import annotations

import torch

from .mamba2_reference import _compute_dtype, _per_head, _rows

__all__ = ["spec_buf_len", "spec_reset_reference", "spec_verify_reference", "spec_commit_reference",
           "spec_materialize_reference"]


def spec_buf_len(B: int, T: int) -> int:
    """Ring slots for history budget ``B`` and ``T`` tokens per verify: the next power of two >= B + T."""
    return 1 << (B + T - 1).bit_length()


def spec_reset_reference(w, origin, is_flush, B: int, T: int, slots=None):
    """Fresh cursors (a new sequence in these slots): w = origin = 0, flush at once only if T > B."""
    idx = slice(None) if slots is None else slots
    w[idx] = 0
    origin[idx] = 0
    is_flush[idx] = T > B


def spec_rows(slot_idx, b: int, w, origin, T: int | None = None, buf: int | None = None):
    """``(row, slot, w, origin)`` of each non-padded row, as Python ints (the references loop over rows). With
    ``T`` and ``buf``: raise if a row's history and a window of ``T`` tokens do not fit the ring."""
    rows, slots = _rows(slot_idx, b, w.device)
    for r, s in zip(rows.tolist(), slots.tolist()):
        ww, o = int(w[s]), int(origin[s])
        if T is not None and ww + T > buf:
            raise ValueError(f"replay_compile.spec: slot {s} holds {ww} records, {T} more do not fit a ring of {buf}")
        yield r, s, ww, o


def _window_outputs(base, LA, DT, X, BW, C, first: int):
    """Outputs after window positions ``first .. len-1`` from the state ``base`` before position 0.

    Args:
        base: [H, P, N]; LA, DT: [H, W]; X: [H, W, P]; BW: [H, W, N] (per head); C: [T, H, N] for the positions
            ``first + s``.
    Returns:
        [T, H, P].
    """
    T = C.shape[0]
    out = []
    for s in range(T):
        pos = first + s
        la = LA[:, :pos + 1]
        suffix = la.flip(-1).cumsum(-1).flip(-1)                                  # Σ_{i>=k}
        after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], -1)  # Σ_{k<i<=pos}: no differences
        coef = DT[:, :pos + 1] * torch.exp(after)                                # [H, pos+1]
        bc = torch.einsum("hkn,hn->hk", BW[:, :pos + 1], C[s])                   # B_k · C_s
        y = torch.exp(suffix[:, 0])[:, None] * torch.einsum("hpn,hn->hp", base, C[s]) + \
            torch.einsum("hk,hkp->hp", coef * bc, X[:, :pos + 1])
        out.append(y)
    return torch.stack(out)


def spec_materialize_reference(state, x_ring, dt_ring, la_ring, B_ring, w, origin, slot: int):
    """The true committed state of one slot (checkpoint + its ``w`` history records), compute dtype [H, P, N]."""
    cdt = _compute_dtype(state, dt_ring)
    buf = x_ring.shape[2]
    H = state.shape[1]
    pos = [(int(origin[slot]) + j) & (buf - 1) for j in range(int(w[slot]))]
    S = state[slot].to(cdt)
    for p in pos:                                         # sequential folding: the definition, not a fast path
        Bh = _per_head(B_ring[slot:slot + 1, :, p].to(cdt), H)[0]                  # [H, N]
        S = torch.exp(la_ring[slot, :, p].to(cdt))[:, None, None] * S + \
            (dt_ring[slot, :, p].to(cdt)[:, None] * x_ring[slot, :, p].to(cdt))[..., None] * Bh[:, None, :]
    return S


def spec_verify_reference(state, x_ring, dt_ring, la_ring, B_ring, w, origin, is_flush, x, dt, la, B, C,
                          slot_idx=None, read_state=None, read_format=None):
    """Verify ``T`` tokens per row from checkpoint + committed history; returns ``y`` [b, T, H, P].

    Args:
        state: [S, H, P, N] checkpoint (written only by rows whose ``is_flush`` is set and ``w > 0``).
        x_ring: [S, H, buf, P]; dt_ring, la_ring: [S, H, buf]; B_ring: [S, G, buf, N]; ``buf`` a power of two.
        w, origin: [S] int32; is_flush: [S] bool (cursors; not changed here: :func:`spec_commit_reference` does).
        x: [b, T, H, P]; dt, la: [b, T, H]; B: [b, T, G, N]; C: [b, T, Gc, N].
        slot_idx: [b] slot per row, negative for padding (zero output, nothing touched); ``None``: row i = slot i.
        read_state: optional [S, H, P, N] low-precision *read copy* of the checkpoint (held decoded here):
            ordinary rows take the checkpoint term of their outputs from it; flush rows fold the fp32 ``state``
            (the recurrence never sees the copy's rounding), read their outputs from the folded state and rewrite
            their copy as ``read_format(folded)`` (a quantize-dequantize function).
    """
    cdt = _compute_dtype(state, x, dt, la)
    b, T, H, P = x.shape
    buf = x_ring.shape[2]
    mask = buf - 1
    y = torch.zeros(b, T, H, P, dtype=cdt, device=x.device)
    for r, s, ww, o in spec_rows(slot_idx, b, w, origin, T, buf):
        fl = bool(is_flush[s])
        hist = [(o + j) & mask for j in range(ww)]
        new = [(o + ww + t) & mask for t in range(T)]
        Xd, DTd, LAd = x[r].transpose(0, 1).to(cdt), dt[r].T.to(cdt), la[r].T.to(cdt)      # [H, T, P], [H, T]
        Bd = _per_head(B[r].transpose(0, 1)[None].to(cdt), H)[0]                           # [H, T, N]
        Cd = _per_head(C[r][None].to(cdt).transpose(1, 2), H)[0].transpose(0, 1)          # [T, H, N]
        Xh, DTh, LAh = x_ring[s][:, hist].to(cdt), dt_ring[s][:, hist].to(cdt), la_ring[s][:, hist].to(cdt)
        Bhh = _per_head(B_ring[s:s + 1, :, hist].to(cdt), H)[0]                            # [H, ww, N]
        if fl:
            S1 = spec_materialize_reference(state, x_ring, dt_ring, la_ring, B_ring, w, origin, s)
            if ww > 0:
                state[s] = S1.to(state.dtype)
                if read_state is not None:
                    read_state[s] = read_format(S1).to(read_state.dtype)
            y[r] = _window_outputs(S1, LAd, DTd, Xd, Bd, Cd, 0)
        else:
            S0 = (state if read_state is None else read_state)[s].to(cdt)
            y[r] = _window_outputs(S0, torch.cat([LAh, LAd], 1), torch.cat([DTh, DTd], 1), torch.cat([Xh, Xd], 1),
                                   torch.cat([Bhh, Bd], 1), Cd, ww)
        G = B_ring.shape[1]
        x_ring[s][:, new] = x[r].transpose(0, 1).to(x_ring.dtype)
        dt_ring[s][:, new] = dt[r].T.to(dt_ring.dtype)
        la_ring[s][:, new] = la[r].T.to(la_ring.dtype)
        B_ring[s][:, new] = B[r].transpose(0, 1).reshape(G, T, -1).to(B_ring.dtype)
    return y


def spec_commit_reference(w, origin, is_flush, n_accepted, B: int, T: int, buf: int, slot_idx=None):
    """Accept ``n_accepted[r]`` (1..T) tokens of each row's last verify: cursor moves only (see module notes)."""
    for r, s, ww, o in spec_rows(slot_idx, n_accepted.shape[0], w, origin):
        n = int(n_accepted[r])
        if not 1 <= n <= T:
            raise ValueError(f"replay_compile.spec: row {r} accepted {n} tokens; must be in [1, T={T}]")
        if bool(is_flush[s]):
            origin[s] = (o + ww) & (buf - 1)
            w[s] = n
        else:
            w[s] = ww + n
        is_flush[s] = int(w[s]) + T > B
