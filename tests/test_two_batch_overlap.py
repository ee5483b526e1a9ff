"""The TBO split rules (runtime/two_batch_overlap.py) on the host, against hand-worked
cases: SGLang's balanced boundary, the threshold, the two-chunk cut, IDLE children."""

from __future__ import annotations

import pytest

from models.forward_mode import ForwardMode
from runtime import two_batch_overlap as tbo
from runtime.batch_builder import BucketShape
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import BatchRow, ScheduleBatch

EXTEND, DECODE, MIXED = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED


def _row(n: int, start: int = 0, rid: str = "r") -> BatchRow:
    req = Req(rid, list(range(start + n)), SamplingParams())
    return BatchRow(req, list(range(start, start + n)), start, [1, 2, 3], sample=True,
                    new_slot=start == 0)


@pytest.mark.parametrize("n,want", [(5, 2), (4, 2), (1, 0)])
def test_decode_splits_at_half_the_sequences(n, want):
    assert tbo.split_point(DECODE, [1] * n) == tbo.SplitPoint(want, want)


def test_balanced_boundary():
    # cuts: after 3 -> 3 | 13, after 8 -> 8 | 8, after 12 -> 12 | 4: the middle one.
    assert tbo.split_point(EXTEND, [3, 5, 4, 4]) == tbo.SplitPoint(2, 8)
    # a tie (2 | 4 and 4 | 2) takes the later cut, as SGLang's `<=` does
    assert tbo.balanced_boundary([2, 2, 2]) == 2


def test_threshold_decides_between_boundary_and_two_chunk():
    # [10, 12]: the only boundary leaves 10/22 = 0.4545 on the left.
    assert tbo.split_point(EXTEND, [10, 12], threshold=0.45) == tbo.SplitPoint(1, 10)
    # below 0.48: cut row 1 (cumulative 22 > 11) at token 11, one token of it in A.
    assert tbo.split_point(EXTEND, [10, 12]) == tbo.SplitPoint(1, 11, two_chunk=True)
    # 12/22 = 0.545 > 1 - 0.48 on the other side too: [12, 10] cuts row 0 at 11.
    assert tbo.split_point(EXTEND, [12, 10]) == tbo.SplitPoint(0, 11, two_chunk=True)
    with pytest.raises(ValueError, match="threshold"):
        tbo.split_point(EXTEND, [1, 2], threshold=0.6)


def test_two_chunk_single_sequence_and_degenerate_cuts():
    assert tbo.split_point(EXTEND, [9]) == tbo.SplitPoint(0, 4, two_chunk=True)
    # one token cannot be cut: A is IDLE, B runs the whole batch
    assert tbo.split_point(EXTEND, [1]) == tbo.SplitPoint(0, 0)
    # [2, 2, 2] -> boundary 4 | 2 (0.67) -> cut row 1 at token 3
    assert tbo.split_point(EXTEND, [2, 2, 2]) == tbo.SplitPoint(1, 3, two_chunk=True)


def test_two_chunk_children_share_the_cut_sequence():
    long, short = _row(20, start=4, rid="long"), _row(2, rid="short")
    batch = ScheduleBatch(EXTEND, [short, long], [])
    split = tbo.split_batch(batch)
    # lens [2, 20]: the boundary leaves 2/22 left -> cut at 11: A = short + 9 of long.
    assert split.point == tbo.SplitPoint(1, 11, two_chunk=True)
    a_first, b_rest = split.a.extend_rows[1], split.b.extend_rows[0]
    assert (a_first.input_ids, a_first.start_pos, a_first.sample) == (
        list(range(4, 13)), 4, False)
    assert (b_rest.input_ids, b_rest.start_pos, b_rest.sample, b_rest.new_slot) == (
        list(range(13, 24)), 13, True, False)
    assert b_rest.pages == long.pages and split.tokens() == (11, 11)
    # rows: A = [short, long part 1], B = [long part 2]; long samples from B's row 0
    shape = BucketShape(16, 2, 0, 2)
    assert split.merge_order(shape) == [0, 2, 1, 3]


def test_mixed_rows_are_extend_rows_then_decode_rows():
    ext = _row(20, rid="p")
    dec = [_row(1, start=7, rid=f"d{i}") for i in range(4)]
    split = tbo.split_batch(ScheduleBatch(MIXED, [ext], dec))
    # lens [20, 1, 1, 1, 1]: best boundary 20 | 4 (0.83) -> cut the prompt at 12
    assert split.point == tbo.SplitPoint(0, 12, two_chunk=True)
    assert (split.a.mode, split.b.mode) == (EXTEND, MIXED)
    assert split.tokens() == (12, 12) and split.rows() == (1, 5)
    shape = BucketShape(16, 1, 4, 2)  # 5 padded rows per child
    assert split.merge_order(shape)[:5] == [5, 6, 7, 8, 9]


def test_decode_children_idle_and_small_batches():
    one = tbo.split_batch(ScheduleBatch(DECODE, [], [_row(1, 3)]))
    assert one.a.mode is ForwardMode.IDLE and one.b.rows and one.rows() == (0, 1)
    shape = BucketShape(0, 0, 2, 4)
    assert one.merge_order(shape) == [2, 0, 1, 3]
    assert tbo.split_batch(ScheduleBatch(DECODE, [], [_row(1, 3)] * 3), min_tokens=4) is None
    assert tbo.split_batch(ScheduleBatch(ForwardMode.IDLE, [], [])) is None


def test_common_shape_takes_each_dimension_of_the_larger_child():
    split = tbo.split_batch(ScheduleBatch(MIXED, [_row(20, rid="p")],
                                          [_row(1, 7, f"d{i}") for i in range(4)]))
    shapes = {id(split.a): BucketShape(16, 1, 0, 0), id(split.b): BucketShape(16, 1, 4, 8)}
    assert tbo.common_shape(split, lambda c: shapes[id(c)]) == BucketShape(16, 1, 4, 8)
