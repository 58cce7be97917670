"""Diagnose Inductor CPU C++ compile failures on a tiny hybrid model: plain inductor vs replayssm."""
import re
import sys

import torch

import replay_compile  # noqa: F401
from replay_compile.testing.hf_models import MAMBA2_FAMILY, make_inputs

fam = sys.argv[1] if len(sys.argv) > 1 else "nemotron_h"
for backend, opts in [("inductor", None), ("replayssm", None), ("replayssm", {"validate": False})]:
    torch._dynamo.reset()
    m = MAMBA2_FAMILY[fam]()
    ids = make_inputs(m)
    m.forward = torch.compile(m.forward, backend=backend, options=opts)
    try:
        with torch.no_grad():
            m.generate(ids, max_new_tokens=20, do_sample=False)
        print(fam, backend, opts, "OK")
    except Exception as e:
        msg = str(e)
        print(fam, backend, opts, "FAIL", type(e).__name__)
        for path, line in re.findall(r"(/tmp/torchinductor\S+?\.cpp):(\d+):\d+: error", msg)[:1]:
            src = open(path).read().splitlines()
            k = int(line)
            print("\n".join(f"{i + 1}: {src[i]}" for i in range(max(0, k - 25), min(len(src), k + 3))))
        print([ln for ln in msg.splitlines() if "error" in ln][:5])
