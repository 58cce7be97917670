"""Broadcast provenance: along which dimensions is a value provably constant, or repeated in blocks?

For every dimension ``d`` of a node's value we compute ``rep[d]``:

* ``FULL``: the value does not depend on the index along ``d`` at all (it was broadcast or expanded there);
* an int ``r >= 1``: the value depends on the index ``i`` only through ``i // r`` (``r == 1``: no knowledge).

Grouped B/C in Mamba-2 (``H`` heads sharing ``G`` groups) show up as ``rep == H // G`` along the head dimension,
whichever spelling produced them (``expand + reshape``, ``repeat_interleave``, indexing with ``h // r``...).
The analysis is conservative: unknown operations give ``rep = 1`` (or ``FULL`` on size-1 dims), so a proof may be
missed but never invented. The matcher only extracts compact tensors along dimensions proven here, and the
rewrite is still checked numerically before it is applied.
"""

from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from .graph_utils import CAST_LIKE, example, is_static_int, op_name, shape, writers

FULL = -1

ELEMENTWISE = CAST_LIKE | {
    "mul", "add", "sub", "div", "neg", "exp", "log", "softplus", "sigmoid", "silu", "tanh", "relu", "pow",
    "rsqrt", "sqrt", "abs", "clamp", "clamp_min", "clamp_max", "where", "maximum", "minimum", "log1p",
    "expm1", "reciprocal", "square", "exp2", "softsign", "gelu", "mul_", "sign", "logaddexp",
}


REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "logsumexp"}


def _default(shp) -> list:
    return [FULL if same_size(s, 1) else 1 for s in shp]


def combine(a: int, b: int) -> int:
    """rep of f(u, v) along a dim where u has rep a and v rep b."""
    if a == FULL:
        return b
    if b == FULL:
        return a
    return math.gcd(a, b)


def normalise(rep: list, shp) -> list:
    return [FULL if (r == FULL or same_size(s, 1) or (is_static_int(s) and r == s)) else r for r, s in zip(rep, shp)]


def merge(reps: list, sizes: list) -> int:
    """rep of the dims ``sizes`` (outer to inner) flattened into one."""
    acc = 1
    for r, s in zip(reversed(reps), reversed(sizes)):
        if not is_static_int(s):
            return acc  # inner constant block is still provable; nothing beyond it
        if r == FULL:
            acc *= s
            continue
        return acc * math.gcd(r, s)
    return FULL


def split(rep: int, sizes: list) -> list:
    """reps of dims ``sizes`` (outer to inner) produced by splitting one dim of rep ``rep``."""
    out = [1] * len(sizes)
    if rep == FULL:
        return [FULL] * len(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        s = sizes[i]
        if not is_static_int(s):
            break
        if rep % s == 0:
            out[i] = FULL
            rep //= s
            continue
        out[i] = math.gcd(rep, s)
        break
    return out


def same_size(a, b) -> bool:
    if is_static_int(a) and is_static_int(b):
        return a == b
    return str(a) == str(b)


def reshape_rep(rep: list, in_shape, out_shape) -> list:
    """Carry reps through a row-major reshape by matching groups of dims with equal products."""
    out = [1] * len(out_shape)
    i = j = 0
    in_shape, out_shape = list(in_shape), list(out_shape)
    while i < len(in_shape) or j < len(out_shape):
        # size-1 dims map to nothing
        if i < len(in_shape) and same_size(in_shape[i], 1):
            i += 1
            continue
        if j < len(out_shape) and same_size(out_shape[j], 1):
            out[j] = FULL
            j += 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            break
        if not (is_static_int(in_shape[i]) and is_static_int(out_shape[j])):
            if not same_size(in_shape[i], out_shape[j]):
                return _default(out_shape)  # symbolic dims regrouped: no proof, stay conservative
            out[j] = rep[i]
            i += 1
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(in_shape) or not is_static_int(in_shape[i]):
                    return _default(out_shape)
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                if j >= len(out_shape) or not is_static_int(out_shape[j]):
                    return _default(out_shape)
                gj.append(j)
                pj *= out_shape[j]
        m = merge([rep[k] for k in gi], [in_shape[k] for k in gi])
        for k, r in zip(gj, split(m, [out_shape[k] for k in gj])):
            out[k] = r
        i += 1
        j += 1
    return normalise(out, out_shape)


class BroadcastAnalysis:
    """Lazily computes and memoises ``rep`` for the nodes of one graph."""

    def __init__(self):
        self._memo: dict[fx.Node, list] = {}

    def rep(self, n: Any) -> list:
        if not isinstance(n, fx.Node):
            return []  # python scalar: constant everywhere (rank 0)
        if n not in self._memo:
            self._memo[n] = self._compute(n)
        return self._memo[n]

    def aligned(self, n: Any, rank: int) -> list:
        """rep of ``n`` right-aligned to a broadcast of rank ``rank`` (missing leading dims: FULL)."""
        r = self.rep(n)
        return [FULL] * (rank - len(r)) + r

    def _compute(self, n: fx.Node) -> list:
        shp = shape(n)
        if shp is None:
            return []
        if writers(n):
            return _default(shp)        # written in place later: a read may not see the value computed here
        name = op_name(n)
        try:
            if name in ELEMENTWISE:
                return self._elementwise(n, shp)
            if name == "expand" or name == "expand_as" or name == "broadcast_to":
                src = n.args[0]
                src_shape = shape(src)
                r = self.aligned(src, len(shp))
                padded = [1] * (len(shp) - len(src_shape)) + list(src_shape)
                return normalise([FULL if same_size(p, 1) else x for x, p in zip(r, padded)], shp)
            if name in ("view", "reshape", "flatten", "unflatten"):
                return reshape_rep(self.rep(n.args[0]), shape(n.args[0]), shp)
            if name == "unsqueeze":
                d = n.args[1] if len(n.args) > 1 else n.kwargs["dim"]
                r = list(self.rep(n.args[0]))
                d = d % (len(r) + 1)
                return normalise(r[:d] + [FULL] + r[d:], shp)
            if name in ("transpose", "swapaxes"):
                r = list(self.rep(n.args[0]))
                a, b = (x % len(r) for x in n.args[1:3])
                r[a], r[b] = r[b], r[a]
                return normalise(r, shp)
            if name == "permute":
                dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
                r = self.rep(n.args[0])
                return normalise([r[d % len(r)] for d in dims], shp)
            if name == "repeat_interleave":
                return self._repeat_interleave(n, shp)
            if name in REDUCTIONS:
                return self._reduction(n, shp)
            if name == "getitem":
                return self._getitem(n, shp)
        except (KeyError, IndexError, TypeError, ValueError):
            pass
        return _default(shp)

    def _elementwise(self, n: fx.Node, shp) -> list:
        out = [FULL] * len(shp)
        operands = list(n.args) + list(n.kwargs.values())
        for a in operands:
            if not isinstance(a, fx.Node) or not isinstance(shape(a), tuple):
                continue
            r = self.aligned(a, len(shp))
            sa = [1] * (len(shp) - len(shape(a))) + list(shape(a))
            for d in range(len(shp)):
                out[d] = combine(out[d], FULL if same_size(sa[d], 1) else r[d])
        return normalise(out, shp)

    def _reduction(self, n: fx.Node, shp) -> list:
        """sum/mean/... over ``dim``: the other dims keep their rep; a kept reduced dim is constant (size 1)."""
        r = list(self.rep(n.args[0]))
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if dim is None:
            return _default(shp)
        dims = {d % len(r) for d in (dim if isinstance(dim, (list, tuple)) else (dim,))}
        out = [FULL if d in dims else x for d, x in enumerate(r) if keep or d not in dims]
        return normalise(out, shp)

    def _repeat_interleave(self, n: fx.Node, shp) -> list:
        src = n.args[0]
        reps = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if not is_static_int(reps) or dim is None:
            return _default(shp)
        r = list(self.rep(src))
        dim %= len(r)
        r[dim] = FULL if r[dim] == FULL else r[dim] * reps
        return normalise(r, shp)

    def _getitem(self, n: fx.Node, shp) -> list:
        src, idx = n.args
        if not isinstance(src, fx.Node) or not hasattr(example(src), "shape"):
            # element of a tuple (split/chunk): along the split dim a slice loses the block structure
            return self._split_piece(n, shp)
        r = list(self.rep(src))
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, fx.Node) or (not isinstance(i, (int, slice)) and i is not None and i is not Ellipsis)
               for i in idx):
            return _default(shp)
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        expanded = []
        for i in idx:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (len(r) - n_real))
            else:
                expanded.append(i)
        expanded += [slice(None)] * (len(r) - sum(1 for i in expanded if i is not None))
        out, d = [], 0
        for i in expanded:
            if i is None:
                out.append(FULL)
            elif isinstance(i, int):
                d += 1
            else:
                full = i == slice(None) or i == slice(None, None, None)
                out.append(r[d] if full or r[d] == FULL else 1)
                d += 1
        return normalise(out, shp)

    def _split_piece(self, n: fx.Node, shp) -> list:
        parent = n.args[0]
        if not isinstance(parent, fx.Node) or op_name(parent) not in ("split", "chunk", "split_with_sizes"):
            return _default(shp)
        src = parent.args[0]
        dim = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)
        r = list(self.rep(src))
        dim %= len(r)
        r[dim] = FULL if r[dim] == FULL else 1
        return normalise(r, shp)
