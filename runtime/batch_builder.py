"""Host-side packing of batch rows into the padded arrays of a ForwardBatch.

Plain numpy (no jax): the scheduler's rows go in, fixed-shape arrays for one bucket
come out, and the ModelRunner moves them to the device in one transfer (flatten_inputs;
the step's program takes them apart again with unflatten_inputs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

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


# (name, shape) of each int32 input of a step, in the order of its flat host buffer.
InputLayout = tuple[tuple[str, tuple[int, ...]], ...]


def input_layout(shape: BucketShape, dp: int = 1) -> InputLayout:
    """The ForwardBatch arrays of `shape` (under dp, dp ranks' pieces, rank after rank),
    then each row's request slot."""
    t = dp * (shape.num_extend_tokens + shape.num_decode_seqs)
    b = dp * (shape.num_extend_seqs + shape.num_decode_seqs)
    return (("input_ids", (t,)), ("positions", (t,)), ("out_cache_loc", (t,)),
            ("page_table", (b, shape.num_pages_per_seq)), ("seq_lens", (b,)),
            ("query_start", (b + dp,)), ("logits_indices", (b,)), ("row_slots", (b,)))


def flatten_inputs(arrays: dict[str, np.ndarray], row_slots: np.ndarray,
                   layout: InputLayout) -> np.ndarray:
    """One int32 vector of a step's inputs, in `layout`'s order. Why: on the CPU backend
    each host array passed to a program is a transfer of its own, and a single-stream
    decode step ran 5% faster with its inputs already on the device than with 8 arrays."""
    parts = [row_slots if name == "row_slots" else arrays[name] for name, _ in layout]
    for (name, want), a in zip(layout, parts, strict=True):
        if a.shape != want:
            raise ValueError(f"{name}: shape {a.shape}, the layout says {want}")
    return np.concatenate([np.asarray(a, np.int32).ravel() for a in parts])


def unflatten_inputs(flat: Any, layout: InputLayout) -> dict[str, Any]:
    """flatten_inputs undone, on any array type that slices and reshapes (a traced one
    inside the step's program): name -> array of its layout shape."""
    out, start = {}, 0
    for name, s in layout:
        n = math.prod(s)
        out[name] = flat[start:start + n].reshape(s)
        start += n
    return out


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
