"""The Engine on the tiny-moe preset: chunked prefill and the prefix cache give the tokens
of each prompt run alone, with nothing compiled after warm-up (strict mode)."""

from __future__ import annotations

import numpy as np
import pytest

from models import registry
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams
from tests.test_engine import _check_same

PAGE = 4
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, top_logprobs=2)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg, params = registry.load_preset("tiny-moe")
    rcfg = RunnerConfig(decode_buckets=(8,), extend_token_buckets=(64,),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(256,), max_top_logprobs=2,
                        strict_compile=True, per_layer_weights=True, cpu_matmul="xla",
                        attention_backend="xla")
    r = ModelRunner(cfg, params, CacheConfig(page_size=PAGE, num_pages=200), rcfg,
                    max_running_requests=8)
    r.warmup(progress=False)
    return r


def _args(**kw) -> ServerArgs:
    base = dict(page_size=PAGE, max_running_requests=8, max_prefill_tokens=64,
                chunked_prefill_size=64, max_extend_seqs=4, compilation_cache_dir=None)
    return ServerArgs(**{**base, **kw})


def _prompts() -> list[list[int]]:
    """8 prompts of 3..60 tokens; every other one shares a 20-token prefix."""
    rng = np.random.default_rng(0)
    system = list(rng.integers(0, 49152, 20))
    bodies = [list(rng.integers(0, 49152, int(rng.integers(3, 40)))) for _ in range(8)]
    return [system + b if i % 2 == 0 else b for i, b in enumerate(bodies)]


@pytest.fixture(scope="module")
def reference(runner):
    eng = Engine(_args(disable_prefix_cache=True, disable_overlap_schedule=True), runner=runner)
    return [eng.generate([p], GREEDY)[0] for p in _prompts()]


@pytest.mark.parametrize("chunk,prefix_cache", [(16, True), (None, True), (16, False)])
def test_tiny_moe_batch_matches_alone(runner, reference, chunk, prefix_cache):
    eng = Engine(_args(chunked_prefill_size=chunk, disable_prefix_cache=not prefix_cache),
                 runner=runner)
    first = eng.generate(_prompts(), GREEDY)
    _check_same(first, reference)
    if prefix_cache:  # the same prompts again: prefixes now come from the cache
        again = eng.generate(_prompts(), GREEDY)
        assert sum(o.meta_info["cached_tokens"] for o in again) > 0
        _check_same(again, reference)
    runner.check_no_compiles()
    assert runner.compiles_after_warmup == 0
