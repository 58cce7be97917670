"""Where an inlined step op (ops/library.py, ``inline=True``) departs from the eager op: per step and per persistent
tensor, the largest difference and the first step it appears; the generated code is written beside.

    python benchmarks/diag_inline.py --out DIR [--cases 1,3]

Cases are ``tests/ops/test_inline_kernels_gpu.py``'s ``CASES`` (by index). A diagnostic for a GPU machine, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))
import test_inline_kernels_gpu as t  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="inline-diag")
    ap.add_argument("--cases", default="1,3")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for i in map(int, args.cases.split(",")):
        case = t.CASES[i]
        name = t._ids(case)
        torch._dynamo.reset()
        e_outs, e_persist, _ = t._run(case, compiled=False)
        try:
            outs, persist, code = t._run(case, compiled=True)
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            print(f"== {name}: compile/run failed: {type(e).__name__}: {str(e)[:2000]}")
            continue
        with open(os.path.join(args.out, f"code_{i}.py"), "w") as f:
            f.write(code)
        print(f"== {name}: {code.count('.run(')} kernel launches in the code, "
              f"'clone' x{code.count('clone')}, 'copy_' x{code.count('copy_')}")
        for s, (a, b) in enumerate(zip(outs, e_outs)):
            d = float((a.double() - b.double()).abs().max())
            if d > 0:
                print(f"   step {s:2d} output max diff {d:.3e} (eager max {float(b.abs().max()):.3e})")
        for k, (a, b) in enumerate(zip(persist, e_persist)):
            d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            print(f"   persistent {k} {tuple(a.shape)} {a.dtype}: max diff {d:.3e}")


if __name__ == "__main__":
    main()
