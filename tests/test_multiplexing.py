"""The multiplexing loop and its interval policy on the host alone, with a fake runner.

The fake's split prefill writes its rows' tokens into the fake KV pool at every interval
(as each layer of a real one writes its K/V) and samples after the last, so a request
decoded before its prefill sampled, a page written after it was freed, or a held request
retracted all change tokens or trip an assertion.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from runtime.config import CacheConfig, SchedulerConfig
from runtime.multiplexing import IntervalPolicy, MultiplexLoop
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import ScheduleBatch, StepOutput
from runtime.scheduler import Scheduler
from runtime.split_prefill import SplitPrefill, interval_sizes
from runtime.step_costs import DeviceCosts
from tests.fake_runner import (
    EOS,
    FakeRunner,
    cache_slots,
    check_invariants,
    next_token,
    reference_output,
)

LAYERS = 5  # odd: one-layer intervals are compiled (split_prefill.interval_sizes)


class _Done:
    def __init__(self, batch: ScheduleBatch, out: StepOutput) -> None:
        self.batch, self._out = batch, out

    shape, detail = None, None  # the fake pads nothing and keeps no path record

    def result(self) -> StepOutput:
        return self._out

    def is_ready(self) -> bool:
        return True


class FakeSplitRunner(FakeRunner):
    """FakeRunner plus the split-prefill launches; `log` records every launch in order."""

    def __init__(self, sched: Scheduler, *args, decode_cost: float = 0.05,
                 layer_cost: float = 0.02) -> None:
        super().__init__(*args)
        self.sched, self.log = sched, []
        self.costs = (decode_cost, layer_cost)
        self.interval_sizes = interval_sizes(LAYERS)
        self.compiles_after_warmup = 0

    def bucket_for(self, batch: ScheduleBatch) -> None:
        return None  # the fake pads nothing

    def launch(self, batch: ScheduleBatch) -> _Done:
        self.log.append(("decode", len(batch.decode_rows)) if batch.decode_rows
                        else ("whole", batch.num_tokens))
        return _Done(batch, self.forward(batch))

    def can_split(self, batch: ScheduleBatch) -> bool:
        return batch.num_tokens > 12  # small prefills run whole

    def start_split(self, batch: ScheduleBatch) -> SplitPrefill:
        return SplitPrefill(batch, shape=None, arrays={}, hidden=None, num_layers=LAYERS)

    def run_interval(self, split: SplitPrefill, k: int) -> None:
        """Each interval writes the live rows' tokens, only into pages they still own."""
        owned = {p for r in self.sched.running for p in r.pages}
        for row in split.batch.extend_rows:
            if row.req.finished:  # aborted: its pages may belong to someone else now
                continue
            assert owned.issuperset(row.pages), "split writes a page its request lost"
            self.kv[cache_slots(row.pages, row.start_pos, row.end_pos, self.page_size)] = \
                row.input_ids
        split.advance(k)
        self.log.append(("interval", k))

    def finish_split(self, split: SplitPrefill) -> _Done:
        assert split.done
        tokens = []
        for row in split.batch.extend_rows:
            seq = self.kv[cache_slots(row.pages, 0, row.end_pos, self.page_size)]
            tok = next_token(seq) if row.req.finished or (seq >= 0).all() else -1
            assert tok >= 0, "read a slot nothing wrote"
            if row.sample:
                self.last[row.req.req_slot] = tok
            tokens.append(tok)
        self.log.append(("sample", len(tokens)))
        return _Done(split.batch, StepOutput(np.asarray(tokens, np.int64)))

    def launch_fused(self, decode: ScheduleBatch, split: SplitPrefill, k: int) -> _Done | None:
        """As one program: the decode rows' step and the split's interval (None for an odd
        k, so the loop's fallback to two calls runs too)."""
        if k % 2:
            return None
        self.log.append(("fused", k))
        done = _Done(decode, self.forward(decode))
        self.run_interval(split, k)
        return done

    def step_cost(self, batch: ScheduleBatch) -> float:
        return self.costs[0]

    def layer_cost(self, split: SplitPrefill) -> float:
        return self.costs[1]


def _setup(num_pages=200, chunk=None, overlap=True, prefix=True, policy=None,
           interleave=True, max_running=8, fused=False):
    cfg = SchedulerConfig(cache=CacheConfig(page_size=4, num_pages=num_pages),
                          max_running_requests=max_running, max_prefill_tokens=64,
                          chunked_prefill_size=chunk, max_extend_seqs=4, overlap=overlap,
                          disable_prefix_cache=not prefix)
    sched = Scheduler(cfg, eos_token_ids=[EOS])
    runner = FakeSplitRunner(sched, num_pages, 4, max_running + 1)
    # Slowdown 2 at the fake's costs: two-layer intervals, which the fake also runs fused.
    loop = MultiplexLoop(sched, runner, runner, policy or IntervalPolicy(None, 0.0, 2.0),
                         overlap, interleave, runner if fused else None)
    return sched, runner, loop


def _run(sched, loop, arrivals: dict[int, list[Req]], on_step=None, max_steps=5000):
    streamed = defaultdict(list)
    for step in range(max_steps):
        for req in arrivals.pop(step, []):
            sched.add(req)
        if on_step is not None:
            on_step(step)
        for ev in loop.step():
            streamed[ev.req.rid] += ev.new_token_ids
        check_invariants(sched)
        if not arrivals and sched.is_idle() and not loop.has_pending:
            return streamed
    raise RuntimeError("not idle")


def _workload(seed=0):
    """Short prompts decoding first, then long ones arriving while they run; some share
    a prefix."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(3, 1000, 20)]
    reqs = {}
    for i in range(10):
        n = int(rng.integers(40, 120)) if i >= 4 else int(rng.integers(2, 12))
        body = [int(t) for t in rng.integers(3, 1000, n)]
        prompt = system + body if i % 3 == 0 else body
        reqs[i] = Req(rid=f"r{i}", prompt_ids=prompt,
                      sampling=SamplingParams(max_new_tokens=int(rng.integers(4, 20))))
    # A lone short prompt late: a prefill small enough to run whole.
    reqs[10] = Req(rid="r10", prompt_ids=[7, 8, 9, 10, 11],
                   sampling=SamplingParams(max_new_tokens=6))
    arrivals = {0: [reqs[i] for i in range(4)], 3: [reqs[4], reqs[5]], 6: [reqs[6]],
                9: [reqs[7], reqs[8], reqs[9]], 12: [reqs[10]]}
    want = {r.rid: reference_output(r.prompt_ids, r.sampling.max_new_tokens)
            for r in reqs.values()}
    return arrivals, want


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("fused", [False, True])
def test_multiplexed_tokens_equal_reference(overlap, prefix, chunk, fused):
    sched, runner, loop = _setup(chunk=chunk, overlap=overlap, prefix=prefix, fused=fused)
    arrivals, want = _workload()
    assert _run(sched, loop, arrivals) == want
    assert runner.kv is not None and sched.allocator.num_used == sched.prefix_cache.num_pages
    kinds = {k for k, _ in runner.log}
    assert ("fused" in kinds) == fused
    assert {"whole", "interval", "sample"} <= kinds  # small prefills run unsplit


def test_decode_runs_between_intervals_of_a_long_prefill():
    sched, runner, loop = _setup(policy=IntervalPolicy(1, 0.0))
    rng = np.random.default_rng(1)
    stream = Req(rid="s", prompt_ids=[5, 6, 7],
                 sampling=SamplingParams(max_new_tokens=300, ignore_eos=True))
    longs = [Req(rid=f"l{i}", prompt_ids=[int(t) for t in rng.integers(3, 1000, 50)],
                 sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(4)]
    got = _run(sched, loop, {0: [stream], 2: longs[:2], 5: longs[2:]})
    assert got["s"] == reference_output(stream.prompt_ids, 300, ignore_eos=True)
    # While `s` decodes, every iteration is one decode step and one interval: never two
    # intervals back to back, and every prefill took LAYERS intervals of one layer.
    kinds = [k for k, _ in runner.log]
    span = kinds[kinds.index("decode"):len(kinds) - kinds[::-1].index("sample")]
    assert ("interval", "interval") not in list(zip(span, span[1:], strict=False))
    assert span.count("interval") == LAYERS * span.count("sample") == LAYERS * len(longs)


def test_without_interleave_a_prefill_runs_whole_before_decode():
    sched, runner, loop = _setup(interleave=False)
    arrivals, want = _workload()
    assert _run(sched, loop, arrivals) == want
    kinds = [k for k, _ in runner.log]
    for i, k in enumerate(kinds):
        if k == "interval" and kinds[i + 1] != "sample":
            assert kinds[i + 1] == "interval"


def test_interval_policy():
    fixed = IntervalPolicy(4, 0.0)
    assert fixed.layers(30, 0.05, 0.01) == 4 and fixed.layers(3, 0.05, 0.01) == 3
    auto = IntervalPolicy(None, 0.0, 2.0)
    assert auto.layers(30, None, 0.01) == 1 and auto.layers(30, 0.05, None) == 1
    # target = 2 x 50 ms: 50 ms left for layers of 10 ms.
    assert auto.layers(30, 0.05, 0.01) == 5
    assert auto.layers(30, 0.05, 0.2) == 1  # always progress
    target = IntervalPolicy(None, 0.2)
    assert target.layers(30, 0.05, 0.01) == 15 and target.layers(7, 0.05, 0.01) == 7
    # the default slowdown, 3: 100 ms beside a 50 ms decode step.
    assert IntervalPolicy(None, 0.0).layers(30, 0.05, 0.01) == 10
    with pytest.raises(ValueError, match="multiplex_decode_slowdown=1"):
        IntervalPolicy(None, 0.0, 1.0)


def test_prefill_first_policy():
    burst = IntervalPolicy(None, 0.0, fill_fraction=0.75)
    assert burst.prefill_first(0, 5, 0.0)  # nothing to decode
    assert burst.prefill_first(2, 30, 60.0)  # 2 of 32: fill the batch first
    assert not burst.prefill_first(24, 8, 0.0)  # 24 of 32 = 0.75: multiplex
    assert not burst.prefill_first(16, 4, 0.0)  # long prompts joining a full batch
    assert not IntervalPolicy(None, 0.0).prefill_first(1, 30, 0.0)  # 0: always multiplex
    capped = IntervalPolicy(None, 0.0, fill_fraction=0.75, max_stall_s=2.0)
    assert capped.prefill_first(2, 30, 1.9)
    assert not capped.prefill_first(2, 30, 2.0)  # waited 2 s: the streams get a step
    with pytest.raises(ValueError, match="multiplex_fill_fraction=1"):
        IntervalPolicy(None, 0.0, fill_fraction=1.0)


def _burst(policy, n=8):
    """n requests of 30-60 tokens arriving together (all split) on an 8-slot batch."""
    sched, runner, loop = _setup(policy=policy, max_running=8)
    rng = np.random.default_rng(3)
    reqs = [Req(rid=f"b{i}", prompt_ids=[int(t) for t in rng.integers(3, 1000, 30 + 4 * i)],
                sampling=SamplingParams(max_new_tokens=12, ignore_eos=True)) for i in range(n)]
    got = _run(sched, loop, {0: reqs})
    for r in reqs:
        assert got[r.rid] == reference_output(r.prompt_ids, 12, ignore_eos=True)
    return runner.log


def _decodes_before_last_sample(log) -> list[int]:
    last = len(log) - [k for k, _ in log][::-1].index("sample")
    return [rows for kind, rows in log[:last] if kind == "decode"]


def test_a_burst_fills_the_batch_before_it_multiplexes():
    always = _decodes_before_last_sample(_burst(IntervalPolicy(None, 0.0, 2.0)))
    first = _decodes_before_last_sample(_burst(IntervalPolicy(None, 0.0, 2.0, 0.75)))
    # Multiplexing from the first prompt on decodes the early streams in small batches;
    # filling first decodes only once 6 of the 8 (0.75) can.
    assert min(always) < 6 and len(first) < len(always)
    assert first and min(first) >= 6
    # A stall bound of (almost) no time gives the streams a step every iteration again.
    capped = _decodes_before_last_sample(_burst(IntervalPolicy(None, 0.0, 2.0, 0.75, 1e-6)))
    assert min(capped) < 6 and len(capped) > len(first)


def test_long_prompts_joining_a_full_batch_are_multiplexed():
    """6 streams decoding when 2 long prompts arrive: 6 of 8 is the fill fraction, so the
    prompts' intervals interleave with decode steps instead of running first."""
    sched, runner, loop = _setup(policy=IntervalPolicy(1, 0.0, fill_fraction=0.75))
    rng = np.random.default_rng(2)
    streams = [Req(rid=f"s{i}", prompt_ids=[5, 6, 7 + i],
                   sampling=SamplingParams(max_new_tokens=60, ignore_eos=True))
               for i in range(6)]
    longs = [Req(rid=f"l{i}", prompt_ids=[int(t) for t in rng.integers(3, 1000, 50)],
                 sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(2)]
    got = _run(sched, loop, {0: streams, 8: longs})
    assert got["s0"] == reference_output(streams[0].prompt_ids, 60, ignore_eos=True)
    kinds = [k for k, _ in runner.log]
    first = kinds.index("interval")
    span = kinds[first:len(kinds) - kinds[::-1].index("sample")]
    assert ("interval", "interval") not in list(zip(span, span[1:], strict=False))


class _AnyGrammar:
    """A grammar that allows every token and records the ones it was fed."""

    done, error = False, None

    def __init__(self) -> None:
        self.fed: list[int] = []

    def accept(self, token: int) -> bool:
        self.fed.append(token)
        return True


@pytest.mark.parametrize("fused", [False, True])
def test_a_constrained_stream_decodes_only_after_its_last_token_is_read(fused):
    """Overlap on: a decode step with a grammar row launches only once every earlier
    launch is read back (its mask needs the tokens in flight); free rows keep overlap."""
    sched, runner, loop = _setup(fused=fused)
    seen = []
    forward = runner.forward

    def checked(batch):  # every launch, fused or not, runs the fake's forward
        seen.extend(r.req.num_pending for r in batch.decode_rows if r.req.grammar is not None)
        return forward(batch)

    runner.forward = checked
    free = Req(rid="f", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=30,
                                                                       ignore_eos=True))
    constrained = Req(rid="c", prompt_ids=[5, 6, 8], grammar=_AnyGrammar(),
                      sampling=SamplingParams(max_new_tokens=30, ignore_eos=True))
    rng = np.random.default_rng(4)
    longs = [Req(rid=f"l{i}", prompt_ids=[int(t) for t in rng.integers(3, 1000, 40)],
                 sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)) for i in range(2)]
    got = _run(sched, loop, {0: [free, constrained], 4: longs})
    assert got["c"] == constrained.grammar.fed == reference_output([5, 6, 8], 30,
                                                                   ignore_eos=True)
    assert got["f"] == reference_output([5, 6, 7], 30, ignore_eos=True)
    assert seen and set(seen) == {1}  # only this step's token pending at launch
    fused_launches = [k for k, _ in runner.log if k == "fused"]
    assert bool(fused_launches) == fused


def test_abort_mid_split_frees_pages_at_once():
    sched, runner, loop = _setup(policy=IntervalPolicy(1, 0.0))
    short = Req(rid="s", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=40,
                                                                        ignore_eos=True))
    long_ = Req(rid="l", prompt_ids=list(range(3, 60)), sampling=SamplingParams(max_new_tokens=4))
    sched.add(short)
    for _ in range(3):
        loop.step()
    sched.add(long_)
    loop.step()  # starts the split of `long_`, runs its first interval
    assert loop.split is not None and long_ in {r.req for r in loop.split.batch.extend_rows}
    used = sched.allocator.num_used
    sched.abort("l")
    assert sched.allocator.num_used < used  # freed at once, mid-split
    streamed = _run(sched, loop, {})
    assert "l" not in streamed and long_.finished
    assert sched.allocator.num_used == sched.prefix_cache.num_pages


def test_pool_pressure_during_a_split_retracts_others_never_the_held():
    # 24 pages of 4 tokens: decode growth forces retractions while prefills split.
    sched, runner, loop = _setup(num_pages=25, policy=IntervalPolicy(1, 0.0), max_running=6)
    rng = np.random.default_rng(5)
    reqs = [Req(rid=f"p{i}", prompt_ids=[int(t) for t in rng.integers(3, 1000, 10 + 3 * i)],
                sampling=SamplingParams(max_new_tokens=20, ignore_eos=True)) for i in range(6)]
    retract = sched._retract

    def checked_retract(req: Req) -> None:
        assert req not in sched._held, "retracted a request whose split prefill is in flight"
        retract(req)

    sched._retract = checked_retract
    got = _run(sched, loop, {0: reqs[:3], 2: reqs[3:]})
    assert sched.stats().num_retractions > 0
    assert got == {r.rid: reference_output(r.prompt_ids, 20, ignore_eos=True) for r in reqs}


def test_device_costs_charge_each_launch_its_own_device_time():
    """Launches run in order: each is charged from when the device could start it."""
    class Output:
        def __init__(self, ready: threading.Event) -> None:
            self.ready = ready

        def block_until_ready(self) -> None:
            self.ready.wait(5)

    costs = DeviceCosts(smoothing=1.0)
    first, second = threading.Event(), threading.Event()
    costs.watch("a", Output(first))
    costs.watch("b", Output(second), per=2)
    time.sleep(0.05)
    first.set()  # a ran ~50 ms
    time.sleep(0.1)
    second.set()  # b started when a finished and ran ~100 ms, over 2 layers
    deadline = time.monotonic() + 5
    while costs.get("b") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0.04 <= costs.get("a") < 0.2
    assert 0.04 <= costs.get("b") < 0.15  # ~0.1 s / 2
    costs.record("a", 1.0)
    assert costs.get("a") == 1.0 and set(costs.snapshot()) == {"a", "b"}


def test_device_costs_charge_beyond_a_base():
    """A fused step charges its interval only what it took beyond the decode step; with
    the base unmeasured nothing is recorded."""
    class Done:
        def block_until_ready(self) -> None:
            time.sleep(0.1)

    costs = DeviceCosts(smoothing=1.0)
    costs.watch("interval", Done(), per=2, base="decode")  # no decode cost yet
    costs.close()
    assert costs.get("interval") is None
    costs.record("decode", 0.06)
    costs.watch("interval", Done(), per=2, base="decode")
    costs.close()
    assert 0.015 <= costs.get("interval") < 0.06  # (~0.1 s - 0.06 s) / 2
