"""Recognise the Mamba-2 decode-step state update in a Dynamo FX graph, by dataflow.

What is matched (names never matter; casts, device moves and view spellings are seen through)::

    new = S * exp(a) + f_1 * f_2 * ... * f_k        S: a 4-D graph input [b, H, P, N] (the cache state)
    S.copy_(new)                                    the anchor: an in-place write of that input
    y = readout(new, C)                             bmm / matmul / einsum / (new * C).sum(-1), contracting N

or the same with the state laid out ``[b, H, N, P]`` and read out by contracting dim -2 (``y = C @ new``,
``(new * C[..., None]).sum(-2)``): MiniMax's lightning attention keeps ``K^T V`` so, with a constant decay per head.

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
from .graph_utils import (
    CAST_LIKE,
    depends_elementwise,
    depends_on,
    dtype,
    flatten,
    is_static_int,
    is_value_cast,
    module_path,
    op_name,
    real_users,
    shape,
    strip,
    writers,
)

FAMILY = "mamba2"
B_, H_, P_, N_ = 0, 1, 2, 3          # dims of the state frame [b, H, P, N]
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class NoMatch(Exception):
    """The anchor is a recurrent-state write, but not one we can rewrite; the message says why.

    ``code`` names the reason for code that decides by it (the pass prefers another matcher's reason over
    ``STATE_DEPENDENT`` and ``OTHER_READOUT_DIM``, the signs of a delta rule or of a transposed state); ``level``
    is the log level of the skip it becomes (``"warning"``: a recurrence left unchanged; ``"info"``: plainly not a
    recurrent step)."""

    STATE_DEPENDENT = "state_dependent_update"
    OTHER_READOUT_DIM = "readout_over_another_dim"

    def __init__(self, reason: str, *, code: str = "no_match", level: str = "warning"):
        super().__init__(reason)
        self.code = code
        self.level = level


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
    transposed: bool = False        # the state is [b, H, N, P]; the op steps its view ``S.mT``
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
                              B_dtype=self.B_dtype, rec_dtype=self.rec_dtype, transposed=self.transposed)

    def low_precision(self) -> bool:
        return any(d in (torch.bfloat16, torch.float16) for d in (self.x_dtype, self.B_dtype, self.out_dtype))

    def exact_new(self, S0: torch.Tensor, c: dict) -> torch.Tensor:
        """The new state in the cache tensor's own layout."""
        cdt = self.rec_dtype
        Bh = c["B"].to(cdt).repeat_interleave(self.H // self.G, dim=1)
        S0 = S0.mT if self.transposed else S0
        new = torch.exp(c["la"].to(cdt))[..., None, None] * S0.to(cdt) + \
            (c["dt"].to(cdt)[..., None] * c["x"].to(cdt))[..., None] * Bh[:, :, None, :]
        return new.mT if self.transposed else new

    def exact_readout(self, new: torch.Tensor, c: dict) -> torch.Tensor:
        Ch = c["C"].to(new.dtype).repeat_interleave(self.H // c["C"].shape[1], dim=1)
        return torch.einsum("bhnp,bhn->bhp" if self.transposed else "bhpn,bhn->bhp", new, Ch)

    def describe(self, spec) -> str:
        rc = f" read copy {spec.read_copy}" if getattr(spec, "read_copy", None) else ""
        layout = " state [N, P]" if self.transposed else ""
        return (f"H={self.H} P={self.P} N={self.N} G={self.G} L={spec.L} "
                f"x:{str(self.x_dtype).replace('torch.', '')}{layout}{rc}")


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


def _frame_dims(rank: int, frame_rank: int = 4, transposed: bool = False) -> list:
    """Frame dims of a value of ``rank`` dims right-aligned to the state's frame (``[b, H, N, P]`` when
    ``transposed``)."""
    frame = [B_, H_, N_, P_] if transposed and frame_rank == 4 else list(range(frame_rank))
    return frame[frame_rank - rank:]


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
        new = strip(a.value)
        if not isinstance(new, fx.Node):
            raise NoMatch("the value written is not computed in this graph")
        t = self._transposed_readout(new, cp)
        PD, ND = (N_, P_) if t else (P_, N_)         # positions of P and N in the state
        b, H, P, N = (shape(state)[i] for i in (B_, H_, PD, ND))
        if dtype(state) not in STATE_DTYPES:
            raise NoMatch(f"state dtype {dtype(state)} is not supported (use one of "
                          f"{', '.join(str(d).replace('torch.', '') for d in STATE_DTYPES)})")
        if not all(is_static_int(s) for s in (H, P, N)):
            raise NoMatch(f"state {tuple(shape(state))}: head and state dims must be static")
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
            if r[PD] == FULL and r[ND] == FULL:
                scal.append(f)
            elif r[ND] == FULL:
                p_side.append(f)
            elif r[PD] == FULL:
                n_side.append(f)
            else:
                raise NoMatch(f"update factor {f.name} {fs} varies along both P and N: not a rank-1 update")
        if not p_side or not n_side:
            raise NoMatch("update term is not an outer product of a P-side and an N-side factor")
        for f in p_side + n_side + scal:
            if depends_on(f, store):
                # e.g. a delta rule (Gated DeltaNet's S·k): the replay op would read it from the checkpoint
                raise NoMatch(f"update factor {f.name} is computed from the state itself (a delta rule?), not "
                              f"from this token's inputs alone", code=NoMatch.STATE_DEPENDENT)

        # groups of B: block-repeat along H
        G = self._groups(n_side, H)
        keep_hp = {B_: 1, H_: 1, P_: 1}
        sizes = {B_: -1, H_: H, P_: P, N_: N}
        x_fn = self._product(p_side, keep_hp, sizes, t)
        B_fn = self._product(n_side, {B_: 1, H_: H // G, N_: 1}, {B_: -1, H_: G, N_: N}, t)
        dt_fn = self._product(scal, {B_: 1, H_: 1}, sizes, t) if scal else None
        if la_frame_rep[PD] != FULL or la_frame_rep[ND] != FULL:
            raise NoMatch("decay is not provably constant along P and N (not a scalar decay per head)")
        la_dims = _frame_dims(len(shape(decay)), transposed=t)
        la_cut = _extractor(shape(decay), la_dims, {B_: 1, H_: 1}, sizes)

        self._check_state_uses(state, cp, state_term)
        readout, C_src, C_fn, Gc, form = self._readout(new, cp, H, N, t)

        rec = torch.float64 if dtype(state) == torch.float64 else torch.float32
        if B_ in la_dims and not same_size(shape(decay)[la_dims.index(B_)], 1):
            la_srcs, la_of = [la_src], (lambda a, _f=la_fn, _c=la_cut: _c(_f(a)).to(rec))
        else:
            # one decay for every row (MiniMax's exp(-slope) per head): expanded over the state's rows
            la_srcs = [la_src, state]
            la_of = (lambda a, s0, _f=la_fn, _c=la_cut: _c(_f(a)).to(rec).expand(s0.shape[0], H).contiguous())
        la = Recipe(la_srcs, la_of)
        if dt_fn is None:
            dt = Recipe(la_srcs, lambda *v, _l=la_of: torch.ones_like(_l(*v)) * consts)
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
            out_shape=out_shape, out_dtype=dtype(readout), x_dtype=x_dtype, B_dtype=B_dtype, rec_dtype=rec,
            transposed=t)

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

    def _product(self, nodes, keep, sizes, t: bool = False):
        cuts = [_extractor(shape(f), _frame_dims(len(shape(f)), transposed=t), keep, sizes) for f in nodes]

        def fn(*vals):
            out = cuts[0](vals[0])
            for c, v in zip(cuts[1:], vals[1:]):
                out = out * c(v)
            return out

        return fn

    def _check_state_uses(self, state, cp, state_term):
        """The state may be read only by the decay product (through casts) and written only by the anchor. Returning
        it is not a read: the caller gets the cache tensor itself (a returned next state, written in place)."""
        for u in real_users(state):
            if u is cp or u.op == "output":
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

    def _readout_use(self, new, cp):
        """(alias of the new state, its one reader)."""
        aliases = self._aliases(new)
        uses = [(a, u) for a in aliases for u in real_users(a) if u not in aliases and u is not cp]
        if not uses:
            raise NoMatch("the new state is written but never read out")
        if len(uses) != 1:
            names = ", ".join(f"`{u.name}` ({op_name(u)})" for _, u in uses)
            raise NoMatch(f"the new state has {len(uses)} readers ({names}); only one readout is supported")
        return uses[0]

    def _transposed_readout(self, new, cp) -> bool:
        """Whether the readout contracts the state's dim -2 (a ``[b, H, N, P]`` state): ``C @ new``, an einsum
        summing its third index, or ``(new * C).sum(-2)``. Anything else is read as ``[b, H, P, N]``; the readout
        matchers below then say what they found."""
        try:
            alias, u = self._readout_use(new, cp)
        except NoMatch:
            return False
        name = op_name(u)
        if name in ("bmm", "matmul"):
            return u.args[0] is not alias and len(u.args) > 1 and u.args[1] is alias and len(shape(alias) or ()) == 4
        if name == "einsum":
            m = _einsum_parts(u, alias)
            return m is not None and len(m[0]) == 4 and m[2] == m[0][:2] + m[0][3]
        if name == "mul":
            sums = real_users(u)
            return len(sums) == 1 and op_name(sums[0]) == "sum" and _sum_dim(sums[0])[0] in (-2, 2)
        return False

    def _readout(self, new, cp, H, N, t: bool):
        alias, u = self._readout_use(new, cp)
        name = op_name(u)
        if name in ("bmm", "matmul") and u.args[0 if not t else 1] is alias:
            return self._readout_matmul(alias, u, H, N, t)
        if name == "einsum":
            return self._readout_einsum(alias, u, H, N, t)
        if name == "mul" and shape(alias) is not None and len(shape(alias)) == 4:
            return self._readout_mul_sum(alias, u, H, N, t)
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

    def _readout_matmul(self, alias, u, H, N, t: bool):
        if t:                                   # C [b, H(or Gc), 1, N] @ new [b, H, N, P]
            c = u.args[0]
            c_shape = shape(c)
            if c_shape is None or len(c_shape) != 4 or c_shape[-2] != 1 or c_shape[-1] != N:
                raise NoMatch(f"readout `{u.name}`: C operand {c_shape} is not [..., 1, N]")
            fn, Gc = self._C_from_frame(c, [B_, H_, P_, N_], H, N, 4)
            return u, c, fn, Gc, "matmul"
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

    def _readout_einsum(self, alias, u, H, N, t: bool):
        parts = _einsum_parts(u, alias)
        if parts is None or len(shape(alias) or ()) != 4:
            raise NoMatch(f"einsum readout `{u.name}` is not (new, C) with an equation read here")
        s_new, s_c, s_out, c = parts
        eq = u.args[0]
        n_ch = (s_new[2] if t else s_new[3]) if len(s_new) == 4 else ""
        if not n_ch or s_out != s_new.replace(n_ch, "") or sorted(s_c) != sorted(s_new[:2] + n_ch):
            raise NoMatch(f"einsum {eq!r} does not contract the state's last dim with C")
        frame = {s_new[0]: B_, s_new[1]: H_, n_ch: N_}
        if [frame[ch] for ch in s_c] != sorted(frame[ch] for ch in s_c):
            raise NoMatch(f"einsum {eq!r}: C dims are permuted")
        fn, Gc = self._C_from_frame(c, [frame[ch] for ch in s_c], H, N, 3)
        return u, c, fn, Gc, "einsum"

    def _readout_mul_sum(self, alias, u, H, N, t: bool):
        others = [a for a in u.args if a is not alias]
        if len(u.args) != 2 or len(others) != 1 or not isinstance(others[0], fx.Node):
            raise NoMatch(f"readout `{u.name}`: expected new * C")
        c = others[0]
        sums = real_users(u)
        if len(sums) != 1 or op_name(sums[0]) != "sum":
            raise NoMatch(f"readout `{u.name}`: new * C is not summed")
        s = sums[0]
        dim, keep = _sum_dim(s)
        if dim not in ((-2, 2) if t else (-1, 3)) or keep:
            raise NoMatch(f"readout `{s.name}` sums dim {dim} (keepdim={keep}), expected the last dim",
                          code=NoMatch.OTHER_READOUT_DIM)
        cs = shape(c)
        fn, Gc = self._C_from_frame(c, _frame_dims(len(cs), transposed=t), H, N, 4)
        return s, c, fn, Gc, "mul-sum"


def _einsum_parts(u: fx.Node, alias: fx.Node):
    """(new's indices, C's indices, output indices, C) of a two-operand einsum over ``alias``, or None."""
    eq, ops = u.args[0], list(u.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or alias not in ops:
        return None
    m = re.fullmatch(r"\s*(\w+)\s*,\s*(\w+)\s*->\s*(\w*)\s*", eq.replace("...", ""))
    if not m:
        return None
    i_new = ops.index(alias)
    return m.group(1 + i_new), m.group(2 - i_new), m.group(3), ops[1 - i_new]


def _sum_dim(s: fx.Node):
    """(dim, keepdim) of a ``sum`` node, a one-element dim list read as its element."""
    dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
    keep = s.kwargs.get("keepdim", s.args[2] if len(s.args) > 2 else False)
    return (dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim), keep


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
