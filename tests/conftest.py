import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the tests check the rewrite on CPU graphs, which the backend leaves to the lowering by default (config.py)
os.environ.setdefault("REPLAY_COMPILE_DEVICES", "cpu,cuda")
# Triton kernels run on CPU tensors through the interpreter where there is no GPU. Must be set before triton
# decorates any kernel (replay_compile imports its kernels lazily, so setting it here is early enough).
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch and sees its own counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
