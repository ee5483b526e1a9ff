"""CPU kernels of our own, called from jit through the XLA FFI.

`packed_matmul`: x [M, K] @ W [K, N] with W packed once at load (`pack`) into 64-column
panels; see packed_matmul.cc for why XLA CPU's own GEMM is slow on decode-sized M. Up to
three bf16 kernels (widening, vdpbf16ps, AMX tiles); the fastest on this CPU serves
(bf16_kernel, measured once per machine). `pack_int8`: weight-only int8 panels with a
scale per output column (`--quantization=int8`), a quarter of f32's bytes. `pack_x12`:
bf16 weights in 12 bits each, losslessly (`--compress_weights`): 3/4 of bf16's bytes for
a memory-bound decode step, the same products.
`decode_attention`, `extend_attention`: paged attention of decode rows / of prefill
(extend) tokens, reading the pool (float32 or bfloat16) in place; see attention.cc.
`write_kv`: this step's K/V into the pool in place (write_kv.cc: XLA CPU's scatter
converts a whole bf16 pool every step).

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
import dataclasses
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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import isa

log = logging.getLogger(__name__)

PANEL = 64  # panel width, kNR in packed_matmul.cc
X12_STEP = 192  # bytes of a compressed k pair of a panel, kX12StepBytes in packed_matmul.cc
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
_BF16_TARGET = "xlaserve_packed_matmul_bf16"  # the one that serves: bf16_kernel()
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
    symbols = {**_TARGETS, **{f"{_BF16_TARGET}_{n}": _BF16_SYMBOLS[n] for n in kernels}}
    for target, symbol in symbols.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    kernel = _choose_bf16(path.parent / "bf16_kernel.json", kernels)
    jax.ffi.register_ffi_target(_BF16_TARGET,
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


def _x12_target() -> str:
    """The compressed kernel that serves: the products of the bf16 kernel that serves
    (bf16_kernel), vdpbf16ps where that is "dot", else widening (AMX's tiles take whole
    16-row blocks; a decode step's rows are few)."""
    targets = x12_targets()
    if not targets:
        raise RuntimeError(f"compressed bf16 weights unavailable: {x12_unavailable_reason()}")
    return targets["dot" if bf16_kernel() == "dot" and "dot" in targets else "widen"]


def _bf16_kernels(lib: ctypes.CDLL) -> list[str]:
    """The bf16 matmul kernels `lib` holds and this process can run."""
    kernels = [n for n, symbol in _BF16_SYMBOLS.items() if hasattr(lib, symbol)]
    if "amx" in kernels and not lib.XlaserveAmxReady():
        kernels.remove("amx")
    return kernels


def bf16_targets() -> dict[str, str]:
    """FFI target of each bf16 matmul kernel this CPU runs ({"widen": ..., "dot": ...,
    "amx": ...}), for tests and benchmarks; packed_matmul serves bf16_kernel()'s."""
    return {n: f"{_BF16_TARGET}_{n}" for n in _bf16_kernels(load())}


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
    rng = np.random.default_rng(0)
    ws = [pack(jnp.asarray(rng.standard_normal((1024, 1024), np.float32) * 0.03,
                           jnp.bfloat16)) for _ in range(32)]

    def chain(target: str) -> Callable[[jax.Array, list[PackedWeight]], jax.Array]:
        def run(x: jax.Array, ws: list[PackedWeight]) -> jax.Array:
            for w in ws:
                x = x + 1e-3 * _ffi_matmul(target, x, w)  # [M, 1024], each on the last
            return x
        return jax.jit(run)

    fns = {n: chain(f"{_BF16_TARGET}_{n}") for n in kernels}
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """W [..., K, N] as panels, P = ceil(N / 64), zero-padded (packed_matmul.cc):
    float32 [..., P, K, 64]; bfloat16 [..., P, K2, 64, 2] with K2 = ceil(K / 2), rows
    k and k + 1 interleaved per column (vdpbf16ps's operand layout); int8 (pack_int8)
    [..., P, K4 * 4, 64] with K4 = ceil(K / 4) and `scales` f32 [..., P, 64], W's
    column n being q[:, n] * scales[n]; compressed bfloat16 (pack_x12) uint8
    [..., P, K2, 192] with `table` uint8 [..., 16], `exc_start` int32 [..., P + 1] and
    `exc` int32 [..., E, 2] (packed_matmul.cc, X12Decode).

    `layer`: None for one matrix; for a stack of them ([L, ...] panels), the traced index
    of the one a call multiplies by (at_layer), which the kernel reads in place.
    `rows`: None, or int32 [M]: the rows of x [M, K] a call computes (nonzero); the
    others, a bucket's padding, come out zero at no cost (only_rows)."""

    panels: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    layer: jax.Array | None = None
    rows: jax.Array | None = None
    scales: jax.Array | None = None
    table: jax.Array | None = None
    exc_start: jax.Array | None = None
    exc: jax.Array | None = None

    @property
    def matrix_ndim(self) -> int:
        """Dims of one matrix's panels."""
        return 4 if self.dtype == jnp.bfloat16 else 3

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., K, N] (of the picked matrix when `layer` is set)."""
        lead = self.panels.shape[:self.panels.ndim - self.matrix_ndim]
        return (*(lead[1:] if self.layer is not None else lead), self.k, self.n)

    @property
    def dtype(self) -> jnp.dtype:
        return self.panels.dtype


def at_layer(w: PackedWeight, layer: jax.Array) -> PackedWeight:
    """Matrix `layer` (traced int32 []) of a stack of them [L, K, N], without a copy."""
    if w.panels.ndim != w.matrix_ndim + 1:
        raise ValueError(f"at_layer takes a stack of matrices, got panels {w.panels.shape}")
    return dataclasses.replace(w, layer=layer)


def only_rows(tree: Any, rows: jax.Array) -> Any:
    """Every PackedWeight of `tree` computing only the x rows where rows [M] is nonzero
    (the real tokens of a padded batch: runtime/forward_batch.real_token_mask)."""
    return jax.tree.map(
        lambda w: dataclasses.replace(w, rows=rows) if isinstance(w, PackedWeight) else w,
        tree, is_leaf=lambda w: isinstance(w, PackedWeight))


def pack(w: jax.Array) -> PackedWeight:
    """W [..., K, N] (float32 or bfloat16) -> PackedWeight of the same dtype."""
    *lead, k, n = w.shape
    p = -(-n // PANEL)
    if w.dtype == jnp.float32:
        w = jnp.pad(w, [(0, 0)] * (len(lead) + 1) + [(0, p * PANEL - n)])
        panels = jnp.swapaxes(w.reshape(*lead, k, p, PANEL), -3, -2)  # [..., P, K, 64]
        return PackedWeight(panels=panels, n=n, k=k)
    if w.dtype != jnp.bfloat16:
        raise ValueError(f"pack takes float32 or bfloat16 weights, not {w.dtype}")
    k2 = -(-k // 2)
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, 2 * k2 - k), (0, p * PANEL - n)])
    w = w.reshape(*lead, k2, 2, p, PANEL)  # [..., K2, 2, P, 64]
    nd = len(lead)
    panels = w.transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)  # [..., P, K2, 64, 2]
    return PackedWeight(panels=panels, n=n, k=k)


def pack_int8(w: jax.Array | np.ndarray) -> PackedWeight:
    """W [..., K, N] -> weight-only int8 panels: each column n symmetric over its K values,
    q = round(W[:, n] / s_n) in [-127, 127] with s_n = max |W[:, n]| / 127 (the scheme of
    SGLang's torchao `int8wo` and of llama.cpp's Q8_0, there per block of 32). Per column
    the scale factors out of the sum: y = (x @ q) * s, one multiply an output.

    Quantized on the host in numpy, each step one IEEE f32 operation, so q and s are
    exactly what a reference computing the same formula gets (make_reference.py's
    torch): under XLA a scale came out 1 ulp off and moved a q by one."""
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    amax = np.abs(w).max(axis=-2)  # [..., N]
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    p, kp = -(-n // PANEL), -(-k // 4) * 4
    q = np.pad(q, [(0, 0)] * len(lead) + [(0, kp - k), (0, p * PANEL - n)])
    panels = np.swapaxes(q.reshape(*lead, kp, p, PANEL), -3, -2)  # [..., P, Kp, 64]
    scales = np.pad(scale, [(0, 0)] * len(lead) + [(0, p * PANEL - n)])
    return PackedWeight(panels=jnp.asarray(np.ascontiguousarray(panels)), n=n, k=k,
                        scales=jnp.asarray(scales.reshape(*lead, p, PANEL)))


def pack_x12(w: jax.Array | np.ndarray) -> PackedWeight:
    """W [..., K, N] bfloat16 -> the same weights in 12 bits each, losslessly.

    Each bf16's high byte (sign and 7 exponent bits) becomes a 4-bit code into a table of
    its matrix's 15 most frequent high bytes and 0x00; its low byte is kept. A weight
    whose high byte has no code (SmolLM2: ~0.02%) is stored as +0 and listed as an
    exception, which the kernel adds after the product. The panel layout is the bf16
    panels' (pack), each k pair's 128 values in packed_matmul.cc's byte order
    (X12Decode). Done on the host in numpy, once at load."""
    plain = pack(jnp.asarray(w, jnp.bfloat16))
    rows = np.asarray(plain.panels).view(np.uint16)  # [..., P, K2, 64, 2]
    *lead, p, k2 = rows.shape[:-2]
    mats = rows.reshape(-1, p, k2, 2 * PANEL)  # [B, P, K2, 128]: word t = 2 column + k parity
    t = np.arange(2 * PANEL)
    j, wi = t // 32, t % 32  # zmm j of the row, word wi in it
    byte = 16 * (wi // 8) + 8 * (j % 2) + wi % 8
    steps = np.zeros((*mats.shape[:3], X12_STEP), np.uint8)
    tables = np.zeros((len(mats), 16), np.uint8)
    starts = np.zeros((len(mats), p + 1), np.int32)
    excs = []
    for b, mat in enumerate(mats):
        hi = (mat >> 8).astype(np.uint8)
        counts = np.bincount(hi.ravel(), minlength=256)
        counts[0] = -1  # 0x00 is entry 0 whatever its count: exceptions decode to +0
        top = np.argsort(-counts, kind="stable")[:15]
        table = np.concatenate([[0], np.sort(top)]).astype(np.uint8)
        lut = np.full(256, -1, np.int16)
        lut[table] = np.arange(16)
        code = lut[hi]
        miss = code < 0
        lo = (mat & 0xFF).astype(np.uint8)
        code[miss], lo[miss] = 0, 0
        step = steps[b]  # [P, K2, 192], a view
        step[..., 64 * (j // 2) + byte] = lo
        for half in (0, 1):
            sel = j // 2 == half
            step[..., 128 + byte[sel]] |= (code[..., sel] << (4 * half)).astype(np.uint8)
        pp, ss, tt = np.nonzero(miss)
        pos = (2 * ss + tt % 2) * PANEL + tt // 2  # k * 64 + column
        order = np.lexsort((pos, pp))
        excs.append(np.stack([pos[order], mat[pp, ss, tt][order].astype(np.int32)], -1))
        starts[b, 1:] = np.cumsum(np.bincount(pp, minlength=p))
        tables[b] = table
    e_max = max(len(e) for e in excs)
    exc = np.zeros((len(mats), e_max, 2), np.int32)
    for b, e in enumerate(excs):
        exc[b, :len(e)] = e
    return PackedWeight(panels=jnp.asarray(steps.reshape(*lead, p, k2, X12_STEP)),
                        n=plain.n, k=plain.k,
                        table=jnp.asarray(tables.reshape(*lead, 16)),
                        exc_start=jnp.asarray(starts.reshape(*lead, p + 1)),
                        exc=jnp.asarray(exc.reshape(*lead, e_max, 2)))


def packed_matmul(x: jax.Array, w: PackedWeight, *, target: str | None = None) -> jax.Array:
    """x [..., K] @ W -> [..., N] float32 through the FFI kernel.

    Float32 panels multiply x as float32; bfloat16 panels multiply x rounded to bfloat16
    (the kernel rounds it, to nearest even as XLA's convert does; the products are exact
    in f32 and accumulate there). `target`: one bf16 kernel by name (tests, measurements:
    bf16_targets); by default the one bf16_kernel() names."""
    want = w.matrix_ndim + (w.layer is not None)
    if w.panels.ndim != want:
        raise ValueError(f"packed_matmul takes one matrix (or a stack and its layer), got "
                         f"panels {w.panels.shape}")
    load()
    if w.dtype == jnp.uint8:
        return _ffi_matmul(target or _x12_target(), x, w)
    name = {"float32": "xlaserve_packed_matmul",
            "int8": "xlaserve_packed_matmul_int8"}.get(w.dtype.name, target or _BF16_TARGET)
    return _ffi_matmul(name, x, w)


def _ffi_matmul(name: str, x: jax.Array, w: PackedWeight) -> jax.Array:
    layer = jnp.asarray(0 if w.layer is None else w.layer, jnp.int32).reshape(())
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if w.rows is not None and w.rows.shape != x2.shape[:1]:
        raise ValueError(f"row mask {w.rows.shape} does not match x rows {x2.shape[:1]}")
    rows = jnp.zeros((0,), jnp.int32) if w.rows is None else w.rows.astype(jnp.int32)
    extra = tuple(a for a in (w.scales, w.table, w.exc_start, w.exc) if a is not None)
    y = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x2.shape[0], w.n), jnp.float32))(
        x2.astype(jnp.float32), w.panels, *extra, layer, rows)
    return y.reshape(*lead, w.n)


def _attention_call(name: str, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_pool: jax.Array, v_pool: jax.Array, *rest: jax.Array,
                    sm_scale: float, sliding_window: int | None,
                    soft_cap: float | None) -> jax.Array:
    """One attention kernel on pools of float32 or bfloat16: q in f32, this step's K/V
    rounded to the pool's dtype (what the pool will hold, so a key reads the same whether
    it is new or cached), the output in q's dtype."""
    load()
    if k_pool.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"CPU attention reads float32 or bfloat16 pages, not {k_pool.dtype}")
    suffix = "_bf16" if k_pool.dtype == jnp.bfloat16 else ""
    out = jax.ffi.ffi_call(name + suffix, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_new.astype(k_pool.dtype), v_new.astype(k_pool.dtype),
        k_pool, v_pool.astype(k_pool.dtype), *rest, sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0), sliding_window=np.int64(sliding_window or 0))
    return out.astype(q.dtype)


def decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                     seq_lens: jax.Array, *, sm_scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> jax.Array:
    """Decode rows' attention, f32 arithmetic (the contract of attention_ref._decode).

    q [B, Hq, Dh]; k_new, v_new [B, Hkv, Dh] (each row's own new key, at seq_len - 1);
    pools [L, Hkv, P, S, Dh] (float32 or bfloat16) holding the earlier context; layer []
    int32; page_table [B, Np] int32; seq_lens [B] int32 -> [B, Hq, Dh]."""
    return _attention_call("xlaserve_decode_attention", q, k_new, v_new, k_pool, v_pool,
                           jnp.asarray(layer, jnp.int32).reshape(()), page_table, seq_lens,
                           sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


def extend_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                     query_start: jax.Array, positions: jax.Array, *, sm_scale: float,
                     sliding_window: int | None = None,
                     soft_cap: float | None = None) -> jax.Array:
    """Extend tokens' attention, f32 arithmetic (the contract of attention_ref._extend).

    q [T, Hq, Dh] of B rows laid back to back (query_start [B + 1]; tokens past the last
    row are padding and give 0); k_new, v_new [T, Hkv, Dh]; pools [L, Hkv, P, S, Dh]
    (float32 or bfloat16); page_table [B, Np] (may be width 0) listing each row's cached
    prefix, which ends at the position of the row's first new token; positions [T]
    -> [T, Hq, Dh]."""
    return _attention_call("xlaserve_extend_attention", q, k_new, v_new, k_pool, v_pool,
                           jnp.asarray(layer, jnp.int32).reshape(()), page_table,
                           query_start, positions, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap)


def write_kv(k_pool: jax.Array, v_pool: jax.Array, layers: jax.Array, slots: jax.Array,
             k: jax.Array, v: jax.Array, after: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """runtime.kv_pool.write_kv's contract on pools of float32 or bfloat16, in place:
    k, v [N, T, Hkv, Dh] of layers [N] into flat slots [T] (page * S + slot) of pools
    [L, Hkv, P, S, Dh]; slots outside the pool are dropped. The pools are aliased to the
    results, so under a donating jit no copy of them is made, provided XLA sees the write
    come after every read of the pools: `after`, an array computed from those reads (not
    read here), makes it a data dependency. Without it, when the reads are not inside a
    loop whose outputs feed k and v (a one-layer scan, which XLA unrolls), XLA CPU copied
    the whole pool before the reads and again before the write."""
    load()
    if k_pool.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"write_kv writes float32 or bfloat16 pages, not {k_pool.dtype}")
    suffix = "_bf16" if k_pool.dtype == jnp.bfloat16 else ""
    pool = jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)
    return jax.ffi.ffi_call("xlaserve_write_kv" + suffix, (pool, pool),
                            input_output_aliases={0: 0, 1: 1})(
        k_pool, v_pool, layers.astype(jnp.int32), slots.astype(jnp.int32),
        k.astype(k_pool.dtype), v.astype(k_pool.dtype),
        jnp.zeros((0,), jnp.int32) if after is None else after)


_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_COLLAPSE = 4, 14, 25  # linux/mman.h
_HUGE = 2 << 20  # x86-64's transparent huge page


def _huge_ranges(tree: object, min_bytes: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) of every whole 2 MiB page inside the CPU arrays of `tree` of at least
    `min_bytes`."""
    jax.block_until_ready(tree)  # the pointers of arrays still being computed
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.nbytes < min_bytes:
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            start = shard.data.unsafe_buffer_pointer()
            lo = -(-start // _HUGE) * _HUGE
            hi = (start + shard.data.nbytes) // _HUGE * _HUGE
            if hi > lo:
                yield lo, hi


def back_with_huge_pages(tree: object, min_bytes: int = 4 << 20) -> int:
    """Ask Linux to hold the CPU arrays of `tree` of at least `min_bytes` in 2 MiB pages
    (madvise MADV_HUGEPAGE, then MADV_COLLAPSE to move them now, Linux >= 6.1); returns
    the bytes collapsed. Advisory: any refusal leaves the array as it was.

    Why: a decode step streams every weight once, and with 4 KiB pages each call's
    stream misses the TLB every 4 KiB and the hardware prefetchers stop at every page
    boundary. A chain of 60 [576, 3072] bf16 matmuls at one row reads 13% faster on huge
    pages (80.5 against 92.1 us a call, AMD EPYC Zen 4; docs/benchmarks.md). The machines here
    leave transparent huge pages to madvise, so nothing gets them unasked."""
    libc = _libc()
    if libc is None:
        return 0
    done = 0
    for lo, hi in _huge_ranges(tree, min_bytes):
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            done += (hi - lo) if libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0 else 0
    return done


def zeros_in_huge_pages(tree: object, min_bytes: int = 4 << 20) -> int:
    """For CPU arrays of `tree` that hold only zeros (a fresh KV pool): hand their pages
    back to Linux (MADV_DONTNEED) and mark the memory MADV_HUGEPAGE, so each 2 MiB of it
    comes back zero-filled in one huge page where it is first touched; returns the bytes.
    XLA's CPU buffers are private anonymous memory, which reads back as zeros after
    MADV_DONTNEED, so the arrays' contents do not change. Advisory, like
    back_with_huge_pages.

    Why not collapse them as back_with_huge_pages does: collapsing a fresh 1.4 GiB pool
    took ~4 s at start-up (the kernel compacts memory for it; in a thread beside
    warm-up's compilation it did not overlap); this takes ~0.1 s, and pages never used
    are never allocated."""
    libc = _libc()
    if libc is None:
        return 0
    done = 0
    for lo, hi in _huge_ranges(tree, min_bytes):
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 and \
                libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            done += hi - lo
    return done


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
