"""What the decode graph looks like when transformers calls fla's recurrent delta-rule kernels (GPU only).

With fla installed (``pip install flash-linear-attention``), transformers routes the Gated DeltaNet and KDA decode
steps of Qwen3.5 / Qwen3-Next / Kimi-Linear (and the families built on them) to fla's
``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``. Builds tiny models of those families on CUDA,
compiles them with a recording backend in front of ``replayssm``, prints the recorded graphs' Triton launches (the
kernel, its constant arguments, the nodes before and after), whether the tokens equal eager's, and what the pass
reported. Diagnostic, not a test: what a matcher of these call forms must read.

    python benchmarks/diag_fla_form.py [qwen3_5 kimi_linear ...]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

try:
    import fla  # noqa: F401
    print("fla", getattr(fla, "__version__", "?"), "importable")
except Exception as e:  # noqa: BLE001
    print("fla not importable:", type(e).__name__, e)

from recorded_graphs import print_launches, record_decode_graphs  # noqa: E402

import replay_compile  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, make_inputs  # noqa: E402


def show(family: str) -> None:
    torch._dynamo.reset()
    replay_compile.clear_reports()
    model = DELTA_FAMILY[family]().cuda()
    print(f"=== {family}")
    graphs = record_decode_graphs(model, make_inputs(model, batch=2, prompt_len=6).cuda())
    print_launches(graphs)
    for r in replay_compile.reports():
        print("report:", r)


for fam in sys.argv[1:] or ["qwen3_5", "kimi_linear"]:
    show(fam)
