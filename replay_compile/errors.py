"""Exceptions raised by replay_compile."""


class ReplayCompileError(RuntimeError):
    """A state update was found but cannot be rewritten and ``strict`` is set, or replay state is misused.

    The message names the layer, the shapes or dtypes involved and what to do.
    """
