"""The ModelRunner's split-prefill half (runtime/split_prefill.py's programs, and the
fused multiplexed step of runtime/fused_step.py): start a split, run its intervals, finish
it, or run an interval inside a decode step; and what the multiplexing policy reads of
their measured costs. A mixin of ModelRunner (runtime/model_runner.py), which owns the
state it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, pack_rows
from runtime.bucket_plan import cost_key
from runtime.executable_budget import release_freed_heap
from runtime.fused_step import FusedExecutables
from runtime.schedule_batch import ScheduleBatch
from runtime.split_prefill import SplitPrefill, layer_work, redirect_finished

if TYPE_CHECKING:
    from runtime.runner_sampling import PendingStep


class SplitLaunch:
    """Split prefill and fused steps of ModelRunner (`self` is the runner)."""

    def _fused_executables(self) -> FusedExecutables:
        if self.split is None:
            raise ValueError("multiplex_fused needs enable_split_prefill")
        width = self.buckets.decode_widths()[-1]
        # Only the largest token bucket, which every chunk of a long prompt but its last
        # fills: the rest run as two calls, and the count stays decode buckets x seq
        # buckets x interval sizes (48 at the default flags, not 96).
        te_max = max(s.num_extend_tokens for s in self.split.shapes)
        pairs = sorted({(s.num_extend_tokens, s.num_extend_seqs) for s in self.split.shapes
                        if s.num_extend_tokens == te_max})
        shapes = [BucketShape(te, be, bd, width) for te, be in pairs
                  for bd in self.cfg.decode_buckets]
        return FusedExecutables(self.model_cfg, self.cfg.attention_backend, shapes,
                                self.split.sizes, self._place)

    def _seed_costs(self) -> None:
        """Time every DECODE bucket and one interval of every split shape once, full of
        tokens that write only the padding page, so the multiplexing policy has costs
        from its first iteration on; serving keeps them current."""
        for key in self.step_keys():
            if key.mode is ForwardMode.DECODE:
                arrays, slots = self._cost_seed_inputs(key.shape)
                logits = self.run_forward(key, arrays, slots)
                self.costs.watch(cost_key(key.mode, key.shape), logits)
        for shape in self.split.shapes:
            arrays, _ = self._cost_seed_inputs(shape)
            split = SplitPrefill(ScheduleBatch(ForwardMode.SPLIT_PREFILL, [], []), shape, arrays,
                                 self.split.embed(self.params, shape, arrays),
                                 self.model_cfg.num_layers)
            k = self.split.sizes[0]  # the cheapest compiled interval
            split.hidden, self.kv = self.split.interval(self.params, self.kv, split, k)
            self._watch_interval(split, k)
        jax.block_until_ready(self.kv)
        release_freed_heap()  # the runs' temporary buffers, as after each compilation

    @property
    def interval_sizes(self) -> list[int]:
        """Layer counts a split-prefill interval may run (compiled at warm-up)."""
        return self.split.sizes if self.split is not None else []

    def layer_cost(self, split: SplitPrefill) -> float | None:
        """Device seconds one layer of split's intervals takes (None until one ran): the
        measured seconds per unit of layer work of its shape, times its own work."""
        per_work = self.costs.get(cost_key(ForwardMode.SPLIT_PREFILL, split.shape))
        return None if per_work is None else per_work * self._layer_work(split)

    def _layer_work(self, split: SplitPrefill) -> float:
        rows = split.batch.extend_rows
        tokens = split.shape.num_extend_tokens
        if rows and self.cfg.cpu_matmul == "packed":  # the packed matmul skips the padding
            tokens = sum(len(r.input_ids) for r in rows)
        return layer_work(self.model_cfg, tokens, rows)

    def _watch_interval(self, split: SplitPrefill, k: int) -> None:
        """Charge split's shape for k layers' device time, per unit of layer work."""
        self.costs.watch(cost_key(ForwardMode.SPLIT_PREFILL, split.shape), split.hidden,
                         per=k * self._layer_work(split))

    def can_split(self, batch: ScheduleBatch) -> bool:
        """Whether batch's extend bucket has split programs (see split_min_tokens)."""
        return self.split is not None and self.bucket_for(batch) in self.split.shapes

    def start_split(self, batch: ScheduleBatch) -> SplitPrefill:
        """Embed an EXTEND batch's tokens; its layers then run interval by interval."""
        if self.split is None:
            raise RuntimeError("split prefill is off (RunnerConfig.enable_split_prefill)")
        shape = self.bucket_for(batch)
        self.init_slots(batch.extend_rows)
        arrays = pack_rows(batch.extend_rows, [], shape, self.cache_cfg.page_size)
        return SplitPrefill(batch, shape, arrays, self.split.embed(self.params, shape, arrays),
                            self.model_cfg.num_layers)

    def run_interval(self, split: SplitPrefill, k: int) -> None:
        """Launch the next k layers of `split` (k one of split.sizes, <= its remaining)."""
        split.drop_finished_rows()
        split.hidden, self.kv = self.split.interval(self.params, self.kv, split, k)
        self._watch_interval(split, k)
        split.advance(k)
        self.step_counts[ForwardMode.SPLIT_PREFILL] += 1
        self.check_no_compiles()

    def finish_split(self, split: SplitPrefill) -> PendingStep:
        """Logits and sampling after the last interval."""
        if not split.done:
            raise RuntimeError(f"split prefill at layer {split.next_layer} of "
                               f"{split.num_layers} is not done")
        return self._sample(split.batch, split.shape, self.split.logits(self.params, split))

    def launch_fused(self, decode: ScheduleBatch, split: SplitPrefill, k: int
                     ) -> PendingStep | None:
        """One fused executable: decode's rows through every layer, split's next k layers
        in the same loop (runtime/fused_step.py). None when no program fits (the caller
        runs the two calls instead)."""
        dec_shape = self.bucket_for(decode)
        ext = split.shape
        shape = BucketShape(ext.num_extend_tokens, ext.num_extend_seqs,
                            dec_shape.num_decode_seqs, dec_shape.num_pages_per_seq)
        if self.fused is None or not self.fused.has(shape, k):
            return None
        mixed = ScheduleBatch(ForwardMode.MIXED, split.batch.extend_rows, decode.decode_rows)
        arrays = pack_rows(mixed.extend_rows, mixed.decode_rows, shape, self.cache_cfg.page_size)
        redirect_finished(arrays, mixed.extend_rows)
        slots = self._row_slots(mixed, shape)[0]
        logits, split.hidden, self.kv = self.fused(
            shape, k, self.params, self.kv, self.state.last_tokens, split.hidden, arrays,
            slots, np.int32(split.next_layer))
        split.advance(k)
        self.step_counts[ForwardMode.SPLIT_PREFILL] += 1
        self.step_counts[ForwardMode.DECODE] += 1
        pending = self._sample(decode, dec_shape, logits)
        # The policy sizes the next interval from the decode step's cost plus the layers':
        # charge the interval what the fused step took beyond the decode step alone.
        self.costs.watch(cost_key(ForwardMode.SPLIT_PREFILL, ext), pending.out.next_tokens,
                         per=k * self._layer_work(split),
                         base=cost_key(ForwardMode.DECODE, dec_shape))
        return pending
