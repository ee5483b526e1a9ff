"""Split prefill as a path (runtime/split_prefill.py's programs): start a split, run its
intervals, finish it; and what the multiplexing policy reads of their measured costs.
The multiplexing loop (runtime/multiplexing.py) calls these verbs on this path; it claims
no batch through the runner's launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, pack_rows, padded_rows, row_order
from runtime.bucket_plan import cost_key
from runtime.executable_budget import FORWARD_COST, PlanPart, release_freed_heap
from runtime.paths.base import ExecPath, LaunchedForward, Lowering
from runtime.runner_sampling import PendingStep
from runtime.schedule_batch import ScheduleBatch
from runtime.split_prefill import SplitExecutables, SplitPrefill, layer_work


class SplitPath(ExecPath):
    name = "split_prefill"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        cfg = runner.cfg
        extend = [k.shape for k in runner.step_keys() if k.mode is ForwardMode.EXTEND]
        if cfg.enable_split_prefill:
            shapes = [s for s in extend if s.num_extend_tokens >= cfg.split_min_tokens]
        else:  # the prefill policy's one-row intervals (RunnerConfig.policy_split_tokens)
            # (a fresh prompt runs at the narrowest width over a prefix: shape_for)
            shapes = [s for s in extend if s.num_extend_tokens == cfg.policy_split_tokens
                      and s.num_extend_seqs == 1 and s.num_pages_per_seq > 0]
        self.programs = SplitExecutables(runner.model_cfg, cfg.attention_backend, shapes,
                                         cfg.split_prefill_layers, runner.placement)

    def plan_parts(self) -> list[PlanPart]:
        flags = ("--enable_split_prefill / --enable_multiplexing: extend buckets"
                 if self.runner.cfg.enable_split_prefill else
                 "the prefill policy's layer intervals (--itl_target_ms=0 drops them): "
                 "one extend bucket")
        return [PlanPart("SPLIT_PREFILL", len(self.names), FORWARD_COST,
                         f"{flags} x interval sizes (even, to 8, and the depth) + embed "
                         "and head")]

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        r = self.runner
        return self.programs.lowerings(params, kv, lambda s: r.abstract_inputs(s)[0],
                                       jnp.dtype(r.cfg.activation_dtype))

    def after_warmup(self) -> None:
        """Time every DECODE bucket and one interval of every split shape once, full of
        tokens that write only the padding page, so the multiplexing policy has costs
        from its first iteration on; serving keeps them current."""
        r = self.runner
        plain = r.paths["plain"]
        for key in r.step_keys():
            if key.mode is ForwardMode.DECODE:
                arrays, slots = r.cost_seed_inputs(key.shape)
                logits = plain.run_forward(key, arrays, slots)
                r.costs.watch(cost_key(key.mode, key.shape), logits)
        for shape in self.programs.shapes:
            arrays, _ = r.cost_seed_inputs(shape)
            split = SplitPrefill(ScheduleBatch(ForwardMode.SPLIT_PREFILL, [], []), shape, arrays,
                                 self.programs.embed(r.params, shape, arrays),
                                 r.model_cfg.num_layers)
            k = self.programs.sizes[0]  # the cheapest compiled interval
            split.hidden, r.kv = self.programs.interval(r.params, r.kv, split, k)
            self._watch_interval(split, k)
        jax.block_until_ready(r.kv)
        release_freed_heap()  # the runs' temporary buffers, as after each compilation

    @property
    def interval_sizes(self) -> list[int]:
        """Layer counts a split-prefill interval may run (compiled at warm-up)."""
        return self.programs.sizes

    def layer_cost(self, split: SplitPrefill) -> float | None:
        """Device seconds one layer of split's intervals takes (None until one ran): the
        measured seconds per unit of layer work of its shape, times its own work."""
        per_work = self.runner.costs.get(cost_key(ForwardMode.SPLIT_PREFILL, split.shape))
        return None if per_work is None else per_work * self.layer_work(split)

    def layer_work(self, split: SplitPrefill) -> float:
        rows = split.batch.extend_rows
        tokens = split.shape.num_extend_tokens
        if rows and self.runner.cfg.cpu_matmul == "packed":  # it skips the padding
            tokens = sum(len(r.input_ids) for r in rows)
        return layer_work(self.runner.model_cfg, tokens, rows)

    def _watch_interval(self, split: SplitPrefill, k: int) -> None:
        """Charge split's shape for k layers' device time, per unit of layer work."""
        self.runner.costs.watch(cost_key(ForwardMode.SPLIT_PREFILL, split.shape),
                                split.hidden, per=k * self.layer_work(split))

    def shape_for(self, batch: ScheduleBatch) -> BucketShape:
        """The split bucket of an extend batch: its EXTEND bucket, or for the prefill
        policy's intervals (compiled for one one-row bucket over a prefix) that bucket at
        the narrowest width that holds the batch's page table: any chunk the policy
        schedules (padding rows cost nothing on the packed CPU matmul)."""
        shape = self.runner.bucket_for(batch)
        tokens = self.runner.cfg.policy_split_tokens
        if self.runner.cfg.enable_split_prefill or not tokens:
            return shape
        wide = [s for s in self.programs.shapes
                if s.num_pages_per_seq >= shape.num_pages_per_seq]
        if not wide:
            return dataclasses.replace(shape, num_extend_tokens=tokens, num_extend_seqs=1)
        return min(wide, key=lambda s: s.num_pages_per_seq)

    def can_split(self, batch: ScheduleBatch) -> bool:
        """Whether batch's split bucket has programs (see split_min_tokens)."""
        return self.shape_for(batch) in self.programs.shapes

    def start_split(self, batch: ScheduleBatch) -> SplitPrefill:
        """Embed an EXTEND batch's tokens; its layers then run interval by interval."""
        r = self.runner
        shape = self.shape_for(batch)
        r.init_slots(batch.extend_rows)
        arrays = pack_rows(batch.extend_rows, [], shape, r.cache_cfg.page_size)
        return SplitPrefill(batch, shape, arrays, self.programs.embed(r.params, shape, arrays),
                            r.model_cfg.num_layers)

    def run_interval(self, split: SplitPrefill, k: int) -> None:
        """Launch the next k layers of `split` (k one of split.sizes, <= its remaining)."""
        r = self.runner
        split.drop_finished_rows()
        split.hidden, r.kv = self.programs.interval(r.params, r.kv, split, k)
        self._watch_interval(split, k)
        split.advance(k)
        r.step_counts[ForwardMode.SPLIT_PREFILL] += 1
        r.check_no_compiles()

    def finish_split(self, split: SplitPrefill) -> PendingStep:
        """Logits and sampling after the last interval."""
        if not split.done:
            raise RuntimeError(f"split prefill at layer {split.next_layer} of "
                               f"{split.num_layers} is not done")
        r, shape = self.runner, split.shape
        logits = self.programs.logits(r.params, split)
        return r.launch_sample(LaunchedForward(split.batch, shape, logits,
                                               padded_rows([split.batch], shape),
                                               row_order([split.batch], shape)))
