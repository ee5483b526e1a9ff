"""Building and loading the CPU kernels' library, and the per-machine bf16 kernel choice.

The library is compiled on first use with the machine's C++ compiler (`$CXX`, else g++)
for this CPU (-march=native, capped by $XLASERVE_CPU_ISA: cpu_kernels.isa) and cached under
~/.cache/xlaserve/cpu_kernels, keyed by the source, the compiler, the jaxlib headers and the
instruction set. It needs x86-64 with AVX2 and FMA (simd16.h: the AVX-512 kernels on 8-lane
halves); `unavailable_reason()` says why not, and the engine then falls back to XLA's dot
and the jnp attention (runtime.engine_setup).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import isa

log = logging.getLogger(__name__)

_SOURCES = [pathlib.Path(__file__).with_name(n)
            for n in ("packed_matmul.cc", "attention.cc", "write_kv.cc", "parallel.h",
                      "simd16.h")]
_TARGETS = {"xlaserve_packed_matmul": "XlaservePackedMatmul",
            "xlaserve_packed_matmul_int8": "XlaservePackedMatmulInt8",
            "xlaserve_decode_attention": "XlaserveDecodeAttention",
            "xlaserve_extend_attention": "XlaserveExtendAttention",
            "xlaserve_decode_attention_bf16": "XlaserveDecodeAttentionBf16",
            "xlaserve_extend_attention_bf16": "XlaserveExtendAttentionBf16",
            "xlaserve_write_kv": "XlaserveWriteKv",
            "xlaserve_write_kv_bf16": "XlaserveWriteKvBf16"}
_CACHE = pathlib.Path(os.environ.get("XLASERVE_CPU_KERNELS_CACHE",
                                     "~/.cache/xlaserve/cpu_kernels")).expanduser()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def unavailable_reason() -> str | None:
    """None when the kernels can be built and run here, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64, this is {platform.machine()}"
    if isa.level() is None:
        return "needs a CPU with AVX2 and FMA"
    if _compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    return None


def _build() -> pathlib.Path:
    """Compile the library once per (source, compiler, flags, headers, CPU); return its
    path. -march=native turns on avx512_bf16 (vdpbf16ps) where the CPU has it."""
    cxx = _compiler()
    include = jax.ffi.include_dir()
    flags = [cxx, "-O3", "-march=native", *isa.compiler_flags(), "-std=c++17", "-shared",
             "-fPIC", "-w", f"-I{include}"]
    cmd = [*flags, *(str(src) for src in _SOURCES if src.suffix == ".cc")]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        *(src.read_text() for src in _SOURCES), " ".join(flags), version, jax.__version__,
        " ".join(sorted(isa.flags()))]).encode()).hexdigest()[:16]
    lib = _CACHE / key / "libxlaserve_cpu.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a
    # half-written library.
    with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
        out = pathlib.Path(tmp.name)
    log.info("compiling CPU kernels: %s", " ".join(cmd))
    done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"building the CPU kernels failed:\n{done.stderr[-4000:]}")
    out.replace(lib)
    return lib


# The bf16 matmul kernels (packed_matmul.cc): symbol per name; "dot" only where the
# compiler targets avx512_bf16, "amx" only where it targets AMX-BF16 and Linux lets this
# process use the tile registers (XlaserveAmxReady).
_BF16_SYMBOLS = {"widen": "XlaservePackedMatmulBf16Widen", "dot": "XlaservePackedMatmulBf16Dot",
                 "amx": "XlaservePackedMatmulBf16Amx"}
# The instruction-set level (cpu_kernels.isa) each is built at.
_BF16_LEVEL = {"widen": "avx2", "dot": "avx512_bf16", "amx": "amx"}
BF16_TARGET = "xlaserve_packed_matmul_bf16"  # the one that serves: bf16_kernel()
# The compressed bf16 matmul (pack_x12), decoding into either bf16 kernel's products;
# built where the compiler targets AVX-512BW ("dot": and avx512_bf16).
_X12_SYMBOLS = {"widen": "XlaservePackedMatmulX12Widen", "dot": "XlaservePackedMatmulX12Dot"}
_X12_TARGET = "xlaserve_packed_matmul_x12"


@functools.cache
def load() -> ctypes.CDLL:
    """Build (if needed) and register the FFI targets; raises when unavailable."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"xlaserve CPU kernels unavailable: {reason}")
    path = _build()
    lib = ctypes.cdll.LoadLibrary(str(path))
    kernels = _bf16_kernels(lib)
    symbols = {**_TARGETS, **{f"{BF16_TARGET}_{n}": _BF16_SYMBOLS[n] for n in kernels}}
    for target, symbol in symbols.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    kernel = _choose_bf16(path.parent / "bf16_kernel.json", kernels)
    jax.ffi.register_ffi_target(BF16_TARGET,
                                jax.ffi.pycapsule(getattr(lib, _BF16_SYMBOLS[kernel])),
                                platform="cpu")
    for n, symbol in _X12_SYMBOLS.items():
        if hasattr(lib, symbol):
            jax.ffi.register_ffi_target(f"{_X12_TARGET}_{n}",
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def x12_targets() -> dict[str, str]:
    """FFI target of each compressed bf16 matmul kernel this CPU runs ({"widen": ...,
    "dot": ...}; none without AVX-512BW), for tests and benchmarks."""
    lib = load()
    return {n: f"{_X12_TARGET}_{n}" for n, symbol in _X12_SYMBOLS.items() if hasattr(lib, symbol)}


def x12_unavailable_reason() -> str | None:
    """None when compressed bf16 weights (pack_x12) run here, else why not."""
    reason = unavailable_reason()
    if reason is None and (why := isa.missing("avx512")):
        reason = (f"bf16 weights in 12 bits decode with AVX-512BW byte shuffles ({why}); "
                  "the nearest format that runs here is --dtype=bfloat16 without "
                  "--compress_weights: the same weights in 16 bits")
    return reason


def _bf16_kernels(lib: ctypes.CDLL) -> list[str]:
    """The bf16 matmul kernels `lib` holds and this process can run."""
    kernels = [n for n, symbol in _BF16_SYMBOLS.items() if hasattr(lib, symbol)]
    if "amx" in kernels and not lib.XlaserveAmxReady():
        kernels.remove("amx")
    return kernels


def bf16_targets() -> dict[str, str]:
    """FFI target of each bf16 matmul kernel this CPU runs ({"widen": ..., "dot": ...,
    "amx": ...}), for tests and benchmarks; packed_matmul serves bf16_kernel()'s."""
    return {n: f"{BF16_TARGET}_{n}" for n in _bf16_kernels(load())}


def bf16_kernel() -> str:
    """The bf16 matmul kernel that serves on this CPU: "widen", "dot" or "amx"
    (_choose_bf16)."""
    load()
    return _bf16_choice


_bf16_choice = "widen"


def _choose_bf16(record: pathlib.Path, kernels: list[str]) -> str:
    """The faster bf16 kernel on this CPU (_pick_bf16), which bf16_kernel() then names."""
    global _bf16_choice
    _bf16_choice = _pick_bf16(record, kernels)
    return _bf16_choice


def _pick_bf16(record: pathlib.Path, kernels: list[str]) -> str:
    """The faster bf16 kernel on this CPU, measured once per library build and CPU (the
    record beside the library: later starts read it, so every process on a machine serves
    the same kernel and the same results). $XLASERVE_CPU_BF16_KERNEL overrides.

    It depends on the CPU: on an Intel Xeon (family 6 model 207) vdpbf16ps has half an
    FMA's issue rate and twice its latency, and widening measured faster (K=576, N=3072:
    M=1 804 vs 1046 us, M=32 1353 vs 1926); on an AMD EPYC (Zen 4) the dot kernel measured
    1.0-1.46x faster at one row and 1.7-1.8x at 32; on an Intel Xeon with AMX the AMX
    kernel is level with both at one row and 1.8-2.0x widening's speed at 32
    (docs/benchmarks.md)."""
    forced = os.environ.get("XLASERVE_CPU_BF16_KERNEL")
    if forced:
        if forced not in kernels:
            why = isa.missing(_BF16_LEVEL[forced]) if forced in _BF16_LEVEL else None
            raise ValueError(f"XLASERVE_CPU_BF16_KERNEL={forced!r}"
                             + (f" {why}" if why else "") + f"; the kernels here: {kernels}")
        return forced
    if len(kernels) == 1:
        return kernels[0]
    with open(record.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process starting beside us measures once
        if record.exists():
            return json.loads(record.read_text())["kernel"]
        # On a thread of its own: the first load() may come from inside a jit trace (the
        # first packed_matmul a process traces), whose trace context is the caller
        # thread's and would turn the timed arrays into tracers.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            secs = pool.submit(_time_bf16, kernels).result()
        # Each kernel's time relative to the best at each row count, summed: a kernel
        # must be good for single streams and batches alike.
        score = {n: sum(t / min(secs[o][m] for o in kernels) for m, t in secs[n].items())
                 for n in kernels}
        kernel = min(kernels, key=score.__getitem__)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kernel": kernel, "seconds": secs, "score": score}))
        tmp.replace(record)
    log.info("bf16 matmul kernel: %s (measured %s)", kernel, secs)
    return kernel


def _time_bf16(kernels: list[str]) -> dict[str, dict[int, float]]:
    """Median seconds of each bf16 kernel over a chain of 32 distinct [1024, 1024] weights
    (64 MiB, twice a large L3: read from memory as a decode step reads its weights) at 1
    and 32 rows; the kernels' calls interleaved (A B A B), so a neighbour's load falls on
    both alike (measured one after the other, the first kernel read 2x faster at one row
    for having the weights half in cache)."""
    # Imported here: the matmul wrappers call load(), which calls this.
    from cpu_kernels.matmul import ffi_matmul
    from cpu_kernels.packing import pack

    rng = np.random.default_rng(0)
    ws = [pack(jnp.asarray(rng.standard_normal((1024, 1024), np.float32) * 0.03,
                           jnp.bfloat16)) for _ in range(32)]

    def chain(target: str) -> Callable[[jax.Array, list[Any]], jax.Array]:
        def run(x: jax.Array, ws: list[Any]) -> jax.Array:
            for w in ws:
                x = x + 1e-3 * ffi_matmul(target, x, w)  # [M, 1024], each on the last
            return x
        return jax.jit(run)

    fns = {n: chain(f"{BF16_TARGET}_{n}") for n in kernels}
    out: dict[str, dict[int, float]] = {n: {} for n in kernels}
    for m in (1, 32):
        x = jnp.ones((m, 1024), jnp.float32)
        times: dict[str, list[float]] = {n: [] for n in kernels}
        for rnd in range(10):
            for n, fn in fns.items():
                t0 = time.perf_counter()
                fn(x, ws).block_until_ready()
                if rnd:  # the first round compiles and faults the weights in
                    times[n].append(time.perf_counter() - t0)
        for n in kernels:
            out[n][m] = float(np.median(times[n]))
    return out
