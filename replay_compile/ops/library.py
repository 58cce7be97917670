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

Inlined CUDA kernels (``register_kernel("cuda", inline=predicate)``): when AOTAutograd traces the op on CUDA tensors
(``torch.compile``), the CUDA implementation itself is traced instead of the opaque op, with every Triton launch
wrapped by ``torch.library.wrap_triton`` (:mod:`replay_compile.kernels.launch`), as ``torch.library.triton_op``
does. Inductor then launches our kernels from its generated code: the per-step host cost of the dispatcher, the
argument checks and Triton's Python launcher (~80 µs per op call at batch 1 on the H200's host; outside CUDA graphs
the decode step waits for it) is paid once at compile time.

Where: every kernel variant by default. ``REPLAY_COMPILE_INLINE_KERNELS=latency`` inlines only where the op
launches its latency kernels (``inline=`` a predicate on the arguments: Mamba-2's ``whole``, the delta rule's
``fused``; small batches), ``0`` none. Read-only tensor inputs are made contiguous before the traced launches:
without that, the inlined bandwidth variants raised the decode loop's peak memory inside whole models by ~2 GiB at
batch 256 and made the Mamba-2 model's bs32 step 2.5x slower. The cause was a read-only input, not the checkpoint:
HF's log-decay reaches the op as a strided view of a state-sized broadcast, and since the launches pass strides as
integers, Inductor gave every launch its own state-sized buffer for it. With contiguous inputs (H200, default mode):
Nemotron-Nano dims bs256 2.97 ms and a 6.04 GiB decode-loop peak inlined vs 3.10 ms / 6.86 GiB opaque; the Mamba-2
model bs32 2.31 ms vs 5.11 opaque, plain torch.compile 2.12.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
from typing import Callable, Iterable

import torch

from ..config import inline_kernels_choice, kernels_choice
from ..kernels.launch import interpreting, traced_launches
from . import mutation_cache

NAMESPACE = "replay_compile"
_LIB = torch.library.Library(NAMESPACE, "DEF")

_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def inline_mode() -> str:
    """``"all"`` (default: every variant inlined), ``"latency"`` (``REPLAY_COMPILE_INLINE_KERNELS=latency``: ops
    inlined where their ``inline`` predicate holds) or ``"off"`` (with ``REPLAY_COMPILE_INLINE_KERNELS=0``,
    ``REPLAY_COMPILE_KERNELS=reference`` or ``TRITON_INTERPRET=1``: the interpreter's kernels cannot be traced). See
    the module docstring."""
    how = inline_kernels_choice()
    if how == "off" or not use_triton() or interpreting():
        return "off"
    return how


def use_triton() -> bool:
    """CUDA tensors go to the Triton kernels unless ``REPLAY_COMPILE_KERNELS=reference``."""
    return kernels_choice() == "triton"


@functools.lru_cache(maxsize=None)
def _kernel_sources_digest() -> str:
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    h = hashlib.sha256()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def inline_cache_tag() -> str:
    """What inlined graphs depend on beyond the graph Inductor's caches key on: whether ops are inlined, our
    kernels' source (their code is traced from behind the op) and every kernel module's ``TUNING`` override.
    The backend adds it to ``torch.compiler.config.cache_key_tag`` while it compiles, so a cached graph is never
    reused across a kernel edit or a tuning / inlining change."""
    parts = [inline_mode(), _kernel_sources_digest()]
    for name, mod in sorted(sys.modules.items()):
        if name.startswith("replay_compile.kernels.") and getattr(mod, "TUNING", None):
            parts.append(f"{name}={sorted(mod.TUNING.items())!r}")
    return "replay_compile-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _exporting() -> bool:
    """torch.export keeps custom ops whole (serializable programs), as it does for ``triton_op``s."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return False
    return custom_triton_ops_decomposition_disabled()


def _all_cuda(args, kwargs) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def compact_inputs(args, mutated):
    """``args`` (a tuple, or a dict of keyword arguments) with every tensor not in ``mutated`` (positions, or
    names) made contiguous; mutated tensors are passed through untouched (the op writes them in place).

    Why, for the traced launches: they pass strides as plain integers, so Inductor must hand each kernel its inputs
    with exactly the traced strides. A read-only input that is a strided view of a state-sized tensor (HF's Mamba-2
    log-decay, taken from an ``[b, H, P, N]`` broadcast) thus became a state-sized buffer per launch (H200: +1.9 GiB
    at bs256, and the Mamba-2 model at bs32 2.5x slower). Contiguous, it is written compactly, once."""
    if isinstance(args, dict):
        return {k: (v.contiguous() if isinstance(v, torch.Tensor) and k not in mutated else v) for k, v in args.items()}
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) and i not in mutated else a for i, a in enumerate(args))


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

    def register_kernel(self, device_type: str, inline: Callable[..., bool] | None = None) -> Callable:
        """Decorator: the implementation for one device type (``"cuda"`` or ``"cpu"``). ``inline`` (CUDA only): ``fn``
        is traced in place of the op under ``torch.compile`` (see the module docstring), everywhere by default, where
        this predicate on the op's arguments holds with ``REPLAY_COMPILE_INLINE_KERNELS=latency``; ``fn`` must then
        be traceable: shapes, strides and dtypes only, no reads of tensor data, every launch through
        :func:`~replay_compile.kernels.launch.launch`."""
        key = _DEVICE_KEYS.get(device_type)
        if key is None:
            raise ValueError(f"replay_op {self.name}: device type {device_type!r} not one of {sorted(_DEVICE_KEYS)}")
        if inline and device_type != "cuda":
            raise ValueError(f"replay_op {self.name}: only CUDA kernels are inlined, not {device_type!r}")

        def deco(fn: Callable) -> Callable:
            _LIB.impl(self.name, self._bumping(fn), key)
            if inline:
                self._register_inline(fn, inline)
            return fn

        return deco

    def _register_inline(self, fn: Callable, where: Callable[..., bool]) -> None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

        mutated = set(self._mutated)
        mutated_names = {self._params[i] for i in mutated}

        def plain(t: type) -> bool:
            return t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor)

        def rule(mode, op, types, args, kwargs):
            # tensor subclasses other than functionalization's and fake tensors keep the opaque op, as triton_op does
            how = inline_mode()
            if how == "off" or not _all_cuda(args, kwargs) or not all(plain(t) for t in types) \
                    or _exporting() or (how == "latency" and not where(*args, **kwargs)):
                return mode.__torch_dispatch__(op, types, args, kwargs)
            mutation_cache.install()         # torch analyses each traced launch: once per kernel and arguments
            with mode, traced_launches():
                return fn(*compact_inputs(args, mutated), **compact_inputs(kwargs, mutated_names))

        torch.library.register_torch_dispatch(f"{NAMESPACE}::{self.name}", FunctionalTensorMode, rule, lib=_LIB)

    def register_fake(self, fn: Callable) -> Callable:
        """Decorator: the shape / dtype function used under FakeTensor (tracing, torch.compile). torch also runs it
        for real meta tensors, which it refuses: a meta tensor has no data for the op to read or write (a fake
        tensor reports the device it stands for, never ``meta``)."""
        params, name = self._params, self.name

        def fake(*args, **kwargs):
            for pname, a in [*zip(params, args), *kwargs.items()]:
                if isinstance(a, torch.Tensor) and a.device.type == "meta":
                    raise ValueError(f"replay_compile.{name}: {pname} is a meta tensor (no data); run the op on real "
                                     "tensors, or trace shapes under FakeTensorMode / torch.compile")
            return fn(*args, **kwargs)

        torch.library.register_fake(f"{NAMESPACE}::{self.name}", fake, lib=_LIB)
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
