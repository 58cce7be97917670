"""replay-compile verify/env and the equivalence checker behind them (fast settings: eager lowering)."""

import pytest

pytest.importorskip("transformers")

from replay_compile.cli import main  # noqa: E402

# marked hf (run again under every transformers version CI installs): one run of each command on a model and the
# family list, which depends on the version; the rest checks the CLI's own logic, the same under every version


@pytest.mark.slow
@pytest.mark.hf
def test_verify_passes_on_a_supported_model(capsys):
    assert main(["verify", "--family", "mamba2", "--lower", "eager", "--tokens", "33", "--buffer-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "identical to eager" in out and "PASS" in out
    assert "flushes: 4 per layer (L=8)" in out


@pytest.mark.slow
def test_verify_in_bfloat16_holds_the_rewrite_to_plain_torch_compile(capsys, monkeypatch):
    """bf16: eager's tokens fed to both compiled runs; the rewrite passes within twice plain torch.compile's own
    departure from eager, and a wrong rewrite does not."""
    assert main(["verify", "--family", "mamba2", "--dtype", "bfloat16", "--lower", "eager", "--tokens", "17",
                 "--buffer-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced" in out and "twice what inductor departs from eager" in out and "PASS" in out, out
    from replay_compile.kernels import mamba2_reference as ref
    real = ref._window_coefficients
    monkeypatch.setattr(ref, "_window_coefficients", lambda la, dt, valid: real(la * 0, dt, valid))
    # the same sizes as above: plain torch.compile's graphs are compiled once, the second run reuses them
    assert main(["verify", "--family", "mamba2", "--dtype", "bfloat16", "--lower", "eager", "--tokens", "17",
                 "--buffer-len", "8"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_fails_when_nothing_is_rewritten(capsys, monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_DISABLE", "1")
    assert main(["verify", "--family", "mamba2", "--lower", "eager", "--tokens", "17", "--buffer-len", "8"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.slow
def test_verify_fails_on_a_wrong_rewrite(capsys, monkeypatch):
    """A kernel bug (here: a flush that forgets the decay) must turn the report red, not pass silently."""
    from replay_compile.kernels import mamba2_reference as ref
    real = ref._window_coefficients

    def no_decay(la_win, dt_win, valid):
        total, coef = real(la_win * 0, dt_win, valid)
        return total, coef

    monkeypatch.setattr(ref, "_window_coefficients", no_decay)
    assert main(["verify", "--family", "mamba2", "--lower", "eager", "--tokens", "17", "--buffer-len", "4"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_env(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "replay_compile" in out
    assert all(" " in line for line in out.splitlines() if line.startswith("transformers")), out   # name, version


@pytest.mark.hf
def test_family_help_lists_every_embedded_model(capsys):
    from replay_compile import cli
    from replay_compile.testing import hf_models

    families = {**hf_models.MAMBA2_FAMILY, **hf_models.DELTA_FAMILY, **hf_models.MAMBA1_FAMILY,
                **hf_models.LIGHTNING_FAMILY}
    assert set(cli.FAMILIES) == set(families)
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "kimi_linear" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.hf
def test_explain_lists_rewritten_layers(capsys):
    assert main(["explain", "--family", "qwen3_5", "--buffer-len", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("rewritten  ") == 2 and "gdn [gdn/grouped] HV=4 Hk=2" in out, out
    assert "2 of 2 state-writing layers rewritten" in out


@pytest.mark.slow
def test_explain_says_why_a_layer_is_left_unchanged(capsys, monkeypatch):
    monkeypatch.setenv("REPLAY_COMPILE_FAMILIES", "mamba2")
    assert main(["explain", "--family", "kimi_linear", "--buffer-len", "4"]) == 0
    out = capsys.readouterr().out
    assert "left unchanged" in out and "0 of 2 state-writing layers rewritten" in out, out


@pytest.mark.slow
@pytest.mark.hf
def test_bench_smoke_on_cpu(tmp_path, capsys):
    """The benchmark command end to end on a tiny model (CPU, wall-clock timing): rows, CSV, table, rewrites."""
    import csv

    assert main(["bench", "--models", "tiny_mamba2", "--batches", "2", "--modes", "eager,replayssm",
                 "--steps", "9", "--buffer-len", "4", "--dtype", "float32", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["mode"] for r in rows] == ["eager", "replayssm"]
    assert rows[0]["rewrites"] == "0" and int(rows[1]["rewrites"]) >= 2
    assert float(rows[1]["flush_ms"]) > 0 and float(rows[1]["nonflush_ms"]) > 0
    assert "| tiny_mamba2" in capsys.readouterr().out and (tmp_path / "bench.md").exists()
    banner = (tmp_path / "bench.md").read_text().splitlines()[0]      # what the numbers depend on besides the rows
    assert banner.startswith("<!-- torch ") and "inline kernels: off" in banner   # the interpreter: nothing traced


def test_bench_rounds_alternate_the_modes_and_average(tmp_path, monkeypatch):
    """``--rounds 2``: each mode runs twice, the second round in reverse order; one row per mode with the mean."""
    import csv

    from replay_compile import bench

    assert bench.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    seen, real = [], bench.bench_one

    def spy(model, bs, mode, steps, L, **kw):
        seen.append(mode)
        r = real(model, bs, mode, steps, L, **kw)
        r["step_ms"] = 2.0 if len(seen) <= 2 else 4.0           # round 1: 2 ms, round 2: 4 ms
        return r
    monkeypatch.setattr(bench, "bench_one", spy)
    assert main(["bench", "--models", "tiny_mamba2", "--batches", "2", "--modes", "eager,replayssm", "--rounds", "2",
                 "--steps", "5", "--buffer-len", "4", "--dtype", "float32", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    assert seen == ["eager", "replayssm", "replayssm", "eager"]
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    assert [r["mode"] for r in rows] == ["eager", "replayssm"]
    assert all(float(r["step_ms"]) == 3.0 and r["rounds"] == "2" for r in rows)
    assert float(rows[0]["tokens_per_s"]) == 2 / 3e-3


@pytest.mark.slow
def test_bench_parity_check_on_cpu(tmp_path, capsys):
    """``bench --check``: eager and compiled greedy decoding in lockstep over > 2L+1 steps (flushes included) agree
    on every token, the layers were rewritten, and the CSV records it."""
    import csv

    assert main(["bench", "--models", "tiny_qwen3_5", "--check", "11", "--check-batch", "2", "--buffer-len", "4",
                 "--dtype", "float32", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (row,) = list(csv.DictReader(open(tmp_path / "parity_float32.csv")))
    assert float(row["tokens_agree"]) == 1.0 and row["first_mismatch"] == "-1" and int(row["rewrites"]) >= 2
    assert float(row["rel_logit_diff"]) < 1e-4
    assert "tokens agree on 100.0%" in capsys.readouterr().out


def test_bench_modes_take_a_read_copy_and_reject_unknown_ones(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit, match="unknown modes .*replayssm:int4.*bf16, fp8_e4m3, nvfp4"):
        main(["bench", "--device", "cpu", "--modes", "replayssm:int4"])
    with pytest.raises(SystemExit, match="unknown modes .*inductor:bf16"):
        main(["bench", "--device", "cpu", "--modes", "inductor:bf16"])
    from replay_compile import bench
    rows = [dict(model="m", batch=1, mode="inductor-ro", step_ms=2.0),
            dict(model="m", batch=1, mode="replayssm-ro:fp8_e4m3", step_ms=1.0)]
    bench._speedups(rows)
    assert rows[1]["speedup_vs_compile"] == 2.0


def test_bench_modes_take_inductor_patches(monkeypatch):
    """``mode@key=value,...``: Inductor config patches for that mode's compile only; reduce-overhead spelled out as
    its options (torch.compile takes mode or options, not both); a patched inductor row is never the baseline."""
    import pytest
    import torch

    from replay_compile import bench

    assert bench.split_mode("replayssm-ro:fp8_e4m3@combo_kernels=1,max_autotune=false,x=3") == (
        "replayssm-ro", "fp8_e4m3", {"combo_kernels": True, "max_autotune": False, "x": 3})
    assert bench.split_mode("inductor") == ("inductor", "", {})
    with pytest.raises(SystemExit, match="combo_kernels.*not key=value"):
        main(["bench", "--device", "cpu", "--modes", "replayssm@combo_kernels"])
    seen = {}

    def fake_compile(fn, backend=None, options=None, **kw):
        seen.update(backend=backend, options=options, kw=kw)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)

    class M:
        forward = staticmethod(lambda *a, **k: None)
    bench._forward_for(M(), "replayssm-ro@combo_kernels=1", 8)
    assert seen["kw"] == {} and seen["backend"] == "replayssm"
    assert seen["options"] == {"buffer_len": 8, "devices": ("cpu", "cuda"), "mode": "reduce-overhead",
                               "combo_kernels": True}
    bench._forward_for(M(), "inductor-ro@combo_kernels=1", 8)
    assert seen["options"] == {"triton.cudagraphs": True, "combo_kernels": True} and seen["kw"] == {}
    bench._forward_for(M(), "inductor@combo_kernels=1", 8)
    assert seen["options"] == {"combo_kernels": True} and seen["backend"] == "inductor"
    rows = [dict(model="m", batch=1, mode="inductor", step_ms=2.0),
            dict(model="m", batch=1, mode="inductor@combo_kernels=1", step_ms=4.0),
            dict(model="m", batch=1, mode="replayssm@combo_kernels=1", step_ms=1.0)]
    bench._speedups(rows)
    assert rows[2]["speedup_vs_compile"] == 2.0


def test_bench_points_are_dealt_to_workers_by_cost():
    """Every (model, batch) point lands on exactly one worker; the big batches are spread first, so no worker gets
    all of them; a worker's points are grouped per model."""
    from replay_compile.bench_parallel import shard_points

    models, batches = ["a", "b", "c"], [1, 8, 32, 64, 128, 256, 512]
    shards = shard_points(models, batches, 2)
    dealt = sorted((m, b) for w in shards for m, bs in w for b in bs)
    assert dealt == sorted((m, b) for m in models for b in batches)
    big = [sum(b for _, bs in w for b in bs if b >= 256) for w in shards]
    assert min(big) > 0, shards
    assert all(len({m for m, _ in w}) == len(w) for w in shards)
    assert shard_points(["a"], [1], 3) == [[("a", [1])], [], []]


@pytest.mark.slow
def test_bench_on_two_workers_merges_their_rows(tmp_path, capsys):
    """``bench --gpus 2``: two worker processes (on CPU here; CUDA_VISIBLE_DEVICES pins them on a GPU host), one
    merged CSV and table with every point, in model / batch / mode order, speedups computed across them."""
    from replay_compile.bench_parallel import read_rows

    assert main(["bench", "--models", "tiny_mamba2", "--batches", "1,2", "--modes", "eager,replayssm",
                 "--steps", "6", "--buffer-len", "4", "--dtype", "float32", "--device", "cpu", "--gpus", "2",
                 "--out", str(tmp_path)]) == 0
    rows = read_rows(str(tmp_path / "bench.csv"))
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "eager"), (1, "replayssm"), (2, "eager"), (2, "replayssm")]
    assert all(r["rewrites"] >= 2 for r in rows if r["mode"] == "replayssm")
    assert {p.name for p in tmp_path.iterdir()} >= {"worker0", "worker1", "bench.csv", "bench.md"}
    assert "rows from 2 workers" in capsys.readouterr().out


def test_bench_time_limit_merges_what_finished(tmp_path, monkeypatch, capsys):
    """``bench --time-limit``: the group running at the limit is stopped (its finished rows kept), later groups are
    skipped, and the rows are merged all the same, with each cut or skipped group reported."""
    import subprocess

    import replay_compile.bench_parallel as bp

    calls = []

    def fake_run(cmd, env, stdout, stderr, timeout):
        out = cmd[cmd.index("--out") + 1]
        model = cmd[cmd.index("--models") + 1]
        calls.append((model, timeout))
        row = dict(model=model, layers=2, tp=1, batch=1, mode="inductor", step_ms=2.0, nonflush_ms=2.0, flush_ms=2.0,
                   tokens_per_s=500.0, first_step_s=1.0, peak_mem_gib=0.1, steady_mem_gib=0.1, rewrites=0)
        with open(f"{out}/bench.csv", "w") as f:                 # the row a bench run writes after its first point
            f.write(",".join(row) + "\n" + ",".join(map(str, row.values())) + "\n")
        monkeypatch.setattr(bp.time, "monotonic", lambda: 1e9)  # ... and then the limit passes
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(bp.subprocess, "run", fake_run)
    rows, failures = bp.run_parallel(1, ["a", "b"], [1], ["inductor"], [], str(tmp_path), time_limit=300)
    assert [c[0] for c in calls] == ["a"] and 0 < calls[0][1] <= 300
    assert [(r["model"], r["step_ms"]) for r in rows] == [("a", 2.0)]
    assert (tmp_path / "bench.csv").exists()
    assert len(failures) == 2 and "a batches [1]: cut at the time limit" in failures[0]
    assert "b batches [1]: skipped (time limit)" in failures[1]


def test_a_failed_worker_reports_the_end_of_its_log(tmp_path, capsys):
    """A unit that exits non-zero is reported with its log's last lines (the exception), not only the log's path."""
    import sys

    from replay_compile.bench_parallel import Unit, run_units

    cmd = [sys.executable, "-c", "print('setting up'); raise MemoryError('CUDA out of memory in the prefill')"]
    failures = run_units([[Unit("m batches [256]", str(tmp_path / "u"), cmd)]])
    assert len(failures) == 1 and "m batches [256]: exit 1" in failures[0]
    err = capsys.readouterr().err
    assert "MemoryError: CUDA out of memory in the prefill" in err and "setting up" in err


def test_bench_cold_compile_runs_each_mode_in_its_own_process_with_empty_caches(tmp_path, monkeypatch):
    """``bench --cold-compile``: one process per (model, batch, mode), each with Inductor and Triton cache folders
    of its own that are empty when it starts; the rows are merged with both ratios against plain torch.compile."""
    import os
    import subprocess

    import replay_compile.bench_parallel as bp

    seen = []

    def fake_run(cmd, env, stdout, stderr, timeout):
        out, mode = cmd[cmd.index("--out") + 1], cmd[cmd.index("--modes") + 1]
        caches = (env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"])
        seen.append((cmd[cmd.index("--batches") + 1], mode, caches, [os.path.exists(c) for c in caches]))
        os.makedirs(caches[0])                                   # what a compile leaves behind
        first = {"inductor": 10.0, "replayssm": 10.5}[mode]
        row = dict(model="m", layers=2, tp=1, batch=int(cmd[cmd.index("--batches") + 1]), mode=mode,
                   step_ms=2.0 if mode == "inductor" else 1.0, nonflush_ms=1.0, flush_ms=1.0, tokens_per_s=1.0,
                   first_step_s=first, peak_mem_gib=0.1, steady_mem_gib=0.1, rewrites=0)
        with open(f"{out}/bench.csv", "w") as f:
            f.write(",".join(row) + "\n" + ",".join(map(str, row.values())) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bp.subprocess, "run", fake_run)
    rows, failures = bp.run_parallel(1, ["m"], [1, 8], ["inductor", "replayssm"], [], str(tmp_path), cold=True)
    assert not failures
    assert sorted((b, m) for b, m, *_ in seen) == [("1", "inductor"), ("1", "replayssm"), ("8", "inductor"),
                                                   ("8", "replayssm")]
    assert len({c for *_, c, _ in seen}) == 4 and all(e == [False, False] for *_, e in seen)
    assert not any(os.path.exists(c[0]) for *_, c, _ in seen)   # removed afterwards
    ours = [r for r in rows if r["mode"] == "replayssm"]
    assert [(r["batch"], r["speedup_vs_compile"], r["first_step_vs_compile"]) for r in ours] == [(1, 2.0, 1.05),
                                                                                               (8, 2.0, 1.05)]


def test_bench_workers_profiles_are_merged_onto_their_rows(tmp_path, monkeypatch):
    """``bench --time-limit S --profile``: each worker profiles its points; the merged ``profile.csv`` holds every
    row's device time by category, read from the worker that ran it."""
    import subprocess

    import replay_compile.bench_parallel as bp

    def fake_run(cmd, env, stdout, stderr, timeout):
        assert "--profile" in cmd
        out, model = cmd[cmd.index("--out") + 1], cmd[cmd.index("--models") + 1]
        gemm = {"a": 1.5, "b": 2.5}[model]
        row = dict(model=model, layers=2, tp=1, batch=1, mode="inductor", step_ms=2.0, nonflush_ms=2.0, flush_ms=2.0,
                   tokens_per_s=500.0, first_step_s=1.0, peak_mem_gib=0.1, steady_mem_gib=0.1, rewrites=0)
        with open(f"{out}/bench.csv", "w") as f:
            f.write(",".join(row) + "\n" + ",".join(map(str, row.values())) + "\n")
        with open(f"{out}/profile.csv", "w") as f:
            f.write("model,batch,context,mode,step_ms,device_ms,GEMM,attention\n"
                    f"{model},1,0,inductor,2.0,{gemm + 0.25},{gemm},0.25\n")
        with open(f"{out}/profile_kernels.csv", "w") as f:
            f.write("model,batch,context,mode,kernel,category,ms_per_step,launches_per_step\n"
                    f"{model},1,0,inductor,gemm_{model},GEMM,{gemm},3.0\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bp.subprocess, "run", fake_run)
    rows, failures = bp.run_parallel(1, ["a", "b"], [1], ["inductor"], ["--profile"], str(tmp_path), time_limit=300)
    assert not failures
    assert [r["profile"] for r in rows] == [{"GEMM": 1.5, "attention": 0.25}, {"GEMM": 2.5, "attention": 0.25}]
    merged = (tmp_path / "profile.csv").read_text().splitlines()
    assert merged[0].startswith("model,batch,context,mode,step_ms,device_ms") and len(merged) == 3
    assert merged[2].split(",")[0] == "b" and "2.5" in merged[2].split(",")
    kernels = (tmp_path / "profile_kernels.csv").read_text().splitlines()
    assert kernels[1:] == ["a,1,,inductor,gemm_a,GEMM,1.5,3.0", "b,1,,inductor,gemm_b,GEMM,2.5,3.0"]


def test_bench_gpus_rejects_tp_and_check(tmp_path):
    with pytest.raises(SystemExit, match="--gpus"):
        main(["bench", "--device", "cpu", "--gpus", "2", "--tp", "2", "--out", str(tmp_path)])


def test_bench_cold_compile_rounds_are_cold_processes_in_alternating_order(tmp_path, monkeypatch):
    """``bench --cold-compile --rounds 2``: each round of each point runs every mode in a process of its own with
    empty caches (modes in alternating order), the workers themselves run one round, and the merged row averages
    the rounds' first steps (the ratio is then of the means) and keeps each."""
    import subprocess

    import replay_compile.bench_parallel as bp

    seen = []
    first = {("inductor", "r1"): 10.0, ("replayssm", "r1"): 12.0, ("inductor", "r2"): 14.0, ("replayssm", "r2"): 13.0}

    def fake_run(cmd, env, stdout, stderr, timeout):
        out, mode = cmd[cmd.index("--out") + 1], cmd[cmd.index("--modes") + 1]
        rnd = out.rsplit("_", 1)[-1]
        seen.append((mode, rnd, env["TORCHINDUCTOR_CACHE_DIR"], cmd[cmd.index("--rounds") + 1]))
        row = dict(model="m", layers=2, tp=1, batch=1, mode=mode, step_ms={"r1": 2.0, "r2": 4.0}[rnd],
                   median_step_ms=1.0, nonflush_ms=1.0, flush_ms=1.0, tokens_per_s=1.0,
                   first_step_s=first[(mode, rnd)], peak_mem_gib=0.1, steady_mem_gib=0.1, rewrites=0, rounds=1)
        with open(f"{out}/bench.csv", "w") as f:
            f.write(",".join(row) + "\n" + ",".join(map(str, row.values())) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bp.subprocess, "run", fake_run)
    rows, failures = bp.run_parallel(1, ["m"], [1], ["inductor", "replayssm"], ["--rounds", "1"], str(tmp_path),
                                     cold=True, rounds=2)
    assert not failures
    assert [(m, r) for m, r, *_ in seen] == [("inductor", "r1"), ("replayssm", "r1"), ("replayssm", "r2"),
                                             ("inductor", "r2")]
    assert len({c for *_, c, _ in seen}) == 4 and all(n == "1" for *_, n in seen)
    plain, ours = rows
    assert (plain["first_step_s"], ours["first_step_s"]) == (12.0, 12.5)
    assert ours["first_step_s_rounds"] == "12.00 13.00" and ours["rounds"] == 2 and ours["step_ms"] == 3.0
    assert ours["first_step_vs_compile"] == pytest.approx(12.5 / 12.0)
    assert "first_step_s_rounds" in (tmp_path / "bench.csv").read_text().splitlines()[0]


def test_bench_cold_compile_workers_run_one_round_each(tmp_path, monkeypatch):
    """The command line keeps ``--rounds`` away from cold workers (a second round in one process compiles warm)
    and hands it to the sweep instead."""
    import replay_compile.bench_parallel as bp

    got = {}

    def fake_parallel(n, models, batches, modes, forward, out_dir, time_limit=None, cold=False, rounds=1):
        got.update(forward=forward, cold=cold, rounds=rounds)
        return [dict(model="m")], []

    monkeypatch.setattr(bp, "run_parallel", fake_parallel)
    main(["bench", "--device", "cpu", "--models", "tiny_mamba2", "--batches", "1", "--modes", "eager",
          "--cold-compile", "--rounds", "3", "--out", str(tmp_path)])
    assert got["cold"] and got["rounds"] == 3
    assert got["forward"][got["forward"].index("--rounds") + 1] == "1"
