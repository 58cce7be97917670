"""Mamba-1's decode step (mamba, falcon_mamba, jamba): a 3-D state ``[batch, D, N]`` with a decay per (channel,
state), found by dataflow and described for the ``mamba1_step`` op.

The form read (after :mod:`.canonical` and :func:`.state_writes.forward_clone_writebacks`), as transformers writes
``mamba_selective_state_update`` once ``dt`` is discretised::

    S.copy_(exp(dt[..., None] * A) * S + <channel factors [b, D, 1]> * <state factors [b, 1, N]>)
    y = matmul(new, C[..., None])          or   (new * C[:, None, :]).sum(-1)

The log-decay ``dt A`` must be a product of a per-(row, channel) factor ``dt`` (constant along N) and a per-(channel,
state) factor ``A`` (constant along the batch); the update's factors are each constant along N (their product is
the record ``u``, the model's ``dt x``) or along D (``B``). Each is proven by the broadcast analysis
(:mod:`.broadcast`) and the whole reading is checked numerically at compile time before the rewrite.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..kernels.mamba1_reference import mamba1_exact_step
from ..state import Mamba1RingSpec
from .broadcast import FULL, BroadcastAnalysis
from .graph_utils import CAST_LIKE, dtype, flatten, is_static_int, module_path, op_name, real_users, shape, strip
from .mamba2 import STATE_DTYPES, NoMatch, Recipe, SiteMatch

_B, _D, _N = 0, 1, 2
# The longest Mamba-1 ring: each held record costs every later step an exp per (channel, state) entry, so longer
# rings lose (H200, Falcon-Mamba-7B dims, fp32 checkpoint, bs 256, L-step average against mamba_ssm's exact step:
# 1.06x at L = 4, 0.81x at L = 8, 0.54x at L = 16; benchmarks/results/mamba1_kernel)
MAX_BUFFER_LEN = 4


@dataclasses.dataclass
class Mamba1Match(SiteMatch):
    D: int
    N: int
    u: Recipe
    dt: Recipe
    A: Recipe
    B: Recipe
    C: Recipe
    out_shape: tuple
    out_dtype: torch.dtype
    rec_dtype: torch.dtype
    # a state [b, heads, D, N] written head by head through ``state[:, head]`` (Zamba): this match is one head's step
    head: int | None = dataclasses.field(default=None, kw_only=True)
    heads: int = dataclasses.field(default=0, kw_only=True)

    family = property(lambda self: "mamba1")
    op = property(lambda self: torch.ops.replay_compile.mamba1_step.default)
    op_keys = ("u", "dt", "A", "B", "C")
    ring_names = ("u_ring", "dt_ring", "B_ring", "A_keep", "cursor")
    new_keys = ("u", "dt", "A", "B")

    @property
    def recipes(self) -> dict:
        return {"u": self.u, "dt": self.dt, "A": self.A, "B": self.B, "C": self.C}

    def ring_spec(self, L: int) -> Mamba1RingSpec:
        """Rings of ``min(L, MAX_BUFFER_LEN)`` records."""
        return Mamba1RingSpec(D=self.D, N=self.N, L=min(L, MAX_BUFFER_LEN), rec_dtype=self.rec_dtype,
                              heads=self.heads)

    def low_precision(self) -> bool:
        return self.out_dtype in (torch.bfloat16, torch.float16)

    def exact_new(self, S0: torch.Tensor, c: dict) -> torch.Tensor:
        s = S0.to(self.rec_dtype).reshape(-1, self.D, self.N).clone()      # (a launch's one-head view: 4-D)
        mamba1_exact_step(s, c["u"], c["dt"], c["A"], c["B"], c["B"])     # (its output is not needed here)
        return s

    def exact_readout(self, new: torch.Tensor, c: dict) -> torch.Tensor:
        return (new * c["C"].to(new.dtype)[:, None, :]).sum(-1)

    def describe(self, spec: Mamba1RingSpec) -> str:
        head = f" head {self.head} of {self.heads}" if self.head is not None else ""
        return f"D={self.D} N={self.N} L={spec.L}{head}"


def _old_chain(f, state: fx.Node):
    """The nodes from factor ``f`` down to ``state`` through casts (``state.float()``), or ``None``."""
    chain, n = [], f
    while isinstance(n, fx.Node) and n is not state and op_name(n) in CAST_LIKE and n.args:
        chain.append(n)
        n = n.args[0]
    return chain if n is state else None


def _exp_arg(f):
    """``x`` of a factor that is ``exp(x)`` under casts (``.to(device=...)``), else ``None``."""
    n = strip(f)
    return n.args[0] if op_name(n) == "exp" and n.args and isinstance(n.args[0], fx.Node) else None


def _cast_users(n: fx.Node) -> list[fx.Node]:
    """``n`` and the casts of it (``new.to(C.dtype)``)."""
    out, todo = [n], [n]
    while todo:
        x = todo.pop()
        for u in real_users(x):
            if op_name(u) in CAST_LIKE and u.args and u.args[0] is x:
                out.append(u)
                todo.append(u)
    return out


def match(state: fx.Node, write: fx.Node, old: fx.Node | None = None, value=None,
          slot: fx.Node | None = None) -> Mamba1Match:
    """Describe the step written by ``write = state.copy_(value)``, or raise :class:`NoMatch` with the reason. A slot
    pool's step (:mod:`.anchors`): ``state`` the pool, ``old`` its rows gathered at ``slot``, ``value`` the rows
    written back there."""
    pool, slot_form = state, slot is not None
    if slot_form:
        state = old
    st = shape(state)
    if st is None or len(st) != 3:
        raise NoMatch(f"state of shape {st}: expected [batch, channels, states]")
    b, D, N = st
    if dtype(state) not in STATE_DTYPES:
        raise NoMatch(f"state dtype {dtype(state)} is not supported")
    if not (is_static_int(D) and is_static_int(N)):
        raise NoMatch(f"state {tuple(st)}: channel and state dims must be static")
    if not slot_form and write.args[0] is not state:
        raise NoMatch("the state is written through a view (a slice per head)")
    new = strip(value if slot_form else write.args[1])
    terms = flatten(new, "add") if isinstance(new, fx.Node) else []
    if len(terms) != 2:
        raise NoMatch(f"new state is a sum of {len(terms)} terms, expected decay * state + update")
    bx = BroadcastAnalysis()
    decay_term = upd_term = None
    for t in terms:
        fs = flatten(t, "mul")
        olds = [f for f in fs if _old_chain(f, state) is not None]
        if olds and decay_term is None:
            decay_term, dfs = t, [f for f in fs if f is not olds[0]]
        else:
            upd_term, ufs = t, fs
    if decay_term is None or upd_term is None or len(dfs) != 1:
        raise NoMatch("new state is not exp(dt A) * state + update")
    la = _exp_arg(dfs[0])
    if la is None:
        raise NoMatch("the state's factor is not exp(·) of a log-decay")
    dt_side, A_side = [], []
    for f in flatten(la, "mul"):
        if not isinstance(f, fx.Node) or shape(f) is None or len(shape(f)) > 3:
            raise NoMatch("log-decay factor is not a tensor of at most 3 dims")
        rep = bx.aligned(f, 3)
        if rep[_N] == FULL and rep[_B] != FULL:
            dt_side.append(f)
        elif rep[_B] == FULL:
            A_side.append(f)
        else:
            raise NoMatch(f"log-decay factor `{f.name}` varies along both the batch and the states: not dt[b, d] "
                          "A[d, n]")
    if len(dt_side) != 1 or not A_side:
        raise NoMatch("log-decay is not a product of a time step dt[b, d] and a decay parameter A[d, n]")
    u_side, B_side = [], []
    for f in ufs:
        if not isinstance(f, fx.Node) or shape(f) is None or len(shape(f)) > 3:
            raise NoMatch("update factor is not a tensor of at most 3 dims")
        rep = bx.aligned(f, 3)
        if rep[_N] == FULL:
            u_side.append(f)
        elif rep[_D] == FULL:
            B_side.append(f)
        else:
            raise NoMatch(f"update factor `{f.name}` varies along both channels and states: not a rank-1 update")
    if not u_side or not B_side:
        raise NoMatch("update is not a product of channel factors and state factors (u[b, d] B[b, n])")
    for u in real_users(state):                 # read only by the decay term (through casts), written by `write`
        n = u
        while n is not decay_term and n is not write and op_name(n) in CAST_LIKE and len(real_users(n)) == 1:
            n = real_users(n)[0]
        if n is decay_term or n is write:
            continue
        raise NoMatch(f"the state is also read by `{u.name}` ({op_name(u)}); rewriting would expose the checkpoint")

    def lift(nodes):
        """fn(*values) -> each value as a float [*, *, *] tensor (leading dims of size 1 added; ranks known now, so
        the recipe traces without branching on a proxy)."""
        pads = [3 - len(shape(n)) for n in nodes]

        def fn(*vals):
            out = []
            for v, k in zip(vals, pads):
                v = v.float()
                for _ in range(k):
                    v = v.unsqueeze(0)
                out.append(v)
            return out
        return fn

    def product(vals):
        out = vals[0]
        for v in vals[1:]:
            out = out * v
        return out

    dt_node = dt_side[0]
    lu, ld, la_, lb = lift(u_side), lift([dt_node]), lift(A_side), lift(B_side)
    dt_rec = Recipe([dt_node], lambda v: ld(v)[0].select(-1, 0).contiguous())
    n_u = len(u_side)
    u_rec = Recipe(u_side + [dt_node], lambda *vs: (product([x.select(-1, 0) for x in lu(*vs[:n_u])])
                                                    * torch.ones_like(ld(vs[n_u])[0].select(-1, 0))).contiguous())
    A_rec = Recipe(A_side, lambda *vs: product([x.select(0, 0) for x in la_(*vs)]).expand(D, N).contiguous())
    B_rec = Recipe(B_side, lambda *vs: product([x.select(1, 0) for x in lb(*vs)]).contiguous())

    # the readout: one contraction of the new value (or a cast of it) with C over N
    outs = [(a, u) for a in _cast_users(new) for u in real_users(a)
            if u is not write and u not in _cast_users(new)]
    if len(outs) != 1:
        raise NoMatch(f"the new state has {len(outs)} readers; one readout (a contraction with C over N) expected")
    alias, r = outs[0]
    if op_name(r) in ("matmul", "bmm") and r.args[0] is alias and shape(r.args[1]) is not None \
            and tuple(shape(r.args[1])[-2:]) == (N, 1):
        c_node = r.args[1]
        c_rec = Recipe([c_node], lambda v: v.float().reshape(-1, N).contiguous())
        readout = r
    elif op_name(r) == "mul" and len(real_users(r)) == 1 and op_name(real_users(r)[0]) == "sum":
        other = r.args[1] if r.args[0] is alias else r.args[0]
        s = real_users(r)[0]
        dims = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
        if dims not in (-1, 2, [-1], [2], (-1,), (2,)) or not isinstance(other, fx.Node) \
                or bx.aligned(other, 3)[_D] != FULL:
            raise NoMatch(f"readout `{s.name}` is not a sum over the states of new * C")
        c_node = other
        lc = lift([c_node])
        c_rec = Recipe([c_node], lambda v: lc(v)[0].select(1, 0).contiguous())
        readout = s
    else:
        raise NoMatch(f"readout `{r.name}` ({op_name(r)}) of the new state is not a contraction with C over N")
    rec = torch.float64 if dtype(state) == torch.float64 else torch.float32
    return Mamba1Match(
        layer=module_path(write, default=f"state input `{pool.name}`"),
        form="mamba1/slot pool" if slot_form else "mamba1", copy_node=write,
        state=pool, new=new, readout=readout, old=state, slot=slot, D=D, N=N,
        u=u_rec, dt=dt_rec, A=A_rec, B=B_rec, C=c_rec,
        out_shape=tuple(shape(readout)), out_dtype=dtype(readout), rec_dtype=rec)


def _head_index(n: fx.Node, state: fx.Node) -> int | None:
    """``h`` where ``n`` is ``state[:, h]`` (a ``getitem`` or ``select``), else ``None``."""
    if op_name(n) == "getitem" and n.args[0] is state:
        idx = n.args[1]
        if isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and isinstance(idx[1], int):
            return idx[1]
    if op_name(n) == "select" and n.args[0] is state and n.args[1:3] and n.args[1] == 1 \
            and isinstance(n.args[2], int):
        return n.args[2]
    return None


def match_heads(state: fx.Node) -> list[Mamba1Match]:
    """A state ``[batch, heads, D, N]`` stepped head by head, each head through ``state[:, h]`` and written once by
    ``state[:, h].copy_(...)`` in Mamba-1's form (Zamba's mixer): one match per head, or :class:`NoMatch`."""
    st = shape(state)
    if st is None or len(st) != 4 or not all(is_static_int(s) for s in st[1:]):
        raise NoMatch(f"state of shape {st}: expected [batch, heads, channels, states] with static heads and sizes")
    if not state.meta["example_value"].is_contiguous():
        raise NoMatch("a head-by-head state that is not contiguous")
    H = st[1]
    views: dict[int, list] = {}
    for u in real_users(state):
        h = _head_index(u, state)
        if h is None:
            raise NoMatch(f"the state is also read by `{u.name}` ({op_name(u)}), not only head by head")
        views.setdefault(h % H, []).append(u)
    if sorted(views) != list(range(H)) or any(len(v) != 1 for v in views.values()):
        raise NoMatch(f"the state's {H} heads are not each taken once ({sorted(views)})")
    out = []
    for h in range(H):
        v = views[h][0]
        writes = [u for u in v.users if op_name(u) == "copy_" and u.args[0] is v]
        if len(writes) != 1:
            raise NoMatch(f"head {h} of the state is written {len(writes)} times, not once")
        m = match(v, writes[0])
        m.state, m.old, m.head, m.heads = state, v, h, H
        out.append(m)
    return out
