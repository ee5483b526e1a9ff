"""Shared by the trace tests: hand-built step records and the Chrome trace schema check."""

from __future__ import annotations

from typing import Any

from runtime.exec_trace import StepRecord


def make_record(mode: str, launch_end: float, rids: tuple[str, ...] = (),
                **kw: Any) -> StepRecord:
    """A step launched at `launch_end` (scheduled over the 0.2 s before it)."""
    base = dict(mode=mode, bucket=None, rids=rids, extend_rows=0, decode_rows=len(rids),
                extend_tokens=0, padded_rows=4, padded_tokens=4,
                sched_start=launch_end - 0.2, sched_end=launch_end - 0.1,
                launch_end=launch_end)
    return StepRecord(**base | kw)

_PHASES = {"X", "M", "C"}


def check_chrome_trace(doc: Any) -> list[dict[str, Any]]:
    """Assert `doc` is a Chrome trace object as ui.perfetto.dev reads it (metadata "M",
    complete "X" and counter "C" events); returns its complete events."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list), type(doc)
    slices = []
    for ev in doc["traceEvents"]:
        assert isinstance(ev, dict), ev
        assert ev.get("ph") in _PHASES, ev
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        assert isinstance(ev.get("pid"), int) and isinstance(ev.get("tid"), int), ev
        assert isinstance(ev.get("args", {}), dict), ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name"), ev
            assert isinstance(ev["args"]["name"], str), ev
            continue
        assert isinstance(ev.get("ts"), (int, float)) and not isinstance(ev["ts"], bool), ev
        if ev["ph"] == "C":  # a counter: numeric series in args
            assert ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values())
            continue
        assert isinstance(ev.get("dur"), (int, float)) and not isinstance(ev["dur"], bool), ev
        assert ev["dur"] >= 0, ev
        slices.append(ev)
    return slices


def lanes(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> "process/thread" names from the metadata events."""
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    return {(e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
            for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
