"""Recognise the Mamba-2 decode-step state update in a Dynamo FX graph, by dataflow.

What is matched (names never matter; casts, device moves and view spellings are seen through)::

    new = S * exp(a) + f_1 * f_2 * ... * f_k        S: a 4-D graph input [b, H, P, N] (the cache state)
    S.copy_(new)                                    the anchor: an in-place write of that input
    y = readout(new, C)                             bmm / matmul / einsum / (new * C).sum(-1), contracting N

with ``a`` provably constant along P and N (a log-decay per row and head), and the update factors ``f_i`` each
provably constant along P (the n-side, ``B``), along N (the p-side, ``x``) or both (scalars, ``dt``). "Provably"
is the broadcast-provenance analysis of :mod:`.broadcast`; it also finds B/C groups (heads sharing a group show
as a block-repeat along H). The result is a :class:`Mamba2Match` with *recipes*: small functions that cut the
compact per-token tensors ``la [b,H]``, ``dt [b,H]``, ``x [b,H,P]``, ``B [b,G,N]``, ``C [b,Gc,N]`` out of
graph values. Recipes run on real tensors (validation) and on FX proxies (rewrite) alike.

Anything else raises :class:`NoMatch` with the reason, which the pass logs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch
import torch.fx as fx

from ..state import Mamba2RingSpec
from .anchors import Anchor
from .broadcast import FULL, BroadcastAnalysis, same_size
from .graph_utils import (CAST_LIKE, depends_elementwise, depends_on, dtype, flatten, is_static_int,
                          is_value_cast, module_path, op_name, real_users, shape, strip, writers)

FAMILY = "mamba2"
B_, H_, P_, N_ = 0, 1, 2, 3          # dims of the state frame [b, H, P, N]
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class NoMatch(Exception):
    """The anchor is a recurrent-state write, but not one we can rewrite; the message says why."""


@dataclasses.dataclass
class Recipe:
    """``fn(*values_of(sources)) -> compact tensor``; works on tensors and on ``fx.Proxy`` objects."""

    sources: list
    fn: Callable

    def __call__(self, values: list):
        return self.fn(*values)


@dataclasses.dataclass
class SiteMatch:
    """What every family's match records about its site: the layer, the spelling (``form``), the in-place write
    of the new state into the cache (``copy_node``), the state input, the new-state value and the readout. Each
    family adds its sizes and recipes and the interface the rewrite and the validation use: ``op``, ``op_keys``,
    ``ring_names``, ``new_keys``, ``recipes``, ``ring_spec``, ``low_precision``, ``exact_new``, ``exact_readout``,
    ``describe``, ``family``."""

    layer: str
    form: str
    copy_node: fx.Node
    state: fx.Node
    new: fx.Node
    readout: fx.Node
    # the old rows (``state`` itself, or a pool's gather) and a pool's slots (:mod:`.anchors`)
    old: fx.Node | None = dataclasses.field(default=None, kw_only=True)
    slot: fx.Node | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass
class Mamba2Match(SiteMatch):
    H: int
    P: int
    N: int
    G: int
    Gc: int
    la: Recipe
    dt: Recipe
    x: Recipe
    B: Recipe
    C: Recipe
    out_shape: tuple
    out_dtype: torch.dtype
    x_dtype: torch.dtype
    B_dtype: torch.dtype
    rec_dtype: torch.dtype          # dt / log-decay records and the ops' compute dtype (fp64 only for fp64 states)
    family: str = FAMILY

    @property
    def recipes(self) -> dict:
        return {"la": self.la, "dt": self.dt, "x": self.x, "B": self.B, "C": self.C}

    # -- what the rewrite and the validation need (DeltaMatch has the same interface) --------------------------
    op = property(lambda self: torch.ops.replay_compile.mamba2_step.default)
    op_keys = ("x", "dt", "la", "B", "C")
    ring_names = ("x_ring", "dt_ring", "la_ring", "B_ring", "cursor")
    new_keys = ("la", "dt", "x", "B")

    def ring_spec(self, L: int) -> Mamba2RingSpec:
        return Mamba2RingSpec(H=self.H, P=self.P, N=self.N, G=self.G, L=L, x_dtype=self.x_dtype,
                              B_dtype=self.B_dtype, rec_dtype=self.rec_dtype)

    def low_precision(self) -> bool:
        return any(d in (torch.bfloat16, torch.float16) for d in (self.x_dtype, self.B_dtype, self.out_dtype))

    def exact_new(self, S0: torch.Tensor, c: dict) -> torch.Tensor:
        cdt = self.rec_dtype
        Bh = c["B"].to(cdt).repeat_interleave(self.H // self.G, dim=1)
        return torch.exp(c["la"].to(cdt))[..., None, None] * S0.to(cdt) + \
            (c["dt"].to(cdt)[..., None] * c["x"].to(cdt))[..., None] * Bh[:, :, None, :]

    def exact_readout(self, new: torch.Tensor, c: dict) -> torch.Tensor:
        Ch = c["C"].to(new.dtype).repeat_interleave(self.H // c["C"].shape[1], dim=1)
        return torch.einsum("bhpn,bhn->bhp", new, Ch)

    def describe(self, spec) -> str:
        rc = f" read copy {spec.read_copy}" if getattr(spec, "read_copy", None) else ""
        return f"H={self.H} P={self.P} N={self.N} G={self.G} L={spec.L} x:{str(self.x_dtype).replace('torch.', '')}{rc}"


def _apply(node: fx.Node, value):
    """Re-apply the single-input op ``node`` (a view or cast) to ``value``."""
    if node.op == "call_method":
        return getattr(value, node.target)(*node.args[1:], **node.kwargs)
    return node.target(value, *node.args[1:], **node.kwargs)


def _extractor(src_shape: tuple, src_dims: list, keep: dict, sizes: dict) -> Callable:
    """Build ``fn(value)`` cutting a compact tensor out of a broadcast value.

    Args:
        src_shape: shape of the value; ``src_dims[k]`` is the frame dim of its k-th dim.
        keep: frame dim -> slice step, for the dims kept (in frame order in the result); every other dim has been
            proven constant (or has size 1) and is indexed at 0.
        sizes: frame dim -> target size of a kept dim (``-1``: leave as is), to expand size-1 dims.
    """
    idx, present = [], []
    for k, fd in enumerate(src_dims):
        if fd in keep:
            step = 1 if same_size(src_shape[k], 1) else keep[fd]
            idx.append(slice(None, None, step) if step != 1 else slice(None))
            present.append(fd)
        else:
            idx.append(0)
    kept = sorted(keep)
    unsq = [i for i, fd in enumerate(kept) if fd not in present]
    expand = [sizes[fd] for fd in kept]
    needs_expand = any(
        s != -1 and (fd not in present or same_size(src_shape[src_dims.index(fd)], 1)) for fd, s in zip(kept, expand))
    idx = tuple(idx)
    trivial = all(i == slice(None) for i in idx)

    def fn(v):
        out = v if trivial else v[idx]
        for i in unsq:
            out = out.unsqueeze(i)
        if needs_expand:
            out = out.expand(*expand)
        return out

    return fn


def _frame_dims(rank: int, frame_rank: int = 4) -> list:
    return list(range(frame_rank - rank, frame_rank))


class Mamba2Matcher:
    """Find and describe Mamba-2 state updates. One instance per graph (it memoises the broadcast analysis)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.bx = BroadcastAnalysis()

    # -- the match -------------------------------------------------------------------------------------------
    def match(self, a: Anchor) -> Mamba2Match:
        """The Mamba-2 step written at anchor ``a`` (a whole state or a slot pool's rows, :mod:`.anchors`)."""
        cp, state, store = a.write, a.old, a.state
        layer = module_path(cp, default=f"state input `{store.name}`")
        if a.why:
            raise NoMatch(a.why)
        b, H, P, N = shape(state)
        if dtype(state) not in STATE_DTYPES:
            raise NoMatch(f"state dtype {dtype(state)} is not supported (use one of "
                          f"{', '.join(str(d).replace('torch.', '') for d in STATE_DTYPES)})")
        if not all(is_static_int(s) for s in (H, P, N)):
            raise NoMatch(f"state {tuple(shape(state))}: head and state dims must be static")
        new = strip(a.value)
        if not isinstance(new, fx.Node):
            raise NoMatch("the value written is not computed in this graph")
        ns = shape(new) or ()
        if len(ns) != 4 or not all(same_size(x, y) for x, y in zip(ns, shape(state))):
            raise NoMatch(f"the value written has shape {shape(new)}, not the state's {shape(state)}")

        terms = flatten(new, "add")
        if len(terms) != 2:
            raise NoMatch(f"new state is a sum of {len(terms)} terms, expected decay*state + update "
                          f"(a chunked-scan or prefill write looks like this)")
        decay, upd, state_term = self._split_terms(terms, state)
        self._check_reads_no_other_state(store, decay, upd)
        la_src, la_fn, la_frame_rep = self._decay(decay)

        # update = product of factors, each constant along P or N (or both)
        factors = flatten(upd, "mul")
        p_side, n_side, scal, consts = [], [], [], 1.0
        for f in factors:
            if not isinstance(f, fx.Node):
                if isinstance(f, (int, float)):
                    consts *= f
                    continue
                raise NoMatch(f"update factor {f!r} is not a tensor or number")
            fs = shape(f)
            if fs is None or len(fs) > 4:
                raise NoMatch(f"update factor {f.name} has shape {fs}")
            r = self.bx.aligned(f, 4)
            if len(fs) == 4 and not same_size(fs[B_], b):
                raise NoMatch(f"update factor {f.name} {fs} is broadcast over the batch")
            if r[P_] == FULL and r[N_] == FULL:
                scal.append(f)
            elif r[N_] == FULL:
                p_side.append(f)
            elif r[P_] == FULL:
                n_side.append(f)
            else:
                raise NoMatch(f"update factor {f.name} {fs} varies along both P and N: not a rank-1 update")
        if not p_side or not n_side:
            raise NoMatch("update term is not an outer product of a P-side and an N-side factor")
        for f in p_side + n_side + scal:
            if depends_on(f, store):
                # e.g. a delta rule (Gated DeltaNet's S·k): the replay op would read it from the checkpoint
                raise NoMatch(f"update factor {f.name} is computed from the state itself (a delta rule?), not "
                              f"from this token's inputs alone")

        # groups of B: block-repeat along H
        G = self._groups(n_side, H)
        keep_hp = {B_: 1, H_: 1, P_: 1}
        sizes = {B_: -1, H_: H, P_: P, N_: N}
        x_fn = self._product(p_side, keep_hp, sizes)
        B_fn = self._product(n_side, {B_: 1, H_: H // G, N_: 1}, {B_: -1, H_: G, N_: N})
        dt_fn = self._product(scal, {B_: 1, H_: 1}, sizes) if scal else None
        if la_frame_rep[P_] != FULL or la_frame_rep[N_] != FULL:
            raise NoMatch("decay is not provably constant along P and N (not a scalar decay per head)")
        la_cut = _extractor(shape(decay), _frame_dims(len(shape(decay))), {B_: 1, H_: 1}, sizes)

        self._check_state_uses(state, cp, state_term)
        readout, C_src, C_fn, Gc, form = self._readout(new, cp, H, N)

        rec = torch.float64 if dtype(state) == torch.float64 else torch.float32
        la = Recipe([la_src], lambda a, _f=la_fn, _c=la_cut: _c(_f(a)).to(rec))
        if dt_fn is None:
            dt = Recipe([la_src], lambda a, _f=la_fn, _c=la_cut: torch.ones_like(_c(_f(a)), dtype=rec) * consts)
        else:
            dt = Recipe(list(scal), lambda *v, _f=dt_fn: (_f(*v).to(rec) * consts) if consts != 1.0
                        else _f(*v).to(rec))
        x_dtype = _promote(p_side)
        B_dtype = _promote(n_side)
        out_shape = _static_or_minus_one(shape(readout))
        return Mamba2Match(
            layer=layer, form=f"{form}{'/grouped' if G < H else ''}{'/slot pool' if a.slot is not None else ''}",
            copy_node=cp, state=store, new=new, readout=readout, old=state, slot=a.slot, H=H, P=P, N=N, G=G, Gc=Gc,
            la=la, dt=dt,
            x=Recipe(list(p_side), lambda *v, _f=x_fn: _f(*v).to(x_dtype)),
            B=Recipe(list(n_side), lambda *v, _f=B_fn: _f(*v).to(B_dtype)),
            C=Recipe([C_src], C_fn),
            out_shape=out_shape, out_dtype=dtype(readout), x_dtype=x_dtype, B_dtype=B_dtype, rec_dtype=rec)

    # -- pieces ----------------------------------------------------------------------------------------------
    def _check_reads_no_other_state(self, state: fx.Node, decay: fx.Node, upd) -> None:
        """The decay and the update may not be computed, elementwise, from another graph input this graph writes
        (another recurrent state of the same step: the running max stabiliser of xLSTM's mLSTM). Their values at a
        later step depend on that state's history, which the replay records do not hold. (An earlier layer's state
        reaches a later layer's inputs only through projections and readouts: not counted.)"""
        for name, term in (("decay", decay), ("update", upd)):
            for ph in self.gm.graph.nodes:
                if ph.op != "placeholder":
                    break
                if ph is not state and writers(ph) and depends_elementwise(term, ph):
                    raise NoMatch(f"the {name} reads `{ph.name}`, another recurrent state this step writes (a "
                                  f"running stabiliser or normaliser, as in xLSTM's mLSTM): a replay window's "
                                  f"{name}s would depend on that state's history, which the records do not hold")

    def _split_terms(self, terms, state):
        """(decay, update, the state*decay node) of ``new = state * decay + update``."""
        for i, t in enumerate(terms):
            fs = flatten(t, "mul")
            hits = [k for k, f in enumerate(fs) if strip(f) is state]
            if len(hits) == 1 and len(fs) == 2:
                return fs[1 - hits[0]], terms[1 - i], strip(t)
        raise NoMatch("no term of the form state * decay in the new state")

    def _decay(self, decay):
        """Find ``exp(arg)`` under views/casts; return (arg node, fn re-applying the views, rep of decay)."""
        chain, d = [], decay
        while isinstance(d, fx.Node) and op_name(d) in (CAST_LIKE | {"view", "reshape", "unsqueeze", "expand",
                                                                    "getitem", "squeeze"}) and not writers(d):
            chain.append(d)
            d = d.args[0]
        if not (isinstance(d, fx.Node) and op_name(d) == "exp"):
            raise NoMatch("decay factor is not exp(·) of a log-decay")
        arg = d.args[0]
        views = [c for c in reversed(chain) if op_name(c) not in CAST_LIKE]

        def fn(a):
            for c in views:
                a = _apply(c, a)
            return a

        if not isinstance(arg, fx.Node):
            raise NoMatch("log-decay is a constant")
        return arg, fn, self.bx.aligned(decay, 4)

    def _groups(self, n_side, H) -> int:
        r = FULL
        for f in n_side:
            rf = self.bx.aligned(f, 4)[H_]
            r = rf if r == FULL else (r if rf == FULL else math.gcd(r, rf))
        r = H if r == FULL else r
        return H // r if H % r == 0 else H

    def _product(self, nodes, keep, sizes):
        cuts = [_extractor(shape(f), _frame_dims(len(shape(f))), keep, sizes) for f in nodes]

        def fn(*vals):
            out = cuts[0](vals[0])
            for c, v in zip(cuts[1:], vals[1:]):
                out = out * c(v)
            return out

        return fn

    def _check_state_uses(self, state, cp, state_term):
        """The state may be read only by the decay product (through casts) and written only by the anchor."""
        for u in real_users(state):
            if u is cp:
                continue
            n = u
            while n is not state_term and is_value_cast(n) and len(real_users(n)) == 1:
                n = real_users(n)[0]
            if n is state_term:
                continue
            raise NoMatch(f"the state is also read by `{u.name}` ({op_name(u)}); rewriting would expose the "
                          f"checkpoint instead of the current state")

    def _aliases(self, new):
        """``new`` and everything that is only a cast or view of it."""
        out, todo = [new], [new]
        while todo:
            n = todo.pop()
            for u in real_users(n):
                if op_name(u) in CAST_LIKE | {"view", "reshape"} and u.args[0] is n and not writers(u):
                    out.append(u)
                    todo.append(u)
        return out

    def _readout(self, new, cp, H, N):
        aliases = self._aliases(new)
        uses = [(a, u) for a in aliases for u in real_users(a) if u not in aliases and u is not cp]
        if not uses:
            raise NoMatch("the new state is written but never read out")
        if len(uses) != 1:
            names = ", ".join(f"`{u.name}` ({op_name(u)})" for _, u in uses)
            raise NoMatch(f"the new state has {len(uses)} readers ({names}); only one readout is supported")
        alias, u = uses[0]
        name = op_name(u)
        if name in ("bmm", "matmul") and u.args[0] is alias:
            return self._readout_matmul(alias, u, H, N)
        if name == "einsum":
            return self._readout_einsum(alias, u, H, N)
        if name == "mul" and shape(alias) is not None and len(shape(alias)) == 4:
            return self._readout_mul_sum(alias, u, H, N)
        raise NoMatch(f"readout `{u.name}` ({name}) of the new state is not a contraction with C over N")

    def _C_from_frame(self, c, c_dims, H, N, frame_rank):
        """Recipe for C [b, Gc, N] from a value whose dims map to ``c_dims`` of a frame; returns (fn, Gc)."""
        rep = self.bx.rep(c)
        for d, fd in enumerate(c_dims):
            if fd not in (B_, H_, N_) and rep[d] != FULL:
                raise NoMatch(f"C operand `{c.name}` {shape(c)} is not constant along P")
        rh = rep[c_dims.index(H_)] if H_ in c_dims else FULL
        rh = H if rh == FULL else rh
        Gc = H // rh if H % rh == 0 else H
        fn = _extractor(shape(c), c_dims, {B_: 1, H_: H // Gc, N_: 1}, {B_: -1, H_: Gc, N_: N})
        return fn, Gc

    def _readout_matmul(self, alias, u, H, N):
        a_shape, c = shape(alias), u.args[1]
        c_shape = shape(c)
        if a_shape is None or c_shape is None or len(c_shape) != len(a_shape) or c_shape[-1] != 1 \
                or c_shape[-2] != N:
            raise NoMatch(f"readout `{u.name}`: C operand {c_shape} is not [..., N, 1]")
        if len(a_shape) == 3:
            # [b*H, P, N] @ [b*H, N, 1]: look through the view of C back to [b, H, N] when possible
            src = c.args[0] if op_name(c) in ("view", "reshape") else None
            src_shape = shape(src) if src is not None else None
            if src_shape is not None and len(src_shape) == 3 and src_shape[1:] == (H, N):
                fn, Gc = self._C_from_frame(src, [B_, H_, N_], H, N, 3)
                return u, src, fn, Gc, "bmm"
            fn0 = (lambda v: v.reshape(-1, H, N))
            return u, c, fn0, H, "bmm"
        if len(a_shape) == 4:
            fn, Gc = self._C_from_frame(c, [B_, H_, N_, P_], H, N, 4)
            return u, c, fn, Gc, "matmul"
        raise NoMatch(f"readout `{u.name}`: unsupported operand rank {len(a_shape)}")

    def _readout_einsum(self, alias, u, H, N):
        eq, ops = u.args[0], list(u.args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        if not isinstance(eq, str) or len(ops) != 2 or alias not in ops or len(shape(alias) or ()) != 4:
            raise NoMatch(f"einsum readout `{u.name}` is not (new, C)")
        m = re.fullmatch(r"\s*(\w+)\s*,\s*(\w+)\s*->\s*(\w*)\s*", eq.replace("...", ""))
        if not m:
            raise NoMatch(f"einsum equation {eq!r} not understood")
        i_new = ops.index(alias)
        s_new, s_c, s_out = m.group(1 + i_new), m.group(2 - i_new), m.group(3)
        c = ops[1 - i_new]
        if len(s_new) != 4 or s_out != s_new[:3] or sorted(s_c) != sorted(s_new[0] + s_new[1] + s_new[3]):
            raise NoMatch(f"einsum {eq!r} does not contract the state's last dim with C")
        frame = {s_new[0]: B_, s_new[1]: H_, s_new[3]: N_}
        if [frame[ch] for ch in s_c] != sorted(frame[ch] for ch in s_c):
            raise NoMatch(f"einsum {eq!r}: C dims are permuted")
        fn, Gc = self._C_from_frame(c, [frame[ch] for ch in s_c], H, N, 3)
        return u, c, fn, Gc, "einsum"

    def _readout_mul_sum(self, alias, u, H, N):
        others = [a for a in u.args if a is not alias]
        if len(u.args) != 2 or len(others) != 1 or not isinstance(others[0], fx.Node):
            raise NoMatch(f"readout `{u.name}`: expected new * C")
        c = others[0]
        sums = real_users(u)
        if len(sums) != 1 or op_name(sums[0]) != "sum":
            raise NoMatch(f"readout `{u.name}`: new * C is not summed")
        s = sums[0]
        dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
        keep = s.kwargs.get("keepdim", s.args[2] if len(s.args) > 2 else False)
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if dim not in (-1, 3) or keep:
            raise NoMatch(f"readout `{s.name}` sums dim {dim} (keepdim={keep}), expected the last dim")
        cs = shape(c)
        fn, Gc = self._C_from_frame(c, _frame_dims(len(cs)), H, N, 4)
        return s, c, fn, Gc, "mul-sum"


def _promote(nodes) -> torch.dtype:
    out = None
    for n in nodes:
        d = dtype(n) or torch.float32
        out = d if out is None else torch.promote_types(out, d)
    return out


def _static_or_minus_one(shp) -> tuple:
    dyn = [i for i, s in enumerate(shp) if not is_static_int(s)]
    if len(dyn) > 1:
        raise NoMatch(f"readout shape {shp} has more than one dynamic dim")
    return tuple(-1 if i in dyn else s for i, s in enumerate(shp))
