"""Chrome trace / Perfetto JSON of an execution trace (host only, no jax).

The file opens in ui.perfetto.dev (or chrome://tracing). Complete events (`ph: "X"`,
microseconds) in four processes, each lane a thread:
  host           scheduling, launch (packing + dispatch), results (readback to processed)
  device         one lane per forward mode: each step from its device start to its ready
                 time, and a "bubbles" lane with the idle gaps the device waited on the host
  micro-batches  TBO steps: micro-batches A and B. XLA reports no per-micro-batch times,
                 so the step's device time is drawn split by token share (args say so).
  requests       per-request spans: queued, prefill (to the first token), decode; requests
                 share lanes when their spans do not overlap.
A counter track ("batch": rows, tokens, padded tokens of each step) sits on the device.
Split-prefill intervals are device steps named by their layer range, with the interval's
prefill id and the decode step it was multiplexed with in args.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from runtime.exec_trace import ExecutionTrace, RequestSpan, StepRecord, TboSplit

HOST, DEVICE, MICRO, REQUESTS = 1, 2, 3, 4
_HOST_LANES = {"scheduling": 1, "launch": 2, "results": 3}
_MODE_LANES = {"extend": 1, "decode": 2, "mixed": 3, "split_prefill": 4, "idle": 5,
               "multi_decode": 6, "target_verify": 7, "draft_extend": 10, "draft_decode": 11}
_BUBBLE_LANE = 9


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _slice(name: str, pid: int, tid: int, start: float, end: float, t0: float,
           **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start, t0),
            "dur": max(0.0, round((end - start) * 1e6, 3)), "args": args}


def _meta(pid: int, tid: int | None, name: str) -> dict[str, Any]:
    if tid is None:
        return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _step_name(r: StepRecord) -> str:
    if r.split is not None:
        s = r.split
        return f"{r.mode} L{s.start_layer}-{s.start_layer + s.num_layers}"
    steps = f" x{r.decode_steps}" if r.decode_steps > 1 else ""
    return f"{r.mode} {r.rows}r/{r.tokens}t{steps}"


def _step_events(r: StepRecord, t0: float) -> Iterable[dict[str, Any]]:
    yield _slice("schedule", HOST, 1, r.sched_start, r.sched_end, t0, step=r.step)
    yield _slice("launch", HOST, 2, r.sched_end, r.launch_end, t0, step=r.step)
    if r.ready is None or r.device_start is None:
        return  # still in flight
    if r.process_end is not None:
        yield _slice("results", HOST, 3, r.ready, r.process_end, t0, step=r.step)
    args: dict[str, Any] = {
        "step": r.step, "rows": r.rows, "tokens": r.tokens, "padded_rows": r.padded_rows,
        "padded_tokens": r.padded_tokens, "waited": r.waited,
        "compiles_after_warmup": r.compiles_after_warmup}
    if r.split is not None:
        args.update(prefill_id=r.split.prefill_id, interval=r.split.interval,
                    decode_step=r.split.decode_step)
    lane = _MODE_LANES.get(r.mode, 8)
    yield _slice(_step_name(r), DEVICE, lane, r.device_start, r.ready, t0, **args)
    # Counter tracks: the batch over time, real and padded.
    yield {"name": "batch", "ph": "C", "pid": DEVICE, "tid": 0, "ts": _us(r.device_start, t0),
           "args": {"rows": r.rows, "tokens": r.tokens, "padded_tokens": r.padded_tokens}}
    if r.idle_before > 0:
        yield _slice("bubble", DEVICE, _BUBBLE_LANE, r.device_start - r.idle_before,
                     r.device_start, t0, step=r.step, mode=r.mode)
    if isinstance(r.detail, TboSplit):
        yield from _micro_batches(r, r.detail, t0)


def _micro_batches(r: StepRecord, tbo: TboSplit, t0: float) -> Iterable[dict[str, Any]]:
    assert r.ready is not None and r.device_start is not None
    a, b = tbo.tokens
    cut = r.device_start + (r.ready - r.device_start) * (a / (a + b) if a + b else 0.5)
    common = dict(step=r.step, split_index=tbo.split_index, two_chunk=tbo.two_chunk,
                  timing="device time split by token share, not measured")
    yield _slice(f"A {tbo.rows[0]}r/{a}t", MICRO, 1, r.device_start, cut, t0, **common)
    yield _slice(f"B {tbo.rows[1]}r/{b}t", MICRO, 2, cut, r.ready, t0, **common)


def _request_events(spans: Sequence[RequestSpan], t0: float) -> list[dict[str, Any]]:
    """Queued / prefill / decode slices, packed greedily into as few lanes as fit."""
    events: list[dict[str, Any]] = []
    lane_ends: list[float] = []
    for s in sorted(spans, key=lambda s: s.created):
        end = s.finished if s.finished is not None else s.created
        lane = next((i for i, e in enumerate(lane_ends) if e <= s.created), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end)
        lane_ends[lane] = end
        tid = lane + 1
        args = dict(rid=s.rid, steps_by_mode=s.steps_by_mode, cached_tokens=s.cached_tokens,
                    num_retractions=s.num_retractions,
                    split_prefill_intervals=s.split_prefill_intervals)
        marks = [s.created, s.first_scheduled, s.first_token, s.finished]
        names = ["queued", "prefill", "decode"]
        for name, start, stop in zip(names, marks, marks[1:], strict=False):
            if start is not None and stop is not None:
                events.append(_slice(f"{s.rid} {name}", REQUESTS, tid, start, stop, t0, **args))
    for i in range(len(lane_ends)):
        events.append(_meta(REQUESTS, i + 1, f"lane {i + 1}"))
    return events


def chrome_trace(steps: Sequence[StepRecord], spans: Sequence[RequestSpan],
                 t0: float) -> dict[str, Any]:
    """The Chrome trace JSON object of these steps and finished requests."""
    events = [_meta(HOST, None, "host"), _meta(DEVICE, None, "device"),
              _meta(MICRO, None, "micro-batches (TBO)"), _meta(REQUESTS, None, "requests")]
    events += [_meta(HOST, tid, name) for name, tid in _HOST_LANES.items()]
    modes = sorted({r.mode for r in steps})
    events += [_meta(DEVICE, _MODE_LANES.get(m, 8), m) for m in modes]
    events += [_meta(DEVICE, _BUBBLE_LANE, "bubbles"), _meta(MICRO, 1, "micro-batch A"),
               _meta(MICRO, 2, "micro-batch B")]
    for r in steps:
        events.extend(_step_events(r, t0))
    events += _request_events(spans, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: ExecutionTrace, path: str, since: float | None = None) -> str:
    """Write the trace's steps and requests (those after `since`, perf_counter) to path."""
    return _dump(chrome_trace(trace.steps(since=since), trace.requests(since=since),
                              trace.t0), path)


def _dump(doc: dict[str, Any], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


class TraceDirWriter:
    """`--trace_dir`: a Perfetto file each time the ring has filled with new steps (so
    none is lost to the ring), and one at shutdown with whatever is left."""

    def __init__(self, trace: ExecutionTrace, trace_dir: str) -> None:
        self.trace, self.dir = trace, os.path.expanduser(trace_dir)
        self._written_steps = 0  # steps numbered below this are in a file already
        self._segment = 0
        self.paths: list[str] = []

    def maybe_write(self) -> None:
        if self.trace.num_recorded - self._written_steps >= max(1, self.trace.capacity):
            self.write()

    def write(self, final: bool = False) -> str | None:
        """Write the steps not yet written; a step still in flight waits for the next
        file unless this is the last one."""
        steps = [s for s in self.trace.steps() if s.step >= self._written_steps
                 and (final or s.ready is not None)]
        if not steps:
            return None
        since = steps[0].sched_start
        doc = chrome_trace(steps, self.trace.requests(since=since), self.trace.t0)
        name = f"execution_trace_{os.getpid()}_{self._segment:04d}.json"
        path = _dump(doc, os.path.join(self.dir, name))
        self._written_steps = steps[-1].step + 1
        self._segment += 1
        self.paths.append(path)
        return path
