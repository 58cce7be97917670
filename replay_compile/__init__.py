"""replay_compile: ReplaySSM for unmodified hybrid models, as a torch.compile backend.

    import torch, replay_compile
    model.forward = torch.compile(model.forward, backend="replayssm")

Public API: :class:`ReplayConfig`, :class:`ReplayTensor`, :func:`protect`, :func:`flush`, :func:`reset`,
:func:`materialize`, :func:`replayssm_backend`; what the pass did: :func:`summary` (one row per layer),
:func:`layer_verdicts`, :func:`reports` (per compiled graph).
"""

from __future__ import annotations

import sys

from . import ops  # noqa: F401 - registers torch.ops.replay_compile.*
from .backend import clear_reports, layer_verdicts, replayssm_backend, reports, summary
from .config import ReplayConfig
from .errors import ReplayCompileError
from .replay_tensor import ReplayTensor
from .state import flush, materialize, protect, reset

__version__ = "0.1.0"
__all__ = ["ReplayConfig", "ReplayCompileError", "ReplayTensor", "clear_reports", "flush", "layer_verdicts",
           "materialize", "protect", "replayssm_backend", "reports", "reset", "summary"]


def _register_backend() -> None:
    """Register ``backend="replayssm"`` unless the installed entry point will do it (it would then collide)."""
    from torch._dynamo.backends import registry

    try:
        registry._discover_entrypoint_backends()
        if "replayssm" in registry._COMPILER_FNS or registry._BACKENDS.get("replayssm") is not None:
            return
    except Exception:  # noqa: BLE001 - private API moved: fall back to the public call below
        pass
    try:
        registry.register_backend(compiler_fn=replayssm_backend, name="replayssm")
    except AssertionError:
        pass  # already registered


_register_backend()

if "transformers" in sys.modules:   # else the backend installs it on first use
    from .integrations import hf as _hf

    _hf.install()
