"""Greedy parity of a head-sharded (tensor-parallel) hybrid model: TP=N vs TP=1 vs eager.

:func:`tp_parity` starts ``world`` processes (gloo on CPU, NCCL on CUDA with one GPU per rank). Every rank builds the
same tiny random model (:mod:`replay_compile.testing.hf_models`) and greedy-decodes the same prompt four ways:

* ``eager``: the unsharded model, eagerly (the reference);
* ``tp1``: the unsharded model compiled with ``backend="replayssm"`` (rank 0 only);
* ``tpN_eager``: the model sharded by :func:`replay_compile.tensor_parallel.parallelize_hybrid`, eagerly;
* ``tpN``: the sharded model compiled with ``backend="replayssm"``, one compile per rank.

Rank 0 compares tokens, logits at every step and the recurrent states left in the cache after ``generate`` (the
sharded ones gathered over the ranks, heads in order) with the reference, and returns the summary. Also runnable as
``python -m replay_compile.testing.tp_parity FAMILY [--device cuda] [--world 2]``.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recurrent_states(cache) -> list[torch.Tensor]:
    """The recurrent-state tensors of an HF cache, layer by layer ([B, heads, ...], heads sharded under TP)."""
    out = []
    for layer in getattr(cache, "layers", []):
        rs = getattr(layer, "recurrent_states", None)       # {state_idx: tensor} in transformers 5.x
        for t in (rs.values() if isinstance(rs, dict) else rs if isinstance(rs, (list, tuple)) else [rs]):
            if isinstance(t, torch.Tensor) and t.dim() >= 3:
                out.append(t)
    return out


def _conv_states(cache) -> list[torch.Tensor]:
    """The conv-state tensors of an HF cache, layer by layer."""
    out = []
    for layer in getattr(cache, "layers", []):
        cs = getattr(layer, "conv_states", None)
        out += [t for t in (cs.values() if isinstance(cs, dict) else []) if isinstance(t, torch.Tensor)]
    return out


def _generate(model, ids, steps: int) -> dict:
    from .. import state as replay_state
    from ..integrations.hf_modules import output_cache

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    cache = output_cache(out)
    replay_state.flush(cache)
    return dict(tokens=out.sequences.cpu(), logits=torch.stack(out.logits).double().cpu(),
                states=_recurrent_states(cache))


def _compiled(model, buffer_len: int, lower: str):
    model.forward = torch.compile(model.forward, backend="replayssm", options={"buffer_len": buffer_len,
                                                                              "lower": lower})
    return model


def _gather_heads(states: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch.distributed as dist

    full = []
    for t in states:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        full.append(torch.cat(parts, dim=1).double().cpu())
    return full


def _compare(ref: dict, got: dict, states: list[torch.Tensor]) -> dict:
    from ..passes.validate import rel_err

    same = torch.equal(ref["tokens"], got["tokens"])
    n = min(len(ref["logits"]), len(got["logits"]))
    logit = float((ref["logits"][:n] - got["logits"][:n]).abs().max()) / max(float(ref["logits"].abs().max()), 1.0)
    ref_states = [t.double().cpu() for t in ref["states"]]
    shapes_ok = [a.shape for a in ref_states] == [b.shape for b in states]
    state = max((rel_err(b, a) for a, b in zip(ref_states, states)), default=float("inf")) if shapes_ok else \
        float("inf")
    return dict(tokens_match=same, rel_logit_diff=logit, max_state_rel_err=state, states_compared=len(states))


def _worker(rank: int, world: int, port: int, family: str, device_type: str, steps: int, batch: int,
            buffer_len: int, dtype_name: str, lower: str, result_path: str, timeout_s: float) -> None:
    import datetime
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    faulthandler.dump_traceback_later(max(timeout_s - 15, 1), exit=False)   # where a slow or stuck rank is

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    # a collective entered by only some ranks raises after this long instead of hanging the run
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        import replay_compile  # noqa: F401 - registers the backend in this process

        from .. import backend as rb
        from ..tensor_parallel import parallelize_hybrid
        from .hf_models import DELTA_FAMILY, MAMBA2_FAMILY, make_inputs

        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        build = {**MAMBA2_FAMILY, **DELTA_FAMILY}[family]
        dtype = getattr(torch, dtype_name)
        ref_model = build(dtype=dtype, seed=0).to(device)
        ids = make_inputs(ref_model, batch=batch, prompt_len=5).to(device)
        eager = _generate(ref_model, ids, steps)
        result: dict = {"family": family, "world": world, "device": device_type, "steps": steps, "batch": batch,
                        "dtype": dtype_name, "buffer_len": buffer_len, "lower": lower}
        if rank == 0:
            tp1 = _generate(_compiled(ref_model, buffer_len, lower), ids, steps)
            result["tp1"] = _compare(eager, tp1, [t.double().cpu() for t in tp1["states"]])
            result["tp1"]["rewrites"] = sum(len(r.rewrites) for r in rb.reports())
        del ref_model
        rb.clear_reports()
        mesh = init_device_mesh(device_type, (world,))
        sharded = parallelize_hybrid(build(dtype=dtype, seed=0).to(device), mesh)
        tpn_eager = _generate(sharded, ids, steps)
        tpn_eager_states = _gather_heads(tpn_eager["states"])
        tpn = _generate(_compiled(sharded, buffer_len, lower), ids, steps)
        tpn_states = _gather_heads(tpn["states"])
        rewrites = [None] * world
        dist.all_gather_object(rewrites, sorted({str(r) for rep in rb.reports() for r in rep.rewrites}))
        if rank == 0:
            result[f"tp{world}_eager"] = _compare(eager, tpn_eager, tpn_eager_states)
            result[f"tp{world}"] = _compare(eager, tpn, tpn_states)
            result[f"tp{world}"]["rewrites_per_rank"] = rewrites
            with open(result_path + ".part", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(result_path + ".part", result_path)      # whole or absent
        # every rank past its last collective before any rank tears the group down: gloo closes its connections at
        # destroy, and a rank still receiving the last all_gather then dies in gloo's thread (SIGABRT, "terminate
        # called without an active exception"), seen once under CI's load
        dist.barrier()
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def tp_parity(family: str, world: int = 2, *, device: str = "cpu", steps: int | None = None, batch: int = 2,
              buffer_len: int = 16, dtype: str = "float32", lower: str = "inductor", timeout_s: float = 1200) -> dict:
    """Run the four decodes over ``world`` processes and return rank 0's comparison (see the module docstring).

    ``timeout_s``: the ranks are terminated and :class:`TimeoutError` raised after this long.
    ``lower``: the backend's lowering of the rewritten graph (``"eager"`` skips Inductor; faster on CPU).
    ``steps`` defaults to ``2 * buffer_len + 1`` (two flushes). Keys ``tp1``, ``tp{world}_eager``, ``tp{world}``,
    each with ``tokens_match``, ``rel_logit_diff`` (max over steps, relative to the largest logit),
    ``max_state_rel_err`` and ``states_compared``; ``tp{world}["rewrites_per_rank"]`` lists each rank's rewrites.
    """
    import torch.multiprocessing as mp

    steps = steps or 2 * buffer_len + 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        ctx = mp.spawn(_worker, args=(world, _free_port(), family, device, steps, batch, buffer_len, dtype, lower,
                                      path, timeout_s), nprocs=world, join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):          # raises ProcessRaisedException if a rank failed
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.terminate()
                    raise TimeoutError(f"tp_parity({family!r}, world={world}): ranks still running after "
                                       f"{timeout_s} s")
        except mp.ProcessExitedException:
            # Rank 0 writes the result only after every rank's last collective: a rank killed by a signal once it
            # exists died tearing down gloo (SIGABRT "terminate called without an active exception", seen under
            # CI's load despite the final barrier), after all its work was compared. Before that, it is a failure.
            if not os.path.exists(path):
                raise
            for p in ctx.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        with open(path) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("family", nargs="+", help="tiny model families, e.g. nemotron_h qwen3_5")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lower", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the ranks are stopped")
    args = p.parse_args(argv)
    results, ok = [], True
    for fam in args.family:
        r = tp_parity(fam, args.world, device=args.device, steps=args.steps, batch=args.batch, dtype=args.dtype,
                      lower=args.lower, timeout_s=args.timeout)
        results.append(r)
        for key in ("tp1", f"tp{args.world}_eager", f"tp{args.world}"):
            c = r[key]
            ok &= c["tokens_match"]
            print(f"{fam} {args.device} {args.dtype} {key:>9}: tokens {'identical' if c['tokens_match'] else 'DIFFER'}"
                  f", logits {c['rel_logit_diff']:.1e} rel, states {c['max_state_rel_err']:.1e} rel "
                  f"({c['states_compared']} layers)", flush=True)
        per_rank = r[f"tp{args.world}"]["rewrites_per_rank"]
        # parity without rewrites proves nothing
        ok &= r["tp1"]["rewrites"] > 0 and all(len(rw) > 0 for rw in per_rank)
        print(f"{fam} rewrites per rank: {per_rank}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
