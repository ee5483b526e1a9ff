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

Two ways to run an iteration: two calls (a DECODE step, then an interval: no executables
beyond the split-prefill set) or, with --multiplex_fused, one executable in which the
decode rows run all layers and the prefill tokens the interval's layers of the same loop,
sharing those layers' weight reads (runtime/fused_step.py). Which is the default is
decided by measurement (docs/multiplexing.md).
"""

from __future__ import annotations

from typing import Protocol

from runtime.schedule_batch import ScheduleBatch, StepOutput
from runtime.scheduler import ReqEvent, Scheduler
from runtime.split_prefill import SplitPrefill, next_interval


class _Pending(Protocol):
    batch: ScheduleBatch

    def result(self) -> StepOutput: ...


class SplitRunner(Protocol):
    """What the loop needs of a runner (ModelRunner, or a fake in tests)."""

    def launch(self, batch: ScheduleBatch) -> _Pending: ...
    def can_split(self, batch: ScheduleBatch) -> bool: ...
    def start_split(self, batch: ScheduleBatch) -> SplitPrefill: ...
    def run_interval(self, split: SplitPrefill, k: int) -> None: ...
    def finish_split(self, split: SplitPrefill) -> _Pending: ...
    def launch_fused(self, decode: ScheduleBatch, split: SplitPrefill,
                     k: int) -> _Pending | None: ...
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
    without --enable_multiplexing; `fused` runs decode + interval as one executable where
    the runner has one for the shapes (runtime/fused_step.py), else as two calls."""

    def __init__(self, scheduler: Scheduler, runner: SplitRunner, policy: IntervalPolicy,
                 overlap: bool, interleave: bool = True, fused: bool = False) -> None:
        self.scheduler, self.runner, self.policy = scheduler, runner, policy
        self.overlap, self.interleave, self.fused = overlap, interleave, fused
        self.split: SplitPrefill | None = None
        self._pending: list[_Pending] = []
        self.last_intervals: list[tuple[int, int]] = []  # of the latest iteration

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or self.split is not None

    def step(self) -> list[ReqEvent]:
        """One iteration; returns the events of the launches it read back."""
        sched = self.scheduler
        launched: list[_Pending] = []
        if self.split is None:
            batch = sched.next_prefill()
            if batch is not None and self.runner.can_split(batch):
                self.split = self.runner.start_split(batch)
            elif batch is not None:  # too small to be worth splitting: one call
                launched.append(self.runner.launch(batch))
                sched.release_prefill()
        decode = sched.next_decode() if self.interleave or self.split is None else None
        self.last_intervals = []
        launched += self._launch(decode)
        if self.split is not None and self.split.done:
            split, self.split = self.split, None
            launched.append(self.runner.finish_split(split))
            sched.release_prefill()
        if self.overlap:
            ready, self._pending = self._pending, launched
        else:
            ready = launched
        events: list[ReqEvent] = []
        for p in ready:
            events += sched.process_results(p.batch, p.result())
        return events

    def _launch(self, decode: ScheduleBatch | None) -> list[_Pending]:
        """This iteration's decode step and interval(s) of the split in flight."""
        split, sizes = self.split, self.runner.interval_sizes
        if split is None:
            return [self.runner.launch(decode)] if decode is not None else []
        if decode is None:
            while not split.done:  # nothing to interleave with: run it all now
                want = self.policy.fixed or split.remaining
                self._run(split, next_interval(split.remaining, want, sizes))
            return []
        want = self.policy.layers(split.remaining, self.runner.step_cost(decode),
                                  self.runner.layer_cost(split))
        k = next_interval(split.remaining, want, sizes)
        if self.fused:
            start = split.next_layer
            fused = self.runner.launch_fused(decode, split, k)
            if fused is not None:
                self._count(split, start, k)
                return [fused]
        pending = self.runner.launch(decode)
        self._run(split, k)
        return [pending]

    def _run(self, split: SplitPrefill, k: int) -> None:
        self._count(split, split.next_layer, k)
        self.runner.run_interval(split, k)

    def _count(self, split: SplitPrefill, start: int, k: int) -> None:
        self.last_intervals.append((start, k))
        for row in split.batch.extend_rows:
            row.req.prefill_intervals += 1
