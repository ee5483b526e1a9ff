"""Device KV pool: one paged K and V buffer per model, layers stacked.

The host side (page allocator, request page tables) is runtime/kv_cache.py and
never imports jax; this module is the device half. Page 0 is reserved: padding
tokens write their K/V there, so a padded batch never touches a live page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from runtime.config import CacheConfig, ModelConfig


@struct.dataclass
class KVPool:
    k: jax.Array  # [L, P, S, Hkv, Dh]
    v: jax.Array  # [L, P, S, Hkv, Dh]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


def kv_pool_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    return (model.num_layers, cache.num_pages, cache.page_size, model.num_kv_heads, model.head_dim)


def kv_bytes_per_token(model: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of K plus V that one cached token costs across all layers."""
    return 2 * model.num_layers * model.kv_size * jnp.dtype(dtype).itemsize


def init_kv_pool(model: ModelConfig, cache: CacheConfig, dtype: jnp.dtype,
                 sharding: jax.sharding.Sharding | None = None) -> KVPool:
    shape = kv_pool_shape(model, cache)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVPool(k=zeros(), v=zeros())


def write_kv(kv: KVPool, layers: jax.Array, slots: jax.Array, k: jax.Array,
             v: jax.Array) -> KVPool:
    """Scatter k, v [N, T, Hkv, Dh] of layers [N] into flat slots [T] of the pool.

    Called once per step after the layer stack (see pallas_kernels/attention_ref.py for
    why not inside it). The pool is viewed as [L, P * S, Hkv, Dh], a free reshape.
    """
    L, P, S, H, D = kv.k.shape
    idx = (layers[:, None], slots[None, :])  # [N, 1], [1, T] -> [N, T]
    kf = kv.k.reshape(L, P * S, H, D).at[idx].set(k.astype(kv.k.dtype))
    vf = kv.v.reshape(L, P * S, H, D).at[idx].set(v.astype(kv.v.dtype))
    return KVPool(k=kf.reshape(L, P, S, H, D), v=vf.reshape(L, P, S, H, D))
