"""Speculative verify + commit step (T tokens per row) with the replay state vs the per-draft snapshot baseline.

    python benchmarks/bench_spec_step.py --out bench-results/spec_step      # full sweep
    python benchmarks/bench_spec_step.py --geoms super --batches 256 --T 4

Per (geometry, batch): one *round* is a verify of ``T`` tokens per row (the last accepted token and ``T - 1``
drafts) and the commit of a random accepted count per row (uniform in 1..T, seeded, rows desynchronised):

* ours: ``replay_compile::mamba2_spec_verify`` / ``delta_spec_verify`` (reads checkpoint + ring once, writes the T
  records; flush rows also fold and write the checkpoint) and ``spec_commit`` (cursor moves);
* baseline: benchmarks/spec_baselines.py, one read of the committed state and T state writes (T + 1 slots per
  sequence), commit by index move.

Both sides: fp32 state, bf16 activations, ``R`` rounds with distinct accepted counts captured in one CUDA graph
and replayed (µs per round = graph time / R), state sets rotated so that L2 stays cold. Before timing, one round of
both from the same state must give the same outputs (the baseline is checked, not trusted). Bytes are the fewest a
round must move: baseline (1 + T) states, ours 1 state + (measured flush rate) states + the ring records read and
written; "% bw" against the copy bandwidth measured at the start.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import copy_bandwidth, time_graph, warm_clocks, write_results  # noqa: E402
from spec_baselines import gdn_snapshot_step, mamba2_snapshot_step, snapshot_commit  # noqa: E402

# name: (family, dims)
GEOMS = {"super": ("mamba2", dict(H=128, P=64, N=128, G=8)), "nano": ("mamba2", dict(H=96, P=80, N=128, G=8)),
         "qwen35_4b": ("gdn", dict(Hk=16, HV=32, K=128, V=128)),
         "qwen35_122b": ("gdn", dict(Hk=16, HV=64, K=128, V=128))}
ROUNDS = 16


class Problem:
    """State sets (ours and baseline), per-round inputs and accepted counts for one (geometry, batch) point."""

    def __init__(self, family, dims, bs, T, Bbud, act=torch.bfloat16, dev="cuda", seed=0):
        # GDN activations stay fp32 as the HF layers hand them to the recurrent rule; Mamba-2's are the model dtype
        from replay_compile.kernels.mamba2_spec_reference import spec_buf_len

        self.family, self.bs, self.T, self.Bbud = family, bs, T, Bbud
        buf = spec_buf_len(Bbud, T)
        g = torch.Generator(device=dev).manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
        uni = lambda *s: torch.rand(*s, generator=g, device=dev)  # noqa: E731
        if family == "mamba2":
            H, P, N, G = dims["H"], dims["P"], dims["N"], dims["G"]
            shape = (H, P, N)
            self.inp = dict(x=rnd(bs, T, H, P).to(act), dt=0.05 + uni(bs, T, H),
                            B=rnd(bs, T, G, N).to(act), C=rnd(bs, T, G, N).to(act))
            self.inp["la"] = self.inp["dt"] * -0.5
            rings = lambda: [torch.zeros(bs, H, buf, P, dtype=act, device=dev),  # noqa: E731
                             torch.zeros(bs, H, buf, device=dev), torch.zeros(bs, H, buf, device=dev),
                             torch.zeros(bs, G, buf, N, dtype=act, device=dev)]
            self.record_bytes = H * (P * 2 + 8) + G * N * 2              # x, dt, la per head; B per group
        else:
            Hk, HV, K, V = dims["Hk"], dims["HV"], dims["K"], dims["V"]
            shape = (HV, K, V)
            norm = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
            self.inp = dict(q=(norm(rnd(bs, T, Hk, K)) * K ** -0.5).contiguous(), k=norm(rnd(bs, T, Hk, K)),
                            v=rnd(bs, T, HV, V), g=-0.1 * uni(bs, T, HV), beta=uni(bs, T, HV))
            rings = lambda: [torch.zeros(bs, HV, buf, V, device=dev), torch.zeros(bs, Hk, buf, K, device=dev),  # noqa: E731
                             torch.zeros(bs, HV, buf, device=dev)]
            self.record_bytes = HV * (V * 4 + 4) + Hk * K * 4            # d, g per value head; k per key head
        self.state_bytes = bs * 4 * shape[0] * shape[1] * shape[2]        # fp32 state per layer
        self.copies = max(1, min(4, (256 * 2**20) // max(self.state_bytes, 1)))   # rotate sets: keep L2 (60 MB) cold
        self.ours = []
        self.base = []
        for _ in range(self.copies):
            s0 = rnd(bs, *shape) * 0.1
            cur = [torch.zeros(bs, dtype=torch.int32, device=dev), torch.zeros(bs, dtype=torch.int32, device=dev),
                   torch.zeros(bs, dtype=torch.bool, device=dev)]
            self.ours.append([s0.clone(), *rings(), *cur])
            pool = torch.zeros((bs, T + 1) + shape, device=dev)
            pool[:, 0] = s0
            self.base.append([pool, torch.zeros(bs, dtype=torch.int32, device=dev)])
        self.n_acc = [torch.randint(1, T + 1, (bs,), generator=g, dtype=torch.int32, device=dev)
                      for _ in range(ROUNDS)]
        self.i = 0

    def _verify(self, c):
        if self.family == "mamba2":
            p = self.inp
            return torch.ops.replay_compile.mamba2_spec_verify(*c, p["x"], p["dt"], p["la"], p["B"], p["C"])
        p = self.inp
        return torch.ops.replay_compile.delta_spec_verify(*c, p["q"], p["k"], p["v"], p["g"], p["beta"])

    def _baseline(self, c):
        p = self.inp
        if self.family == "mamba2":
            return mamba2_snapshot_step(*c, p["x"], p["dt"], p["la"], p["B"], p["C"])
        return gdn_snapshot_step(*c, p["q"], p["k"], p["v"], p["g"], p["beta"])

    def ours_round(self):
        c = self.ours[self.i % self.copies]
        n = self.n_acc[self.i % ROUNDS]
        self.i += 1
        self._verify(c)
        torch.ops.replay_compile.spec_commit(*c[-3:], n, self.Bbud, self.T)

    def base_round(self):
        c = self.base[self.i % self.copies]
        n = self.n_acc[self.i % ROUNDS]
        self.i += 1
        self._baseline(c)
        snapshot_commit(c[1], n, self.T)

    def check(self):
        """One round of both from the same fresh state must agree (the first set of each, before any timing)."""
        y_ours = self._verify(self.ours[0])
        y_base = self._baseline(self.base[0])
        return float((y_ours - y_base).abs().max() / (y_base.abs().max() + 1e-12))   # cursors untouched: no commit

    def flush_rate(self) -> float:
        """Fraction of rows that flush per round over the captured sequence (measured eagerly, then undone)."""
        from replay_compile.kernels.mamba2_spec_reference import spec_reset_reference

        w, o, f = (t.clone() for t in self.ours[0][-3:])
        total = 0.0
        for r in range(4 * ROUNDS):
            total += float(f.float().mean())
            torch.ops.replay_compile.spec_commit(w, o, f, self.n_acc[r % ROUNDS], self.Bbud, self.T)
        spec_reset_reference(w, o, f, self.Bbud, self.T)
        return total / (4 * ROUNDS)


def bench_point(family, dims, bs, T, Bbud):
    p = Problem(family, dims, bs, T, Bbud)
    err = p.check()
    if not err < 1e-3:
        raise AssertionError(f"{family} {dims} bs{bs}: verify and snapshot baseline disagree ({err:.2e})")
    fr = p.flush_rate()
    for _ in range(3 * ROUNDS):                                              # steady state: rings partly full
        p.ours_round()
    res = dict(ours_us=time_graph(p.ours_round, inner=ROUNDS * p.copies, reps=20),
               base_us=time_graph(p.base_round, inner=ROUNDS * p.copies, reps=20))
    # ours: state read, flush writes, ring history read (≈ B/2 records on average), T records written
    ours_bytes = p.state_bytes * (1 + fr) + bs * p.record_bytes * (Bbud / 2 + T)
    base_bytes = p.state_bytes * (1 + T)
    return res, ours_bytes, base_bytes, fr, err


def _tuning(family) -> dict:
    if family == "mamba2":
        from replay_compile.kernels.mamba2_spec_triton import TUNING
    else:
        from replay_compile.kernels.delta_spec_triton import TUNING
    return TUNING


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default="super,qwen35_4b")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--B", type=int, default=16, help="history budget (the replay buffer length)")
    ap.add_argument("--configs", default="",
                    help="';'-separated launch configs of the verify kernel (e.g. 'BLOCK_V=64,num_warps=8'; Mamba-2 "
                         "takes BLOCK_P), each timed at --batches instead of the default")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import replay_compile  # noqa: F401 - registers the ops

    warm_clocks()
    bw = copy_bandwidth()
    pr = torch.cuda.get_device_properties(0)
    print(f"# {pr.name} sm_{pr.major}{pr.minor}, torch {torch.__version__}, python {platform.python_version()}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; T={args.T}, B={args.B}, fp32 state, bf16 activations, "
          f"baseline: per-draft snapshots (1 read + T writes)")
    print(f"{'geom':12} {'bs':>4} {'base us':>9} {'%bw':>5} {'ours us':>9} {'%bw':>5} {'flush/rd':>8} "
          f"{'speedup':>7} {'floor x':>7} {'check':>8}")
    rows = []
    configs = args.configs.split(";") if args.configs else [""]
    for gname, bs, cfg in itertools.product(args.geoms.split(","), map(int, args.batches.split(",")), configs):
        family, dims = GEOMS[gname]
        tuning = _tuning(family)
        tuning.clear()
        tuning.update({k: int(v) if v.isdigit() else v for k, v in (kv.split("=") for kv in cfg.split(",") if kv)})
        res, ob, bb, fr, err = bench_point(family, dims, bs, args.T, args.B)
        tuning.clear()
        row = dict(geom=gname + (f"[{cfg}]" if cfg else ""), dtype="float32", bs=bs, T=args.T, B=args.B,
                   base_us=res["base_us"], ours_us=res["ours_us"], base_bw=bb / (res["base_us"] * 1e-6) / bw,
                   ours_bw=ob / (res["ours_us"] * 1e-6) / bw, flush_rate=fr, speedup=res["base_us"] / res["ours_us"],
                   floor_ratio=bb / ob, check_err=err)
        rows.append(row)
        print(f"{row['geom']:12} {bs:4d} {row['base_us']:9.1f} {100 * row['base_bw']:4.0f}% {row['ours_us']:9.1f} "
              f"{100 * row['ours_bw']:4.0f}% {fr:8.2f} {row['speedup']:6.2f}x {row['floor_ratio']:6.2f}x "
              f"{err:8.1e}", flush=True)
        torch.cuda.empty_cache()
    write_results(rows, args.out, "spec_step", sorted({r["geom"] for r in rows}), ["float32"],
                  "speedup over snapshot baseline")


if __name__ == "__main__":
    main()
