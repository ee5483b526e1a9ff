"""What the two kernel bodies share: the static launch configuration, the KV blocks a query
tile walks, and the masked online-softmax step over one block.

The Mosaic GPU body (paged_attention_mosaic.py) and the Triton body
(paged_attention_triton.py) differ only in how a KV block reaches the matmul units; which
blocks a tile visits and how their scores are masked is defined once, here, and masks as
attention_ref.paged_attention_ref does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

MASKED = -1e30  # finite, so a fully masked (padding) row gives 0 instead of NaN
# Columns of the per-tile metadata array meta [NT, 8] int32 (see ragged_paged_attention.py);
# `window` is the launch's traced sliding window (0: none), as `layer` the same in every tile.
META = ("row", "kv_len", "prefix_len", "pos0", "nrows", "new_start", "layer", "window")
NROWS = META.index("nrows")
NEW_START = META.index("new_start")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static parameters of one launch; frozen, so it hashes and can be jit-static."""

    impl: str                   # "mosaic" (16-bit inputs) or "triton" (f32)
    group: int                  # G: query heads per KV head
    tile_rows: int              # M: (token, query head) rows of a tile, a multiple of 64
    block_kv: int               # BK: KV tokens per step, a multiple of page_size
    page_size: int              # S
    pages_per_seq: int          # Np: width of the page table
    num_slots: int              # KV blocks in flight (Mosaic)
    num_splits: int             # programs per tile along the KV axis (Mosaic)
    num_extend_tiles: int       # NT_e: extend tiles come first, then one tile per decode row
    sm_scale: float
    windowed: bool              # a window column to mask by (else no window code at all)
    logit_softcap: float        # 0: off
    # Rows of a tile in q's and the output's device arrays: M, except in a decode-only
    # Mosaic launch, whose tiles hold G live rows: there G rounded up to 8 (the SMEM
    # tiling a TMA copy lands in), so a step's q and output move G rows per (row, KV head)
    # instead of 64 (16x the bytes at G = 4: 1.6 GB of a 128-row 8B decode step).
    io_rows: int = 0  # 0: tile_rows

    @property
    def q_rows(self) -> int:
        return self.io_rows or self.tile_rows

    @property
    def tile_tokens(self) -> int:
        """Tokens of one row per tile: M // G."""
        return self.tile_rows // self.group


def cdiv(x: jax.Array, d: int) -> jax.Array:
    return (jnp.maximum(x, 0) + d - 1) // d


class KVSchedule:
    """The KV blocks of one tile, as steps 0, 1, ...: its pool blocks [lo_p, lo_p + n_p)
    (KV positions blk * BK ...), then its new-token blocks [lo_n, lo_n + n_n) (positions
    prefix_len + blk * BK ..., read from k_new / v_new). Blocks are bounded by the last
    query (causal), the row's length and the first query's window start; tiles with no
    live rows get no steps."""

    def __init__(self, kv_len, prefix_len, pos0, nrows, window, cfg: KernelConfig):
        bk, group = cfg.block_kv, cfg.group
        last = pos0 + (nrows + group - 1) // group - 1  # position of the last query
        # The first position any query sees: a decode tile skips the pool blocks wholly
        # before its window. `window` is traced (0: none), read only when cfg.windowed.
        first = jnp.where(window > 0, pos0 - window + 1, 0) if cfg.windowed else 0
        live = nrows > 0
        self.lo_p = jnp.maximum(first, 0) // bk
        self.n_p = jnp.where(live, jnp.maximum(
            cdiv(jnp.minimum(prefix_len, last + 1), bk) - self.lo_p, 0), 0)
        self.lo_n = jnp.maximum(first - prefix_len, 0) // bk
        new_hi = cdiv(jnp.minimum(last + 1, kv_len) - prefix_len, bk)
        self.n_n = jnp.where(live, jnp.maximum(new_hi - self.lo_n, 0), 0)
        self.kv_len, self.prefix_len, self.bk = kv_len, prefix_len, bk

    @property
    def num_steps(self):
        return self.n_p + self.n_n

    def split(self, split, num_splits: int):
        """Steps [lo, hi) of KV split `split` out of num_splits."""
        total = self.num_steps
        chunk = (total + num_splits - 1) // num_splits
        lo = jnp.minimum(split * chunk, total)
        return lo, jnp.minimum(lo + chunk, total)

    def block(self, step):
        """-> (is_new, block index in its part, KV position of its first key, key bound)."""
        is_new = step >= self.n_p
        blk = jnp.where(is_new, self.lo_n + step - self.n_p, self.lo_p + step)
        base = jnp.where(is_new, self.prefix_len, 0) + blk * self.bk
        return is_new, blk, base, jnp.where(is_new, self.kv_len, self.prefix_len)


def softmax_step(s, rows, kv_pos, m_prev, l_prev, bound, pos0, nrows, window,
                 cfg: KernelConfig):
    """One online-softmax step over a KV block, masked as the reference masks.

    s [M, BK] f32 raw scores; rows / kv_pos [M, BK] int32 tile row and KV position (keys at
    or past `bound` do not exist); m_prev / l_prev [M]; window the traced sliding window (0:
    none). Returns p [M, BK] (unnormalized), alpha [M] (rescale of the old accumulator),
    m [M], l [M].
    """
    bcast = functools.partial(lax.broadcast_in_dim, shape=s.shape, broadcast_dimensions=(0,))
    s = s * cfg.sm_scale
    if cfg.logit_softcap:
        s = cfg.logit_softcap * jnp.tanh(s / cfg.logit_softcap)
    q_pos = pos0 + rows // cfg.group
    mask = (rows < nrows) & (kv_pos < bound) & (kv_pos <= q_pos)
    if cfg.windowed:
        mask = mask & ((window <= 0) | (kv_pos > q_pos - window))
    s = jnp.where(mask, s, MASKED)
    m = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m)
    # Multiply by the mask (as the reference does): a row with nothing visible yet has
    # m == MASKED, where exp(s - m) would be 1, not 0.
    p = jnp.where(mask, jnp.exp(s - bcast(m)), 0.0)
    return p, alpha, m, l_prev * alpha + p.sum(axis=1)


def finish(acc, l, m=None, sink=None):
    """acc [M, Dh] / l [M]; rows that saw no key (padding) have l == 0 and give 0. With
    sink [M] (each row's head's sink logit) and the running max m [M], the sink joins the
    denominator, both rescaled to max(m, sink) as attention_ref._with_sinks does."""
    if sink is not None:
        m_all = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_all)
        l = l * alpha + jnp.exp(sink - m_all)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, (0,))
    return acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, (0,))


def sink_rows(sinks, hkv: int, rows: int, group: int):
    """sinks [Hq] -> [Hkv, rows] f32: tile row r of KV head h is query head h * G + r % G."""
    r = jnp.arange(rows) % group
    return sinks.astype(jnp.float32).reshape(hkv, group)[:, r]


def apply_sinks_by_lse(out, lse, sinks_rows):
    """A normalized output whose rows' log-sum-exp is known (the Mosaic body, after merging
    its splits): out [NT, Hkv, Mq, Dh], lse [NT, Hkv, Mq], sinks_rows [Hkv, Mq] -> out scaled
    by exp(lse) / (exp(lse) + exp(sink)), which is the sink joining the denominator."""
    w = jax.nn.sigmoid(lse - sinks_rows[None])  # [NT, Hkv, Mq]
    return (out.astype(jnp.float32) * w[..., None]).astype(out.dtype)
