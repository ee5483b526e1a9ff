"""Pure-jnp ragged paged attention: the reference twin of the kernels, and the CPU path where
cpu_kernels cannot run (--attention_backend=xla).

The pool holds each row's *earlier* context only; this step's K/V arrive as dense
`k_new`/`v_new` and are written to the pool after the layer stack (one scatter per
step, outside the layer loop). Keeping reads and writes of the pool out of the same
loop iteration is what lets XLA update the donated pool in place; a gather after a
scatter on the same carried buffer made XLA copy the whole pool every layer.

Each query attends to two parts, softmaxed jointly:
  prefix: pool positions [0, seq_len - q_len) of its row, through the page table;
  new:    this step's tokens of its row, causally.

The attention variants (the common keywords of every backend):
  window         sliding window: a query at position p sees keys at positions in
                 (p - window, p] (transformers' `sliding_window_overlay`: kv > q - window).
                 A traced int32 scalar, so one trace serves layers of different windows;
                 0 = no window at run time; None = no window code at all (static).
  sinks          [Hq] f32 per-head logits that join each query's softmax denominator with
                 no value (gpt-oss attention sinks); unscaled and not soft-capped. None: off.
  logit_softcap  static: scores -> cap * tanh(scores / cap) after sm_scale, before the
                 mask (Gemma 2 style); 0: off.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mesh_types import varying_like

_MASKED = -1e30  # finite, so a fully masked (padding) row gives 0 instead of NaN
# Prefix tokens per step of the decode walk: small enough that a batch pays for about the
# context it has, large enough that the loop's per-step overhead stays small. (One pass
# over a 256-token bucket instead: 4-20% slower at <= 128 context for B = 1 to 16, ~5%
# faster for B=1 at 129-256, with the multiply-reduce scores.)
_DECODE_BLOCK_TOKENS = 128
# Query / key block of the extend path's new tokens (extend buckets are multiples of 64).
_EXTEND_BLOCK_TOKENS = 128


def _gather_pages(pool: jax.Array, layer: jax.Array, page_table: jax.Array) -> jax.Array:
    """pool [L, Hkv, P, S, Dh], page_table [B, Np] -> [Hkv, B, Np * S, Dh].

    One gather of whole [S * Dh] rows of the flattened pool: XLA CPU copies those with
    memcpy, while indexing `pool[layer, :, page_table]` is an element-wise gather."""
    n_layers, hkv, n_pages, s, d = pool.shape
    b, np_ = page_table.shape
    rows = (layer * hkv + jnp.arange(hkv)[:, None, None]) * n_pages + page_table  # [Hkv, B, Np]
    out = jnp.take(pool.reshape(n_layers * hkv * n_pages, s * d), rows.reshape(-1), axis=0,
                   mode="clip")
    return out.reshape(hkv, b, np_ * s, d)


def _softcap(s: jax.Array, cap: float) -> jax.Array:
    return cap * jnp.tanh(s / cap) if cap else s


def _scores(q: jax.Array, k: jax.Array, spec: str, sm_scale: float,
            logit_softcap: float) -> jax.Array:
    return _softcap(jnp.einsum(spec, q, k, preferred_element_type=jnp.float32) * sm_scale,
                    logit_softcap)


def _in_window(kv_pos: jax.Array, q_pos: jax.Array, window: jax.Array | None) -> jax.Array:
    if window is None:
        return jnp.ones(jnp.broadcast_shapes(kv_pos.shape, q_pos.shape), bool)
    return (window <= 0) | (kv_pos > q_pos - window)


def window_start(q_pos: jax.Array, window: jax.Array | None) -> jax.Array:
    """The first key position a query at q_pos sees (0 without a window)."""
    if window is None:
        return jnp.zeros_like(q_pos)
    return jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)


def _with_sinks(m: jax.Array, l: jax.Array, acc: jax.Array,
                sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Online-softmax state (running max m, sum l [...], acc [..., Dh]) with each head's
    sink logit [...] joining the denominator -> (l, acc) to divide. Both are rescaled to
    max(m, sink), so a sink far above the scores neither overflows nor loses the keys."""
    if sinks is None:
        return l, acc
    m_all = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_all)
    return l * alpha + jnp.exp(sinks - m_all), acc * alpha[..., None]


def _decode(q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens, *, sm_scale,
            window=None, sinks=None, logit_softcap=0.0):
    """q [B, Hq, Dh], k_new/v_new [B, Hkv, Dh]: each row's one query sits at position
    seq_len - 1 and attends to its pool prefix and to its own new key.

    The prefix is walked in blocks of _DECODE_BLOCK_TOKENS with an online softmax
    (_walk_prefix). The row's own key seeds the softmax, so no block is concatenated."""
    b, hq, d = q.shape
    hkv = k_new.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).transpose(1, 0, 2, 3)  # [Hkv, B, G, Dh]
    m = _scores(qg, k_new, "hbgd,bhd->hbg", sm_scale, logit_softcap)  # [Hkv, B, G] running max
    l = jnp.ones_like(m)  # running sum of exp(s - m)
    acc = jnp.broadcast_to(v_new.transpose(1, 0, 2)[:, :, None].astype(jnp.float32),
                           (*m.shape, d))  # [Hkv, B, G, Dh]
    prefix = seq_lens - 1  # [B]
    m, l, acc = _walk_prefix(qg, prefix, prefix[:, None], seq_lens, (m, l, acc), k_pool,
                             v_pool, layer, page_table, sm_scale=sm_scale, window=window,
                             logit_softcap=logit_softcap)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(hkv, 1, hq // hkv)  # [Hkv, 1, G]
    l, acc = _with_sinks(m, l, acc, sinks)
    out = (acc / l[..., None]).astype(q.dtype)  # [Hkv, B, G, Dh]; l >= 1 (own key)
    return out.transpose(1, 0, 2, 3).reshape(b, hq, d)


def _walk_prefix(qg, prefix_len, q_pos, seq_lens, carry, k_pool, v_pool, layer, page_table,
                 *, sm_scale, window, logit_softcap):
    """The decode walk: queries qg [Hkv, B, Q, Dh] at positions q_pos [B, Q] (or [B, 1])
    against their row's pool keys [0, prefix_len) [B], folded into the online-softmax
    carry (m, l [Hkv, B, Q], acc [Hkv, B, Q, Dh]).

    The prefix goes by in blocks of _DECODE_BLOCK_TOKENS, for as many blocks as the
    batch's longest prefix needs (a dynamic trip count): the cost follows the context the
    rows have, not the width of their KV bucket, which is up to 4x larger. With a window
    the walk starts at the block of the earliest key any live row (seq_len > 0) sees:
    blocks wholly before every row's window are not read."""
    s_page = k_pool.shape[3]
    bp = max(1, min(page_table.shape[1], _DECODE_BLOCK_TOKENS // s_page))  # pages per block
    n_pages = -(-page_table.shape[1] // bp) * bp
    page_table = jnp.pad(page_table, ((0, 0), (0, n_pages - page_table.shape[1])))
    needed = (jnp.max(prefix_len) + bp * s_page - 1) // (bp * s_page)  # blocks holding a prefix
    first_block = 0
    if window is not None:  # all rows padding: past `needed`, no trips
        live = jnp.where(seq_lens > 0, window_start(prefix_len, window),
                         jnp.iinfo(jnp.int32).max)
        first_block = jnp.min(live) // (bp * s_page)

    def block(i, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(page_table, i * bp, bp, axis=1)  # [B, bp]
        k = _gather_pages(k_pool, layer, pages)  # [Hkv, B, bp * S, Dh]
        v = _gather_pages(v_pool, layer, pages)
        kv_pos = i * bp * s_page + jnp.arange(bp * s_page)[None, None, :]  # [1, 1, bp * S]
        mask = ((kv_pos < prefix_len[:, None, None])
                & _in_window(kv_pos, q_pos[:, :, None], window))[None]  # [1, B, Q|1, bp * S]
        # Scores and p @ v as multiply-reduce, not einsum: XLA CPU runs an [Hkv x B]-
        # batched dot of G-row matrices slowly, a fused multiply-reduce well (B=32 at
        # 200 context, 30 layers: 72 against 126 ms; a decode step 165-181 against 226).
        raw = (qg[:, :, :, None].astype(jnp.float32) * k[:, :, None].astype(jnp.float32)
               ).sum(-1) * sm_scale  # [Hkv, B, Q, bp * S]
        s = jnp.where(mask, _softcap(raw, logit_softcap), _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None]) * mask  # [Hkv, B, Q, bp * S]
        pv = (p[..., None] * v[:, :, None].astype(jnp.float32)).sum(-2)  # [Hkv, B, Q, Dh]
        return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

    if bp == n_pages:  # one block: no loop
        return block(0, carry)
    # The blocks also read the pool and the page table, perhaps on other mesh axes.
    carry = tuple(varying_like(c, k_pool, v_pool, page_table, seq_lens, layer) for c in carry)
    return lax.fori_loop(first_block, needed, block, carry)


def _verify(q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens, query_start,
            positions, *, width, sm_scale, window=None, sinks=None, logit_softcap=0.0):
    """A TARGET_VERIFY batch's extend half, laid out as _extend's (q [T_e, Hq, Dh], rows
    back to back from query_start [B + 1]), each row at most W = `width` tokens (its
    last token and its drafts) on its cached prefix (page_table [B, Np]); T_e = B * W.

    A row's W queries attend to the same pool prefix, so they go through the decode walk
    (_walk_prefix) as W * G query heads of their KV head: the prefix is read once per row
    (_extend's one pass scores every token against every row's page-table slots, B x W x
    B x Np pairs: 8 rows of 5 tokens on SmolLM2 took 3.4x the forward of the CPU
    kernels), and its cost follows the context, so one page-table width serves all. The
    row's new keys seed the online softmax, causally masked. Tokens past a row's first W
    and padding rows come out 0."""
    t, hq, d = q.shape
    hkv = k_new.shape[1]
    g, b = hq // hkv, page_table.shape[0]
    first = query_start[:b]  # [B]
    j = jnp.arange(width)
    # Row r's token j is token first[r] + j if the row has it; the others sit past every
    # position (their outputs are dropped), so a real query's causal mask excludes them.
    has = j[None, :] < (query_start[1:b + 1] - first)[:, None]  # [B, W]
    idx = jnp.clip(first[:, None] + j[None, :], 0, t - 1)  # [B, W]
    pos = jnp.where(has, positions[idx], jnp.iinfo(jnp.int32).max)  # [B, W]
    qg = q[idx].reshape(b, width, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(
        hkv, b, width * g, d)  # [Hkv, B, W * G, Dh], query index w * G + g
    kn = k_new[idx].transpose(2, 0, 1, 3)  # [Hkv, B, W, Dh]
    vn = v_new[idx].transpose(2, 0, 1, 3)
    q_pos = jnp.repeat(pos, g, axis=1)  # [B, W * G]
    # Every query sees its own key (a padding one too), so l > 0.
    new = ((pos[:, None, :] <= q_pos[:, :, None])
           & _in_window(pos[:, None, :], q_pos[:, :, None], window))[None]  # [1, B, WG, W]
    s = jnp.where(new, _scores(qg, kn, "hbqd,hbkd->hbqk", sm_scale, logit_softcap), _MASKED)
    m = s.max(axis=-1)  # [Hkv, B, W * G]
    p = jnp.exp(s - m[..., None]) * new
    acc = jnp.einsum("hbqk,hbkd->hbqd", p, vn.astype(jnp.float32),
                     preferred_element_type=jnp.float32)  # [Hkv, B, W * G, Dh]
    # [B] cached tokens of each row (a padding row, seq_len 0, may hold padding tokens)
    prefix = jnp.where(has[:, 0] & (seq_lens > 0), pos[:, 0], 0)
    m, l, acc = _walk_prefix(qg, prefix, q_pos, seq_lens, (m, p.sum(axis=-1), acc), k_pool,
                             v_pool, layer, page_table, sm_scale=sm_scale, window=window,
                             logit_softcap=logit_softcap)
    if sinks is not None:  # [Hq] -> [Hkv, 1, W * G]: each head's logit at all W positions
        sinks = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, 1, 1, g),
                         (1, 1, width, 1)).reshape(hkv, 1, width * g)
    l, acc = _with_sinks(m, l, acc, sinks)
    out = (acc / l[..., None]).reshape(hkv, b, width, g, -1).transpose(1, 2, 0, 3, 4)
    out = out.reshape(b * width, hq, -1)  # [B * W, Hq, Dh], row r's token j at r * W + j
    # Back to the token axis: token i is token i - first[r] of its row r.
    row = jnp.searchsorted(query_start[1:b + 1], jnp.arange(t), side="right")  # [T_e]
    at = jnp.arange(t) - jnp.take(first, row, mode="clip")
    keep = (row < b) & (at < width)
    return jnp.where(keep[:, None, None], out[jnp.clip(row * width + at, 0, t - 1)],
                     0).astype(q.dtype)


def _extend(q, k_new, v_new, k_pool, v_pool, layer, page_table, query_start,
            positions, *, sm_scale, window=None, sinks=None, logit_softcap=0.0):
    """q [T_e, Hq, Dh] of B_e rows laid back to back, all shapes static.

    Prefix: every token scores the cached prefixes of all B_e rows, masked to its own row
    (one pass; empty when the page table has width 0). New tokens: the queries go in
    blocks of _EXTEND_BLOCK_TOKENS, and block j scores only the key blocks from the one
    where its first token's row starts up to itself (a dynamic trip count), with an
    online softmax across prefix and blocks: 4 rows x 128 tokens score 1/4 of the
    T_e x T_e pairs. A SmolLM2 forward (A B A B against one pass over all pairs): 8 rows x
    256 tokens 2.4-2.6 s against 5.7-5.9 s, 4 x 128 0.56-0.63 against 0.66-0.68 s. One
    512-token row gains nothing (equal within noise over two A/Bs): the per-block ops are
    too small for XLA CPU to split over its threads, which eats the causal saving."""
    t, hq, d = q.shape
    b = page_table.shape[0]
    hkv = k_new.shape[1]
    tok_row = jnp.searchsorted(query_start[1:], jnp.arange(t), side="right")  # [T_e]
    # A row's cached prefix ends where its first new token sits. (Not seq_len - q_len: the
    # last row's span in query_start also covers the bucket's padding tokens.)
    row_first = jnp.take(query_start, tok_row, mode="clip")  # [T_e]
    qg = q.reshape(t, hkv, hq // hkv, d).transpose(1, 2, 0, 3)  # [Hkv, G, T_e, Dh]
    q_pos = positions[:, None]  # [T_e, 1]
    # The key-block loops below update these from q, the new K/V and the row layout.
    inputs = (q, k_new, v_new, query_start, positions)
    m = varying_like(jnp.full(qg.shape[:3], _MASKED, jnp.float32),
                      *inputs)  # [Hkv, G, T_e] running max
    l = varying_like(jnp.zeros(qg.shape[:3], jnp.float32), *inputs)  # sum of exp(s - m)
    acc = varying_like(jnp.zeros(qg.shape, jnp.float32), *inputs)  # [Hkv, G, T_e, Dh]

    def update(carry, qb, kb, vb, mask):
        """Online-softmax step: qb [Hkv, G, Q, Dh] against kb/vb [Hkv, K, Dh], mask [Q, K]."""
        m, l, acc = carry
        s = jnp.where(mask, _scores(qb, kb, "hgqd,hkd->hgqk", sm_scale, logit_softcap), _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None]) * mask  # [Hkv, G, Q, K]
        pv = jnp.einsum("hgqk,hkd->hgqd", p.astype(vb.dtype), vb,
                        preferred_element_type=jnp.float32)
        return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

    if page_table.shape[1]:
        prefix_len = jnp.take(positions, row_first, mode="clip")  # [T_e]
        kp = _gather_pages(k_pool, layer, page_table)  # [Hkv, B_e, K, Dh]
        vp = _gather_pages(v_pool, layer, page_table)
        kmax = kp.shape[2]
        kv_row = jnp.repeat(jnp.arange(b), kmax)  # [B_e * K]
        kv_pos = jnp.tile(jnp.arange(kmax), b)  # [B_e * K]
        prefix = ((kv_row[None] == tok_row[:, None]) & (kv_pos[None] < prefix_len[:, None])
                  & _in_window(kv_pos[None], q_pos, window))  # [T_e, B_e * K]
        m, l, acc = update((m, l, acc), qg, kp.reshape(hkv, b * kmax, d),
                           vp.reshape(hkv, b * kmax, d), prefix)

    bq = _EXTEND_BLOCK_TOKENS if t % _EXTEND_BLOCK_TOKENS == 0 else t
    kt, vt = k_new.transpose(1, 0, 2), v_new.transpose(1, 0, 2)  # [Hkv, T_e, Dh]
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(hkv, hq // hkv, 1)  # [Hkv, G, 1]
    outs = []
    for j in range(t // bq):  # static: T_e / bq query blocks
        rows = slice(j * bq, (j + 1) * bq)
        qb, qrow, qpos = qg[:, :, rows], tok_row[rows, None], q_pos[rows]

        def key_block(i, carry, qb=qb, qrow=qrow, qpos=qpos):
            kb = lax.dynamic_slice_in_dim(kt, i * bq, bq, axis=1)  # [Hkv, bq, Dh]
            vb = lax.dynamic_slice_in_dim(vt, i * bq, bq, axis=1)
            krow = lax.dynamic_slice_in_dim(tok_row, i * bq, bq)[None]  # [1, bq]
            kpos = lax.dynamic_slice_in_dim(positions, i * bq, bq)[None]
            mask = ((krow == qrow) & (qrow < b) & (kpos <= qpos)
                    & _in_window(kpos, qpos, window))  # [bq, bq]
            return update(carry, qb, kb, vb, mask)

        carry = (m[:, :, rows], l[:, :, rows], acc[:, :, rows])
        if j == 0:
            m_j, l_j, acc_j = key_block(0, carry)
        else:  # rows are laid back to back: the block's first token has the earliest start
            m_j, l_j, acc_j = lax.fori_loop(row_first[j * bq] // bq, j + 1, key_block, carry)
        l_j, acc_j = _with_sinks(m_j, l_j, acc_j, sinks)
        outs.append(acc_j / jnp.maximum(l_j, 1e-30)[..., None])  # padding tokens: 0, not NaN
    out = jnp.concatenate(outs, axis=2).astype(q.dtype)  # [Hkv, G, T_e, Dh]
    return out.transpose(2, 0, 1, 3).reshape(t, hq, d)


def paged_attention_ref(
    q: jax.Array,            # [T, Hq, Dh]
    k_new: jax.Array,        # [T, Hkv, Dh] this step's keys (rope applied)
    v_new: jax.Array,        # [T, Hkv, Dh]
    k_pool: jax.Array,       # [L, Hkv, P, S, Dh] earlier context
    v_pool: jax.Array,       # [L, Hkv, P, S, Dh]
    layer: jax.Array,        # [] int32
    page_table: jax.Array,   # [B, Np] int32, pages of each row's earlier context
    seq_lens: jax.Array,     # [B] int32, context + this step's tokens
    query_start: jax.Array,  # [B + 1] int32
    positions: jax.Array,    # [T] int32
    *,
    num_extend_tokens: int,
    num_extend_seqs: int,
    sm_scale: float,
    window: jax.Array | int | None = None,
    sinks: jax.Array | None = None,
    logit_softcap: float = 0.0,
    decode_fn: Callable | None = None,
    extend_fn: Callable | None = None,
    verify_width: int = 0,
) -> jax.Array:
    """Attention for the extend rows then the decode rows of a batch -> [T, Hq, Dh].

    decode_fn / extend_fn: the decode rows' / extend tokens' attention with _decode's /
    _extend's signature (the CPU backend passes cpu_kernels.decode_attention and
    extend_attention); None: the jnp paths above. verify_width > 0: the extend rows are a
    TARGET_VERIFY batch's, each at most that many tokens, and the jnp path scores them
    with the decode walk (_verify)."""
    te, be = num_extend_tokens, num_extend_seqs
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
    common = dict(sm_scale=sm_scale, window=window, sinks=sinks, logit_softcap=logit_softcap)
    parts = []
    if te and verify_width and extend_fn is None:
        parts.append(_verify(q[:te], k_new[:te], v_new[:te], k_pool, v_pool, layer,
                             page_table[:be], seq_lens[:be], query_start[:be + 1],
                             positions[:te], width=verify_width, **common))
    elif te:
        parts.append((extend_fn or _extend)(q[:te], k_new[:te], v_new[:te], k_pool, v_pool,
                                            layer, page_table[:be], query_start[:be + 1],
                                            positions[:te], **common))
    if q.shape[0] > te:
        parts.append((decode_fn or _decode)(q[te:], k_new[te:], v_new[te:], k_pool, v_pool,
                                            layer, page_table[be:], seq_lens[be:], **common))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
