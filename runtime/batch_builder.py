"""Host-side packing of batch rows into the padded arrays of a ForwardBatch.

Plain numpy (no jax): the scheduler's rows go in, fixed-shape arrays for one bucket
come out, and the ModelRunner moves them to the device in one transfer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

# Position of padding tokens: past any real position, so a causal mask keeps every real
# query from attending to padding keys that share its row's slice of the token axis.
PAD_POSITION = 1 << 30


@dataclasses.dataclass
class SeedRow:
    """A Row not tied to a request (warm-up's cost seeding)."""

    input_ids: list[int]
    start_pos: int
    pages: list[int]


class Row(Protocol):
    input_ids: Sequence[int]  # tokens fed this step; -1 = "the token sampled last step"
    start_pos: int            # tokens of this row already in the KV cache
    pages: Sequence[int]      # pages covering [0, start_pos + len(input_ids))


@dataclasses.dataclass(frozen=True)
class BucketShape:
    """The static sizes of one trace: T_e extend tokens, B_e extend rows, B_d decode rows,
    and Np pages per row in the page table."""

    num_extend_tokens: int
    num_extend_seqs: int
    num_decode_seqs: int
    num_pages_per_seq: int


def pack_rows(extend_rows: Sequence[Row], decode_rows: Sequence[Row], shape: BucketShape,
              page_size: int) -> dict[str, np.ndarray]:
    """Pack rows into the ForwardBatch layout (runtime/forward_batch.py). Padding tokens
    write to page 0, which the allocator never hands out."""
    te, be, bd, npg = (shape.num_extend_tokens, shape.num_extend_seqs, shape.num_decode_seqs,
                       shape.num_pages_per_seq)
    t, b = te + bd, be + bd
    n_ext = sum(len(r.input_ids) for r in extend_rows)
    if n_ext > te or len(extend_rows) > be or len(decode_rows) > bd:
        raise ValueError(f"rows do not fit bucket {shape}")
    input_ids = np.zeros(t, np.int32)
    positions = np.full(t, PAD_POSITION, np.int32)
    out_cache_loc = np.zeros(t, np.int32)
    page_table = np.zeros((b, npg), np.int32)
    seq_lens = np.zeros(b, np.int32)
    query_start = np.full(b + 1, n_ext, np.int32)
    logits_indices = np.zeros(b, np.int32)

    def put(row_idx: int, tok0: int, row: Row) -> None:
        n = len(row.input_ids)
        end = row.start_pos + n
        pages = np.asarray(row.pages, np.int32)
        ctx_pages = -(-row.start_pos // page_size)  # the table lists earlier context only
        if ctx_pages > npg:
            raise ValueError(f"row needs {ctx_pages} context pages; bucket has {npg}")
        pos = np.arange(row.start_pos, end, dtype=np.int32)
        input_ids[tok0:tok0 + n] = row.input_ids
        positions[tok0:tok0 + n] = pos
        out_cache_loc[tok0:tok0 + n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[row_idx, :ctx_pages] = pages[:ctx_pages]
        seq_lens[row_idx] = end
        query_start[row_idx] = tok0
        logits_indices[row_idx] = tok0 + n - 1

    tok = 0
    for i, row in enumerate(extend_rows):
        put(i, tok, row)
        tok += len(row.input_ids)
    for i, row in enumerate(decode_rows):
        put(be + i, te + i, row)
    query_start[be:be + bd] = te + np.arange(bd, dtype=np.int32)
    query_start[b] = t
    return dict(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                page_table=page_table, seq_lens=seq_lens, query_start=query_start,
                logits_indices=logits_indices)
