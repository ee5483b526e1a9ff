"""Forward modes. Host-side (no jax) so the scheduler can name them."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    """What one model call does; each mode is its own jit trace.

    EXTEND: prefill rows (possibly on top of a cached prefix), many tokens per row.
    DECODE: one token per row.
    MIXED: extend rows (a chunked prefill) and decode rows in one forward.
    IDLE: nothing to run (a data-parallel rank with no work still joins collectives).
    SPLIT_PREFILL: an extend batch advanced a fixed chunk of layers per call.
    """

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    SPLIT_PREFILL = "split_prefill"

