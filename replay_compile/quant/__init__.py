"""Low-precision storage formats for SSM state *read copies*.

See :mod:`replay_compile.quant.formats` for the layouts, the recipes and the error bounds.
"""

from __future__ import annotations

from .formats import (
    E2M1_MAX,
    E2M1_VALUES,
    FORMATS,
    FP8_E4M3_MAX,
    BF16Format,
    Encoded,
    FP8E4M3RowFormat,
    NVFP4Format,
    ReadCopyFormat,
    e2m1_decode,
    e2m1_encode,
    get_format,
    pack_nibbles,
    quantize_dequantize,
    unpack_nibbles,
)

__all__ = ["BF16Format", "E2M1_MAX", "E2M1_VALUES", "Encoded", "FORMATS", "FP8E4M3RowFormat", "FP8_E4M3_MAX",
           "NVFP4Format", "ReadCopyFormat", "e2m1_decode", "e2m1_encode", "get_format", "pack_nibbles",
           "quantize_dequantize", "unpack_nibbles"]
