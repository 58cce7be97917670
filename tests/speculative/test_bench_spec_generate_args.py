"""``benchmarks/bench_spec_generate.py --gpus N`` hands each worker the command line less the options it gets of its
own: the points it runs and its output folder."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from bench_spec_generate import worker_argv  # noqa: E402


def test_a_worker_gets_the_command_line_less_its_own_options():
    argv = ["--models", "a,b", "--batches=1,32", "--gpus", "4", "--new", "64", "--out=res", "--variants",
            "lookup,accept-all", "--out", "x", "--train-copy", "250", "--gpus=2", "--profile"]
    assert worker_argv(argv) == ["--new", "64", "--variants", "lookup,accept-all", "--train-copy", "250", "--profile"]
    assert worker_argv(["--budget", "28"]) == ["--budget", "28"]


def test_the_groups_rows_are_merged_from_their_own_folders_and_a_time_limit_skips_the_rest(tmp_path, monkeypatch):
    """``--gpus`` / ``--time-limit``: each (model, batch) group runs as a worker process writing its CSV in a folder
    of its own; the merge reads exactly those (a stale CSV elsewhere under ``--out`` is not a row), and a group left
    when the time limit passes is skipped and reported, the finished rows still merged."""
    import subprocess

    import bench_spec_generate as bsg
    import pytest

    import replay_compile.bench_parallel as bp

    stale = tmp_path / "old"
    stale.mkdir()
    (stale / "spec_generate.csv").write_text("model,batch,variant,tokens_per_s\nstale,1,decode,1.0\n")
    ran = []

    def fake_run(cmd, env, stdout, stderr, timeout):
        out, model = cmd[cmd.index("--out") + 1], cmd[cmd.index("--models") + 1]
        ran.append((model, cmd[cmd.index("--batches") + 1], env["CUDA_VISIBLE_DEVICES"], "--time-limit" in cmd))
        with open(os.path.join(out, "spec_generate.csv"), "w") as f:
            f.write(f"model,batch,variant,tokens_per_s\n{model},{cmd[cmd.index('--batches') + 1]},decode,5.0\n")
        monkeypatch.setattr(bp.time, "monotonic", lambda: 1e9)     # the limit passes during the first group
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bp.subprocess, "run", fake_run)
    monkeypatch.setattr(bsg, "_plot", lambda rows, path: None)
    with pytest.raises(SystemExit):                                 # a skipped group fails the run
        bsg.main(["--models", "qwen35_4b,nemotron_h_nano4b", "--batches", "32", "--time-limit", "600",
                  "--out", str(tmp_path), "--new", "16"])
    assert ran == [("qwen35_4b", "32", "0", False)]
    merged = (tmp_path / "spec_generate.csv").read_text().splitlines()
    assert merged == ["model,batch,variant,tokens_per_s", "qwen35_4b,32,decode,5.0"]
