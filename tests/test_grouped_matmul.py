"""The grouped expert matmul (pallas_kernels/grouped_matmul.py) against its jnp reference,
in Pallas interpret mode on the CPU: f32 and bf16, ragged groups (empty ones, one longer
than a tile, rows of no expert), and the tile plan's layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm


def _grouped(x: jax.Array, w: jax.Array, es: jax.Array, bm: int) -> jax.Array:
    plan = gm.plan_tiles(es, w.shape[0], bm)
    tiles = gm.tile_matmul(gm.gather_tiles(x, plan), w, plan.expert, interpret=True)
    return gm.scatter_tiles(tiles, plan, x.shape[0])


ROUTINGS = {
    "ragged": [2] * 20 + [0, 4, 4, 5, 0, 2, 4, 5, 5, 2],  # 1 and 3 empty, 2 over a tile
    "no_expert": [5] * 12,  # every row without an expert: zeros
    "one_row": [3],
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_grouped_matmul_equals_reference(routing, dtype, tol):
    """Each row through its expert's [K, N] weights (experts E = 5; id 5: no expert, zero
    rows), K and N over several blocks, tiles of 16 rows."""
    rng = np.random.default_rng(len(routing))
    es = np.asarray(ROUTINGS[routing], np.int32)
    rng.shuffle(es)
    m, e, k, n = len(es), 5, 96, 48  # blocks: K 32 x 3, N 16 x 3
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype)
    got = jax.jit(_grouped, static_argnums=3)(x, w, jnp.asarray(es), 16)
    want = gm.grouped_matmul_ref(x, w, jnp.asarray(es))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[es == e], 0)


def test_tile_plan_holds_each_expert_row_once():
    """Tiles hold one expert's rows each, in row order, every routed row once; a group of 20
    rows takes two 16-row tiles, empty groups none, and the spare tiles are unused (id E)."""
    es = np.asarray([2] * 20 + [0, 4, 4, 5, 0], np.int32)  # E = 5; 5: no expert
    plan = gm.plan_tiles(jnp.asarray(es), 5, 16)
    expert, src = np.asarray(plan.expert), np.asarray(plan.src)
    used = expert < 5
    assert list(expert[used]) == [0, 2, 2, 4]
    assert len(expert) == gm.num_tiles(len(es), 5, 16)
    assert (src[~used] == len(es)).all()
    rows = src[src < len(es)]
    assert sorted(rows) == [i for i in range(len(es)) if es[i] < 5]
    for t in np.flatnonzero(used):
        held = src[t][src[t] < len(es)]
        assert (es[held] == expert[t]).all() and list(held) == sorted(held)


def test_block_sizes_are_powers_of_two_dividing_the_dims():
    assert gm.block_size(768) == 128 and gm.block_size(96) == 32 and gm.block_size(40) is None
    assert gm.available(2048, 768) == (gm.pltriton is not None)
    assert not gm.available(2048, 40)
