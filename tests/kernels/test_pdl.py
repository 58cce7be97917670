"""Programmatic dependent launch (PDL) between the launches of the Mamba-2 ``pre`` step.

With PDL the second launch (the checkpoint pass) starts while the first (the window) still runs: it streams its
checkpoint tile, then waits (``gdc_wait``) before reading the window's outputs. A load placed before the wait that
reads something the window writes would race. On the GPU the step runs at a batch where the two launches overlap
(bs128-256, real geometries), with and without PDL from identical caches, for 2L+3 steps with desynced cursors and
padding rows: every output, the checkpoint and every ring must be bit-identical, and the pass must really have been
launched with PDL (its launch options and ``griddepcontrol.wait`` in its PTX). On CPU: when PDL is switched on.
"""

import pytest
import torch

from replay_compile.kernels import launch as kl
from replay_compile.kernels import mamba2_triton as kt
from replay_compile.kernels.mamba2_triton import replay_step_triton
from replay_compile.state import Mamba2RingSpec

gpu = pytest.mark.gpu


def test_pdl_switches(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kl, "_major", lambda index: 9)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "1")
    assert kl.pdl_on(cuda)
    assert kl.pdl_options(True) == {"launch_pdl": True} and kl.pdl_options(False) == {}
    assert not kl.pdl_on(cuda, wanted=False)                 # the configuration's pdl=0
    assert not kl.pdl_on(torch.device("cpu"))
    with kl.traced_launches():                               # Inductor launches traced kernels itself
        assert not kl.pdl_on(cuda)
    monkeypatch.setattr(kl, "_major", lambda index: 8)       # Ampere has no griddepcontrol
    assert not kl.pdl_on(cuda)
    monkeypatch.setattr(kl, "_major", lambda index: 9)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "0")
    assert not kl.pdl_on(cuda)
    monkeypatch.setenv("REPLAY_COMPILE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not kl.pdl_on(cuda)


def _cursors_and_slots(S, b, L, gen):
    """Desynced cursors (every ring position, including the flush position L-1, at once) and a row -> slot map
    with a permutation and two padding rows."""
    cursor = torch.randint(0, L, (S,), generator=gen, device="cuda", dtype=torch.int32)
    slots = torch.randperm(S, generator=gen, device="cuda")[:b].to(torch.int32)
    slots[3] = -1
    slots[b // 2] = -1
    return cursor, slots


def _run_twice(monkeypatch, make, step, steps, kernels):
    """``make()`` -> (cache tensors, per-step input tuples); runs ``step`` over them with PDL off, then on, from
    clones of the same cache; returns both runs' outputs and final caches."""
    cache, inputs = make()
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("REPLAY_COMPILE_PDL", flag)
        c = [t.clone() for t in cache]
        outs = [step(c, inp).clone() for inp in inputs[:steps]]
        torch.cuda.synchronize()
        k = kernels["kernel"]
        runs.append((outs, c, bool(k.metadata.launch_pdl), "griddepcontrol.wait" in k.asm["ptx"]))
    return runs


def _assert_same(runs):
    (outs0, cache0, pdl0, wait0), (outs1, cache1, pdl1, wait1) = runs
    assert not pdl0 and pdl1 and wait1, "the checkpoint pass was not launched with PDL"
    for t, (a, b) in enumerate(zip(outs0, outs1)):
        assert torch.equal(a, b), f"step {t}: output differs with PDL (max {float((a - b).abs().max())})"
    for i, (a, b) in enumerate(zip(cache0, cache1)):
        assert torch.equal(a, b), f"cache tensor {i} (checkpoint, rings, cursor) differs with PDL"


@gpu
@pytest.mark.parametrize("b, H, P, N, G", [(256, 128, 64, 128, 8), (128, 96, 80, 128, 8)])   # Super, Nano
@pytest.mark.parametrize("spec", ["pre"])
def test_mamba2_pre_pdl_bit_identical(monkeypatch, b, H, P, N, G, spec):
    """A PDL chain of three launches: the count's zeroing -> the window launch, whose flush rows list themselves
    only after their ``gdc_wait`` -> the checkpoint pass."""
    L, S = 16, b + 8
    steps = 2 * L + 3
    gen = torch.Generator("cuda").manual_seed(5)

    def make():
        state = torch.randn((S, H, P, N), generator=gen, device="cuda") * 0.1
        rings = list(Mamba2RingSpec(H, P, N, G, L, torch.bfloat16, torch.bfloat16).allocate(S, "cuda"))
        for r in rings[:-1]:
            r.copy_(torch.randn(r.shape, generator=gen, device="cuda").to(r.dtype) * 0.1)
        rings[2].copy_(-rings[1].float().abs())              # log decays <= 0
        rings[1].abs_()
        cursor, slots = _cursors_and_slots(S, b, L, gen)
        rings[-1].copy_(cursor)
        inputs = []
        for _ in range(steps):
            dt = torch.rand((b, H), generator=gen, device="cuda") * 0.2
            inputs.append((torch.randn((b, H, P), generator=gen, device="cuda").bfloat16(), dt, -dt * 0.5,
                           torch.randn((b, G, N), generator=gen, device="cuda").bfloat16(),
                           torch.randn((b, G, N), generator=gen, device="cuda").bfloat16(), slots))
        return [state, *rings], inputs

    def step(c, inp):
        return replay_step_triton(c[0], *c[1:], *inp)

    with kt.tuned(kt.TUNING, spec):
        _assert_same(_run_twice(monkeypatch, make, step, steps, kt.LAST_LAUNCH))
