"""Prefill/decode multiplexing: the engine loop that, every iteration, launches one decode
step of the running batch and one layer interval of the split prefill in flight, so a
long prompt never freezes the streams that are already decoding. Host only (no jax):
it calls the scheduler's verbs and the runner's launches, and is tested with a fake.

    iteration:  [split = runner.start_split(scheduler.next_prefill())]   when none in flight
                decode = runner.launch(scheduler.next_decode())
                runner.run_interval(split, k)          k from IntervalPolicy
                [runner.finish_split(split); scheduler.release_prefill()]   after the last
                read back the previous iteration's launches (overlap) or this one's

How many layers an interval runs (IntervalPolicy): a fixed k with --split_prefill_layers
(back to back when nothing decodes); all that remain when nothing decodes; otherwise the
most that keep one iteration (decode step + interval) within the inter-token-latency
target, from the device costs the runner measures while serving (runtime/step_costs.py).
The target is --multiplex_itl_target_ms, or, when 0, twice the running batch's own
decode step: streams slow down at most ~2x while a prompt prefills, and the prefill gets
the rest of the device.

Why two calls and not one fused executable: on this CPU the decode step and the interval
both saturate the cores, so fusing them saves only the decode rows' weight reads for k
layers; the two-call loop needs no executables beyond the split-prefill set. The fused
variant (decode rows through all layers, the prefill tokens through [s, s + k) of the
same loop) is not built yet; which one wins on a GPU is part of the GPU suite.
"""

from __future__ import annotations

import time
from typing import Protocol

from runtime.exec_trace import ExecutionTrace, SplitInterval, step_record
from runtime.schedule_batch import ScheduleBatch
from runtime.scheduler import ReqEvent, Scheduler
from runtime.split_prefill import SplitPrefill, next_interval
from runtime.traced_launch import Pending, TracedRunner, TracedStep, launch_traced, read_back


class SplitRunner(TracedRunner, Protocol):
    """What the loop needs of a runner (ModelRunner, or a fake in tests)."""

    def start_split(self, batch: ScheduleBatch) -> SplitPrefill: ...
    def run_interval(self, split: SplitPrefill, k: int) -> None: ...
    def finish_split(self, split: SplitPrefill) -> Pending: ...
    def step_cost(self, batch: ScheduleBatch) -> float | None: ...
    def layer_cost(self, split: SplitPrefill) -> float | None: ...
    @property
    def interval_sizes(self) -> list[int]: ...


class IntervalPolicy:
    """Layers for the next interval of a split prefill (see the module docstring)."""

    def __init__(self, fixed_layers: int | None, itl_target_s: float,
                 decode_factor: float = 2.0) -> None:
        self.fixed, self.target, self.factor = fixed_layers, itl_target_s, decode_factor

    def layers(self, remaining: int, decode_cost: float | None,
               layer_cost: float | None) -> int:
        """How many of `remaining` layers to run while a decode step of `decode_cost`
        seconds shares the iteration (None: not measured yet)."""
        if self.fixed is not None:
            return min(self.fixed, remaining)
        if decode_cost is None or layer_cost is None or layer_cost <= 0:
            return 1  # measure first: one layer is the cheapest probe
        target = self.target or self.factor * decode_cost
        return max(1, min(remaining, int((target - decode_cost) / layer_cost)))


class MultiplexLoop:
    """The engine loop with split prefill; `interleave=False` runs each split prefill to
    its end before decoding (prefill priority, as the plain loop), for --enable_split_prefill
    without --enable_multiplexing. Every launch goes into `trace` (runtime/exec_trace.py):
    decode steps, each interval (with the decode step it shared the iteration with) and
    the prefill's sampling step."""

    def __init__(self, scheduler: Scheduler, runner: SplitRunner, policy: IntervalPolicy,
                 overlap: bool, interleave: bool = True,
                 trace: ExecutionTrace | None = None) -> None:
        self.scheduler, self.runner, self.policy = scheduler, runner, policy
        self.overlap, self.interleave = overlap, interleave
        self.trace = trace if trace is not None else ExecutionTrace(capacity=0)
        self.split: SplitPrefill | None = None
        self._pending: list[TracedStep] = []
        self.last_intervals: list[tuple[int, int]] = []  # of the latest iteration

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or self.split is not None

    def step(self) -> list[ReqEvent]:
        """One iteration; returns the events of the launches it read back."""
        sched = self.scheduler
        t0 = time.perf_counter()
        if self.split is None:
            batch = sched.next_prefill()
            if batch is not None:
                self.split = self.runner.start_split(batch)
        launched: list[TracedStep] = []
        decode = sched.next_decode() if self.interleave or self.split is None else None
        if decode is not None:
            launched.append(launch_traced(self.trace, self.runner, decode, t0))
        self.last_intervals = []
        if self.split is not None:
            done = self._advance(decode, launched[0].record.step if launched else None)
            if done is not None:
                launched.append(done)
        if self.overlap:
            ready, self._pending = self._pending, launched
        else:
            ready = launched
        events: list[ReqEvent] = []
        for p in ready:
            events += sched.process_results(p.pending.batch, read_back(self.trace, p))
            self.trace.processed(p.record, time.perf_counter())
        return events

    def _advance(self, decode: ScheduleBatch | None, decode_step: int | None
                 ) -> TracedStep | None:
        """Run this iteration's interval(s) of the split in flight; when its last layer is
        launched, sample it and release its requests to decode."""
        split, sizes = self.split, self.runner.interval_sizes
        assert split is not None
        if decode is None:
            while not split.done:  # nothing to interleave with: run it all now
                want = self.policy.fixed or split.remaining
                self._run(split, next_interval(split.remaining, want, sizes), None)
        else:
            want = self.policy.layers(split.remaining, self.runner.step_cost(decode),
                                      self.runner.layer_cost(split))
            self._run(split, next_interval(split.remaining, want, sizes), decode_step)
        if not split.done:
            return None
        self.split = None
        t0 = time.perf_counter()
        pending = self.runner.finish_split(split)
        rec = step_record(split.batch, split.shape, t0, t0, time.perf_counter(),
                          self.runner.compiles_after_warmup)
        self.scheduler.release_prefill()
        return TracedStep(pending, self.trace.record(rec))

    def _run(self, split: SplitPrefill, k: int, decode_step: int | None) -> None:
        t0, start, index = time.perf_counter(), split.next_layer, len(split.intervals)
        self.last_intervals.append((start, k))
        for row in split.batch.extend_rows:
            row.req.prefill_intervals += 1
        self.runner.run_interval(split, k)
        # Nobody reads an interval back: the trace places its end by the measured cost.
        per_layer = self.runner.layer_cost(split)
        interval = SplitInterval(prefill_id=split.batch.extend_rows[0].req.rid,
                                 interval=index, start_layer=start, num_layers=k,
                                 total_layers=split.num_layers, decode_step=decode_step)
        self.trace.record(step_record(
            split.batch, split.shape, t0, t0, time.perf_counter(),
            self.runner.compiles_after_warmup, split=interval,
            est_device_s=None if per_layer is None else per_layer * k))
