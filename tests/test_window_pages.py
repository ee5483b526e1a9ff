"""Sliding-window models (every layer slides, e.g. Mistral): the scheduler frees each running
request's pages wholly before its next query's window, and the prefix cache never offers
a freed page. Host only, with the fake runner in window mode (its model reads only the
last `window` positions, as attention over a window does)."""

from __future__ import annotations

import numpy as np
import pytest

from models.config import ModelConfig
from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_cache import PAD_PAGE, pages_for
from runtime.prefix_cache import PrefixCache
from runtime.request import Req, SamplingParams
from runtime.scheduler import Scheduler
from tests.fake_runner import (
    EOS,
    FakeRunner,
    check_invariants,
    drive,
    fake_decode,
    reference_output,
)
from tests.test_scheduler import workload

PS, WINDOW = 4, 6


def make(window: int = WINDOW, num_pages: int = 400, max_running: int = 16, **kw):
    cfg = SchedulerConfig(cache=CacheConfig(page_size=PS, num_pages=num_pages),
                          max_running_requests=max_running, sliding_window=window, **kw)
    return (Scheduler(cfg, [EOS], fake_decode),
            FakeRunner(num_pages, PS, max_running, window=window))


def cached_pages_hold_their_tokens(sched: Scheduler, runner: FakeRunner) -> None:
    """Every page the prefix cache offers holds the tokens of its key (the fake KV stores
    token ids): a freed page that went into the cache, or was reused, would not."""
    cache = sched.prefix_cache
    if not isinstance(cache, PrefixCache):
        return
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        assert node.page != PAD_PAGE
        got = runner.kv[node.page * PS:(node.page + 1) * PS].tolist()
        assert got == list(node.key), f"cached page {node.page} holds {got}, key {node.key}"
        stack.extend(node.children.values())


def run(sched: Scheduler, runner: FakeRunner, reqs: list[Req], overlap: bool) -> dict:
    for r in reqs:
        sched.add(r)

    def step(_: int) -> None:
        check_invariants(sched)
        if not overlap:  # every cached page's KV is written by now
            cached_pages_hold_their_tokens(sched, runner)
    out = drive(sched, runner, overlap, on_step=step)
    check_invariants(sched)
    cached_pages_hold_their_tokens(sched, runner)
    return out


@pytest.mark.parametrize("num_pages", [400, 36], ids=["big_pool", "tiny_pool"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "nochunk"])
def test_outputs_equal_the_windowed_reference(chunk, cache, overlap, num_pages):
    """Batched, chunked, cached, under a small pool: each request's tokens are what the
    windowed model gives it alone; every page reference stays accounted for; idle, only
    the prefix cache holds pages."""
    sched, runner = make(num_pages=num_pages, chunked_prefill_size=chunk,
                         disable_prefix_cache=not cache, overlap=overlap)
    reqs = workload()
    out = run(sched, runner, reqs, overlap)
    for r in reqs:
        want = reference_output(r.prompt_ids, r.sampling.max_new_tokens,
                                r.sampling.ignore_eos, window=WINDOW)
        assert r.output_ids == out[r.rid] == want, r.rid
    assert sched.is_idle()
    assert sched.allocator.num_used == sched.prefix_cache.num_pages
    if num_pages == 36:  # the freed pages spare retractions the same pool forces unwindowed
        full, full_runner = make(window=0, num_pages=num_pages, chunked_prefill_size=chunk,
                                 disable_prefix_cache=not cache, overlap=overlap)
        run(full, full_runner, workload(), overlap)
        assert sched.stats().num_retractions < full.stats().num_retractions


@pytest.mark.parametrize("cache", [True, False])
def test_a_long_generation_holds_only_its_window(cache):
    """One request decoding 200 tokens holds about window / page_size pages, not 50, and
    a request with a prefix the cache holds reuses only pages with the right KV."""
    sched, runner = make(disable_prefix_cache=not cache)
    prompt = list(range(3, 13))
    r = Req("long", prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    sched.add(r)
    peak = 0

    def watch(_: int) -> None:
        nonlocal peak
        check_invariants(sched)
        live = [p for p in r.pages if p != PAD_PAGE]
        peak = max(peak, len(live) - (sched.prefix_cache.num_pages if cache else 0))
    drive(sched, runner, on_step=watch)
    assert r.output_ids == reference_output(prompt, 200, True, window=WINDOW)
    assert peak <= pages_for(WINDOW, PS) + 2
    # The prompt's whole pages went into the cache before any page was freed; nothing
    # past the first freed page did.
    assert sched.prefix_cache.num_pages == (len(prompt) // PS if cache else 0)
    cached_pages_hold_their_tokens(sched, runner)
    again = Req("again", prompt + r.output_ids[:30], SamplingParams(max_new_tokens=20))
    out = run(sched, runner, [again], overlap=False)
    assert out["again"] == reference_output(again.prompt_ids, 20, window=WINDOW)
    assert again.cached_tokens == (len(prompt) // PS * PS if cache else 0)


def test_no_window_keeps_every_page():
    sched, runner = make(window=0)
    r = Req("r", list(range(3, 13)), SamplingParams(max_new_tokens=40, ignore_eos=True))
    sched.add(r)
    drive(sched, runner, on_step=lambda _: check_invariants(sched))
    assert r.output_ids == reference_output(list(range(3, 13)), 40, True)


def test_uniform_window_is_the_schedulers_window():
    """Only a model whose every layer slides frees pages (ModelConfig.uniform_window)."""
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=4, sliding_window=16)
    assert ModelConfig(**base).uniform_window == 16
    mixed = ModelConfig(**base, layer_types=("sliding_attention", "full_attention"))
    assert mixed.uniform_window == 0
    assert np.array_equal(mixed.layer_windows, (16, 0))
