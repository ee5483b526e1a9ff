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
# Columns of the per-tile metadata array meta [NT, 7] int32 (see ragged_paged_attention.py).
META = ("row", "kv_len", "prefix_len", "pos0", "nrows", "new_start", "layer")
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
    sliding_window: int | None
    soft_cap: float | None
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

    def __init__(self, kv_len, prefix_len, pos0, nrows, cfg: KernelConfig):
        bk, group, window = cfg.block_kv, cfg.group, cfg.sliding_window
        last = pos0 + (nrows + group - 1) // group - 1  # position of the last query
        first = 0 if window is None else pos0 - window + 1  # first position any query sees
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


def softmax_step(s, rows, kv_pos, m_prev, l_prev, bound, pos0, nrows, cfg: KernelConfig):
    """One online-softmax step over a KV block, masked as the reference masks.

    s [M, BK] f32 raw scores; rows / kv_pos [M, BK] int32 tile row and KV position (keys at
    or past `bound` do not exist); m_prev / l_prev [M]. Returns p [M, BK] (unnormalized),
    alpha [M] (rescale of the old accumulator), m [M], l [M].
    """
    bcast = functools.partial(lax.broadcast_in_dim, shape=s.shape, broadcast_dimensions=(0,))
    s = s * cfg.sm_scale
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    q_pos = pos0 + rows // cfg.group
    mask = (rows < nrows) & (kv_pos < bound) & (kv_pos <= q_pos)
    if cfg.sliding_window is not None:
        mask = mask & (kv_pos > q_pos - cfg.sliding_window)
    s = jnp.where(mask, s, MASKED)
    m = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m)
    # Multiply by the mask (as the reference does): a row with nothing visible yet has
    # m == MASKED, where exp(s - m) would be 1, not 0.
    p = jnp.where(mask, jnp.exp(s - bcast(m)), 0.0)
    return p, alpha, m, l_prev * alpha + p.sum(axis=1)


def finish(acc, l):
    """acc [M, Dh] / l [M]; rows that saw no key (padding) have l == 0 and give 0."""
    return acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, (0,))
