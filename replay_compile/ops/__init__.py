"""Custom ops (``torch.ops.replay_compile.*``). Importing this package registers them."""

from . import delta, mamba2, mamba2_spec  # noqa: F401

__all__ = ["delta", "mamba2", "mamba2_spec"]
