"""Triton-kernel launches as Dynamo records them, for the anchors that recognise a library's kernel by its name.

Dynamo records a user Triton kernel's launch as one higher-order op, ``triton_kernel_wrapper_mutation(kernel_idx,
constant_args_idx, grid, kwargs)``: tensor arguments are graph nodes in ``kwargs``; sizes, strides, ``None``
arguments and constexprs are in its kernel side table. Kernels under ``triton.autotune`` / ``triton.heuristics``
keep the JIT function as their ``fn``; a heuristic's value is computed from the other arguments when a launch is
run by the numerical check (:func:`heuristic_values`).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def _hop():
    return getattr(torch.ops.higher_order, "triton_kernel_wrapper_mutation", None)


def jit_function(kernel):
    """The ``JITFunction`` under autotuner / heuristics wrappers (``None`` if there is none)."""
    seen = 0      # wrappers carry ``arg_names`` too (triton >= 3.4): descend while the inner one has them
    while kernel is not None and (not hasattr(kernel, "arg_names") or hasattr(getattr(kernel, "fn", None),
                                                                              "arg_names")) and seen < 8:
        kernel = getattr(kernel, "fn", None)
        seen += 1
    return kernel if hasattr(kernel, "arg_names") else None


def kernel_call(node: fx.Node):
    """``(jit_function, tensor kwargs, constant kwargs)`` of a Triton-kernel launch node, or ``None``."""
    hop = _hop()
    if hop is None or node.op != "call_function" or node.target is not hop:
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        consts = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    except (KeyError, AssertionError, IndexError):
        return None
    return jit_function(kernel), dict(node.kwargs["kwargs"]), dict(consts)


def kernel_name(node: fx.Node) -> str | None:
    """The launched kernel's function name, or ``None`` for anything but a Triton launch."""
    call = kernel_call(node)
    if call is None or call[0] is None:
        return None
    return getattr(call[0].fn, "__name__", None)


def launches(gm: fx.GraphModule, names) -> list[fx.Node]:
    """Launch nodes of kernels whose function name is in ``names``, in graph order."""
    return [n for n in gm.graph.nodes if kernel_name(n) in names]


def heuristic_values(kernel, args: dict) -> dict:
    """Constexprs a ``triton.heuristics`` wrapper computes from the launch's arguments (all its layers)."""
    out, seen = {}, 0
    jit = jit_function(kernel)
    while kernel is not None and kernel is not jit and seen < 8:
        for name, fn in (getattr(kernel, "values", None) or {}).items():
            if name not in args and name not in out:
                out[name] = fn({**args, **out})
        kernel = getattr(kernel, "fn", None)
        seen += 1
    return out
