"""Forward modes and the padding position: the host-side (no jax) half of the forward
batch's contract, so the scheduler and the batch packer can name them."""

from __future__ import annotations

import enum

# Position of padding tokens: past any real position, so a causal mask keeps every real
# query from attending to padding keys that share its row's slice of the token axis.
PAD_POSITION = 1 << 30


class ForwardMode(enum.Enum):
    """What one model call does; each mode is its own jit trace.

    EXTEND: prefill rows (possibly on top of a cached prefix), many tokens per row.
    DECODE: one token per row.
    MIXED: extend rows (a chunked prefill) and decode rows in one forward.
    IDLE: nothing to run (a data-parallel rank with no work still joins collectives).
    SPLIT_PREFILL: an extend batch advanced a fixed chunk of layers per call.
    TARGET_VERIFY: decode rows of 1 + k tokens each (the last token, then k drafted
      ones) scored in one pass over the rows' caches, a token sampled at every position
      (runtime/spec_decode.py).
    DRAFT_EXTEND / DRAFT_DECODE: a draft model's catch-up extend and its k decode
      steps (runtime/paths/draft.py); its forward batches are EXTEND / DECODE ones.
    """

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    SPLIT_PREFILL = "split_prefill"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"

