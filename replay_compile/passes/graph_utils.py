"""Spelling-independent views of Dynamo FX graph nodes.

Dynamo graphs keep the user's spelling: ``x.exp()`` is a ``call_method``, ``torch.exp(x)`` a ``call_function``,
``a * b`` is ``operator.mul``. The matchers never look at names of variables or modules; they ask these helpers
what a node *does*: :func:`op_name` gives one canonical name per operation, :func:`strip` sees through casts and
copies that do not change values' meaning, :func:`flatten` collects the operands of nested products or sums.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

_OPERATORS = {
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
    operator.neg: "neg", operator.getitem: "getitem", operator.matmul: "matmul", operator.pow: "pow",
}

# value-preserving up to rounding: casts, device moves, copies (unless the result is written in place later:
# see :func:`writers`)
CAST_LIKE = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach"}
# metadata-only uses of a tensor (reading them cannot observe stale values)
METADATA = {"size", "dim", "numel", "stride", "shape", "dtype", "device", "is_contiguous", "data_ptr"}
VIEW_LIKE = {"view", "reshape", "unsqueeze", "squeeze", "expand", "getitem", "flatten", "unflatten"}
# results that may share memory with their first operand: a write to the result writes the operand too. Casts and
# reshapes return their operand itself when nothing changes; only clone always copies.
ALIASING = (VIEW_LIKE | CAST_LIKE | {
    "transpose", "swapaxes", "permute", "t", "narrow", "select", "as_strided", "view_as", "expand_as", "movedim",
    "diagonal", "split", "split_with_sizes", "chunk", "unbind", "unfold", "view_as_real", "view_as_complex",
    "real", "imag", "squeeze_", "unsqueeze_"}) - {"clone"}


def op_name(n: Any) -> str | None:
    """Canonical operation name of a node (``"mul"``, ``"exp"``, ``"copy_"``, ...), or None for non-calls."""
    if not isinstance(n, fx.Node):
        return None
    if n.op == "call_method":
        return str(n.target)
    if n.op != "call_function":
        return None
    t = n.target
    if t in _OPERATORS:
        return _OPERATORS[t]
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    name = getattr(t, "__name__", None)
    if name == "multiply":
        return "mul"
    if name == "true_divide" or name == "divide":
        return "div"
    return name


def is_call(n: Any, *names: str) -> bool:
    return op_name(n) in names


def tensor_args(n: fx.Node) -> list:
    """Positional operands of a call (``self`` first for methods)."""
    return list(n.args)


def example(n: Any):
    """The FakeTensor (or SymInt / constant) Dynamo recorded for a node, or the constant itself."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return n


def _concrete(s):
    """A SymInt whose value is a known constant (Dynamo makes those under dynamic=True) becomes a plain int."""
    if isinstance(s, torch.SymInt) and is_concrete_int(s):
        return int(s)
    return s


def shape(n: Any) -> tuple | None:
    v = example(n)
    if isinstance(v, torch.Tensor):
        return tuple(_concrete(s) for s in v.shape)
    if isinstance(v, (int, float, bool)) or v is None:
        return ()
    return None


def dtype(n: Any) -> torch.dtype | None:
    v = example(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _mutable_args(target) -> list[tuple[int, str]]:
    """(position, name) of the arguments a custom or aten op's schema declares written (``Tensor(a!)``)."""
    if isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    else:
        return []
    return [(i, a.name) for ov in overloads for i, a in enumerate(ov._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _writes_operand(u: fx.Node, a: fx.Node) -> bool:
    """Whether the call ``u`` may write the memory of its operand ``a``."""
    name = op_name(u)
    if name is None:
        return False
    if (is_inplace(u) or name == "setitem" or u.kwargs.get("inplace") is True) and u.args and u.args[0] is a:
        return True
    out = u.kwargs.get("out")
    if out is a or (isinstance(out, (tuple, list)) and a in out):
        return True
    if u.op != "call_function":
        return False
    t = u.target
    if isinstance(t, torch._ops.HigherOrderOperator):
        # a Triton launch writes any tensor it takes; other higher-order ops run subgraphs we do not inspect
        return True
    for i, arg_name in _mutable_args(t):
        if (i < len(u.args) and u.args[i] is a) or u.kwargs.get(arg_name) is a:
            return True
    return False


def aliases(n: fx.Node) -> set[fx.Node]:
    """``n`` and every node that may share its memory: views, no-op casts, and in-place results (an in-place
    method returns its operand, so ``t.mul_(a).add_(b)`` writes ``t`` twice)."""
    out, todo = {n}, [n]
    while todo:
        a = todo.pop()
        for u in a.users:
            if u not in out and u.args and u.args[0] is a and (
                    op_name(u) in ALIASING or (is_inplace(u) and _writes_operand(u, a))):
                out.add(u)
                todo.append(u)
    return out


def writers(n: Any) -> list[fx.Node]:
    """The calls that may write ``n``'s memory after it is computed: in-place methods and functions, ``setitem``,
    ``out=`` and ``inplace=True`` arguments, ops whose schema writes an argument and higher-order ops (Triton
    launches), applied to ``n`` or to one of its :func:`aliases`. Reads of ``n`` after one of them do not see the
    value ``n`` was computed as, so such a node is never taken as value-preserving."""
    if not isinstance(n, fx.Node):
        return []
    return [u for a in aliases(n) for u in a.users if _writes_operand(u, a)]


def is_value_cast(n: Any) -> bool:
    """A cast, device move or copy whose result is never written afterwards: its value is its operand's."""
    return isinstance(n, fx.Node) and op_name(n) in CAST_LIKE and bool(n.args) and not writers(n)


def strip(n: Any) -> Any:
    """Follow single-input casts and copies back to the value they came from (a copy that is updated in place
    afterwards, such as ``t = S.clone(); t.mul_(a)``, holds another value: it is not followed)."""
    while is_value_cast(n):
        n = n.args[0]
    return n


def flatten(n: Any, name: str) -> list:
    """Operands of a tree of ``name`` (``"mul"`` or ``"add"``) nodes, casts stripped between levels."""
    n = strip(n)
    if is_call(n, name) and len(n.args) == 2 and not n.kwargs:
        return flatten(n.args[0], name) + flatten(n.args[1], name)
    return [n]


def real_users(n: fx.Node) -> list[fx.Node]:
    """Users of ``n`` that may read its values (metadata queries excluded)."""
    return [u for u in n.users if op_name(u) not in METADATA]


def depends_on(n: Any, target: fx.Node) -> bool:
    """Whether the value of ``n`` is computed (transitively) from ``target``."""
    seen, todo = set(), [n] if isinstance(n, fx.Node) else []
    while todo:
        x = todo.pop()
        if x is target:
            return True
        if x in seen:
            continue
        seen.add(x)
        todo.extend(x.all_input_nodes)
    return False


# ops that mix values across positions or channels: a path through one is not an elementwise dependence
_MIXING = {"linear", "matmul", "bmm", "mm", "einsum", "addmm", "baddbmm", "conv1d", "conv2d", "sum", "mean",
           "softmax", "layer_norm", "rms_norm", "group_norm", "cumsum"}


def depends_elementwise(n: Any, target: fx.Node) -> bool:
    """Whether ``n`` is computed from ``target`` through elementwise ops, views and casts only (no projection,
    reduction or kernel launch on the way)."""
    seen, todo = set(), [n] if isinstance(n, fx.Node) else []
    while todo:
        x = todo.pop()
        if x is target:
            return True
        if x in seen or op_name(x) in _MIXING or (x.op == "call_function" and
                                                  isinstance(x.target, torch._ops.HigherOrderOperator)):
            continue
        seen.add(x)
        todo.extend(x.all_input_nodes)
    return False


def is_state_input(n: fx.Node, dims: int = 4) -> bool:
    """A graph input shaped like a recurrent state: a 4-D (or ``dims``-D) floating-point tensor."""
    v = example(n) if n.op == "placeholder" else None
    return isinstance(v, torch.Tensor) and v.dim() == dims and v.is_floating_point()


def state_inputs(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if is_state_input(n)]


def is_inplace(n: fx.Node) -> bool:
    name = op_name(n)
    return bool(name) and name.endswith("_") and not name.startswith("_")


def module_path(n: fx.Node, default: str | None = None) -> str:
    """Best-effort dotted module path of the code that produced ``n`` (for logs), e.g. ``backbone.layers.0.mixer``."""
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        paths = [v[0] for v in stack.values()]
        # the innermost module of the model itself: a module reached through a global (transformers 5.25 with the
        # `kernels` package calls its kernel functions as hub modules, "G.__import_...") names a function, not a layer
        inside = [p for p in paths if not p.startswith("G.") and not p.startswith("G[")]
        path = (inside or paths)[-1]
        path = path.replace("L['self'].", "").replace("L['self']", "")
        for junk in ("._modules['", "']", "['", "._modules"):
            path = path.replace(junk, "." if junk.endswith("['") else "")
        path = re.sub(r"^L\.(args\[0\]|self)(\.|$)", "", path)      # a forward reached through a wrapper(self, ...)
        return path.strip(".") or "<root>"
    return default or n.name


def is_static_int(s: Any) -> bool:
    return isinstance(s, int) and not isinstance(s, bool)


def nodes_in(items: Iterable) -> list[fx.Node]:
    return [x for x in items if isinstance(x, fx.Node)]
