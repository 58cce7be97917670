"""Hypothesis strategies for ReplaySSM property tests (needs ``hypothesis``).

* :func:`mamba2_geometries` draws ``Mamba2Geometry(batch, H, P, N, G, Gc)`` with H % G == H % Gc == 0 and P, N
  not restricted to powers of two.
* :func:`buffer_lens` draws L.
* :func:`step_schedules` draws, per step, which slot each batch row uses (``-1``: padding) — rows skip steps, so
  cursors desynchronise, and rows can be permuted over slots.

:func:`mamba2_problem` turns a geometry into seeded random tensors and :class:`ExactMamba2Oracle` steps every slot
with the exact recurrence, for comparison with the op at every step.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from ..kernels.mamba2_reference import mamba2_plain_step


@dataclasses.dataclass(frozen=True)
class Mamba2Geometry:
    batch: int
    H: int
    P: int
    N: int
    G: int
    Gc: int

    def __str__(self):
        return f"b{self.batch}-H{self.H}-P{self.P}-N{self.N}-G{self.G}-Gc{self.Gc}"


@st.composite
def mamba2_geometries(draw, max_batch: int = 4, max_heads: int = 6, max_p: int = 12, max_n: int = 12,
                      min_p: int = 1, min_n: int = 1):
    H = draw(st.integers(1, max_heads))
    divisors = [d for d in range(1, H + 1) if H % d == 0]
    return Mamba2Geometry(
        batch=draw(st.integers(1, max_batch)), H=H, P=draw(st.integers(min_p, max_p)), N=draw(st.integers(min_n, max_n)),
        G=draw(st.sampled_from(divisors)), Gc=draw(st.sampled_from(divisors)))


def buffer_lens(max_len: int = 32):
    return st.integers(1, max_len)


@st.composite
def step_schedules(draw, batch: int, steps: int, padding: bool = True, permute: bool = True):
    """A list of ``steps`` slot-index lists (length ``batch``; slot ``i`` used by at most one row, -1 = pad)."""
    sched = []
    for _ in range(steps):
        slots = list(range(batch))
        if permute:
            slots = draw(st.permutations(slots))
        if padding:
            active = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
            slots = [s if a else -1 for s, a in zip(slots, active)]
        sched.append(slots)
    return sched


def mamba2_problem(geom: Mamba2Geometry, steps: int, dtype=torch.float64, seed: int = 0, decay=(0.3, 1.0)):
    """Seeded per-step inputs: list of dicts with x [b,H,P], dt [b,H], la [b,H] (log of a decay in ``decay``),
    B [b,G,N], C [b,Gc,N]; and an initial state [b,H,P,N]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    b, H, P, N, G, Gc = geom.batch, geom.H, geom.P, geom.N, geom.G, geom.Gc
    lo, hi = decay
    seq = [dict(x=r(b, H, P).to(dtype), dt=(0.05 + u(b, H)).to(dtype),
                la=torch.log(lo + (hi - lo) * u(b, H)).to(dtype), B=r(b, G, N).to(dtype), C=r(b, Gc, N).to(dtype))
           for _ in range(steps)]
    return r(b, H, P, N).to(dtype), seq


class ExactMamba2Oracle:
    """True per-slot states, advanced with the exact recurrence in fp64."""

    def __init__(self, state0: torch.Tensor):
        self.state = state0.detach().to(torch.float64).clone()

    def step(self, inp: dict, slots) -> torch.Tensor:
        """Advance the slots used by non-padded rows; return y [b, H, P] (zeros for padded rows)."""
        b, H, P = inp["x"].shape
        y = torch.zeros(b, H, P, dtype=torch.float64)
        for row, s in enumerate(slots):
            if s < 0:
                continue
            st_ = self.state[s:s + 1]
            pick = lambda t: t[row:row + 1].to(torch.float64)  # noqa: E731
            y[row] = mamba2_plain_step(st_, pick(inp["x"]), pick(inp["dt"]), pick(inp["la"]), pick(inp["B"]),
                                       pick(inp["C"]))[0]
        return y
