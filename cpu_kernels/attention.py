"""Paged attention and the KV write through the FFI (attention.cc, write_kv.cc), reading
and writing the pool (float32 or bfloat16) in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build


def _attention_call(name: str, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    k_pool: jax.Array, v_pool: jax.Array, *rest: jax.Array,
                    sm_scale: float, window: jax.Array | int | None, sinks: jax.Array | None,
                    logit_softcap: float) -> jax.Array:
    """One attention kernel on pools of float32 or bfloat16: q in f32, this step's K/V
    rounded to the pool's dtype (what the pool will hold, so a key reads the same whether
    it is new or cached), the output in q's dtype. window / sinks / logit_softcap: see
    pallas_kernels/attention_ref.py (the window travels as a traced int32 operand, 0: none;
    the sinks as f32 [Hq], empty: none)."""
    build.load()
    if k_pool.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"CPU attention reads float32 or bfloat16 pages, not {k_pool.dtype}")
    suffix = "_bf16" if k_pool.dtype == jnp.bfloat16 else ""
    out = jax.ffi.ffi_call(name + suffix, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_new.astype(k_pool.dtype), v_new.astype(k_pool.dtype),
        k_pool, v_pool.astype(k_pool.dtype), *rest,
        jnp.asarray(0 if window is None else window, jnp.int32).reshape(()),
        jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(logit_softcap or 0.0))
    return out.astype(q.dtype)


def decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                     seq_lens: jax.Array, *, sm_scale: float,
                     window: jax.Array | int | None = None, sinks: jax.Array | None = None,
                     logit_softcap: float = 0.0) -> jax.Array:
    """Decode rows' attention, f32 arithmetic (the contract of attention_ref._decode).

    q [B, Hq, Dh]; k_new, v_new [B, Hkv, Dh] (each row's own new key, at seq_len - 1);
    pools [L, Hkv, P, S, Dh] (float32 or bfloat16) holding the earlier context; layer []
    int32; page_table [B, Np] int32; seq_lens [B] int32 -> [B, Hq, Dh]."""
    return _attention_call("xlaserve_decode_attention", q, k_new, v_new, k_pool, v_pool,
                           jnp.asarray(layer, jnp.int32).reshape(()), page_table, seq_lens,
                           sm_scale=sm_scale, window=window, sinks=sinks,
                           logit_softcap=logit_softcap)


def extend_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array,
                     v_pool: jax.Array, layer: jax.Array, page_table: jax.Array,
                     query_start: jax.Array, positions: jax.Array, *, sm_scale: float,
                     window: jax.Array | int | None = None, sinks: jax.Array | None = None,
                     logit_softcap: float = 0.0) -> jax.Array:
    """Extend tokens' attention, f32 arithmetic (the contract of attention_ref._extend).

    q [T, Hq, Dh] of B rows laid back to back (query_start [B + 1]; tokens past the last
    row are padding and give 0); k_new, v_new [T, Hkv, Dh]; pools [L, Hkv, P, S, Dh]
    (float32 or bfloat16); page_table [B, Np] (may be width 0) listing each row's cached
    prefix, which ends at the position of the row's first new token; positions [T]
    -> [T, Hq, Dh]."""
    return _attention_call("xlaserve_extend_attention", q, k_new, v_new, k_pool, v_pool,
                           jnp.asarray(layer, jnp.int32).reshape(()), page_table,
                           query_start, positions, sm_scale=sm_scale, window=window,
                           sinks=sinks, logit_softcap=logit_softcap)


def write_kv(k_pool: jax.Array, v_pool: jax.Array, layers: jax.Array, slots: jax.Array,
             k: jax.Array, v: jax.Array, after: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """models.kv_pool.write_kv's contract on pools of float32 or bfloat16, in place:
    k, v [N, T, Hkv, Dh] of layers [N] into flat slots [T] (page * S + slot) of pools
    [L, Hkv, P, S, Dh]; slots outside the pool are dropped. The pools are aliased to the
    results, so under a donating jit no copy of them is made, provided XLA sees the write
    come after every read of the pools: `after`, an array computed from those reads (not
    read here), makes it a data dependency. Without it, when the reads are not inside a
    loop whose outputs feed k and v (a one-layer scan, which XLA unrolls), XLA CPU copied
    the whole pool before the reads and again before the write."""
    build.load()
    if k_pool.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"write_kv writes float32 or bfloat16 pages, not {k_pool.dtype}")
    suffix = "_bf16" if k_pool.dtype == jnp.bfloat16 else ""
    pool = jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)
    return jax.ffi.ffi_call("xlaserve_write_kv" + suffix, (pool, pool),
                            input_output_aliases={0: 0, 1: 1})(
        k_pool, v_pool, layers.astype(jnp.int32), slots.astype(jnp.int32),
        k.astype(k_pool.dtype), v.astype(k_pool.dtype),
        jnp.zeros((0,), jnp.int32) if after is None else after)
