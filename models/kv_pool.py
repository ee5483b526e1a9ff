"""Device KV pool: one paged K and V buffer per model, layers stacked.

The host side (page allocator, request page tables) is runtime/kv_cache.py and
never imports jax; this module is the device half. Page 0 is reserved: padding
tokens write their K/V there, so a padded batch never touches a live page.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig


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

    k: jax.Array  # [L, Hkv, P, S, Dh]
    v: jax.Array  # [L, Hkv, P, S, Dh]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]


def kv_pool_shape(model: ModelConfig, cache: PoolGeometry) -> tuple[int, ...]:
    """The K pool's shape (V's is the same, or empty under MLA: v_pool_shape)."""
    return (model.num_layers, model.num_kv_heads, cache.num_pages, cache.page_size, model.head_dim)


def v_pool_shape(model: ModelConfig, cache: PoolGeometry) -> tuple[int, ...]:
    """Multi-head latent attention caches only the latent row (in K): V is [..., 0]."""
    shape = kv_pool_shape(model, cache)
    return shape if model.mla is None else (*shape[:-1], 0)


def kv_bytes_per_token(model: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of K plus V (MLA: of the latent row) that one cached token costs across all
    layers."""
    return (1 if model.mla else 2) * model.num_layers * model.kv_size * jnp.dtype(dtype).itemsize


def init_kv_pool(model: ModelConfig, cache: PoolGeometry, dtype: jnp.dtype,
                 sharding: jax.sharding.Sharding | None = None) -> KVPool:
    def zeros(shape: tuple[int, ...]) -> jax.Array:
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    return KVPool(k=zeros(kv_pool_shape(model, cache)), v=zeros(v_pool_shape(model, cache)))


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
