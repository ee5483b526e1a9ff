"""The plain step: one forward executable per (mode, bucket) of the BucketPlan, its logits
sampled by the runner's shared sampler. Every batch no other path claims runs here.

Under data-parallel attention a plain program holds dp ranks' buckets (the dp path packs
them); its mode follows from its bucket (bucket_plan.mode_of), so a prefill handed out
for splitting but run whole takes the EXTEND program without relabelling the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.forward_batch import ForwardBatch
from models.forward_mode import ForwardMode
from models.kv_pool import with_rings
from runtime.batch_builder import (
    BucketShape,
    flatten_inputs,
    input_layout,
    pack_flat,
    padded_rows,
    row_order,
    unflatten_inputs,
)
from runtime.bucket_plan import StepKey, cost_key, key_name, mode_of
from runtime.executable_budget import FORWARD_COST, PlanPart
from runtime.paths.base import ExecPath, LaunchedForward, Lowering
from runtime.schedule_batch import ScheduleBatch


class PlainPath(ExecPath):
    name = "plain"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.keys = runner.step_keys()
        self._exe: dict[StepKey, Callable] = {}

    @property
    def names(self) -> list[str]:
        return [key_name(k) for k in self.keys]

    def plan_parts(self) -> list[PlanPart]:
        c = self.runner.cfg
        n = {m: sum(k.mode is m for k in self.keys) for m in ForwardMode}
        kv = f"{len(c.kv_len_buckets)} kv_len_buckets"
        ext = (f"extend_token_buckets {list(c.extend_token_buckets)} x extend_seq_buckets "
               f"{list(c.extend_seq_buckets)} (--max_extend_seqs) x page-table widths")
        return [
            PlanPart("DECODE", n[ForwardMode.DECODE], FORWARD_COST,
                     f"{len(c.decode_buckets)} decode_buckets (--max_running_requests)"),
            PlanPart("EXTEND", n[ForwardMode.EXTEND], FORWARD_COST, ext),
            PlanPart("MIXED", n[ForwardMode.MIXED], FORWARD_COST,
                     "--enable_mixed_chunk: extend buckets x "
                     f"{len(c.decode_buckets)} decode_buckets x {kv}" if c.enable_mixed else
                     "the decode-first policy (--itl_target_ms): one per chunk bucket "
                     f"{sorted({s[0] for s in c.mixed_shapes})} + one of --max_extend_seqs "
                     "rows"),
        ]

    def sampler_rows(self) -> set[int]:
        dp = self.runner.dp
        return {dp * (k.shape.num_extend_seqs + k.shape.num_decode_seqs) for k in self.keys}

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        for key in self.keys:
            yield key_name(key), functools.partial(
                self._program(key).lower, params, kv, state.last_tokens,
                self.runner.flat_input(key.shape))

    def install(self, compiled: Mapping[str, Callable]) -> None:
        self._exe = {k: compiled[key_name(k)] for k in self.keys}

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape:
        return self.runner.buckets.bucket_for(batch)

    def forward(self, batch: ScheduleBatch) -> LaunchedForward:
        r = self.runner
        shape = r.buckets.bucket_for(batch)
        key = StepKey(mode_of(shape), shape)
        r.init_slots(batch.extend_rows)
        padded = padded_rows([batch], shape)
        row_slots = r.slots_of(padded)[0]
        flat = pack_flat(batch.extend_rows, batch.decode_rows, shape, r.cache_cfg.page_size,
                         row_slots)
        logits = self._run_flat(key, flat)
        r.step_counts[key.mode] += 1
        return LaunchedForward(batch, shape, logits, padded, row_order([batch], shape),
                               cost=cost_key(key.mode, shape))

    def run_forward(self, key: StepKey, arrays: dict[str, np.ndarray],
                    row_slots: np.ndarray) -> jax.Array:
        """Run the step program `key` on packed arrays (pack_rows; dp_pack under dp) and
        the rows' slots: its logits [B, V]; the pool is updated in place."""
        return self._run_flat(key, flatten_inputs(arrays, row_slots,
                                                  input_layout(key.shape, self.runner.dp)))

    def has(self, key: StepKey) -> bool:
        return key in self._exe

    def _run_flat(self, key: StepKey, flat: np.ndarray) -> jax.Array:
        r = self.runner
        logits, r.kv = self._exe[key](r.params, r.kv, r.state.last_tokens, flat)
        return logits

    def _program(self, key: StepKey) -> Callable:
        r = self.runner
        shape = key.shape
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        cfg, backend, dummy = r.model_cfg, r.cfg.attention_backend, r.max_running
        model, mesh, dp = r.model, r.mesh, r.dp
        layout = input_layout(shape, dp)

        def forward(params, kv, last_tokens, flat):
            arrays = unflatten_inputs(flat, layout)  # flat: [sum of the layout's sizes]
            row_slots = arrays.pop("row_slots")  # [B]
            # Decode inputs of -1 are the tokens this slot sampled in the previous step,
            # which the host has not read back yet (overlap scheduling).
            if dp == 1:
                tok_slot = jnp.concatenate([jnp.full(te, dummy, jnp.int32), row_slots[be:]])
            else:  # rank after rank: [extend tokens | decode rows] of each   # [T]
                per_rank = row_slots.reshape(dp, -1)[:, be:]
                tok_slot = jnp.concatenate([jnp.full((dp, te), dummy, jnp.int32), per_rank],
                                           axis=1).reshape(-1)
            ids = jnp.where(arrays["input_ids"] < 0, last_tokens[tok_slot],
                            arrays["input_ids"])
            batch = ForwardBatch(**{**arrays, "input_ids": ids}, mode=key.mode,
                                 num_extend_tokens=te, num_extend_seqs=be)
            batch = with_rings(batch, kv, row_slots)
            return model.forward(params, kv, batch, cfg, backend, mesh=mesh)  # [B, V], pool

        place = r.placement
        return jax.jit(forward, donate_argnums=(1,), **place.out(place.replicated, place.kv))
