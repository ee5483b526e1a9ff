"""Launching and reading back a step with its execution-trace record (host only, no jax):
the calls both engine loops (runtime/engine.py StepLoop, runtime/multiplexing.py) share."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape
from runtime.exec_trace import ExecutionTrace, StepRecord, step_record
from runtime.schedule_batch import ScheduleBatch, StepOutput


class Pending(Protocol):
    """A launched step (the runner's PendingStep, or a fake)."""

    batch: ScheduleBatch

    def is_ready(self) -> bool: ...
    def result(self) -> StepOutput: ...


class TracedRunner(Protocol):
    """What `launch_traced` needs of a runner."""

    @property
    def compiles_after_warmup(self) -> int: ...
    def launch(self, batch: ScheduleBatch) -> Pending: ...
    def bucket_for(self, batch: ScheduleBatch) -> BucketShape | None: ...


@dataclasses.dataclass
class TracedStep:
    """A launched step and its record."""

    pending: Pending
    record: StepRecord


def launch_traced(trace: ExecutionTrace, runner: TracedRunner, batch: ScheduleBatch,
                  sched_start: float) -> TracedStep:
    """runner.launch(batch), recorded (scheduling ran from sched_start until now)."""
    sched_end = time.perf_counter()
    pending = runner.launch(batch)
    # A two-batch-overlap step (the runner's PendingStep.tbo) computed both micro-batches
    # at its own padded shape; a fake runner's pending has neither attribute.
    shape = getattr(pending, "padded_shape", None) or runner.bucket_for(batch)
    # A split-prefill batch too small to split runs whole, as an EXTEND step
    # (ModelRunner.launch): count it as one, not as a layer interval of a split prefill.
    ran = ForwardMode.EXTEND if batch.mode is ForwardMode.SPLIT_PREFILL else None
    rec = step_record(batch, shape, sched_start, sched_end, time.perf_counter(),
                      runner.compiles_after_warmup, tbo=getattr(pending, "tbo", None),
                      mode=ran)
    return TracedStep(pending, trace.record(rec))


def read_back(trace: ExecutionTrace, step: TracedStep) -> StepOutput:
    """step's results, its ready time recorded. Whether the host had to wait here tells a
    device-bound step from a host-bound one."""
    waited = not step.pending.is_ready()
    out = step.pending.result()
    trace.ready(step.record, time.perf_counter(), waited)
    return out
