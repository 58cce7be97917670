"""Custom ops (``torch.ops.replay_compile.*``). Importing this package registers them."""

from . import (  # noqa: F401
    decode_attention,
    delta,
    delta_readcopy,
    delta_spec,
    mamba1,
    mamba2,
    mamba2_readcopy,
    mamba2_spec,
    spec,
)

__all__ = ["decode_attention", "delta", "delta_readcopy", "delta_spec", "mamba1", "mamba2", "mamba2_readcopy",
           "mamba2_spec", "spec"]
