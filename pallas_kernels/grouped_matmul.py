"""Grouped expert matmul for a GPU: rows grouped by expert, each group's rows through its
own expert's weights, read in place from the stacked [E, K, N] weights.

XLA's GPU compiler turns `lax.ragged_dot` into a dense product of every row with every
expert (it reads all E experts whatever the routing), and a loop over the routed experts
copies each expert's dynamic slices before its gemms (docs/gpu.md). Here the rows are laid
out as tiles of `bm` rows of one expert each (`plan_tiles`, jnp), and one Triton program
per (tile, column block) loads its expert's [K, bn] columns straight from the stack: a
step reads each routed expert's weights once per tile of its rows, the others not at all.
The layout is vLLM's / SGLang's fused-MoE Triton kernel's (rows sorted by expert, padded
to whole blocks, one expert id per block; unused blocks exit at once).

Pallas' Triton backend is deprecated (since jax 0.11 it may be gone; models/moe.py then
keeps XLA's products).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mesh_types import out_struct

try:  # deprecated since jax 0.11
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

BLOCKS = (128, 64, 32, 16)  # column / depth block sizes tried, largest first (powers of 2)


def block_size(n: int, largest: int = 128) -> int | None:
    """The largest of BLOCKS up to `largest` dividing n (Triton blocks are powers of 2 >=
    16); None: none."""
    return next((b for b in BLOCKS if b <= largest and n % b == 0), None)


def available(k: int, n: int) -> bool:
    """Whether [E, K, N] experts can take the kernel: Triton present, K and N blocked."""
    return pltriton is not None and block_size(k) is not None and block_size(n) is not None


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Rows [M] grouped by expert as T tiles of bm rows, each within one expert's group."""

    expert: jax.Array  # [T] int32 tile's expert; E: an unused tile
    src: jax.Array  # [T, bm] int32 row of the input each tile row holds; M: none (padding)


def num_tiles(m: int, n_experts: int, bm: int) -> int:
    """Tiles enough for any grouping of m rows: each group's last tile may be partial, and
    every used tile holds at least one row."""
    return min(-(-m // bm) + n_experts, m)


def plan_tiles(es: jax.Array, n_experts: int, bm: int) -> TilePlan:
    """es [M] int32 each row's expert (n_experts or more: no expert, the row is skipped) ->
    the tiles: each expert's rows in order, bm to a tile, then unused tiles."""
    m = es.shape[0]
    t = num_tiles(m, n_experts, bm)
    order = jnp.argsort(es, stable=True).astype(jnp.int32)  # [M] rows grouped by expert
    sizes = jnp.bincount(jnp.minimum(es, n_experts), length=n_experts + 1)[:n_experts]  # [E]
    starts = jnp.cumsum(sizes) - sizes  # [E] each group's first sorted row
    tiles = -(-sizes // bm)  # [E] tiles of each group
    ends = jnp.cumsum(tiles)  # [E] one past each group's last tile
    tile = jnp.arange(t, dtype=jnp.int32)  # [T]
    expert = jnp.searchsorted(ends, tile, side="right").astype(jnp.int32)  # [T]; E: unused
    g = jnp.minimum(expert, n_experts - 1)
    first = starts[g] + (tile - (ends[g] - tiles[g])) * bm  # [T] the tile's first sorted row
    rows = jnp.where(expert < n_experts, jnp.minimum(bm, starts[g] + sizes[g] - first), 0)
    i = jnp.arange(bm, dtype=jnp.int32)  # [bm]
    at = jnp.minimum(first[:, None] + i[None, :], m - 1)  # [T, bm] sorted positions
    src = jnp.where(i[None, :] < rows[:, None], order[at], m)  # [T, bm]
    return TilePlan(expert=expert, src=src)


def gather_tiles(x: jax.Array, plan: TilePlan) -> jax.Array:
    """x [M, K] -> [T, bm, K], padding rows zero."""
    m = x.shape[0]
    return jnp.where((plan.src < m)[..., None], x[jnp.minimum(plan.src, m - 1)], 0)


def scatter_tiles(y: jax.Array, plan: TilePlan, m: int) -> jax.Array:
    """y [T, bm, N] -> [M, N]: each row's result from its tile; rows of no expert zero."""
    flat = y.reshape(-1, y.shape[-1])  # [T*bm, N]
    return jnp.zeros((m, y.shape[-1]), y.dtype).at[plan.src.reshape(-1)].set(flat, mode="drop")


def tile_matmul_kernel(e_ref, x_ref, w_ref, o_ref, *, n_experts: int, bk: int, bn: int):
    """One (tile, column block) program: o [bm, bn] = x [bm, K] @ w[e][:, block]; an unused
    tile (e = n_experts) loads nothing and writes zeros. x and w are whole arrays in GMEM."""
    t, j = pl.program_id(0), pl.program_id(1)
    e = e_ref[t]
    used = e < n_experts
    e = jnp.minimum(e, n_experts - 1)
    bm, k = x_ref.shape[1], x_ref.shape[2]
    f32 = x_ref.dtype == jnp.float32
    prec = lax.Precision.HIGHEST if f32 else None  # f32 in, no tf32

    def step(i, acc):
        xb = x_ref[t, :, pl.ds(i * bk, bk)]  # [bm, bk]
        wb = w_ref[e, pl.ds(i * bk, bk), pl.ds(j * bn, bn)]  # [bk, bn]
        return acc + jnp.dot(xb, wb, precision=prec, preferred_element_type=jnp.float32)

    steps = jnp.where(used, jnp.int32(k // bk), jnp.int32(0))  # bounds of one type for scf.for
    acc = lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def tile_matmul(x: jax.Array, w: jax.Array, expert: jax.Array,
                interpret: bool = False) -> jax.Array:
    """x [T, bm, K] tiles, w [E, K, N] stacked experts, expert [T] int32 (E: unused) ->
    [T, bm, N] in x's dtype: tile t times its expert's weights (f32 accumulation)."""
    if pltriton is None:
        raise NotImplementedError("the grouped expert matmul needs Pallas' Triton backend")
    t, bm, k = x.shape
    n_experts, _, n = w.shape
    # vLLM's fused-MoE defaults, untuned here: few rows a tile (decode) take narrow column
    # blocks, so a step with one routed expert still spreads its weights over many programs
    bn, bk = (32, 64) if bm <= 16 else (64, 32)
    bk, bn = block_size(k, bk), block_size(n, bn)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)  # whole array, indexed inside the kernel
    return pl.pallas_call(
        functools.partial(tile_matmul_kernel, n_experts=n_experts, bk=bk, bn=bn),
        grid=(t, n // bn),
        in_specs=[anywhere, anywhere, anywhere],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j: (i, 0, j)),
        out_shape=out_struct((t, bm, n), x.dtype, expert, x, w),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(expert, x, w)


def grouped_matmul_ref(x: jax.Array, w: jax.Array, es: jax.Array) -> jax.Array:
    """x [M, K], w [E, K, N], es [M] (E or more: zeros) -> [M, N], f32 accumulation."""
    n_experts = w.shape[0]
    y = jnp.einsum("mk,mkn->mn", x, w[jnp.minimum(es, n_experts - 1)],
                   precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where((es < n_experts)[:, None], y, 0).astype(x.dtype)
