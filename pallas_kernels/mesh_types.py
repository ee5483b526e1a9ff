"""Types of values under shard_map: which manual mesh axes (tp heads, dp rows) a value
varies over. shard_map checks them (check_vma): a loop's carry must keep its type across
trips, and a kernel's output type must say how it varies. Outside shard_map nothing varies
and these helpers change nothing."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import ManualAxisType


def varying_axes(*xs: jax.Array) -> frozenset[str]:
    """The manual mesh axes that at least one of xs varies over."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in xs))


def varying_like(x: jax.Array, *inputs: jax.Array) -> jax.Array:
    """x typed to vary over every axis one of `inputs` varies over: the initial carry of a
    loop whose body updates it from those inputs (a constant start is replicated, the
    update is not)."""
    axes = varying_axes(*inputs) - varying_axes(x)
    return lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def out_struct(shape: tuple[int, ...], dtype, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output's type: it varies over the axes its inputs vary over."""
    axes = varying_axes(*inputs)
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=ManualAxisType(varying=axes) if axes else None)
