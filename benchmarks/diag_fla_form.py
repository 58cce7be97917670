"""What the decode graph looks like when transformers calls fla's recurrent delta-rule kernels (GPU only).

With fla installed (``pip install flash-linear-attention``), transformers routes the Gated DeltaNet and KDA decode
steps of Qwen3.5 / Qwen3-Next / Kimi-Linear (and the families built on them) to fla's
``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``. Builds tiny models of those families on CUDA,
compiles them with a recording backend in front of ``replayssm``, prints the recorded graphs' Triton launches (the
kernel, its constant arguments, the nodes before and after), whether the tokens equal eager's, and what the pass
reported. Diagnostic, not a test: what a matcher of these call forms must read.

    python benchmarks/diag_fla_form.py [qwen3_5 kimi_linear ...]
"""
import sys

import torch

try:
    import fla  # noqa: F401
    print("fla", getattr(fla, "__version__", "?"), "importable")
except Exception as e:  # noqa: BLE001
    print("fla not importable:", type(e).__name__, e)

import replay_compile  # noqa: E402
from replay_compile.backend import replayssm_backend  # noqa: E402
from replay_compile.testing.hf_models import DELTA_FAMILY, make_inputs  # noqa: E402


def show(family: str) -> None:
    graphs = []

    def recording(gm, example_inputs, **kw):
        graphs.append(gm)
        return replayssm_backend(gm, example_inputs, **kw)

    torch._dynamo.reset()
    replay_compile.clear_reports()
    model = DELTA_FAMILY[family]().cuda()
    ids = make_inputs(model, batch=2, prompt_len=6).cuda()
    print(f"=== {family}")
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)
        model.forward = torch.compile(model.forward, backend=recording)
        try:
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
            print("tokens identical:", bool((out == ref).all()))
        except Exception as e:  # noqa: BLE001 - still show the graphs
            print("compiled generate failed:", type(e).__name__, str(e)[:800])
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    for i, gm in enumerate(graphs):
        hops = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
        print(f"--- graph {i}: {len(list(gm.graph.nodes))} nodes, {len(hops)} triton kernel HOPs")
        seen = set()
        for n in hops:
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            name = getattr(getattr(k, "fn", k), "__name__", str(k))
            if name in seen:
                continue
            seen.add(name)
            print("   kernel:", name, "| constants:", kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"]))
            print("  ", n.format_node()[:1500])
            nodes = list(gm.graph.nodes)
            j = nodes.index(n)
            for m in nodes[max(0, j - 12): j + 10]:
                print("     ", m.format_node()[:300])
    for r in replay_compile.reports():
        print("report:", r)


for fam in sys.argv[1:] or ["qwen3_5", "kimi_linear"]:
    show(fam)
