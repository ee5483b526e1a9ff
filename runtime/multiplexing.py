"""Prefill/decode multiplexing: the engine loop that, every iteration, launches one decode
step of the running batch and one layer interval of the split prefill in flight, so a
long prompt never freezes the streams that are already decoding. Host only (no jax):
it calls the scheduler's verbs, the runner's launches and the split-prefill path's
(runtime/paths/split.py), and is tested with a fake.

    iteration:  [split = splitter.start_split(scheduler.next_prefill())]   when none in flight
                decode = runner.launch(scheduler.next_decode())
                splitter.run_interval(split, k)        k from IntervalPolicy
                [splitter.finish_split(split); scheduler.release_prefill()]   after the last
                read back the previous iteration's launches (overlap) or this one's

How many layers an interval runs (IntervalPolicy): a fixed k with --split_prefill_layers
(back to back when nothing decodes); all that remain when nothing decodes; otherwise the
most that keep one iteration (decode step + interval) within the inter-token-latency
target, from the device costs the runner measures while serving (runtime/step_costs.py).
The target is --multiplex_itl_target_ms, or, when 0, --multiplex_decode_slowdown times
the running batch's own decode step: at a slowdown r streams slow down ~r x while a prompt
prefills, and the prefill gets the rest, (r - 1) / r, of the device. The per-layer cost
is measured per unit of layer work (split_prefill.layer_work), so a chunk over a long
prefix is charged its extra attention before its first interval runs.

Whether an iteration decodes at all (IntervalPolicy.prefill_first): a decode step costs
about as much at 4 rows as at 32 where it is weight-bound, so decoding the first streams
of a burst beside every interval adds decode steps that a batch filled first would not
run (the last prompt admitted needs its output length in steps after its prefill either
way). So while the decoding streams are under --multiplex_fill_fraction of the batch they
become once the prompts prefilling and the waiting ones with a free slot join, the prefill
runs first, whole; but the streams never wait more than --multiplex_max_stall_ms. Under
overload the batch is full and a prompt mostly joins it alone, so it is multiplexed; so
are long prompts joining a running batch that is already most of the batch. Off by
default (fill fraction 0): it keeps a burst's throughput but puts the overload ITL p99 at
the stall bound, since a ramp or a batch turning over looks like a burst
(docs/multiplexing.md).

Two ways to run an iteration: two calls (a DECODE step, then an interval: no executables
beyond the split-prefill set) or, with --multiplex_fused, one executable in which the
decode rows run all layers and the prefill tokens the interval's layers of the same loop,
sharing those layers' weight reads (runtime/fused_step.py). Which is the default is
decided by measurement (docs/multiplexing.md).

Every launch goes into the engine's execution trace (runtime/exec_trace.py): decode
steps, each interval with the decode step it shared its iteration with, a fused step as
one decode record carrying its interval, and the prefill's sampling step.
"""

from __future__ import annotations

import time
from typing import Protocol

from models.forward_mode import ForwardMode
from runtime.exec_trace import ExecutionTrace, SplitInterval, step_record
from runtime.schedule_batch import ScheduleBatch
from runtime.scheduler import ReqEvent, Scheduler
from runtime.split_prefill import SplitPrefill, next_interval
from runtime.traced_launch import Pending, TracedRunner, TracedStep, launch_traced, read_back


class CostedRunner(TracedRunner, Protocol):
    """What the loop needs of a runner (ModelRunner, or a fake in tests)."""

    def step_cost(self, batch: ScheduleBatch) -> float | None: ...


class Splitter(Protocol):
    """What the loop needs of the split-prefill path (runtime/paths/split.py, or a fake)."""

    def can_split(self, batch: ScheduleBatch) -> bool: ...
    def start_split(self, batch: ScheduleBatch) -> SplitPrefill: ...
    def run_interval(self, split: SplitPrefill, k: int) -> None: ...
    def finish_split(self, split: SplitPrefill) -> Pending: ...
    def layer_cost(self, split: SplitPrefill) -> float | None: ...
    @property
    def interval_sizes(self) -> list[int]: ...


class Fuser(Protocol):
    """What the loop needs of the fused-step path (runtime/paths/fused.py, or a fake)."""

    def launch_fused(self, decode: ScheduleBatch, split: SplitPrefill,
                     k: int) -> Pending | None: ...


class IntervalPolicy:
    """Layers for the next interval of a split prefill (see the module docstring)."""

    def __init__(self, fixed_layers: int | None, itl_target_s: float,
                 decode_slowdown: float = 3.0, fill_fraction: float = 0.0,
                 max_stall_s: float = 0.0) -> None:
        if decode_slowdown <= 1:
            raise ValueError(f"multiplex_decode_slowdown={decode_slowdown} must be > 1: at 1 "
                             "no layer of a prefill fits beside a decode step")
        if not 0 <= fill_fraction < 1:
            raise ValueError(f"multiplex_fill_fraction={fill_fraction} must be in [0, 1)")
        self.fixed, self.target, self.factor = fixed_layers, itl_target_s, decode_slowdown
        self.fill_fraction, self.max_stall_s = fill_fraction, max_stall_s

    def prefill_first(self, decodable: int, joining: int, stalled_s: float) -> bool:
        """Whether this iteration runs the split prefill without a decode step: while the
        `decodable` streams are under `fill_fraction` of the batch they become once the
        `joining` requests (prefilling, or waiting with a free slot) join, unless they
        have waited `max_stall_s` (0: no bound) since their last decode step."""
        if decodable == 0:
            return True
        if decodable >= self.fill_fraction * (decodable + joining):
            return False
        return not (self.max_stall_s and stalled_s >= self.max_stall_s)

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


class SplitLauncher:
    """Runs a split prefill's intervals and its finishing sampling step into the trace:
    for the MultiplexLoop and for the default loop's layer-interval prefills
    (runtime/engine.py StepLoop)."""

    def __init__(self, runner: CostedRunner, splitter: Splitter,
                 trace: ExecutionTrace) -> None:
        self.runner, self.splitter, self.trace = runner, splitter, trace

    def run(self, split: SplitPrefill, k: int, decode_step: int | None) -> None:
        """Launch split's next k layers; decode_step: the trace's step number of the
        DECODE step that shares the iteration."""
        t0, start, index = time.perf_counter(), split.next_layer, len(split.intervals)
        self.count(split)
        self.splitter.run_interval(split, k)
        # Nobody reads an interval back: the trace places its end by the measured cost.
        per_layer = self.splitter.layer_cost(split)
        self.trace.record(step_record(
            split.batch, split.shape, t0, t0, time.perf_counter(),
            self.runner.compiles_after_warmup,
            split=interval_record(split, start, k, index, decode_step),
            est_device_s=None if per_layer is None else per_layer * k))

    def run_up_to(self, split: SplitPrefill, want: int, decode_step: int | None) -> None:
        """As many compiled intervals as make up `want` layers (the sizes run to 8 and the
        depth: 12 layers is 8 + 4, not 8), at least one."""
        start = split.next_layer
        while not split.done:
            k = next_interval(split.remaining, want, self.splitter.interval_sizes)
            if k > want and split.next_layer != start:
                return
            self.run(split, k, decode_step)
            want -= k

    def run_rest(self, split: SplitPrefill, want: int | None = None) -> None:
        """Nothing to interleave with: the remaining layers back to back, `want` (None:
        all) at a time."""
        while not split.done:
            k = next_interval(split.remaining, want or split.remaining,
                              self.splitter.interval_sizes)
            self.run(split, k, None)

    def finish(self, split: SplitPrefill) -> TracedStep:
        """The prefill's logits and sampling, after its last interval."""
        t0 = time.perf_counter()
        pending = self.splitter.finish_split(split)
        rec = step_record(split.batch, split.shape, t0, t0, time.perf_counter(),
                          self.runner.compiles_after_warmup)
        return TracedStep(pending, self.trace.record(rec))

    @staticmethod
    def count(split: SplitPrefill) -> None:
        for row in split.batch.extend_rows:
            row.req.prefill_intervals += 1


def interval_record(split: SplitPrefill, start: int, k: int, index: int,
                    decode_step: int | None, rids: tuple[str, ...] | None = None
                    ) -> SplitInterval:
    """The trace's record of split's interval `index`: layers [start, start + k)."""
    return SplitInterval(prefill_id=split.batch.extend_rows[0].req.rid, interval=index,
                         start_layer=start, num_layers=k, total_layers=split.num_layers,
                         decode_step=decode_step, rids=rids)


class MultiplexLoop:
    """The engine loop with split prefill; `interleave=False` runs each split prefill to
    its end before decoding (prefill priority, as the plain loop), for --enable_split_prefill
    without --enable_multiplexing. `splitter` runs the split prefill's intervals; `fused`,
    if given, runs decode + interval as one executable where it has one for the shapes
    (runtime/fused_step.py), else they run as two calls."""

    def __init__(self, scheduler: Scheduler, runner: CostedRunner, splitter: Splitter,
                 policy: IntervalPolicy, overlap: bool, interleave: bool = True,
                 fused: Fuser | None = None, trace: ExecutionTrace | None = None) -> None:
        self.scheduler, self.runner, self.splitter, self.policy = (scheduler, runner,
                                                                   splitter, policy)
        self.overlap, self.interleave, self.fused = overlap, interleave, fused
        self.launcher = SplitLauncher(runner, splitter,
                                      trace if trace is not None else ExecutionTrace(0))
        self.split: SplitPrefill | None = None
        self._pending: list[TracedStep] = []
        self._last_decode = time.perf_counter()  # when a decode step last launched

    @property
    def trace(self) -> ExecutionTrace:
        return self.launcher.trace

    @trace.setter
    def trace(self, trace: ExecutionTrace) -> None:
        self.launcher.trace = trace

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or self.split is not None

    def step(self) -> list[ReqEvent]:
        """One iteration; returns the events of the launches it read back."""
        sched = self.scheduler
        t0 = time.perf_counter()
        launched: list[TracedStep] = []
        if self.split is None:
            batch = sched.next_prefill()
            if batch is not None and self.splitter.can_split(batch):
                self.split = self.splitter.start_split(batch)
            elif batch is not None:  # too small to be worth splitting: one EXTEND step
                launched.append(launch_traced(self.trace, self.runner, batch, t0,
                                              mode=ForwardMode.EXTEND))
                sched.release_prefill()
                t0 = time.perf_counter()
        decode = None
        if self.split is None or (self.interleave and not self._prefill_first(t0)):
            decode = sched.next_decode()
        events: list[ReqEvent] = []
        if decode is not None:
            self._last_decode = t0
            if any(r.req.grammar is not None for r in decode.rows):
                # Its rows' grammar masks need the tokens still in flight: read them first.
                events = self._process(self._pending + launched)
                self._pending, launched = [], []
        launched += self._launch(decode, t0)
        if self.split is not None and self.split.done:
            split, self.split = self.split, None
            launched.append(self.launcher.finish(split))
            sched.release_prefill()
        if self.overlap:
            ready, self._pending = self._pending, launched
        else:
            ready = launched
        return events + self._process(ready)

    def _process(self, launched: list[TracedStep]) -> list[ReqEvent]:
        """Read back `launched` in launch order and apply their tokens."""
        events: list[ReqEvent] = []
        for p in launched:
            events += self.scheduler.process_results(p.pending.batch, read_back(self.trace, p))
            self.trace.processed(p.record, time.perf_counter())
        return events

    def _prefill_first(self, now: float) -> bool:
        """The policy's prefill_first for the scheduler's batch now; a batch that had
        nothing to decode starts its stall clock now."""
        decodable, joining = self.scheduler.batch_growth()
        if decodable == 0:
            self._last_decode = now
        return self.policy.prefill_first(decodable, joining, now - self._last_decode)

    def _launch(self, decode: ScheduleBatch | None, t0: float) -> list[TracedStep]:
        """This iteration's decode step and interval(s) of the split in flight; t0: when
        its scheduling began."""
        split, sizes = self.split, self.splitter.interval_sizes
        if split is None:
            return [launch_traced(self.trace, self.runner, decode, t0)] if decode else []
        if decode is None:  # nothing to interleave with: run it all now
            self.launcher.run_rest(split, self.policy.fixed)
            return []
        want = self.policy.layers(split.remaining, self.runner.step_cost(decode),
                                  self.splitter.layer_cost(split))
        k = next_interval(split.remaining, want, sizes)
        if self.fused is not None:
            fused = self._launch_fused(decode, self.fused, split, k, t0)
            if fused is not None:
                return [fused]
        pending = launch_traced(self.trace, self.runner, decode, t0)
        self.launcher.run(split, k, pending.record.step)
        return [pending]

    def _launch_fused(self, decode: ScheduleBatch, fuser: Fuser, split: SplitPrefill, k: int,
                      t0: float) -> TracedStep | None:
        """The fused executable, recorded as one decode step carrying the interval."""
        start, index, sched_end = split.next_layer, len(split.intervals), time.perf_counter()
        fused = fuser.launch_fused(decode, split, k)
        if fused is None:
            return None
        self.launcher.count(split)
        interval = interval_record(split, start, k, index, None,
                                   rids=tuple(r.req.rid for r in split.batch.extend_rows))
        rec = step_record(decode, self.runner.bucket_for(decode), t0, sched_end,
                          time.perf_counter(), self.runner.compiles_after_warmup,
                          split=interval)
        return TracedStep(fused, self.trace.record(rec))
