"""The execution trace: per-step records, bubble accounting, per-request paths, Perfetto.

Host-side tests build records by hand (the split-prefill and TBO paths record through the
same API); engine tests run a tiny random model and check what the Engine recorded.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from models import llama
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.exec_trace import ExecutionTrace, SplitInterval, StepRecord, TboSplit, mode_runs
from runtime.model_runner import ModelRunner
from runtime.perfetto import TraceDirWriter, chrome_trace, write_chrome_trace
from runtime.request import SamplingParams
from tests import test_multiplexing as mux
from tests.model_utils import TINY
from tests.trace_utils import check_chrome_trace, lanes, make_record

# ---- host side: records built by hand ---------------------------------------------------


def test_bubbles_from_recorded_times():
    trace = ExecutionTrace()
    a = trace.record(make_record("extend", 1.0))
    trace.ready(a, 2.0, waited=True)           # first step of a busy period: no bubble
    b = trace.record(make_record("decode", 2.5))      # launched 0.5 s after a's result: a bubble
    c = trace.record(make_record("decode", 2.7))      # launched while b runs (overlap): none
    trace.ready(b, 3.5, waited=True)
    trace.ready(c, 4.5, waited=True)
    trace.end_busy_period()
    d = trace.record(make_record("decode", 10.0))     # after an idle engine: not a bubble
    trace.ready(d, 11.0, waited=False)
    assert [r.step for r in (a, b, c, d)] == [0, 1, 2, 3]
    assert (b.device_start, b.idle_before) == (2.5, 0.5)
    assert (c.device_start, c.idle_before) == (3.5, 0.0)
    assert d.idle_before == 0.0
    got = trace.bubbles()
    assert got["extend"] == {"busy_s": 1.0, "idle_s": 0.0, "fraction": 0.0,
                             "host_bound_steps": 0}
    assert got["decode"]["host_bound_steps"] == 1  # d: the device was done before we looked
    assert got["decode"]["busy_s"] == pytest.approx(1.0 + 1.0 + 1.0)
    assert got["decode"]["idle_s"] == pytest.approx(0.5)
    assert got["all"]["fraction"] == pytest.approx(0.5 / 4.5)
    assert trace.step_counts() == {"extend": 1, "decode": 3}


def test_split_prefill_and_tbo_records_reach_requests_and_perfetto():
    trace = ExecutionTrace()
    trace.add_request("long", 0.0)
    trace.add_request("short", 0.0)
    recs = []
    for i in range(3):  # one decode step and one 10-layer interval per iteration
        dec = trace.record(make_record("decode", 1.0 + i, ("short",)))
        split = SplitInterval(prefill_id=7, interval=i, start_layer=10 * i, num_layers=10,
                              total_layers=30, decode_step=dec.step)
        recs += [dec, trace.record(make_record("split_prefill", 1.5 + i, ("long",), extend_rows=1,
                                        extend_tokens=300, split=split))]
    tbo = trace.record(make_record("decode", 5.0, ("short", "long"), decode_rows=2,
                            detail=TboSplit(tokens=(1, 3), rows=(1, 1), split_index=1)))
    for r, t in zip([*recs, tbo], [1.4, 1.9, 2.4, 2.9, 3.4, 3.9, 7.0], strict=True):
        trace.ready(r, t, waited=True)
    # A fused decode + interval executable: one step, only the prefill counts an interval.
    fused = trace.record(make_record("decode", 7.5, ("short", "long"), split=SplitInterval(
        prefill_id=7, interval=3, start_layer=30, num_layers=0, total_layers=30,
        rids=("long",))))
    trace.ready(fused, 7.6)
    meta = trace.finish_request("long", 8.0, first_token=7.0)
    assert trace.requests()[-1].split_prefill_intervals == 4
    assert meta["steps_by_mode"] == {"split_prefill": 3, "decode": 2}
    assert meta["queue_time"] == pytest.approx(1.4)  # its first interval's sched_end
    trace.finish_request("short", 8.0)
    assert trace.requests()[-1].split_prefill_intervals == 0
    assert [s["split"]["decode_step"] for s in trace.last(8)[1:6:2]] == [0, 2, 4]
    assert mode_runs(trace.steps()) == [("decode", 1), ("split_prefill", 1)] * 3 + [
        ("decode", 2)]

    doc = json.loads(json.dumps(chrome_trace(trace.steps(), trace.requests(), trace.t0)))
    slices = check_chrome_trace(doc)
    names = lanes(doc)
    by_lane: dict[str, list[dict]] = {}
    for ev in slices:
        by_lane.setdefault(names[ev["pid"], ev["tid"]], []).append(ev)
    assert [e["name"] for e in by_lane["device/split_prefill"]] == [
        "split_prefill L0-10", "split_prefill L10-20", "split_prefill L20-30"]
    assert [e["args"]["decode_step"] for e in by_lane["device/split_prefill"]] == [0, 2, 4]
    assert len(by_lane["device/decode"]) == 5
    (a,), (b,) = by_lane["micro-batches (TBO)/micro-batch A"], by_lane[
        "micro-batches (TBO)/micro-batch B"]
    assert a["ts"] + a["dur"] == pytest.approx(b["ts"])
    assert b["dur"] == pytest.approx(3 * a["dur"])  # drawn by token share 1 : 3
    assert {e["args"]["rid"] for e in slices if e["pid"] == 4} == {"long", "short"}


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="trace_buffer_steps=-1"):
        ExecutionTrace(capacity=-1)


def test_disabled_trace_only_counts_modes():
    trace = ExecutionTrace(capacity=0)
    trace.add_request("r", 0.0)
    rec = trace.record(make_record("decode", 1.0, ("r",)))
    trace.ready(rec, 2.0)
    assert trace.steps() == [] and trace.last(5) == [] and trace.bubbles()["all"]["busy_s"] == 0
    assert trace.step_counts() == {"decode": 1}
    assert trace.finish_request("r", 3.0) == {}


def test_trace_dir_writer_loses_no_step(tmp_path):
    trace = ExecutionTrace(capacity=4)
    writer = TraceDirWriter(trace, str(tmp_path))
    for i in range(10):
        rec = trace.record(make_record("decode", float(i)))
        writer.maybe_write()  # the ring holds 4: a file every 4 new steps
        trace.ready(rec, i + 0.5)
    writer.write(final=True)
    steps = []
    for path in writer.paths:
        doc = json.loads(open(path).read())
        steps += [e["args"]["step"] for e in check_chrome_trace(doc)
                  if lanes(doc)[e["pid"], e["tid"]] == "device/decode"]
    # A step in flight when a file is cut goes to the next one: none lost, none twice.
    assert len(writer.paths) == 4 and sorted(steps) == list(range(10))


# ---- the engine records its own steps ---------------------------------------------------

CFG = dataclasses.replace(TINY, max_position_embeddings=128)
PAGE = 4


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    rcfg = RunnerConfig(decode_buckets=(4, 8), extend_token_buckets=(64,),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(128,), strict_compile=True,
                        enable_split_prefill=True)
    r = ModelRunner(CFG, llama.init_params(CFG, jax.random.key(3)),
                    CacheConfig(page_size=PAGE, num_pages=200), rcfg, max_running_requests=8)
    r.warmup(progress=False)
    return r


def _engine(runner: ModelRunner, **kw) -> Engine:
    args = dict(page_size=PAGE, max_running_requests=8, max_prefill_tokens=64,
                chunked_prefill_size=64, max_extend_seqs=4, compilation_cache_dir=None)
    return Engine(ServerArgs(**args | kw), runner=runner)


PROMPTS = [[5 + i] * n for i, n in enumerate((3, 10, 30, 50, 7))]
SP = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def test_engine_records_modes_buckets_and_padding(runner):
    eng = _engine(runner, disable_prefix_cache=True)
    outs = eng.generate(PROMPTS, SP)
    steps = eng.trace.steps()
    # Prefill chunks first (5 prompts, 100 tokens, 64-token batches), then decode only.
    runs = mode_runs(steps)
    assert [m for m, _ in runs] == ["extend", "decode"] and runs[0][1] == 2
    assert eng.trace.step_counts() == {m: sum(s.mode == m for s in steps)
                                       for m in ("extend", "decode")}
    # Every prompt token is prefilled exactly once (no prefix cache); 100 of them go to
    # 64-token buckets, and the 5-row decode steps pad to the 8-row bucket.
    ext = [s for s in steps if s.mode == "extend"]
    assert sum(s.extend_tokens for s in ext) == sum(map(len, PROMPTS))
    assert all(s.bucket.num_extend_tokens == 64 == s.padded_tokens for s in ext)
    five = [s for s in steps if s.mode == "decode" and s.decode_rows == 5]
    assert five and all(s.bucket == BucketShape(0, 0, 8, 128 // PAGE) for s in five)
    assert all(s.padded_rows == 8 and s.padded_tokens - s.tokens == 3 for s in five)
    for s in steps:
        assert s.sched_start <= s.sched_end <= s.launch_end <= s.device_start <= s.ready
        assert s.ready <= s.process_end and s.compiles_after_warmup == 0
        assert set(s.rids) <= {o.rid for o in outs} and len(s.rids) == s.rows
    assert [s.step for s in steps] == list(range(len(steps)))


def test_meta_info_says_which_path_each_request_took(runner):
    eng = _engine(runner)
    shared = list(range(1, 41))
    first = eng.generate([shared + [1]], SP)[0]
    outs = eng.generate([shared + [2], [9] * 70], SP)
    for o in (first, *outs):
        m = o.meta_info
        # The first token comes from the last prefill chunk; each later one from a decode.
        assert m["steps_by_mode"]["decode"] == SP.max_new_tokens - 1
        assert m["prefill_intervals"] == 0 and m["retracted"] is False
        assert m["queue_time"] >= 0
    assert outs[1].meta_info["steps_by_mode"]["extend"] == 2  # 70 tokens, 64-token chunks
    assert first.meta_info["cached_tokens"] == 0
    assert outs[0].meta_info["cached_tokens"] == 40  # page-aligned share of the prefix


def test_retracted_requests_say_so(runner):
    eng = _engine(runner, max_total_tokens=24 * PAGE)
    sp = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    outs = eng.generate([[3 + i] * 20 for i in range(6)], sp)
    retracted = [o for o in outs if o.meta_info["retracted"]]
    assert retracted, "the pool is too small for all six: some must be retracted"
    for o in retracted:
        assert o.meta_info["num_retractions"] >= 1
        assert o.meta_info["steps_by_mode"]["extend"] >= 2  # prefilled again on resume


def _fraction_from_records(steps: list[StepRecord]) -> float:
    """idle / (busy + idle), recomputed from the raw launch and ready times."""
    busy = idle = 0.0
    prev = None
    for s in steps:
        start = s.launch_end if prev is None else max(s.launch_end, prev)
        idle += 0.0 if prev is None else max(0.0, s.launch_end - prev)
        busy += s.ready - start
        prev = s.ready
    return idle / (busy + idle)


def test_bubble_fraction_is_lower_with_overlap_scheduling(runner):
    fractions = {}
    for overlap in (True, False):
        eng = _engine(runner, disable_overlap_schedule=not overlap)
        eng.generate([[4] * 8] * 8, dataclasses.replace(SP, max_new_tokens=24))
        got = eng.trace.bubbles()["all"]["fraction"]
        assert got == pytest.approx(_fraction_from_records(eng.trace.steps()))
        fractions[overlap] = got
    assert fractions[False] > 0
    assert fractions[True] < fractions[False], fractions


def test_perfetto_file_of_a_short_run(runner, tmp_path):
    eng = _engine(runner)
    eng.generate(PROMPTS[:3], SP)
    path = write_chrome_trace(eng.trace, str(tmp_path / "run.json"))
    doc = json.loads(open(path).read())
    slices = check_chrome_trace(doc)
    names = lanes(doc)
    lane_of = [names[e["pid"], e["tid"]] for e in slices]
    steps = eng.trace.steps()
    assert lane_of.count("device/decode") == sum(s.mode == "decode" for s in steps)
    assert lane_of.count("device/extend") == sum(s.mode == "extend" for s in steps)
    assert lane_of.count("host/scheduling") == len(steps)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert [c["args"]["rows"] for c in counters] == [s.rows for s in steps]
    phases = [e["name"].split()[-1] for e in slices if e["pid"] == 4]
    assert sorted(phases) == sorted(["queued", "prefill", "decode"] * 3)


def test_multiplexing_interleaves_intervals_with_decode_steps(runner):
    """A long prompt arrives while three streams decode: its split-prefill intervals
    alternate with decode steps, each naming the decode step of its iteration."""
    eng = _engine(runner, enable_multiplexing=True, split_prefill_layers=1)
    long_sp = dataclasses.replace(SP, max_new_tokens=12)
    for p in PROMPTS[:3]:
        eng.add_request(p, long_sp)
    while eng.trace.step_counts().get("decode", 0) < 3:
        eng.step()
    rid = eng.add_request([7] * 60, SP)
    outs = {}
    while eng.has_work():
        outs.update({o.rid: o for o in eng.step() if o.finished})
    steps = eng.trace.steps()
    by_step = {s.step: s for s in steps}
    mine = [s for s in steps if s.split is not None and s.split.prefill_id == rid]
    assert [(s.split.start_layer, s.split.num_layers) for s in mine] == [
        (i, 1) for i in range(CFG.num_layers)]
    for s in mine:  # launched right after the decode step it shares the iteration with
        dec = by_step[s.split.decode_step]
        assert dec.mode == "decode" and dec.step == s.step - 1 and rid not in dec.rids
    first, last = mine[0].step, mine[-1].step
    span = [s.mode for s in steps if first - 1 <= s.step <= last]
    assert span == ["decode", "split_prefill"] * CFG.num_layers
    assert any(("split_prefill", 1) == r for r in mode_runs(steps))
    # Intervals are never read back: the next readback bounds their estimated end.
    for s in mine:
        assert s.waited is None and s.device_start <= s.ready <= by_step[s.step + 1].ready
    meta = outs[rid].meta_info
    assert meta["prefill_intervals"] == CFG.num_layers
    assert meta["steps_by_mode"]["split_prefill"] == CFG.num_layers + 1  # + its sampling
    assert meta["steps_by_mode"]["decode"] == SP.max_new_tokens - 1


@pytest.mark.parametrize("fused", [False, True])
def test_multiplex_loop_records_every_launch(fused):
    """Host only, the fake split runner: one record per launch, of the right kind; a fused
    launch is one decode record carrying its interval and naming the prefill's rows; a
    prefill too small to split is recorded as the EXTEND step it ran as."""
    sched, runner, loop = mux._setup(fused=fused)
    loop.trace = ExecutionTrace()
    arrivals, want = mux._workload()
    assert mux._run(sched, loop, arrivals) == want
    kinds = []
    for kind, _ in runner.log:  # a fused launch logs its interval too: one launch
        if not (kind == "interval" and kinds and kinds[-1] == "fused"):
            kinds.append(kind)
    steps = loop.trace.steps()
    expect = {"decode": ("decode", False), "fused": ("decode", True),
              "interval": ("split_prefill", True), "sample": ("split_prefill", False),
              "whole": ("extend", False)}
    assert [(s.mode, s.split is not None) for s in steps] == [expect[k] for k in kinds]
    assert ("fused" in kinds) == fused and "whole" in kinds
    by_step = {s.step: s for s in steps}
    for s in steps:
        assert s.ready is not None and s.device_start <= s.ready
        if s.split is not None and s.mode == "decode":  # fused
            assert s.split.rids and not set(s.split.rids) & set(s.rids)
        elif s.split is not None and s.split.decode_step is not None:
            assert by_step[s.split.decode_step].mode == "decode"
