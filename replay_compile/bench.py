"""``replay-compile bench``: whole decode steps of hybrid models, unmodified vs rewritten, across batch sizes.

Per (model, batch, mode): random-weight model, static cache allocated and prefilled eagerly (so CUDA graphs can own
nothing of it), then decode steps through ``forward`` compiled as the mode says:

* ``eager``                  the model as written
* ``inductor``, ``inductor-ro``     plain ``torch.compile`` (default / ``mode="reduce-overhead"``)
* ``replayssm``, ``replayssm-ro``   ``backend="replayssm"`` (default / ``mode="reduce-overhead"``); a suffix
  ``:<fmt>`` (``replayssm-ro:fp8_e4m3``) adds ``read_copy=<fmt>``

Each decode step is timed with CUDA events on GPUs (wall clock on CPU), the loop synchronising after every step as a
loop that reads each token back does: the step time holds the host's work before the launch. Steps are labelled
flush / non-flush by their position (the cursor is 0 after the prefill, so step ``t`` flushes when ``t % L == L -
1``). Reported: tokens/s, mean step time, flush and non-flush step times, peak memory (of the whole run, and of the
decode loop alone after the first step compiled), time of the first compiled step (compile); on GPUs also ``2 L``
steps queued without synchronisation (``queued ms``: the device's time per step when the host runs ahead, as in a
loop that schedules the next step before the last one ends; ``host ms``: the host's time per call), each beside the
bytes floor (weights, SSM states, records, the filled keys and values at the measured copy bandwidth).
Results go to a CSV, a Markdown table and, with matplotlib, a PNG of the speedup over plain ``torch.compile`` in the
same mode.

Models: real-size configurations with random weights (``nemotron_h_nano4b``, ``qwen35_4b``, ``mamba2_2p7b``;
``--layers`` keeps the first N layers when memory or time forces it, and the table says so) and the tiny test
models of :mod:`replay_compile.testing.hf_models` (``tiny_<family>``) for CPU smoke runs.

Tensor parallelism: ``torchrun --nproc-per-node N -m replay_compile.cli bench --tp N ...`` shards every model with
:func:`replay_compile.tensor_parallel.parallelize_hybrid` (one GPU per rank, NCCL) and times the same modes per rank;
rank 0 writes the results (column ``tp``). Both sides of every ratio run sharded the same way.
"""

from __future__ import annotations

import csv
import math
import os
import re
import statistics
import sys
import time
from typing import Callable

from .config import env_flag

MODES = ("eager", "inductor", "inductor-ro", "replayssm", "replayssm-ro")


def _nemotron_h_nano4b(layers: int | None):
    from transformers import NemotronHConfig
    # Nemotron-Nano-4B-like: 96 Mamba-2 heads x 80, 8 groups, state 128; attention every 7th block, MLP between
    # (the mixer width is heads x head_dim; `expand` is unused and must be an int in transformers 5.17)
    pattern = (["linear_attention", "mlp"] * 3 + ["full_attention", "mlp"]) * 7
    n = layers or len(pattern)
    return NemotronHConfig(
        hidden_size=3072, layers_block_type=pattern[:n], mamba_num_heads=96, mamba_head_dim=80, n_groups=8,
        ssm_state_size=128, conv_kernel=4, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=131072,
        # the eager torch prefill materialises [b, chunk, chunk, heads, state] products: 154 GB at bs256 with the
        # default 128-token chunks (out of memory on an H200), 2.4 GB with 16 (the benchmark's prompt length)
        chunk_size=16), "NemotronHForCausalLM"


def _qwen35_4b(layers: int | None):
    from transformers import Qwen3_5TextConfig
    n = layers or 32
    return Qwen3_5TextConfig(
        hidden_size=2560, num_hidden_layers=n, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (n // 4)
        + ["linear_attention"] * (n % 4), linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=9216, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, vocab_size=248320), "Qwen3_5ForCausalLM"


def _mamba2_2p7b(layers: int | None):
    from transformers import Mamba2Config
    return Mamba2Config(hidden_size=2560, num_hidden_layers=layers or 64, num_heads=80, head_dim=64, n_groups=1,
                        state_size=128, expand=2, vocab_size=50288,
                        chunk_size=16), "Mamba2ForCausalLM"     # the eager prefill's chunk products: see Nemotron


REAL: dict[str, Callable] = {"nemotron_h_nano4b": _nemotron_h_nano4b, "qwen35_4b": _qwen35_4b,
                             "mamba2_2p7b": _mamba2_2p7b}


def tp_setup(tp: int, device: str):
    """Join the process group torchrun set up; returns ``(mesh, rank, device)`` (the rank's own GPU on CUDA)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp or "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"replay-compile bench --tp {tp}: run it under torchrun --nproc-per-node {tp} "
                         f"-m replay_compile.cli bench ... (found WORLD_SIZE={world})")
    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return init_device_mesh("cuda" if cuda else "cpu", (tp,)), dist.get_rank(), device


def _setup(tp: int, device: str, dtype_name: str, out_dir: str):
    """``(mesh, rank, device, dtype)`` for a run: joins the tensor-parallel group when ``tp > 1``; makes ``out_dir``."""
    import torch

    mesh, rank = None, 0
    if tp > 1:
        mesh, rank, device = tp_setup(tp, device)
    os.makedirs(out_dir, exist_ok=True)
    return mesh, rank, device, getattr(torch, dtype_name)


def build_model(name: str, dtype, device, layers: int | None = None, seed: int = 0, mesh=None):
    """The named model on ``device``; with a tensor-parallel ``mesh``, sharded over it (every rank builds the same
    weights from ``seed`` first)."""
    model = _build_model(name, dtype, device, layers, seed)
    if mesh is not None:
        from .tensor_parallel import parallelize_hybrid
        parallelize_hybrid(model, mesh)
    return model


def _build_model(name: str, dtype, device, layers: int | None = None, seed: int = 0):
    import torch
    import transformers

    if name.startswith("tiny_"):
        from .testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY
        fam = name[len("tiny_"):]
        builders = {**MAMBA2_FAMILY, **DELTA_FAMILY}
        if fam not in builders:
            raise SystemExit(f"replay-compile bench: unknown model {name!r}")
        return builders[fam](dtype=dtype, seed=seed).to(device)
    if name not in REAL:
        raise SystemExit(f"replay-compile bench: unknown model {name!r}; choose from {sorted(REAL)} or tiny_<family>")
    cfg, cls = REAL[name](layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(transformers, cls)(cfg).to(dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


class _Timer:
    def __init__(self, device):
        import torch
        self.cuda = str(device).startswith("cuda")
        self.torch = torch

    def __call__(self, fn):
        """(result, seconds) of ``fn()``."""
        t = self.torch
        if self.cuda:
            a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            t.cuda.synchronize()
            return out, a.elapsed_time(b) * 1e-3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def split_mode(mode: str) -> tuple[str, str, dict]:
    """``"replayssm-ro:fp8_e4m3@combo_kernels=1"`` -> ``("replayssm-ro", "fp8_e4m3", {"combo_kernels": True})``: the
    mode, its read copy and Inductor config patches (``@key=value,key=value``; 1 / 0 / true / false are booleans,
    other digits integers) applied to that mode's compile only, for either backend (e.g. ``inductor@combo_kernels=1``
    beside ``replayssm@combo_kernels=1`` to see a patch on both sides)."""
    mode, _, patch_text = mode.partition("@")
    mode, _, read_copy = mode.partition(":")
    patches: dict = {}
    for item in filter(None, patch_text.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"replay-compile bench: Inductor patch {item!r} in mode {mode!r} is not key=value")
        low = val.strip().lower()
        patches[key.strip()] = (low in ("1", "true") if low in ("0", "1", "true", "false")
                                else int(low) if low.lstrip("-").isdigit() else val)
    return mode, read_copy, patches


def _forward_for(model, mode: str, L: int):
    import torch
    if mode == "eager":
        return model.forward
    mode, read_copy, patches = split_mode(mode)
    backend = "replayssm" if mode.startswith("replayssm") else "inductor"
    kw = {"mode": "reduce-overhead"} if mode.endswith("-ro") else {}
    # CPU graphs too: the benchmark measures the rewrite wherever it runs (on CPU it is slower: config.DEFAULT_DEVICES)
    options = {"buffer_len": L, "devices": ("cpu", "cuda")} if backend == "replayssm" else None
    if read_copy:
        options["read_copy"] = read_copy
    if options is not None and kw:
        options["mode"] = kw.pop("mode")
    if patches:
        if kw:                               # torch.compile takes mode or options, not both: spell the mode out
            patches = {**torch._inductor.list_mode_options(kw.pop("mode")), **patches}
        options = {**(options or {}), **patches}
    return torch.compile(model.forward, backend=backend, options=options, **kw)


def cache_kwarg(model) -> str:
    """The forward's cache argument (see :func:`~replay_compile.integrations.hf_modules.cache_kwarg`)."""
    from .integrations.hf_modules import cache_kwarg as lookup

    name = lookup(model)
    if name is None:
        raise SystemExit(f"replay-compile bench: {type(model).__name__}.forward takes no cache argument")
    return name


def _median_launch_seconds(fn, *args, warmup: int = 3, repeats: int = 10) -> float:
    """Median time of one ``fn(*args)`` on the current GPU: plain launches (no graph) timed with events, after
    ``warmup`` untimed calls that bring the clocks up."""
    import torch

    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second): best of several sizes, plain launches
    timed with events (no graph), after the clocks were warmed up."""
    import torch

    best = 0.0
    for gib in (0.5, 1, 2):
        n = int(gib * 2**30) // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        best = max(best, 2 * n * 4 / _median_launch_seconds(y.copy_, x))
        del x, y
    return best


def matmul_peak(dtype) -> float:
    """Dense matrix-multiply throughput (flop/s) of ``dtype`` on the current GPU: the best of a few large square
    products, plain launches timed with events. The compute side of :func:`roofline_floor_ms`."""
    import torch

    best = 0.0
    for n in (4096, 8192):
        x = torch.randn(n, n, device="cuda", dtype=dtype)
        y = torch.randn(n, n, device="cuda", dtype=dtype)
        best = max(best, 2 * n**3 / _median_launch_seconds(torch.matmul, x, y))
        del x, y
    return best


def step_gemm_terms(model, batch: int) -> list[tuple[int, int]]:
    """``(bytes, flops)`` of every matrix a one-token decode step of ``batch`` rows multiplies by: each
    ``nn.Linear`` weight (the language-model head included), read once and applied to ``batch`` rows. Their bytes
    are part of :func:`step_floor_bytes`' weights."""
    import torch

    return [(m.weight.numel() * m.weight.element_size(), 2 * batch * m.weight.numel())
            for m in model.modules() if isinstance(m, torch.nn.Linear)]


def roofline_floor_ms(floor_bytes: int, gemm_terms, bandwidth: float, peak: float) -> float:
    """The step's floor with its matrix products' compute counted: every byte of ``floor_bytes`` at ``bandwidth``,
    except that a product whose ``flops / peak`` exceeds its weight's ``bytes / bandwidth`` takes the longer. At
    batch 256 a bf16 product does ~256 flops per weight byte, near a Hopper GPU's ridge point, so there the bytes
    floor alone undercounts it."""
    extra = sum(max(0.0, f / peak - b / bandwidth) for b, f in gemm_terms)
    return (floor_bytes / bandwidth + extra) * 1e3


def fill_context(cache, start: int, context: int, seed: int = 0) -> None:
    """Positions ``[start, context)`` of every static attention layer of ``cache`` hold random keys and values with
    the spread of the prefilled ones, and the layers write their next keys at ``context``: as far as a decode step's
    cost goes, what a ``context``-token prompt leaves (a step reads those positions whatever they hold; SSM layers
    cost the same at any context). An eager prefill of ``context`` tokens at batch 256 would not fit the GPU:
    transformers' PyTorch chunk scan materialises [b, chunks, chunk, chunk, heads, state] products."""
    import torch

    from .integrations.hf_modules import attention_layers, write_at

    gen = torch.Generator(device="cpu").manual_seed(seed)
    for layer in attention_layers(cache):
        for t in (layer.keys, layer.values):
            spread = float(t[:, :, :start].float().std()) if start > 1 else 1.0
            noise = torch.randn(t[:, :, start:context].shape, generator=gen, dtype=torch.float32)
            t[:, :, start:context].copy_(noise.mul_(spread))
        write_at(layer, context)


def step_floor_bytes(model, cache, batch: int, filled: int) -> dict:
    """Bytes a decode step must move: the weights once (of the input embedding only the ``batch`` rows it gathers,
    unless the language-model head shares it), every SSM state read once (what a replay step reads; the exact step
    also writes it), conv states read and written, each attention layer's ``filled`` keys and values read once.
    Per-token records and activations are left out (under 1% of the total at these sizes)."""
    import torch

    from .integrations.hf_modules import attention_layers

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        weights -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    attn = attention_layers(cache)
    kv = sum(batch * t.shape[1] * filled * t.shape[3] * t.element_size() for layer in attn
             for t in (layer.keys, layer.values))
    ssm = conv = 0
    seen = {id(t) for layer in attn for t in (layer.keys, layer.values)}
    for layer in getattr(cache, "layers", []):
        for name, val in vars(layer).items():
            items = val.values() if isinstance(val, dict) else val if isinstance(val, (list, tuple)) else [val]
            for t in items:
                if not isinstance(t, torch.Tensor) or id(t) in seen or t.dim() < 3 or t.shape[0] != batch:
                    continue
                seen.add(id(t))
                if "conv" in name:
                    conv += 2 * t.numel() * t.element_size()
                else:
                    ssm += t.numel() * t.element_size()
    return dict(weights=weights, ssm=ssm, conv=conv, kv=kv, total=weights + ssm + conv + kv)


# device-kernel name fragments -> what a decode step spends the time on (first match wins; Inductor names its
# fused kernels after the ops they hold, `triton_poi_fused_clone_expand_...` for repeat_kv's copy)
PROFILE_CATEGORIES = (
    ("attention", ("decode_attention", "flash", "fmha", "attention", "sdpa")),
    ("KV expand copy", ("expand", "clone", "repeat")),
    ("SSM step", ("mamba", "delta", "replay", "readcopy", "selective", "spec_", "cursor", "zero_count",
                  "fused_recurrent", "chunk_gated", "fold", "flush", "nvfp4")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk", "_mm_")),
    ("copy / memset", ("copy", "memcpy", "memset", "catarray", "fill")),
    ("conv", ("conv",)),
    ("norms, gates, other fused", ("triton_",)),
)


# the words of Inductor's fused-kernel names that move data without arithmetic: a kernel made of these alone, with an
# expand or repeat among them, is a layout copy (transformers' repeat_kv); one that also computes is not
_LAYOUT_WORDS = frozenset({"clone", "expand", "repeat", "interleave", "view", "unsafe", "unsqueeze", "squeeze",
                           "reshape", "permute", "transpose", "slice", "select", "copy", "cat", "split", "with",
                           "sizes", "alias", "t"})


def kernel_category(name: str) -> str:
    low = name.lower().replace("_to_copy", "")           # Inductor's name for a dtype cast, not a copy
    fused = re.fullmatch(r"triton_(?:poi|per|red)_fused_(.*?)(?:_\d+)?", low)
    for cat, parts in PROFILE_CATEGORIES:
        if cat == "KV expand copy" and fused:
            words = set(filter(None, fused.group(1).split("_")))
            if words <= _LAYOUT_WORDS and words & {"expand", "repeat"}:
                return cat
            continue
        if any(p in low for p in parts):
            return cat
    return "other"


PROFILE_STEPS = 8


def profile_steps(step: Callable, steps: int = PROFILE_STEPS, kernels: dict | None = None) -> dict:
    """Device milliseconds per step by :data:`PROFILE_CATEGORIES` over ``steps`` calls of ``step`` (torch.profiler,
    CUDA activity; the step must already be warm). ``kernels``: filled with ``name -> (ms per step, launches per
    step)`` for every kernel, which tells a step bound by many small launches from one bound by a slow kernel."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    launches: dict = {}
    times = kernel_times(prof, launches)
    if kernels is not None:
        kernels.update({name: (t / steps, launches[name] / steps) for name, t in times.items()})
    return {cat: t / steps for cat, t in by_category(times).items()}


def kernel_times(prof, launches: dict | None = None) -> dict[str, float]:
    """Device milliseconds per kernel name over a finished ``torch.profiler`` run (its CUDA events); ``launches``:
    filled with the number of launches per name."""
    import torch

    out: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None)
            t = e.cuda_time_total if t is None else t
            out[e.name] = out.get(e.name, 0.0) + t / 1e3
            if launches is not None:
                launches[e.name] = launches.get(e.name, 0) + 1
    return out


def by_category(times: dict[str, float]) -> dict[str, float]:
    """Kernel times summed by :func:`kernel_category`."""
    out: dict = {}
    for name, t in times.items():
        cat = kernel_category(name)
        out[cat] = out.get(cat, 0.0) + t
    return out


WARM_STEPS = 3          # steps left out of the statistics: compile, CUDA-graph warm-up, CUDA-graph recording


def queued_steps(step: Callable, steps: int) -> tuple[float, float]:
    """``step()`` ``steps`` times with no synchronisation between them (each step's token argmaxed on the device
    feeds the next): (device seconds per step, host seconds per call). The timed loop synchronises after every step,
    so its step time holds the host's work before the launch (Dynamo's guards, the CUDA-graph launch), as a loop
    that reads each token back pays it; here the host runs ahead of the device, as in a loop that schedules the
    next step before the last one ends, and the step time is the device's alone unless the host is slower."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = time.perf_counter() - t0
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e-3 / steps, host / steps


def bench_one(model, batch: int, mode: str, steps: int, L: int, prompt_len: int = 16, seed: int = 0,
              cache_len: int | None = None, context: int = 0, profile: bool = False, queued: int = 0) -> dict:
    """Decode ``steps`` tokens after an eager prefill; per-step times. The first compiled step is the compile.
    ``context``: decode from position ``context``, the positions after the prompt filled by :func:`fill_context`.
    ``cache_len``: the static cache's positions (default: just enough); a longer one holds unfilled positions,
    which transformers' SDPA reads and the decode-attention rewrite skips. ``profile`` (CUDA): also the device time
    per step by category (:func:`profile_steps`), as ``profile`` in the result. ``queued`` (CUDA): then that many
    steps with no synchronisation between them (:func:`queued_steps`), as ``queued_ms`` and ``host_ms``."""
    import torch
    from transformers import StaticCache

    from . import backend as rb
    from . import state as rs

    device = next(model.parameters()).device
    torch._dynamo.reset()
    rb.clear_reports()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    start = max(context, prompt_len)
    need = start + steps + 2 + (PROFILE_STEPS if profile else 0) + queued
    if cache_len is not None and cache_len < need:
        raise SystemExit(f"replay-compile bench: a cache of {cache_len} positions is too short for a "
                         f"{prompt_len}-token prompt and {steps} steps ({need})")
    cache = StaticCache(config=model.config, max_cache_len=cache_len or need)
    timer = _Timer(device)
    if timer.cuda:
        torch.cuda.reset_peak_memory_stats()
    forward = _forward_for(model, mode, L)
    ck = cache_kwarg(model)
    times = []
    steady, compile_peak = float("nan"), 0
    with torch.no_grad():
        out = model(ids, use_cache=True, cache_position=torch.arange(prompt_len, device=device), **{ck: cache})
        if start > prompt_len:
            fill_context(cache, prompt_len, start, seed)
        floor = step_floor_bytes(model, cache, batch, start + 1)
        if mode.startswith("replayssm"):
            rs.protect(cache)                # what generate does after its prefill
        tok = out.logits[:, -1:].argmax(-1)
        for t in range(steps + 1):
            pos = torch.tensor([start + t], device=device)
            out, dt = timer(lambda: forward(tok, use_cache=True, cache_position=pos, **{ck: cache}))
            tok = out.logits[:, -1:].argmax(-1)
            times.append(dt)
            if t == 0 and timer.cuda:                # from here on: the steady decode loop, without compilation
                compile_peak = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        if timer.cuda:
            steady = torch.cuda.max_memory_allocated() / 2**30
        breakdown, kernels = {}, {}
        # the positions of the steps after the timed ones, made beforehand: a queued loop must not wait on a copy
        positions = iter([torch.tensor([p], device=device) for p in range(start + steps + 1, need)])

        def one():
            nonlocal tok
            out = forward(tok, use_cache=True, cache_position=next(positions), **{ck: cache})
            tok = out.logits[:, -1:].argmax(-1)
        queued_ms = host_ms = float("nan")
        if queued and timer.cuda:
            queued_s, host_s = queued_steps(one, queued)
            queued_ms, host_ms = queued_s * 1e3, host_s * 1e3
        if profile and timer.cuda:
            breakdown = profile_steps(one, PROFILE_STEPS, kernels)
        rs.flush(cache)
    # step 0 compiles (or warms up eager); under mode="reduce-overhead" CUDA-graph trees run step 1 as a warm-up and
    # record the graph in step 2: none of them is a decode step a server would see (with them in, the mean of a
    # 32-step run at batch 1 moved by up to 30% with the recording's host cost)
    first, skip = times[0], min(WARM_STEPS, max(1, len(times) - 1))
    rest = times[skip:]
    flush = [x for t, x in enumerate(times) if t >= skip and t % L == L - 1]
    nonflush = [x for t, x in enumerate(times) if t >= skip and t % L != L - 1]
    mean = statistics.mean(rest)
    rewrites = sum(len(r.rewrites) for r in rb.reports())
    return dict(batch=batch, mode=mode, steps=steps, step_ms=mean * 1e3,
                median_step_ms=statistics.median(rest) * 1e3,
                nonflush_ms=statistics.mean(nonflush) * 1e3 if nonflush else float("nan"),
                flush_ms=statistics.mean(flush) * 1e3 if flush and mode.startswith("replayssm") else float("nan"),
                tokens_per_s=batch / mean, first_step_s=first,
                peak_mem_gib=max(compile_peak / 2**30, steady) if timer.cuda else float("nan"),
                steady_mem_gib=steady,
                queued_ms=queued_ms, host_ms=host_ms,
                rewrites=rewrites, context=start, floor_bytes=floor["total"], gemm_terms=step_gemm_terms(model, batch),
                profile=breakdown, kernels=kernels)


def parity(model, batch: int, steps: int, L: int, mode: str = "replayssm-ro", prompt_len: int = 16,
           seed: int = 0) -> dict:
    """Greedy decode of ``steps`` tokens, eager and ``mode`` in lockstep on two caches, both fed eager's tokens
    (teacher forcing: one disagreement cannot cascade, every step is compared). Returns the fraction of steps whose
    argmax tokens agree on every row, the first step that disagreed (-1: none), and the largest logit difference,
    absolute and relative to the largest eager logit."""
    import torch
    from transformers import StaticCache

    from . import backend as rb
    from . import state as rs

    device = next(model.parameters()).device
    torch._dynamo.reset()
    rb.clear_reports()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    ck = cache_kwarg(model)
    caches = [StaticCache(config=model.config, max_cache_len=prompt_len + steps + 2) for _ in range(2)]
    forwards = [model.forward, _forward_for(model, mode, L)]
    agree, first_bad, max_abs, max_ref = 0, -1, 0.0, 0.0
    with torch.no_grad():
        outs = [model(ids, use_cache=True, cache_position=torch.arange(prompt_len, device=device), **{ck: c})
                for c in caches]
        if mode.startswith("replayssm"):
            rs.protect(caches[1])
        tok = outs[0].logits[:, -1:].argmax(-1)
        for t in range(steps):
            pos = torch.tensor([prompt_len + t], device=device)
            la, lb = (f(tok, use_cache=True, cache_position=pos, **{ck: c}).logits[:, -1].float()
                      for f, c in zip(forwards, caches))
            same = bool((la.argmax(-1) == lb.argmax(-1)).all())
            agree += same
            if not same and first_bad < 0:
                first_bad = t
            max_abs = max(max_abs, float((la - lb).abs().max()))
            max_ref = max(max_ref, float(la.abs().max()))
            tok = la.argmax(-1, keepdim=True)
        rs.flush(caches[1])
    return dict(batch=batch, mode=mode, steps=steps, tokens_agree=agree / steps, first_mismatch=first_bad,
                max_logit_diff=max_abs, rel_logit_diff=max_abs / max(max_ref, 1e-30),
                rewrites=sum(len(r.rewrites) for r in rb.reports()))


def run_parity(models, batch, steps, L, device, dtype_name, layers, out_dir, mode="replayssm-ro",
               tp: int = 1) -> list[dict]:
    """:func:`parity` for each model; writes ``parity.csv`` and prints one line per model (rank 0 under ``tp``)."""
    mesh, rank, device, dtype = _setup(tp, device, dtype_name, out_dir)
    rows = []
    for name in models:
        model = build_model(name, dtype, device, layers, mesh=mesh)
        r = dict(model=name, layers=getattr(model.config, "num_hidden_layers", None), dtype=dtype_name, L=L, tp=tp,
                 **parity(model, batch, steps, L, mode))
        rows.append(r)
        del model
        if rank:
            continue
        print(f"parity {name} ({r['layers']} layers, {dtype_name}) bs={batch} {mode}: {steps} greedy steps, tokens "
              f"agree on {100 * r['tokens_agree']:.1f}% (first mismatch {r['first_mismatch']}), max logit diff "
              f"{r['max_logit_diff']:.2e} ({r['rel_logit_diff']:.1e} of the largest logit), "
              f"{r['rewrites']} layers rewritten",
              flush=True)
    _tp_teardown(tp)
    if rank:
        return rows
    with open(os.path.join(out_dir, f"parity_{dtype_name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


class _Progress:
    """A tqdm bar on stderr (tqdm comes with transformers), or one line per point without it."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="point", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def next(self, what: str) -> None:
        if self.done and self.bar is not None:
            self.bar.update(1)
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(what)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {what} ...", file=sys.stderr, flush=True)

    def note(self, line: str) -> None:
        """A line on stderr above the bar (without one, printed as it is)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        elif self.enabled:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.close()


def round_orders(modes: list[str], rounds: int) -> list[list[str]]:
    """The order modes run in, per round: as given, then reversed, and so on (A B, B A, A B, ...), so a drift of
    the machine over the run (host clocks, other load: host-bound steps moved 2x between machines) weighs on every
    mode alike instead of on whichever runs last."""
    return [list(modes) if r % 2 == 0 else list(reversed(modes)) for r in range(rounds)]


def _floor_ratios(row: dict) -> None:
    """A row's step times against its floors, where it has them: ``pct_floor`` and ``queued_pct_floor`` (the bytes
    floor over the step), ``queued_x_roofline`` (the queued step over the roofline floor)."""
    if "floor_ms" in row:
        row["pct_floor"] = 100 * row["floor_ms"] / row["step_ms"]
        row["queued_pct_floor"] = 100 * row["floor_ms"] / row["queued_ms"]
    if "roofline_floor_ms" in row:
        row["queued_x_roofline"] = row["queued_ms"] / row["roofline_floor_ms"]


def merge_rounds(runs: list[dict]) -> dict:
    """One row from ``bench_one`` rows of the same mode in several rounds: times and throughput averaged over the
    rounds, compile time from the first (later rounds hit the compile caches), peaks the largest."""
    if len(runs) == 1:
        return dict(runs[0], rounds=1)
    out = dict(runs[0])
    for key in ("step_ms", "median_step_ms", "nonflush_ms", "flush_ms", "queued_ms", "host_ms"):
        if key in out:
            out[key] = statistics.mean(r[key] for r in runs)
    out["tokens_per_s"] = out["batch"] / (out["step_ms"] * 1e-3)
    _floor_ratios(out)                                     # rows read back from CSVs carry their floors
    for key in ("peak_mem_gib", "steady_mem_gib"):
        out[key] = max(r[key] for r in runs)
    out["rounds"] = len(runs)
    return out


def run(models, batches, modes, steps, L, device, dtype_name, layers, out_dir, progress=True, tp: int = 1,
        rounds: int = 1, context: int = 0, profile: bool = False) -> list[dict]:
    """Every (model, batch, mode) point; rows written as they come. Under ``tp`` > 1 (torchrun), every rank runs
    every point on its shard and rank 0 writes (its own timings: the ranks meet at every all-reduce anyway).
    ``rounds`` > 1: each (model, batch) runs its modes that many times in alternating order (:func:`round_orders`)
    and reports their mean (:func:`merge_rounds`)."""
    import torch

    mesh, rank, device, dtype = _setup(tp, device, dtype_name, out_dir)
    cuda = str(device).startswith("cuda")
    bandwidth = copy_bandwidth() if cuda else float("nan")        # the floor's bytes/s
    peak = matmul_peak(dtype) if cuda else float("nan")            # and its matrix products' flop/s
    rows = []
    total = len(models) * len(batches) * len(modes) * rounds
    bar = _Progress(total, progress and rank == 0)
    for name in models:
        model = build_model(name, dtype, device, layers, mesh=mesh)
        n_layers = getattr(model.config, "num_hidden_layers", None)
        for bs in batches:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for order in round_orders(modes, rounds):
                for mode in order:
                    bar.next(f"{name} bs={bs} {mode}")
                    try:
                        runs[mode].append(bench_one(model, bs, mode, steps, L, context=context, profile=profile,
                                                    queued=2 * L))
                        r = runs[mode][-1]                  # a run cut short still shows what it measured
                        bar.note(f"  {name} bs={bs} {mode}: {r['step_ms']:.3f} ms/step (flush {r['flush_ms']:.3f}), "
                                 f"first step {r['first_step_s']:.1f} s")
                        if env_flag("REPLAY_COMPILE_BENCH_COMPILE_TIMES", False):   # where compile time went
                            print(f"compile times, {name} bs={bs} {mode}:\n{torch._dynamo.utils.compile_times()}",
                                  file=sys.stderr)
                    except torch.cuda.OutOfMemoryError:
                        if tp > 1:      # the other ranks would wait for this one at the next all-reduce
                            raise
                        torch.cuda.empty_cache()
                        print(f"  {name} bs={bs} {mode}: out of memory, skipped", file=sys.stderr)
            for mode in modes:
                if runs[mode]:
                    row = merge_rounds(runs[mode])
                    row["floor_ms"] = row["floor_bytes"] / bandwidth * 1e3
                    row["roofline_floor_ms"] = roofline_floor_ms(row["floor_bytes"], row.pop("gemm_terms"),
                                                                 bandwidth, peak)
                    _floor_ratios(row)
                    rows.append(dict(model=name, layers=n_layers, dtype=dtype_name, L=L, tp=tp, **row))
            if rank == 0:
                _write(rows, out_dir, quiet=True)          # a run cut short still leaves its rows
        del model
    bar.close()
    if rank == 0:
        _write(rows, out_dir)
    _tp_teardown(tp)
    return rows


def _tp_teardown(tp: int) -> None:
    """Leave the process group cleanly (without it, NCCL's teardown at exit kept torchrun waiting)."""
    if tp > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _speedups(rows):
    def plain(mode):                                   # replayssm-ro:fp8_e4m3@combo_kernels=1 -> inductor-ro
        return split_mode(mode)[0].replace("replayssm", "inductor")
    # the baseline is plain torch.compile as shipped: an inductor mode with patches is a row, never the baseline
    base = {(r["model"], r["batch"], plain(r["mode"])): r for r in rows
            if r["mode"].startswith("inductor") and "@" not in r["mode"]}
    for r in rows:
        ref = base.get((r["model"], r["batch"], plain(r["mode"])))
        ours = ref is not None and r["mode"].startswith("replayssm")
        r["speedup_vs_compile"] = ref["step_ms"] / r["step_ms"] if ours else float("nan")
        # first step (compile + one step) relative to plain torch.compile's; comparable only where both compiled
        # cold (bench --cold-compile): in one process the mode that compiles first warms the caches for the other
        r["first_step_vs_compile"] = (r["first_step_s"] / ref["first_step_s"]
                                      if ours and "first_step_s" in r and "first_step_s" in ref else float("nan"))


def run_banner() -> str:
    """What a results table depends on beyond its rows: versions, the GPU, and the switches that change which
    kernels run (inlining into compiled graphs, programmatic dependent launch)."""
    import torch

    from .ops.library import inline_mode

    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"torch {torch.__version__}, triton {tv}, {gpu}; inline kernels: {inline_mode()}; "
            f"PDL: {os.environ.get('REPLAY_COMPILE_PDL', '1')}; transformers' kernel packages: {kernel_packages()}")


def kernel_packages() -> str:
    """The packages transformers routes its SSM mixers to when they import (fla for Gated DeltaNet / KDA, mamba_ssm
    and causal_conv1d for Mamba-2, each function falling back to transformers' PyTorch code on its own): with them
    the ``eager`` and ``inductor*`` rows run transformers' kernel path, without them its PyTorch path."""
    import importlib

    found = []
    for name in ("fla", "mamba_ssm", "causal_conv1d"):
        try:
            mod = importlib.import_module(name)
        except Exception:                      # a missing package or a compiled extension that does not load
            continue
        found.append(f"{name} {getattr(mod, '__version__', '?')}")
    return ", ".join(found) or "none"


PROFILE_KERNEL_COLUMNS = ("model", "batch", "context", "mode", "kernel", "category", "ms_per_step",
                          "launches_per_step")


def _write_profile(rows, out_dir, quiet: bool) -> None:
    """``profile.csv`` and a table: device ms per step by category, per (model, batch, mode); and
    ``profile_kernels.csv``: every kernel's ms and launches per step, costliest first per (model, batch, mode)."""
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return
    ranked = [sorted(r.get("kernels", {}).items(), key=lambda kv: -kv[1][0]) for r in prof]     # costliest first
    with open(os.path.join(out_dir, "profile_kernels.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PROFILE_KERNEL_COLUMNS)
        for r, kernels in zip(prof, ranked):
            for name, (ms, n) in kernels:
                w.writerow([r["model"], r["batch"], r.get("context"), r["mode"], name, kernel_category(name), ms, n])
    cats = [c for c, _ in PROFILE_CATEGORIES] + ["other"]
    cats = [c for c in cats if any(c in r["profile"] for r in prof)]
    with open(os.path.join(out_dir, "profile.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "batch", "context", "mode", "step_ms", "device_ms"] + cats)
        for r in prof:
            w.writerow([r["model"], r["batch"], r.get("context"), r["mode"], r["step_ms"],
                        sum(r["profile"].values())] + [r["profile"].get(c, 0.0) for c in cats])
    if quiet:
        return
    print("device ms per step by category (torch.profiler):")
    print(f"{'model':22} {'bs':>4} {'mode':14} {'device':>8} " + " ".join(f"{c[:14]:>14}" for c in cats))
    for r in prof:
        print(f"{r['model'][:22]:22} {r['batch']:4d} {r['mode'][:14]:14} {sum(r['profile'].values()):8.3f} "
              + " ".join(f"{r['profile'].get(c, 0.0):14.3f}" for c in cats))
    for r, kernels in zip(prof, ranked):
        if kernels:
            print(f"costliest kernels, {r['model']} bs{r['batch']} {r['mode']} (ms / launches per step):")
            for name, (ms, n) in kernels[:8]:
                print(f"  {ms:8.3f} {n:6.1f}  {name[:100]}")


def _write(rows, out_dir, quiet=False):
    if not rows:
        return
    _speedups(rows)
    _write_profile(rows, out_dir, quiet)
    with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k not in ("profile", "kernels")],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    nan = float("nan")
    lines = ["| model (layers, TP) | batch | context | mode | step ms | floor ms | % of floor | queued ms | "
             "queued % of floor | roofline floor ms | queued x roofline | host ms | non-flush ms | "
             "flush ms | tokens/s | first step s | peak GiB | decode-loop peak GiB | rewrites | "
             "speedup vs torch.compile | first step vs torch.compile |",
             "|" + " --- |" * 21]
    for r in rows:
        lines.append(f"| {r['model']} ({r['layers']}, {r.get('tp', 1)}) | {r['batch']} | {r.get('context', '')} | "
                     f"{r['mode']} | {r['step_ms']:.3f} | {r.get('floor_ms', nan):.3f} | "
                     f"{r.get('pct_floor', nan):.0f} | {r.get('queued_ms', nan):.3f} | "
                     f"{r.get('queued_pct_floor', nan):.0f} | {r.get('roofline_floor_ms', nan):.3f} | "
                     f"{r.get('queued_x_roofline', nan):.2f} | {r.get('host_ms', nan):.3f} | "
                     f"{r['nonflush_ms']:.3f} | {r['flush_ms']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['first_step_s']:.1f} | {r['peak_mem_gib']:.2f} | "
                     f"{r.get('steady_mem_gib', nan):.2f} | "
                     f"{r['rewrites']} | "
                     f"{r['speedup_vs_compile']:.2f} | {r.get('first_step_vs_compile', float('nan')):.2f} |")
    table = "\n".join(lines)
    banner = run_banner()
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(f"<!-- {banner} -->\n" + table + "\n")
    if quiet:
        return
    print(f"# {banner}")
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for model in sorted({r["model"] for r in rows}):
        curves = {mode: [r for r in rows if r["model"] == model and r["mode"] == mode
                         and math.isfinite(r["speedup_vs_compile"])] for mode in ("replayssm", "replayssm-ro")}
        if not any(curves.values()):
            continue            # no plain torch.compile row to compare with in this run: nothing to plot
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, pts in curves.items():
            if pts:
                ax.plot([r["batch"] for r in pts], [r["speedup_vs_compile"] for r in pts], marker="o", label=mode)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode step speedup vs torch.compile (same mode)")
        ax.set_title(model)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"bench_{model}.png"), dpi=120)
        plt.close(fig)
