"""Registers and spill stack of a Triton kernel compiled for a CUDA target on a machine without a GPU.

    python benchmarks/diag_registers.py replay_compile.kernels.delta_split_triton:_delta_apply_kernel \
        --warps 2 --const HAS_SLOT=0 KDA=1 BLOCK_K=128 BLOCK_V=32 BLOCK_L=16 STOCHASTIC_FP16=0 FLUSH_STAGES=4 PDL=0 \
        --ptr cursor_ptr=i32 slot_ptr=i32 wrow_ptr=i32 k_ptr=bf16 v_ptr=bf16 kr_ptr=bf16

Triton's own frontend and the ``ptxas`` bundled with it (no driver needed) build the cubin; ``cuobjdump
-res-usage`` reads it. Pointers default to fp32 and integer arguments to i32. The installed Triton decides the
numbers: triton 3.9 read 255 registers and an 80-byte stack here for a kernel that ncu showed at 161
registers on the H200 (triton 3.6). Use it to compare variants of one kernel, not as the device's figure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def compile_cuda(fn, const: dict, warps: int, ptr_types: dict, arch: int = 90, aligned: bool = False,
                 maxnreg: int = 0, source=None):
    """``fn`` (a ``triton.jit`` or ``gluon.jit`` function) compiled with ``const`` for sm_``arch``: the compiled kernel.

    ``aligned``: every pointer and every non-constant integer argument specialised as divisible by 16, as a launch
    specialises 16-byte aligned tensors and strides (give unit strides as ``const`` ``=1``, as a launch specialises
    them too): without it loads are compiled unvectorised, which a launch on the device does not do. ``maxnreg``: the
    register cap of a launch with that option (0: none). ``source``: the frontend's source class (default Triton's
    ``ASTSource``; Gluon kernels pass ``GluonASTSource``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unknown = set(const) - set(fn.arg_names)
    if unknown:
        raise SystemExit(f"{fn.__name__} has no parameter(s) {sorted(unknown)}")
    sig = {n: "constexpr" if n in const else ("*" + ptr_types.get(n, "fp32")) if n.endswith("_ptr") else "i32"
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in const} if aligned else {}
    return triton.compile((source or ASTSource)(fn, sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})})


def resources(kernel) -> dict:
    """``{"regs", "stack", "shared"}`` of a kernel compiled by :func:`compile_cuda`."""
    usage = _cuobjdump(kernel.asm["cubin"], "-res-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", usage)
    if m is None:
        raise SystemExit(f"cuobjdump printed no resource usage:\n{usage}")
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), shared=int(m.group(3)))


def sass_census(kernel):
    """``(n_instructions, Counter of opcodes)`` of the SASS of a kernel compiled by :func:`compile_cuda` (``BAR``:
    block barriers, one per cross-warp reduction step or layout change; ``LDL`` / ``STL``: spills)."""
    import collections

    sass = _cuobjdump(kernel.asm["cubin"], "-sass")
    ops = collections.Counter()
    n = 0
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            n += 1
            ops[m.group(1)] += 1
    return n, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel",
                    help="module:function, e.g. replay_compile.kernels.delta_triton:_delta_replay_step_kernel")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    ap.add_argument("--const", nargs="*", default=[], metavar="NAME=VALUE", help="constexpr parameters")
    ap.add_argument("--ptr", nargs="*", default=[], metavar="NAME=DTYPE", help="pointer element types (default fp32)")
    ap.add_argument("--aligned", action="store_true",
                    help="pointers and integer arguments divisible by 16, as a launch specialises them (give unit "
                         "strides in --const as NAME=1)")
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap per thread, as the launch option (0: none)")
    ap.add_argument("--census", action="store_true", help="also count the SASS opcodes (barriers, loads, spills)")
    a = ap.parse_args()
    module, _, name = a.kernel.partition(":")
    fn = getattr(importlib.import_module(module), name)
    const = {k: _value(v) for k, _, v in (c.partition("=") for c in a.const)}
    ptrs = dict(p.split("=", 1) for p in a.ptr)
    kernel = compile_cuda(fn, const, a.warps, ptrs, a.arch, a.aligned, a.maxnreg)
    r = resources(kernel)
    print(f"{name} sm_{a.arch} {a.warps} warps: {r['regs']} registers, {r['stack']} B stack, {r['shared']} B shared")
    if a.census:
        n, ops = sass_census(kernel)
        print(f"{n} SASS instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    main()
