"""Logging for replay_compile.

One logger, ``replay_compile``. Rewrites and skipped anchors are logged at INFO (one line each); set
``REPLAY_COMPILE_LOG=debug`` (or ``info``, ``warning``) to route them to stderr without configuring logging yourself.
Graphs before/after the pass are emitted under ``TORCH_LOGS="+replay_compile"``-style debug logging.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("replay_compile")


def timed_phase(key: str):
    """A phase of ours in ``torch._dynamo.utils.compile_times()`` beside dynamo's and Inductor's own (where this torch
    has ``dynamo_timed``), so that a compile-time comparison can tell the pass's share apart."""
    from torch._dynamo import utils as dynamo_utils

    timed = getattr(dynamo_utils, "dynamo_timed", None)
    return timed(key) if timed is not None else contextlib.nullcontext()


def _configure_from_env() -> None:
    level = os.environ.get("REPLAY_COMPILE_LOG", "").strip().upper()
    if not level:
        return
    log.setLevel(getattr(logging, level, logging.INFO))
    if not any(getattr(h, "_replay_compile", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))       # every message starts with "replay_compile:"
        h._replay_compile = True
        log.addHandler(h)
        log.propagate = False


_configure_from_env()
