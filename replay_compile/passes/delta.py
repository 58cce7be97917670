"""Recognise the delta-rule decode step (Gated DeltaNet, Kimi Delta Attention) in a Dynamo FX graph, by dataflow.

What is matched (names never matter; casts and view spellings are seen through), state ``S: [b, HV, K, V]``::

    s1    = S * exp(g)                 g constant along V; constant along K too (GDN) or not (KDA)
    kvm   = (s1 * k).sum(-2)           k constant along V: S'ᵀ k
    delta = (v - kvm) * beta           v, beta constant along K; beta constant along V
    new   = s1 + k * delta             the same k; a rank-1 update
    S.copy_(new)                       the anchor
    o     = (new * q).sum(-2)          the readout, q constant along V

which is how transformers writes Qwen3-Next / Qwen3.5 (``torch_recurrent_gated_delta_rule``) and Kimi-Linear
(``recurrent_kimi_delta_attention``). Grouped value heads (``repeat_interleave`` of q/k from ``Hk`` key heads) are
found by the broadcast analysis, so the ring stores one key per key head. The result is a :class:`DeltaMatch`
whose recipes cut ``q, k [b, H*, K]``, ``v [b, HV, V]``, ``g [b, HV]`` (``[b, HV, K]`` for KDA) and ``beta [b, HV]``
out of graph values; :func:`replay_compile::delta_step` replaces the write and the readout.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx

from ..kernels.delta_reference import delta_exact_step
from ..state import DeltaRingSpec
from .anchors import Anchor
from .broadcast import FULL, same_size
from .graph_utils import (
    CAST_LIKE,
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
from .mamba2 import (
    B_,
    H_,
    N_,
    P_,
    STATE_DTYPES,
    Mamba2Matcher,
    NoMatch,
    Recipe,
    SiteMatch,
    _extractor,
    _promote,
    _static_or_minus_one,
)

K_, V_ = P_, N_                     # the state frame [b, HV, K, V] in the Mamba-2 frame's dim numbers
_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "getitem"}


def flatten_users(new):
    """The add nodes of the tree that forms ``new`` (its own node and nested adds)."""
    out, todo = set(), [new]
    while todo:
        n = todo.pop()
        if isinstance(n, fx.Node) and op_name(n) == "add":
            out.add(n)
            todo.extend(a for a in n.args if isinstance(a, fx.Node))
    return out


def _einsum_parts(n: fx.Node, state_like: fx.Node):
    """(operands [state_like, other], state letters, other letters, output letters) of a two-operand einsum in
    which one operand is ``state_like`` (casts seen through); NoMatch otherwise."""
    eq, ops = n.args[0], list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    m = re.fullmatch(r"\s*(\w+)\s*,\s*(\w+)\s*->\s*(\w*)\s*", eq) if isinstance(eq, str) else None
    idx = [i for i, o in enumerate(ops) if strip(o) is strip(state_like)] if len(ops) == 2 else []
    if not m or len(idx) != 1 or len(m.group(1 + idx[0])) != 4:
        raise NoMatch(f"einsum `{n.name}` is not (state, vector) -> vector")
    i = idx[0]
    return [ops[i], ops[1 - i]], m.group(1 + i), m.group(2 - i), m.group(3)


def _adds_dims_only(n: fx.Node) -> bool:
    """``x[..., None]``-style indexing: only None, Ellipsis and full slices (an unsqueeze in another spelling)."""
    idx = n.args[1] if len(n.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in idx)


def _base(n):
    """Strip casts and pure views (the compact value a broadcast factor was made from)."""
    while isinstance(n, fx.Node) and n.args and not writers(n) and (
            op_name(n) in CAST_LIKE | (_VIEWS - {"getitem"}) or (op_name(n) == "getitem" and _adds_dims_only(n))):
        n = n.args[0]
    return n


@dataclasses.dataclass
class DeltaMatch(SiteMatch):
    HV: int
    Hk: int
    Hq: int
    K: int
    V: int
    kda: bool
    q: Recipe
    k: Recipe
    v: Recipe
    g: Recipe
    beta: Recipe
    out_shape: tuple
    out_dtype: torch.dtype
    k_dtype: torch.dtype
    rec_dtype: torch.dtype
    # the state is [b, HV, V, K] (fla's ``state_v_first``, serving engines' GDN pools); the op steps ``S.mT``
    transposed: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def family(self) -> str:
        return "kda" if self.kda else "gdn"

    @property
    def recipes(self) -> dict:
        return {"q": self.q, "k": self.k, "v": self.v, "g": self.g, "beta": self.beta}

    # -- what the rewrite and the validation need (same interface as Mamba2Match) -------------------------------
    op = property(lambda self: torch.ops.replay_compile.delta_step.default)
    op_keys = ("q", "k", "v", "g", "beta")
    ring_names = ("d_ring", "k_ring", "g_ring", "cursor")
    new_keys = ("k", "v", "g", "beta")

    def ring_spec(self, L: int) -> DeltaRingSpec:
        return DeltaRingSpec(HV=self.HV, Hk=self.Hk, K=self.K, V=self.V, L=L, d_dtype=self.rec_dtype,
                             k_dtype=self.k_dtype, kda=self.kda, rec_dtype=self.rec_dtype, transposed=self.transposed)

    def low_precision(self) -> bool:
        return any(d in (torch.bfloat16, torch.float16) for d in (self.k_dtype, self.out_dtype))

    def exact_new(self, S0: torch.Tensor, c: dict) -> torch.Tensor:
        """The new state in the cache tensor's own layout."""
        s = (S0.mT if self.transposed else S0).to(self.rec_dtype).clone()
        delta_exact_step(s, c["k"], c["k"], c["v"], c["g"], c["beta"])
        return s.mT if self.transposed else s

    def exact_readout(self, new: torch.Tensor, c: dict) -> torch.Tensor:
        q = c["q"].to(new.dtype).repeat_interleave(self.HV // c["q"].shape[1], dim=1)
        return torch.einsum("bhvk,bhk->bhv" if self.transposed else "bhkv,bhk->bhv", new, q)

    def describe(self, spec: DeltaRingSpec) -> str:
        rc = f" read copy {spec.read_copy}" if spec.read_copy else ""
        layout = " state [V, K]" if self.transposed else ""
        return f"HV={self.HV} Hk={self.Hk} K={self.K} V={self.V} L={spec.L}{layout}{rc}"


class DeltaMatcher(Mamba2Matcher):
    """Find and describe delta-rule state updates (shares the broadcast analysis helpers of the Mamba-2 one)."""

    def match(self, a: Anchor) -> DeltaMatch:
        """The delta-rule step written at anchor ``a`` (a whole state or a slot pool's rows, :mod:`.anchors`)."""
        cp, state, store = a.write, a.old, a.state
        layer = module_path(cp, default=f"state input `{store.name}`")
        if a.why:
            raise NoMatch(a.why)
        b, HV, K, V = shape(state)
        if dtype(state) not in STATE_DTYPES:
            raise NoMatch(f"state dtype {dtype(state)} is not supported")
        if not all(is_static_int(s) for s in (HV, K, V)):
            raise NoMatch(f"state {tuple(shape(state))}: head and state dims must be static")
        new = strip(a.value)
        terms = flatten(new, "add") if isinstance(new, fx.Node) else []
        if len(terms) != 2:
            raise NoMatch(f"new state is a sum of {len(terms)} terms, expected decayed state + update")
        gate, upd, s1 = self._split_terms(terms, state)
        self._check_reads_no_other_state(store, gate, upd)
        g_src, g_fn, g_rep = self._decay(gate)
        if g_rep[V_] != FULL:
            raise NoMatch("gate is not provably constant along V")
        kda = g_rep[K_] != FULL

        # update = k * delta, with delta = (v - (s1 * k).sum(-2)) * beta
        factors = [f for f in flatten(upd, "mul")]
        if len(factors) != 2 or not all(isinstance(f, fx.Node) for f in factors):
            raise NoMatch("update term is not a product of a key factor and a corrected-value factor")
        reps = [self.bx.aligned(f, 4) for f in factors]
        try:
            ik = next(i for i, r in enumerate(reps) if r[V_] == FULL and r[K_] != FULL)
        except StopIteration:
            raise NoMatch("update term has no key factor (constant along V)") from None
        kfac, dfac = factors[ik], factors[1 - ik]
        if self.bx.aligned(dfac, 4)[K_] != FULL:
            raise NoMatch("corrected-value factor varies along K: not a rank-1 update")
        if depends_on(kfac, store):
            raise NoMatch("key factor is computed from the state")
        delta = _base(dfac)
        dparts = flatten(delta, "mul")
        reading = [f for f in dparts if isinstance(f, fx.Node) and depends_on(f, store)]
        if len(reading) != 1:
            raise NoMatch("update does not read the state (not a delta rule)" if not reading else
                          "corrected value reads the state more than once")
        sub = strip(reading[0])
        if op_name(sub) != "sub" or len(sub.args) != 2:
            raise NoMatch(f"corrected value is not v - S'ᵀk (found {op_name(sub)})")
        v_node, kvm = sub.args
        if not isinstance(v_node, fx.Node) or depends_on(v_node, store):
            raise NoMatch("value term v is computed from the state")
        kvm_reader = self._check_kv_mem(kvm, s1, kfac)
        self._check_decayed_uses(s1, new, kvm_reader)
        beta_parts = [f for f in dparts if f is not reading[0]]
        if not all(isinstance(f, fx.Node) for f in beta_parts):
            raise NoMatch("corrected value has a non-tensor factor")

        self._check_state_uses(state, cp, s1)
        readout, qfac, q_dims = self._readout_q(new, cp, s1)
        if depends_on(qfac, store):
            raise NoMatch("query factor is computed from the state")

        # groups of q and k: block repeats along the value heads
        Hk = self._groups([kfac], HV)
        rq = self.bx.rep(qfac)[q_dims.index(H_)] if H_ in q_dims else FULL
        rq = HV if rq == FULL else rq
        Hq = HV // rq if HV % rq == 0 else HV
        rec = torch.float64 if dtype(state) == torch.float64 else torch.float32
        k_fn = self._product([kfac], {B_: 1, H_: HV // Hk, K_: 1}, {B_: -1, H_: Hk, K_: K, V_: V})
        q_fn = _extractor(shape(qfac), q_dims, {B_: 1, H_: HV // Hq, K_: 1}, {B_: -1, H_: Hq, K_: K})
        d3 = [B_, H_, V_]                                         # the frame of delta: [b, HV, V]
        v_cut = _extractor(shape(v_node), d3[3 - len(shape(v_node)):], {B_: 1, H_: 1, V_: 1}, {B_: -1, H_: HV, V_: V})
        for f in beta_parts:
            if len(shape(f)) > 3 or self.bx.aligned(f, 3)[2] != FULL:
                raise NoMatch(f"beta factor {f.name} varies along V")
        beta_cuts = [_extractor(shape(f), d3[3 - len(shape(f)):], {B_: 1, H_: 1}, {B_: -1, H_: HV}) for f in beta_parts]
        beta_src = list(beta_parts) or [v_node]             # no beta factor: beta = 1 (shaped from v)
        keep_g = {B_: 1, H_: 1, K_: 1} if kda else {B_: 1, H_: 1}
        g_cut = _extractor(shape(gate), list(range(4 - len(shape(gate)), 4)), keep_g, {B_: -1, H_: HV, K_: K})
        k_dtype = _promote([kfac])

        def beta_fn(*vals):
            if not beta_cuts:
                return torch.ones_like(v_cut(vals[0])[..., 0], dtype=rec)
            out = beta_cuts[0](vals[0])
            for c, x in zip(beta_cuts[1:], vals[1:]):
                out = out * c(x)
            return out.to(rec)

        return DeltaMatch(
            layer=layer, form=f"{'kda' if kda else 'gdn'}{'/grouped' if min(Hk, Hq) < HV else ''}"
                 f"{'/slot pool' if a.slot is not None else ''}",
            copy_node=cp, state=store, new=new, readout=readout, old=state, slot=a.slot, HV=HV, Hk=Hk, Hq=Hq, K=K, V=V,
            kda=kda,
            q=Recipe([qfac], lambda x, _f=q_fn: _f(x).to(rec)),
            k=Recipe([kfac], lambda x, _f=k_fn: _f(x).to(k_dtype)),
            v=Recipe([v_node], lambda x, _c=v_cut: _c(x).to(rec)),
            g=Recipe([g_src], lambda a, _f=g_fn, _c=g_cut: _c(_f(a)).to(rec)),
            beta=Recipe(beta_src, beta_fn),
            out_shape=_static_or_minus_one(shape(readout)), out_dtype=dtype(readout), k_dtype=k_dtype, rec_dtype=rec)

    # -- pieces ----------------------------------------------------------------------------------------------
    def _check_kv_mem(self, kvm, s1, kfac):
        """``kvm`` must be ``(s1 * k).sum(-2)`` with the update's own k (and nothing else reading the state)."""
        kvm = strip(kvm)
        if op_name(kvm) == "einsum":
            ops, s_st, s_x, s_out = _einsum_parts(kvm, s1)
            if s_out != s_st[0] + s_st[1] + s_st[3] or sorted(s_x) != sorted(s_st[:3]):
                raise NoMatch(f"S'ᵀk einsum {kvm.args[0]!r} does not contract the state's K dim with a key")
            if _base(ops[1]) is not _base(kfac):
                raise NoMatch("S'ᵀk uses another key than the update")
            return kvm
        if op_name(kvm) != "sum":
            raise NoMatch(f"S'ᵀk is not a sum or einsum (found {op_name(kvm)})")
        dim = kvm.args[1] if len(kvm.args) > 1 else kvm.kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if dim not in (-2, 2) or kvm.kwargs.get("keepdim", False):
            raise NoMatch(f"S'ᵀk sums dim {dim}, expected K (-2)")
        prod = strip(kvm.args[0])
        parts = list(prod.args) if op_name(prod) == "mul" and len(prod.args) == 2 else []   # s1 is a mul itself
        if len(parts) != 2 or not any(strip(p) is s1 for p in parts):
            raise NoMatch("S'ᵀk does not read the decayed state of the update")
        other = next(p for p in parts if strip(p) is not s1)
        if _base(other) is not _base(kfac):
            raise NoMatch("S'ᵀk uses another key than the update")
        return prod

    def _check_decayed_uses(self, s1, new, kvm_mul):
        """The decayed state may feed only the new state and S'ᵀk: anything else would read the checkpoint."""
        for u in real_users(s1):
            n = u
            while n not in (new, kvm_mul) and is_value_cast(n) and len(real_users(n)) == 1:
                n = real_users(n)[0]
            if n is new or n is kvm_mul or (op_name(n) == "add" and n in flatten_users(new)):
                continue
            raise NoMatch(f"the decayed state is also read by `{u.name}` ({op_name(u)})")

    def _readout_q(self, new, cp, s1):
        aliases = self._aliases(new)
        uses = [(a, u) for a in aliases for u in real_users(a) if u not in aliases and u is not cp]
        if len(uses) != 1:
            raise NoMatch(f"the new state has {len(uses)} readers; expected one readout (new * q).sum(-2)")
        alias, u = uses[0]
        if op_name(u) == "einsum" and len(shape(alias) or ()) == 4:
            ops, s_st, s_q, s_out = _einsum_parts(u, alias)
            if s_out != s_st[0] + s_st[1] + s_st[3] or sorted(s_q) != sorted(s_st[:3]):
                raise NoMatch(f"readout einsum {u.args[0]!r} does not contract the state's K dim with q")
            frame = {s_st[0]: B_, s_st[1]: H_, s_st[2]: K_}
            return u, ops[1], [frame[ch] for ch in s_q]
        if op_name(u) != "mul" or len(u.args) != 2:
            raise NoMatch(f"readout `{u.name}` ({op_name(u)}) is not (new * q).sum(-2) or an einsum over K")
        q = next((a for a in u.args if a is not alias), None)
        sums = real_users(u)
        if not isinstance(q, fx.Node) or len(sums) != 1 or op_name(sums[0]) != "sum":
            raise NoMatch(f"readout `{u.name}` is not summed")
        s = sums[0]
        dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        if dim not in (-2, 2) or s.kwargs.get("keepdim", False):
            raise NoMatch(f"readout sums dim {dim}, expected K (-2)")
        if self.bx.aligned(q, 4)[V_] != FULL:
            raise NoMatch("query factor varies along V")
        if not all(same_size(a, c) for a, c in zip(shape(s)[-2:], (shape(new)[1], shape(new)[3]))):
            raise NoMatch(f"readout shape {shape(s)} is not [b, HV, V]")
        return s, q, list(range(4 - len(shape(q)), 4))
