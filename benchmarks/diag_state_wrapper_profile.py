"""Where a whole-step difference between wrapped (``ReplayTensor``) and plain cache states would come from: per
variant, alternated over two repetitions, the host time of each compiled decode call, the device time per step of
40 steps queued without a host read between them, and the kernels (count and device time) of two profiled steps;
then the kernels whose count or time differs by more than 5%.

    python benchmarks/diag_state_wrapper_profile.py [LAYERS=56] [BATCH=256]

Nemotron-Nano-4B dimensions, random weights, bf16, ``backend="replayssm"``, ``mode="reduce-overhead"``, L = 16.
"""
import collections
import statistics
import sys
import time

import torch
from transformers import StaticCache

import replay_compile.backend as rb
from replay_compile import bench
from replay_compile import state as rs

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 56
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 256
model = bench.build_model("nemotron_h_nano4b", torch.bfloat16, "cuda", layers=layers)
ck = bench.cache_kwarg(model)

def run(variant, steps=40, prompt=16):
    torch._dynamo.reset()
    rb.clear_reports()
    ids = torch.randint(3, 1000, (bs, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    cache = StaticCache(config=model.config, max_cache_len=prompt + 2 * steps + 4)
    fwd = bench._forward_for(model, "replayssm-ro", 16)
    with torch.no_grad():
        out = model(ids, use_cache=True, cache_position=torch.arange(prompt, device="cuda"), **{ck: cache})
        if variant == "wrapped":
            rs.protect(cache)
        tok = out.logits[:, -1:].argmax(-1)
        poss = [torch.tensor([prompt + t], device="cuda") for t in range(2 * steps + 2)]
        for t in range(steps):                                   # compile, warm, record
            tok = fwd(tok, use_cache=True, cache_position=poss[t], **{ck: cache}).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        host = []
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for t in range(steps, 2 * steps):                       # pipelined: no sync until the end
            h0 = time.perf_counter()
            tok = fwd(tok, use_cache=True, cache_position=poss[t], **{ck: cache}).logits[:, -1:].argmax(-1)
            host.append(time.perf_counter() - h0)
        b.record()
        torch.cuda.synchronize()
        pipe = a.elapsed_time(b) / steps
        # kernels of 4 steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for t in range(2 * steps, 2 * steps + 2):
                tok = fwd(tok, use_cache=True, cache_position=poss[t], **{ck: cache}).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        kern = collections.Counter()
        ktime = collections.Counter()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kern[e.key] += e.count
                ktime[e.key] += e.device_time_total
        rs.flush(cache)
    return dict(variant=variant, host_ms=statistics.median(host) * 1e3, host_mean_ms=statistics.mean(host) * 1e3,
                pipelined_ms=pipe), kern, ktime

res = {}
for rep, order in enumerate((("wrapped", "plain"), ("plain", "wrapped"))):
    for v in order:
        r, kern, ktime = run(v)
        print(rep, r, "kernels", sum(kern.values()), "kernel_ms/2steps %.3f" % (sum(ktime.values()) / 1e3), flush=True)
        res[v] = (kern, ktime)
kw, tw = res["wrapped"]
kp, tp = res["plain"]
for k in sorted(set(kw) | set(kp), key=lambda k: -(tw[k] + tp[k]))[:40]:
    if kw[k] != kp[k] or abs(tw[k] - tp[k]) > 0.05 * max(tw[k], tp[k], 1):
        print(f"{k[:80]:80s} n {kw[k]:4d}/{kp[k]:4d} us {tw[k]:9.1f}/{tp[k]:9.1f}")
