"""Custom ops (``torch.ops.replay_compile.*``). Importing this package registers them."""

from . import delta, mamba2  # noqa: F401

__all__ = ["delta", "mamba2"]
