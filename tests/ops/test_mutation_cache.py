"""The memoised Triton mutation analysis (ops/mutation_cache.py): one analysis per kernel and argument kinds, torch's
answer unchanged, nothing cached that could differ."""

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from replay_compile.ops import mutation_cache as mc


def _toy(x_ptr, y_ptr, n, FLAG: tl.constexpr):
    offs = tl.arange(0, 16)
    v = tl.load(x_ptr + offs, mask=offs < n)
    if FLAG:
        tl.store(y_ptr + offs, v, mask=offs < n)
    else:
        tl.store(x_ptr + offs, v + 1, mask=offs < n)


def _foreign(x_ptr):
    tl.store(x_ptr, 1.0)


# JITFunctions whatever TRITON_INTERPRET says (the analysis lowers them to TTIR); the toy kernel counts as ours
_toy.__module__ = "replay_compile.toy"
_toy_kernel = JITFunction(_toy)
_foreign_kernel = JITFunction(_foreign)


class _OneConfig:
    """What wrap_triton builds around a kernel launched with num_warps: a new object per launch site."""

    def __init__(self, fn, warps):
        self.fn, self.configs = fn, [f"num_warps: {warps}"]


def _counting():
    calls = []

    def analyse(kernel, kwargs, tma_descriptor_metadata):
        calls.append(dict(kwargs))
        return {"writes": ["y_ptr" if kwargs.get("FLAG") else "x_ptr"]}
    return calls, mc.memoised(analyse)


def _args(n=8, flag=True, dtype=torch.float32):
    return {"x_ptr": torch.empty(16, dtype=dtype), "y_ptr": torch.empty(16, dtype=dtype), "n": n, "FLAG": flag}


def test_one_analysis_per_kernel_and_argument_kinds():
    calls, memo = _counting()
    first = memo(_OneConfig(_toy_kernel, 2), _args(), {})
    again = memo(_OneConfig(_toy_kernel, 2), _args(), {})        # another launch site, same kernel and kinds
    assert first == again == {"writes": ["y_ptr"]} and len(calls) == 1
    first["writes"].append("poisoned")                          # a caller changing its answer changes no other
    again["writes"].append("poisoned")
    assert memo(_OneConfig(_toy_kernel, 2), _args(), {}) == {"writes": ["y_ptr"]} and len(calls) == 1
    memo(_toy_kernel, _args(), {})
    assert len(calls) == 2                                     # the bare JITFunction: another key


def _fake_and_box_args(dtype=torch.float32):
    """The toy kernel's arguments as AOTAutograd traces them (fake tensors) and as Inductor lowers them (TensorBox)."""
    from torch._inductor import ir
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {"x_ptr": torch.empty(16, dtype=dtype), "y_ptr": torch.empty(16, dtype=dtype), "n": 8, "FLAG": True}
    box = lambda name: ir.TensorBox(ir.StorageBox(ir.InputBuffer(  # noqa: E731
        name=name, layout=ir.FixedLayout(torch.device("cpu"), dtype, size=[16]))))
    return fake, {"x_ptr": box("x"), "y_ptr": box("y"), "n": 8, "FLAG": True}


def test_the_lowering_reuses_the_traces_analysis():
    """Torch's TTIR generation treats fake tensors and TensorBoxes alike: one analysis serves both; a real tensor
    or another dtype is still another key."""
    calls, memo = _counting()
    fake, box = _fake_and_box_args()
    assert memo(_toy_kernel, fake, {}) == memo(_toy_kernel, box, {}) and len(calls) == 1
    memo(_toy_kernel, _fake_and_box_args(torch.bfloat16)[1], {})
    memo(_toy_kernel, _args(), {})
    assert len(calls) == 3


@pytest.mark.parametrize("change", [dict(n=9), dict(flag=False), dict(dtype=torch.bfloat16)])
def test_any_other_scalar_constexpr_or_dtype_is_analysed_again(change):
    calls, memo = _counting()
    memo(_toy_kernel, _args(), {})
    memo(_toy_kernel, _args(**change), {})
    memo(_OneConfig(_toy_kernel, 4), _args(), {})               # another launch configuration
    assert len(calls) == 3


def test_foreign_kernels_symbolic_sizes_and_tma_metadata_are_never_cached():
    calls, memo = _counting()
    for _ in range(2):
        memo(_foreign_kernel, {"x_ptr": torch.empty(1)}, {})
        memo(_toy_kernel, dict(_args(), n=object()), {})          # e.g. a SymInt: not a plain value
        memo(_toy_kernel, _args(), {"x_ptr": ("stable", ())})
        memo(_toy_kernel, _args(), tma_descriptor_metadata={})    # a keyword call
    assert len(calls) == 8


_REAL_ANALYSIS = r"""
import json, sys
import torch
import torch._higher_order_ops.triton_kernel_wrap as tkw
from triton.runtime import driver
sys.path.insert(0, sys.argv[1])
import test_mutation_cache as t
from replay_compile.ops import mutation_cache as mc
from replay_compile.testing.standin_driver import StandInDriver

driver.set_active(StandInDriver())
names = mc.install()
assert mc.install() is names
wrapped = getattr(tkw, names[0])
generated = []
real = tkw.generate_ttir
tkw.generate_ttir = lambda *a, **k: generated.append(1) or real(*a, **k)

def writes(result):
    rw = getattr(result, "read_writes", None)
    return sorted(d.name for d in rw.writes) if rw is not None else sorted(result)

out = {}
for flag in (True, False):
    n0 = len(generated)
    a, b = wrapped(t._toy_kernel, t._args(flag=flag), {}), wrapped(t._toy_kernel, t._args(flag=flag), {})
    out[str(flag)] = [writes(a), writes(b), len(generated) - n0,
                      writes(wrapped.__wrapped__(t._toy_kernel, t._args(flag=flag), {}))]
fake, box = t._fake_and_box_args()
real_analysis = wrapped.__wrapped__
out["kinds"] = [writes(real_analysis(t._toy_kernel, fake, {})), writes(real_analysis(t._toy_kernel, box, {}))]
print(json.dumps(out))
"""


def test_install_wraps_torch_and_the_real_analysis_gives_torchs_answer_once():
    """The real analysis (TTIR for a stand-in sm_90 target, no GPU; in a process of its own, since TTIR cannot be
    generated where TRITON_INTERPRET was set at import) through the installed memo: torch's own answer, TTIR
    generated once for two launches."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", _REAL_ANALYSIS, here], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"True": [["y_ptr"], ["y_ptr"], 1, ["y_ptr"]], "False": [["x_ptr"], ["x_ptr"], 1, ["x_ptr"]],
                   "kinds": [["y_ptr"], ["y_ptr"]]}
