"""The loop the decode rewrites share (:mod:`.decode_attention`, :mod:`.decode_conv`): every candidate call of a graph
matched, kept to CUDA graphs where asked, its configuration checked numerically, then replaced in place; a candidate
left unchanged is logged with the reason (debug for a pattern that is not the rewrite's, a warning for a failed
check) and returned with it."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

from .._logging import log
from .graph_utils import example, module_path


class NotRewritten(Exception):
    """Why a candidate call is left unchanged (each rewrite raises its own subclass)."""


def rewrite_each(gm: fx.GraphModule, candidates: list[fx.Node], match: Callable, check: Callable[..., str | None],
                 insert: Callable[[fx.Graph, object], object], *, tensor: Callable[[object], fx.Node],
                 cuda_only: bool, noun: str, cpu_reason: str, describe: Callable[[object], str]
                 ) -> tuple[list, list[tuple[str, str]]]:
    """Rewrite ``candidates`` of ``gm``'s graph in place: ``match(n)`` (raises :class:`NotRewritten`), on CUDA only
    where ``cuda_only`` (the device of ``tensor(match)``; else ``cpu_reason``), ``check(match)`` (None or what failed),
    ``insert(graph, match)``; ``noun`` names the call in the logs, ``describe(match)`` the rewrite. Returns the
    rewritten matches and ``(layer, reason)`` for the calls left unchanged."""
    done, left = [], []
    for n in candidates:
        layer = module_path(n)
        try:
            m = match(n)
            if cuda_only and example(tensor(m)).device.type != "cuda":
                raise NotRewritten(cpu_reason)
            bad = check(m)
            if bad:
                log.warning("replay_compile: %s: %s left unchanged: its rewrite failed its check for this "
                            "configuration (%s)", layer, noun, bad)
                left.append((layer, bad))
                continue
        except NotRewritten as e:
            left.append((layer, str(e)))
            log.debug("replay_compile: %s: %s left unchanged: %s", layer, noun, e)
            continue
        insert(gm.graph, m)
        done.append(m)
        log.info("replay_compile: %s: %s", layer, describe(m))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, left
