"""What the decode graph looks like when HF calls mamba_ssm's ``selective_state_update`` (GPU only).

Makes mamba_ssm importable (installed, or its source under ``.baselines/``), builds a tiny NemotronH on CUDA,
compiles it with a recording backend in front of ``replayssm``, prints the nodes around the state update and what
our pass reported. Diagnostic, not a test.
"""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(__file__))

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

from recorded_graphs import print_launches, record_decode_graphs  # noqa: E402

import replay_compile  # noqa: E402
from replay_compile.testing.hf_models import MAMBA2_FAMILY, make_inputs  # noqa: E402

model = MAMBA2_FAMILY["nemotron_h"]().cuda()
import transformers.models.nemotron_h.modeling_nemotron_h as mh  # noqa: E402

cells = [c.cell_contents for c in (mh.mamba2_selective_state_update.__closure__ or ())
         if callable(getattr(c, "cell_contents", None))]
print("HF wrapper closure:", [(getattr(f, "__module__", "?"), getattr(f, "__name__", "?")) for f in cells])
graphs = record_decode_graphs(model, make_inputs(model, batch=2, prompt_len=6).cuda())
print_launches(graphs, before=25, after=8)
for r in replay_compile.reports():
    print("report:", r)
