"""CPU kernels of our own, called from jit through the XLA FFI.

`packed_matmul`: x [M, K] @ W [K, N] with W packed once at load (`pack`) into 64-column
panels; see packed_matmul.cc for why XLA CPU's own GEMM is slow on decode-sized M.

The library is compiled on first use with the machine's C++ compiler (`$CXX`, else g++)
for this CPU (-march=native) and cached under ~/.cache/xlaserve/cpu_kernels, keyed by the
source, the compiler, the jaxlib headers and the CPU. It needs x86-64 with AVX-512F;
`unavailable_reason()` says why not, and callers fall back to XLA's matmul.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

PANEL = 64  # panel width, kNR in packed_matmul.cc
_SOURCE = pathlib.Path(__file__).with_name("packed_matmul.cc")
_TARGET = "xlaserve_packed_matmul"
_CACHE = pathlib.Path(os.environ.get("XLASERVE_CPU_KERNELS_CACHE",
                                     "~/.cache/xlaserve/cpu_kernels")).expanduser()


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def unavailable_reason() -> str | None:
    """None when the kernels can be built and run here, else why not."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64, this is {platform.machine()}"
    if "avx512f" not in _cpu_flags():
        return "needs a CPU with AVX-512F"
    if _compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    return None


def _build() -> pathlib.Path:
    """Compile the library once per (source, compiler, headers, CPU); return its path."""
    cxx = _compiler()
    include = jax.ffi.include_dir()
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{include}", str(_SOURCE)]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        _SOURCE.read_text(), " ".join(cmd[:-2]), version, jax.__version__,
        " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]
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
        raise RuntimeError(f"building {_SOURCE.name} failed:\n{done.stderr[-4000:]}")
    out.replace(lib)
    return lib


@functools.cache
def load() -> None:
    """Build (if needed) and register the FFI targets; raises when unavailable."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"xlaserve CPU kernels unavailable: {reason}")
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.XlaservePackedMatmul),
                                platform="cpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """W [..., K, N] as panels [..., P, K, 64], P = ceil(N / 64), zero-padded."""

    panels: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., K, N]."""
        return (*self.panels.shape[:-3], self.panels.shape[-2], self.n)


def pack(w: jax.Array) -> PackedWeight:
    """W [..., K, N] (float32) -> PackedWeight."""
    *lead, k, n = w.shape
    p = -(-n // PANEL)
    w = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, p * PANEL - n)])
    panels = jnp.swapaxes(w.reshape(*lead, k, p, PANEL), -3, -2)  # [..., P, K, 64]
    return PackedWeight(panels=panels, n=n)


def packed_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [..., K] (float32) @ W -> [..., N] through the FFI kernel."""
    if w.panels.ndim != 3:
        raise ValueError(f"packed_matmul takes one matrix, got panels {w.panels.shape}")
    load()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    y = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.n), jnp.float32))(
        x2, w.panels)
    return y.reshape(*lead, w.n)
