"""Ragged paged attention over the runtime's KV pool.

One call serves a ForwardBatch's extend rows (many causal queries per row, on top
of whatever prefix the row already has in the cache) and its decode rows (one
query per row): see runtime/forward_batch.py for the token/row layout.

`ragged_paged_attention_ref` is the pure-jnp reference and the fast path on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked (padding) row gives 0 instead of NaN


def _gather_pages(pool: jax.Array, layer: jax.Array, page_table: jax.Array) -> jax.Array:
    """pool [L, P, S, Hkv, Dh], page_table [B, Np] -> [B, Np * S, Hkv, Dh].

    Indexing layer and pages in one expression lowers to a single gather, so the
    layer's whole pool is never copied.
    """
    b, n_pages = page_table.shape
    _, _, s, h, d = pool.shape
    return pool[layer, page_table].reshape(b, n_pages * s, h, d)


def _softmax_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float,
                    soft_cap: float | None) -> jax.Array:
    """q [N, Hkv, G, Dh], k/v [N, K, Hkv, Dh], mask [N, K] (or broadcastable) -> [N, Hkv, G, Dh]."""
    s = jnp.einsum("nhgd,nkhd->nhgk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = mask[:, None, None, :]  # [N, 1, 1, K]
    s = jnp.where(mask, s, _MASKED)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True)) * mask  # [N, Hkv, G, K]
    denom = jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("nhgk,nkhd->nhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out / denom).astype(q.dtype)


def _window_mask(kv_pos: jax.Array, q_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    if sliding_window is None:
        return jnp.ones(jnp.broadcast_shapes(kv_pos.shape, q_pos.shape), bool)
    return kv_pos > q_pos - sliding_window


def _decode_ref(q, k_pool, v_pool, layer, page_table, seq_lens, sm_scale, sliding_window,
                soft_cap):
    """q [B, Hq, Dh]: the single query of each row sits at position seq_len - 1."""
    b, hq, d = q.shape
    hkv = k_pool.shape[3]
    k = _gather_pages(k_pool, layer, page_table)  # [B, K, Hkv, Dh]
    v = _gather_pages(v_pool, layer, page_table)
    kv_pos = jnp.arange(k.shape[1])[None, :]  # [1, K]
    mask = (kv_pos < seq_lens[:, None]) & _window_mask(kv_pos, seq_lens[:, None] - 1,
                                                       sliding_window)
    out = _softmax_attend(q.reshape(b, hkv, hq // hkv, d), k, v, mask, sm_scale, soft_cap)
    return out.reshape(b, hq, d)


def _extend_ref(q, k_pool, v_pool, layer, page_table, seq_lens, query_start, positions,
                sm_scale, sliding_window, soft_cap):
    """q [T_e, Hq, Dh] of B_e rows laid back to back; every row's KV (prefix and new) is in
    the pool already. Each token attends to the flattened KV of all B_e rows, masked to
    its own row and causally, which keeps every shape static."""
    t, hq, d = q.shape
    b = page_table.shape[0]
    hkv = k_pool.shape[3]
    k = _gather_pages(k_pool, layer, page_table)  # [B_e, K, Hkv, Dh]
    v = _gather_pages(v_pool, layer, page_table)
    kmax = k.shape[1]
    k = k.reshape(1, b * kmax, hkv, d)  # [1, B_e * K, Hkv, Dh]
    v = v.reshape(1, b * kmax, hkv, d)
    kv_row = jnp.repeat(jnp.arange(b), kmax)  # [B_e * K]
    kv_pos = jnp.tile(jnp.arange(kmax), b)  # [B_e * K]
    tok_row = jnp.searchsorted(query_start[1:], jnp.arange(t), side="right")  # [T_e]
    row_len = jnp.append(seq_lens, 0)[tok_row]  # [T_e]; padding tokens get row B_e, length 0
    q_pos = positions[:, None]  # [T_e, 1]
    mask = ((kv_row[None, :] == tok_row[:, None]) & (kv_pos[None, :] <= q_pos)
            & (kv_pos[None, :] < row_len[:, None]) & _window_mask(kv_pos[None, :], q_pos,
                                                                  sliding_window))
    qg = q.reshape(1, t, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)  # [1, Hkv, G, T_e, Dh]
    s = jnp.einsum("nhgtd,nkhd->nhgtk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASKED)  # [1, Hkv, G, T_e, B_e * K]
    p = jnp.exp(s - s.max(axis=-1, keepdims=True)) * mask
    denom = jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("nhgtk,nkhd->nhgtd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32) / denom
    return out[0].transpose(2, 0, 1, 3).reshape(t, hq, d).astype(q.dtype)


def ragged_paged_attention_ref(
    q: jax.Array,            # [T, Hq, Dh]
    k_pool: jax.Array,       # [L, P, S, Hkv, Dh]
    v_pool: jax.Array,       # [L, P, S, Hkv, Dh]
    layer: jax.Array,        # [] int32
    page_table: jax.Array,   # [B, Np] int32
    seq_lens: jax.Array,     # [B] int32
    query_start: jax.Array,  # [B + 1] int32
    positions: jax.Array,    # [T] int32
    *,
    num_extend_tokens: int,
    num_extend_seqs: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention for the extend rows then the decode rows of a batch -> [T, Hq, Dh]."""
    te, be = num_extend_tokens, num_extend_seqs
    parts = []
    if te:
        parts.append(_extend_ref(q[:te], k_pool, v_pool, layer, page_table[:be], seq_lens[:be],
                                 query_start[:be + 1], positions[:te], sm_scale,
                                 sliding_window, soft_cap))
    if q.shape[0] > te:
        parts.append(_decode_ref(q[te:], k_pool, v_pool, layer, page_table[be:], seq_lens[be:],
                                 sm_scale, sliding_window, soft_cap))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
