"""Mamba-2 replay step kernel vs mamba_ssm's ``selective_state_update``, on one GPU, in one run.

    python benchmarks/bench_mamba2_kernel.py --out bench-results/mamba2   # full sweep
    python benchmarks/bench_mamba2_kernel.py --batches 256 --geoms super # one point
    python benchmarks/bench_mamba2_kernel.py --batches 1,256 --configs 'pre;pre:BLOCK_P=32,num_warps=2'

Per (geometry, batch, state dtype): the baseline step, our non-flush step (the mean over the L-1 non-flush ring
positions), our flush step and the average over L consecutive steps (one flush), each replayed from a CUDA graph of
at least 8 steps (median of repeats; the state of a large batch is far larger than L2, small batches rotate over
several state buffers so L2 stays cold; a graph of one step would add the graph's own launch latency to every figure:
``step_times``). Bytes are the
fewest the step must move; "% bw" is bytes / time against the device-to-device copy bandwidth measured at the start
of the run.
The baseline is mamba_ssm's Triton ``selective_state_update``: installed, or its source under ``.baselines/``
(copy it along to a GPU machine without network; mamba_ssm's compiled extensions are not needed for this function).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import types

import torch

from replay_compile.bench import copy_bandwidth

GEOMS = {"nano": (96, 80, 128, 8), "super": (128, 64, 128, 8)}   # H, P, N, G (Nemotron-Nano-4B, -Super-120B)


def load_baseline():
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update
    except Exception:  # noqa: BLE001 - not installed (or its CUDA extensions missing): use the source under .baselines/
        root = os.path.join(os.path.dirname(__file__), "..", ".baselines", "mamba_ssm")
        if not os.path.isdir(root):
            return None
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [os.path.abspath(root)]                    # skip its __init__ (imports CUDA extensions)
        sys.modules["mamba_ssm"] = pkg
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        return selective_state_update


def time_graph(fn, reps=30, warmup=3, inner=1) -> float:
    """Median µs per call of ``fn``, captured ``inner`` times in a row in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(times)


# Steps per captured graph, at least: a replay's own launch latency (a few µs) is no step's time. With one step per
# graph a large batch (one state buffer) would include that latency in every figure.
MIN_GRAPH_STEPS = 8


def graph_calls(copies: int) -> int:
    """Calls per captured graph: a multiple of ``copies`` (the rotated buffers), at least ``MIN_GRAPH_STEPS``."""
    return copies * -(-MIN_GRAPH_STEPS // copies)


def step_times(step, cursors, L: int, desync: bool = False) -> dict:
    """Per-step µs of ``step(k)``, one replay step on buffer set ``k`` whose cursor is ``cursors[k]``:

    * ``nonflush_us``: the mean over a cycle of the ``L - 1`` non-flush ring positions, every cursor reset to 0 once
      per cycle (no cursor fill kernel inside the figure);
    * ``flush_us``: the cursor filled to ``L - 1`` before each step (that ~2 µs fill is in the figure);
    * ``lavg_us``: ``L`` consecutive steps per buffer, the cursor running free (one flush each);
    * ``desync_us`` (only with ``desync``): the same with every row's cursor at its own ring position
      (``row mod L``), so about ``b / L`` rows flush in each step, as in serving where requests arrive at different
      times; the lockstep ``lavg_us`` (every row flushing in the same step) stays the figure of record."""
    copies = len(cursors)
    i = [0]

    def rotate():
        k = i[0] = (i[0] + 1) % copies
        step(k)

    def flush():
        k = i[0] = (i[0] + 1) % copies
        cursors[k].fill_(L - 1)
        step(k)

    def nonflush_cycle():
        for c in cursors:
            c.zero_()
        for _ in range(L - 1):
            for k in range(copies):
                step(k)

    res = {"flush_us": time_graph(flush, inner=graph_calls(copies)),
           "lavg_us": time_graph(rotate, reps=10, inner=L * copies), "nonflush_us": math.nan}
    if L > 1:
        cycles = -(-MIN_GRAPH_STEPS // ((L - 1) * copies))
        res["nonflush_us"] = time_graph(nonflush_cycle, inner=cycles) / ((L - 1) * copies)
    if desync:
        for c in cursors:                           # the steps advance them in place: the stagger persists
            c.copy_(torch.arange(c.numel(), device=c.device) % L)
        res["desync_us"] = time_graph(rotate, reps=10, inner=L * copies)
    return res


def held_records(L: int) -> float:
    """Records a non-flush step holds on average in :func:`step_times`' cycle (``w = 0 .. L-2``): what its ring
    bytes are counted at."""
    return (L - 2) / 2


def desync_header(on: bool) -> str:
    """The sweep table's two desynchronised-step columns (``--desync``), or nothing."""
    return f" {'desync us':>9} {'x desync':>8}" if on else ""


def desync_cells(r: dict, base: float, on: bool) -> str:
    """One row's desynchronised step time and its speedup over ``base`` (``--desync``), or nothing."""
    return f" {r['desync_us']:>9.1f} {base / r['desync_us']:>8.2f}" if on else ""


def random_step(bs, H, P, N, G, L, copies, act, dev="cuda"):
    """``copies`` ring sets (x, dt, la, B rings and cursor) with random records, and one token's random inputs
    ``(x, dt, la, B, C)``; shared by the Mamba-2 step benchmarks."""
    from replay_compile.state import Mamba2RingSpec

    spec = Mamba2RingSpec(H, P, N, G, L, act, act)
    rings = [spec.allocate(bs, dev) for _ in range(copies)]
    for r in rings:
        for t in r[:4]:
            t.normal_()
    x = torch.randn(bs, H, P, device=dev, dtype=act)
    dt = torch.rand(bs, H, device=dev) * 0.1
    la = -torch.rand(bs, H, device=dev)
    B = torch.randn(bs, G, N, device=dev, dtype=act)
    C = torch.randn(bs, G, N, device=dev, dtype=act)
    return rings, (x, dt, la, B, C)


def bench_point(ssu, H, P, N, G, bs, state_dtype, L, act=torch.bfloat16, desync=False):
    from replay_compile.kernels.mamba2_triton import replay_step_triton

    dev = "cuda"
    state_bytes = bs * H * P * N * torch.empty((), dtype=state_dtype).element_size()
    copies = max(1, min(8, (256 * 2**20) // max(state_bytes, 1)))     # rotate buffers: keep L2 (60 MB) cold
    states = [torch.randn(bs, H, P, N, device=dev).to(state_dtype) for _ in range(copies)]
    rings, (x, dt, la, B, C) = random_step(bs, H, P, N, G, L, copies, act, dev)
    i = [0]

    # each captured call uses the next buffer, so a replay walks all of them (cold L2 at small batch)
    res = step_times(lambda k: replay_step_triton(states[k], *rings[k], x, dt, la, B, C, None),
                     [r[-1] for r in rings], L, desync)
    if ssu is not None:
        A = -torch.rand(H, device=dev)[:, None, None].expand(H, P, N)
        Dp = torch.randn(H, device=dev)[:, None].expand(H, P)
        dtb = torch.randn(H, device=dev)[:, None].expand(H, P)
        dt_full = dt[:, :, None].expand(bs, H, P)
        base_states = [s.float() if state_dtype == torch.float32 else s for s in states]

        def base():
            k = i[0] = (i[0] + 1) % copies
            ssu(base_states[k], x, dt_full, A, B, C, D=Dp, dt_bias=dtb, dt_softplus=True)
        res["baseline_us"] = time_graph(base, inner=graph_calls(copies))
    es = torch.empty((), dtype=state_dtype).element_size()
    ea = torch.empty((), dtype=act).element_size()
    sb = bs * H * P * N * es
    held = held_records(L)
    ring_read = int(bs * (H * held * (P * ea + 8) + G * held * N * ea))
    res["bytes_baseline"] = 2 * sb
    res["bytes_nonflush"] = sb + ring_read
    res["bytes_flush"] = 2 * sb + 2 * ring_read
    return res


def reported(label: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or ``None`` after one line naming ``label`` and the error: a configuration that fails
    (does not compile, or fails its check) is reported and the sweep goes on (the run's other configurations
    are not lost to it). Shared by the kernel sweeps and diagnostics here."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        print(f"  {label} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None


def compare_configs(tuning: dict, points, configs, bw, csv_path):
    """Launch-config comparison shared by the kernel benchmarks: for each point ``(geom, batch, baseline_us, run)``
    (``run()`` times our kernel: a ``bench_point`` result without the baseline), every ``configs`` entry (a
    ``tuning.parse_tuning`` string) is forced on the kernel module's ``tuning`` dict and timed; a config that
    does not compile is reported and skipped (``run`` is called before the next point is drawn, so it may close over
    the loop variables of a generator). Prints a line per run, writes every row to ``csv_path``."""
    from replay_compile.kernels.tuning import tuned

    rows = []

    def resources():
        from replay_compile.kernels import mamba2_triton as kt
        return kt.kernel_resources(kt.LAST_LAUNCH.get("kernel")) if tuning is kt.TUNING else ""
    print(f"{'geom':12} {'bs':>4} {'config':40} {'nonfl us':>9} {'% floor':>7} {'flush us':>9} {'Lavg us':>8} "
          f"{'base us':>8} {'x':>5}")
    for gname, bs, base, run in points:
        for spec in configs:
            with tuned(tuning, spec):
                r = reported(f"{gname} {bs} {spec}", run)
            if r is None:
                continue
            pct = r["bytes_nonflush"] / (r["nonflush_us"] * 1e-6) / bw * 100
            rows.append(dict(geom=gname, bs=bs, config=spec, **r, baseline_us=base, pct_floor_nonflush=pct,
                             speedup=base / r["lavg_us"]))
            print(f"{gname:12} {bs:>4} {spec:40} {r['nonflush_us']:>9.1f} {pct:>7.0f} {r['flush_us']:>9.1f} "
                  f"{r['lavg_us']:>8.1f} {base:>8.1f} {base / r['lavg_us']:>5.2f}  {resources()}", flush=True)
    write_csv(rows, csv_path)


def sweep_configs(ssu, bw, L, out, configs, batches, geoms, dtypes=("float32",)):
    """:func:`compare_configs` for the Mamba-2 kernel per checkpoint dtype (``geom`` is labelled ``/bf16`` etc.
    for other than fp32), with selective_state_update's time of each point measured once in the same run; used to
    pick the defaults of ``mamba2_triton.launch_config``."""
    from replay_compile.kernels import mamba2_triton as kt

    def points():
        for gname in geoms:
            H, P, N, G = GEOMS[gname]
            for dname in dtypes:
                sdt = getattr(torch, dname)
                label = gname if dname == "float32" else f"{gname}/{dname[:4]}"
                for bs in batches:
                    base = bench_point(ssu, H, P, N, G, bs, sdt, L).get("baseline_us", float("nan"))
                    yield label, bs, base, lambda: bench_point(None, H, P, N, G, bs, sdt, L)
    compare_configs(kt.TUNING, points(), configs, bw, os.path.join(out, "mamba2_kernel_configs.csv"))


def write_csv(rows, path):
    """Every row (dicts with the same keys) to a CSV file."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_results(rows, out, stem, geoms, dtypes, ylabel):
    """``<stem>.csv`` with every row and, with matplotlib, ``<stem>_speedup.png`` (speedup vs batch per geometry and
    state dtype). Shared by the kernel benchmarks."""
    write_csv(rows, os.path.join(out, f"{stem}.csv"))
    if not any(math.isfinite(r["speedup"]) for r in rows):
        return                  # no baseline in this run (not installed): no speedup to plot
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for gname in geoms:
        for dname in dtypes:
            pts = [r for r in rows if r["geom"] == gname and r["dtype"] == dname]
            ax.plot([r["bs"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"{gname} {dname}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{stem}_speedup.png"), dpi=120)


def warm_clocks():
    x = torch.empty(2**28, device="cuda")
    for _ in range(200):
        x.mul_(1.0)
    torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--geoms", default="super,nano")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--L", type=int, default=16)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--configs", default="",
                    help="';'-separated launch configs (e.g. 'pre;pre:BLOCK_P=32,num_warps=2') compared at "
                         "--batches, fp32 state, instead of the sweep")
    ap.add_argument("--desync", action="store_true",
                    help="also time steps with every row at its own ring position (step_times' desync_us)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ssu = load_baseline()
    warm_clocks()
    bw = copy_bandwidth()
    p = torch.cuda.get_device_properties(0)
    print(f"# {p.name} sm_{p.major}{p.minor}, torch {torch.__version__}, python {platform.python_version()}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, baseline: {'mamba_ssm selective_state_update' if ssu else 'none'}")
    rows = []
    hdr = f"{'geom':6} {'dtype':8} {'bs':>4} {'base us':>9} {'nonfl us':>9} {'%bw':>5} {'flush us':>9} " \
          f"{'L-avg us':>9} {'speedup':>7} {'floor x':>7} {'chosen':>6} {'xwhole':>6} {'xpre':>6}" + \
          desync_header(args.desync)
    if args.configs:
        return sweep_configs(ssu, bw, args.L, args.out, args.configs.split(";"),
                             list(map(int, args.batches.split(","))), args.geoms.split(","), args.dtypes.split(","))
    print(hdr)
    for gname in args.geoms.split(","):
        H, P, N, G = GEOMS[gname]
        for dname in args.dtypes.split(","):
            sdt = getattr(torch, dname)
            for bs in map(int, args.batches.split(",")):
                from replay_compile.kernels import mamba2_triton as kt
                chosen = kt.launch_config(bs, H, P, N, args.L)["variant"]
                per = {}
                for variant in ("whole", "pre"):             # both variants launch_config picks from, the baseline once
                    kt.TUNING.update(variant=variant)
                    per[variant] = bench_point(ssu if variant == "whole" else None, H, P, N, G, bs, sdt, args.L,
                                               desync=args.desync and variant == chosen)
                    kt.TUNING.clear()
                r = dict(per[chosen])
                base = per["whole"].get("baseline_us", float("nan"))
                pct = r["bytes_nonflush"] / (r["nonflush_us"] * 1e-6) / bw * 100
                floor_l = ((args.L - 1) * r["bytes_nonflush"] + r["bytes_flush"]) / args.L / bw * 1e6
                r.pop("baseline_us", None)
                row = dict(geom=gname, dtype=dname, bs=bs, L=args.L, copy_bw_TBs=bw / 1e12, variant=chosen,
                           baseline_us=base, **r, speedup=base / r["lavg_us"], lavg_floor_us=floor_l,
                           baseline_floor_us=r["bytes_baseline"] / bw * 1e6,
                           whole_lavg_us=per["whole"]["lavg_us"], pre_lavg_us=per["pre"]["lavg_us"])
                rows.append(row)
                print(f"{gname:6} {dname:8} {bs:>4} {base:>9.1f} {r['nonflush_us']:>9.1f} {pct:>5.0f} "
                      f"{r['flush_us']:>9.1f} {r['lavg_us']:>9.1f} {row['speedup']:>7.2f} "
                      f"{row['baseline_floor_us'] / floor_l:>7.2f} {chosen:>6} {base / per['whole']['lavg_us']:>6.2f} "
                      f"{base / per['pre']['lavg_us']:>6.2f}" + desync_cells(r, base, args.desync), flush=True)
    write_results(rows, args.out, "mamba2_kernel", args.geoms.split(","), args.dtypes.split(","),
                  "L-step average speedup vs selective_state_update")

if __name__ == "__main__":
    main()
