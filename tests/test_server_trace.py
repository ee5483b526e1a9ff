"""Execution-path observability over HTTP: /debug/execution_trace, bubble metrics,
per-request paths in meta_info, /start_profile + /stop_profile, --trace_dir files.

Same harness as test_server.py (one tiny runner per session, a real uvicorn server).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import pytest

from tests import test_server
from tests.test_server import LiveServer, error_of, metric, tiny_engine, wait_idle
from tests.trace_utils import check_chrome_trace, lanes

SP = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    engine = tiny_engine()
    with LiveServer(lambda: engine) as s:
        s.wait_ready()
        yield s


http = test_server.http  # the client fixture of tests/test_server.py, on this module's live


def test_execution_trace_endpoint_and_bubble_metrics(http):
    out = http.post("/generate", json={"text": ["a b c", "hello there"],
                                       "sampling_params": SP}).json()
    wait_idle(http)
    body = http.get("/debug/execution_trace", params={"n": 4}).json()
    assert body["tracing"] is True and len(body["steps"]) == 4
    for s in body["steps"]:
        assert s["mode"] in ("extend", "decode")
        assert s["padded_tokens"] >= s["tokens"] >= 1 and s["padded_rows"] >= s["rows"]
        assert s["launch_end"] >= s["sched_end"] >= s["sched_start"]
        assert s["ready"] >= s["device_start"]
        assert s["split"] is None and s["detail"] is None
    # The counter is process-wide (other test modules compile after the shared runner's
    # warm-up): what must hold is that nothing compiled while these steps ran.
    assert len({s["compiles_after_warmup"] for s in body["steps"]}) == 1
    rids = {o["meta_info"]["id"] for o in out}  # the engine rids of the two members
    last = body["steps"][-1]
    assert last["mode"] == "decode" and set(last["rids"]) == rids
    assert {r["rid"] for r in body["requests"][-2:]} == rids
    assert all(r["steps_by_mode"]["decode"] == 4 for r in body["requests"][-2:])
    assert body["step_counts"]["decode"] >= 4
    assert body["path"] == [["decode", 4]]
    five = http.get("/debug/execution_trace", params={"n": 5}).json()
    assert five["path"] == [["extend", 1], ["decode", 4]]  # one prefill, then 4 decodes
    assert 0 <= body["bubbles"]["all"]["fraction"] < 1
    assert body["bubbles"]["decode"]["busy_s"] > 0
    assert 0 <= body["padding_waste"]["tokens"] < 1
    assert http.get("/debug/trace", params={"n": 4}).json()["steps"] == body["steps"]
    first = body["steps"][0]["step"]
    newer = http.get("/debug/execution_trace", params={"n": 10, "after": first}).json()
    assert [s["step"] for s in newer["steps"]] == [s["step"] for s in body["steps"][1:]]
    assert metric(http, 'xlaserve_device_busy_seconds_total{mode="decode"}') > 0
    assert 0 <= metric(http, 'xlaserve_device_bubble_fraction{mode="all"}') < 1
    assert 'xlaserve_device_idle_seconds_total{mode="all"}' in http.get("/metrics").text


def test_execution_trace_as_perfetto(http):
    http.post("/generate", json={"text": "perfetto", "sampling_params": SP})
    doc = http.get("/debug/execution_trace", params={"n": 8, "format": "perfetto"}).json()
    names = lanes(doc)
    used = {names[e["pid"], e["tid"]] for e in check_chrome_trace(doc)}
    assert {"host/scheduling", "host/launch", "device/decode"} <= used
    bad = http.get("/debug/execution_trace", params={"format": "xml"})
    assert bad.status_code == 400 and error_of(bad)["param"] == "format"


def test_generate_meta_info_says_which_path(http):
    meta = http.post("/generate", json={"text": "which path did I take",
                                        "sampling_params": SP}).json()["meta_info"]
    assert meta["steps_by_mode"] == {"extend": 1, "decode": SP["max_new_tokens"] - 1}
    assert meta["prefill_intervals"] == 0
    assert meta["retracted"] is False and meta["num_retractions"] == 0
    assert meta["queue_time"] >= 0 and meta["cached_tokens"] >= 0
    # The tiny runner has no MIXED programs of the prefill policy: prefill first, said so.
    assert meta["prefill_paths"] == {"extend (no policy)": 1}
    body = http.get("/debug/execution_trace", params={"n": 1}).json()
    assert body["prefill_policy"] is None and body["prefill_paths"]["extend (no policy)"] >= 1


def test_start_and_stop_profile(http, tmp_path):
    r = http.post("/stop_profile")
    assert r.status_code == 400 and "no profile is running" in error_of(r)["message"]
    r = http.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 200 and r.json()["output_dir"] == str(tmp_path)
    again = http.post("/start_profile", json={"output_dir": str(tmp_path / "b")})
    assert again.status_code == 400 and "already running" in error_of(again)["message"]
    bad = http.post("/start_profile", json={"output_dir": 3})
    assert bad.status_code == 400 and error_of(bad)["param"] == "output_dir"
    http.post("/generate", json={"text": "profile me", "sampling_params": SP})
    r = http.post("/stop_profile")
    assert r.status_code == 200, r.text
    assert glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    doc = json.loads(open(r.json()["execution_trace"]).read())
    steps = [e for e in check_chrome_trace(doc) if e["pid"] == 2 and e["name"] != "bubble"]
    assert len(steps) == SP["max_new_tokens"]  # exactly the profiled request's steps
    assert http.post("/stop_profile").status_code == 400


def test_trace_dir_files_open_as_chrome_traces(tmp_path):
    engine = tiny_engine(trace_dir=str(tmp_path), trace_buffer_steps=6)
    with LiveServer(lambda: engine) as s:
        s.wait_ready()
        with s.client() as c:
            c.post("/generate", json={"text": ["one", "two"], "sampling_params": SP})
            c.post("/generate", json={"text": "three", "sampling_params": SP})
            # A profile left running when the server stops is stopped, not leaked.
            assert c.post("/start_profile").json()["output_dir"] == str(tmp_path)
    assert not engine.profiling
    files = sorted(glob.glob(os.path.join(tmp_path, "execution_trace_*.json")))
    assert len(files) >= 2  # the ring filled at least once, plus the file at shutdown
    steps = []
    for path in files:
        doc = json.loads(open(path).read())
        steps += [e["args"]["step"] for e in check_chrome_trace(doc)
                  if e["pid"] == 2 and e["name"] != "bubble"]
    assert sorted(steps) == list(range(len(steps))) == list(range(engine.trace.num_recorded))
