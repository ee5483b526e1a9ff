"""Two-batch overlap (TBO): how one batch is split into two micro-batches, and how their
results go back in the original order. Host code (no jax): the scheduler's rows in,
two child ScheduleBatches and a row order out; `split_batch` is the entry point.

The split follows SGLang's rules (python/sglang/srt/batch_overlap/two_batch_overlap.py):
- DECODE: at half the sequences (A gets n // 2 rows, B the rest; one row: A is IDLE).
- EXTEND / MIXED (rows are extend rows then decode rows, a decode row is one token): at
  the sequence boundary whose token sums are most balanced. When even that leaves the
  left child with less than `threshold` (or more than 1 - threshold) of the tokens, the
  two-chunk fallback cuts the sequence that straddles the middle at total // 2 tokens: A
  ends with that sequence's first part (not sampled), B starts with its rest, which
  extends on the K/V that A's part computes in the same forward (the device runs A's
  attention of each layer before B's and hands B those K/V; models/moe_overlap.py).

Whether a batch is worth splitting at all is `min_tokens` (RunnerConfig.tbo_min_tokens;
docs/tbo.md has the measured crossover): below it the plain path runs.

The device runs both micro-batches padded to one common bucket (the larger child's
shapes), so TBO adds one executable per plain bucket it covers, not one per pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape
from runtime.schedule_batch import BatchRow, ScheduleBatch

DEFAULT_THRESHOLD = 0.48


def balanced_boundary(lens: Sequence[int]) -> int:
    """The index i in [1, n) where sum(lens[:i]) and sum(lens[i:]) are closest (the later
    one on a tie, as SGLang); 0 for fewer than two sequences."""
    total, left = sum(lens), 0
    best, best_diff = 0, float("inf")
    for i in range(1, len(lens)):
        left += lens[i - 1]
        diff = abs(2 * left - total)
        if diff > best_diff:
            break  # the left sum only grows: past the middle every later cut is worse
        best, best_diff = i, diff
    return best


def straddling_seq(lens: Sequence[int]) -> int:
    """The index of the sequence whose tokens cross total // 2 (cumulative sum > half)."""
    half, left = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        left += n
        if left > half:
            return i
    return 0


@dataclasses.dataclass(frozen=True)
class SplitPoint:
    """Where B starts: row `seq_index` (in rows order) and token `token_index`; with
    `two_chunk`, row seq_index is cut, its first `token_index - sum(lens[:seq_index])`
    tokens in A and the rest in B."""

    seq_index: int
    token_index: int
    two_chunk: bool = False


def split_point(mode: ForwardMode, lens: Sequence[int],
                threshold: float = DEFAULT_THRESHOLD) -> SplitPoint:
    """SGLang's split of a batch whose rows feed `lens` tokens each (see the module
    docstring)."""
    if not 0 <= threshold <= 0.5:
        raise ValueError(f"tbo_token_distribution_threshold={threshold} must be in [0, 0.5]")
    if mode is ForwardMode.DECODE:
        i = len(lens) // 2
        return SplitPoint(i, i)
    i = balanced_boundary(lens)
    total, left = sum(lens), sum(lens[:i])
    if threshold * total <= left <= (1 - threshold) * total:
        return SplitPoint(i, left)
    j, cut = straddling_seq(lens), total // 2
    before = sum(lens[:j])
    # A degenerate cut (nothing of row j on one side, or A with more rows than tokens, the
    # case SGLang also refuses) keeps the boundary split.
    if not before < cut < before + lens[j] or j + 1 > cut:
        return SplitPoint(i, left)
    return SplitPoint(j, cut, two_chunk=True)


@dataclasses.dataclass(frozen=True)
class TboBatches:
    """The two micro-batches of a batch, and for each of the batch's rows (batch.rows
    order) which row of the children's padded concatenation holds its logits."""

    a: ScheduleBatch
    b: ScheduleBatch
    point: SplitPoint

    def tokens(self) -> tuple[int, int]:
        return self.a.num_tokens, self.b.num_tokens

    def rows(self) -> tuple[int, int]:
        return len(self.a.rows), len(self.b.rows)

    def merge_order(self, shape: BucketShape) -> list[int]:
        """Row r of the merged logits = row order[r] of concat(A's padded rows, B's),
        both padded to `shape`; rows past the batch's point at padding rows."""
        per_child = shape.num_extend_seqs + shape.num_decode_seqs

        def padded_index(child: ScheduleBatch, offset: int) -> list[int]:
            ext = list(range(len(child.extend_rows)))
            dec = [shape.num_extend_seqs + i for i in range(len(child.decode_rows))]
            return [offset + i for i in ext + dec]

        a_idx, b_idx = padded_index(self.a, 0), padded_index(self.b, per_child)
        if self.point.two_chunk:
            a_idx = a_idx[:-1]  # the cut row's first part samples nothing; B's part does
        order = a_idx + b_idx
        spare = [i for i in range(2 * per_child) if i not in set(order)]
        return order + spare


def split_batch(batch: ScheduleBatch, threshold: float = DEFAULT_THRESHOLD,
                min_tokens: int = 1) -> TboBatches | None:
    """The micro-batches of `batch` (None: a mode TBO does not split, or fewer than
    `min_tokens` tokens, which run the plain path)."""
    if batch.mode not in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED):
        return None
    if batch.num_tokens < max(min_tokens, 1):
        return None
    lens = [len(r.input_ids) for r in batch.rows]
    p = split_point(batch.mode, lens, threshold)
    n_ext = len(batch.extend_rows)
    tagged = [(r, i >= n_ext) for i, r in enumerate(batch.rows)]
    a_rows, b_rows = tagged[:p.seq_index], tagged[p.seq_index:]
    if p.two_chunk:
        row, is_dec = b_rows[0]
        c = p.token_index - sum(lens[:p.seq_index])
        first = dataclasses.replace(row, input_ids=row.input_ids[:c], sample=False)
        rest = dataclasses.replace(row, input_ids=row.input_ids[c:], start_pos=row.start_pos + c,
                                   new_slot=False)
        a_rows, b_rows = a_rows + [(first, is_dec)], [(rest, is_dec)] + b_rows[1:]
    return TboBatches(_split_child(a_rows), _split_child(b_rows), p)


def _split_child(rows: list[tuple[BatchRow, bool]]) -> ScheduleBatch:
    ext = [r for r, is_dec in rows if not is_dec]
    dec = [r for r, is_dec in rows if is_dec]
    if not rows:
        return ScheduleBatch(ForwardMode.IDLE, [], [])
    mode = ForwardMode.MIXED if ext and dec else (
        ForwardMode.EXTEND if ext else ForwardMode.DECODE)
    return ScheduleBatch(mode, ext, dec)


def common_shape(tbo: TboBatches, bucket_for: Callable[[ScheduleBatch], BucketShape]
                 ) -> BucketShape:
    """One bucket both micro-batches fit (each dimension the larger child's); an IDLE
    child fits any."""
    shapes = [bucket_for(c) for c in (tbo.a, tbo.b) if c.rows]
    return BucketShape(*(max(getattr(s, f.name) for s in shapes)
                         for f in dataclasses.fields(BucketShape)))
