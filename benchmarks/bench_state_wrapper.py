"""What the ``ReplayTensor`` cache states cost the compiled decode step: the same model, batch and mode timed with
the cache's recurrent states wrapped (what ``generate`` does after its prefill) and left plain, alternating, in one
process; then teacher-forced parity of both against eager.

    python benchmarks/bench_state_wrapper.py --model nemotron_h_nano4b --layers 16 --batches 1,256 --reps 3

Prints one JSON line per run (``replay_compile.bench.bench_one``'s fields plus ``variant`` and ``rep``) and one per
parity check; ``--out`` also writes them as a CSV.
"""

from __future__ import annotations

import argparse
import csv
import json

import torch

from replay_compile import bench
from replay_compile import state as replay_state

FIELDS = ("model", "layers", "batch", "mode", "variant", "rep", "step_ms", "median_step_ms", "nonflush_ms",
          "flush_ms", "rewrites")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nemotron_h_nano4b")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batches", default="1,256")
    p.add_argument("--modes", default="replayssm-ro,replayssm")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--order", default="wrapped,plain",
                   help="the variants' order within a repetition; odd repetitions run it reversed (alternation "
                        "keeps the first run of the process from always being the same variant)")
    p.add_argument("--out", help="CSV path")
    args = p.parse_args()

    model = bench.build_model(args.model, getattr(torch, args.dtype), "cuda", layers=args.layers)
    wrap = replay_state.protect             # bench_one calls it after the prefill; "plain" replaces it
    rows = []
    for batch in map(int, args.batches.split(",")):
        for mode in args.modes.split(","):
            for rep in range(args.reps):
                order = args.order.split(",")
                for variant in (order if rep % 2 == 0 else order[::-1]):
                    replay_state.protect = wrap if variant == "wrapped" else (lambda cache: 0)
                    r = bench.bench_one(model, batch, mode, args.steps, 16)
                    r.update(model=args.model, layers=args.layers, variant=variant, rep=rep)
                    rows.append({k: r[k] for k in FIELDS})
                    print(json.dumps(rows[-1]), flush=True)
    for variant in ("wrapped", "plain"):
        replay_state.protect = wrap if variant == "wrapped" else (lambda cache: 0)
        print(json.dumps({"parity": variant, **bench.parity(model, 8, 40, 16)}), flush=True)
    replay_state.protect = wrap
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
