"""Hypothesis strategies for ReplaySSM property tests (needs ``hypothesis``).

* :func:`mamba2_geometries` draws ``Mamba2Geometry(batch, H, P, N, G, Gc)`` with H % G == H % Gc == 0 and P, N
  not restricted to powers of two.
* :func:`buffer_lens` draws L.
* :func:`step_schedules` draws, per step, which slot each batch row uses (``-1``: padding) — rows skip steps, so
  cursors desynchronise, and rows can be permuted over slots.

:func:`mamba2_problem` turns a geometry into seeded random tensors and :class:`ExactMamba2Oracle` steps every slot
with the exact recurrence, for comparison with the op at every step. :func:`delta_geometries`,
:func:`delta_problem` and :class:`ExactDeltaOracle` do the same for Gated DeltaNet / KDA.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from ..kernels.delta_reference import delta_exact_step
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
        batch=draw(st.integers(1, max_batch)), H=H, P=draw(st.integers(min_p, max_p)),
        N=draw(st.integers(min_n, max_n)),
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


@dataclasses.dataclass(frozen=True)
class DeltaGeometry:
    """Delta-rule layer geometry: ``HV`` value heads over ``Hk`` key heads, key dim ``K``, value dim ``V``;
    ``kda``: per-key-channel gate (Kimi Delta Attention) instead of one per head (Gated DeltaNet)."""

    batch: int
    HV: int
    Hk: int
    K: int
    V: int
    kda: bool

    def __str__(self):
        return f"{'kda' if self.kda else 'gdn'}-b{self.batch}-HV{self.HV}-Hk{self.Hk}-K{self.K}-V{self.V}"


@st.composite
def delta_geometries(draw, max_batch: int = 4, max_heads: int = 6, max_k: int = 12, max_v: int = 12,
                     min_k: int = 1, min_v: int = 1, kda=None):
    HV = draw(st.integers(1, max_heads))
    return DeltaGeometry(
        batch=draw(st.integers(1, max_batch)), HV=HV,
        Hk=draw(st.sampled_from([d for d in range(1, HV + 1) if HV % d == 0])),
        K=draw(st.integers(min_k, max_k)), V=draw(st.integers(min_v, max_v)),
        kda=draw(st.booleans()) if kda is None else kda)


def delta_problem(geom: DeltaGeometry, steps: int, dtype=torch.float64, seed: int = 0, decay=(0.3, 1.0)):
    """Seeded per-step inputs as the models produce them: q, k [b, Hk, K] L2-normalised (q also scaled by
    K^-1/2), v [b, HV, V], g = log of a decay in ``decay`` ([b, HV], or [b, HV, K] for KDA), beta in (0, 1) [b, HV];
    and an initial state [b, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    b, HV, Hk, K, V = geom.batch, geom.HV, geom.Hk, geom.K, geom.V
    lo, hi = decay
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    gshape = (b, HV, K) if geom.kda else (b, HV)
    seq = [dict(q=(norm(r(b, Hk, K)) * K ** -0.5).to(dtype), k=norm(r(b, Hk, K)).to(dtype), v=r(b, HV, V).to(dtype),
                g=torch.log(lo + (hi - lo) * u(*gshape)).to(dtype), beta=u(b, HV).to(dtype))
           for _ in range(steps)]
    return r(b, HV, K, V).to(dtype), seq


class ExactDeltaOracle:
    """True per-slot delta-rule states, advanced with the exact recurrence in fp64."""

    def __init__(self, state0: torch.Tensor):
        self.state = state0.detach().to(torch.float64).clone()

    def step(self, inp: dict, slots) -> torch.Tensor:
        """Advance the slots used by non-padded rows; return o [b, HV, V] (zeros for padded rows)."""
        b, HV, V = inp["v"].shape
        o = torch.zeros(b, HV, V, dtype=torch.float64)
        for row, s in enumerate(slots):
            if s < 0:
                continue
            pick = lambda t: t[row:row + 1].to(torch.float64)  # noqa: E731
            o[row] = delta_exact_step(self.state[s:s + 1], *(pick(inp[k]) for k in ("q", "k", "v", "g", "beta")))[0]
        return o
