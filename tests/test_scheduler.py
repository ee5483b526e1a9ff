"""Scheduler: admission, chunking, mixed batches, retraction, abort, stop rules, policies.

The fake runner's tokens are a hash of the sequence read back through the page tables, so
"same tokens as the request run alone" checks every page, slot and cache decision.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from models.forward_mode import ForwardMode
from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_cache import pages_for
from runtime.request import FinishReason, Req, ReqStatus, SamplingParams
from runtime.schedule_batch import PREV_TOKEN, StepOutput
from runtime.scheduler import Scheduler
from tests.fake_runner import (
    EOS,
    VOCAB,
    FakeRunner,
    check_invariants,
    drive,
    fake_decode,
    reference_output,
)

PS = 4


def make(
    num_pages: int = 400, max_running: int = 8, page_size: int = PS, **kw
) -> tuple[Scheduler, FakeRunner]:
    cache = CacheConfig(page_size=page_size, num_pages=num_pages)
    cfg = SchedulerConfig(cache=cache, max_running_requests=max_running, **kw)
    return Scheduler(cfg, [EOS], fake_decode), FakeRunner(num_pages, page_size, max_running)


def req(rid: str, prompt: list[int], max_new: int = 16, **kw) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, **kw))


def workload(seed: int = 0, n: int = 16) -> list[Req]:
    """Random prompt lengths; some share a system prompt, two are identical, one extends
    another's prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 70))]
        prompt = (system if i % 3 == 0 else []) + tail
        if i in (5, 9):
            prompt = reqs[i - 1].prompt_ids + (tail[:5] if i == 9 else [])
        reqs.append(req(f"r{i}", prompt, rng.randrange(1, 40), ignore_eos=i == 7))
    return reqs


def run(sched: Scheduler, runner: FakeRunner, reqs: list[Req], overlap=None, **kw):
    for r in reqs:
        sched.add(r)
    overlap = sched.config.overlap if overlap is None else overlap
    streamed = drive(sched, runner, overlap, on_step=lambda _: check_invariants(sched), **kw)
    check_invariants(sched)
    return streamed


def assert_drained(sched: Scheduler) -> None:
    """Idle: only the prefix cache holds pages, and evicting it frees them all."""
    assert sched.is_idle()
    assert sched.allocator.num_used == sched.prefix_cache.num_pages
    sched.prefix_cache.evict(sched.allocator.capacity)
    assert sched.allocator.num_free == sched.allocator.capacity
    check_invariants(sched)


def run_in_waves(sched: Scheduler, runner: FakeRunner, overlap: bool,
                 alone: dict[str, list[int]]) -> list[Req]:
    """The workload arriving four at once, then one per step; every request's output
    must equal its run alone, streamed as it was produced."""
    reqs = workload()
    arrivals = list(reversed(reqs))

    def arrive(step: int) -> None:
        check_invariants(sched)
        for _ in range(4 if step == 0 else 1 if arrivals else 0):
            sched.add(arrivals.pop())

    streamed = drive(sched, runner, overlap, on_step=arrive)
    for r in reqs:
        assert r.output_ids == alone[r.rid], r.rid
        assert streamed[r.rid] == r.output_ids
    return reqs


# ---- the core property ----


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Each workload request run alone on a big pool."""
    out = {}
    for r in workload():
        sched, runner = make(num_pages=400, chunked_prefill_size=None)
        out[r.rid] = run(sched, runner, [r])[r.rid]
        expected = reference_output(r.prompt_ids, r.sampling.max_new_tokens, r.sampling.ignore_eos)
        assert out[r.rid] == r.output_ids == expected
    return out


@pytest.mark.parametrize("num_pages", [400, 36], ids=["big_pool", "tiny_pool"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("chunk", [16, 64, None], ids=["chunk16", "chunk64", "nochunk"])
def test_batched_outputs_equal_alone(alone, chunk, cache, mixed, overlap, num_pages):
    sched, runner = make(
        num_pages=num_pages,
        chunked_prefill_size=chunk,
        disable_prefix_cache=not cache,
        enable_mixed_chunk=mixed,
        overlap=overlap,
        max_running=16,
    )
    reqs = run_in_waves(sched, runner, overlap, alone)
    for r in reqs:
        assert r.status is ReqStatus.FINISHED and r.finish_reason.kind in ("stop", "length")
    if num_pages == 36:
        assert sched.stats().num_retractions > 0
    if cache:
        assert sched.stats().prefix_hit_tokens > 0
    assert_drained(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_lpm_and_unaligned_chunks_equal_alone(alone, overlap):
    sched, runner = make(
        num_pages=40, page_size=3, schedule_policy="lpm", chunked_prefill_size=7, overlap=overlap
    )
    reqs = workload()
    run(sched, runner, reqs)
    assert {r.rid: r.output_ids for r in reqs} == alone
    assert_drained(sched)


# ---- admission ----


def test_budgets_limit_each_extend_batch():
    sched, runner = make(
        max_running=3, chunked_prefill_size=None, max_prefill_tokens=40, max_extend_seqs=2
    )
    reqs = [req(f"r{i}", [10 + i] * 15) for i in range(5)] + [req("long", [9] * 90)]
    for r in reqs:
        sched.add(r)
    batches = []
    while not sched.is_idle():
        batch = sched.next_batch()
        batches.append(batch)
        assert len(sched.running) <= 3
        assert len(batch.extend_rows) <= 2
        if len(batch.extend_rows) > 1:
            assert batch.num_tokens <= 40
        sched.process_results(batch, runner.forward(batch))
        check_invariants(sched)
    # The 90-token prompt exceeds the budget but still runs, alone, with chunking off.
    long_rows = [b for b in batches if any(r.req.rid == "long" for r in b.extend_rows)]
    assert len(long_rows) == 1 and len(long_rows[0].extend_rows) == 1
    assert all(r.output_ids == reference_output(r.prompt_ids, 16) for r in reqs)


def test_admission_waits_for_free_pages():
    sched, runner = make(num_pages=11, chunked_prefill_size=None, disable_prefix_cache=True)
    a, b = req("a", [5] * 20, 4, ignore_eos=True), req("b", [6] * 20, 4, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    batch = sched.next_batch()
    assert [r.req for r in batch.extend_rows] == [a]  # b's 5 pages + reserve do not fit
    sched.process_results(batch, runner.forward(batch))
    run(sched, runner, [])
    assert a.output_ids == reference_output(a.prompt_ids, 4, True)
    assert b.output_ids == reference_output(b.prompt_ids, 4, True)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_rows(chunk):
    sched, runner = make(chunked_prefill_size=chunk)
    long, short = req("long", range(3, 203), 5), req("short", [7] * 10, 5)
    sched.add(long)
    sched.add(short)
    chunk_rows = []
    while not sched.is_idle():
        batch = sched.next_batch()
        assert sum(len(r.input_ids) for r in batch.extend_rows) <= chunk
        assert sum(r.is_prefilling for r in sched.running) <= 1  # one chunked request
        chunk_rows += [r for r in batch.extend_rows if r.req is long]
        events = sched.process_results(batch, runner.forward(batch))
        assert all(ev.new_token_ids or ev.finished for ev in events)
        assert {ev.req.rid for ev in events} <= {r.req.rid for r in batch.rows if r.sample}
    assert [r.sample for r in chunk_rows] == [False] * (len(chunk_rows) - 1) + [True]
    assert [r.start_pos for r in chunk_rows] == [i * chunk for i in range(len(chunk_rows))]
    assert long.output_ids == reference_output(long.prompt_ids, 5)


@pytest.mark.parametrize("mixed", [False, True])
def test_mixed_batches(mixed):
    sched, runner = make(chunked_prefill_size=16, enable_mixed_chunk=mixed)
    first = req("first", [4] * 10, 30, ignore_eos=True)
    sched.add(first)
    batch = sched.next_batch()
    sched.process_results(batch, runner.forward(batch))
    sched.add(req("second", range(3, 63), 4))
    modes = []
    while not sched.is_idle():
        batch = sched.next_batch()
        modes.append(batch.mode)
        if batch.mode is ForwardMode.MIXED:
            assert batch.extend_rows and [r.req for r in batch.decode_rows] == [first]
        if batch.mode is ForwardMode.EXTEND:
            assert not batch.decode_rows
        sched.process_results(batch, runner.forward(batch))
    assert (ForwardMode.MIXED in modes) == mixed
    assert first.output_ids == reference_output(first.prompt_ids, 30, True)


def test_prefix_hit_reuses_pages_and_prefills_the_rest():
    sched, runner = make()
    prompt = list(range(3, 43))
    run(sched, runner, [req("a", prompt, 3)])
    b = req("b", prompt, 3)
    sched.add(b)
    batch = sched.next_batch()
    (row,) = batch.extend_rows
    assert b.cached_tokens == row.start_pos == 36  # page aligned, last token left over
    assert row.input_ids == prompt[36:] and row.sample
    sched.process_results(batch, runner.forward(batch))
    run(sched, runner, [])
    assert b.output_ids == reference_output(prompt, 3)
    assert sched.stats().prefix_hit_tokens == 36


# ---- retraction ----


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_resumes_without_loss(overlap):
    sched, runner = make(num_pages=24, chunked_prefill_size=None, overlap=overlap)
    reqs = [req(f"r{i}", [20 + i] * 12, 40, ignore_eos=True) for i in range(4)]
    retracted = set()

    def watch(_):
        check_invariants(sched)
        retracted.update(r.rid for r in sched.waiting if r.num_retractions)

    for r in reqs:
        sched.add(r)
    drive(sched, runner, overlap, on_step=watch)
    assert retracted and sched.stats().num_retractions >= len(retracted)
    for r in reqs:
        assert r.output_ids == reference_output(r.prompt_ids, 40, True)
    assert_drained(sched)


# ---- abort ----


def test_abort_in_every_state():
    sched, runner = make(num_pages=30, max_running=2, chunked_prefill_size=16)
    waiting, running = req("waiting", [5] * 8, 20), req("running", [6] * 8, 40, ignore_eos=True)
    chunked = req("chunked", range(3, 83), 5)
    for r in (running, chunked, waiting):
        sched.add(r)
    for _ in range(3):  # running decodes, chunked is mid-prefill, waiting has no slot
        batch = sched.next_batch()
        sched.process_results(batch, runner.forward(batch))
    assert chunked.is_prefilling and running.output_ids and waiting.status is ReqStatus.WAITING
    for r in (waiting, chunked, running):
        assert sched.abort(r.rid, "client left") is r
        assert r.finished and r.finish_reason == FinishReason("abort", message="client left")
        check_invariants(sched)
    assert sched.abort("running") is None
    assert_drained(sched)
    late = req("late", [7] * 9, 6)
    run(sched, runner, [late])
    assert late.output_ids == reference_output(late.prompt_ids, 6)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_pages", [400, 40])
def test_random_aborts_leave_others_intact(overlap, num_pages):
    sched, runner = make(num_pages=num_pages, chunked_prefill_size=16, overlap=overlap)
    reqs = workload(seed=1)
    rng = random.Random(2)
    abort_at = {r.rid: rng.randrange(1, 60) for r in rng.sample(reqs, 8)}

    def maybe_abort(step: int) -> None:
        check_invariants(sched)
        for rid, at in abort_at.items():
            if at == step:
                sched.abort(rid)

    for r in reqs:
        sched.add(r)
    streamed = drive(sched, runner, overlap, on_step=maybe_abort)
    for r in reqs:
        expected = reference_output(r.prompt_ids, r.sampling.max_new_tokens, r.sampling.ignore_eos)
        if r.finish_reason.kind == "abort":
            assert r.output_ids == expected[: len(r.output_ids)]
        else:
            assert r.output_ids == expected
        assert streamed.get(r.rid, []) == r.output_ids
    assert_drained(sched)


def test_abort_under_overlap_discards_in_flight_token():
    sched, runner = make(overlap=True)
    r = req("r", [5] * 6, 20, ignore_eos=True)
    sched.add(r)
    first = sched.next_batch()
    second = sched.next_batch()  # launched before first's results: a PREV_TOKEN decode row
    assert second.decode_rows[0].input_ids == [PREV_TOKEN]
    out1, out2 = runner.forward(first), runner.forward(second)
    assert len(sched.process_results(first, out1)) == 1
    sched.abort("r")
    assert sched.process_results(second, out2) == []
    assert r.output_ids == reference_output(r.prompt_ids, 1)
    assert_drained(sched)


# ---- finishing ----


def test_stop_string_cuts_output():
    base = req("base", [11] * 5, 60, ignore_eos=True)
    ref = reference_output(base.prompt_ids, 60, True)
    text = fake_decode(ref)
    stop = text[20:23]
    k = text.find(stop) + len(stop)
    sched, runner = make()
    r = req("r", [11] * 5, 60, ignore_eos=True, stop=("zzzzzzzz", stop))
    run(sched, runner, [r])
    assert r.output_ids == ref[:k]
    assert r.finish_reason == FinishReason("stop", matched=stop)
    assert r.finish_reason.trim(fake_decode(r.output_ids)) == text[: text.find(stop)]


def test_stop_token_ids_eos_and_length():
    ref = reference_output([8] * 5, 200, ignore_eos=True)
    stop_tok = ref[10]
    sched, runner = make(num_pages=600)
    by_stop = req("stop", [8] * 5, 200, ignore_eos=True, stop_token_ids=(stop_tok,))
    by_eos = req("eos", [8] * 5, 200)
    by_len = req("len", [8] * 5, 3, ignore_eos=True)
    zero = req("zero", [8] * 5, 0)
    run(sched, runner, [by_stop, by_eos, by_len, zero])
    assert by_stop.output_ids == ref[: ref.index(stop_tok) + 1]
    assert by_stop.finish_reason == FinishReason("stop", matched=stop_tok)
    assert EOS in ref and by_eos.output_ids == ref[: ref.index(EOS) + 1]
    assert by_eos.finish_reason == FinishReason("stop", matched=EOS)
    assert by_len.output_ids == ref[:3] and by_len.finish_reason.kind == "length"
    assert zero.output_ids == [] and zero.finish_reason.kind == "length"


def test_logprobs_are_recorded():
    sched, _ = make()
    r = req("r", [3] * 5, 2, logprobs=True, top_logprobs=2)
    sched.add(r)
    batch = sched.next_batch()
    top = (np.array([[7, 8, 9]]), np.array([[-0.1, -2.0, -3.0]]))
    out = StepOutput(np.array([7]), logprobs=np.array([-0.1]), top_logprobs=top)
    sched.process_results(batch, out)
    assert r.output_logprobs == [pytest.approx(-0.1)]
    assert r.output_top_logprobs == [([7, 8], [pytest.approx(-0.1), -2.0])]


# ---- policy and API ----


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_longest_prefix_match_first(policy):
    sched, runner = make(schedule_policy=policy, max_extend_seqs=1)
    shared = list(range(3, 35))
    run(sched, runner, [req("warm", shared + [1], 1)])
    cold, hot = req("cold", [900] * 33, 1), req("hot", shared + [2], 1)
    sched.add(cold)
    sched.add(hot)
    first = sched.next_batch().extend_rows[0].req
    assert first is (hot if policy == "lpm" else cold)


def test_add_rejects_what_can_never_run():
    sched, _ = make(num_pages=10, max_context_len=30)
    sched.add(req("a", [1], 4))
    for bad, match in [
        (req("a", [1], 4), "duplicate"),
        (req("b", [], 4), "empty prompt"),
        (req("c", [1] * 20, 20), "context length"),
    ]:
        with pytest.raises(ValueError, match=match):
            sched.add(bad)
    with pytest.raises(ValueError, match="KV pages"):
        make(num_pages=4)[0].add(req("d", [1] * 10, 10))
    with pytest.raises(ValueError, match="tokenizer"):
        Scheduler(sched.config, [EOS]).add(req("e", [1], 4, stop=("x",)))


def test_results_must_come_back_in_step():
    sched, _ = make(overlap=False)
    sched.add(req("a", [1, 2], 4))
    sched.add(req("b", [1, 3], 4))
    sched.next_batch()
    with pytest.raises(RuntimeError, match="await process_results"):
        sched.next_batch()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_new_tokens", -1),
        ("max_new_tokens", 10**9),
        ("stop_token_ids", (5, VOCAB)),
        ("top_logprobs", 21),
        ("stop", ("",)),
    ],
)
def test_sampling_params_validate(field, value):
    with pytest.raises(ValueError, match=f"sampling_params.{field}="):
        SamplingParams(**{field: value}).validate(VOCAB)


def test_sampling_params_from_dict():
    sp = SamplingParams.from_dict({"temperature": 0, "stop": "###", "stop_token_ids": [5]})
    assert sp.stop == ("###",) and sp.stop_token_ids == (5,) and sp.temperature == 0
    sp.validate(VOCAB)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1.0})


# ---- multi-step decode (runtime/multi_step.py) ----


def count_steps(runner: FakeRunner) -> list[int]:
    """Record each launched batch's steps."""
    seen, forward = [], runner.forward

    def wrapped(batch):
        seen.append(batch.steps)
        return forward(batch)

    runner.forward = wrapped
    return seen


@pytest.mark.parametrize("num_pages", [400, 36], ids=["big_pool", "tiny_pool"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_multi_step_outputs_equal_alone(alone, mixed, overlap, num_pages):
    sched, runner = make(num_pages=num_pages, chunked_prefill_size=16, enable_mixed_chunk=mixed,
                         overlap=overlap, max_running=16, num_scheduler_steps=4)
    steps = count_steps(runner)
    run_in_waves(sched, runner, overlap, alone)
    # On the tiny pool retracted requests wait with free slots, so most batches are single.
    assert steps.count(4) >= (5 if num_pages == 400 else 1) and steps.count(1) >= 10
    if num_pages == 36:
        assert sched.stats().num_retractions > 0
    assert_drained(sched)


def test_multi_step_only_when_nothing_can_be_admitted():
    sched, runner = make(num_scheduler_steps=4, max_running=2)
    a, b, c = (req(x, [5 + i] * 6, 30, ignore_eos=True) for i, x in enumerate("abc"))
    sched.add(a)
    first = sched.next_batch()  # a's prefill
    sched.process_results(first, runner.forward(first))
    batch = sched.next_batch()
    assert batch.steps == 4 and [r.num_steps for r in batch.rows] == [4]
    assert a.kv_len == 10 and a.num_pending == 4 and len(a.pages) == pages_for(10, PS)
    sched.process_results(batch, runner.forward(batch))
    assert len(a.output_ids) == 5
    sched.add(b)  # a free slot: b prefills first, a single step beside nothing
    batch = sched.next_batch()
    assert batch.steps == 1 and batch.mode is ForwardMode.EXTEND
    sched.process_results(batch, runner.forward(batch))
    sched.add(c)  # no free slot for c: a and b may run 4 steps
    batch = sched.next_batch()
    assert batch.steps == 4 and len(batch.rows) == 2
    sched.process_results(batch, runner.forward(batch))


def test_multi_step_stops_where_single_steps_stop():
    ref = reference_output([8] * 5, 200, ignore_eos=True)
    stop_tok = ref[10]
    base = reference_output([11] * 5, 60, True)
    text = fake_decode(base)
    stop = text[21:24]
    sched, runner = make(num_pages=600, num_scheduler_steps=4)
    by_stop = req("stop", [8] * 5, 200, ignore_eos=True, stop_token_ids=(stop_tok,))
    by_eos = req("eos", [8] * 5, 200)
    by_len = req("len", [8] * 5, 7, ignore_eos=True)  # 1 + 4 + 2: the last batch runs 2
    by_str = req("str", [11] * 5, 60, ignore_eos=True, stop=(stop,))
    steps = count_steps(runner)
    run(sched, runner, [by_stop, by_eos, by_len, by_str])
    assert 4 in steps
    assert by_stop.output_ids == ref[: ref.index(stop_tok) + 1]
    assert EOS in ref and by_eos.output_ids == ref[: ref.index(EOS) + 1]
    assert by_len.output_ids == ref[:7] and by_len.finish_reason.kind == "length"
    k = text.find(stop) + len(stop)
    assert by_str.output_ids == base[:k] and by_str.finish_reason.matched == stop
    assert_drained(sched)


def test_multi_step_logprobs_and_abort_in_flight():
    sched, runner = make(num_scheduler_steps=3, overlap=True)
    r = req("r", [3] * 5, 20, logprobs=True, top_logprobs=1, ignore_eos=True)
    sched.add(r)
    first = sched.next_batch()  # prefill
    second = sched.next_batch()  # 3 steps, launched before first's results
    assert second.steps == 3 and second.rows[0].input_ids == [PREV_TOKEN]
    sched.process_results(first, StepOutput(np.array([7]), np.array([-0.5]),
                                            (np.array([[7]]), np.array([[-0.5]]))))
    top = (np.array([[[4], [5], [6]]]), np.array([[[-1.0], [-2.0], [-3.0]]]))
    events = sched.process_results(second, StepOutput(np.array([[4, 5, 6]]),
                                                      np.array([[-1.0, -2.0, -3.0]]), top))
    assert [e.new_token_ids for e in events] == [[4, 5, 6]] and r.output_ids == [7, 4, 5, 6]
    assert r.output_logprobs == [-0.5, -1.0, -2.0, -3.0]
    assert r.output_top_logprobs[1:] == [([4], [-1.0]), ([5], [-2.0]), ([6], [-3.0])]
    third = sched.next_batch()
    assert third.steps == 3 and r.num_pending == 3
    sched.abort("r")
    assert sched.process_results(third, StepOutput(np.array([[1, 2, 3]]))) == []
    assert r.output_ids == [7, 4, 5, 6] and r.num_pending == 0
    assert_drained(sched)
