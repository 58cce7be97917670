"""Piecewise lowering: compile the pure regions of a rewritten graph, run its stateful ops in PyTorch.

Torch-TensorRT's ``torch.compile`` backend refuses graphs that mutate their inputs and then runs the whole graph
eagerly, and TensorRT plugins cannot mutate their inputs; a decode step mutates the cache (attention KV writes, conv
state updates, our replay ops). So the rewritten graph is split at every mutating node:

* *stateful* nodes — our ``replay_compile::*`` ops and every in-place op or item assignment — each form a piece of
  their own, run as they are (eager PyTorch, our Triton kernels inside);
* the *pure* regions between them are compiled by a pluggable per-piece compiler: Inductor (``lower="piecewise"``,
  tested on CPU in CI) or Torch-TensorRT (``lower="tensorrt"``).

Pieces are compiled lazily at their first call with the real arguments, once per argument signature (shapes, dtypes,
devices, non-tensor values), so a Dynamo graph with symbolic sizes still gets correct pieces. Pieces with fewer than
``MIN_PIECE_OPS`` ops run eagerly (compiling them costs more than it saves). Limits: no CUDA graphs across pieces
(``mode="reduce-overhead"`` is not applied to piecewise lowerings).
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from ._logging import log
from .errors import ReplayCompileError
from .passes.graph_utils import is_inplace

MIN_PIECE_OPS = 2
TENSORRT_HELP = ("lower='tensorrt' needs Torch-TensorRT with TensorRT's libraries: pip install torch-tensorrt "
                 "tensorrt --extra-index-url https://pypi.nvidia.com (the TensorRT wheels live on NVIDIA's index, "
                 "not PyPI), matching your torch version; or use lower='piecewise' (Inductor pieces) or "
                 "lower='inductor'")


def is_stateful(n: fx.Node) -> bool:
    """A node that mutates something: our replay ops, in-place ops (``copy_``, ``index_copy_``, ...), item
    assignment."""
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target is operator.setitem:
        return True
    ns = getattr(getattr(n.target, "_schema", None), "name", "") or ""
    if ns.startswith("replay_compile::"):
        return True
    if isinstance(n.target, torch._ops.OpOverloadPacket) and str(n.target).startswith("replay_compile."):
        return True
    return is_inplace(n)


def split_stateful(gm: fx.GraphModule) -> tuple[fx.GraphModule, set[str]]:
    """``gm`` split into ``submod_<i>`` pieces in graph order; returns (split module, names of the stateful pieces).
    Every stateful node is a piece of its own; the pure nodes between two of them form one piece."""
    part: dict[fx.Node, int] = {}
    stateful: set[int] = set()
    cur = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if is_stateful(n):
            cur += 1
            part[n] = cur
            stateful.add(cur)
            cur += 1
        else:
            part[n] = cur
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    return split, {f"submod_{i}" for i in stateful}


class _LazyPiece(torch.nn.Module):
    """A pure piece, compiled at its first call per argument signature by ``compiler(gm, args)``."""

    def __init__(self, name: str, gm: fx.GraphModule, compiler: Callable):
        super().__init__()
        self.piece_name, self.gm, self.compiler = name, gm, compiler
        self.compiled: dict[tuple, Callable] = {}

    @staticmethod
    def _signature(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else
                     (type(a), a) for a in args)

    def forward(self, *args):
        key = self._signature(args)
        fn = self.compiled.get(key)
        if fn is None:
            log.debug("replay_compile: compiling piece %s (%d inputs)", self.piece_name, len(args))
            fn = self.compiled[key] = self.compiler(self.gm, list(args))
        return fn(*args)


def _n_ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
               and n.target is not operator.getitem)


def inductor_piece_compiler(gm: fx.GraphModule, args: list) -> Callable:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, args)


def tensorrt_piece_compiler(gm: fx.GraphModule, args: list) -> Callable:
    torch_tensorrt = import_tensorrt()
    return torch_tensorrt.compile(gm, ir="dynamo", inputs=args, min_block_size=1)


def import_tensorrt():
    """``torch_tensorrt``, or a ReplayCompileError saying what to install (its import raises a plain ``Exception``
    when TensorRT's libraries are missing, not an ImportError)."""
    try:
        import torch_tensorrt
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise ReplayCompileError(f"replay_compile: {TENSORRT_HELP}. Importing torch_tensorrt failed: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return torch_tensorrt


PIECE_COMPILERS = {"piecewise": inductor_piece_compiler, "tensorrt": tensorrt_piece_compiler}


def lower_piecewise(gm: fx.GraphModule, example_inputs: Sequence, how: str) -> Callable:
    """The rewritten graph ``gm`` as a callable: pure pieces compiled by ``PIECE_COMPILERS[how]`` (lazily), stateful
    pieces eager. Raises a ReplayCompileError at once if ``how == "tensorrt"`` and Torch-TensorRT cannot load."""
    if how == "tensorrt":
        import_tensorrt()
    compiler = PIECE_COMPILERS[how]
    split, stateful = split_stateful(gm)
    n_pure = 0
    for name, sub in list(split.named_children()):
        if name in stateful or _n_ops(sub) < MIN_PIECE_OPS:
            continue
        setattr(split, name, _LazyPiece(name, sub, compiler))
        n_pure += 1
    log.info("replay_compile: piecewise lowering (%s): %d compiled pieces, %d stateful ops left to PyTorch", how,
             n_pure, len(stateful))
    split.replay_pieces = (n_pure, len(stateful))
    return split
