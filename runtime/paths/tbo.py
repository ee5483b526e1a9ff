"""Two-batch overlap as a path: a batch that two_batch_overlap.split_batch splits runs as
two micro-batches in one TBO program of their common bucket (runtime/tbo_step.py); its
merged logits go to the shared sampler. A batch it does not split (too few tokens, or no
program for its children's bucket) is left to the next path."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from models.config import ModelConfig
from models.forward_mode import ForwardMode
from runtime import two_batch_overlap
from runtime.batch_builder import BucketShape, pack_rows, padded_rows
from runtime.bucket_plan import StepKey
from runtime.config import RunnerConfig
from runtime.exec_trace import TboSplit
from runtime.executable_budget import FORWARD_COST, PlanPart
from runtime.paths.base import ExecPath, LaunchedForward, Lowering
from runtime.schedule_batch import ScheduleBatch
from runtime.tbo_step import TboExecutables, compiler_options

logger = logging.getLogger(__name__)


class TboPath(ExecPath):
    name = "tbo"

    def __init__(self, runner: Any) -> None:
        """TBO programs for the buckets a split child can need: the children of a batch of
        at least tbo_min_tokens tokens hold at least half of them each (the larger one)."""
        super().__init__(runner)
        r, cfg = runner, runner.cfg
        modes = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED)
        keys = [k for k in r.step_keys() if k.mode in modes and 2 * (
            k.shape.num_extend_tokens + k.shape.num_decode_seqs) >= cfg.tbo_min_tokens]
        options = compiler_options(jax.default_backend())
        if options:
            logger.info("two-batch overlap: %d executables compiled with %s", len(keys),
                        options)
        self.programs = TboExecutables(r.model_cfg, cfg.attention_backend, r.mesh, keys,
                                       r.max_running,
                                       r.placement.out(r.placement.replicated, r.placement.kv),
                                       options)

    def plan_parts(self) -> list[PlanPart]:
        return [PlanPart("TBO", len(self.names), FORWARD_COST,
                         "--enable_two_batch_overlap: one per DECODE / EXTEND / MIXED bucket "
                         "of at least tbo_min_tokens / 2 tokens")]

    def sampler_rows(self) -> set[int]:
        return {self.programs.rows(k) for k in self.programs.keys}

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        r = self.runner
        return self.programs.lowerings(params, kv, state.last_tokens, r.abstract_inputs,
                                       r.placement.i32)

    def forward(self, batch: ScheduleBatch) -> LaunchedForward | None:
        r, tbo = self.runner, self.programs
        split = two_batch_overlap.split_batch(batch, r.cfg.tbo_token_distribution_threshold,
                                              r.cfg.tbo_min_tokens)
        if split is None:
            return None
        shape = two_batch_overlap.common_shape(split, r.bucket_for)
        key = StepKey(batch.mode, shape)
        if not tbo.has(key):
            return None
        r.init_slots(batch.extend_rows)
        children = (split.a, split.b)
        arrays = [pack_rows(c.extend_rows, c.decode_rows, shape, r.cache_cfg.page_size)
                  for c in children]
        slots = [r.slots_of(padded_rows([c], shape))[0] for c in children]
        order = np.asarray(split.merge_order(shape), np.int32)
        logits, r.kv = tbo(key, r.params, r.kv, r.state.last_tokens, *arrays, *slots, order)
        r.step_counts[batch.mode] += 1
        padded = [*batch.rows, *[None] * (tbo.rows(key) - len(batch.rows))]
        both = BucketShape(*(2 * getattr(shape, f) for f in (
            "num_extend_tokens", "num_extend_seqs", "num_decode_seqs")),
            shape.num_pages_per_seq)
        return LaunchedForward(
            batch, both, logits, padded, np.arange(len(batch.rows)),
            cost=tbo.names[tbo.keys.index(key)],
            detail=TboSplit(split.tokens(), split.rows(), split.point.seq_index,
                            split.point.two_chunk))


def check_tbo(model_cfg: ModelConfig, cfg: RunnerConfig, mesh: Any) -> None:
    """What two-batch overlap needs, as a start-up error."""
    if not model_cfg.is_moe:
        raise ValueError("enable_two_batch_overlap is for MoE models (it overlaps the expert-"
                         f"parallel all_to_all); {model_cfg.architecture} is dense")
    if cfg.per_layer_weights:
        raise ValueError("enable_two_batch_overlap runs the stacked layer weights: "
                         "per_layer_weights=False")
    if mesh is not None and mesh.shape.get("tp", 1) > 1:
        raise ValueError("enable_two_batch_overlap runs on an ep mesh without tp (tp="
                         f"{mesh.shape['tp']})")
