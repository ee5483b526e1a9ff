"""PNG timeline of a run from its execution-trace Chrome JSON.

    .venv/bin/python scripts/bench/plot_timeline.py --trace=/tmp/tr/execution_trace_123_0000.json
    .venv/bin/python scripts/bench/plot_timeline.py --trace=run.json --out=run.png --start_ms=200 \\
        --end_ms=900 --max_request_lanes=8

The input is what `--trace_dir`, `POST /stop_profile` or
`GET /debug/execution_trace?format=perfetto` write (runtime/perfetto.py). One row per lane:
host scheduling, device steps by mode (decode, extend, mixed, split-prefill intervals),
device bubbles, TBO micro-batches, then per-request lanes (queued / prefill / decode).
Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "Chrome trace JSON written by xlaserve (required)")
flags.DEFINE_string("out", None, "PNG path (default: the trace path with .png)")
flags.DEFINE_float("start_ms", None, "window start, ms from the trace's origin")
flags.DEFINE_float("end_ms", None, "window end, ms from the trace's origin")
flags.DEFINE_integer("max_request_lanes", 12, "request lanes drawn (0: none)")
flags.DEFINE_string("title", None, "plot title (default: the file name)")

# Lane order top to bottom, and colours by slice kind.
_ORDER = ["host/scheduling", "host/launch", "host/results", "device/decode", "device/extend",
          "device/mixed", "device/split_prefill", "device/idle", "device/bubbles",
          "micro-batches (TBO)/micro-batch A", "micro-batches (TBO)/micro-batch B"]
_COLOURS = {"decode": "tab:blue", "extend": "tab:orange", "mixed": "tab:purple",
            "split_prefill": "tab:green", "bubble": "tab:red", "schedule": "tab:gray",
            "launch": "silver", "results": "darkgray", "queued": "lightgray",
            "prefill": "tab:orange", "A": "tab:cyan", "B": "tab:olive"}


def load_lanes(doc: dict[str, Any], start_ms: float | None, end_ms: float | None,
               max_request_lanes: int) -> list[tuple[str, list[tuple[float, float, str]]]]:
    """(lane name, [(start ms, duration ms, kind)]) in drawing order, clipped to the
    window; empty lanes are dropped."""
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    names = {(e["pid"], e["tid"]): f"{procs.get(e['pid'], e['pid'])}/{e['args']['name']}"
             for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    for e in events:
        if e["ph"] != "X":
            continue
        t, d = e["ts"] / 1e3, e["dur"] / 1e3
        if (start_ms is not None and t + d < start_ms) or (end_ms is not None and t > end_ms):
            continue
        lane = names.get((e["pid"], e["tid"]), f"{e['pid']}/{e['tid']}")
        lanes.setdefault(lane, []).append((t, d, _kind(e["name"])))
    requests = sorted((k for k in lanes if k.startswith("requests/")),
                      key=lambda k: int(k.rsplit(" ", 1)[-1]))[:max_request_lanes]
    known = [k for k in _ORDER if k in lanes]
    others = sorted(k for k in lanes if k not in _ORDER and not k.startswith("requests/"))
    return [(k, lanes[k]) for k in known + others + requests]


def _kind(name: str) -> str:
    """The colour key of a slice: its mode, phase or micro-batch."""
    first, last = name.split(" ", 1)[0], name.rsplit(" ", 1)[-1]
    return first if first in _COLOURS else last if last in _COLOURS else "other"


def plot(lanes: list[tuple[str, list[tuple[float, float, str]]]], path: str,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, 0.45 * len(lanes) + 1.5))
    kinds_seen: set[str] = set()
    for row, (_, slices) in enumerate(reversed(lanes)):
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for t, d, kind in slices:
            by_kind.setdefault(kind, []).append((t, max(d, 1e-3)))
        for kind, bars in by_kind.items():
            # White edges keep back-to-back steps of one lane apart.
            ax.broken_barh(bars, (row + 0.1, 0.8), facecolor=_COLOURS.get(kind, "black"),
                           edgecolor="white", linewidth=0.4)
            kinds_seen.add(kind)
    ax.set_yticks([r + 0.5 for r in range(len(lanes))])
    ax.set_yticklabels([name for name, _ in reversed(lanes)], fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=_COLOURS.get(k, "black"), label=k)
                       for k in sorted(kinds_seen)], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    with open(FLAGS.trace) as f:
        doc = json.load(f)
    lanes = load_lanes(doc, FLAGS.start_ms, FLAGS.end_ms, FLAGS.max_request_lanes)
    if not lanes:
        raise app.UsageError(f"{FLAGS.trace}: no slices in the window")
    out = FLAGS.out or os.path.splitext(FLAGS.trace)[0] + ".png"
    plot(lanes, out, FLAGS.title or os.path.basename(FLAGS.trace))
    print(f"wrote {out} ({len(lanes)} lanes)")


if __name__ == "__main__":
    flags.mark_flag_as_required("trace")  # here, not at import: other scripts import plot()
    app.run(main)
