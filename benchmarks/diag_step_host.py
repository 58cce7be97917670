"""Where a compiled decode step's host time goes: plain ``torch.compile`` against ``backend="replayssm"``, one model.

    python benchmarks/diag_step_host.py [--model qwen35_4b] [--batch 1] [--layers 0] [--calls 64]

Both sides compile the model's forward (``mode="reduce-overhead"`` on CUDA) over a static cache prefilled eagerly
and take a few warm steps; then ``--calls`` steps are queued with no synchronisation (each step's token argmaxed on
the device feeds the next), timed on the host, and the same again under ``cProfile``: the functions with the most
time of their own and the most time below them, per side. At batch 1 a full-depth step waits on this work when the
loop reads each token back, so the difference between the sides is what a fix has to remove. A diagnostic, not a
benchmark: it reports host time and profiles, no speedup.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main(argv=None):
    from transformers import StaticCache

    from replay_compile.bench import _forward_for, build_model, cache_kwarg

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen35_4b", help="a replay_compile.bench model name (tiny_<family> on CPU)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="the first N blocks (0: full depth)")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.model, dtype, args.device, layers=args.layers or None)
    ck = cache_kwarg(model)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    modes = ("inductor-ro", "replayssm-ro") if args.device == "cuda" else ("inductor", "replayssm")
    prompt, warm = 16, 4
    for mode in modes:
        torch._dynamo.reset()
        ids = torch.randint(3, model.config.vocab_size, (args.batch, prompt), device=args.device)
        length = prompt + warm + 2 * args.calls + 2
        cache = StaticCache(config=model.config, max_cache_len=length)
        forward = _forward_for(model, mode, 16)
        positions = iter([torch.tensor([p], device=args.device) for p in range(prompt, length)])
        with torch.no_grad():
            out = model(ids, use_cache=True, cache_position=torch.arange(prompt, device=args.device), **{ck: cache})
            tok = out.logits[:, -1:].argmax(-1)

            def step():
                nonlocal tok
                out = forward(tok, use_cache=True, cache_position=next(positions), **{ck: cache})
                tok = out.logits[:, -1:].argmax(-1)

            for _ in range(warm):
                step()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                step()
            host = (time.perf_counter() - t0) / args.calls
            sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                step()
            prof.disable()
            sync()
        print(f"== {args.model} ({args.layers or 'all'} blocks) bs{args.batch} {mode}: host {host * 1e3:.3f} ms "
              f"per call")
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            print(f"-- by {key}, {args.calls} calls")
            print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])


if __name__ == "__main__":
    main()
