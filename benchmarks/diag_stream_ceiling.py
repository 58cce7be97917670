"""What a read-only stream of the checkpoint reaches on this GPU, and where the ``pre`` step's time goes.

    python benchmarks/diag_stream_ceiling.py [--geom super] [--batch 256]

The non-flush step's design target is >= 90% of the bandwidth floor; the floor is counted against the device-to-device
*copy* bandwidth. A non-flush step only reads the checkpoint, so this measures, on one ``[b, H, P, N]`` fp32 state:

* ``copy_``: read + write bandwidth (the floor's reference);
* ``state.sum(-1)``: PyTorch's read-only reduction;
* ``gemv`` kernels: the non-flush pass's arithmetic alone (``y[p] = Σ_n S[p, n] c[n]``) over ``BLOCK_P x N`` tiles,
  one program per tile, for several tile heights and warp counts; and a persistent form (a fixed grid looping over
  tiles, ``tl.range`` with ``num_stages`` so the next tile's load is issued before this one's reduction);
* the ``pre`` step's four launches, each timed by the profiler on non-flush and flush steps.

A diagnostic for ``docs/design/mamba2_kernel.md``, not a benchmark: no baseline, no speed claim.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_mamba2_kernel import GEOMS, copy_bandwidth, random_step, reported, time_graph  # noqa: E402


@triton.jit
def _gemv_tile_kernel(s_ptr, c_ptr, y_ptr, P, N, H, heads_per_g, n_pb,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)                          # one axis: b * H reaches past the 65535 of axis 1 at bs512
    pid_p = pid % n_pb
    rh = (pid // n_pb).to(tl.int64)                 # row * H + h
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    m = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    s = tl.load(s_ptr + rh * P * N + offs_p[:, None] * N + offs_n[None, :], mask=m, other=0.0)
    g = (rh // H) * (H // heads_per_g) + (rh % H) // heads_per_g
    c = tl.load(c_ptr + g * N + offs_n, mask=offs_n < N, other=0.0)
    tl.store(y_ptr + rh * P + offs_p, tl.sum(s * c[None, :], axis=1), mask=offs_p < P)


@triton.jit
def _gemv_flat_kernel(s_ptr, c_ptr, y_ptr, P, N, H, heads_per_g, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``BLOCK_R`` consecutive rows of the ``[b * H * P, N]`` state per program (several heads of one group when
    ``BLOCK_R > P``: more bytes in flight per program than one head's tile holds)."""
    r0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    s = tl.load(s_ptr + offs_r[:, None] * N + offs_n[None, :], mask=(offs_n < N)[None, :], other=0.0)
    rh = r0 // P
    g = (rh // H) * (H // heads_per_g) + (rh % H) // heads_per_g
    c = tl.load(c_ptr + g * N + offs_n, mask=offs_n < N, other=0.0)
    tl.store(y_ptr + offs_r, tl.sum(s.to(tl.float32) * c[None, :], axis=1))


@triton.jit
def _gemv_persistent_kernel(s_ptr, c_ptr, y_ptr, n_tiles, P, N, H, heads_per_g, n_pb,
                            BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        rh = (t // n_pb).to(tl.int64)
        offs_p = (t % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
        m = (offs_p < P)[:, None] & mask_n[None, :]
        s = tl.load(s_ptr + rh * P * N + offs_p[:, None] * N + offs_n[None, :], mask=m, other=0.0)
        g = (rh // H) * (H // heads_per_g) + (rh % H) // heads_per_g
        c = tl.load(c_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        tl.store(y_ptr + rh * P + offs_p, tl.sum(s * c[None, :], axis=1), mask=offs_p < P)


def stream_ceiling(bs, H, P, N, G, bw, state_dtype=torch.float32):
    state = torch.randn(bs, H, P, N, device="cuda").to(state_dtype)
    c = torch.randn(bs, G, N, device="cuda")
    y = torch.empty(bs, H, P, device="cuda")
    nbytes = state.numel() * state.element_size()
    rows = []

    def report(name, us):
        rows.append((name, us))
        print(f"  {name:44} {us:9.1f} us  {nbytes / (us * 1e-6) / 1e12:6.2f} TB/s  "
              f"{nbytes / (us * 1e-6) / bw * 100:5.1f}% of copy bw", flush=True)

    dst = torch.empty_like(state)
    report("copy_ (read+write: 2x bytes)", time_graph(lambda: dst.copy_(state)) / 2)
    report("state.sum(-1)", time_graph(lambda: torch.sum(state, -1, out=y)))
    for bp, nw in [(8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (64, 4)]:
        if bp > triton.next_power_of_2(P):
            continue
        grid = (triton.cdiv(P, bp) * bs * H,)
        fn = lambda: _gemv_tile_kernel[grid](state, c, y, P, N, H, H // G, triton.cdiv(P, bp), BLOCK_P=bp,  # noqa: E731
                                             BLOCK_N=triton.next_power_of_2(N), num_warps=nw)
        report(f"gemv tile BLOCK_P={bp} warps={nw}", time_graph(fn))
    if (H // G) % 2 == 0 and (P & (P - 1)) == 0:     # whole heads per program: 2 or 4 of one group
        for heads, nw in [(1, 2), (2, 2), (2, 4), (4, 4), (4, 8)]:
            br = heads * P
            fn = lambda: _gemv_flat_kernel[(bs * H * P // br,)](  # noqa: E731
                state, c, y, P, N, H, H // G, BLOCK_R=br, BLOCK_N=triton.next_power_of_2(N), num_warps=nw)
            report(f"gemv {heads} heads/program warps={nw}", time_graph(fn))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bp, nw, per_sm, stages in [(16, 1, 16, 2), (16, 1, 32, 2), (16, 2, 16, 3), (32, 2, 8, 3), (32, 4, 8, 2),
                                   (32, 4, 4, 4), (64, 4, 4, 3)]:
        n_pb = triton.cdiv(P, bp)
        n_tiles = n_pb * bs * H
        fn = lambda: _gemv_persistent_kernel[(sms * per_sm,)](  # noqa: E731
            state, c, y, n_tiles, P, N, H, H // G, n_pb, BLOCK_P=bp, BLOCK_N=triton.next_power_of_2(N),
            STAGES=stages, num_warps=nw)
        label = f"persistent BLOCK_P={bp} warps={nw} {per_sm}/SM stages={stages}"
        reported(label, lambda: report(label, time_graph(fn)))
    return rows


def profile_steps(step, cursor, L, reps=10):
    """Device time per kernel of ``step()`` with every cursor at ``L // 2`` (non-flush) and at ``L - 1`` (flush):
    profiler over ``reps`` plain launches after 3 warm-up steps, one line per kind of step."""
    for name, w in (("non-flush", L // 2), ("flush", L - 1)):
        for _ in range(3):
            cursor.fill_(w)
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                cursor.fill_(w)
                step()
            torch.cuda.synchronize()
        per = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] += e.device_time_total / reps
        print(f"  {name}: " + "; ".join(f"{k[:40]} {v:.1f} us" for k, v in per.most_common()), flush=True)


def launch_breakdown(bs, H, P, N, G, L=16, state_dtype=torch.float32):
    """Device time per kernel of one ``pre`` step (profiler, plain launches), non-flush and flush."""
    from replay_compile.kernels.mamba2_triton import replay_step_triton

    state = torch.randn(bs, H, P, N, device="cuda").to(state_dtype)
    rings, (x, dt, la, B, C) = random_step(bs, H, P, N, G, L, 1, torch.bfloat16)
    ring = rings[0]
    profile_steps(lambda: replay_step_triton(state, *ring, x, dt, la, B, C, None), ring[-1], L)


def readcopy_breakdown(bs, H, P, N, G, fmt, L=16):
    """Device time per kernel of one Mamba-2 read-copy step (``fmt``), non-flush and flush."""
    from replay_compile.kernels.mamba2_readcopy_reference import init_read_copy
    from replay_compile.kernels.mamba2_readcopy_triton import replay_step_readcopy_triton

    state = torch.randn(bs, H, P, N, device="cuda")
    copy = init_read_copy(state, fmt)
    rings, (x, dt, la, B, C) = random_step(bs, H, P, N, G, L, 1, torch.bfloat16)
    ring = rings[0]
    profile_steps(lambda: replay_step_readcopy_triton(state, copy, fmt, *ring, x, dt, la, B, C, None), ring[-1], L)


def delta_breakdown(Hk, HV, K, V, kda, bs, L=16, read_copy=None):
    """Device time per kernel of one delta-rule step (exact split kernels, or the read-copy step with ``read_copy``),
    non-flush and flush: where GDN / KDA and the delta read copy lose to the state bytes."""
    from replay_compile.kernels.delta_readcopy_triton import delta_replay_step_readcopy_triton
    from replay_compile.kernels.delta_triton import delta_replay_step_triton
    from replay_compile.ops.mamba2_readcopy import as_copy
    from replay_compile.state import DeltaRingSpec

    spec = DeltaRingSpec(HV, Hk, K, V, L, torch.float32, torch.bfloat16, kda, read_copy=read_copy)
    state = torch.randn(bs, HV, K, V, device="cuda")
    ring = spec.allocate(bs, "cuda")
    for t in ring[:3]:
        t.normal_()
    ring[2].neg_().abs_().neg_()
    if read_copy:
        spec.sync_copy(state, ring)
    q = torch.nn.functional.normalize(torch.randn(bs, Hk, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(bs, Hk, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(bs, HV, V, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand((bs, HV, K) if kda else (bs, HV), device="cuda") * 0.1
    beta = torch.rand(bs, HV, device="cuda")
    if read_copy:
        enc = as_copy(read_copy, state, ring[5:8])
        step = lambda: delta_replay_step_readcopy_triton(  # noqa: E731
            state, enc, read_copy, *ring[:5], ring[-1], q, k, v, g, beta, None)
    else:
        step = lambda: delta_replay_step_triton(state, *ring[:3], ring[-1], q, k, v, g, beta, None)  # noqa: E731
    profile_steps(step, ring[-1], L)


DELTA_GEOMS = {"qwen35_4b": (16, 32, 128, 128, False), "kimi_linear": (32, 32, 128, 128, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geoms", default="super,nano")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--breakdown-only", action="store_true", help="only the pre step's per-launch times")
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the Mamba-2 checkpoint's dtype (streams and breakdowns)")
    ap.add_argument("--delta", default="", help="comma list of qwen35_4b,kimi_linear: delta-rule breakdowns (exact "
                    "and fp8 read copy) instead of the Mamba-2 ones")
    ap.add_argument("--delta-configs", default="split", help="';'-separated delta_triton TUNING strings (parse_tuning) "
                    "of the exact step, one breakdown each")
    ap.add_argument("--delta-read-copy", default="fp8_e4m3", help="also break down this read copy ('' for none)")
    ap.add_argument("--delta-rc-configs", default="rc", help="';'-separated delta_readcopy_triton TUNING strings "
                    "(parse_tuning; the name before ':' is ignored) of the read-copy step, one breakdown each")
    ap.add_argument("--read-copy", default="", help="Mamba-2 read-copy breakdowns of this format instead")
    ap.add_argument("--rc-configs", default="", help="';'-separated mamba2_readcopy_triton.tuned strings, one "
                    "read-copy breakdown each ('' = the defaults)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)} torch {torch.__version__} triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write) {bw / 1e12:.2f} TB/s")
    for gname in filter(None, args.delta.split(",")):
        Hk, HV, K, V, kda = DELTA_GEOMS[gname]
        from replay_compile.kernels import delta_triton as kd
        from replay_compile.kernels.tuning import tuned
        for spec in filter(None, args.delta_configs.split(";")):
            print(f"{gname} bs{args.batch} fp32 state [{args.batch}, {HV}, {K}, {V}], exact, {spec}")
            with tuned(kd.TUNING, spec):
                reported(spec, delta_breakdown, Hk, HV, K, V, kda, args.batch)
        from replay_compile.kernels import delta_readcopy_triton as drt
        for spec in filter(None, args.delta_rc_configs.split(";")) if args.delta_read_copy else ():
            print(f"{gname} bs{args.batch} fp32 state, read copy {args.delta_read_copy}, {spec}")
            with tuned(drt.TUNING, spec):
                reported(spec, delta_breakdown, Hk, HV, K, V, kda, args.batch, read_copy=args.delta_read_copy)
    if args.delta:
        return
    if args.read_copy:
        from replay_compile.kernels import mamba2_readcopy_triton as rct
        for gname in args.geoms.split(","):
            H, P, N, G = GEOMS[gname]
            for spec in args.rc_configs.split(";"):
                print(f"{gname} bs{args.batch} fp32 state, read copy {args.read_copy}, {spec or 'defaults'}")
                with rct.tuned(spec):
                    reported(spec, readcopy_breakdown, args.batch, H, P, N, G, args.read_copy)
        return
    sdt = getattr(torch, args.state_dtype)
    for gname in args.geoms.split(","):
        H, P, N, G = GEOMS[gname]
        print(f"{gname} bs{args.batch} {args.state_dtype} state [{args.batch}, {H}, {P}, {N}]")
        if not args.breakdown_only:
            stream_ceiling(args.batch, H, P, N, G, bw, sdt)
        launch_breakdown(args.batch, H, P, N, G, state_dtype=sdt)


if __name__ == "__main__":
    main()
