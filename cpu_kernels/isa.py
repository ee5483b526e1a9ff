"""Which x86-64 instruction sets the CPU kernels are built for.

The kernels come in levels, each adding instructions to the one below:

    avx2         AVX2 + FMA: every kernel, on 8-lane halves (simd16.h)
    avx512       AVX-512 F/BW/DQ/VL: 16-lane kernels, and bf16 weights in 12 bits
                 (--compress_weights), whose decoder is a byte shuffle of AVX-512BW
    avx512_bf16  + vdpbf16ps: the "dot" bf16 matmul kernel
    amx          + AMX-BF16 tiles: the "amx" bf16 matmul kernel

A machine runs its own level and every level below it. `XLASERVE_CPU_ISA=LEVEL` caps the
level the kernels are built for (as oneDNN's ONEDNN_MAX_CPU_ISA does), so one AVX-512
machine can build and test the AVX2 kernels too; it is read once per process. A cap above
the machine's own level is the machine's level.
"""

from __future__ import annotations

import functools
import os
import pathlib

LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
ENV = "XLASERVE_CPU_ISA"

# /proc/cpuinfo flags each level needs beyond the levels below it.
_NEEDS = {"avx2": ("avx2", "fma"),
          "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
          "avx512_bf16": ("avx512_bf16",),
          "amx": ("amx_tile", "amx_bf16")}
# The flag prefixes a build capped below each level leaves out, and the compiler switches
# that turn them off under -march=native (GCC and Clang: -mno-avx512f drops every AVX-512
# extension, -mno-amx-tile every AMX one).
_DROP = {"avx512": (("avx512", "amx"), ("-mno-avx512f", "-mno-amx-tile")),
         "avx512_bf16": (("avx512_bf16", "amx"), ("-mno-avx512bf16", "-mno-amx-tile")),
         "amx": (("amx",), ("-mno-amx-tile",))}
# Which feature each format or kernel needs, for messages.
FEATURE_OF_LEVEL = {"avx2": "AVX2 and FMA", "avx512": "AVX-512BW", "avx512_bf16":
                    "AVX512_BF16", "amx": "AMX-BF16"}


@functools.cache
def machine_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it can't be read)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def level_of(flags: frozenset[str] | set[str]) -> str | None:
    """The highest level a CPU with these flags runs (None: below AVX2 + FMA)."""
    best = None
    for level in LEVELS:
        if not set(_NEEDS[level]) <= flags:
            break
        best = level
    return best


def machine_level() -> str | None:
    """This CPU's own level, ignoring the cap."""
    return level_of(machine_flags())


@functools.cache
def cap() -> str | None:
    """$XLASERVE_CPU_ISA, checked (None: unset or "native")."""
    want = os.environ.get(ENV, "").strip().lower()
    if want in ("", "native"):
        return None
    if want not in LEVELS:
        raise ValueError(f"{ENV}={want!r}: want one of {', '.join(LEVELS)} or native")
    return want


def level() -> str | None:
    """The level the kernels are built for: the machine's, capped by $XLASERVE_CPU_ISA."""
    own, limit = machine_level(), cap()
    if own is None or limit is None:
        return own
    return LEVELS[min(LEVELS.index(own), LEVELS.index(limit))]


def has(want: str) -> bool:
    """Whether the kernels are built for `want` (a level) or above."""
    now = level()
    return now is not None and LEVELS.index(now) >= LEVELS.index(want)


def flags() -> frozenset[str]:
    """The machine's flags less those above the level (what the build may use)."""
    now = level()
    out = set(machine_flags())
    for above, (prefixes, _) in _DROP.items():
        if now is None or LEVELS.index(now) < LEVELS.index(above):
            out = {f for f in out if not f.startswith(prefixes)}
    return frozenset(out)


def compiler_flags() -> list[str]:
    """Switches after -march=native that keep the build at level(): they turn off what
    the CPU has above it (none at the machine's own level)."""
    now = level()
    have = machine_flags()
    out: list[str] = []
    for above, (prefixes, switches) in _DROP.items():
        above_now = now is None or LEVELS.index(now) < LEVELS.index(above)
        if above_now and any(f.startswith(prefixes) for f in have):
            out += [s for s in switches if s not in out]
    return out


def levels_below() -> list[str]:
    """The levels under the machine's own that it can also run (for `make test`)."""
    own = machine_level()
    return [] if own is None else list(LEVELS[:LEVELS.index(own)])


def missing(want: str) -> str | None:
    """None when the kernels here are built for `want` (a level), else a sentence naming
    the missing feature and whether the CPU or the cap leaves it out."""
    if has(want):
        return None
    feature = FEATURE_OF_LEVEL[want]
    own = machine_level()
    if own is not None and LEVELS.index(own) >= LEVELS.index(want):
        return f"needs {feature}, which {ENV}={cap()} leaves out"
    return f"needs {feature}, which this CPU lacks"
