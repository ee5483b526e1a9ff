"""scripts/bench/plot_timeline.py: the lanes it reads from a trace file, and the PNG it writes."""

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
_spec = importlib.util.spec_from_file_location("plot_timeline", REPO / "scripts" / "bench" /
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
    tbo = trace.record(make_record("decode", 1.02, ("r",), detail=TboSplit((2, 2), (1, 1), 1)))
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


def test_plot_writes_a_png(tmp_path):
    path = _trace_file(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "plot_timeline.py"),
                           f"--trace={path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = path.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def _smoke(script: str, tmp_path: Path, *extra: str) -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench" / script), "--smoke",
           f"--out_dir={tmp_path}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_timeline_long_prompts_smoke(tmp_path):
    _smoke("timeline_long_prompts.py", tmp_path, "--label=mixed",
           "--set=enable_mixed_chunk=true")
    summary = json.loads((tmp_path / "mixed_summary.json").read_text())
    assert summary["server_args"]["enable_mixed_chunk"] == "True"
    assert summary["max_decode_gap_s"] >= summary["median_decode_gap_s"] > 0
    assert summary["step_counts"]["mixed"] >= 1  # the long prompt ran beside the decodes
    assert (tmp_path / "mixed.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_trace_overhead_smoke(tmp_path):
    _smoke("bench_trace_overhead.py", tmp_path, "--rounds=2", "--compilation_cache_dir=",
           "--num_prompts=4", "--input_len=16", "--output_len=8")
    s = json.loads((tmp_path / "bench_trace_overhead.json").read_text())["summary"]
    assert len(s["ratios"]) == 2 and s["median_ratio_on_off"] > 0
    assert 0 < s["trace_cost_s_per_step"] < s["wall_s_per_step"]
