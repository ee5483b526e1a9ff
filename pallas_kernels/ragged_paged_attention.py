"""Ragged paged attention over the runtime's KV pool: the Pallas kernels and their wrapper.

One call serves a ForwardBatch's extend rows (many causal queries per row, on top of
whatever prefix the row already has in the cache) and its decode rows (one query per
row); see models/forward_batch.py for the token/row layout. The pool holds each row's
*earlier* context; this step's K/V arrive densely as k_new / v_new and are written to the
pool after the layer stack (attention_ref.py says why).

  paged_attention         this module: picks the kernel body, cuts the batch into query
                          tiles, launches, and puts the tiles back in token order
  paged_attention_kernel  the Mosaic GPU body (paged_attention_mosaic.py, 16-bit inputs)
                          and the Triton body (paged_attention_triton.py, f32 inputs)
  paged_attention_ref     the pure-jnp twin (attention_ref.py, re-exported here), which is
                          also the CPU path where cpu_kernels cannot run
  kv_schedule.py          what both bodies share: launch config, KV block walk, softmax step

On the CPU the kernels run in interpret mode (`interpret=True`, tests). The design:

* Work is cut into query tiles of M (a multiple of 64) rows. A tile belongs to one batch
  row and one KV head; its rows are (token, query head) pairs of that row, the G query
  heads that share the KV head laid side by side (row r = token r // G, head r % G), so
  grouped-query attention reads every KV page once per tile. A decode row is one tile
  (G of its M rows used); an extend row is cdiv(q_len, M // G) tiles. Decode and extend
  tiles go through the same kernel launch, which is what makes MIXED batches one call.
* Each program (tile, KV head, KV split) walks blocks of BK tokens with an online softmax:
  its row's pool blocks (BK / S pages each), then blocks of its row's new tokens read from
  k_new / v_new, skipping blocks the causal mask and the sliding window exclude. Small
  decode batches split each tile's blocks over several programs (flash-decoding), merged
  by log-sum-exp afterwards.
* The window is traced (a column of the tile metadata), so one launch serves layers of
  different windows; attention sinks join each row's denominator at the end (Triton: in
  the body; Mosaic: from the merged log-sum-exp, after the launch).
* 16-bit inputs run on Pallas Mosaic GPU (TMA copies into swizzled shared memory, a ring
  of `num_slots` buffers in flight; wgmma for QK^T and PV). f32 inputs run on the Pallas
  Triton backend; `mosaic_unsupported` says why.
* Padding (rows with seq_len 0, tokens past a row's real tokens) gives zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import paged_attention_mosaic, paged_attention_triton
from pallas_kernels.attention_ref import paged_attention_ref
from pallas_kernels.kv_schedule import NEW_START, NROWS, KernelConfig, sink_rows
from pallas_kernels.paged_attention_mosaic import mosaic_unsupported

__all__ = ["paged_attention", "paged_attention_ref"]

_WGMMA_M = 64  # a warpgroup's wgmma works on 64-row tiles
_TMA_ROWS = 8  # shared memory operands are tiled by 8 rows: a TMA copy moves whole tiles


def _num_extend_tiles(te: int, be: int, tile_tokens: int) -> int:
    """Static bound on sum_i cdiv(q_len_i, tile_tokens) over B_e rows holding T_e tokens."""
    return min(te, pl.cdiv(te, tile_tokens) + be) if te and be else 0


def _default_splits(programs: int) -> int:
    """KV splits per tile (flash-decoding) so that a small decode batch still puts about
    two programs on every SM: 8 rows x 3 KV heads would otherwise be 24 programs on an
    H200's 132 SMs, each streaming its whole context alone."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 1
    sms = getattr(dev, "core_count", None) or 132
    return int(min(16, max(1, 2 * sms // programs)))


def _config(q, k_pool, page_table, *, te, be, sm_scale, windowed, logit_softcap, impl,
            block_kv, num_slots, num_splits) -> KernelConfig:
    """The static launch parameters; None picks the default of each tuning knob."""
    _, hq, dh = q.shape
    page_size, hkv = k_pool.shape[3], k_pool.shape[1]
    group = hq // hkv
    if impl is None:
        impl = "mosaic" if mosaic_unsupported(q.dtype) is None else "triton"
    if block_kv is None:
        # Triton walks one page per step; Mosaic copies several pages per step so each wgmma
        # sees >= 64 KV rows (its K-dim granularity for PV) and a step moves ~32 KB of K+V.
        block_kv = page_size if impl == "triton" else max(page_size, min(128, 8192 // dh))
    if block_kv % page_size:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={page_size}")
    tile_rows = _WGMMA_M * pl.cdiv(group, _WGMMA_M)
    nte = _num_extend_tiles(te, be, tile_rows // group)
    if impl == "triton":
        if block_kv != page_size:
            raise ValueError("the Triton body walks one page per step: block_kv = page_size")
        num_splits = 1
    elif num_splits is None:
        num_splits = _default_splits((nte + page_table.shape[0] - be) * hkv)  # programs
    # Decode-only on Mosaic: q and the output hold a tile's live rows (KernelConfig.io_rows);
    # the body loads them into the first rows of its M-row tile in shared memory.
    io_rows = min(tile_rows, pl.cdiv(group, _TMA_ROWS) * _TMA_ROWS) if (
        impl == "mosaic" and not nte) else tile_rows
    return KernelConfig(impl=impl, group=group, tile_rows=tile_rows, block_kv=block_kv,
                        page_size=page_size, pages_per_seq=page_table.shape[1],
                        num_slots=num_slots or 3, num_splits=num_splits, num_extend_tiles=nte,
                        sm_scale=sm_scale, windowed=windowed,
                        logit_softcap=float(logit_softcap or 0.0), io_rows=io_rows)


def _tile_metadata(seq_lens, query_start, positions, layer, *, te, be, cfg: KernelConfig,
                   window=0):
    """-> meta [NT, 8] int32 (columns kv_schedule.META) and tok0 [NT], each tile's first
    token.

    Extend tiles first (row i owns cdiv(q_len_i, tile_tokens) consecutive tiles), then one
    tile per decode row. A tile's queries sit at positions pos0, pos0 + 1, ... (a row's new
    tokens are consecutive, see forward_batch.py); a decode query sits at seq_len - 1.
    prefix_len is how much of the row the pool holds; new_start the token index of the
    row's first new token (its k_new / v_new row); nrows the live tile rows.
    """
    tpt, group, nte = cfg.tile_tokens, cfg.group, cfg.num_extend_tiles
    cols = []
    if nte:
        qs = query_start[:be + 1]
        q_len = qs[1:] - qs[:-1]  # [B_e]
        n_tiles = (q_len + tpt - 1) // tpt  # [B_e]
        tile_end = jnp.cumsum(n_tiles)  # [B_e]
        t = jnp.arange(nte, dtype=jnp.int32)  # [NT_e]
        row = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), be - 1)  # [NT_e]
        local = t - (tile_end - n_tiles)[row]
        tok0 = qs[row] + local * tpt  # [NT_e] first token of the tile
        kv = seq_lens[row]
        # The row's cached prefix is the position of its first new token. Its real new
        # tokens are kv - start: fewer than q_len when the bucket's trailing padding tokens
        # fall in the last row's range. Padding rows (seq_len 0) and padding tokens get no
        # live tile rows, so they attend to nothing and give zeros.
        start = positions[jnp.clip(qs[row], 0, te - 1)]
        n_real = jnp.where((t < tile_end[-1]) & (kv > 0), kv - start, 0)
        ntok = jnp.clip(n_real - local * tpt, 0, tpt)
        cols.append([row, kv, start, start + local * tpt, ntok * group, qs[row], tok0])
    bd = seq_lens.shape[0] - be
    if bd:
        row = be + jnp.arange(bd, dtype=jnp.int32)  # [B_d]
        kv = seq_lens[be:]
        tok = te + jnp.arange(bd, dtype=jnp.int32)
        cols.append([row, kv, kv - 1, kv - 1, jnp.where(kv > 0, group, 0), tok, tok])
    meta = jnp.concatenate([jnp.stack(c[:6], axis=1) for c in cols]).astype(jnp.int32)
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    scalar_cols = jnp.broadcast_to(scalars, (meta.shape[0], 2))  # layer, window
    tok0 = jnp.concatenate([c[6] for c in cols])  # [NT]
    return jnp.concatenate([meta, scalar_cols], axis=1), tok0


def _page_aligned_new_kv(meta, query_start, k_new, v_new, *, te: int, be: int,
                         cfg: KernelConfig):
    """For the Mosaic body: k_new / v_new [T, Hkv, Dh] -> [N, Hkv, Dh] with each row's new
    tokens starting at a multiple of the page size S, and meta's new_start column moved
    with them. Why: the body's TMA copies land in SMEM tiled by 8 rows, so a copy's first
    GMEM row must be a multiple of 8 (an unaligned one reads the wrong rows on the device;
    jax 0.11's layout inference rejects it outright), and the body can only prove that for
    offsets written as a multiple of S. Extend row r occupies [a_r, a_r + q_len_r) with
    a_r = sum of the earlier rows' q_len rounded up to S; decode row i's one token sits at
    E + i * S after them (E the extend part's static bound). Tokens no row owns (the bucket's
    trailing padding) are dropped. N leaves a block of BK rows beyond the last row, so the
    last block's copies stay in bounds."""
    t, hkv, dh = k_new.shape
    s, bk, nte = cfg.page_size, cfg.block_kv, cfg.num_extend_tiles
    ext = pl.cdiv(te + be * (s - 1), s) * s if te else 0  # bound on the aligned extend span
    bd = t - te
    n = pl.cdiv(ext + bd * s, bk) * bk + bk
    dst, starts = [], []
    if te:
        qs = query_start[:be + 1]
        span = (qs[1:] - qs[:-1] + s - 1) // s * s  # [B_e] each row's aligned extent
        a = jnp.cumsum(span) - span  # [B_e] aligned start of each row
        j = jnp.arange(te, dtype=jnp.int32)
        row = jnp.minimum(jnp.searchsorted(qs[1:], j, side="right"), be - 1)  # [T_e]
        dst.append(jnp.where(j < qs[be], a[row] + j - qs[row], n))  # n: dropped
        starts.append(a[meta[:nte, 0]])  # extend tiles' rows
    if bd:
        dec = ext + s * jnp.arange(bd, dtype=jnp.int32)  # [B_d]
        dst.append(dec)
        starts.append(dec)
    if te:
        dst = jnp.concatenate(dst)
        moved = [jnp.zeros((n, hkv, dh), x.dtype).at[dst].set(x, mode="drop")
                 for x in (k_new, v_new)]  # [N, Hkv, Dh]
    else:  # the same layout as one pad (a zero buffer and a scatter are two more kernels)
        moved = [jnp.pad(x[:, None], ((0, 0), (0, s - 1), (0, 0), (0, 0))).reshape(
            bd * s, hkv, dh) for x in (k_new, v_new)]  # [B_d * S, Hkv, Dh]
        moved = [jnp.pad(x, ((0, n - bd * s), (0, 0), (0, 0))) for x in moved]  # [N, ...]
    meta = meta.at[:, NEW_START].set(jnp.concatenate(starts).astype(jnp.int32))
    return meta, *moved


def _pack_q(q, tok0, te: int, cfg: KernelConfig, hkv: int):
    """q [T, Hq, Dh] -> tiles [NT, Hkv, M, Dh]; tile row r holds token tok0 + r // G, head r % G.
    (Decode-only Mosaic launches: [NT, Hkv, q_rows, Dh], see KernelConfig.io_rows.)"""
    t, _, dh = q.shape
    group, m, nte = cfg.group, cfg.q_rows, cfg.num_extend_tiles
    qg = q.reshape(t, hkv, group, dh)  # [T, Hkv, G, Dh]; query head = kv head * G + g
    parts = []
    if nte:
        r = jnp.arange(m)
        tok = jnp.clip(tok0[:nte, None] + r // group, 0, t - 1)  # [NT_e, M]
        parts.append(qg[tok, :, (r % group)[None, :]].transpose(0, 2, 1, 3))  # [NT_e, Hkv, M, Dh]
    if t > te:
        pad = ((0, 0), (0, 0), (0, m - group), (0, 0))
        parts.append(jnp.pad(qg[te:], pad))  # [B_d, Hkv, M, Dh]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _unpack_out(out, meta, tok0, te: int, cfg: KernelConfig):
    """tiles [NT, Hkv, M, Dh] -> [T, Hq, Dh]; tokens no tile covers (padding) get zeros."""
    _, hkv, m, dh = out.shape
    group, nte = cfg.group, cfg.num_extend_tiles
    parts = []
    if te:
        r = jnp.arange(m)
        valid = r[None, :] < meta[:nte, NROWS, None]  # [NT_e, M]
        tok = jnp.where(valid, tok0[:nte, None] + r // group, te)  # te: out of range, dropped
        oe = jnp.zeros((te, hkv, group, dh), out.dtype)
        oe = oe.at[tok, :, (r % group)[None, :]].set(out[:nte].transpose(0, 2, 1, 3), mode="drop")
        parts.append(oe.reshape(te, hkv * group, dh))
    if out.shape[0] > nte:
        parts.append(out[nte:, :, :group].reshape(-1, hkv * group, dh))  # [B_d, Hq, Dh]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def paged_attention(
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
    interpret: bool | None = None,
    impl: str | None = None,
    block_kv: int | None = None,
    num_slots: int | None = None,
    num_splits: int | None = None,
) -> jax.Array:
    """The Pallas kernel version of `paged_attention_ref` -> [T, Hq, Dh] (window, sinks,
    logit_softcap: see attention_ref).

    interpret: None picks interpret mode on a CPU backend and compiled kernels otherwise.
    Tuning knobs (tests and scripts/bench/bench_kernels.py; None = default): impl "mosaic" /
    "triton" (by dtype), block_kv tokens per KV step, num_slots KV blocks in flight and
    num_splits programs per tile along the KV axis (Mosaic).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if q.shape[0] == 0:
        return q
    te, be = num_extend_tokens, num_extend_seqs
    cfg = _config(q, k_pool, page_table, te=te, be=be, sm_scale=sm_scale,
                  windowed=window is not None, logit_softcap=logit_softcap, impl=impl,
                  block_kv=block_kv, num_slots=num_slots, num_splits=num_splits)
    if cfg.impl == "mosaic" and not interpret and (why := mosaic_unsupported(q.dtype)):
        raise NotImplementedError(why)
    meta, tok0 = _tile_metadata(seq_lens, query_start, positions, layer, te=te, be=be, cfg=cfg,
                                window=0 if window is None else window)
    k_new, v_new = k_new.astype(k_pool.dtype), v_new.astype(k_pool.dtype)
    if cfg.impl == "mosaic":
        meta, k_new, v_new = _page_aligned_new_kv(meta, query_start, k_new, v_new, te=te,
                                                  be=be, cfg=cfg)
    else:
        # A block of new tokens may run past T: pad so its loads stay in bounds.
        t, bk = k_new.shape[0], cfg.block_kv
        pad = ((0, pl.cdiv(t, bk) * bk + bk - t), (0, 0), (0, 0))
        k_new, v_new = (jnp.pad(x, pad) for x in (k_new, v_new))
    q_tiles = _pack_q(q, tok0, te, cfg, k_pool.shape[1]).astype(k_pool.dtype)  # [NT, Hkv, Mq, Dh]
    body = paged_attention_mosaic if cfg.impl == "mosaic" else paged_attention_triton
    sinks = None if sinks is None else sink_rows(sinks, k_pool.shape[1], cfg.q_rows, cfg.group)
    out = body.launch(meta, page_table.astype(jnp.int32), q_tiles, k_pool, v_pool, k_new, v_new,
                      cfg, interpret, sinks=sinks)
    return _unpack_out(out, meta, tok0, te, cfg).astype(q.dtype)
