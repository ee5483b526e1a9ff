"""The fused multiplexed step as a path (runtime/fused_step.py's programs): a decode
step and the next interval of a split prefill in one executable. The multiplexing loop
calls launch_fused on this path; it claims no batch through the runner's launch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, pack_rows, padded_rows, row_order
from runtime.bucket_plan import cost_key
from runtime.executable_budget import FORWARD_COST, PlanPart
from runtime.fused_step import FusedExecutables
from runtime.paths.base import ExecPath, LaunchedForward, Lowering
from runtime.paths.split import SplitPath
from runtime.runner_sampling import PendingStep
from runtime.schedule_batch import ScheduleBatch
from runtime.split_prefill import SplitPrefill, redirect_finished


class FusedPath(ExecPath):
    name = "fused"

    def __init__(self, runner: Any, split: SplitPath | None) -> None:
        super().__init__(runner)
        if split is None:
            raise ValueError("multiplex_fused needs enable_split_prefill")
        self.split = split
        shapes = split.programs.shapes
        width = runner.buckets.decode_widths()[-1]
        # Only the largest token bucket, which every chunk of a long prompt but its last
        # fills: the rest run as two calls, and the count stays decode buckets x seq
        # buckets x interval sizes (48 at the default flags, not 96).
        te_max = max(s.num_extend_tokens for s in shapes)
        pairs = sorted({(s.num_extend_tokens, s.num_extend_seqs) for s in shapes
                        if s.num_extend_tokens == te_max})
        fused = [BucketShape(te, be, bd, width) for te, be in pairs
                 for bd in runner.cfg.decode_buckets]
        self.programs = FusedExecutables(runner.model_cfg, runner.cfg.attention_backend,
                                         fused, split.programs.sizes, runner.placement)

    def plan_parts(self) -> list[PlanPart]:
        return [PlanPart("FUSED", len(self.names), FORWARD_COST,
                         "--multiplex_fused: extend buckets x decode_buckets x interval sizes")]

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        r = self.runner
        return self.programs.lowerings(params, kv, state.last_tokens,
                                       lambda s: r.abstract_inputs(s)[0],
                                       jnp.dtype(r.cfg.activation_dtype))

    def launch_fused(self, decode: ScheduleBatch, split: SplitPrefill, k: int
                     ) -> PendingStep | None:
        """One fused executable: decode's rows through every layer, split's next k layers
        in the same loop. None when no program fits (the caller runs the two calls)."""
        r = self.runner
        dec_shape = r.bucket_for(decode)
        ext = split.shape
        shape = BucketShape(ext.num_extend_tokens, ext.num_extend_seqs,
                            dec_shape.num_decode_seqs, dec_shape.num_pages_per_seq)
        if not self.programs.has(shape, k):
            return None
        mixed = ScheduleBatch(ForwardMode.MIXED, split.batch.extend_rows, decode.decode_rows)
        arrays = pack_rows(mixed.extend_rows, mixed.decode_rows, shape, r.cache_cfg.page_size)
        redirect_finished(arrays, mixed.extend_rows)
        slots = r.slots_of(padded_rows([mixed], shape))[0]
        logits, split.hidden, r.kv = self.programs(
            shape, k, r.params, r.kv, r.state.last_tokens, split.hidden, arrays, slots,
            np.int32(split.next_layer))
        split.advance(k)
        r.step_counts[ForwardMode.SPLIT_PREFILL] += 1
        r.step_counts[ForwardMode.DECODE] += 1
        pending = r.launch_sample(LaunchedForward(decode, dec_shape, logits,
                                                  padded_rows([decode], dec_shape),
                                                  row_order([decode], dec_shape)))
        # The policy sizes the next interval from the decode step's cost plus the layers':
        # charge the interval what the fused step took beyond the decode step alone.
        r.costs.watch(cost_key(ForwardMode.SPLIT_PREFILL, ext), pending.out.next_tokens,
                      per=k * self.split.layer_work(split),
                      base=cost_key(ForwardMode.DECODE, dec_shape))
        return pending
