"""Spellings of a state update turned into the one form every family's matcher reads, before any matcher looks.

The matchers read ``S.copy_(decay * S + update)`` with the readout taken from the new value and the update's outer
product as a broadcast product. Users (and reference implementations) write the same step in other ways; each is
rewritten here into that form, each rewrite keeping every value the graph computes (what
tests/passes/test_pass_spellings.py checks step by step against the eager module, for each spelling):

* **In-place updates** of a graph-input state, ``S.mul_(a).add_(u)``, ``S.mul_(a); S.addcmul_(t1, t2, value=c)``
  (which Dynamo records as ``S.copy_(fma(t1 * t2, c, S))``), ``S.add_(u, alpha=c)``: each becomes its out-of-place
  op on the running value (cast back to the state's dtype, as an in-place op stores it), one ``S.copy_(value)``
  follows the last of them, and later reads of ``S`` (or of the in-place results, which are ``S``) read the value.
* **Reads after the write**: ``S.copy_(v)`` followed by ``y = f(S)`` (mamba_ssm's reference step) reads ``v``
  (cast to the state's dtype where the copy casts).
* **Outer products**: an ``einsum`` that sums over no index (``"bhp,bhn->bhpn"``, ``"bh,bhp,bhn->bhpn"``) becomes a
  broadcast product of its operands; ``baddbmm`` / ``bmm`` / ``matmul`` whose contracted dim is 1 likewise
  (``baddbmm(S * a, x[..., None], B[..., None, :])``). Only where the result flows into a state write.

A state whose writes do not fit (a view of it written, another kind of in-place op, a view taken before the write
and read after it) is left as it is; the matchers then say what they see.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from . import anchors
from .graph_utils import (
    ALIASING,
    METADATA,
    dtype,
    example,
    flatten,
    is_static_int,
    op_name,
    shape,
    state_inputs,
    strip,
    writers,
)
from .rewrite import erase_dead

# in-place arithmetic a state update is spelt with, and what each becomes
_INPLACE = {"mul_", "add_", "sub_", "div_", "addcmul_"}


def canonicalize(graph: fx.Graph) -> list[str]:
    """Apply the rewrites above to ``graph`` in place; returns one line per rewrite made (for the debug log)."""
    done = []
    for s in state_inputs(graph):
        done += _functionalize_inplace(graph, s)
        done += _forward_reads_after_write(graph, s)
    done += _expand_outer_products(graph)
    done += _sums_under_a_view(graph)
    return done


def _set_meta(node: fx.Node, fn, *args, **kwargs) -> fx.Node:
    """``node.meta["example_value"]`` from ``fn`` run on its operands' example values (under their fake mode)."""
    vals = [example(a) for a in args]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["example_value"] = fn(*vals, **{k: example(v) for k, v in kwargs.items()})
    return node


def _call(graph: fx.Graph, fn, *args, **kwargs) -> fx.Node:
    return _set_meta(graph.call_function(fn, args, kwargs), fn, *args, **kwargs)


def _method(graph: fx.Graph, name: str, *args, **kwargs) -> fx.Node:
    n = graph.call_method(name, args, kwargs)
    return _set_meta(n, lambda self, *a, **k: getattr(self, name)(*a, **k), *args, **kwargs)


def _read_as(n: fx.Node, olds, new: fx.Node) -> None:
    """``n`` reads ``new`` wherever it read one of ``olds`` (nested arguments included)."""
    n.args = fx.node.map_arg(n.args, lambda a: new if a in olds else a)
    n.kwargs = fx.node.map_arg(n.kwargs, lambda a: new if a in olds else a)


def _cast_to(graph: fx.Graph, v: fx.Node, dt: torch.dtype | None) -> fx.Node:
    return v if dt is None or dtype(v) == dt else _method(graph, "to", v, dt)


def _convertible(u: fx.Node) -> bool:
    """Whether :func:`_out_of_place` knows the in-place call ``u`` with its arguments."""
    name, rest, kw = op_name(u), u.args[1:], set(u.kwargs)
    if name == "copy_":
        return len(rest) == 1 and isinstance(rest[0], fx.Node) and not kw
    if name == "addcmul_":
        return len(rest) == 2 and not kw - {"value"}
    if name in ("add_", "sub_"):
        return len(rest) == 1 and not kw - {"alpha"}
    return name in ("mul_", "div_") and len(rest) == 1 and not kw


def _out_of_place(graph: fx.Graph, u: fx.Node, cur: fx.Node, dt) -> fx.Node:
    """The out-of-place form of the in-place arithmetic ``u`` applied to the value ``cur``, cast to ``dt``."""
    name, rest, kw = op_name(u), list(u.args[1:]), dict(u.kwargs)
    if name == "copy_":
        return _cast_to(graph, rest[0], dt)
    if name == "addcmul_":
        prod = _call(graph, operator.mul, rest[0], rest[1])
        if kw.get("value", 1) != 1:
            prod = _call(graph, operator.mul, prod, kw["value"])
        out = _call(graph, operator.add, cur, prod)
    elif name in ("add_", "sub_"):
        other = rest[0]
        if kw.get("alpha", 1) != 1:
            other = _call(graph, operator.mul, other, kw["alpha"])
        out = _call(graph, operator.add if name == "add_" else operator.sub, cur, other)
    else:
        out = _call(graph, operator.mul if name == "mul_" else operator.truediv, cur, rest[0])
    return _cast_to(graph, out, dt)


def _functionalize_inplace(graph: fx.Graph, s: fx.Node) -> list[str]:
    """``S.mul_(a).add_(u)`` and kin on the graph input ``s`` -> ``S.copy_(S * a + u)``, later reads read that."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    chain, members = [], {s}
    for n in graph.nodes:
        if (op_name(n) in _INPLACE or op_name(n) == "copy_") and n.args and n.args[0] in members:
            chain.append(n)
            members.add(n)
    if not any(op_name(n) in _INPLACE for n in chain) or not all(map(_convertible, chain)):
        return []               # none, or only S.copy_(v): already the form the matchers read
    if any(w not in chain for w in writers(s)):
        return []               # also written another way (a view written, copy_, a launch): left alone
    first = order[chain[0]]
    for u in s.users:           # a view taken before the first write and read after it would see the new value
        if u not in chain and order[u] < first and op_name(u) in ALIASING:
            if any(order[r] > first for r in u.users):
                return []
    dt, cur = dtype(s), s
    for n in list(graph.nodes)[first:]:
        if n in chain:
            with graph.inserting_before(n):
                cur = _out_of_place(graph, n, cur, dt)
        else:                   # reads of the state (or of an in-place result: the state) read the running value
            _read_as(n, members, cur)
    with graph.inserting_after(cur):
        graph.call_method("copy_", (s, cur))
    for n in reversed(chain):
        graph.erase_node(n)
    return [f"in-place updates of `{s.name}` ({', '.join(op_name(n) for n in chain)}) as one copy_"]


def _forward_reads_after_write(graph: fx.Graph, s: fx.Node) -> list[str]:
    """``S.copy_(v); y = f(S)`` -> ``y = f(v)`` where ``S`` is written exactly once, by that copy."""
    ws = writers(s)
    if len(ws) != 1 or op_name(ws[0]) != "copy_" or ws[0].args[0] is not s or len(ws[0].args) != 2:
        return []
    cp, v = ws[0], ws[0].args[1]
    if not isinstance(v, fx.Node) or writers(v):
        return []
    order = {n: i for i, n in enumerate(graph.nodes)}
    at = order[cp]
    later = [u for u in s.users if order[u] > at and u.op != "output" and op_name(u) not in METADATA]
    if not later:
        return []
    for u in s.users:           # a view of the state taken before the write and read after it: left alone
        if order[u] < at and op_name(u) in ALIASING and any(order[r] > at for r in u.users):
            return []
    with graph.inserting_after(cp):
        val = _cast_to(graph, v, dtype(s))
    for u in later:
        _read_as(u, {s}, val)
    return [f"reads of `{s.name}` after its write read the value written"]


def _feeds_a_state_write(graph: fx.Graph) -> set[fx.Node]:
    """Ancestors of the values written into state inputs (whole, or a pool's rows: :mod:`.anchors`)."""
    seen: set[fx.Node] = set()
    todo = [a.value for a in anchors.find(graph) if isinstance(a.value, fx.Node)]
    while todo:
        x = todo.pop()
        if x not in seen:
            seen.add(x)
            todo.extend(x.all_input_nodes)
    return seen


def _expand_outer_products(graph: fx.Graph) -> list[str]:
    done = []
    feeds = _feeds_a_state_write(graph)
    for n in [n for n in graph.nodes if n in feeds]:        # graph order: the same code on every compile
        name = op_name(n)
        if name == "einsum":
            new = _einsum_as_product(graph, n)
        elif name == "fma" and len(n.args) == 3 and not n.kwargs:        # a * b + c (Dynamo's addcmul_)
            with graph.inserting_before(n):
                new = _call(graph, operator.add, _call(graph, operator.mul, n.args[0], n.args[1]), n.args[2])
        elif name in ("baddbmm", "bmm", "matmul"):
            new = _rank1_matmul_as_product(graph, n)
        else:
            continue
        if new is not None:
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            done.append(f"{name} `{n.name}` as a broadcast product")
    return done


def _einsum_as_product(graph: fx.Graph, n: fx.Node) -> fx.Node | None:
    """An einsum that sums over no index: its operands permuted and broadcast to the output, multiplied."""
    if n.kwargs or not n.args or not isinstance(n.args[0], str):
        return None
    eq, ops = n.args[0].replace(" ", ""), list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    subs = ins.split(",")
    if len(subs) != len(ops) or len(ops) < 2 or len(set(out)) != len(out):
        return None
    if any(len(set(sub)) != len(sub) or set(sub) - set(out) for sub in subs):
        return None             # a repeated or summed index: a contraction, not an outer product
    if any(not isinstance(o, fx.Node) or shape(o) is None or len(shape(o)) != len(sub) for o, sub in zip(ops, subs)):
        return None
    with graph.inserting_before(n):
        prod = None
        for o, sub in zip(ops, subs):
            present = [c for c in out if c in sub]
            perm = [sub.index(c) for c in present]
            if perm != sorted(perm):
                o = _method(graph, "permute", o, *perm)
            for i, c in enumerate(out):
                if c not in sub:
                    o = _method(graph, "unsqueeze", o, i)
            prod = o if prod is None else _call(graph, operator.mul, prod, o)
    return prod


def _rank1_matmul_as_product(graph: fx.Graph, n: fx.Node) -> fx.Node | None:
    """``baddbmm(c, a, b)`` / ``bmm(a, b)`` / ``matmul(a, b)`` with ``a [..., M, 1]``, ``b [..., 1, K]``:
    ``c * beta + alpha * (a * b)``, the product broadcast."""
    name = op_name(n)
    args = list(n.args)
    kw = dict(n.kwargs)
    if name == "baddbmm":
        if len(args) != 3 or set(kw) - {"beta", "alpha"}:
            return None
        c, a, b = args
    elif len(args) == 2 and not kw:
        c, (a, b) = None, args
    else:
        return None
    sa, sb = shape(a), shape(b)
    if sa is None or sb is None or len(sa) < 2 or len(sb) < 2 or sa[-1] != 1 or sb[-2] != 1:
        return None
    if name != "matmul" and (len(sa) != 3 or len(sb) != 3):
        return None
    with graph.inserting_before(n):
        prod = _call(graph, operator.mul, a, b)
        if kw.get("alpha", 1) != 1:
            prod = _call(graph, operator.mul, prod, kw["alpha"])
        if c is None:
            return prod
        if kw.get("beta", 1) != 1:
            c = _call(graph, operator.mul, c, kw["beta"])
        return _call(graph, operator.add, c, prod)


def _sums_under_a_view(graph: fx.Graph) -> list[str]:
    """A step computed over a flattened ``[b·H, P, N]`` state and viewed back, ``S.copy_(flat.view(b, H, P, N))``
    with ``flat = S.view(b·H, P, N) * a + x * B`` (``baddbmm``'s broadcast product): the sum computed over the
    state's own shape instead, each factor viewed to it (a factor of ``b·H`` rows split, a broadcast one kept), and
    other readers of ``flat`` (the readout) reading a view of the new sum."""
    done = []
    for a in anchors.find(graph):
        v = a.value
        if a.slot is not None or op_name(v) not in ("view", "reshape") or not isinstance(v.args[0], fx.Node):
            continue
        flat = v.args[0]
        ts, fs = shape(v), shape(flat)
        if ts is None or fs is None or len(ts) != 4 or len(fs) != 3 or tuple(fs[1:]) != tuple(ts[2:]):
            continue
        H = ts[1]
        if not is_static_int(H) or not all(is_static_int(x) for x in ts[2:]):
            continue
        terms = flatten(flat, "add")
        if len(terms) < 2:
            continue
        before = set(graph.nodes)
        with graph.inserting_before(flat.next):
            lifted = []
            for t in terms:
                factors = [_lift_rows(graph, f, fs, ts) for f in flatten(t, "mul")]
                if any(f is None for f in factors):
                    lifted = None
                    break
                lifted.append(factors)
            if lifted is None:
                continue
            new = None
            for factors in lifted:
                prod = factors[0]
                for f in factors[1:]:
                    prod = _call(graph, operator.mul, prod, f)
                new = prod if new is None else _call(graph, operator.add, new, prod)
            as_flat = _method(graph, "reshape", new, -1, *fs[1:])
        made = set(graph.nodes) - before
        v.replace_all_uses_with(new)
        for u in list(flat.users):
            if u is not v and u not in made:
                _read_as(u, {flat}, as_flat)
        erase_dead(graph, [v, flat])                    # the flat sum and its view of S: no reader is left
        done.append(f"the sum `{flat.name}` under the view `{v.name}` computed over the state's shape")
    return done


def _lift_rows(graph: fx.Graph, f, fs: tuple, ts: tuple):
    """Factor ``f`` of a ``[b·H, P, N]`` sum as a factor of the ``[b, H, P, N]`` one (``None`` if it cannot be)."""
    if not isinstance(f, fx.Node):
        return f                                        # a scalar
    src = strip(f)
    if op_name(src) in ("view", "reshape") and isinstance(src.args[0], fx.Node) and shape(src.args[0]) is not None \
            and tuple(shape(src.args[0])) == tuple(ts):
        return src.args[0]                              # S.view(b·H, P, N): S itself
    s = shape(f)
    if s is None or len(s) > 3:
        return None
    s = (1,) * (3 - len(s)) + tuple(s)
    if s[0] == 1:
        return _method(graph, "reshape", f, 1, 1, *s[1:])
    if s[0] == fs[0]:
        return _method(graph, "reshape", f, -1, ts[1], *s[1:])
    return None
