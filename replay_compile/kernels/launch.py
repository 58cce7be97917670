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
import threading

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
    """``kernel`` (a ``triton.jit`` function), or its traceable wrapper while tracing."""
    if not tracing():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)
