"""Ragged paged attention over the runtime's KV pool.

One call serves a ForwardBatch's extend rows (many causal queries per row, on top
of whatever prefix the row already has in the cache) and its decode rows (one
query per row): see runtime/forward_batch.py for the token/row layout.

`ragged_paged_attention_ref` is the pure-jnp reference and the fast path on CPU.
`ragged_paged_attention` is the Pallas kernel for the GPU with the same signature and
semantics, and `paged_attention` the kernel twin of attention_ref.paged_attention_ref
(this step's K/V passed densely, the pool holding earlier context). On the CPU both run
in interpret mode (tests). The design:

* Work is cut into query tiles of M (a multiple of 64) rows. A tile belongs to one batch
  row and one KV head; its rows are (token, query head) pairs of that row, the G query
  heads that share the KV head laid side by side (row r = token r // G, head r % G), so
  grouped-query attention reads every KV page once per tile. A decode row is one tile
  (G of its M rows used); an extend row is cdiv(q_len, M // G) tiles. Decode and extend
  tiles go through the same kernel launch, which is what makes MIXED batches one call.
* Each program (tile, KV head, KV split) walks blocks of BK tokens (BK / S pages, or a run
  of dense new tokens) with an online softmax, skipping blocks the causal mask and the
  sliding window exclude. Small decode batches split each tile's blocks over several
  programs (flash-decoding), merged by log-sum-exp afterwards.
* 16-bit inputs run on Pallas Mosaic GPU (TMA copies into swizzled shared memory, a ring
  of `num_slots` buffers in flight; wgmma for QK^T and PV). f32 inputs run on the Pallas
  Triton backend; `_mosaic_unsupported` says why.
* Padding (rows with seq_len 0, tokens past a row's real tokens) gives zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # deprecated since jax 0.11 (f32 only; see _mosaic_unsupported)
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

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


# ---------------------------------------------------------------------------------------------
# Pallas kernels. Shared pieces first: tile metadata, the KV block schedule and the masked
# online-softmax step are the same for the Mosaic GPU and the Triton body, so the two only
# differ in how a KV block reaches the matmul units.
#
# Two call forms share the kernels. `ragged_paged_attention` (the reference's form): every
# key, this step's included, is in the pool. `paged_attention` (pallas_kernels/
# attention_ref.py's form): the pool holds each row's earlier context only and this step's
# keys come as dense k_new / v_new [T, Hkv, Dh]. A tile walks its row's pool blocks (the
# prefix), then, in the second form, blocks of its row's new tokens read from k_new / v_new.

_META = ("row", "kv_len", "prefix_len", "pos0", "nrows", "new_start", "layer")  # meta columns
_NROWS = _META.index("nrows")
_WGMMA_M = 64  # a warpgroup's wgmma works on 64-row tiles


@functools.cache
def _gpu_interpret_params():
    """Mosaic GPU interpret mode (simulates SMEM, TMA and barriers on the CPU). It is public
    as plgpu.InterpretGPUParams in newer jax; jax 0.10 only has the private class."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def _config(q, k_pool, page_table, *, new_kv, sm_scale, sliding_window, soft_cap, impl,
            block_kv, num_slots, num_splits):
    """Static kernel parameters; num_splits None is settled once the tile count is known."""
    _, hq, dh = q.shape
    page_size, hkv = k_pool.shape[2], k_pool.shape[3]
    group = hq // hkv
    if impl is None:
        impl = "mosaic" if _mosaic_unsupported(q.dtype) is None else "triton"
    if block_kv is None:
        # Triton walks one page per step; Mosaic copies several pages per step so each wgmma
        # sees >= 64 KV rows (its K-dim granularity for PV) and a step moves ~32 KB of K+V.
        block_kv = page_size if impl == "triton" else max(page_size, min(128, 8192 // dh))
    if block_kv % page_size:
        raise ValueError(f"block_kv={block_kv} must be a multiple of page_size={page_size}")
    if impl == "triton":
        if block_kv != page_size:
            raise ValueError("the Triton body walks one page per step: block_kv = page_size")
        num_splits = 1
    tile_rows = _WGMMA_M * pl.cdiv(group, _WGMMA_M)
    return dict(impl=impl, new_kv=new_kv, group=group, tile_rows=tile_rows,
                tile_tokens=tile_rows // group, block_kv=block_kv, page_size=page_size,
                pages_per_seq=page_table.shape[1], num_slots=num_slots or 3,
                num_splits=num_splits, sm_scale=sm_scale, sliding_window=sliding_window,
                soft_cap=soft_cap)


def _default_splits(programs: int) -> int:
    """KV splits per tile (flash-decoding) so that a small decode batch still puts about
    two programs on every SM: 8 rows x 3 KV heads would otherwise be 24 programs on an
    H200's 132 SMs, each streaming its whole context alone."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 1
    sms = getattr(dev, "core_count", None) or 132
    return int(min(16, max(1, 2 * sms // programs)))


def _mosaic_unsupported(dtype) -> str | None:
    """Why Mosaic GPU cannot run this dtype (None if it can)."""
    if jnp.dtype(dtype).itemsize == 2:
        return None
    # f32 falls back to Triton: wgmma on f32 (tf32) accepts neither a transposed B operand
    # nor an A operand in registers, and a V page is [tokens, Dh] row-major, so P @ V would
    # need every page transposed on its way through shared memory. Triton's dot does f32
    # (with precision=HIGHEST) from plain loads.
    return f"{jnp.dtype(dtype).name}: Mosaic GPU wgmma has no f32 P @ V from row-major pages"


def _num_extend_tiles(te: int, be: int, tile_tokens: int) -> int:
    """Static bound on sum_i cdiv(q_len_i, tile_tokens) over B_e rows holding T_e tokens."""
    return min(te, pl.cdiv(te, tile_tokens) + be) if te and be else 0


def _tile_metadata(seq_lens, query_start, positions, layer, *, te, be, cfg):
    """-> meta [NT, 7] int32 (columns _META) and the number of extend tiles.

    Extend tiles first (row i owns cdiv(q_len_i, tile_tokens) consecutive tiles), then one
    tile per decode row. A tile's queries sit at positions pos0, pos0 + 1, ... (a row's new
    tokens are consecutive, see forward_batch.py); a decode query sits at seq_len - 1.
    prefix_len is how much of the row the pool holds; new_start the token index of the
    row's first new token (its k_new / v_new row); nrows the live tile rows.
    """
    tpt, group, new_kv = cfg["tile_tokens"], cfg["group"], cfg["new_kv"]
    cols = []
    nte = _num_extend_tiles(te, be, tpt)
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
        cols.append([row, kv, start if new_kv else kv, start + local * tpt, ntok * group,
                     qs[row], tok0])
    bd = seq_lens.shape[0] - be
    if bd:
        row = be + jnp.arange(bd, dtype=jnp.int32)  # [B_d]
        kv = seq_lens[be:]
        tok = te + jnp.arange(bd, dtype=jnp.int32)
        cols.append([row, kv, kv - 1 if new_kv else kv, kv - 1, jnp.where(kv > 0, group, 0),
                     tok, tok])
    meta = jnp.concatenate([jnp.stack(c[:6], axis=1) for c in cols]).astype(jnp.int32)
    layer_col = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (meta.shape[0], 1))
    tok0 = jnp.concatenate([c[6] for c in cols])  # [NT] first token of each tile
    return jnp.concatenate([meta, layer_col], axis=1), tok0, nte


def _pack_q(q, tok0, nte, te, cfg, hkv):
    """q [T, Hq, Dh] -> tiles [NT, Hkv, M, Dh]; tile row r holds token tok0 + r // G, head r % G."""
    t, _, dh = q.shape
    group, m = cfg["group"], cfg["tile_rows"]
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


def _unpack_out(out, meta, tok0, nte, te, cfg):
    """tiles [NT, Hkv, M, Dh] -> [T, Hq, Dh]; tokens no tile covers (padding) get zeros."""
    _, hkv, m, dh = out.shape
    group = cfg["group"]
    parts = []
    if te:
        r = jnp.arange(m)
        valid = r[None, :] < meta[:nte, _NROWS, None]  # [NT_e, M]
        tok = jnp.where(valid, tok0[:nte, None] + r // group, te)  # te: out of range, dropped
        oe = jnp.zeros((te, hkv, group, dh), out.dtype)
        oe = oe.at[tok, :, (r % group)[None, :]].set(out[:nte].transpose(0, 2, 1, 3), mode="drop")
        parts.append(oe.reshape(te, hkv * group, dh))
    if out.shape[0] > nte:
        parts.append(out[nte:, :, :group].reshape(-1, hkv * group, dh))  # [B_d, Hq, Dh]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _cdiv(x, d: int):
    return (jnp.maximum(x, 0) + d - 1) // d


class _Schedule:
    """The KV blocks of one tile, as steps 0, 1, ...: its pool blocks [lo_p, lo_p + n_p) (KV
    positions blk * BK ...), then its new-token blocks [lo_n, lo_n + n_n) (positions
    prefix_len + blk * BK ..., read from k_new / v_new). Blocks are bounded by the last
    query (causal), the row's length and the first query's window start; tiles with no
    live rows get no steps."""

    def __init__(self, kv_len, prefix_len, pos0, nrows, cfg):
        bk, group, window = cfg["block_kv"], cfg["group"], cfg["sliding_window"]
        last = pos0 + (nrows + group - 1) // group - 1  # position of the last query
        first = 0 if window is None else pos0 - window + 1  # first position any query sees
        live = nrows > 0
        self.lo_p = jnp.maximum(first, 0) // bk
        self.n_p = jnp.where(live, jnp.maximum(
            _cdiv(jnp.minimum(prefix_len, last + 1), bk) - self.lo_p, 0), 0)
        self.lo_n = self.n_n = 0
        if cfg["new_kv"]:
            self.lo_n = jnp.maximum(first - prefix_len, 0) // bk
            new_hi = _cdiv(jnp.minimum(last + 1, kv_len) - prefix_len, bk)
            self.n_n = jnp.where(live, jnp.maximum(new_hi - self.lo_n, 0), 0)
        self.kv_len, self.prefix_len, self.bk = kv_len, prefix_len, bk

    def split(self, split, num_splits):
        """Steps [lo, hi) of KV split `split` out of num_splits."""
        total = self.n_p + self.n_n
        chunk = (total + num_splits - 1) // num_splits
        lo = jnp.minimum(split * chunk, total)
        return lo, jnp.minimum(lo + chunk, total)

    def block(self, step):
        """-> (is_new, block index in its part, KV position of its first key, key bound)."""
        is_new = step >= self.n_p
        blk = jnp.where(is_new, self.lo_n + step - self.n_p, self.lo_p + step)
        base = jnp.where(is_new, self.prefix_len, 0) + blk * self.bk
        return is_new, blk, base, jnp.where(is_new, self.kv_len, self.prefix_len)


def _softmax_step(s, rows, kv_pos, m_prev, l_prev, bound, pos0, nrows, cfg):
    """One online-softmax step over a KV block, masked as the reference masks.

    s [M, BK] f32 raw scores; rows / kv_pos [M, BK] int32 tile row and KV position (keys at
    or past `bound` do not exist); m_prev / l_prev [M]. Returns p [M, BK] (unnormalized),
    alpha [M] (rescale of the old accumulator), m [M], l [M].
    """
    bcast = functools.partial(lax.broadcast_in_dim, shape=s.shape, broadcast_dimensions=(0,))
    s = s * cfg["sm_scale"]
    if cfg["soft_cap"] is not None:
        s = cfg["soft_cap"] * jnp.tanh(s / cfg["soft_cap"])
    q_pos = pos0 + rows // cfg["group"]
    mask = (rows < nrows) & (kv_pos < bound) & (kv_pos <= q_pos)
    if cfg["sliding_window"] is not None:
        mask = mask & (kv_pos > q_pos - cfg["sliding_window"])
    s = jnp.where(mask, s, _MASKED)
    m = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m)
    # Multiply by the mask (as the reference does): a row with nothing visible yet has
    # m == _MASKED, where exp(s - m) would be 1, not 0.
    p = jnp.where(mask, jnp.exp(s - bcast(m)), 0.0)
    return p, alpha, m, l_prev * alpha + p.sum(axis=1)


def _finish(acc, l):
    """acc [M, Dh] / l [M]; rows that saw no key (padding) have l == 0 and give 0."""
    return acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, (0,))


def ragged_paged_attention_kernel(meta_ref, pt_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref,
                                  lse_ref, q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar,
                                  v_bar, *, cfg: dict, compiled: bool):
    """Mosaic GPU body for one (tile, KV head, KV split) program: one warpgroup.

    GMEM refs: meta [NT, 7] int32, page table [B, Np] int32, q tiles [NT, Hkv, M, Dh],
    K / V pools [L, P, S, Hkv, Dh], new K / V [T + BK, Hkv, Dh] (unused in the all-in-pool
    form); outputs o [splits, NT, Hkv, M, Dh] (normalized within the split) and lse
    [splits, NT, Hkv, M] f32 (log-sum-exp, to merge the splits). SMEM: q_smem [M, Dh]
    (then the output tile), k_smem / v_smem [slots, BK, Dh], lse_smem [M].

    A KV block of BK tokens arrives as BK / S TMA copies of [S, Dh] slices (pool pages, or
    runs of new tokens), issued `slots - 1` blocks ahead of the block being multiplied.
    Slot reuse is safe because a wgmma result is read back (which waits for it) before the
    next step issues copies. `compiled=False` is the CPU interpret mode: the same copies
    and barriers run in Mosaic GPU's interpreter, but the two wgmmas become dot_generals
    and layouts are left out, since the interpreter implements neither transposed wgmma
    operands nor layout casts.
    """
    m_rows, dh = q_smem.shape
    slots, bk = k_smem.shape[0], k_smem.shape[1]
    s_page, n_pages = cfg["page_size"], cfg["pages_per_seq"]
    per_block = bk // s_page
    t, h, split = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("split")
    row, kv_len, prefix_len, pos0, nrows, new_start, layer = (meta_ref[t, i] for i in range(7))
    sched = _Schedule(kv_len, prefix_len, pos0, nrows, cfg)
    lo, hi = sched.split(split, cfg["num_splits"])
    layout = plgpu.layout_cast if compiled else (lambda x, _: x)
    wgmma_layout = plgpu.Layout.WGMMA

    def fetch_pages(blk, slot):
        for i in range(per_block):
            page = pt_ref[row, jnp.minimum(blk * per_block + i, n_pages - 1)]
            dst = (slot, pl.ds(i * s_page, s_page))
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, h, :], k_smem.at[dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, h, :], v_smem.at[dst], v_bar.at[slot])

    def fetch_new(blk, slot):  # as many copies as a page block: the barriers count arrivals
        for i in range(per_block):
            src = (pl.ds(new_start + blk * bk + i * s_page, s_page), h)
            dst = (slot, pl.ds(i * s_page, s_page))
            plgpu.copy_gmem_to_smem(kn_ref.at[src], k_smem.at[dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(vn_ref.at[src], v_smem.at[dst], v_bar.at[slot])

    def fetch(step, slot):
        is_new, blk, _, _ = sched.block(step)
        if not cfg["new_kv"]:
            return fetch_pages(blk, slot)
        pl.when(is_new)(lambda: fetch_new(blk, slot))
        pl.when(jnp.logical_not(is_new))(lambda: fetch_pages(blk, slot))

    plgpu.copy_gmem_to_smem(q_ref.at[t, h], q_smem, q_bar)
    for i in range(slots - 1):
        pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))
    plgpu.barrier_wait(q_bar)

    def qk(slot):  # -> [M, BK] f32
        if not compiled:
            return lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                   precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            return acc_ref[...]
        return pl.run_scoped(scope, plgpu.ACC((m_rows, bk), jnp.float32))

    def pv(acc, p, slot):  # acc [M, Dh] += p [M, BK] @ v [BK, Dh]
        p = p.astype(v_smem.dtype)
        if not compiled:
            return acc + jnp.dot(p, v_smem[slot], precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_smem.at[slot]))(
            plgpu.ACC.init(acc))

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i - lo, slots)
        ahead = i + slots - 1
        pl.when(ahead < hi)(lambda: fetch(ahead, lax.rem(ahead - lo, slots)))
        _, _, base, bound = sched.block(i)
        plgpu.barrier_wait(k_bar.at[slot])
        s = qk(slot)
        rows = layout(lax.broadcasted_iota(jnp.int32, (m_rows, bk), 0), wgmma_layout)
        kv_pos = base + layout(lax.broadcasted_iota(jnp.int32, (m_rows, bk), 1), wgmma_layout)
        p, alpha, m, l = _softmax_step(s, rows, kv_pos, m, l, bound, pos0, nrows, cfg)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, (0,))
        plgpu.barrier_wait(v_bar.at[slot])
        return pv(acc, p, slot), m, l

    row_layout = wgmma_layout.reduce(1)
    init = (layout(jnp.full((m_rows, dh), 0.0, jnp.float32), wgmma_layout),  # acc
            layout(jnp.full((m_rows,), _MASKED, jnp.float32), row_layout),  # running max
            layout(jnp.full((m_rows,), 0.0, jnp.float32), row_layout))  # running sum
    acc, m, l = lax.fori_loop(lo, hi, step, init)
    q_smem[...] = _finish(acc, l).astype(q_smem.dtype)
    lse_smem[...] = m + jnp.log(jnp.maximum(l, 1e-30))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[split, t, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, t, h])
    plgpu.wait_smem_to_gmem(0)


def _triton_kernel(meta_ref, pt_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref, *, cfg: dict):
    """Triton body for one (tile, KV head) program, f32 inputs: one page (or page-sized
    run of new tokens) per step, loaded straight from GMEM; Triton pipelines the loads.
    q / o refs are this program's [M, Dh] tile."""
    t, h = pl.program_id(0), pl.program_id(1)
    row, kv_len, prefix_len, pos0, nrows, new_start, layer = (meta_ref[t, i] for i in range(7))
    sched = _Schedule(kv_len, prefix_len, pos0, nrows, cfg)
    q = q_ref[...]  # [M, Dh]
    m_rows, bk = q.shape[0], cfg["block_kv"]
    hp = lax.Precision.HIGHEST  # f32 in, no tf32

    def load(pool_ref, new_ref, is_new, blk):  # -> [S, Dh]
        # Both sources are read and one is kept (f32 is not the fast path); the unused
        # source's index is clamped so the read stays in bounds.
        page = pt_ref[row, jnp.minimum(jnp.where(is_new, 0, blk), cfg["pages_per_seq"] - 1)]
        from_pool = pool_ref[layer, page, :, h, :]
        if not cfg["new_kv"]:
            return from_pool
        tok = new_start + jnp.where(is_new, blk, 0) * bk
        return jnp.where(is_new, new_ref[pl.ds(tok, bk), h, :], from_pool)

    def step(i, carry):
        acc, m, l = carry
        is_new, blk, base, bound = sched.block(i)
        k = load(k_ref, kn_ref, is_new, blk)
        v = load(v_ref, vn_ref, is_new, blk)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=hp,
                            preferred_element_type=jnp.float32)  # [M, S]
        rows = lax.broadcasted_iota(jnp.int32, (m_rows, bk), 0)
        kv_pos = base + lax.broadcasted_iota(jnp.int32, (m_rows, bk), 1)
        p, alpha, m, l = _softmax_step(s, rows, kv_pos, m, l, bound, pos0, nrows, cfg)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, precision=hp,
                                             preferred_element_type=jnp.float32)
        return acc, m, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((m_rows,), _MASKED, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    acc, _, l = lax.fori_loop(0, sched.n_p + sched.n_n, step, init)
    o_ref[...] = _finish(acc, l).astype(o_ref.dtype)


def _swizzle_transforms(minor: int, dtype) -> tuple:
    """Tiling + swizzle for a [rows, minor] SMEM operand of wgmma (and of the TMA that fills
    it): the widest swizzle whose span divides a row, so head_dim 64 in bf16 (128 bytes)
    gets the 128-byte swizzle and needs no padding."""
    row_bytes = minor * jnp.dtype(dtype).itemsize
    for swizzle in (128, 64, 32):
        if row_bytes % swizzle == 0:
            elems = swizzle // jnp.dtype(dtype).itemsize
            return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)
    raise ValueError(f"head_dim {minor} of {jnp.dtype(dtype).name} is not a multiple of 32 bytes")


def _call_mosaic(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new, cfg, interpret):
    nt, hkv, m_rows, dh = q_tiles.shape
    dtype, slots, bk, splits = q_tiles.dtype, cfg["num_slots"], cfg["block_kv"], cfg["num_splits"]
    tf = _swizzle_transforms(dh, dtype)
    per_block = bk // cfg["page_size"]
    body = functools.partial(ragged_paged_attention_kernel, cfg=cfg, compiled=not interpret)
    out, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((splits, *q_tiles.shape), dtype),
                  jax.ShapeDtypeStruct((splits, nt, hkv, m_rows), jnp.float32)),
        grid=(nt, hkv, splits),
        grid_names=("tile", "kv_head", "split"),
        scratch_types=[
            plgpu.SMEM((m_rows, dh), dtype, transforms=tf),  # q, then the output tile
            plgpu.SMEM((slots, bk, dh), dtype, transforms=tf),  # K blocks
            plgpu.SMEM((slots, bk, dh), dtype, transforms=tf),  # V blocks
            plgpu.SMEM((m_rows,), jnp.float32),  # log-sum-exp of each tile row
            plgpu.Barrier(),
            # one arrival per page copy: a block is ready when all its pages landed
            plgpu.Barrier(num_arrivals=per_block, num_barriers=slots),
            plgpu.Barrier(num_arrivals=per_block, num_barriers=slots),
        ],
        interpret=_gpu_interpret_params() if interpret else None,
    )(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new)
    if not cfg["has_extend_tiles"]:  # decode only: just the G live rows of each tile
        out, lse = out[..., :cfg["group"], :], lse[..., :cfg["group"]]
    return _merge_splits(out, lse)


def _merge_splits(out, lse):
    """out [K, NT, Hkv, M, Dh] (each split normalized), lse [K, NT, Hkv, M] -> [NT, Hkv, M, Dh].
    Empty splits have lse ~ _MASKED and weigh 0; rows empty in every split stay 0."""
    if out.shape[0] == 1:
        return out[0]
    w = jnp.exp(lse - lse.max(axis=0))  # [K, NT, Hkv, M]
    merged = jnp.einsum("ktgm,ktgmd->tgmd", w, out.astype(jnp.float32))
    return (merged / w.sum(axis=0)[..., None]).astype(out.dtype)


def _call_triton(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new, cfg, interpret):
    if pltriton is None:
        raise NotImplementedError("f32 attention needs Pallas' Triton backend, which this "
                                  "jax no longer has; use bf16 or attention_backend='xla'")
    nt, hkv, m_rows, dh = q_tiles.shape
    anywhere = pl.BlockSpec(memory_space=pl.ANY)  # whole array, indexed inside the kernel
    tile = pl.BlockSpec((None, None, m_rows, dh), lambda t, h: (t, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_triton_kernel, cfg=cfg),
        grid=(nt, hkv),
        in_specs=[anywhere, anywhere, tile] + [anywhere] * 4,
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(meta, page_table, q_tiles, k_pool, v_pool, k_new, v_new)


def _attention(q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens, query_start,
               positions, *, num_extend_tokens, num_extend_seqs, sm_scale, sliding_window=None,
               soft_cap=None, interpret=None, impl=None, block_kv=None, num_slots=None,
               num_splits=None):
    """Both call forms (k_new None: all keys in the pool), with the kernel choice exposed
    for tests and benchmarks: impl "mosaic" / "triton" (default: by dtype), block_kv tokens
    per KV step, num_slots KV buffers in flight and num_splits programs per tile along the
    KV axis (Mosaic)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    te, be = num_extend_tokens, num_extend_seqs
    if q.shape[0] == 0:
        return q
    cfg = _config(q, k_pool, page_table, new_kv=k_new is not None, sm_scale=sm_scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, impl=impl,
                  block_kv=block_kv, num_slots=num_slots, num_splits=num_splits)
    if cfg["impl"] == "mosaic" and not interpret and (why := _mosaic_unsupported(q.dtype)):
        raise NotImplementedError(why)
    meta, tok0, nte = _tile_metadata(seq_lens, query_start, positions, layer, te=te, be=be,
                                     cfg=cfg)
    _, _, _, hkv, dh = k_pool.shape
    if cfg["num_splits"] is None:
        cfg["num_splits"] = _default_splits(meta.shape[0] * hkv)
    cfg["has_extend_tiles"] = nte > 0
    if k_new is None:  # never read; a stand-in so both forms share one kernel signature
        k_new = v_new = jnp.zeros((cfg["block_kv"], hkv, dh), k_pool.dtype)
    else:  # a block of new tokens may run past T: pad so its copies stay in bounds, to a
        # multiple of BK since TMA wants the sliced extent to be a multiple of SMEM's tiling
        t, bk = k_new.shape[0], cfg["block_kv"]
        pad = ((0, pl.cdiv(t, bk) * bk + bk - t), (0, 0), (0, 0))
        k_new, v_new = (jnp.pad(x.astype(k_pool.dtype), pad) for x in (k_new, v_new))
    q_tiles = _pack_q(q, tok0, nte, te, cfg, hkv).astype(k_pool.dtype)  # [NT, Hkv, M, Dh]
    call = _call_mosaic if cfg["impl"] == "mosaic" else _call_triton
    out = call(meta, page_table.astype(jnp.int32), q_tiles, k_pool, v_pool, k_new, v_new, cfg,
               interpret)
    return _unpack_out(out, meta, tok0, nte, te, cfg).astype(q.dtype)


def ragged_paged_attention(
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
    interpret: bool | None = None,
) -> jax.Array:
    """The Pallas kernel version of `ragged_paged_attention_ref` -> [T, Hq, Dh]: every key,
    this step's included, is already in the pool.

    interpret: None picks interpret mode on a CPU backend and compiled kernels otherwise.
    """
    return _attention(q, None, None, k_pool, v_pool, layer, page_table, seq_lens, query_start,
                      positions, num_extend_tokens=num_extend_tokens,
                      num_extend_seqs=num_extend_seqs, sm_scale=sm_scale,
                      sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)


def paged_attention(
    q: jax.Array,            # [T, Hq, Dh]
    k_new: jax.Array,        # [T, Hkv, Dh] this step's keys (rope applied)
    v_new: jax.Array,        # [T, Hkv, Dh]
    k_pool: jax.Array,       # [L, P, S, Hkv, Dh] earlier context
    v_pool: jax.Array,       # [L, P, S, Hkv, Dh]
    layer: jax.Array,        # [] int32
    page_table: jax.Array,   # [B, Np] int32, pages of each row's earlier context
    seq_lens: jax.Array,     # [B] int32, context + this step's tokens
    query_start: jax.Array,  # [B + 1] int32
    positions: jax.Array,    # [T] int32
    *,
    num_extend_tokens: int,
    num_extend_seqs: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The Pallas kernel version of `pallas_kernels.attention_ref.paged_attention_ref`
    -> [T, Hq, Dh]: the pool holds each row's earlier context, this step's keys come dense.

    interpret: None picks interpret mode on a CPU backend and compiled kernels otherwise.
    """
    return _attention(q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens,
                      query_start, positions, num_extend_tokens=num_extend_tokens,
                      num_extend_seqs=num_extend_seqs, sm_scale=sm_scale,
                      sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
