"""The one configuration object of replay_compile.

Every knob lives in :class:`ReplayConfig`, a frozen dataclass. It is built from, in increasing priority:
defaults, environment variables (see :data:`ENV_VARS`), and the ``options=`` dict given to
``torch.compile(..., backend="replayssm", options={...})``. Option keys that are not fields of
:class:`ReplayConfig` are passed on to the lowering (Inductor config patches).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

CONFIG_VERSION = 7        # 2: read_copy; 3: read_copy_families; 4: decode_attention; 5: devices; 6: its default;
                          # 7: decode_conv

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def parse_flag(value: str) -> bool:
    """An on/off environment value: ``1 true on yes`` or ``0 false off no`` (any case); anything else raises
    ``ValueError`` (a misspelt switch must not silently mean either)."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The on/off switch ``name`` from the environment (:func:`parse_flag`); ``default`` when unset or empty. Every
    boolean ``REPLAY_COMPILE_*`` variable is read through this, so they all take the same spellings."""
    raw = (os.environ if environ is None else environ).get(name, "")
    if not raw.strip():
        return default
    try:
        return parse_flag(raw)
    except ValueError as e:
        raise ValueError(f"replay_compile: bad value {raw!r} for {name}: {e}") from None


# name -> (field, parser, help). One table; the README's environment table is written from it.
ENV_VARS: dict[str, tuple[str, Any, str]] = {
    "REPLAY_COMPILE_BUFFER_LEN": ("buffer_len", int, "records per ring before a flush (L); default 16"),
    "REPLAY_COMPILE_STRICT": ("strict", parse_flag, "1: raise instead of leaving an unrecognised SSM update unchanged"),
    "REPLAY_COMPILE_VALIDATE": ("validate", parse_flag, "0: skip the numerical check of each match at compile time"),
    "REPLAY_COMPILE_FAMILIES": ("families", lambda s: tuple(x for x in s.split(",") if x),
                                "comma list of families to rewrite; default mamba2, gdn, kda (mamba1: opt-in)"),
    "REPLAY_COMPILE_DISABLE": ("enabled", lambda s: not parse_flag(s),
                               "1: compile with the lowering only, rewrite nothing"),
    "REPLAY_COMPILE_READ_COPY": ("read_copy", lambda s: s or None,
                                 "bf16 / fp8_e4m3 / nvfp4 / nvfp4_row: non-flush steps read a low-precision copy of "
                                 "the checkpoint (the recurrence stays exact); default: none"),
    "REPLAY_COMPILE_DEVICES": ("devices", lambda s: tuple(x.strip().lower() for x in s.split(",") if x.strip()),
                               "comma list of device types whose graphs are rewritten; default cuda (on CPU the ops "
                               "run their PyTorch reference, slower than plain torch.compile)"),
    "REPLAY_COMPILE_DECODE_ATTENTION": ("decode_attention", lambda s: s.strip().lower(),
                                        "auto (CUDA graphs) / on (every device; CPU runs the reference) / off: "
                                        "rewrite one-token SDPA over a cache into the grouped-head decode "
                                        "attention op; default auto"),
    "REPLAY_COMPILE_DECODE_CONV": ("decode_conv", lambda s: s.strip().lower(),
                                   "auto (CUDA graphs) / on (every device) / off: compute the depthwise conv of a "
                                   "decode step or verify window as shifted multiply-adds Inductor fuses; default "
                                   "auto"),
    "REPLAY_COMPILE_READ_COPY_FAMILIES": ("read_copy_families", lambda s: tuple(x for x in s.split(",") if x),
                                          "comma list of families given the read copy; default mamba2"),
}
# read where they act, not part of ReplayConfig (the on/off ones through env_flag)
OTHER_ENV_VARS = {
    "REPLAY_COMPILE_KERNELS": "reference: run the ops' PyTorch reference on CUDA instead of the Triton kernels",
    "REPLAY_COMPILE_INLINE_KERNELS": "0: keep the step ops opaque in compiled graphs; latency: trace only the "
                                     "small-batch latency kernels into them (default: every exact kernel variant; "
                                     "ops/library.py)",
    "REPLAY_COMPILE_LOG": "info / debug: log rewrites and skips (and graphs at debug) to stderr",
    "REPLAY_COMPILE_COMBO_KERNELS": "0: do not turn on Inductor's combo kernels for graphs with rewrites (default on; "
                                    "backend.py says why; options={'combo_kernels': False} does the same per compile)",
    "REPLAY_COMPILE_MUTATION_CACHE": "0: let torch analyse every inlined kernel launch itself (default: once per "
                                     "kernel and argument kinds; ops/mutation_cache.py)",
    "REPLAY_COMPILE_PDL": "0: no programmatic dependent launch (Hopper and later; kernels/launch.py)",
    "REPLAY_COMPILE_BENCH_COMPILE_TIMES": "1: replay-compile bench prints Dynamo's compile phases per run",
}

def _choice(name: str, default: str, choices: dict[str, str], environ: Mapping[str, str] | None = None) -> str:
    """The value of the variable ``name`` mapped through ``choices`` (spellings -> meaning, any case); ``default``
    when unset or empty; anything else raises ``ValueError`` naming the variable and the accepted values."""
    raw = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise ValueError(f"replay_compile: bad value {raw!r} for {name}; expected one of {', '.join(choices)}")
    return choices[raw]


def kernels_choice(environ: Mapping[str, str] | None = None) -> str:
    """``REPLAY_COMPILE_KERNELS``: ``"triton"`` (default) or ``"reference"`` (the ops' PyTorch reference on CUDA)."""
    return _choice("REPLAY_COMPILE_KERNELS", "triton", {"triton": "triton", "reference": "reference"}, environ)


def inline_kernels_choice(environ: Mapping[str, str] | None = None) -> str:
    """``REPLAY_COMPILE_INLINE_KERNELS``: ``"all"`` (default), ``"latency"`` or ``"off"`` (ops/library.py)."""
    spellings = {**{v: "all" for v in _TRUE + ("all",)}, **{v: "off" for v in _FALSE}, "latency": "latency"}
    return _choice("REPLAY_COMPILE_INLINE_KERNELS", "all", spellings, environ)


SUPPORTED_FAMILIES = ("mamba2", "gdn", "kda", "mamba1")
# Mamba-1 is opt-in: its replay step runs every held record's decay through an exp per (channel, state) entry, and
# measured on the H200 (Falcon-Mamba-7B dims, L = 4) it is 1.05-1.15x mamba_ssm's exact step at batch 256-512 and
# slower below batch 64 (docs/design/mamba1.md)
DEFAULT_FAMILIES = ("mamba2", "gdn", "kda")
SUPPORTED_LOWERINGS = ("inductor", "eager", "piecewise", "tensorrt")
SUPPORTED_READ_COPIES = ("bf16", "fp8_e4m3", "nvfp4", "nvfp4_row")
DECODE_ATTENTION_MODES = ("auto", "on", "off")
DECODE_CONV_MODES = ("auto", "on", "off")
SUPPORTED_DEVICES = ("cuda", "cpu")
# CPU graphs are left to the lowering by default: there the ops run their PyTorch reference, and the rewritten
# decode step measured 0.33-0.35x plain torch.compile's speed (2-core CPU, embedded models, steady state), while the
# GPU kernels are what the rewrite is for. The command-line tools and the tests opt in to show and check the rewrite.
DEFAULT_DEVICES = ("cuda",)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """Frozen, versioned configuration.

    Attributes:
        buffer_len: L, the number of token records kept per sequence before a flush folds them into the
            checkpoint. ``1`` reproduces the plain recurrent step exactly (every step flushes).
        strict: raise :class:`~replay_compile.errors.ReplayCompileError` when a state update anchor is found
            but cannot be rewritten, instead of leaving it unchanged with a log line.
        validate: numerically check every match on small inputs before rewriting it.
        families: SSM families to rewrite ("mamba2", "gdn": Gated DeltaNet, "kda": Kimi Delta Attention; "mamba1"
            only when listed: ``DEFAULT_FAMILIES`` says why).
        enabled: rewrite at all (``False`` gives plain lowering, useful for A/B runs).
        lower: ``"inductor"`` (default), ``"eager"`` (run the rewritten FX graph as is; for debugging),
            ``"piecewise"`` (split at mutating nodes, Inductor per pure piece) or ``"tensorrt"`` (the same with
            Torch-TensorRT per piece; :mod:`replay_compile.piecewise`).
        read_copy: None (default: every read is exact) or a read-copy format (``"bf16"``, ``"fp8_e4m3"``,
            ``"nvfp4"``, ``"nvfp4_row"``: NVFP4 with a tensor scale per row, encoded inside the flush): Mamba-2
            non-flush steps read their checkpoint term from a copy in that format, rewritten at every flush; the
            fp32 recurrence is untouched, outputs carry the copy's rounding (``benchmarks/drift.py`` measures the
            drift).
        read_copy_families: the families whose layers get the read copy when ``read_copy`` is set (default
            ``("mamba2",)``). Delta-rule layers (``"gdn"``, ``"kda"``) also keep raw values so that flushes re-run
            the exact recurrence; their read-copy step is correct on every device but measured slower than exact
            reads on the H200 (Qwen3.5-4B dims, bs256, fp8: 5.87 vs 4.81 ms per whole step), so it is opt-in.
        decode_attention: ``"auto"``: ``scaled_dot_product_attention`` of a decode step's token or a speculative
            verify's window over a key/value cache on CUDA becomes ``replay_compile::decode_attention`` (grouped
            heads read once, only the positions the mask keeps; :mod:`replay_compile.passes.decode_attention`);
            the default: on the H100, Nemotron-Nano-4B dims at full depth, batch 256, context 1,024, it took the
            whole step from 1.85x to 3.69x plain ``torch.compile``. ``"on"``: on every device (the CPU op is the
            reference, slower than SDPA: for tests); ``"off"``: attention is left to the lowering.
        decode_conv: ``"auto"`` (the default): a depthwise ``conv1d`` of a decode step or a verify window (at most
            8 taps and 16 output positions) in a CUDA graph becomes shifted multiply-adds accumulated in fp32, which
            Inductor fuses with the concatenation before them (:mod:`replay_compile.passes.decode_conv`); ``"on"``:
            on every device; ``"off"``: the convolution is left to the lowering.
        devices: device types whose graphs are rewritten (default ``("cuda",)``: ``DEFAULT_DEVICES`` says why CPU
            graphs are left to the lowering unless listed).
    """

    buffer_len: int = 16
    strict: bool = False
    validate: bool = True
    families: tuple[str, ...] = DEFAULT_FAMILIES
    enabled: bool = True
    lower: str = "inductor"
    read_copy: Optional[str] = None
    read_copy_families: tuple[str, ...] = ("mamba2",)
    decode_attention: str = "auto"
    decode_conv: str = "auto"
    devices: tuple[str, ...] = DEFAULT_DEVICES
    version: int = CONFIG_VERSION

    def __post_init__(self):
        if not isinstance(self.buffer_len, int) or not 1 <= self.buffer_len <= 64:
            raise ValueError(f"replay_compile: buffer_len must be an int in 1..64, got {self.buffer_len!r}")
        unknown = set(self.families) - set(SUPPORTED_FAMILIES)
        if unknown:
            raise ValueError(f"replay_compile: unknown families {sorted(unknown)}; supported: {SUPPORTED_FAMILIES}")
        if self.lower not in SUPPORTED_LOWERINGS:
            raise ValueError(f"replay_compile: lower must be one of {SUPPORTED_LOWERINGS}, got {self.lower!r}")
        unknown = set(self.read_copy_families) - set(SUPPORTED_FAMILIES)
        if unknown:
            raise ValueError(f"replay_compile: unknown read_copy_families {sorted(unknown)}; supported: "
                             f"{SUPPORTED_FAMILIES}")
        unknown = set(self.devices) - set(SUPPORTED_DEVICES)
        if unknown:
            raise ValueError(f"replay_compile: unknown devices {sorted(unknown)}; supported: {SUPPORTED_DEVICES}")
        if self.decode_attention not in DECODE_ATTENTION_MODES:
            raise ValueError(f"replay_compile: decode_attention must be one of {DECODE_ATTENTION_MODES}, got "
                             f"{self.decode_attention!r}")
        if self.decode_conv not in DECODE_CONV_MODES:
            raise ValueError(f"replay_compile: decode_conv must be one of {DECODE_CONV_MODES}, got "
                             f"{self.decode_conv!r}")
        if self.read_copy is not None and self.read_copy not in SUPPORTED_READ_COPIES:
            raise ValueError(f"replay_compile: read_copy must be None or one of {SUPPORTED_READ_COPIES}, "
                             f"got {self.read_copy!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"version"}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ReplayConfig":
        environ = os.environ if environ is None else environ
        kw = {}
        for var, (field, parse, _) in ENV_VARS.items():
            if environ.get(var, "").strip():           # unset or empty: the default
                try:
                    kw[field] = parse(environ[var])
                except ValueError as e:
                    raise ValueError(f"replay_compile: bad value {environ[var]!r} for {var}: {e}") from None
        return cls(**kw)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> tuple["ReplayConfig", dict[str, Any]]:
        """Split ``torch.compile(options=...)`` into our config and the lowering's own options (Inductor config
        patches, and ``mode``); a key that is neither raises ``ValueError`` naming the nearest of both."""
        base = cls.from_env()
        options = dict(options or {})
        ours = {k: options.pop(k) for k in list(options) if k in cls.field_names()}
        _check_lowering_keys(options, cls.field_names())
        for key in ("families", "read_copy_families", "devices"):     # "gdn", "mamba2,gdn" or any sequence
            if isinstance(ours.get(key), str):
                ours[key] = tuple(x for x in ours[key].split(",") if x)
            elif key in ours:
                ours[key] = tuple(ours[key])
        return dataclasses.replace(base, **ours), options


def _check_lowering_keys(options: Mapping[str, Any], ours: set[str]) -> None:
    """Every option that is not a :class:`ReplayConfig` field must be ``mode`` or an Inductor config key (they patch
    the Inductor compile): a misspelt field would otherwise surface at the first forward as an ``AttributeError``
    from Inductor's config."""
    unknown = [k for k in options if k != "mode"]
    if not unknown:
        return
    import difflib

    from torch._inductor import config as inductor_config

    known = set(inductor_config.get_config_copy())
    for key in unknown:
        if key in known:
            continue
        near = difflib.get_close_matches(key, sorted(ours), n=1, cutoff=0.6) or \
            difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"replay_compile: unknown option {key!r}: not a ReplayConfig field ({', '.join(sorted(ours))})"
                         f" nor an Inductor config key{hint}")
