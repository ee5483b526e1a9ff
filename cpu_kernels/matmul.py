"""The packed matmul through the FFI: x [..., K] @ a PackedWeight, in the weight's format."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build
from cpu_kernels.packing import PackedWeight


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
    build.load()
    if w.dtype == jnp.uint8:
        return ffi_matmul(target or x12_target(), x, w)
    name = {"float32": "xlaserve_packed_matmul",
            "int8": "xlaserve_packed_matmul_int8"}.get(w.dtype.name, target or build.BF16_TARGET)
    return ffi_matmul(name, x, w)


def ffi_matmul(name: str, x: jax.Array, w: PackedWeight) -> jax.Array:
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


def x12_target() -> str:
    """The compressed kernel that serves: the products of the bf16 kernel that serves
    (bf16_kernel), vdpbf16ps where that is "dot", else widening (AMX's tiles take whole
    16-row blocks; a decode step's rows are few)."""
    targets = build.x12_targets()
    if not targets:
        raise RuntimeError(f"compressed bf16 weights unavailable: {build.x12_unavailable_reason()}")
    return targets["dot" if build.bf16_kernel() == "dot" and "dot" in targets else "widen"]
