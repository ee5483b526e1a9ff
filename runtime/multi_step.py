"""Multi-step decode: K decode steps of one batch in one program (forward, then sampling,
K times on the device), so the host schedules, packs, launches and reads back once per K
tokens instead of once per token (vLLM's --num-scheduler-steps). On a 2-core CPU the host
thread's work per step shares the cores with the kernels; on a GPU it is the gap between
two short steps.

Inputs: the plain DECODE step's flat vector (batch_builder.pack_flat; its page table lists
every page of the K positions, not just the earlier context) followed by each row's step
count n [B] (1..K; 0 for padding), and the sampler's word vector of those rows. Step i
feeds each row the token of step i - 1 at position start + i and writes its K/V there; a
row past its n runs as padding (no work on the CPU fast path, K/V to the padding page),
and its sampler slot is not updated, so the slot keeps the row's last real token for the
next batch's PREV_TOKEN. The sampling words' `step` column advances by one each step, so
a seeded row draws what the one-step path draws for the same position.

Out: SampleOutput with a leading [K] axis; the host keeps each row's first n tokens and
stops at a finish, as if they came one by one (Scheduler.process_results). One program
per plain DECODE bucket (the runner's `num_scheduler_steps`); grammar-constrained rows
and batches beside a prefill use the one-step programs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.forward_batch import ForwardBatch, ForwardMode
from models.kv_pool import with_rings
from runtime.batch_builder import PAD_POSITION, BucketShape, input_layout, unflatten_inputs
from runtime.bucket_plan import StepKey
from runtime.schedule_batch import BatchRow


class MultiStepExecutables:
    """K-step decode programs, one per plain DECODE step key."""

    def __init__(self, steps: int, keys: list[StepKey], page_size: int) -> None:
        if steps < 2:
            raise ValueError(f"num_scheduler_steps={steps}: multi-step programs need >= 2")
        self.steps, self.page_size = steps, page_size
        self.keys = [k for k in keys if k.mode is ForwardMode.DECODE]
        self._exe: dict[str, Callable] = {}

    @property
    def names(self) -> list[str]:
        return [self.name(k) for k in self.keys]

    def name(self, key: StepKey) -> str:
        s = key.shape
        return f"multi_decode/K{self.steps}_bd{s.num_decode_seqs}_np{s.num_pages_per_seq}"

    def lowerings(self, program: Callable[[StepKey], Callable], params: Any, kv: Any,
                  state: Any, flat_for: Callable[[int], Any], words_for: Callable[[int], Any]
                  ) -> list[tuple[str, Callable[[], Any]]]:
        """(name, lower) of each program: `program(key)` is its jitted function, flat_for(n)
        / words_for(b) the abstract flat inputs of n words and the sampler words of b rows."""
        out = []
        for key in self.keys:
            b = key.shape.num_decode_seqs
            n = sum(math.prod(s) for _, s in input_layout(key.shape)) + b
            out.append((self.name(key), functools.partial(
                program(key).lower, params, kv, state, flat_for(n), words_for(b))))
        return out

    def install(self, compiled: dict[str, Callable]) -> None:
        self._exe = {n: compiled[n] for n in self.names}

    def __call__(self, key: StepKey, *args: Any) -> Any:
        return self._exe[self.name(key)](*args)


def pack_steps(flat: np.ndarray, rows: list[BatchRow], shape: BucketShape,
               page_size: int) -> np.ndarray:
    """A plain DECODE step's flat inputs (pack_flat) made a K-step program's: each row's
    page table lists every page its steps write, and its step count follows the vector."""
    layout = input_layout(shape)
    arrays = unflatten_inputs(flat, layout)  # views of flat
    table = arrays["page_table"]  # [B, Np]
    for i, row in enumerate(rows):
        last = row.start_pos + row.num_steps - 1
        n = last // page_size + 1
        if n > table.shape[1]:
            raise ValueError(f"row's {row.num_steps} steps need {n} pages; bucket has "
                             f"{table.shape[1]}")
        table[i, :n] = row.pages[:n]
    steps = np.zeros(shape.num_decode_seqs, np.int32)
    steps[:len(rows)] = [r.num_steps for r in rows]
    return np.concatenate([flat, steps])


def multi_step_fn(key: StepKey, steps: int, page_size: int,
                  forward: Callable[[Any, Any, ForwardBatch], tuple[jax.Array, Any]],
                  sample: Callable[[Any, jax.Array, jax.Array], tuple[Any, Any]],
                  step_at: int) -> Callable:
    """The K-step program of DECODE bucket `key` (unjitted): (params, kv, state, flat,
    words) -> (SampleOutput with a [K] axis, kv, state).

    forward(params, kv, batch) -> (logits [B, V], kv) is the model's forward; sample(state,
    logits, words) -> (SampleOutput, state) the runner's sampler body; step_at the first
    word of the sampling words' `step` column (one word per row)."""
    layout = input_layout(key.shape)
    b = key.shape.num_decode_seqs
    n_plain = sum(math.prod(s) for _, s in layout)

    def program(params, kv, state, flat, words):
        arrays = unflatten_inputs(flat[:n_plain], layout)
        todo = flat[n_plain:]  # [B] steps each row runs
        row_slots = arrays.pop("row_slots")  # [B]
        # Decode inputs of -1: the token the slot sampled last (overlap scheduling).
        ids0 = jnp.where(arrays["input_ids"] < 0, state.last_tokens[row_slots],
                         arrays["input_ids"])  # [B]
        pos0, seq0, table = arrays["positions"], arrays["seq_lens"], arrays["page_table"]
        mask0 = words[b:2 * b]  # [B] sample_mask as 0 / 1

        def body(carry, i):
            kv, state, ids = carry
            live = (i < todo) & (seq0 > 0)  # [B]
            pos = pos0 + i
            page = jnp.take_along_axis(
                table, jnp.minimum(pos // page_size, table.shape[1] - 1)[:, None], 1)[:, 0]
            batch = ForwardBatch(
                input_ids=ids, positions=jnp.where(live, pos, PAD_POSITION),
                out_cache_loc=jnp.where(live, page * page_size + pos % page_size, 0),
                page_table=table, seq_lens=jnp.where(live, seq0 + i, 0),
                query_start=arrays["query_start"], logits_indices=arrays["logits_indices"],
                mode=ForwardMode.DECODE, num_extend_tokens=0, num_extend_seqs=0)
            logits, kv = forward(params, kv, with_rings(batch, kv, row_slots))  # [B, V]
            w = words.at[b:2 * b].set(mask0 * live)
            w = w.at[step_at:step_at + b].add(i)
            out, state = sample(state, logits, w)
            return (kv, state, out.next_tokens), out

        (kv, state, _), outs = jax.lax.scan(body, (kv, state, ids0),
                                               jnp.arange(steps, dtype=jnp.int32))
        return outs, kv, state

    return program
