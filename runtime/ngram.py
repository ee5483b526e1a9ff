"""Prompt lookup (n-gram) drafting: propose the tokens that followed the most recent
earlier occurrence of the sequence's last n tokens (vLLM's / SGLang's `ngram`). Plain
NumPy, no model: code edits, summaries with quotes and RAG answers copy long spans of
their prompt, and a copied span is found by its last few tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    """Drafts up to k tokens for a token sequence (prompt + output so far).

    The longest suffix of `max_ngram` .. `min_ngram` tokens that occurred earlier wins,
    and of its occurrences the latest (the one nearest the text being written). Only the
    last `window` tokens are searched, so a step's host cost is bounded on long contexts.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the sequence's suffix;
        [] when no suffix of min_ngram tokens or more recurs."""
        if k <= 0 or len(tokens) <= self.min_ngram:
            return []
        seq = np.asarray(tokens[-self.window:], np.int64)  # [L]
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            # Windows that start before the suffix itself: [L - n, n]
            windows = sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the latest match
                return seq[start:start + k].tolist()
        return []
