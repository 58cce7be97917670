"""``replay-compile``: demo, verify, explain, env.

    replay-compile demo                 # the embedded tiny hybrid model, compiled vs eager
    replay-compile verify --family bamba --dtype bfloat16
    replay-compile verify --config path/to/config.json   # any transformers config, random weights
    replay-compile explain --family qwen3_5               # which layers are rewritten, which not, and why
    replay-compile bench --device cuda                    # decode-step benchmark, real-size hybrids (GPU)
    replay-compile env
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from .config import SUPPORTED_READ_COPIES

DEMO_FAMILY = "nemotron_h"
# the embedded tiny models (replay_compile.testing.hf_models; listed here so that --help needs no transformers import)
FAMILIES = ("nemotron_h", "bamba", "mamba2", "falcon_h1", "zamba2", "granitemoehybrid", "nemotron_h_omni", "qwen3_next",
            "qwen3_5", "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "lara_mini", "bailing_hybrid", "qwen4_exp",
            "glm5_next", "mamba", "falcon_mamba", "jamba", "zamba", "minimax")


def _torch_setup(threads: int | None):
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch


def _build(args):
    import torch

    from .testing.hf_models import DELTA_FAMILY, LIGHTNING_FAMILY, MAMBA1_FAMILY, MAMBA2_FAMILY, available, make_inputs
    builders = {**MAMBA2_FAMILY, **DELTA_FAMILY, **MAMBA1_FAMILY, **LIGHTNING_FAMILY}

    dtype = getattr(torch, args.dtype)
    if args.config:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(args.config)
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
        name = f"{type(model).__name__} from {args.config} (random weights)"
    else:
        if args.family not in builders:
            raise SystemExit(f"replay-compile: unknown family {args.family!r}; choose from {sorted(builders)}")
        if not available(args.family):
            import transformers
            raise SystemExit(f"replay-compile: family {args.family!r} is not in the installed transformers "
                             f"{transformers.__version__}; upgrade transformers or choose another family")
        model = builders[args.family](dtype=dtype, seed=args.seed)
        name = f"tiny {type(model).__name__} (embedded config, random weights, seed {args.seed})"
    ids = make_inputs(model, batch=args.batch, prompt_len=args.prompt_len, seed=args.seed)
    if args.device != "cpu":
        model, ids = model.to(args.device), ids.to(args.device)
        name += f" on {args.device}"
    return model, ids, name


def _run_check(args, title: str) -> int:
    torch = _torch_setup(args.threads)
    from .testing import check_equivalence

    if args.verbose:
        os.environ.setdefault("REPLAY_COMPILE_LOG", "info")
        from . import _logging

        _logging._configure_from_env()
    t0 = time.perf_counter()
    model, ids, name = _build(args)
    print(f"{title}: {name}")
    print(f"  torch {torch.__version__}, {args.dtype}, batch {ids.shape[0]}, prompt {ids.shape[1]} tokens, "
          f"{args.tokens} new tokens, L={args.buffer_len}, lowering {args.lower}, {args.cache} cache")
    options = {"lower": args.lower}
    if args.mode:
        options["mode"] = args.mode
    gen = {"cache_implementation": "static"} if args.cache == "static" else {}
    rep = check_equivalence(model, ids, max_new_tokens=args.tokens, buffer_len=args.buffer_len, options=options,
                            logit_rtol=args.logit_rtol, state_rtol=args.state_rtol, **gen)
    print("  " + rep.summary().replace("\n", "\n  "))
    print(f"  total {time.perf_counter() - t0:.1f}s")
    return 0 if rep.passed else 1


def explain_model(model, ids, buffer_len: int = 16) -> dict:
    """Compile ``model`` with the replayssm backend (eager lowering), run a prefill and two decode steps, and say
    per layer what the pass did: ``{layer: (verdict, detail)}`` with verdict "rewritten", "left unchanged" or
    "not a recurrence" (resets, window shifts and multi-token scans such as prefill: never rewritten by design)."""
    import torch

    from . import backend

    backend.clear_reports()
    original = model.forward
    model.forward = torch.compile(original, backend="replayssm",
                                  options={"lower": "eager", "buffer_len": buffer_len, "devices": ("cpu", "cuda")})
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        model.forward = original
        from . import state as replay_state
        replay_state.flush(model)
    verdicts = backend.layer_verdicts()
    return verdicts


def _explain(args) -> int:
    _torch_setup(args.threads)
    model, ids, name = _build(args)
    print(f"explain: {name}")
    verdicts = explain_model(model, ids, args.buffer_len)
    if not verdicts:
        print("  no recurrent-state write found in the compiled graphs (no SSM layer, or a form the pass does not "
              "anchor on)")
        return 1
    width = max(len(k) for k in verdicts)
    for layer in sorted(verdicts, key=_layer_key):
        verdict, detail = verdicts[layer]
        print(f"  {layer:<{width}}  {verdict:<16}  {detail}")
    n = sum(1 for v, _ in verdicts.values() if v == "rewritten")
    print(f"  {n} of {len(verdicts)} state-writing layers rewritten")
    return 0


def _bench(args) -> int:
    torch = _torch_setup(args.threads)
    from . import bench

    cuda = args.device.startswith("cuda")
    context = args.context if args.context is not None else (1024 if cuda else 0)
    if context < 0:
        raise SystemExit("replay-compile bench: --context must be >= 0")
    models = (args.models or ("nemotron_h_nano4b,qwen35_4b,mamba2_2p7b" if cuda else "tiny_nemotron_h")).split(",")
    batches = [int(b) for b in (args.batches or ("1,8,32,64,128,256,512" if cuda else "1,2")).split(",")]
    modes = (args.modes or (",".join(bench.MODES) if cuda else "eager,inductor,replayssm")).split(",")
    try:
        parts = {m: bench.split_mode(m) for m in modes}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    unknown = {m for m, (base, rc, _) in parts.items() if base not in bench.MODES
               or (rc and (not base.startswith("replayssm") or rc not in SUPPORTED_READ_COPIES))}
    if unknown:
        raise SystemExit(f"replay-compile bench: unknown modes {sorted(unknown)}; choose from {bench.MODES}, "
                         f"replayssm modes optionally with ':<read copy>' ({', '.join(SUPPORTED_READ_COPIES)}); "
                         "any mode optionally with '@<inductor option>=<value>,...'")
    lead = int(os.environ.get("RANK", "0")) == 0       # under torchrun (--tp) only rank 0 prints
    if lead:
        print(f"bench: {models} batches {batches} modes {modes}, {args.steps} decode steps, L={args.buffer_len}, "
              f"{args.dtype} on {args.device}, torch {torch.__version__}, context {context}" +
              (f", first {args.layers} layers only" if args.layers else "") +
              (f", TP={args.tp}" if args.tp > 1 else ""))
    if args.check:
        rows = bench.run_parity(models, args.check_batch, args.check, args.buffer_len, args.device, args.dtype,
                                args.layers, args.out, mode=modes[-1] if args.modes else
                                ("replayssm-ro" if cuda else "replayssm"), tp=args.tp)
        ok = all(r["tokens_agree"] == 1.0 for r in rows)
        return 0 if ok or args.dtype != "float32" else 1
    if args.rounds < 1:
        raise SystemExit("replay-compile bench: --rounds must be >= 1")
    if args.gpus > 1 or args.time_limit or args.cold_compile:
        if args.tp > 1 or args.check:
            raise SystemExit("replay-compile bench: --gpus / --time-limit / --cold-compile spread independent points "
                             "over worker processes; they do not combine with --tp or --check")
        from .bench_parallel import run_parallel
        # cold: each round is a process of its own (a second round in one process would compile warm)
        worker_rounds = 1 if args.cold_compile else args.rounds
        forward = ["--steps", str(args.steps), "--rounds", str(worker_rounds), "--buffer-len", str(args.buffer_len),
                   "--dtype", args.dtype,
                   "--device", args.device, "--context", str(context)] + \
                  (["--layers", str(args.layers)] if args.layers else []) + \
                  (["--threads", str(args.threads)] if args.threads else []) + \
                  (["--profile"] if args.profile else [])
        rows, failures = run_parallel(args.gpus, models, batches, modes, forward, args.out,
                                      time_limit=args.time_limit, cold=args.cold_compile, rounds=args.rounds)
        for line in failures:
            print(f"replay-compile bench: {line}", file=sys.stderr)
        print(f"wrote {os.path.join(args.out, 'bench.csv')} and bench.md ({len(rows)} rows from {args.gpus} workers)")
        return 0 if rows and not failures else 1
    rows = bench.run(models, batches, modes, args.steps, args.buffer_len, args.device, args.dtype, args.layers,
                     args.out, tp=args.tp, rounds=args.rounds, context=context, profile=args.profile)
    if lead:
        print(f"wrote {os.path.join(args.out, 'bench.csv')} and bench.md ({len(rows)} rows)")
    return 0 if rows else 1


def _layer_key(name: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch: the command will say so later
        return False


def _env(_args) -> int:
    import importlib

    print(f"{'python':<15} {platform.python_version()} ({platform.machine()}, {os.cpu_count()} cpus)")
    for mod in ("torch", "triton", "transformers", "torch_tensorrt", "hypothesis", "sympy"):
        try:
            m = importlib.import_module(mod)
            print(f"{mod:<15} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001 - report whatever stops the import (torch_tensorrt raises Exception)
            print(f"{mod:<15} not available ({type(e).__name__})")
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"{'device':<15} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    else:
        print(f"{'device':<15} cpu only")
    from . import __version__
    from .config import ENV_VARS, OTHER_ENV_VARS

    print(f"replay_compile {__version__}")
    for var in (*ENV_VARS, *OTHER_ENV_VARS):
        if var in os.environ:
            print(f"  {var}={os.environ[var]}")
    return 0


def _add_common(p: argparse.ArgumentParser, tokens: int):
    p.add_argument("--family", default=DEMO_FAMILY, metavar="FAMILY",
                   help=f"embedded tiny model family: {', '.join(FAMILIES)} (default: %(default)s)")
    p.add_argument("--config", help="a transformers config.json (or directory) to build with random weights")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=tokens, help="new tokens (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--buffer-len", type=int, default=16, help="L (default: %(default)s)")
    p.add_argument("--lower", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--mode", default=None, help="torch.compile mode for the lowering")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--cache", default="static", choices=["static", "dynamic"],
                   help="transformers cache: static (one decode graph; default) or dynamic (a graph per KV growth)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--logit-rtol", type=float, default=None,
                   help="max logit difference relative to the largest logit (default 1e-3 in float32; in bfloat16 / "
                        "float16 twice plain torch.compile's own difference from eager, at least 1e-2)")
    p.add_argument("--state-rtol", type=float, default=None, help="the same for the final cache states")
    p.add_argument("-v", "--verbose", action="store_true", help="log each rewrite and skip")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay-compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="compile the embedded tiny hybrid model and compare with eager")
    _add_common(demo, tokens=64)
    verify = sub.add_parser("verify", help="check any supported model: compiled vs eager over >= 2L+1 steps")
    _add_common(verify, tokens=33)
    explain = sub.add_parser("explain", help="which SSM layers the pass rewrites, which it leaves and why")
    _add_common(explain, tokens=3)
    b = sub.add_parser("bench", help="decode-step benchmark: eager / torch.compile / replayssm across batch sizes")
    b.add_argument("--models", help="comma list: nemotron_h_nano4b, qwen35_4b, mamba2_2p7b, tiny_<family> "
                                    "(default: the three real-size models on CUDA, tiny_nemotron_h on CPU)")
    b.add_argument("--batches", help="comma list (default 1..512 on CUDA, 1,2 on CPU)")
    b.add_argument("--modes", help="comma list of eager, inductor, inductor-ro, replayssm, replayssm-ro; replayssm "
                   "modes take an optional read copy, e.g. replayssm-ro:fp8_e4m3; any mode takes Inductor config "
                   "patches for its compile, e.g. replayssm@combo_kernels=1")
    b.add_argument("--steps", type=int, default=48, help="timed decode steps (default: %(default)s)")
    b.add_argument("--rounds", type=int, default=1,
                   help="run each (model, batch)'s modes this many times, in alternating order, and report the mean "
                        "(steadier ratios where the step is host-bound; compile time from the first round, or with "
                        "--cold-compile the mean of every round's cold compile, each round in processes of its own)")
    b.add_argument("--buffer-len", type=int, default=16)
    b.add_argument("--layers", type=int, default=None,
                   help="keep only the first N layers (default: full depth; say why in reports)")
    b.add_argument("--context", type=int, default=None, metavar="N",
                   help="decode after N cache positions (a short prefill, the rest filled with random keys and "
                        "values: what an N-token prompt costs a decode step; default 1024 on CUDA, 0 on CPU)")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--out", default="bench-results")
    b.add_argument("--profile", action="store_true",
                   help="also profile 8 steps per point (CUDA): device time per step by category (attention, KV "
                        "expand copy, SSM step, GEMM, ...), printed and written to profile.csv; every kernel's time "
                        "and launches per step to profile_kernels.csv")
    b.add_argument("--check", type=int, default=0, metavar="TOKENS",
                   help="instead of timing: greedy-decode TOKENS tokens eager and compiled (the last of --modes, "
                        "default replayssm-ro on CUDA) in lockstep and compare tokens and logits; exit 1 if an fp32 "
                        "run disagrees on any token")
    b.add_argument("--check-batch", type=int, default=4)
    b.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="spread the sweep's (model, batch) points over N GPUs of this host, one worker process per "
                        "GPU (CUDA_VISIBLE_DEVICES); one merged CSV, table and plots (worker logs under OUT/worker<k>)")
    b.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop the sweep after S seconds and still merge what finished (runs through the --gpus "
                        "workers, also for one GPU): the (model, batch) groups cut or skipped are listed")
    b.add_argument("--cold-compile", action="store_true",
                   help="run every (model, batch, mode) in a process of its own with empty Inductor and Triton "
                        "caches, so that 'first step s' is a cold compile for every mode (compile-time ratios)")
    b.add_argument("--tp", type=int, default=1, metavar="N",
                   help="shard every model over N ranks (tensor parallel); launch with torchrun --nproc-per-node N "
                        "-m replay_compile.cli bench --tp N ...")
    sub.add_parser("env", help="versions and devices")
    args = parser.parse_args(argv)
    if args.cmd == "env":
        return _env(args)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("replay-compile: this command needs transformers: pip install 'replay-compile[hf]'", file=sys.stderr)
        return 2
    if args.cmd == "explain":
        return _explain(args)
    if args.cmd == "bench":
        return _bench(args)
    return _run_check(args, "demo" if args.cmd == "demo" else "verify")


if __name__ == "__main__":
    sys.exit(main())
