"""Execution-path trace: which path every forward step and every request took, and when
the device sat idle (host only, no jax).

The Engine owns an `ExecutionTrace` (`engine.trace`): a bounded ring of `StepRecord`s, one
per launched forward, plus per-request tallies and device bubble accounting. Offline
users and tests read it directly; the server exports it (`GET /debug/execution_trace`,
`/metrics`, `--trace_dir` Perfetto files written by runtime/perfetto.py).

How a loop records (StepLoop in runtime/engine.py, MultiplexLoop in runtime/multiplexing.py):

    t0 = time.perf_counter()
    batch = scheduler.next_batch()                       # host scheduling
    step = launch_traced(trace, runner, batch, t0)       # runtime/traced_launch.py
    ...
    out = read_back(trace, step)     # result(); ready() with whether the host had to wait
    ... process results ...
    trace.processed(step.record, time.perf_counter())
    if nothing is left to run: trace.end_busy_period()   # idle is not a bubble

`ready()` must come in launch order (the device runs launches in order). A launch that is
never read back (a split-prefill interval: its hidden state stays on the device) is
recorded with `est_device_s` (the runner's measured cost); the next readback completes it.

Other paths pass `split=` / `detail=` to `step_record`, or build a `StepRecord(...)`:
- a split-prefill layer interval: `mode="split_prefill"`, `split=SplitInterval(prefill_id,
  interval, start_layer, num_layers, total_layers, decode_step=<step number of the DECODE
  record launched in the same iteration>)`. The prefill's last launch (logits and
  sampling, read back) is a `split_prefill` record without `split`. A fused decode +
  interval executable would be one record with the decode mode, all rows in `rids`, and
  `split.rids` naming the prefill's requests.
- a step whose execution path keeps a record of its own passes it as `detail` (the
  runner's PendingStep.detail): a two-batch-overlap step's `TboSplit(tokens=(a, b),
  rows=(a, b), split_index, two_chunk)`, whose micro-batches the Perfetto file draws in
  their own lane.

Times are `time.perf_counter()` seconds; exports are relative to the trace's creation.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape
from runtime.prefill_policy import PrefillDecision
from runtime.schedule_batch import ScheduleBatch


@dataclasses.dataclass(frozen=True)
class SplitInterval:
    """One layer interval of a split prefill: layers [start_layer, start_layer + num_layers)
    of `total_layers`, the `interval`-th call of prefill `prefill_id`."""

    prefill_id: int | str
    interval: int
    start_layer: int
    num_layers: int
    total_layers: int
    decode_step: int | None = None  # the decode step it was multiplexed with, if any
    rids: tuple[str, ...] | None = None  # the prefill's requests, if not all of the step's


@dataclasses.dataclass(frozen=True)
class TboSplit:
    """A two-batch-overlap step: tokens and rows of micro-batches A and B, the row index
    where B starts, and whether one sequence was cut in two (the two-chunk fallback)."""

    tokens: tuple[int, int]
    rows: tuple[int, int]
    split_index: int
    two_chunk: bool = False


@dataclasses.dataclass
class StepRecord:
    """One launched forward. The loop fills the first block; the trace fills the rest.

    rows / tokens are real; padded_rows / padded_tokens are what the bucket computes, so
    the padding waste is their difference. sched_start..sched_end is host scheduling,
    sched_end..launch_end packing and dispatch.
    """

    mode: str
    bucket: BucketShape | None
    rids: tuple[str, ...]
    extend_rows: int
    decode_rows: int
    extend_tokens: int
    padded_rows: int
    padded_tokens: int
    sched_start: float
    sched_end: float
    launch_end: float
    compiles_after_warmup: int = 0
    split: SplitInterval | None = None
    detail: Any = None  # the launching execution path's own record, e.g. a TboSplit
    # For a launch nobody reads back (a split-prefill interval): the loop's estimate of its
    # device seconds. Its end is then placed by it, and never after the next readback.
    est_device_s: float | None = None
    # Decode steps the launch ran on the device (a multi-step program, mode
    # "multi_decode": runtime/multi_step.py); decode_rows of them each.
    decode_steps: int = 1
    # The prefill policy's decision for the step's extend rows: path, why, and its inputs
    # (runtime/prefill_policy.py); None without the policy or without extend rows.
    decision: PrefillDecision | None = None
    # Filled by ExecutionTrace.
    step: int = -1
    ready: float | None = None  # when the readback returned
    # Whether the host blocked on the readback. False: the device had finished earlier,
    # so `ready` (and this step's device time) is an upper bound. None: never read back
    # (ready estimated from est_device_s).
    waited: bool | None = None
    device_start: float | None = None  # max(launch_end, previous step's ready)
    idle_before: float = 0.0  # device bubble between the previous step and this one
    process_end: float | None = None  # host done with this step's results

    @property
    def rows(self) -> int:
        return self.extend_rows + self.decode_rows

    @property
    def tokens(self) -> int:
        return self.extend_tokens + self.decode_rows

    def to_json(self, t0: float) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("sched_start", "sched_end", "launch_end", "ready", "device_start",
                  "process_end"):
            if d[k] is not None:
                d[k] -= t0
        d["rids"] = list(self.rids)
        d["rows"], d["tokens"] = self.rows, self.tokens
        return d


def step_record(batch: ScheduleBatch, shape: BucketShape | None, sched_start: float,
                sched_end: float, launch_end: float, compiles_after_warmup: int, *,
                split: SplitInterval | None = None, detail: Any = None,
                est_device_s: float | None = None,
                mode: ForwardMode | None = None) -> StepRecord:
    """The record of a batch padded to `shape` (None: unpadded, e.g. a fake runner); a
    split-prefill interval passes its `split`, a path its own `detail`; `mode`: what ran,
    where it is not the batch's mode. A multi-step batch is mode "multi_decode"."""
    ext = batch.extend_rows
    n_ext = sum(len(r.input_ids) for r in ext)
    n_dec = len(batch.decode_rows)
    rows, tokens = len(ext) + n_dec, n_ext + n_dec
    if shape is not None:
        rows = shape.num_extend_seqs + shape.num_decode_seqs
        tokens = shape.num_extend_tokens + shape.num_decode_seqs
    return StepRecord(
        mode="multi_decode" if batch.steps > 1 else (mode or batch.mode).value, bucket=shape,
        rids=tuple(r.req.rid for r in batch.rows),
        extend_rows=len(ext), decode_rows=n_dec, extend_tokens=n_ext,
        padded_rows=rows, padded_tokens=tokens,
        sched_start=sched_start, sched_end=sched_end, launch_end=launch_end,
        compiles_after_warmup=compiles_after_warmup, split=split, detail=detail,
        est_device_s=est_device_s, decode_steps=batch.steps, decision=batch.decision)


def prefill_path(rec: StepRecord) -> str | None:
    """The path a step's extend rows took: the policy's decision, or without one the mode
    the step ran in ("extend", "mixed", "split_prefill" with "(no policy)"); None for a
    step without extend rows."""
    if rec.decision is not None:
        return rec.decision.path
    return f"{rec.mode} (no policy)" if rec.extend_rows else None


@dataclasses.dataclass
class RequestSpan:
    """One request's path: when it arrived, first ran, got its first token and ended, and
    how many steps of each mode it took part in."""

    rid: str
    created: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    steps_by_mode: dict[str, int] = dataclasses.field(default_factory=dict)
    split_prefill_intervals: int = 0
    num_retractions: int = 0
    cached_tokens: int = 0
    # Steps that prefilled this request, by path (prefill_path), and the policy's reason
    # for its last prefill step.
    prefill_paths: dict[str, int] = dataclasses.field(default_factory=dict)
    prefill_reason: str | None = None

    def meta(self) -> dict[str, Any]:
        """The request's meta_info fields (its split-prefill intervals are there already,
        as prefill_intervals, counted by the request itself)."""
        queued = None if self.first_scheduled is None else self.first_scheduled - self.created
        return {"steps_by_mode": dict(self.steps_by_mode), "queue_time": queued,
                "prefill_paths": dict(self.prefill_paths),
                "prefill_reason": self.prefill_reason}

    def to_json(self, t0: float) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("created", "first_scheduled", "first_token", "finished"):
            if d[k] is not None:
                d[k] -= t0
        return d


class _Bubbles:
    """Device busy and idle seconds per mode; idle time is charged to the step the device
    waited for. Gaps across an idle engine (nothing to run) are not bubbles.

    Ready times are when the host read a result back. Where the host did not have to wait
    (`waited` False: a host-bound step under overlap scheduling), the device finished
    earlier by an unknown amount: that step's busy time is overstated and the bubble after
    it missed, so the idle fraction is a lower bound; `host_bound_steps` counts them."""

    def __init__(self) -> None:
        self.busy: collections.Counter[str] = collections.Counter()
        self.idle: collections.Counter[str] = collections.Counter()
        self.host_bound: collections.Counter[str] = collections.Counter()
        self.last_ready: float | None = None

    def observe(self, rec: StepRecord, implicit_by: float | None = None) -> None:
        """Account a finished step. implicit_by: rec was never read back but a later
        launch was, at this time (the device runs launches in order), so rec's end is
        its start plus its estimate, capped there."""
        prev = self.last_ready
        start = rec.launch_end if prev is None else max(rec.launch_end, prev)
        if implicit_by is not None:
            rec.ready = min(implicit_by, start + (rec.est_device_s or 0.0))
        assert rec.ready is not None
        rec.device_start = min(start, rec.ready)
        rec.idle_before = 0.0 if prev is None else max(0.0, rec.launch_end - prev)
        self.busy[rec.mode] += max(0.0, rec.ready - rec.device_start)
        self.idle[rec.mode] += rec.idle_before
        self.host_bound[rec.mode] += rec.waited is False
        self.last_ready = rec.ready if prev is None else max(prev, rec.ready)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for mode in sorted(set(self.busy) | set(self.idle)):
            out[mode] = _fraction(self.busy[mode], self.idle[mode], self.host_bound[mode])
        out["all"] = _fraction(sum(self.busy.values()), sum(self.idle.values()),
                               sum(self.host_bound.values()))
        return out


def _fraction(busy: float, idle: float, host_bound: int) -> dict[str, float]:
    total = busy + idle
    return {"busy_s": busy, "idle_s": idle, "fraction": idle / total if total else 0.0,
            "host_bound_steps": host_bound}


class ExecutionTrace:
    """The last `capacity` steps and finished requests, written by the engine thread and
    read by others (HTTP, metrics). capacity 0 turns recording off; step counts by mode
    are kept either way (they feed /metrics)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 0:
            raise ValueError(f"trace_buffer_steps={capacity} must be >= 0 (0: off)")
        self.capacity = capacity
        self.t0 = time.perf_counter()
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self._finished: collections.deque[RequestSpan] = collections.deque(maxlen=capacity)
        self._live: dict[str, RequestSpan] = {}
        self._bubbles = _Bubbles()
        self._unready: collections.deque[StepRecord] = collections.deque()  # launch order
        self._counts: collections.Counter[str] = collections.Counter()
        self._paths: collections.Counter[str] = collections.Counter()  # prefill steps
        # The prefill policy's start-up inputs (target, measured costs); None: no policy.
        self.policy: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self.num_recorded = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # ---- the loop's side -----------------------------------------------------------------

    def record(self, rec: StepRecord) -> StepRecord:
        """Append a launched step; returns it with its step number set."""
        path = prefill_path(rec)
        with self._lock:
            self._counts[rec.mode] += 1
            if path is not None:
                self._paths[path] += 1
            if not self.enabled:
                return rec
            rec.step = self.num_recorded
            self.num_recorded += 1
            self._steps.append(rec)
            self._unready.append(rec)
            for rid in rec.rids:
                self._tally(rid, rec.mode, rec)
            if path is not None:
                for rid in rec.rids[:rec.extend_rows]:
                    self._tally_prefill(rid, path, rec.decision)
            split = rec.split
            if split is not None and split.rids is not None:
                for rid in split.rids:  # a fused step's prefill rows: their own mode
                    if rid not in rec.rids:
                        self._tally(rid, "split_prefill", rec)
        return rec

    def _tally(self, rid: str, mode: str, rec: StepRecord) -> None:
        span = self._live.get(rid)
        if span is None:
            return
        if span.first_scheduled is None:
            span.first_scheduled = rec.sched_end
        span.steps_by_mode[mode] = span.steps_by_mode.get(mode, 0) + 1
        split = rec.split
        span.split_prefill_intervals += split is not None and (
            split.rids is None or rid in split.rids)

    def _tally_prefill(self, rid: str, path: str, decision: PrefillDecision | None) -> None:
        span = self._live.get(rid)
        if span is not None:
            span.prefill_paths[path] = span.prefill_paths.get(path, 0) + 1
            if decision is not None:
                span.prefill_reason = decision.reason

    def ready(self, rec: StepRecord, t: float, waited: bool | None = None) -> None:
        """The step's results are back on the host (call in launch order)."""
        if not self.enabled:
            return
        with self._lock:
            while self._unready and self._unready[0] is not rec:  # launched before rec
                self._bubbles.observe(self._unready.popleft(), implicit_by=t)
            if self._unready:
                self._unready.popleft()
            rec.ready, rec.waited = t, waited
            self._bubbles.observe(rec)

    def processed(self, rec: StepRecord, t: float) -> None:
        rec.process_end = t

    def end_busy_period(self) -> None:
        """Nothing is left to run: the gap until the next step is idleness, not a bubble."""
        with self._lock:
            while self._unready:  # launches nobody read back: over before we went idle
                self._bubbles.observe(self._unready.popleft(),
                                      implicit_by=time.perf_counter())
            self._bubbles.last_ready = None

    def add_request(self, rid: str, t: float) -> None:
        if self.enabled:
            with self._lock:
                self._live[rid] = RequestSpan(rid, t)

    def finish_request(self, rid: str, t: float, *, first_token: float | None = None,
                       num_retractions: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
        """End a request's span (finished or aborted); returns its meta_info fields."""
        with self._lock:
            span = self._live.pop(rid, None)
            if span is None:
                return {}
            span.finished, span.first_token = t, first_token
            span.num_retractions, span.cached_tokens = num_retractions, cached_tokens
            self._finished.append(span)
        return span.meta()

    # ---- readers -------------------------------------------------------------------------

    def steps(self, n: int | None = None, since: float | None = None) -> list[StepRecord]:
        """The last n records (all when None), optionally only those launched after
        `since` (a perf_counter time). Records may still be completing: copy to read."""
        with self._lock:
            steps = list(self._steps)
        if since is not None:
            steps = [s for s in steps if s.sched_start >= since]
        return steps if n is None else steps[-n:] if n > 0 else []

    def last(self, n: int, after: int = -1) -> list[dict[str, Any]]:
        """The last n records numbered above `after` as JSON (a poller passes the last
        step it saw)."""
        with self._lock:
            recs = [r for r in self._steps if r.step > after] if after >= 0 else self._steps
            recs = list(recs)[-n:] if n > 0 else []
            return [r.to_json(self.t0) for r in recs]

    def requests(self, n: int | None = None, since: float | None = None) -> list[RequestSpan]:
        with self._lock:
            spans = list(self._finished)
        if since is not None:
            spans = [s for s in spans if s.finished is not None and s.finished >= since]
        return spans if n is None else spans[-n:] if n > 0 else []

    def step_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def prefill_paths(self) -> dict[str, int]:
        """Steps with extend rows by the path they took (prefill_path), since start-up."""
        with self._lock:
            return dict(self._paths)

    def bubbles(self) -> dict[str, dict[str, float]]:
        """Per mode and "all": device busy seconds, idle seconds, idle fraction, and the
        steps whose device time is an upper bound (see _Bubbles)."""
        with self._lock:
            return self._bubbles.summary()


def padding_waste(recs: Sequence[StepRecord]) -> dict[str, float]:
    """Share of computed tokens and rows that were bucket padding over `recs`."""
    tok = sum(r.padded_tokens for r in recs)
    rows = sum(r.padded_rows for r in recs)
    return {"tokens": 1 - sum(r.tokens for r in recs) / tok if tok else 0.0,
            "rows": 1 - sum(r.rows for r in recs) / rows if rows else 0.0}


def mode_runs(recs: Sequence[StepRecord]) -> list[tuple[str, int]]:
    """The path as run lengths of modes in launch order, e.g. [("decode", 16),
    ("extend", 6), ("decode", 80)]: multiplexing shows as alternating short runs."""
    runs: list[tuple[str, int]] = []
    for r in recs:
        if runs and runs[-1][0] == r.mode:
            runs[-1] = (r.mode, runs[-1][1] + 1)
        else:
            runs.append((r.mode, 1))
    return runs
