"""The decode-first prefill policy (runtime/prefill_policy.py) on the host scheduler with
the fake runner: decode rows in every step while a long prompt prefills, chunk sizes that
follow the cost model, a whole EXTEND when nothing decodes, prefill first without it, and
the same tokens as every request run alone."""

from __future__ import annotations

import pytest

from models.forward_mode import ForwardMode
from runtime.config import CacheConfig, SchedulerConfig, ServerArgs
from runtime.exec_trace import ExecutionTrace, step_record
from runtime.prefill_policy import (
    YOUNG_STREAM_TOKENS,
    PrefillPolicy,
    SplitShape,
    StepCosts,
    chunk_buckets,
    default_target,
    extend_work,
    policy_shapes,
    split_pays,
)
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import ScheduleBatch
from runtime.scheduler import Scheduler
from tests.fake_runner import EOS, FakeRunner, check_invariants, fake_decode, reference_output

PS = 4
MAX_RUNNING = 8
CHUNK = 64
# 10 ms a decode step, 1 ms a token of extend work, attention pairs at 1/500 of a token:
# against a 50 ms target a chunk of 32 fits up to position ~125, one of 16 to ~740.
COSTS = StepCosts(decode_s=0.010, step_s=0.0, token_s=0.001, pair_weight=0.002)
SHAPES = policy_shapes((16, 32, CHUNK), 4, MAX_RUNNING)


def make(policy: PrefillPolicy | None, **kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(cache=CacheConfig(page_size=PS, num_pages=400),
                          max_running_requests=MAX_RUNNING, chunked_prefill_size=CHUNK,
                          max_prefill_tokens=CHUNK, **kw)
    return (Scheduler(cfg, [EOS], fake_decode, policy=policy),
            FakeRunner(400, PS, MAX_RUNNING))


def policy(target_s: float = 0.050) -> PrefillPolicy:
    return PrefillPolicy(target_s, COSTS, SHAPES)


def req(rid: str, prompt: list[int], max_new: int, **kw) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kw))


def step(sched: Scheduler, runner: FakeRunner):
    batch = sched.next_batch()
    sched.process_results(batch, runner.forward(batch))
    check_invariants(sched)
    return batch


def decode_past_youth(sched: Scheduler, runner: FakeRunner, n: int) -> list[Req]:
    """n short requests decoding, each past its first YOUNG_STREAM_TOKENS tokens."""
    running = [req(f"run{i}", [5 + i] * 6, 200) for i in range(n)]
    for r in running:
        sched.add(r)
    while any(r.num_generated <= YOUNG_STREAM_TOKENS for r in running):
        step(sched, runner)
    return running


def prefill_beside(sched: Scheduler, runner: FakeRunner, running: list[Req],
                   long: Req) -> list[tuple[ScheduleBatch, list[int]]]:
    """Add `long` and step until its first token: each step's batch and the tokens each
    of `running` gained in that step."""
    sched.add(long)
    steps = []
    while long.num_generated == 0:
        before = [len(r.output_ids) for r in running]
        batch = step(sched, runner)
        steps.append((batch, [len(r.output_ids) - b for r, b in zip(running, before,
                                                                      strict=True)]))
    return steps


def test_decode_rows_ride_every_step_of_a_long_prefill():
    sched, runner = make(policy())
    running = decode_past_youth(sched, runner, 3)
    long = req("long", range(3, 403), 4)
    chunks = []
    for batch, grown in prefill_beside(sched, runner, running, long):
        assert batch.mode is ForwardMode.MIXED  # the chunk never runs without them
        assert {r.req.rid for r in batch.decode_rows} == {r.rid for r in running}
        assert grown == [1] * len(running)
        chunks.append(batch.extend_rows[0])
        assert batch.decision.path == "mixed" and batch.decision.decode_rows == 3
    # Each chunk is the largest bucket whose predicted step fits the 50 ms target: 32
    # tokens while the prefix is short, 16 once the attention over it makes 32 too slow.
    for row in chunks[:-1]:
        n, fits = len(row.input_ids), COSTS.mixed_s(len(row.input_ids), row.start_pos)
        assert fits <= 0.050
        bigger = [b for b in (16, 32, CHUNK) if b > n]
        assert not bigger or COSTS.mixed_s(bigger[0], row.start_pos) > 0.050
    sizes = [len(r.input_ids) for r in chunks]
    assert sizes[0] == 32 and 16 in sizes
    assert long.output_ids == reference_output(long.prompt_ids, 1)


def test_no_chunk_fits_the_smallest_still_advances():
    sched, runner = make(policy(target_s=0.001))
    decode_past_youth(sched, runner, 2)
    sched.add(req("long", range(3, 103), 2))
    batch = step(sched, runner)
    assert batch.mode is ForwardMode.MIXED and len(batch.extend_rows[0].input_ids) == 16
    assert batch.decision.reason.startswith("no chunk fits")


def test_whole_extend_when_nothing_decodes():
    sched, runner = make(policy())
    prompts = [req(f"r{i}", [7 + i] * 15, 3) for i in range(4)]
    for r in prompts:
        sched.add(r)
    batch = step(sched, runner)
    # The chunked-prefill budget, four prompts in one EXTEND, no matter the target.
    assert batch.mode is ForwardMode.EXTEND and len(batch.extend_rows) == 4
    assert batch.decision.path == "extend" and batch.decision.chunk_tokens == 60


def test_young_streams_take_the_largest_chunk():
    """A burst: the first prompts' streams are young, so the rest prefill in the largest
    chunks (with several rows) while they decode beside them."""
    sched, runner = make(policy())
    burst = [req(f"b{i}", [9 + i] * 30, 20) for i in range(8)]
    for r in burst:
        sched.add(r)
    first = step(sched, runner)
    assert first.mode is ForwardMode.EXTEND and len(first.extend_rows) == 3  # 64 tokens
    second = step(sched, runner)
    assert second.mode is ForwardMode.MIXED and second.decision.path == "mixed_young"
    assert second.decision.chunk_tokens == CHUNK and second.decision.max_rows == 4
    assert sum(len(r.input_ids) for r in second.extend_rows) > 32  # past the target's 32


def test_overload_streams_are_not_young():
    """More prompts waiting than free slots is an overload, not a burst being admitted:
    the young streams get chunks the target bounds."""
    sched, runner = make(policy())
    for i in range(MAX_RUNNING + 6):
        sched.add(req(f"o{i}", [9 + i] * 30, 20))
    assert step(sched, runner).mode is ForwardMode.EXTEND
    second = step(sched, runner)
    assert second.mode is ForwardMode.MIXED and second.decision.path == "mixed"
    assert second.decision.chunk_tokens == 32


def test_a_chunk_filled_from_the_queue_is_priced_from_position_zero():
    """A prompt with a few tokens left leaves the rest of a chunk to the next prompt:
    the prediction counts those tokens, so the largest chunk is not taken for free."""
    p = policy(target_s=0.050)
    near_end = p.plan(3, False, 700, 4, queued=0)  # nothing behind it: any chunk is 4 tokens
    assert near_end.chunk_tokens == CHUNK
    assert near_end.predicted_ms == pytest.approx(1e3 * COSTS.mixed_s(4, 700))
    filled = p.plan(3, False, 700, 4, queued=400)
    assert filled.chunk_tokens == 32
    work = extend_work(4, 700, COSTS.pair_weight) + extend_work(28, 0, COSTS.pair_weight)
    assert filled.predicted_ms == pytest.approx(
        1e3 * (COSTS.decode_s + COSTS.step_s + COSTS.token_s * work))


def test_target_zero_restores_prefill_first():
    """Without a policy (--itl_target_ms=0) a prefill step carries no decode rows."""
    sched, runner = make(None)
    running = decode_past_youth(sched, runner, 3)
    steps = prefill_beside(sched, runner, running, req("long", range(3, 403), 4))
    for batch, grown in steps:
        assert batch.decision is None
        if batch.mode is ForwardMode.EXTEND:
            assert grown == [0] * len(running)  # they wait
    assert {batch.mode for batch, _ in steps} == {ForwardMode.EXTEND}


def test_server_args_turn_the_policy_on_and_off():
    assert ServerArgs().decode_first
    assert not ServerArgs(itl_target_ms=0).decode_first
    for override in (dict(enable_mixed_chunk=True), dict(enable_multiplexing=True),
                     dict(enable_split_prefill=True), dict(chunked_prefill_size=None)):
        assert not ServerArgs(**override).decode_first, override
    with pytest.raises(ValueError, match="itl_target_ms"):
        ServerArgs(itl_target_ms=-1)


def test_policy_shapes_share_the_largest_sampler():
    shapes = policy_shapes(chunk_buckets(512), 4, 32)
    assert shapes == ((64, 1, 31), (96, 1, 31), (128, 1, 31), (256, 1, 31), (512, 4, 28))
    assert {be + bd for _, be, bd in shapes} == {32}
    assert policy_shapes((64,), 4, 1) == ()  # one running request: nothing decodes beside


def test_default_target_is_a_multiple_of_the_decode_step():
    assert default_target(COSTS, 16) == pytest.approx(0.0375)
    slow = StepCosts(decode_s=0.010, step_s=0.0, token_s=0.01, pair_weight=0.0)
    assert default_target(slow, 16) == pytest.approx(slow.mixed_s(16, 0))  # the floor
    assert extend_work(10, 0, 0.0) == 10


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("num_pages", [400, 60], ids=["big_pool", "tiny_pool"])
def test_outputs_equal_alone_under_the_policy(overlap, num_pages):
    """Waves of prompts of every length (some sharing a prefix) with streams decoding: the
    tokens equal each request's reference, through retraction and the prefix cache."""
    cfg = SchedulerConfig(cache=CacheConfig(page_size=PS, num_pages=num_pages),
                          max_running_requests=MAX_RUNNING, chunked_prefill_size=CHUNK,
                          max_prefill_tokens=CHUNK, overlap=overlap)
    sched = Scheduler(cfg, [EOS], fake_decode, policy=policy())
    runner = FakeRunner(num_pages, PS, MAX_RUNNING)
    system = list(range(100, 140))
    reqs = [req(f"r{i}", (system if i % 2 else []) + [3 + i] * (5 + 13 * i), 5 + 3 * i)
            for i in range(12)]
    arrivals = list(reversed(reqs))
    pending, paths = None, set()
    for _ in range(10_000):
        if arrivals and runner.num_batches % 3 == 0:
            sched.add(arrivals.pop())
        batch = sched.next_batch()
        if batch is None and pending is None and not arrivals:
            break
        if batch is not None and batch.decision is not None:
            paths.add(batch.decision.path)
        launched = (batch, runner.forward(batch)) if batch is not None else None
        done, pending = (pending, launched) if overlap else (launched, None)
        if done is not None:
            sched.process_results(*done)
        if batch is None and done is None:
            runner.num_batches += 1  # let the next arrival in
        check_invariants(sched)
    assert sched.is_idle()
    for r in reqs:
        assert r.output_ids == reference_output(r.prompt_ids, r.sampling.max_new_tokens, True)
    assert {"extend", "mixed"} <= paths
    if num_pages == 60:
        assert sched.stats().num_retractions > 0


def test_the_trace_says_which_path_each_prefill_took():
    sched, runner = make(policy())
    trace = ExecutionTrace(64)
    decode_past_youth(sched, runner, 2)
    long = req("long", range(3, 203), 2)
    sched.add(long)
    trace.add_request("long", 0.0)
    while long.num_generated == 0:
        batch = sched.next_batch()
        trace.record(step_record(batch, None, 0.0, 0.0, 0.0, 0))
        sched.process_results(batch, runner.forward(batch))
    meta = trace.finish_request("long", 1.0)
    assert set(meta["prefill_paths"]) == {"mixed"} and meta["prefill_paths"]["mixed"] > 3
    assert "fits the target" in meta["prefill_reason"]
    rec = trace.last(1)[0]
    assert rec["decision"]["path"] == "mixed" and rec["decision"]["target_ms"] == 50.0
    assert trace.prefill_paths()["mixed"] == meta["prefill_paths"]["mixed"]


def test_measured_steps_correct_the_predictions():
    """Steps measured at twice their prediction shrink the chunk that fits."""
    p = policy(target_s=0.050)
    assert p.plan(3, False, 0, None, 10_000).chunk_tokens == 32
    for _ in range(30):
        p.observe(COSTS.mixed_s(32, 0), 2 * COSTS.mixed_s(32, 0))
    assert p.scale == pytest.approx(2.0, rel=0.01)
    decision = p.plan(3, False, 0, None, 10_000)
    assert decision.chunk_tokens == 16 and decision.scale == p.scale
    p.observe(1.0, 100.0)  # one wild measurement moves it a bounded step
    assert p.scale < 2.5


def test_the_default_target_follows_the_decode_step():
    """Without --itl_target_ms the target is 3.75x the decode step as measured while
    serving, from the start-up figure on."""
    p = PrefillPolicy(None, COSTS, SHAPES)
    assert p.target_s == pytest.approx(0.0375)
    for _ in range(40):
        p.observe_decode(0.020)
    assert p.target_s == pytest.approx(0.075, rel=0.01)
    assert p.plan(3, False, 0, None, 10_000).target_ms == pytest.approx(75, rel=0.01)
    assert p.to_json()["decode_ms_now"] == pytest.approx(20, rel=0.01)


# Layer intervals of one 64-token row, of a 32-layer model.
SPLIT = SplitShape(tokens=CHUNK, num_layers=32, sizes=(2, 4, 8, 32))


def test_layer_intervals_where_no_chunk_fits():
    """Past the context where even the smallest chunk overruns the target, the prefill
    advances by layer intervals of the largest chunk beside a DECODE step."""
    p = PrefillPolicy(0.030, COSTS, SHAPES, SPLIT)
    assert p.plan(3, False, 0, None, 1000).path == "mixed"  # 16 tokens from 0: 26 ms
    d = p.plan(3, False, 2000, 600, 0)  # 16 tokens at 2,000: 90 ms
    assert d.path == "interval" and (d.chunk_tokens, d.max_rows) == (CHUNK, 1)
    layer = COSTS.token_s * extend_work(CHUNK, 2000, COSTS.pair_weight) / 32
    assert d.predicted_ms == pytest.approx(1e3 * (COSTS.decode_s + 2 * layer))
    assert "no chunk fits" in d.reason
    # A prompt's last few tokens: the interval is priced at what is left of it.
    assert p.plan(3, False, 2000, 8, 0).predicted_ms == pytest.approx(
        1e3 * (COSTS.decode_s + 2 * COSTS.token_s
               * extend_work(8, 2000, COSTS.pair_weight) / 32))
    without = PrefillPolicy(0.030, COSTS, SHAPES).plan(3, False, 2000, 600, 0)
    assert without.path == "mixed" and without.chunk_tokens == 16
    # Just over the target (16 tokens at 100: 29.2 ms against 28): still the chunk.
    near = PrefillPolicy(0.028, COSTS, SHAPES, SPLIT).plan(3, False, 100, 600, 0)
    assert near.path == "mixed" and near.chunk_tokens == 16


def test_interval_layers_fill_the_target_beside_the_decode_step():
    p = PrefillPolicy(0.030, COSTS, SHAPES, SPLIT)
    assert p.interval_layers(32, 0.010, 0.002, 0, CHUNK) == 10
    assert p.interval_layers(4, 0.010, 0.002, 0, CHUNK) == 4  # what is left
    assert p.interval_layers(32, 0.010, 0.5, 0, CHUNK) == 1  # at least one
    # Not measured yet: the cost model's layer, the decode step as last measured.
    model = COSTS.token_s * extend_work(CHUNK, 2000, COSTS.pair_weight) / 32
    assert p.interval_layers(32, None, None, 2000, CHUNK) == int(0.020 / model)


def test_intervals_pay_only_on_deep_models():
    assert split_pays(30, 2, 512, 64)  # 34 token-equivalents a step against 64
    assert not split_pays(4, 2, 512, 64)


def test_an_interval_holds_its_prompt_while_the_others_decode():
    """The loop's side of an interval decision on the host: the decode rows run as a
    DECODE step, the held prompt is in no decode batch until its split prefill is done,
    and its tokens equal the reference."""
    sched, runner = make(PrefillPolicy(0.030, COSTS, SHAPES, SPLIT))
    running = decode_past_youth(sched, runner, 3)
    long = req("long", range(3, 603), 4)
    sched.add(long)
    paths = []
    while long.num_generated == 0:
        batch = sched.next_batch()
        paths.append(batch.decision.path)
        if batch.decision.path != "interval":
            sched.process_results(batch, runner.forward(batch))
            continue
        assert [r.req for r in batch.extend_rows] == [long]
        decode = ScheduleBatch(ForwardMode.DECODE, [], batch.decode_rows)
        sched.process_results(decode, runner.forward(decode))
        for _ in range(3):  # the split's intervals run beside these
            d = sched.next_decode()
            assert {r.req for r in d.rows} == set(running)
            sched.process_results(d, runner.forward(d))
            check_invariants(sched)
        prefill = ScheduleBatch(ForwardMode.SPLIT_PREFILL, batch.extend_rows, [])
        sched.process_results(prefill, runner.forward(prefill))
        sched.release_prefill()
        check_invariants(sched)
    assert paths[0] == "mixed" and "interval" in paths
    assert long.output_ids == reference_output(long.prompt_ids, 1)
