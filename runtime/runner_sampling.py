"""The ModelRunner's sampling half: the sampler executable (one per batch-row count B,
shared by every path, mode and bucket with B rows), the per-slot penalty state it reads,
and PendingStep, a launched step's device results. A mixin of ModelRunner
(runtime/model_runner.py), which owns the state it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from runtime import sampling
from runtime.batch_builder import BucketShape
from runtime.bucket_plan import smallest_fitting
from runtime.grammar import mask_width
from runtime.request import MAX_LOGIT_BIAS
from runtime.schedule_batch import BatchRow, ScheduleBatch, StepOutput
from runtime.slot_state import SlotState, constraint_columns, sampling_columns


class PendingStep:
    """Device results of a launched step; `result()` blocks and reads them back."""

    def __init__(self, batch: ScheduleBatch, out: sampling.SampleOutput, order: np.ndarray,
                 top_n: int, steps: int = 1) -> None:
        # order: padded-row index of each real row (extend rows, then decode rows).
        # steps > 1: a multi-step program's results, each array with a leading [K] axis.
        self.batch, self.out, self._order, self._top_n = batch, out, order, top_n
        self._steps = steps
        # For the execution trace: the padded step the launch computed (None: the batch's
        # bucket), and the launching path's own record (StepRecord.detail).
        self.shape: BucketShape | None = None
        self.detail: Any = None

    def is_ready(self) -> bool:
        """Whether the device has finished this step (readback would not block)."""
        return self.out.next_tokens.is_ready()

    def result(self) -> StepOutput:
        # np.asarray, not jax.device_get: on the CPU backend device_get's async host copy
        # costs ~0.3 ms of host CPU a step (0.08 ms this way), taken from the kernels' cores.
        out = jax.tree.map(np.asarray, self.out)
        if self._steps > 1:  # [K, B, ...] -> [B, K, ...], StepOutput's layout
            out = jax.tree.map(lambda a: np.swapaxes(a, 0, 1), out)
        o = self._order
        top = (out.top_ids[o], out.top_logprobs[o]) if self._top_n else None
        return StepOutput(next_token_ids=out.next_tokens[o], logprobs=out.logprobs[o],
                          top_logprobs=top)


class SamplingLaunch:
    """Sampling of ModelRunner (`self` is the runner)."""

    def _sample_fn(self) -> Callable:
        place = self.placement
        return jax.jit(self.sample_body(), donate_argnums=(0,),
                       **place.out(place.replicated, place.replicated))

    def sample_body(self) -> Callable:
        """sample(state, logits [B, V], words) -> (SampleOutput, state): the sampler
        program's body, which a path may also run inside its own programs."""
        top_n, dummy = self.cfg.max_top_logprobs, self.max_running
        mask_w = mask_width(self.model_cfg.vocab_size)

        def sample(state, logits, words):
            # words: [row_slots (B) | sample_mask (B) | SamplingBatch.to_words()] i32
            b = logits.shape[0]
            row_slots, sample_mask = words[:b], words[b:2 * b] != 0  # [B], [B]
            sp = sampling.SamplingBatch.from_words(words[2 * b:], b, mask_width=mask_w,
                                                   bias_slots=MAX_LOGIT_BIAS)
            out = sampling.sample(logits, sp, state.token_counts, state.prompt_mask,
                                  row_slots, num_top_logprobs=top_n)
            tgt = jnp.where(sample_mask, row_slots, dummy)  # [B]
            state = SlotState(
                last_tokens=state.last_tokens.at[tgt].set(out.next_tokens),
                token_counts=sampling.update_token_counts(state.token_counts, tgt,
                                                          out.next_tokens),
                prompt_mask=state.prompt_mask)
            return out, state

        return sample

    def abstract_sample_inputs(self, b: int) -> tuple:
        rep = self.placement.replicated
        words = 2 * b + sampling.word_count(b, mask_width(self.model_cfg.vocab_size),
                                            MAX_LOGIT_BIAS)
        return (jax.ShapeDtypeStruct((b, self.model_cfg.vocab_size), jnp.float32, sharding=rep),
                jax.ShapeDtypeStruct((words,), jnp.int32, sharding=rep))

    def init_slots(self, rows: Sequence[BatchRow]) -> None:
        """Rebuild the penalty state of each newly admitted (or resumed) request that uses
        penalties: output-token counts and prompt mask. Requests without penalties never
        read their slot's state, so they skip this."""
        for row in rows:
            req, sp = row.req, row.req.sampling
            if not row.new_slot or (sp.frequency_penalty == 0 and sp.presence_penalty == 0
                                    and sp.repetition_penalty == 1):
                continue
            n = smallest_fitting(self.cfg.kv_len_buckets, req.num_known, "sequence length")
            ids = np.full(n, -1, np.int32)
            ids[:req.num_known] = req.all_ids
            is_out = np.zeros(n, np.int32)
            is_out[len(req.prompt_ids):req.num_known] = 1
            self.state = self._init_slot_exec[n](self.state, np.int32(req.req_slot), ids,
                                                 is_out)

    def slots_of(self, padded: list[BatchRow | None]) -> tuple[np.ndarray, np.ndarray]:
        """Each padded row's slot (padding: the spare last slot) and whether it samples."""
        row_slots = np.full(len(padded), self.max_running, np.int32)
        sample_mask = np.zeros(len(padded), bool)
        for i, r in enumerate(padded):
            if r is not None:
                row_slots[i], sample_mask[i] = r.req.req_slot, r.sample
        return row_slots, sample_mask

    def _sample_rows(self, batch: ScheduleBatch, padded: list[BatchRow | None],
                     logits: jax.Array, order: np.ndarray) -> PendingStep:
        """Sample logits [len(padded), V] whose row i is padded[i] (None: padding)."""
        out, self.state = self._samplers[len(padded)](self.state, logits,
                                                      self.sample_words(padded))
        self.check_no_compiles()
        return PendingStep(batch, out, order, self.cfg.max_top_logprobs)

    def sample_words(self, padded: list[BatchRow | None]) -> np.ndarray:
        """The sampler's one host input: [row_slots | sample_mask | the rows' SamplingBatch
        .to_words()]. Rows that hold the same requests as last step's (every decode step
        of a steady batch) reuse its vector: only the steps and grammar masks are new."""
        key = [None if r is None else (r.req, r.sample, r.req.req_slot) for r in padded]
        cached = self._words_cache
        if cached is None or not _same_rows(cached[0], key):
            row_slots, sample_mask = self.slots_of(padded)
            words = np.concatenate([row_slots, sample_mask.astype(np.int32),
                                    self.sampling_batch(len(padded), padded).to_words()])
            self._words_cache = (key, words)
            return words.copy()  # the cached vector never goes to a program: it may alias
        words = cached[1].copy()
        b, v = len(padded), self.model_cfg.vocab_size
        layout = sampling.word_layout(b, mask_width(v), MAX_LOGIT_BIAS)
        start = 2 * b + layout["step"][0]
        words[start:start + b] = [0 if r is None else r.end_pos for r in padded]
        if any(r is not None and r.req.grammar is not None for r in padded):
            start = 2 * b + layout["token_bitmask"][0]
            mask = constraint_columns(padded, v)["token_bitmask"]  # [B, W]
            words[start:start + mask.size] = mask.ravel()
        return words

    def sampling_batch(self, b: int, padded: Sequence[BatchRow | None] = ()
                        ) -> sampling.SamplingBatch:
        """Every step passes the full bitmask and bias widths: one sampler trace per B."""
        v = self.model_cfg.vocab_size
        cols = {**sampling_columns(padded), **constraint_columns(padded, v)} if padded else {}
        return sampling.SamplingBatch.create(b, mask_width=mask_width(v),
                                             bias_slots=MAX_LOGIT_BIAS, **cols)


_RowKey = tuple[object, bool, int] | None


def _same_rows(a: list[_RowKey], b: list[_RowKey]) -> bool:
    """Whether two steps' padded rows are the same requests (by identity), sampling or
    not alike, in the same slots."""
    return len(a) == len(b) and all(
        x is y or (x is not None and y is not None and x[0] is y[0] and x[1:] == y[1:])
        for x, y in zip(a, b, strict=True))
