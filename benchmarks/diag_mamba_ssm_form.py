"""What the decode graph looks like when HF calls mamba_ssm's ``selective_state_update`` (GPU only).

Makes mamba_ssm importable (installed, or its source under ``.baselines/``), builds a tiny NemotronH on CUDA,
compiles it with a recording backend in front of ``replayssm``, prints the nodes around the state update and what
our pass reported. Diagnostic, not a test.
"""
import os
import sys
import types

import torch

root = os.path.join(os.path.dirname(__file__), "..", ".baselines", "mamba_ssm")
try:
    import mamba_ssm  # noqa: F401
except Exception:  # noqa: BLE001
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [os.path.abspath(root)]
    sys.modules["mamba_ssm"] = pkg
try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa: F401
    print("mamba_ssm selective_state_update importable")
except Exception as e:  # noqa: BLE001
    print("mamba_ssm not importable:", type(e).__name__, e)

import replay_compile  # noqa: E402
from replay_compile.backend import replayssm_backend  # noqa: E402
from replay_compile.testing.hf_models import MAMBA2_FAMILY, make_inputs  # noqa: E402

graphs = []


def recording(gm, example_inputs, **kw):
    graphs.append(gm)
    return replayssm_backend(gm, example_inputs, **kw)


model = MAMBA2_FAMILY["nemotron_h"]().cuda()
import transformers.models.nemotron_h.modeling_nemotron_h as mh  # noqa: E402
cells = [c.cell_contents for c in (mh.mamba2_selective_state_update.__closure__ or ())
         if callable(getattr(c, "cell_contents", None))]
print("HF wrapper closure:", [(getattr(f, "__module__", "?"), getattr(f, "__name__", "?")) for f in cells])
ids = make_inputs(model, batch=2, prompt_len=6).cuda()
with torch.no_grad():
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    model.forward = torch.compile(model.forward, backend=recording)
    try:
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        print("tokens identical:", bool((out == ref).all()))
    except Exception as e:  # noqa: BLE001 - still show the graphs
        print("compiled generate failed:", type(e).__name__, str(e)[:800])
for i, gm in enumerate(graphs):
    hops = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    print(f"--- graph {i}: {len(list(gm.graph.nodes))} nodes, {len(hops)} triton kernel HOPs")
    for n in hops[:2]:
        print("  ", n.format_node()[:1500])
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
        k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        print("   kernel:", k, getattr(k, "fn", None))
        print("   constant args:", kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"]))
    if hops:
        first = hops[0]
        nodes = list(gm.graph.nodes)
        j = nodes.index(first)
        for n in nodes[max(0, j - 25): j + 8]:
            print("     ", n.format_node()[:300])
for r in replay_compile.reports():
    print("report:", r)
