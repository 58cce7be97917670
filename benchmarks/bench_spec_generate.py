"""End-to-end speculative generation (``replay_compile.speculative.generate_speculative``) against decoding without
drafts, compiled on both sides.

    python benchmarks/bench_spec_generate.py --out bench-results/spec_generate [--models nemotron_h_nano4b,qwen35_4b]
        [--layers N] [--gpus N]

Real-size layer dimensions (``replay_compile.bench``'s models, random weights, full depth or the first ``--layers``
blocks), a repetitive prompt set (a random ``--phrase``-token phrase repeated ``--repeats`` times per row), greedy
decoding of ``--new`` tokens. Every variant's attention layers hold a static cache of ``--context`` positions. With
the decode-attention rewrite (the default) a step reads only the filled positions (the prompt and the tokens so far),
so the attention costs what the prompt's length says; with ``REPLAY_COMPILE_DECODE_ATTENTION=off`` transformers'
attention reads every static position, the cost of a ``--context``-token prompt without its prefill. A longer prompt
(``--phrase`` x ``--repeats``) costs its prefill, transformers' PyTorch path at full batch. Per model and batch, in
one process:

* ``decode``: the compiled decode step without drafts (``backend="replayssm"``, ``mode="reduce-overhead"``): the
  baseline the ratios are against, its time per step with the steps queued on the device as the rounds of a burst
  are (``replay_compile.bench.queued_steps``; on CPU the median synchronised step); ``sync_ms``: the median step of
  a loop that synchronises after every token, which also pays the host's work before each launch;
* ``lookup``: compiled speculative rounds with prompt-lookup drafts (3 per round). With random weights the model
  never repeats the prompt, so nothing is accepted: this row measures the cost of verifying drafts that fail. With
  ``--train-copy STEPS`` each model is first trained (fp32 weights, forward passes under bf16 autocast on CUDA, at
  most STEPS AdamW steps; the MLP blocks held fixed unless ``--copy-params all``) on the copy task of
  ``replay_compile.testing.copy_task`` until it continues a repeated
  phrase (retried once at a third of the learning rate if it has not learned), and the prompts become a
  ``--copy-phrase``-token phrase of ids < ``--copy-vocab`` repeated twice: prompt lookup then meets the repetitive
  text it is meant for;
* ``oracle``: compiled speculative rounds drafting their own output (every draft accepted; found by re-drafting
  each run's output until a run reproduces it, ``--oracle-iters``: in bf16 a token depends on the window position a
  verify computes it at, through near-ties of the argmax): the upper bound a good draft source reaches;
* ``accept-all``: compiled rounds with prompt-lookup drafts, every draft accepted by force (the round's
  acceptance is replaced by one that keeps all ``k`` drafts and the model's token after them; the argmax is still
  computed): exactly the work of rounds with perfect drafts, ``T`` tokens per round. Its tokens are not the model's;
  the oracle row is the honest acceptance, which in bf16 falls short of ``T`` (below);
* ``snapshot``: the same oracle rounds with the per-draft snapshot baseline in place of the replay verify
  (``spec_baselines.snapshot_layers``: ``T + 1`` states per sequence, one read and ``T`` writes per round), compiled
  the same way: the speculative decoding an engine without replay runs;
* ``snapshot-all``: the per-draft snapshot baseline with every draft accepted by force, as ``accept-all``: the
  baseline's cost for exactly the work of the ``accept-all`` row (its ``x snapshot`` ratio), which needs neither the
  lookup row nor an oracle fixed point;
* ``draft``: compiled rounds with a ``DraftModel`` proposer (a random-weight Llama of ``--draft-model`` size over the
  target's vocabulary): its drafts are as good as chance, so the row is the cost of proposing with a draft model.

Each speculative row times a call of ``--new`` tokens after a first call that compiled and captured its round. The
replay rows call one ``SpeculativeGenerator`` as a serving loop would, so the timed call prefills into the kept cache
and replays the kept graph from its first round (``warmup`` 0; ``reused`` 1); the snapshot rows go through
``generate_rounds`` without it, warm-up rounds and capture included. ``tok/s``: the steady state, tokens emitted by
the replayed rounds over their time (``SpeculativeOutput.timing``; ``decode``'s per-step median is the same kind of
figure), with ``ms/round``; ``call tok/s``: the whole call (prefill, any warm-up rounds and capture, and the final
fold included), with ``prefill``, ``warmup`` and ``finish`` (the rings folded into the cache; ``finish_replayed``
1 where the fold replayed the graph the generator captured after its first call) in seconds, and its
``x decode`` against a decode call of as many tokens: the same prompt's prefill (timed on its own, ``prefill`` in
the decode row) plus ``--new`` decode steps. Also
tokens per round and the share of tokens equal to the lookup row's (exactness against ``generate`` is the tests'
business, in fp32), and the first call's seconds (``first``: compile,
capture, and for the oracle rows the runs that found its drafts). The CSV grows row by row; a PNG of tokens/s
against batch at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import time
from unittest import mock

import torch

VARIANTS = ("lookup", "accept-all", "oracle", "snapshot", "snapshot-all", "draft")


def _timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def _prefill_seconds(model, ids, cache_len: int) -> float:
    """Seconds of the prompt's prefill into a fresh static cache of ``cache_len`` positions, as a decode call pays
    it (transformers' forward over the prompt; the second of two runs, so the first run's one-time set-up is not
    counted)."""
    from transformers import StaticCache

    from replay_compile.bench import cache_kwarg

    pos = torch.arange(ids.shape[1], device=ids.device)
    seconds = float("nan")
    with torch.no_grad():
        for _ in range(2):
            cache = StaticCache(config=model.config, max_cache_len=cache_len)
            _, seconds = _timed(lambda: model(ids, use_cache=True, cache_position=pos, **{cache_kwarg(model): cache}))
            cache = None
    return seconds


def _trainable(name: str, device, layers):
    """The fp32 model to train on the copy task: the tiny test models are built with a large init (0.5, for
    numerically demanding parity tests) that does not train; give them the usual 0.02."""
    from replay_compile.bench import build_model

    if name.startswith("tiny_"):
        from replay_compile.testing.hf_models import DELTA_FAMILY, MAMBA2_FAMILY
        return {**MAMBA2_FAMILY, **DELTA_FAMILY}[name[5:]](dtype=torch.float32, initializer_range=0.02).to(device)
    return build_model(name, torch.float32, device, layers=layers)


def _train(name: str, args):
    """The fp32 model trained on the copy task at the default learning rate, or, where it has not learned (copy
    accuracy < 0.5: the rate is a guess at large widths, see ``copy_task.default_lr``), a fresh one at a third of
    it. Returns the model and ``train_copy``'s result (with the rate used)."""
    from replay_compile.testing.copy_task import default_lr, train_copy

    lr = None
    for attempt in range(2):
        model = _trainable(name, args.device, args.layers)
        lr = default_lr(model) if lr is None else lr / 3
        trained = train_copy(model, args.train_copy, phrase_len=args.copy_phrase, vocab=args.copy_vocab,
                             batch=args.copy_batch, lr=lr, check_every=25,
                             autocast_dtype=torch.bfloat16 if args.device == "cuda" else None,
                             freeze_mlps=args.copy_params == "no-mlp",
                             log=lambda s: print(f"# {name} (lr {lr:.1e}): {s}", flush=True))
        if trained["copy_acc"] >= 0.5 or attempt == 1:
            return model, trained
        print(f"# {name}: copy accuracy {trained['copy_acc']:.3f} at lr {lr:.1e}: retrying at {lr / 3:.1e}",
              flush=True)
        model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _accept_all_rounds():
    """:class:`~replay_compile.speculative.rounds.Rounds` whose acceptance keeps every draft (the ``accept-all``
    rows)."""
    from replay_compile.speculative.rounds import Rounds

    class AcceptAll(Rounds):
        def accept(self, logits, drafts):
            ok, pred = super().accept(logits, drafts)            # the argmax stays in the round
            return torch.full_like(ok, self.k), torch.cat([drafts, pred[:, self.k:]], dim=1)

    return AcceptAll


def _fixed_point(generate, seqs, iters: int):
    """Sequences that a run drafting them reproduces exactly, so that every draft is accepted: in bf16 a token
    depends on which window position a verify computes it at (near-ties of the argmax), so a run drafting another
    run's output can reject a draft where the acceptance pattern differs. Re-drafting from each run's own output
    moves every row's first disagreement forward; stops when nothing changes (or after ``iters`` runs)."""
    from replay_compile.testing.drafts import known_continuation

    for i in range(iters):
        out = generate(known_continuation(seqs))
        same = out.shape[1] <= seqs.shape[1] and torch.equal(out, seqs[:, :out.shape[1]])
        seqs = out
        if same:
            print(f"# oracle drafts reproduced after {i + 1} runs", flush=True)
            return seqs
    print(f"# oracle drafts not a fixed point after {iters} runs: some rows reject some drafts", flush=True)
    return seqs


def _draft_model(spec: str, vocab: int, dtype, device):
    """A random-weight Llama of ``spec`` = "hidden,layers" over the target's vocabulary (its drafts are as good as
    chance: the row measures what proposing costs), or None."""
    if not spec:
        return None
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = map(int, spec.split(","))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def main(argv=None):
    from spec_baselines import snapshot_layers

    from replay_compile import bench
    from replay_compile.bench import build_model
    from replay_compile.speculative import DraftModel, PromptLookup, SpeculativeGenerator
    from replay_compile.speculative import generate as generate_module
    from replay_compile.speculative.generate import generate_rounds
    from replay_compile.testing.copy_task import copy_batch
    from replay_compile.testing.drafts import known_continuation

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="nemotron_h_nano4b,qwen35_4b")
    ap.add_argument("--batches", default="1,32,256,512")
    ap.add_argument("--layers", type=int, default=0, help="the first N blocks (0: full depth)")
    ap.add_argument("--context", type=int, default=1024,
                    help="static cache positions of every variant (at least what the prompt and new tokens need)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--budget", type=int, default=16,
                    help="history budget of the replay rings (generate_speculative's buffer_len): records held before "
                         "a verify folds them; a larger budget flushes less often and reads more records per verify")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--train-copy", type=int, default=0, metavar="STEPS",
                    help="train each model on the copy task first (at most STEPS steps; 0: random weights)")
    ap.add_argument("--copy-vocab", type=int, default=128,
                    help="ids of the copy task's phrases (128 and phrases of 8: what the CPU runs learn in a few "
                         "hundred steps; 1000 and 16 stayed at chance for 600 steps on a 4B-sized model)")
    ap.add_argument("--copy-phrase", type=int, default=8)
    ap.add_argument("--copy-batch", type=int, default=48)
    ap.add_argument("--copy-params", choices=("no-mlp", "all"), default="no-mlp",
                    help="what the copy task trains: every parameter but the MLP blocks' (default; Qwen3.5-4B dims "
                         "then train in ~50 GB instead of ~78 GB) or all")
    ap.add_argument("--variants", default="lookup,accept-all,oracle,snapshot,draft")
    ap.add_argument("--phrase", type=int, default=8, help="random prompts: a phrase of this many tokens ...")
    ap.add_argument("--repeats", type=int, default=4, help="... repeated this many times")
    ap.add_argument("--draft-model", default="1024,4",
                    help="hidden size and layers of the random-weight Llama draft model (16 heads, 4 KV heads, the "
                         "target's vocabulary); empty: no draft-model row")
    ap.add_argument("--oracle-iters", type=int, default=6,
                    help="runs re-drafting their own output until every oracle draft is accepted")
    ap.add_argument("--profile", action="store_true",
                    help="also the device time per step / replayed round by kernel category (torch.profiler): the "
                         "decode step's, and each speculative variant's from two calls of --new / 2 and --new tokens "
                         "(their difference: replayed rounds only); printed and written to spec_profile.csv")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--gpus", type=int, default=1,
                    help="spread the (model, batch) points over N GPUs of this host, one worker process per GPU "
                         "(CUDA_VISIBLE_DEVICES); one merged CSV and PNG (worker logs under OUT/worker<k>)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="stop after S seconds and still merge the (model, batch) groups that finished (each group "
                         "then runs as a worker process, also on one GPU; the groups cut or skipped are listed)")
    args = ap.parse_args(argv)
    if args.gpus > 1 or args.time_limit is not None:
        return _run_parallel(args, sys.argv[1:] if argv is None else list(argv))
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"bench_spec_generate: unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if ("oracle" in args.variants or "snapshot" in args.variants) and "lookup" not in args.variants:
        raise SystemExit("bench_spec_generate: the oracle and snapshot rows draft the lookup row's output: add lookup "
                         "to --variants")
    if args.profile and args.device != "cuda":
        raise SystemExit("bench_spec_generate: --profile reads CUDA kernel times; it needs --device cuda")
    _AcceptAll = _accept_all_rounds()
    compiler = (lambda fn: torch.compile(fn, backend="replayssm"))      # the rounds capture their own CUDA graph
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    rows = []
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    import transformers
    print(f"# {dev_name}, torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}, "
          f"{args.layers or 'all'} layers, {args.new} new tokens, {args.num_draft} drafts per round, history budget "
          f"{args.budget}, static caches "
          f"of >= {args.context} positions"
          + (f", models trained on the copy task (<= {args.train_copy} steps, phrases of {args.copy_phrase} over "
             f"{args.copy_vocab} ids)" if args.train_copy else ""))
    print(f"{'model':18} {'bs':>3} {'variant':8} {'tok/s':>10} {'x decode':>8} {'ms/round':>8} {'tok/round':>9} "
          f"{'call tok/s':>9} {'x decode':>8} {'prefill':>6} {'warmup':>6} {'finish':>6} {'agree':>6} {'first':>6}")
    csv_path = os.path.join(args.out, "spec_generate.csv")
    for stale in (csv_path, os.path.join(args.out, "spec_profile.csv")):
        if os.path.exists(stale):
            os.remove(stale)
    for name in args.models.split(","):
        trained = None
        if args.train_copy:
            model, trained = _train(name, args)
            model = model.to(dtype)
        else:
            model = build_model(name, dtype, args.device, layers=args.layers or None)
        vocab = model.config.vocab_size
        drafter = _draft_model(args.draft_model, vocab, dtype, args.device) if "draft" in args.variants else None
        for bs in map(int, args.batches.split(",")):
            g = torch.Generator().manual_seed(bs)
            if trained:
                ids = copy_batch(bs, args.copy_phrase, reps=2, vocab=min(args.copy_vocab, vocab), generator=g,
                                 device=args.device)
            else:
                ids = torch.randint(3, vocab, (bs, args.phrase), generator=g).repeat(1, args.repeats).to(args.device)
            extra = dict(copy_steps=trained["steps"] if trained else 0,
                         copy_acc=trained["copy_acc"] if trained else float("nan"))
            # the same cache length on every side: the rounds' need (prompt, new tokens, scratch) or the context
            cache_len = max(args.context, ids.shape[1] + args.new + 2 * (args.num_draft + 1)
                            + (bench.PROFILE_STEPS if args.profile else 0) + DECODE_QUEUED)
            step = bench.bench_one(model, bs, "replayssm-ro", args.new, 16, prompt_len=ids.shape[1],
                                   cache_len=cache_len, profile=args.profile,
                                   queued=DECODE_QUEUED if args.device == "cuda" else 0)
            if args.profile:
                _emit_profile(name, bs, "decode", step.get("profile", {}), 1.0, args.out)
            # the baseline is the decode step queued as the rounds are (the host runs ahead; the rounds of a burst
            # are replayed with no read between them); the step of a loop synchronising after each token is slower
            dec_ms = step["median_step_ms"] if math.isnan(step["queued_ms"]) else step["queued_ms"]
            dec_tps = bs / (dec_ms * 1e-3)
            # a whole decode call pays the prompt's prefill too, as a speculative call does: the call-level baseline
            prefill_s = _prefill_seconds(model, ids, cache_len)
            dec_call_tps = bs * args.new / (prefill_s + args.new * dec_ms * 1e-3)
            _emit(rows, csv_path, dict(model=name, bs=bs, variant="decode", cache_len=cache_len, tok_s_rounds=dec_tps,
                                       x_decode=1.0, tok_s_call=dec_call_tps, x_decode_call=1.0,
                                       tok_round=1.0, ms_round=dec_ms, sync_ms=step["median_step_ms"],
                                       prefill_s=prefill_s, warmup_s=float("nan"), finish_s=float("nan"),
                                       reused=float("nan"), finish_replayed=float("nan"), agree=1.0,
                                       first_s=step["first_step_s"], **extra))
            print(f"{name:18} {bs:3d} {'decode':8} {dec_tps:10.1f} {1.0:7.2f}x {dec_ms:8.2f} "
                  f"{1.0:9.2f} {dec_call_tps:9.1f} {1.0:7.2f}x {prefill_s:6.3f} {'':>6} {'':>6} {'':>6} "
                  f"{step['first_step_s']:6.1f}  (synchronised after every step: {step['median_step_ms']:.2f} ms)",
                  flush=True)
            ref = None                          # the lookup run's tokens at 2N: what the oracle rows draft
            round_tps = {}
            for variant in VARIANTS:
                if variant not in args.variants or variant == "draft" and drafter is None:
                    continue
                layers_for = snapshot_layers if variant.startswith("snapshot") else None
                accept_all = variant in ("accept-all", "snapshot-all")

                served = {}                     # the variant's generator, for the draft source it was made with

                def run(new, draft):
                    with (mock.patch.object(generate_module, "Rounds", _AcceptAll) if accept_all
                          else contextlib.nullcontext()):
                        if layers_for is None:
                            if served.get("draft") is not draft:        # one generator at a time: its buffers
                                served.clear()
                                served.update(draft=draft, gen=SpeculativeGenerator(
                                    model, num_draft=args.num_draft, draft=draft, buffer_len=args.budget,
                                    compile=True, eos_token_id=[], max_cache_len=cache_len))
                            return served["gen"](ids, new)
                        return generate_rounds(model, ids, new, num_draft=args.num_draft, draft=draft,
                                               buffer_len=args.budget, compiler=compiler, eos=[], layers_for=layers_for,
                                               cuda_graph=args.device == "cuda", max_cache_len=cache_len)
                t_first = time.perf_counter()
                if variant in ("lookup", "accept-all", "snapshot-all"):
                    draft = PromptLookup(ngram=3)
                elif variant == "draft":
                    draft = DraftModel(drafter)
                else:
                    draft = known_continuation(_fixed_point(lambda d: run(args.new, d).sequences, ref,
                                                            args.oracle_iters))
                run(args.new, draft)                                      # compile, capture
                t_first = time.perf_counter() - t_first
                out, t = _timed(lambda: run(args.new, draft))
                if ref is None:
                    ref = out.sequences
                agree = float((out.sequences == ref).float().mean())
                tm = out.timing
                if args.profile:
                    cats, rounds = _round_profile(run, draft, args.new)
                    _emit_profile(name, bs, variant, cats, rounds, args.out)
                tps = bs * args.new / t
                tps_r = tm["replay_tokens"] / tm["replay"] if tm["replay"] > 0 else float("nan")
                _emit(rows, csv_path, dict(model=name, bs=bs, variant=variant, cache_len=cache_len, tok_s_rounds=tps_r,
                                           x_decode=tps_r / dec_tps, tok_s_call=tps, x_decode_call=tps / dec_call_tps,
                                           tok_round=out.tokens_per_round,
                                           ms_round=1e3 * tm["replay"] / max(tm["replay_rounds"], 1),
                                           sync_ms=float("nan"), prefill_s=tm["prefill"], warmup_s=tm["warmup"],
                                           finish_s=tm["finish"], reused=tm.get("reused", 0.0),
                                           finish_replayed=tm.get("finish_replayed", 0.0), agree=agree,
                                           first_s=t_first, **extra))
                print(f"{name:18} {bs:3d} {variant:8} {tps_r:10.1f} {tps_r / dec_tps:7.2f}x "
                      f"{1e3 * tm['replay'] / max(tm['replay_rounds'], 1):8.2f} {out.tokens_per_round:9.2f} "
                      f"{tps:9.1f} {tps / dec_call_tps:7.2f}x {tm['prefill']:6.3f} {tm['warmup']:6.3f} "
                      f"{tm['finish']:6.3f} {agree:6.3f} {t_first:6.1f}", flush=True)
                round_tps[variant] = tps_r
                out = None
                served.clear()
            for ours, base in (("accept-all", "snapshot-all"), ("oracle", "snapshot")):
                if ours in round_tps and base in round_tps:
                    print(f"# {name} bs {bs}: {ours} / {base} = {round_tps[ours] / round_tps[base]:.2f}x", flush=True)
        model = drafter = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _plot(rows, os.path.join(args.out, "spec_generate.png"))


DECODE_QUEUED = 32      # decode steps queued without synchronisation: the baseline's step time (bench.queued_steps)

PER_WORKER = ("--gpus", "--out", "--models", "--batches", "--time-limit")


def worker_argv(argv: list[str]) -> list[str]:
    """The command line less the options each ``--gpus`` worker gets of its own (``--opt value`` or
    ``--opt=value``)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in PER_WORKER:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in PER_WORKER)):
            rest.append(a)
    return rest


def _run_parallel(args, argv: list[str]) -> None:
    """``--gpus N``: every (model, batch) point to one of N workers (``bench_parallel.shard_points``: largest batches
    first, to the least-loaded), each worker running its points' ``(model, batches)`` groups one after another as this
    script on its own GPU (``bench_parallel.run_units``); then the groups' rows merged into ``OUT/spec_generate.csv``
    (and ``spec_profile.csv``) and the PNG. Points never share a GPU, so their timings are those of separate runs."""
    from replay_compile.bench_parallel import Unit, read_rows, run_units, shard_points

    rest = worker_argv(argv)
    os.makedirs(args.out, exist_ok=True)
    shards = [[Unit(f"{model} batches {batches}", os.path.join(args.out, f"worker{k}", f"group{i}"),
                    [sys.executable, os.path.abspath(__file__), *rest, "--models", model,
                     "--batches", ",".join(map(str, batches)),
                     "--out", os.path.join(args.out, f"worker{k}", f"group{i}")])
               for i, (model, batches) in enumerate(shard)]
              for k, shard in enumerate(shard_points(args.models.split(","),
                                                     [int(b) for b in args.batches.split(",")], args.gpus))]
    failed = run_units(shards, args.time_limit)
    rows = []
    for name in ("spec_generate.csv", "spec_profile.csv"):
        parts = [os.path.join(u.out, name) for shard in shards for u in shard]
        merged = [r for part in parts if os.path.exists(part) for r in read_rows(part)]
        if merged:
            with open(os.path.join(args.out, name), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(merged[0]))
                w.writeheader()
                w.writerows(merged)
        if name == "spec_generate.csv":
            rows = merged
    merged_csv = os.path.join(args.out, "spec_generate.csv")
    print(f"# {len(rows)} rows from {sum(map(bool, shards))} workers into {merged_csv}")
    for line in failed:
        print(f"# {line}", file=sys.stderr)
    _plot(rows, os.path.join(args.out, "spec_generate.png"))
    if failed:
        raise SystemExit(1)


def _round_profile(run, draft, new: int) -> tuple[dict, float]:
    """Device milliseconds by kernel category summed over the replayed rounds of a ``new``-token call, less those of a
    ``new // 2``-token call (prefill, warm-up rounds and capture are the same in both), and the rounds between."""
    import torch

    from replay_compile.bench import by_category, kernel_times

    def profiled(n):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = run(n, draft)
            torch.cuda.synchronize()
        return kernel_times(prof), out.timing["replay_rounds"]

    # a call of new // 2 tokens has shapes of its own (the token buffer), so it is compiled once outside the profile:
    # profiled cold, its compilation's device work made the differences negative (Qwen3.5-4B dims, batch 256: an
    # int32 fill of -12.8 ms per round and Inductor kernels of -8.7 ms, a 31.7 ms round summing to 8.1 ms)
    run(new // 2, draft)
    short, r0 = profiled(new // 2)
    full, r1 = profiled(new)
    rounds = float(r1 - r0)
    diff = {k: full.get(k, 0.0) - short.get(k, 0.0) for k in full | short}
    for k in sorted(diff, key=lambda k: abs(diff[k]), reverse=True)[:16]:       # a negative one is a difference too
        print(f"#     {diff[k] / max(rounds, 1):7.3f} ms/round  {k[:100]}", flush=True)
    return by_category(diff), rounds


def _emit_profile(model: str, bs: int, variant: str, cats: dict, rounds: float, out_dir: str) -> None:
    """Print and append one profile row: device ms per step or replayed round by category."""
    from replay_compile.bench import PROFILE_CATEGORIES

    names = [c for c, _ in PROFILE_CATEGORIES] + ["other"]
    per = {c: cats.get(c, 0.0) / rounds if rounds > 0 else float("nan") for c in names}
    total = sum(per.values())
    print(f"#   {variant} device ms per {'step' if variant == 'decode' else 'round'}: {total:.2f} = "
          + ", ".join(f"{c} {v:.2f}" for c, v in per.items() if v > 0.005), flush=True)
    path = os.path.join(out_dir, "spec_profile.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["model", "bs", "variant", "rounds", "device_ms"] + names)
        w.writerow([model, bs, variant, rounds, total] + [per[c] for c in names])


def _emit(rows: list, path: str, row: dict) -> None:
    """Keep ``row`` and append it to the CSV at once (a run stopped part-way keeps what it measured); every row has
    the first row's columns, in its order."""
    if rows and list(row) != list(rows[0]):
        raise AssertionError(f"bench_spec_generate: row columns {list(row)} differ from the CSV's {list(rows[0])}")
    new = not os.path.exists(path)
    rows.append(row)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)


def _plot(rows, path):
    """Steady-state tokens/s against batch, one panel per model, one line per variant (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot")
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:                                   # every point failed or was cut: nothing to draw
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "generate"):
            pts = sorted((r["bs"], r["tok_s_rounds"]) for r in rows if r["model"] == name and r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title=name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
