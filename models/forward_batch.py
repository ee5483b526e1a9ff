"""ForwardBatch: the device-side description of one model call.

Row and token layout (all sizes are static bucket sizes, so they are shapes):

    tokens:  [ extend tokens (T_e, rows 0..B_e-1 back to back, then padding) | decode (B_d) ]
    rows:    [ extend rows (B_e)                                             | decode (B_d) ]

EXTEND has B_d == 0, DECODE has T_e == B_e == 0, MIXED has both. Padding tokens
write their K/V to page 0 (reserved) and sit at position PAD_POSITION (past every real
position, so causal masks exclude them); padding rows have seq_len 0.

The page table of a row lists the pages of its *earlier* context (positions before
this step's tokens); this step's K/V reach attention directly and are scattered into
the pool (at out_cache_loc) after the layer stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.forward_mode import PAD_POSITION, ForwardMode

__all__ = ["ForwardBatch", "ForwardMode"]


@struct.dataclass
class ForwardBatch:
    input_ids: jax.Array       # [T] int32; T = T_e + B_d
    positions: jax.Array       # [T] int32, position of each token in its sequence
    out_cache_loc: jax.Array   # [T] int32, flat slot (page * page_size + offset) to write K/V
    page_table: jax.Array      # [B, Np] int32 page ids per row; B = B_e + B_d
    seq_lens: jax.Array        # [B] int32, KV length of each row including this step's tokens
    query_start: jax.Array     # [B + 1] int32, offset of each row's first token in the token axis
    logits_indices: jax.Array  # [B] int32, the token whose logits each row samples from
    mode: ForwardMode = struct.field(pytree_node=False)
    num_extend_tokens: int = struct.field(pytree_node=False)  # T_e
    num_extend_seqs: int = struct.field(pytree_node=False)    # B_e
    # The sliding layers' ring addresses (models/kv_pool.ring_addresses; None: no rings):
    # the virtual page table [B, Np] and the slot [T] each token's K/V go to.
    ring_page_table: jax.Array | None = None
    ring_out_cache_loc: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decode_seqs(self) -> int:
        return self.num_seqs - self.num_extend_seqs


def real_row_mask(seq_lens: jax.Array) -> jax.Array:
    """seq_lens [B] -> [B] int32: 1 for a real row, 0 for a bucket's padding row (seq_len
    0)."""
    return (seq_lens > 0).astype(jnp.int32)


def real_token_mask(batch: ForwardBatch) -> jax.Array:
    """[T] int32: 1 for a real token, 0 for padding (at PAD_POSITION; the last extend row's
    query_start span runs to the bucket's end, so it does not tell them apart)."""
    return (batch.positions < PAD_POSITION).astype(jnp.int32)
