"""scripts/plot_timeline.py: the lanes it reads from a trace file, and the PNG it writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.exec_trace import ExecutionTrace, SplitInterval, TboSplit
from runtime.perfetto import write_chrome_trace
from tests.trace_utils import make_record

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plot_timeline", REPO / "scripts" /
                                               "plot_timeline.py")
plot_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_timeline)


def _trace_file(tmp_path: Path) -> Path:
    """A decode step, a split-prefill interval multiplexed with it, a TBO decode step."""
    trace = ExecutionTrace()
    trace.t0 = 0.0
    trace.add_request("r", 0.9)
    dec = trace.record(make_record("decode", 1.0, ("r",)))
    split = trace.record(make_record("split_prefill", 1.001, split=SplitInterval(
        prefill_id=1, interval=0, start_layer=0, num_layers=4, total_layers=8,
        decode_step=dec.step)))
    tbo = trace.record(make_record("decode", 1.02, ("r",), tbo=TboSplit((2, 2), (1, 1), 1)))
    for rec, t in ((dec, 1.005), (split, 1.010), (tbo, 1.03)):
        trace.ready(rec, t, waited=True)
        trace.processed(rec, t + 0.001)
    trace.finish_request("r", 1.04, first_token=1.005)
    return Path(write_chrome_trace(trace, str(tmp_path / "t.json")))


def test_lanes_in_order_and_clipped(tmp_path):
    doc = json.loads(_trace_file(tmp_path).read_text())
    lanes = dict(plot_timeline.load_lanes(doc, None, None, 4))
    assert list(lanes)[:3] == ["host/scheduling", "host/launch", "host/results"]
    assert [kind for _, _, kind in lanes["device/split_prefill"]] == ["split_prefill"]
    assert [kind for _, _, kind in lanes["device/decode"]] == ["decode", "decode"]
    assert [kind for _, _, kind in lanes["micro-batches (TBO)/micro-batch A"]] == ["A"]
    assert [kind for _, _, kind in lanes["requests/lane 1"]] == ["queued", "prefill", "decode"]
    # ms from the origin: the window 1012-1040 ms keeps only what reaches into it.
    window = dict(plot_timeline.load_lanes(doc, 1012.0, 1040.0, 0))
    assert [t for t, _, _ in window["device/decode"]] == [pytest.approx(1020.0)]
    assert not any(k.startswith("requests/") for k in window)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="the PNG needs matplotlib (the bench extra)")
def test_plot_writes_a_png(tmp_path):
    path = _trace_file(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plot_timeline.py"),
                           f"--trace={path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = path.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
