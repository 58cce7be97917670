"""``replay_op``: the decorator our ops are defined with, ``torch.library.custom_op``'s interface at a fraction of its
per-call cost.

Why not ``torch.library.custom_op`` itself: it dispatches through Python at three keys (autograd, ADInplaceOrView,
then the backend, where it also checks at run time that no output aliases an input), ~50 µs per call with five
mutated arguments on a 2-core CPU against ~4 µs for the same op defined through ``torch.library.Library``
(``benchmarks/diag_host_overhead.py`` measures both on the GPU machine). Outside CUDA graphs (``torch.compile``'s
default mode) a decode step calls one of our ops per SSM layer, so the difference is host time the GPU waits for.

What is kept: the schema is inferred from the type annotations exactly as ``custom_op`` does (same mutation
annotations, so Dynamo / AOTAutograd functionalize and Inductor re-inplaces the op the same way); ``register_kernel``
and ``register_fake`` have the same signatures; the version counters of the mutated tensors are bumped after every
call (``custom_op`` bumps them in its ADInplaceOrView kernel; ours write through raw pointers, so autograd and
:mod:`replay_compile.state`'s external-write check would not see the write otherwise). What is dropped: the
autograd kernel (these are decode-time ops; an input that requires grad gets PyTorch's "autograd not implemented"
warning instead of custom_op's error) and the run-time aliasing check (our outputs are fresh tensors by construction).
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch

NAMESPACE = "replay_compile"
_LIB = torch.library.Library(NAMESPACE, "DEF")

_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


class ReplayOp:
    """One op: call it like the function it was defined from; ``.default`` is the ``torch.ops`` overload."""

    def __init__(self, name: str, fn: Callable, mutates_args: Iterable[str]):
        self.name = name
        self._params = list(inspect.signature(fn).parameters)
        missing = [a for a in mutates_args if a not in self._params]
        if missing:
            raise ValueError(f"replay_op {name}: mutates_args {missing} are not parameters of {fn.__name__}")
        self._mutated = [self._params.index(a) for a in mutates_args]
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        _LIB.impl(name, self._bumping(fn), "CompositeExplicitAutograd")
        self.default = getattr(getattr(torch.ops, NAMESPACE), name).default
        self.__doc__ = fn.__doc__

    def _bumping(self, fn: Callable) -> Callable:
        """``fn`` followed by a version bump of every mutated tensor it was given."""
        if not self._mutated:
            return fn
        idx, params = self._mutated, self._params

        def impl(*args, **kwargs):
            out = fn(*args, **kwargs)
            torch.autograd.graph.increment_version(
                [t for t in (args[i] if i < len(args) else kwargs.get(params[i]) for i in idx)
                 if isinstance(t, torch.Tensor)])
            return out

        return impl

    def register_kernel(self, device_type: str) -> Callable:
        """Decorator: the implementation for one device type (``"cuda"`` or ``"cpu"``)."""
        key = _DEVICE_KEYS.get(device_type)
        if key is None:
            raise ValueError(f"replay_op {self.name}: device type {device_type!r} not one of {sorted(_DEVICE_KEYS)}")

        def deco(fn: Callable) -> Callable:
            _LIB.impl(self.name, self._bumping(fn), key)
            return fn

        return deco

    def register_fake(self, fn: Callable) -> Callable:
        """Decorator: the shape / dtype function used under FakeTensor (tracing, torch.compile)."""
        torch.library.register_fake(f"{NAMESPACE}::{self.name}", fn, lib=_LIB)
        return fn

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)


def replay_op(qualname: str, *, mutates_args: Iterable[str]) -> Callable:
    """Define ``torch.ops.replay_compile.<name>`` from an annotated function (``custom_op``'s arguments).

    ``qualname`` is ``"replay_compile::<name>"``. The function is the implementation for every device without its
    own ``register_kernel``.
    """
    ns, _, name = qualname.partition("::")
    if ns != NAMESPACE or not name:
        raise ValueError(f"replay_op: qualname must be '{NAMESPACE}::<name>', got {qualname!r}")

    def deco(fn: Callable) -> ReplayOp:
        return ReplayOp(name, fn, tuple(mutates_args))

    return deco
