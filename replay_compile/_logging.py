"""Logging for replay_compile.

One logger, ``replay_compile``. Rewrites and skipped anchors are logged at INFO (one line each); set
``REPLAY_COMPILE_LOG=debug`` (or ``info``, ``warning``) to route them to stderr without configuring logging yourself.
Graphs before/after the pass are emitted under ``TORCH_LOGS="+replay_compile"``-style debug logging.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("replay_compile")


def _configure_from_env() -> None:
    level = os.environ.get("REPLAY_COMPILE_LOG", "").strip().upper()
    if not level:
        return
    log.setLevel(getattr(logging, level, logging.INFO))
    if not any(getattr(h, "_replay_compile", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[replay_compile] %(message)s"))
        h._replay_compile = True
        log.addHandler(h)
        log.propagate = False


_configure_from_env()
