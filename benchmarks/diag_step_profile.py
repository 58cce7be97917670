"""Where a compiled decode step's time goes: torch.profiler over steady steps, plain torch.compile vs replayssm.

    python benchmarks/diag_step_profile.py --model nemotron_h_nano4b --layers 8 --batch 1
        [--modes inductor-ro,replayssm-ro]

Per mode: the step's wall time (host launch + device, synchronised as in ``replay-compile bench``), the number of
device kernels per step and the top kernels by device time. ``--py-rows N``: the steps under cProfile too (the host's
Python side, default mode); ``--census``: every Triton launch per step by kernel name and launcher (how the default
mode's batch-1 loss was traced to our graph's extra prologue kernels per GDN layer). Modes take Inductor patches as
in ``replay-compile bench`` (``replayssm@combo_kernels=1``). Written for the batch-1 question; a diagnostic, not a
benchmark.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch


def launcher_census(step, steps: int) -> None:
    """Per Triton kernel that Inductor's wrapper launches in ``steps`` steps: its name, how many launches and which
    launcher runs it: Inductor's static launcher (``StaticallyLaunched*``: one C call) or Triton's own
    (``CompiledKernel``: Python ``launch_metadata`` + launcher object per call; user-defined kernels take it unless
    ``static_launch_user_defined_triton_kernels`` is on). Default mode's batch-1 step is host-bound, so the path
    matters."""
    from torch._inductor.runtime import triton_heuristics as th

    seen = collections.Counter()
    orig = th.CachingAutotuner.run

    def run(self, *args, **kwargs):
        results = getattr(self, "compile_results", None) or []      # StaticTritonCompileResult / TritonCompileResult
        launchers = getattr(self, "launchers", None) or []
        kind = (type(results[0]).__name__ if results else
                type(getattr(launchers[0], "bin", None)).__name__ if launchers else "unbuilt")
        seen[(getattr(self.fn, "__name__", "?"), kind)] += 1
        return orig(self, *args, **kwargs)

    th.CachingAutotuner.run = run
    try:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    finally:
        th.CachingAutotuner.run = orig
    by_kind = collections.Counter()
    for (_, kind), n in seen.items():
        by_kind[kind] += n
    print("   launchers per step: " + ", ".join(f"{k} {n / steps:.0f}" for k, n in by_kind.most_common()))
    for (name, kind), n in sorted(seen.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"     {n / steps:5.1f}/step  {kind:34s} {name[:100]}")


def profile_mode(model, mode: str, batch: int, L: int, warm: int = 20, steps: int = 8, top: int = 12,
                 cpu_rows: int = 8, py_rows: int = 0, census: bool = False):
    from transformers import StaticCache

    from replay_compile.bench import _forward_for, cache_kwarg

    dev = next(model.parameters()).device
    torch._dynamo.reset()
    ids = torch.randint(3, model.config.vocab_size, (batch, 16), device=dev)
    # prompt + warm-up + timed + census + cProfiled (py_rows) + profiled steps: a cache one step short overflows on
    # the device (an index assert in the KV write, which also stops the run)
    cache = StaticCache(config=model.config, max_cache_len=16 + warm + 4 * steps + 4)
    ck = cache_kwarg(model)
    fwd = _forward_for(model, mode, L)
    with torch.no_grad():
        out = model(ids, use_cache=True, cache_position=torch.arange(16, device=dev), **{ck: cache})
        tok = out.logits[:, -1:].argmax(-1)
        pos = 16

        def step():
            nonlocal tok, pos
            o = fwd(tok, use_cache=True, cache_position=torch.tensor([pos], device=dev), **{ck: cache})
            tok = o.logits[:, -1:].argmax(-1)
            pos += 1
        for _ in range(warm):
            step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        if census:
            print(f"== {mode}: Triton launches by launcher over {steps} steps")
            launcher_census(step, steps)
        if py_rows:               # the host's Python side per step (default mode: where the time goes)
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            pr.disable()
            print(f"== {mode}: Python functions by own time over {steps} steps (cProfile)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(py_rows)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
                torch.cuda.synchronize()
    kern = collections.Counter()
    count = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[e.name] += 1
    walls.sort()
    print(f"== {mode}: median step {walls[len(walls) // 2] * 1e3:.3f} ms (host+device, synchronised), "
          f"{sum(count.values()) / steps:.0f} kernels/step, "
          f"device total {sum(kern.values()) / steps / 1e3:.3f} ms/step")
    for name, t in kern.most_common(top):
        print(f"   {t / steps:9.1f} us/step  x{count[name] / steps:4.0f}  {name[:110]}")
    try:
        timeline(prof, mode)
    except Exception as e:  # noqa: BLE001 - a diagnostic: the totals below still print
        print(f"   timeline failed: {type(e).__name__}: {e}")
    cpu = prof.key_averages()
    rows = sorted((e for e in cpu if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:cpu_rows]
    for e in rows:
        print(f"   cpu {e.self_cpu_time_total / steps:9.1f} us/step  x{e.count / steps:5.1f}  {e.key[:100]}")


def timeline(prof, mode: str) -> None:
    """Per CUDA-graph launch (kernels grouped by the launch's correlation id in the Kineto trace): host launch call
    length, launch-to-first-kernel latency, span from first kernel start to last kernel end, busy time inside the
    span, and the largest idle gaps between consecutive kernels with their neighbours. GPU work launched outside
    graphs is listed by name. The question it answers: where a step's wall time goes when device time is equal."""
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    os.unlink(path)
    launches, gpu = {}, collections.defaultdict(list)
    for e in ev:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "correlation" not in a:
            continue
        if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"]:
            launches[a["correlation"]] = e
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu[a["correlation"]].append(e)
    outside = collections.Counter(k["name"][:60] for c, ks in gpu.items() if c not in launches for k in ks)
    print(f"   {mode}: {len(launches)} graph launches; GPU ops outside graphs: {dict(outside.most_common(6))}")
    for c, le in sorted(launches.items(), key=lambda kv: kv[1]["ts"]):
        ks = sorted(gpu.get(c, []), key=lambda k: k["ts"])
        if not ks:
            continue
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        busy = sum(k["dur"] for k in ks)
        gaps = sorted(((b["ts"] - (a["ts"] + a["dur"]), a["name"][:40], b["name"][:40]) for a, b in zip(ks, ks[1:])),
                      reverse=True)[:3]
        print(f"     launch call {le['dur']:6.1f} us, to 1st kernel {ks[0]['ts'] - le['ts']:6.1f} us, span "
              f"{span:7.1f} us, busy {busy:7.1f} us, {len(ks)} ops; gaps: "
              + "; ".join(f"{g:.1f} us {a} -> {b}" for g, a, b in gaps))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="nemotron_h_nano4b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="inductor-ro,replayssm-ro")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--cpu-rows", type=int, default=8, help="host ops listed by self time (default mode: the host "
                    "is the question)")
    ap.add_argument("--py-rows", type=int, default=0, help="also run the steps under cProfile and list this many "
                    "Python functions by own time")
    ap.add_argument("--census", action="store_true", help="list every Triton launch per step with its launcher "
                    "(static or Triton's own)")
    args = ap.parse_args(argv)
    from replay_compile.bench import build_model
    model = build_model(args.model, torch.bfloat16, "cuda", args.layers)
    for mode in args.modes.split(","):
        profile_mode(model, mode, args.batch, args.L, cpu_rows=args.cpu_rows, py_rows=args.py_rows,
                     census=args.census)


if __name__ == "__main__":
    main()
