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

from models.forward_mode import PAD_POSITION


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


class Parted(Protocol):
    """One part of a step (a ScheduleBatch; under dp, one rank's)."""

    extend_rows: Sequence[Any]
    decode_rows: Sequence[Any]


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
    """Pack rows into the ForwardBatch layout (models/forward_batch.py). Padding tokens
    write to page 0, which the allocator never hands out."""
    layout = input_layout(shape)
    arrays = unflatten_inputs(np.empty(sum(math.prod(s) for _, s in layout), np.int32), layout)
    del arrays["row_slots"]
    _fill(arrays, extend_rows, decode_rows, shape, page_size)
    return arrays


def pack_flat(extend_rows: Sequence[Row], decode_rows: Sequence[Row], shape: BucketShape,
              page_size: int, row_slots: np.ndarray) -> np.ndarray:
    """pack_rows and the rows' slots, written straight into flatten_inputs's vector."""
    layout = input_layout(shape)
    flat = np.empty(sum(math.prod(s) for _, s in layout), np.int32)
    arrays = unflatten_inputs(flat, layout)  # views of flat
    arrays.pop("row_slots")[:] = row_slots
    _fill(arrays, extend_rows, decode_rows, shape, page_size)
    return flat


def _fill(arrays: dict[str, np.ndarray], extend_rows: Sequence[Row],
          decode_rows: Sequence[Row], shape: BucketShape, page_size: int) -> None:
    te, be, bd, npg = (shape.num_extend_tokens, shape.num_extend_seqs, shape.num_decode_seqs,
                       shape.num_pages_per_seq)
    t, b = te + bd, be + bd
    n_ext = sum(len(r.input_ids) for r in extend_rows)
    if n_ext > te or len(extend_rows) > be or len(decode_rows) > bd:
        raise ValueError(f"rows do not fit bucket {shape}")
    input_ids, positions = arrays["input_ids"], arrays["positions"]
    out_cache_loc, page_table = arrays["out_cache_loc"], arrays["page_table"]
    seq_lens, query_start = arrays["seq_lens"], arrays["query_start"]
    logits_indices = arrays["logits_indices"]
    input_ids.fill(0)
    positions.fill(PAD_POSITION)
    out_cache_loc.fill(0)
    page_table.fill(0)
    seq_lens.fill(0)
    query_start.fill(n_ext)
    logits_indices.fill(0)

    def check(row: Row) -> int:
        ctx_pages = -(-row.start_pos // page_size)  # the table lists earlier context only
        if ctx_pages > npg:
            raise ValueError(f"row needs {ctx_pages} context pages; bucket has {npg}")
        return ctx_pages

    tok = 0
    for i, row in enumerate(extend_rows):
        n = len(row.input_ids)
        end = row.start_pos + n
        pages = np.asarray(row.pages, np.int32)
        ctx_pages = check(row)
        pos = np.arange(row.start_pos, end, dtype=np.int32)
        input_ids[tok:tok + n] = row.input_ids
        positions[tok:tok + n] = pos
        out_cache_loc[tok:tok + n] = pages[pos // page_size] * page_size + pos % page_size
        page_table[i, :ctx_pages] = pages[:ctx_pages]
        seq_lens[i] = end
        query_start[i] = tok
        logits_indices[i] = tok + n - 1
        tok += n
    # Decode rows feed one token each: scalar writes (a decode step packs every row, and
    # a row's numpy temporaries cost more than the step's other host work on 2 cores).
    for i, row in enumerate(decode_rows):
        if len(row.input_ids) != 1:
            raise ValueError(f"a decode row feeds one token, not {len(row.input_ids)}")
        pos, t_i, r_i = row.start_pos, te + i, be + i
        ctx_pages = check(row)
        input_ids[t_i] = row.input_ids[0]
        positions[t_i] = pos
        out_cache_loc[t_i] = row.pages[pos // page_size] * page_size + pos % page_size
        page_table[r_i, :ctx_pages] = row.pages[:ctx_pages]
        seq_lens[r_i] = pos + 1
        logits_indices[r_i] = t_i
    query_start[be:be + bd] = te + np.arange(bd, dtype=np.int32)
    query_start[b] = t


def padded_rows(parts: Sequence[Parted | None], shape: BucketShape) -> list[Any]:
    """Each padded row's BatchRow (None: padding), part after part (an IDLE part: None;
    under dp a part is one rank's): a part's extend rows from its first row, its decode
    rows from num_extend_seqs."""
    b = shape.num_extend_seqs + shape.num_decode_seqs
    padded: list[Any] = [None] * (b * len(parts))
    for rank, part in enumerate(parts):
        for i, r in enumerate(part.extend_rows if part else []):
            padded[rank * b + i] = r
        for i, r in enumerate(part.decode_rows if part else []):
            padded[rank * b + shape.num_extend_seqs + i] = r
    return padded


def row_order(parts: Sequence[Parted | None], shape: BucketShape) -> np.ndarray:
    """Padded-row index of each real row in result order (part after part, its extend
    rows then its decode rows): the inverse of padded_rows."""
    b, be = shape.num_extend_seqs + shape.num_decode_seqs, shape.num_extend_seqs
    out = []
    for r, p in enumerate(parts):
        if p is not None:
            out += [r * b + i for i in range(len(p.extend_rows))]
            out += [r * b + be + i for i in range(len(p.decode_rows))]
    return np.asarray(out, np.int64)
