"""Does the rewritten decode step run inside CUDA graphs (mode="reduce-overhead") with no skips and no allocation
per step? Tiny NemotronH on CUDA, static cache, greedy, compared with eager.

    python benchmarks/check_cudagraphs.py
"""
import logging

import torch

import replay_compile
from replay_compile.testing.hf_models import MAMBA2_FAMILY, make_inputs

skips = []


class _Catch(logging.Handler):
    def emit(self, record):
        if "skipping cudagraphs" in record.getMessage():
            skips.append(record.getMessage())


for name in ("torch._inductor", "torch._inductor.cudagraph_trees", "torch._inductor.utils"):
    logging.getLogger(name).addHandler(_Catch())

model = MAMBA2_FAMILY["nemotron_h"]().cuda()
ids = make_inputs(model, batch=4, prompt_len=8).cuda()
kw = dict(max_new_tokens=48, do_sample=False, cache_implementation="static", output_logits=True,
          return_dict_in_generate=True)
with torch.no_grad():
    ref = model.generate(ids, **kw)
orig = model.forward
for backend in ("inductor", "replayssm"):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    skips.clear()
    model.forward = torch.compile(orig, backend=backend, mode="reduce-overhead")
    with torch.no_grad():
        model.generate(ids, **kw)                      # warm-up: compile, record graphs
        torch.cuda.synchronize()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    c = torch._dynamo.utils.counters
    print(f"[{backend}] rewrites: {sum(len(r.rewrites) for r in replay_compile.reports()) if backend != 'inductor' else 0}")
    print(f"[{backend}] tokens identical to eager:", bool((out.sequences == ref.sequences).all()))
    print(f"[{backend}] max logit diff:", max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)))
    print(f"[{backend}] inductor cudagraph counters:", {k: v for k, v in c["inductor"].items() if "cudagraph" in k})
    print(f"[{backend}] skip messages:", [m.splitlines()[0][:160] for m in skips[:3]])
    replay_compile.clear_reports()

# allocation per step: a manual decode loop on the compiled forward with a static cache
from transformers import StaticCache  # noqa: E402
cache = StaticCache(config=model.config, max_cache_len=80)
with torch.no_grad():
    o = model(ids, past_key_values=cache, use_cache=True)
    tok = o.logits[:, -1:].argmax(-1)
    pos = ids.shape[1]
    mems = []
    for t in range(40):
        o = model(tok, past_key_values=cache, use_cache=True,
                  cache_position=torch.tensor([pos + t], device="cuda"))
        tok = o.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        mems.append(torch.cuda.memory_allocated())
import transformers  # noqa: E402
print("transformers", transformers.__version__)
print("memory_allocated over steps 20..40 constant:", len(set(mems[20:])) == 1, mems[19:23])
