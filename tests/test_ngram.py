"""The prompt-lookup drafter alone (host only)."""

import pytest

from runtime.ngram import NgramDrafter


def test_drafts_what_followed_the_latest_match():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] last occurred at 5..7, followed by 7, 8, 5
    assert d.draft(seq, 3) == [7, 8, 5]
    assert d.draft(seq, 10) == [7, 8, 5, 1, 2, 3]  # runs up to the end of the sequence


def test_longest_suffix_wins():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    # the 1-gram [3] recurs later (at index 6) than the 3-gram [1, 2, 3] (at 0..2)
    seq = [1, 2, 3, 4, 5, 0, 3, 6, 1, 2, 3]
    assert d.draft(seq, 2) == [4, 5]


def test_no_match_or_no_room():
    d = NgramDrafter(max_ngram=4, min_ngram=2)
    assert d.draft([1, 2, 3, 4, 5], 4) == []  # no 2-gram recurs
    assert d.draft([1, 2, 1, 2], 0) == []
    assert d.draft([7], 3) == []
    assert d.draft([1, 2, 1, 2], 5) == [1, 2]  # the match's continuation is the suffix


def test_window_bounds_the_search():
    d = NgramDrafter(max_ngram=2, min_ngram=2, window=5)
    seq = [4, 5, 6] + [0] * 10 + [1, 4, 5]
    assert d.draft(seq, 2) == []  # the earlier [4, 5] lies outside the last 5 tokens


def test_bad_ngram_range():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
