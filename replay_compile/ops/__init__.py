"""Custom ops (``torch.ops.replay_compile.*``). Importing this package registers them."""

from . import mamba2  # noqa: F401

__all__ = ["mamba2"]
