"""Chrome trace JSON schema check shared by the trace tests (engine and HTTP)."""

from __future__ import annotations

from typing import Any

_PHASES = {"X", "M"}


def check_chrome_trace(doc: Any) -> list[dict[str, Any]]:
    """Assert `doc` is a Chrome trace object as ui.perfetto.dev reads it; returns its
    complete ("X") events."""
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
        for key in ("ts", "dur"):
            assert isinstance(ev.get(key), (int, float)) and not isinstance(ev[key], bool), ev
        assert ev["dur"] >= 0, ev
        slices.append(ev)
    return slices


def lanes(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> "process/thread" names from the metadata events."""
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    return {(e["pid"], e["tid"]): f"{procs[e['pid']]}/{e['args']['name']}"
            for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
