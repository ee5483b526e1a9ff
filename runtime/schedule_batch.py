"""The interface between the host scheduler and the device runner (host only, no jax).

The cache slot of token position p of a row is
`pages[p // page_size] * page_size + p % page_size`; page 0 is the padding page.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.forward_mode import ForwardMode
from runtime.prefill_policy import PrefillDecision
from runtime.request import Req

# input_ids entry meaning "the token the device sampled for this row's req_slot last step".
PREV_TOKEN = -1


@dataclasses.dataclass
class BatchRow:
    """One request's share of a forward.

    input_ids: tokens fed this step. In overlap mode a decode row may be [PREV_TOKEN]: the
      device substitutes the token it sampled for `req.req_slot` in the previous step.
    start_pos: position of input_ids[0] == tokens of this request already in the KV cache.
    pages: page ids covering positions [0, start_pos + len(input_ids)).
    sample: False for a non-final chunk of a chunked prefill (its logits are discarded and
      it streams nothing). A sampling row must store its token as the slot's previous token.
    new_slot: first row since the request took `req.req_slot` (admission or resume after a
      retraction): per-slot device state (penalty counts, RNG) must be reset from
      `req.prompt_ids` / `req.output_ids` before this row runs.
    num_steps: decode steps of a multi-step batch (runtime/multi_step.py) this row runs:
      it samples a token at each of positions start_pos .. start_pos + num_steps - 1, each
      fed the one before, and `pages` cover them all.
    """

    req: Req
    input_ids: list[int]
    start_pos: int
    pages: list[int]
    sample: bool
    new_slot: bool = False
    num_steps: int = 1

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclasses.dataclass
class ScheduleBatch:
    """Rows of one forward: extend rows first, then decode rows (one input token each).
    steps > 1: a DECODE batch run as one multi-step program of that many steps; each row
    runs its own num_steps of them (runtime/multi_step.py). A TARGET_VERIFY batch's decode
    rows feed their last token and then their drafted ones (runtime/spec_decode.py)."""

    mode: ForwardMode
    extend_rows: list[BatchRow]
    decode_rows: list[BatchRow]
    steps: int = 1
    # The prefill policy's decision for this step's extend rows (runtime/prefill_policy.py;
    # None without the policy): the execution trace keeps it.
    decision: PrefillDecision | None = None

    @property
    def rows(self) -> list[BatchRow]:
        """All rows in output order."""
        return self.extend_rows + self.decode_rows

    @property
    def num_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


@dataclasses.dataclass
class StepOutput:
    """What the runner returns for a batch, one entry per row in `ScheduleBatch.rows` order.

    Rows with sample=False may hold anything. `logprobs` may be None when no row asked for
    logprobs; `top_logprobs` is (ids [num_rows, k], logprobs [num_rows, k]) with k >= every
    row's sampling.top_logprobs, or None. A multi-step batch's (ScheduleBatch.steps = K)
    have a step axis after the row axis: [num_rows, K], [num_rows, K, k].
    """

    next_token_ids: np.ndarray  # [num_rows] int; [num_rows, K] for K steps
    logprobs: np.ndarray | None = None  # [num_rows] float: logprob of the chosen token
    top_logprobs: tuple[np.ndarray, np.ndarray] | None = None
