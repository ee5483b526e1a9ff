"""The host half of data-parallel attention (runtime/dp_attention.py), on the fake runner:
each rank its own pool (page ids from 0 on every rank), its own slots and prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, padded_rows, row_order
from runtime.config import CacheConfig, SchedulerConfig
from runtime.dp_attention import (
    DPBatch,
    DPScheduler,
    dp_pack,
    split_output,
)
from runtime.schedule_batch import StepOutput
from tests.fake_runner import EOS, FakeRunner, drive, fake_decode, reference_output
from tests.test_scheduler import PS, req, workload

DP, PAGES, RUNNING = 2, 120, 4


class DPFakeRunner:
    """Each rank's part on its own fake pool; the results rank after rank."""

    def __init__(self, dp: int, num_pages: int, max_running: int) -> None:
        self.ranks = [FakeRunner(num_pages, PS, dp * max_running) for _ in range(dp)]
        self.idle = 0

    def forward(self, batch: DPBatch) -> StepOutput:
        assert isinstance(batch, DPBatch)
        outs = [r.forward(p) for r, p in zip(self.ranks, batch.parts, strict=True)
                if p is not None]
        self.idle += batch.num_idle
        return StepOutput(np.concatenate([o.next_token_ids for o in outs]))


def make(**kw) -> tuple[DPScheduler, DPFakeRunner]:
    cfg = SchedulerConfig(cache=CacheConfig(page_size=PS, num_pages=PAGES),
                          max_running_requests=RUNNING, **kw)
    return DPScheduler(cfg, DP, [EOS], fake_decode), DPFakeRunner(DP, PAGES, RUNNING)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [None, 16])
def test_every_rank_gives_each_request_its_own_tokens(overlap, chunk):
    sched, runner = make(overlap=overlap, chunked_prefill_size=chunk)
    reqs = workload(n=16)
    for r in reqs:
        sched.add(r)
    got = drive(sched, runner, overlap=overlap)
    for r in reqs:
        assert got[r.rid] == reference_output(r.prompt_ids, r.sampling.max_new_tokens,
                                              r.sampling.ignore_eos), r.rid
    assert min(f.num_batches for f in runner.ranks) > 0  # both ranks ran requests
    stats = sched.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_total_pages == DP * (PAGES - 1)
    for s in sched.ranks:
        s.allocator.check()
        s.prefix_cache.check()


def test_slots_are_disjoint_and_pages_are_each_ranks_own():
    sched, _ = make()
    for i in range(2 * RUNNING):
        sched.add(req(f"r{i}", [5 + i] * 9))
    batch = sched.next_batch()
    slots = {r: {row.req.req_slot for row in p.rows} for r, p in enumerate(batch.parts)}
    assert slots[0] <= set(range(RUNNING)) and slots[1] <= set(range(RUNNING, 2 * RUNNING))
    assert all(row.pages and max(row.pages) < PAGES for row in batch.rows)
    assert sched.config.max_running_requests == DP * RUNNING


def test_routing_follows_the_prefix_cache_then_the_load():
    sched, runner = make(overlap=False)
    system = list(range(10, 42))  # 8 pages
    first = req("a", system + [1, 2, 3], max_new=2)
    sched.add(first)
    assert sched.rank_for(req("x", [7, 8, 9])) == 1  # rank 0 has a request: the other
    drive(sched, runner)
    # "a" finished on rank 0 and left its prefix cached there: a prompt sharing it follows.
    assert sched.rank_for(req("b", system + [4, 5])) == 0
    assert sched.rank_for(req("c", [99] * 40)) == 0  # an idle tie: the lowest rank


def test_a_rank_without_work_is_idle():
    sched, runner = make()
    sched.add(req("only", [3, 4, 5, 6], max_new=5))
    batch = sched.next_batch()
    assert batch.num_idle == 1 and batch.mode is ForwardMode.EXTEND
    sched.process_results(batch, runner.forward(batch))
    drive(sched, runner)
    assert runner.idle >= 5  # every step of the lone request left the other rank idle


def test_abort_and_duplicates_reach_the_right_rank():
    sched, _ = make()
    sched.add(req("a", [1, 2, 3]))
    sched.add(req("b", [1, 2, 4]))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        sched.add(req("a", [5]))
    assert sched.abort("b").rid == "b" and sched.abort("nope") is None
    assert sched.stats().num_waiting == 1


def test_output_split_and_row_order():
    out = StepOutput(np.arange(5), np.arange(5.0), (np.arange(10).reshape(5, 2),) * 2)
    a, b = split_output(out, [2, 3])
    assert a.next_token_ids.tolist() == [0, 1] and b.logprobs.tolist() == [2.0, 3.0, 4.0]
    assert b.top_logprobs[0].tolist() == [[4, 5], [6, 7], [8, 9]]
    sched, _ = make()
    for i in range(3):
        sched.add(req(f"r{i}", [3 + i] * 5))
    batch = sched.next_batch()  # rank 0: two extend rows, rank 1: one
    shape = BucketShape(64, 4, 0, 0)
    assert row_order(batch.parts, shape).tolist() == [0, 1, 4]
    padded = padded_rows(batch.parts, shape)
    assert [padded[i] for i in row_order(batch.parts, shape)] == batch.rows
    packed = dp_pack(batch, shape, PS)
    assert packed["input_ids"].shape == (128,) and packed["query_start"].shape == (10,)
    assert packed["logits_indices"][4] == 64 + 4  # rank 1's first row, 5 tokens in
