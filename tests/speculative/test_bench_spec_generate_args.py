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
