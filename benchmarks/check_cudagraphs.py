"""Does the rewritten decode step run inside CUDA graphs (mode="reduce-overhead") with no skips and no allocation
per step? A tiny hybrid model on CUDA (NemotronH by default), static cache, greedy, compared with an eager decode
loop.

    python benchmarks/check_cudagraphs.py [nemotron_h | qwen3_next | qwen3_5 | qwen3_5_moe | kimi_linear | ...]
        [bf16,fp8_e4m3,nvfp4]   (also replayssm with each read-copy format: tokens may differ from eager, the
                                 logit difference is the copy's rounding)
    torchrun --nproc-per-node N benchmarks/check_cudagraphs.py FAMILY
        (tensor parallel: the model sharded by ``parallelize_hybrid`` over N GPUs; every rank checks its own step
         against the sharded model's eager decode and prints its lines prefixed with its rank)

The cache is allocated and prefilled eagerly, then only the one-token decode step is compiled: the way a serving
loop uses CUDA graphs. (Letting ``generate`` create a hybrid cache inside the first compiled call makes the cache
tensors outputs of a CUDA graph, which the next replay overwrites: transformers 5.17 + plain Inductor then fails
with "accessing tensor output of CUDAGraphs that has been overwritten". That is a property of the cache's
allocation, not of our rewrite.)
"""
import logging
import os
import sys

import torch
import transformers
from transformers import StaticCache

import replay_compile
from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY, make_inputs

skips = []


class _Catch(logging.Handler):
    def emit(self, record):
        if "skipping cudagraphs" in record.getMessage():
            skips.append(record.getMessage())


for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.utils",
             "torch._inductor.cudagraph_utils", "torch._inductor.compile_fx"):
    logging.getLogger(name).addHandler(_Catch())

STEPS = 48
family = sys.argv[1] if len(sys.argv) > 1 else "nemotron_h"
world = int(os.environ.get("WORLD_SIZE", "1"))
prefix = ""
model = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family]()
if world > 1:                                   # under torchrun: shard over the ranks' GPUs
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from replay_compile.tensor_parallel import parallelize_hybrid

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    prefix = f"[rank {dist.get_rank()}/{world}] "
    model = parallelize_hybrid(model.cuda(), init_device_mesh("cuda", (world,)))
model = model.cuda().eval()
ids = make_inputs(model, batch=4, prompt_len=8).cuda()


def decode(forward):
    """Eager prefill, then STEPS one-token steps through ``forward``; tokens, logits, memory after each step."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + STEPS + 4)
    toks, logits, mems = [], [], []
    with torch.no_grad():
        o = model(ids, past_key_values=cache, use_cache=True)
        tok = o.logits[:, -1:].argmax(-1)
        for t in range(STEPS):
            o = forward(tok, past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([ids.shape[1] + t], device="cuda"))
            logits.append(o.logits[:, -1].float().cpu())         # host copies: device memory is the step's alone
            tok = o.logits[:, -1:].argmax(-1)
            toks.append(tok.cpu())
            torch.cuda.synchronize()
            mems.append(torch.cuda.memory_allocated())
    return torch.cat(toks, 1), logits, mems, cache


print(f"{prefix}{family} transformers {transformers.__version__} torch {torch.__version__}, tensor parallel {world}")
ref_toks, ref_logits, _, _ = decode(model.forward)
runs = [("inductor", None), ("replayssm", None)]
runs += [("replayssm", fmt) for fmt in (sys.argv[2].split(",") if len(sys.argv) > 2 else [])]
for backend, read_copy in runs:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    replay_compile.clear_reports()
    skips.clear()
    if read_copy:        # torch.compile takes no mode with options: our backend reads the mode from its options
        compiled = torch.compile(model.forward, backend=backend,
                                 options={"mode": "reduce-overhead", "read_copy": read_copy,
                                          "read_copy_families": "mamba2,gdn,kda"})
        backend = f"replayssm read_copy={read_copy}"
    else:
        compiled = torch.compile(model.forward, backend=backend, mode="reduce-overhead")
    try:
        toks, logits, mems, cache = decode(compiled)
    except Exception as e:  # noqa: BLE001 - report and go on to the next backend
        print(f"{prefix}[{backend}] FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        continue
    if backend.startswith("replayssm"):
        replay_compile.flush(cache)
    c = torch._dynamo.utils.counters
    print(f"{prefix}[{backend}] rewrites: {sum(len(r.rewrites) for r in replay_compile.reports())}")
    print(f"{prefix}[{backend}] tokens identical to eager: {bool((toks == ref_toks).all())}; max logit diff "
          f"{max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)):.2e}")
    graphs = {k: v for k, v in c["inductor"].items() if "cudagraph" in k}
    print(f"{prefix}[{backend}] inductor cudagraph counters: {graphs}")
    print(f"{prefix}[{backend}] 'skipping cudagraphs' messages: {len(skips)} "
          f"{[m.splitlines()[0][:160] for m in skips[:2]]}")
    print(f"{prefix}[{backend}] memory_allocated constant over steps 8..{STEPS}: {len(set(mems[8:])) == 1} "
          f"({mems[7]} .. {mems[-1]} bytes)")
if world > 1:
    dist.destroy_process_group()
