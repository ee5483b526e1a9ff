"""Multi-step decode as a path: a DECODE batch of `steps` > 1 runs its steps in one
program per DECODE bucket, sampling inside it (runtime/multi_step.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from models.forward_mode import ForwardMode
from runtime import sampling
from runtime.batch_builder import pack_flat, padded_rows
from runtime.bucket_plan import StepKey
from runtime.executable_budget import MULTI_STEP_COST, PlanPart
from runtime.grammar import mask_width
from runtime.multi_step import MultiStepExecutables, multi_step_fn, pack_steps
from runtime.paths.base import ExecPath, Lowering
from runtime.request import MAX_LOGIT_BIAS
from runtime.runner_sampling import PendingStep
from runtime.schedule_batch import ScheduleBatch


class MultiStepPath(ExecPath):
    name = "multi_step"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.programs = MultiStepExecutables(runner.cfg.num_scheduler_steps,
                                             runner.step_keys(), runner.cache_cfg.page_size)

    def plan_parts(self) -> list[PlanPart]:
        c = self.runner.cfg
        return [PlanPart("MULTI_STEP", len(self.names), MULTI_STEP_COST,
                         f"--num_scheduler_steps > 1: one per DECODE bucket "
                         f"({len(c.decode_buckets)} decode_buckets x "
                         f"{len(c.kv_len_buckets)} kv_len_buckets)")]

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        r = self.runner
        return self.programs.lowerings(self._program, params, kv, state, r.placement.i32,
                                       lambda b: r.abstract_sample_inputs(b)[1])

    def launch(self, batch: ScheduleBatch) -> PendingStep | None:
        """Run a DECODE batch's `steps` decode steps in one program; its results carry a
        step axis."""
        if batch.steps <= 1:
            return None
        r = self.runner
        shape = r.bucket_for(batch)
        key = StepKey(ForwardMode.DECODE, shape)
        rows = batch.decode_rows
        padded = padded_rows([batch], shape)
        page = r.cache_cfg.page_size
        flat = pack_steps(pack_flat([], rows, shape, page, r.slots_of(padded)[0]), rows,
                          shape, page)
        out, r.kv, r.state = self.programs(key, r.params, r.kv, r.state, flat,
                                           r.sample_words(padded))
        r.check_no_compiles()
        r.step_counts[ForwardMode.DECODE] += batch.steps
        return PendingStep(batch, out, np.arange(len(rows)), r.cfg.max_top_logprobs,
                           steps=batch.steps)

    def _program(self, key: StepKey) -> Callable:
        r = self.runner
        model, cfg, mesh, place = r.model, r.model_cfg, r.mesh, r.placement
        backend = r.cfg.attention_backend
        b = key.shape.num_decode_seqs
        layout = sampling.word_layout(b, mask_width(cfg.vocab_size), MAX_LOGIT_BIAS)
        program = multi_step_fn(
            key, r.cfg.num_scheduler_steps, r.cache_cfg.page_size,
            lambda params, kv, batch: model.forward(params, kv, batch, cfg, backend, mesh=mesh),
            r.sample_body(), 2 * b + layout["step"][0])
        return jax.jit(program, donate_argnums=(1, 2),
                       **place.out(place.replicated, place.kv, place.replicated))
