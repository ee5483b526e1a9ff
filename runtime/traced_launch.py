"""Launching and reading back a step with its execution-trace record (host only, no jax):
the calls both engine loops (runtime/engine.py StepLoop, runtime/multiplexing.py) share."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape
from runtime.exec_trace import ExecutionTrace, StepRecord, step_record
from runtime.schedule_batch import ScheduleBatch, StepOutput


class Pending(Protocol):
    """A launched step (the runner's PendingStep, or a fake)."""

    batch: ScheduleBatch
    shape: BucketShape | None  # the padded step it computed; None: the batch's bucket
    detail: Any  # the launching path's own trace record (StepRecord.detail)

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
                  sched_start: float, mode: ForwardMode | None = None) -> TracedStep:
    """runner.launch(batch), recorded (scheduling ran from sched_start until now); `mode`:
    what ran, where it is not the batch's mode."""
    sched_end = time.perf_counter()
    pending = runner.launch(batch)
    shape = pending.shape or runner.bucket_for(batch)
    rec = step_record(batch, shape, sched_start, sched_end, time.perf_counter(),
                      runner.compiles_after_warmup, detail=pending.detail, mode=mode)
    return TracedStep(pending, trace.record(rec))


def read_back(trace: ExecutionTrace, step: TracedStep) -> StepOutput:
    """step's results, its ready time recorded. Whether the host had to wait here tells a
    device-bound step from a host-bound one."""
    waited = not step.pending.is_ready()
    out = step.pending.result()
    trace.ready(step.record, time.perf_counter(), waited)
    return out
