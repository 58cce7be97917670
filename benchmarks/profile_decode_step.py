"""Where one whole decode step spends its time: plain ``torch.compile`` vs ``backend="replayssm"``, same model.

    python benchmarks/profile_decode_step.py --model nemotron_h_nano4b --batch 1 --layers 8 \
        [--modes inductor-ro,replayssm-ro] [--steps 8] [--device cuda] [--out DIR]

Builds the model as ``replay-compile bench`` does (random weights, real layer sizes), prefills eagerly, runs the
compiled decode until warm (compile, CUDA-graph warm-up and recording), then profiles ``--steps`` decode steps with
``torch.profiler``. Per mode it prints the wall time per step, the device time per step, the number of device
kernels per step, and the kernels (or, on CPU, the operators) that take the most time, with their count per step.
Made for issue 5's batch-1 question (0.94x in one session, 1.05x in another): a replay step at batch 1 is latency
and launches, and this says which kernels, copies or host work differ between the two modes.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch


def profile_mode(model, mode: str, batch: int, steps: int, L: int, prompt_len: int = 16) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from transformers import StaticCache

    from replay_compile import backend as rb
    from replay_compile import state as rs
    from replay_compile.bench import WARM_STEPS, _forward_for, cache_kwarg

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    rb.clear_reports()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    warm = WARM_STEPS + 2
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + warm + steps + 2)
    forward = _forward_for(model, mode, L)
    ck = cache_kwarg(model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        out = model(ids, use_cache=True, cache_position=torch.arange(prompt_len, device=device), **{ck: cache})
        tok = out.logits[:, -1:].argmax(-1)
        pos = prompt_len

        def step():
            nonlocal tok, pos
            out = forward(tok, use_cache=True, cache_position=torch.tensor([pos], device=device), **{ck: cache})
            tok = out.logits[:, -1:].argmax(-1)
            pos += 1

        for _ in range(warm):
            step()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = (time.perf_counter() - t0) / steps
        rs.flush(cache)
    kernels = collections.Counter()
    dev_us = collections.Counter()
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            dev_us[e.name] += e.device_time
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("aten::", "replay")):
            kernels[e.name] += 1
            dev_us[e.name] += e.cpu_time_total
    return dict(mode=mode, wall_ms=wall * 1e3, device_ms=sum(dev_us.values()) / steps / 1e3,
                launches=sum(kernels.values()) / steps,
                top=[(name, dev_us[name] / steps, kernels[name] / steps) for name, _ in dev_us.most_common(15)],
                rewrites=sum(len(r.rewrites) for r in rb.reports()))


def main(argv=None):
    from replay_compile.bench import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="nemotron_h_nano4b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="inductor-ro,replayssm-ro")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--buffer-len", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    args = ap.parse_args(argv)
    model = build_model(args.model, getattr(torch, args.dtype), args.device, layers=args.layers)
    what = "kernels" if args.device.startswith("cuda") else "operators (CPU time)"
    lines = [f"# {args.model}, {args.layers} layers, batch {args.batch}, {args.dtype}, {args.device}, "
             f"L = {args.buffer_len}, {args.steps} profiled steps after warm-up; top {what} per step"]
    for mode in args.modes.split(","):
        r = profile_mode(model, mode, args.batch, args.steps, args.buffer_len)
        busy = "device" if args.device.startswith("cuda") else "operator time (inclusive, nested ops overlap)"
        lines.append(f"{mode}: wall {r['wall_ms']:.3f} ms/step, {busy} {r['device_ms']:.3f} ms/step, "
                     f"{r['launches']:.1f} {what.split()[0]}/step, {r['rewrites']} rewrites")
        for name, us, n in r["top"]:
            lines.append(f"    {us:9.1f} us  x{n:5.1f}  {name[:110]}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{args.model}_bs{args.batch}.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
