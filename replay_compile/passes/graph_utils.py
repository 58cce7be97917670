"""Spelling-independent views of Dynamo FX graph nodes.

Dynamo graphs keep the user's spelling: ``x.exp()`` is a ``call_method``, ``torch.exp(x)`` a ``call_function``,
``a * b`` is ``operator.mul``. The matchers never look at names of variables or modules; they ask these helpers
what a node *does*: :func:`op_name` gives one canonical name per operation, :func:`strip` sees through casts and
copies that do not change values' meaning, :func:`flatten` collects the operands of nested products or sums.
"""

from __future__ import annotations

import re

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

_OPERATORS = {
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
    operator.neg: "neg", operator.getitem: "getitem", operator.matmul: "matmul", operator.pow: "pow",
}

# value-preserving up to rounding: casts, device moves, copies
CAST_LIKE = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach"}
# metadata-only uses of a tensor (reading them cannot observe stale values)
METADATA = {"size", "dim", "numel", "stride", "shape", "dtype", "device", "is_contiguous", "data_ptr"}
VIEW_LIKE = {"view", "reshape", "unsqueeze", "squeeze", "expand", "getitem", "flatten", "unflatten"}


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


def strip(n: Any) -> Any:
    """Follow single-input casts and copies back to the value they came from."""
    while isinstance(n, fx.Node) and op_name(n) in CAST_LIKE and n.args:
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


def is_inplace(n: fx.Node) -> bool:
    name = op_name(n)
    return bool(name) and name.endswith("_") and not name.startswith("_")


def module_path(n: fx.Node, default: str | None = None) -> str:
    """Best-effort dotted module path of the code that produced ``n`` (for logs), e.g. ``backbone.layers.0.mixer``."""
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
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
