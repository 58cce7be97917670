"""Kernel launches that Inductor can see: ``launch(kernel)[grid](...)`` at every launch site of our Triton entries.

Eagerly (and inside the opaque op) ``launch(kernel)`` is the kernel itself, so the launch costs what Triton's
launcher costs. While :func:`traced_launches` is active, which :mod:`replay_compile.ops.library` turns on when
AOTAutograd traces one of our ops on CUDA tensors, it is ``torch.library.wrap_triton(kernel)``: the launch becomes a
``triton_kernel_wrapper`` node of the traced graph, Inductor compiles the kernel into its own module and launches it
from the generated wrapper (a few µs per launch), and the op's Python (argument checks, launch configuration, the
dispatcher) runs once at compile time instead of at every decode step. Same kernels, same arguments, same results.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from ..config import env_flag

_STATE = threading.local()


def tracing() -> bool:
    """True inside :func:`traced_launches`."""
    return getattr(_STATE, "on", False)


@contextlib.contextmanager
def traced_launches():
    """Launch sites hand their kernels to ``wrap_triton`` for the duration of the block (nesting allowed)."""
    prev = tracing()
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = prev


def launch(kernel):
    """``kernel`` (a ``triton.jit`` function), or its traceable wrapper while tracing. Under the interpreter (CI),
    a wrapper that checks every launch passes every kernel parameter (:class:`_AllArguments`)."""
    if tracing():
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    if interpreting():
        return _AllArguments(kernel)
    return kernel


class _AllArguments:
    """``kernel[grid](*args, **kwargs)`` that first checks every parameter of ``kernel`` is given. A kernel that
    runs inside a compiled graph is launched through ``wrap_triton``, which does not apply a parameter's default
    (its mutation analysis fails with "Incorrect number of arguments" and Inductor's launcher then misses
    arguments: the GPU inline tests); checked wherever the interpreter runs the launch code, so CPU tests catch
    it."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            names = list(getattr(self.kernel, "arg_names", ()))
            missing = [n for n in names[len(args):] if n not in kwargs]
            if missing:
                raise TypeError(f"replay_compile: {getattr(self.kernel, '__name__', self.kernel)} launched without "
                                f"{missing}: pass every kernel parameter at its launch (wrap_triton, which launches "
                                f"the kernels inlined into compiled graphs, applies no defaults)")
            return self.kernel[grid](*args, **kwargs)
        return run


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (``TRITON_INTERPRET`` set to anything but ``0``): its
    kernels cannot be traced into graphs nor take hardware-only launch options."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_on(device, wanted: bool = True) -> bool:
    """Whether a launch on ``device`` may use programmatic dependent launch (PDL, Hopper and later): the kernel
    after a PDL pair's first launch starts while the first one is still running, issues its loads that depend on
    nothing the first one writes, and waits (``gdc_wait``) before reading what it writes. Off for the interpreter,
    for launches traced by Inductor (kept to the plain launch there), before sm_90, and with
    ``REPLAY_COMPILE_PDL=0``."""
    if not wanted or tracing() or getattr(device, "type", None) != "cuda" or interpreting():
        return False
    if not env_flag("REPLAY_COMPILE_PDL", True):
        return False
    return _major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def reg_options(maxnreg) -> dict:
    """Launch keyword arguments capping a kernel's registers per thread (``maxnreg``; none when not set, and none
    for launches traced by Inductor, which are kept to the plain launch as for :func:`pdl_on`)."""
    return {"maxnreg": int(maxnreg)} if maxnreg and not tracing() else {}


def pdl_options(on: bool) -> dict:
    """Launch keyword arguments for :func:`pdl_on`'s answer (none when off: older Triton has no ``launch_pdl``)."""
    return {"launch_pdl": True} if on else {}
