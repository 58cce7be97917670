"""GPU-only: the step ops traced into compiled graphs (``register_kernel("cuda", inline=...)``).

Under ``torch.compile`` the CUDA step ops can be traced instead of called: AOTAutograd traces their Triton launches
and Inductor launches the kernels from its generated code (ops/library.py); every variant by default, only the
latency variants with ``REPLAY_COMPILE_INLINE_KERNELS=latency``. Checked here, per op and kernel variant, over 2L + 3
steps with rows flushing at different steps: the compiled function gives the eager op's outputs and leaves the
checkpoint, rings and cursor exactly as the eager op does (same kernels, same arguments); the generated code launches
our kernels, does not call the op and copies nothing; no copy of the checkpoint is made (peak memory); the default
inlines every exact variant, ``latency`` the latency variants only; with ``REPLAY_COMPILE_INLINE_KERNELS=0``, and for
the read-copy ops, the op stays opaque and gives the same results.
"""

import contextlib
import logging
import re

import pytest
import torch

pytestmark = pytest.mark.gpu

from torch._inductor.utils import run_and_get_code  # noqa: E402

from replay_compile.kernels import delta_triton as kd  # noqa: E402
from replay_compile.kernels import mamba2_triton as km  # noqa: E402
from replay_compile.ops import delta, delta_readcopy, mamba2, mamba2_readcopy  # noqa: E402
from replay_compile.state import DeltaRingSpec, Mamba2RingSpec  # noqa: E402
from replay_compile.testing.strategies import DeltaGeometry, Mamba2Geometry, delta_problem, mamba2_problem  # noqa: E402

L = 8
STEPS = 2 * L + 3


@pytest.fixture(autouse=True)
def _no_compile_caches():
    """Cases share graphs (same op and shapes, another TUNING or REPLAY_COMPILE_INLINE_KERNELS): compile each afresh
    (through our backend the cache key carries these, see backend._cache_tagged; here Inductor is called directly)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


# per family: the problem, its seed, the input names (the low-precision ones cast to bf16), the ring spec, where
# the read-copy storage sits among the persistent tensors, the exact and the read-copy step op
_FAMILIES = {
    "mamba2": (mamba2_problem, 3, ("x", "dt", "la", "B", "C"), ("x", "B", "C"),
               lambda g, rc: Mamba2RingSpec(g.H, g.P, g.N, g.G, L, torch.bfloat16, torch.bfloat16, read_copy=rc),
               slice(5, 8), mamba2.mamba2_step, mamba2_readcopy.mamba2_step_rc),
    "delta": (delta_problem, 5, ("q", "k", "v", "g", "beta"), ("q", "k", "v"),
              lambda g, rc: DeltaRingSpec(g.HV, g.Hk, g.K, g.V, L, torch.float32, torch.bfloat16, g.kda,
                                          read_copy=rc),
              slice(6, 9), delta.delta_step, delta_readcopy.delta_step_rc),
}


def _case(geom, read_copy):
    """(persistent tensors on CUDA, per-step inputs, the step function) for a Mamba-2 or delta-rule geometry."""
    problem, seed, keys, low, spec, copy_at, op, op_rc = _FAMILIES[
        "mamba2" if isinstance(geom, Mamba2Geometry) else "delta"]
    state0, seq = problem(geom, STEPS, dtype=torch.float32, seed=seed, decay=(0.8, 1.0))
    persist = (state0.cuda(),) + spec(geom, read_copy).allocate(geom.batch, "cuda")
    if read_copy:
        mamba2_readcopy.encode_copy(read_copy, persist[0], persist[copy_at])
    seq = [tuple(d[k].cuda().to(torch.bfloat16 if k in low else torch.float32) for k in keys) for d in seq]

    def step(p, inp, slots):
        return op_rc(*p, *inp, slots, read_copy) if read_copy else op(*p, *inp, slots)
    return persist, seq, step


CASES = [
    ("mamba2", Mamba2Geometry(2, 8, 64, 128, 2, 2), None, km, "whole"),
    ("mamba2", Mamba2Geometry(3, 16, 64, 128, 2, 2), None, km, "pre"),
    ("mamba2", Mamba2Geometry(3, 16, 64, 128, 2, 2), "fp8_e4m3", None, None),
    ("mamba2", Mamba2Geometry(3, 16, 64, 128, 2, 2), "nvfp4", None, None),
    ("gdn", DeltaGeometry(2, 8, 4, 128, 128, False), None, kd, "fused"),
    ("gdn", DeltaGeometry(3, 8, 4, 128, 128, False), None, kd, "split"),
    ("kda", DeltaGeometry(3, 8, 8, 128, 128, True), None, kd, "split"),
    ("gdn", DeltaGeometry(3, 8, 4, 128, 128, False), "fp8_e4m3", None, None),
]
# The read-copy step ops stay opaque: their kernels take the fp8 / nvfp4 storage through dtype views
# (mamba2_readcopy_triton._copy_args), and a mutation through a view of another dtype is not re-inplaced: traced,
# the step copied the whole read copy out and back every step (measured on the H200).
INLINED = [c for c in CASES if c[2] is None]
OPAQUE = [c for c in CASES if c[2] is not None]


class _AnalysisFallbacks(logging.Handler):
    """Collects the warning torch logs when its analysis of a kernel's TTIR fails and it then treats every argument
    as mutated (it clones what it cannot re-inplace: a state read before a later kernel writes it gets copied)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if "assuming every input is mutated" in record.getMessage():
            self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *a):
        logging.getLogger("torch._dynamo").removeHandler(self)
        return False


def _calls(code: str) -> list[str]:
    """The generated code's lines that are not comments (its graph-fragment comments name every traced node)."""
    return [ln for ln in code.splitlines() if not ln.lstrip().startswith("#")]


def _run(case, compiled: bool):
    _, geom, read_copy, mod, variant = case
    persist, seq, step = _case(geom, read_copy)
    # row r sits out step r (padded): rows flush at different steps
    b = geom.batch
    slot_seq = [torch.tensor([r if t != r else -1 for r in range(b)], dtype=torch.int32, device="cuda")
                for t in range(STEPS)]
    fn = torch.compile(step, backend="inductor", fullgraph=True) if compiled else step
    outs, code = [], []
    ctx = km.tuned(mod.TUNING, variant) if mod is not None else contextlib.nullcontext()
    with ctx:
        for t in range(STEPS):
            if compiled and t == 0:
                y, src = run_and_get_code(fn, persist, seq[t], slot_seq[t])
                code += src
            else:
                y = fn(persist, seq[t], slot_seq[t])
            outs.append(y.clone())
    torch.cuda.synchronize()
    return outs, persist, "\n".join(code)


def _close(a, e, what: str):
    """Same values: fp32 / bf16 within 1e-5 (Inductor compiles the same kernel source), one-byte formats (fp8
    copies, nvfp4 codes) and integers bit for bit."""
    if a.element_size() == 1 or not a.is_floating_point():
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           e.view(torch.uint8) if e.element_size() == 1 else e), what
    else:
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _ids(case):
    return f"{case[0]}-{case[2] or 'exact'}-{case[4] or 'default'}"


@pytest.mark.parametrize("case", INLINED, ids=_ids)
def test_inlined_step_equals_the_eager_op(case, monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", "all")      # every variant, not only the latency ones
    torch._dynamo.reset()
    eager_outs, eager_persist, _ = _run(case, compiled=False)
    with _AnalysisFallbacks() as fallbacks:
        outs, persist, code = _run(case, compiled=True)
    assert not fallbacks.messages, "torch could not analyse a kernel's mutations"
    calls = _calls(code)
    assert not [ln for ln in calls if "triton_kernel_wrapper" in ln]     # lowered, not left as a higher-order op
    assert not [ln for ln in calls if "torch.ops.replay_compile" in ln], "the op was not inlined"
    copies = [ln.strip() for ln in calls if re.search(r"triton_\w*(copy|clone)\w*\.run\(", ln)]
    assert not copies, f"the traced step copies tensors: {copies}"
    for t, (a, e) in enumerate(zip(outs, eager_outs)):
        _close(a, e, f"step {t}")
    for i, (a, e) in enumerate(zip(persist, eager_persist)):
        _close(a, e, f"persistent tensor {i}")


@pytest.mark.parametrize("mode", ["", "latency"], ids=["default", "latency"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5], CASES[6]], ids=_ids)
def test_which_variants_are_inlined(case, mode, monkeypatch):
    """By default every exact variant is inlined; ``latency`` inlines Mamba-2 ``whole`` and delta ``fused`` only."""
    if mode:
        monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", mode)
    else:
        monkeypatch.delenv("REPLAY_COMPILE_INLINE_KERNELS", raising=False)
    torch._dynamo.reset()
    _, _, code = _run(case, compiled=True)
    opaque = bool([ln for ln in _calls(code) if "torch.ops.replay_compile" in ln])
    assert opaque == (mode == "latency" and case[4] not in ("whole", "fused"))


@pytest.mark.parametrize("case", [CASES[1], CASES[6]] + OPAQUE, ids=_ids)
def test_opaque_op_when_inlining_is_off_and_for_read_copies(case, monkeypatch):
    if case[2] is None:
        monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", "0")
    torch._dynamo.reset()
    eager_outs, eager_persist, _ = _run(case, compiled=False)
    outs, persist, code = _run(case, compiled=True)
    assert [ln for ln in _calls(code) if "torch.ops.replay_compile" in ln]
    for i, (a, e) in enumerate(zip(outs + list(persist), eager_outs + list(eager_persist))):
        _close(a, e, f"tensor {i}")


@pytest.mark.parametrize("geom", [
    Mamba2Geometry(64, 64, 64, 128, 8, 8),             # Super-like, 128 MiB fp32 checkpoint
    Mamba2Geometry(64, 96, 80, 128, 8, 8),             # Nemotron-Nano: P = 80, 240 MiB
    DeltaGeometry(64, 32, 16, 128, 128, False),        # Qwen3.5-4B GDN, 128 MiB
    DeltaGeometry(64, 32, 32, 128, 128, True),         # Kimi-Linear KDA
], ids=str)
@pytest.mark.parametrize("strided_decay", [False, True], ids=["", "strided-decay"])
def test_inlined_step_makes_no_copy_of_the_checkpoint(geom, strided_decay, monkeypatch):
    """A large checkpoint (bandwidth variants, inlined on request): the compiled step's peak memory stays far below
    one more checkpoint, and torch analysed every kernel's mutations (a failed analysis clones what it cannot
    re-inplace). HF's log-decay reaches the op as a strided view of a state-sized broadcast; passed to the launches
    as it is, its strides made Inductor allocate a state-sized buffer for it per launch: ~1.9 GiB more at
    Nemotron-Nano dims bs256 with every variant inlined (H200). ``strided_decay`` builds the decay that way inside
    the compiled step."""
    monkeypatch.setenv("REPLAY_COMPILE_INLINE_KERNELS", "all")
    torch._dynamo.reset()
    persist, seq, step0 = _case(geom, None)
    at = 2 if isinstance(geom, Mamba2Geometry) else 3                # la (Mamba-2) or g (GDN / KDA)

    def step(p, inp, slots):
        if strided_decay:
            d = inp[at]                                              # [b, H] or KDA's [b, HV, K]
            n = 4 - d.dim()                                          # state dims it broadcasts over
            big = d.reshape(*d.shape, *(1,) * n) * torch.ones(p[0].shape[-n:], device=d.device)
            inp = (*inp[:at], big[(...,) + (0,) * n], *inp[at + 1:])
        return step0(p, inp, slots)
    fn = torch.compile(step, backend="inductor", fullgraph=True)
    with _AnalysisFallbacks() as fallbacks:
        fn(persist, seq[0], None)
    assert not fallbacks.messages, "torch could not analyse a kernel's mutations"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for t in range(1, L + 1):                                        # includes a flush step
        fn(persist, seq[t], None)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < persist[0].numel() * persist[0].element_size() // 4, f"{extra} bytes beyond the step's inputs"
