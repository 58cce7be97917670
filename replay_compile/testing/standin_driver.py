"""A stand-in Triton driver for lowering kernels to TTIR without a GPU (torch's mutation analysis of traced
launches needs a target): a CUDA sm_90 target, no device. Used by ``benchmarks/diag_inline_cpu.py`` and the tests of
:mod:`replay_compile.ops.mutation_cache`; the process must not have set ``TRITON_INTERPRET`` before importing
Triton (its standard library would then be interpreter functions, which TTIR generation rejects)."""

from __future__ import annotations

import torch


class StandInDriver:
    """Enough of a Triton driver for TTIR: ``triton.runtime.driver.set_active(StandInDriver())``."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, *_):
        return 0
