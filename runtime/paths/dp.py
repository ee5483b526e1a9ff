"""The data-parallel attention step (runtime/dp_attention.py): a DPBatch holds every
rank's batch; it runs in the plain step program of one per-rank bucket, dp ranks long,
and its logits go to the shared sampler rank after rank."""

from __future__ import annotations

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, padded_rows, row_order
from runtime.bucket_plan import StepKey, cost_key, mode_of
from runtime.config import CacheConfig, RunnerConfig
from runtime.dp_attention import DPBatch, dp_pack, dp_padded_shape, dp_shape
from runtime.paths.base import ExecPath, LaunchedForward
from runtime.schedule_batch import ScheduleBatch


class DPPath(ExecPath):
    name = "dp"

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape | None:
        if not isinstance(batch, DPBatch):
            return None
        buckets = self.runner.buckets
        return dp_shape(batch, buckets.bucket_for, buckets.decode_widths()[-1])

    def forward(self, batch: ScheduleBatch) -> LaunchedForward | None:
        shape = self.bucket_for(batch)
        if shape is None:
            return None
        assert isinstance(batch, DPBatch)
        r = self.runner
        key = StepKey(mode_of(shape), shape)
        r.init_slots(batch.extend_rows)
        padded = padded_rows(batch.parts, shape)
        logits = r.paths["plain"].run_forward(
            key, dp_pack(batch, shape, r.cache_cfg.page_size), r.slots_of(padded)[0])
        r.step_counts[ForwardMode.IDLE] += batch.num_idle
        r.step_counts[key.mode] += 1
        # Rows come back in padded order, rank after rank; the trace shows the whole step.
        return LaunchedForward(batch, dp_padded_shape(shape, r.dp), logits, padded,
                               row_order(batch.parts, shape), cost=cost_key(key.mode, shape))


def check_dp(dp: int, cfg: RunnerConfig, cache: CacheConfig) -> None:
    """What data-parallel attention does not run with, as a start-up error."""
    if cache.num_pages % dp:
        raise ValueError(f"dp={dp}: the KV pool's {cache.num_pages} pages must split "
                         "evenly over the data-parallel ranks")
    off = [flag for flag, on in (("enable_split_prefill / multiplexing",
                                  cfg.enable_split_prefill),
                                 ("multiplex_fused", cfg.multiplex_fused),
                                 ("enable_two_batch_overlap", cfg.enable_two_batch_overlap),
                                 ("num_scheduler_steps > 1", cfg.num_scheduler_steps > 1))
           if on]
    if off:
        raise ValueError(f"dp={dp} (data-parallel attention) does not run with "
                         f"{', '.join(off)} yet")
    if not cfg.enable_mixed:
        raise ValueError(f"dp={dp}: a step may hold one rank's prefill and another's "
                         "decode rows, so the runner needs the MIXED buckets "
                         "(enable_mixed)")
