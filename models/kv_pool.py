"""Device KV pool: one paged K and V buffer per model, layers stacked.

The host side (page allocator, request page tables) is runtime/kv_cache.py and
never imports jax; this module is the device half. Page 0 is reserved: padding
tokens write their K/V there, so a padded batch never touches a live page.

Sliding-window rings (a model with sliding and global layers,
RunnerConfig.sliding_window_rings): the main pool holds the global layers only, and the
sliding layers get a second pool in which each request slot owns a fixed ring of
`ring_pages` pages, reused as the context grows. Position p of slot s lives in ring page
`1 + s * R + (p // S) % R`; a row's sliding page table is "virtual", as wide as the main
one, entry j = its ring's page j % R. Entries before the window alias live ring pages,
which the kernels' window masks exclude (pallas_kernels/attention_ref.py masks by
position), so no kernel changes. An extend step writes its tokens after attending, so a
ring holds window + the longest extend of a row (ring_pages_for).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.forward_mode import PAD_POSITION


class PoolGeometry(Protocol):
    """The pool's page geometry (runtime.config.CacheConfig is one)."""

    @property
    def page_size(self) -> int: ...

    @property
    def num_pages(self) -> int: ...


@struct.dataclass
class KVPool:
    """Heads outside pages ("HND" per layer): one (layer, KV head, page) is a contiguous
    [S, Dh] block, so gathering a batch's pages for one layer is a gather of whole rows
    that lands directly in the [Hkv, B, tokens, Dh] order attention multiplies in (on the
    CPU, 8 rows x 4096 context: 1.28x faster per decode step than the token-major
    [L, P, S, Hkv, Dh], which needs a transposing gather; short contexts about equal), and
    a GPU kernel's TMA copies one page per KV head as a dense 2-D tile."""

    k: jax.Array  # [L, Hkv, P, S, Dh]; with rings: the global layers only, [L_g, ...]
    v: jax.Array  # [L, Hkv, P, S, Dh]
    # The sliding layers' ring pool (None: no rings; see the module docstring).
    sk: jax.Array | None = None  # [L_s, Hkv, 1 + slots * R, S, Dh]
    sv: jax.Array | None = None
    ring_pages: int = struct.field(pytree_node=False, default=0)  # R; 0: no rings

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]


def kv_pool_shape(model: ModelConfig, cache: PoolGeometry,
                  num_layers: int | None = None) -> tuple[int, ...]:
    """The K pool's shape (V's is the same, or empty under MLA: v_pool_shape);
    `num_layers`: the layers it holds (default all; with rings the global ones)."""
    n = model.num_layers if num_layers is None else num_layers
    return (n, model.num_kv_heads, cache.num_pages, cache.page_size, model.head_dim)


def v_pool_shape(model: ModelConfig, cache: PoolGeometry,
                 num_layers: int | None = None) -> tuple[int, ...]:
    """Multi-head latent attention caches only the latent row (in K): V is [..., 0]."""
    shape = kv_pool_shape(model, cache, num_layers)
    return shape if model.mla is None else (*shape[:-1], 0)


def kv_bytes_per_token(model: ModelConfig, dtype: jnp.dtype, num_layers: int | None = None
                       ) -> int:
    """Bytes of K plus V (MLA: of the latent row) that one cached token costs across all
    layers (or `num_layers` of them)."""
    n = model.num_layers if num_layers is None else num_layers
    return (1 if model.mla else 2) * n * model.kv_size * jnp.dtype(dtype).itemsize


def ring_layers(model: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global layers, sliding layers) of a model, in layer order: with rings, layer
    global_layers[i] is row i of the main pool, sliding_layers[i] row i of the ring pool."""
    windows = model.layer_windows
    return (tuple(i for i, w in enumerate(windows) if not w),
            tuple(i for i, w in enumerate(windows) if w))


def ring_pages_for(window: int, max_extend: int, page_size: int) -> int:
    """Pages R of one ring: a step's queries [s, s + C) read keys from s - window + 1 on
    and write their own C after attending, so window + C - 1 positions must stay distinct,
    and they may straddle one more page than they fill."""
    return -(-(window + max_extend) // page_size) + 1


def ring_pool_pages(ring_pages: int, num_slots: int) -> int:
    """Pages of the ring pool: the padding page and one ring per request slot."""
    return 1 + num_slots * ring_pages


def init_kv_pool(model: ModelConfig, cache: PoolGeometry, dtype: jnp.dtype,
                 sharding: jax.sharding.Sharding | None = None, ring_pages: int = 0,
                 ring_slots: int = 0) -> KVPool:
    """The zeroed pool; with ring_pages R > 0 (a model with sliding and global layers),
    the main pool holds the global layers and a ring pool of `ring_slots` rings the
    sliding ones (module docstring)."""
    def zeros(shape: tuple[int, ...]) -> jax.Array:
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    if not ring_pages:
        return KVPool(k=zeros(kv_pool_shape(model, cache)), v=zeros(v_pool_shape(model, cache)))
    glob, slide = ring_layers(model)
    rings = RingGeometry(cache.page_size, ring_pool_pages(ring_pages, ring_slots))
    return KVPool(k=zeros(kv_pool_shape(model, cache, len(glob))),
                  v=zeros(v_pool_shape(model, cache, len(glob))),
                  sk=zeros(kv_pool_shape(model, rings, len(slide))),
                  sv=zeros(v_pool_shape(model, rings, len(slide))), ring_pages=ring_pages)


@dataclasses.dataclass(frozen=True)
class RingGeometry:
    """The ring pool's page geometry (a PoolGeometry)."""

    page_size: int
    num_pages: int


def ring_addresses(ring_base: jax.Array, positions: jax.Array, query_start: jax.Array,
                   ring_pages: int, page_size: int, table_width: int
                   ) -> tuple[jax.Array, jax.Array]:
    """Each row's virtual ring page table and each token's ring slot.

    ring_base [B]: the first page of each row's ring; positions [T], query_start [B + 1]
    as in ForwardBatch. Returns page_table [B, Np] (entry j = ring_base + j % R) and
    out_cache_loc [T] (padding tokens, at PAD_POSITION, write to page 0)."""
    j = jnp.arange(table_width, dtype=jnp.int32)
    table = ring_base[:, None] + j[None, :] % ring_pages  # [B, Np]
    tok = jnp.arange(positions.shape[0], dtype=jnp.int32)
    # The row whose [query_start, next query_start) holds each token (padding rows share
    # one start; their tokens are padding, written to page 0 below).
    row = jnp.searchsorted(query_start[1:], tok, side="right")  # [T]
    row = jnp.minimum(row, ring_base.shape[0] - 1)
    page = ring_base[row] + (positions // page_size) % ring_pages
    loc = page * page_size + positions % page_size
    return table, jnp.where(positions < PAD_POSITION, loc, 0).astype(jnp.int32)


def write_kv(kv: KVPool, layers: jax.Array, slots: jax.Array, k: jax.Array,
             v: jax.Array) -> KVPool:
    """Scatter k, v [N, T, Hkv, Dh] of layers [N] into flat slots [T] of the pool.

    Called once per step after the layer stack (see pallas_kernels/attention_ref.py for
    why not inside it). The pool is viewed as [L, Hkv, P * S, Dh], a free reshape.
    """
    L, H, P, S, _ = kv.k.shape
    idx = (layers[:, None, None], jnp.arange(H)[None, :, None], slots[None, None, :])  # [N, H, T]

    def put(pool: jax.Array, new: jax.Array) -> jax.Array:
        d = pool.shape[-1]  # D, or 0 for MLA's empty V
        new = new.transpose(0, 2, 1, 3).astype(pool.dtype)  # [N, Hkv, T, Dh]
        return pool.reshape(L, H, P * S, d).at[idx].set(new).reshape(L, H, P, S, d)

    return KVPool(k=put(kv.k, k), v=put(kv.v, v))


def with_rings(batch: ForwardBatch, kv: KVPool, row_slots: jax.Array) -> ForwardBatch:
    """`batch` with its rows' ring addresses (ring_addresses) when the pool has rings:
    row_slots [B] are the rows' request slots (padding rows': the spare last slot)."""
    if not kv.ring_pages:
        return batch
    table, loc = ring_addresses(1 + row_slots * kv.ring_pages, batch.positions,
                                batch.query_start, kv.ring_pages, kv.page_size,
                                batch.page_table.shape[1])
    return batch.replace(ring_page_table=table, ring_out_cache_loc=loc)

