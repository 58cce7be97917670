"""``replay-compile bench --gpus N``: the sweep's (model, batch) points spread over N GPUs of one host.

A full sweep (3 models x 7 batches x 5 modes) is mostly compile time, one compile per point and mode, and every point
is independent: N worker processes, each pinned to one GPU with ``CUDA_VISIBLE_DEVICES``, run their share of the
points one after another through the ordinary ``bench`` command (a model is built once per worker and model), and
the parent merges their rows into one CSV, table and set of plots. Timings stay per GPU: no two points ever share a
device. Each worker's output and log stay under ``OUT/worker<k>/``.

``--cold-compile``: every (model, batch, mode) runs in a process of its own with empty Inductor / Triton cache
directories, so each mode's first step is a cold compile (in one process the modes share caches and warm-up, and
whichever compiles first pays for both: compile-time ratios then depend on the run order). With ``--rounds R`` each
(model, batch) runs its modes R times that way, in alternating order, and reports the mean of the R cold first steps
(and of the step times): one cold compile of plain torch.compile ranged 12.5-20.3 s on the H200's host across
separate runs, so a compile-time ratio from one sample each says little.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from . import bench


def shard_points(models: list[str], batches: list[int], n: int) -> list[list[tuple[str, list[int]]]]:
    """Deal every (model, batch) point to one of ``n`` workers: largest batches first, each to the least-loaded
    worker (a point costs about one compile per mode plus its decode steps, weight ``1 + batch / 128``). Returns per
    worker its ``(model, batches)`` groups (one model build per group), in the given model order."""
    load = [0.0] * n
    got: list[dict[str, list[int]]] = [{} for _ in range(n)]
    points = sorted(((m, b) for m in models for b in batches), key=lambda p: (-p[1], models.index(p[0])))
    for m, b in points:
        k = min(range(n), key=lambda i: (load[i], i))
        load[k] += 1 + b / 128
        got[k].setdefault(m, []).append(b)
    return [[(m, sorted(w[m])) for m in models if m in w] for w in got]


def _value(s: str):
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def read_rows(path: str) -> list[dict]:
    """The rows of a ``bench.csv`` with numbers as numbers (as :func:`bench.run` returns them)."""
    with open(path, newline="") as f:
        return [{k: _value(v) for k, v in r.items()} for r in csv.DictReader(f)]


def read_profiles(path: str) -> dict[tuple, dict]:
    """The per-category device times of a ``profile.csv``, by ``(model, batch, mode)``: what :func:`bench.run` holds
    as each row's ``profile``."""
    fixed = ("model", "batch", "context", "mode", "step_ms", "device_ms")
    return {(r["model"], r["batch"], r["mode"]): {k: v for k, v in r.items() if k not in fixed}
            for r in read_rows(path)}


def read_kernel_profiles(path: str) -> dict[tuple, dict]:
    """The per-kernel rows of a ``profile_kernels.csv``, by ``(model, batch, mode)``: ``kernel -> (ms per step,
    launches per step)``, what :func:`bench.run` holds as each row's ``kernels``."""
    out: dict = {}
    for r in read_rows(path):
        out.setdefault((r["model"], r["batch"], r["mode"]), {})[str(r["kernel"])] = (r["ms_per_step"],
                                                                                    r["launches_per_step"])
    return out


def _units(shard: list[tuple[str, list[int]]], modes: list[str], cold: bool,
           rounds: int = 1) -> list[tuple[str, list[int], list[str], str]]:
    """A worker's runs: ``(model, batches, modes, output folder name)``; one per model group, or with ``cold`` one
    per (model, batch, mode) and round, the modes of a round in :func:`~replay_compile.bench.round_orders`."""
    if not cold:
        return [(m, bs, modes, m) for m, bs in shard]
    tag = lambda r: f"_r{r + 1}" if rounds > 1 else ""  # noqa: E731
    return [(m, [b], [mode], f"{m}_b{b}_{mode.replace(':', '_')}{tag(r)}") for m, bs in shard for b in bs
            for r, order in enumerate(bench.round_orders(modes, rounds)) for mode in order]


def merge_cold_rounds(rows: list[dict]) -> list[dict]:
    """One row per (model, batch, mode) from the rows of its cold rounds, in first-seen order: step times averaged
    (:func:`~replay_compile.bench.merge_rounds`) and the first step too (every round compiled cold), each round's
    first step kept in ``first_step_s_rounds``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["mode"]), []).append(r)
    out = []
    for runs in groups.values():
        merged = bench.merge_rounds(runs)
        merged["first_step_s"] = sum(r["first_step_s"] for r in runs) / len(runs)
        merged["first_step_s_rounds"] = " ".join(f"{r['first_step_s']:.2f}" for r in runs)
        out.append(merged)
    return out


@dataclasses.dataclass
class Unit:
    """One process of a sweep: ``label`` names it in the report, ``out`` is its output folder (created before it
    runs, its log written there), ``cmd`` its command line; ``cold``: it runs with Inductor and Triton cache folders
    of its own, empty when it starts and removed when it ends."""

    label: str
    out: str
    cmd: list[str]
    cold: bool = False


def _log_tail(path: str, lines: int = 8) -> str:
    """The last ``lines`` lines of a unit's log, indented (a traceback's end: the exception and where it was raised)."""
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("    " + line[:300] for line in tail)


def run_units(shards: list[list[Unit]], time_limit: float | None = None) -> list[str]:
    """Run ``shards[k]``'s units one after another in worker ``k`` (a thread), pinned to GPU ``k`` with
    ``CUDA_VISIBLE_DEVICES``; each unit's output goes to ``unit.out/log.txt``. ``time_limit`` (seconds): a unit still
    running then is stopped and later ones are skipped, so that what finished can still be merged (a sweep cut by an
    outer timeout merges nothing). Returns one line per unit that failed, was cut or was skipped."""
    failures: list[str] = []
    lock = threading.Lock()
    deadline = None if time_limit is None else time.monotonic() + time_limit

    def worker(k: int) -> None:
        for unit in shards[k]:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(k))
            caches = tempfile.mkdtemp(prefix="replay-compile-cold-") if unit.cold else None
            if caches:
                env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                           TRITON_CACHE_DIR=os.path.join(caches, "triton"))
            os.makedirs(unit.out, exist_ok=True)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                status = "skipped (time limit)"
            else:
                with open(os.path.join(unit.out, "log.txt"), "w") as log:
                    try:
                        rc = subprocess.run(unit.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            timeout=left).returncode
                        status = "done" if rc == 0 else f"exit {rc}"
                    except subprocess.TimeoutExpired:          # the child is killed; its finished rows stay
                        status = "cut at the time limit"
            if caches:
                shutil.rmtree(caches, ignore_errors=True)
            with lock:
                line = f"worker {k} (GPU {k}): {unit.label}: {status}"
                print(line, file=sys.stderr, flush=True)
                if status.startswith("exit"):              # the error's last lines, so the report says why
                    print(_log_tail(os.path.join(unit.out, "log.txt")), file=sys.stderr, flush=True)
                if status != "done":
                    failures.append(f"{line}, see {os.path.join(unit.out, 'log.txt')}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(shards)) if shards[k]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def run_parallel(n: int, models: list[str], batches: list[int], modes: list[str], forward: list[str],
                 out_dir: str, time_limit: float | None = None, cold: bool = False,
                 rounds: int = 1) -> tuple[list[dict], list[str]]:
    """Run the sweep on ``n`` GPUs (workers ``0 .. n-1``); ``forward`` holds the other ``bench`` options (steps,
    dtype, layers, ...). ``time_limit``: as :func:`run_units`.
    ``cold``: one process per (model, batch, mode), each with fresh Inductor and Triton cache directories;
    ``rounds`` of them per point, merged by :func:`merge_cold_rounds` (without ``cold``, ``forward`` carries
    ``--rounds`` to the workers instead).
    Returns the merged rows (also written to ``out_dir``) and one line per failed, cut or skipped group."""
    os.makedirs(out_dir, exist_ok=True)
    shards = [[Unit(f"{model} batches {bs}" + (f" {unit_modes[0]}" if cold else ""),
                    os.path.join(out_dir, f"worker{k}", name),
                    [sys.executable, "-m", "replay_compile.cli", "bench", "--models", model,
                     "--batches", ",".join(map(str, bs)), "--modes", ",".join(unit_modes),
                     "--out", os.path.join(out_dir, f"worker{k}", name), *forward], cold=cold)
               for model, bs, unit_modes, name in _units(shard, modes, cold, rounds)]
              for k, shard in enumerate(shard_points(models, batches, n))]
    failures = run_units(shards, time_limit)
    rows = []
    for shard in shards:
        for unit in shard:
            path = os.path.join(unit.out, "bench.csv")
            if os.path.exists(path):                     # a worker cut short still leaves the rows it finished
                got = read_rows(path)
                prof = os.path.join(unit.out, "profile.csv")
                profiles = read_profiles(prof) if os.path.exists(prof) else {}
                kern = os.path.join(unit.out, "profile_kernels.csv")
                kernels = read_kernel_profiles(kern) if os.path.exists(kern) else {}
                for r in got:
                    r["profile"] = profiles.get((r["model"], r["batch"], r["mode"]), {})
                    r["kernels"] = kernels.get((r["model"], r["batch"], r["mode"]), {})
                rows += got
    if cold:
        rows = merge_cold_rounds(rows)
    order = {m: i for i, m in enumerate(modes)}
    rows.sort(key=lambda r: (models.index(r["model"]), r["batch"], order.get(r["mode"], len(order))))
    bench._write(rows, out_dir)
    return rows, failures
