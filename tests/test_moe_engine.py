"""The Engine on the tiny-moe preset: chunked prefill and the prefix cache give the tokens
of each prompt run alone, with nothing compiled after warm-up (strict mode)."""

from __future__ import annotations

import pytest

from models import registry
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams
from tests.engine_utils import check_same, engine_args, prompts, small_runner

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, top_logprobs=2)
VOCAB = registry.PRESETS["tiny-moe"].vocab_size


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return small_runner(*registry.load_preset("tiny-moe"))


@pytest.fixture(scope="module")
def reference(runner):
    eng = Engine(engine_args(disable_prefix_cache=True, disable_overlap_schedule=True),
                 runner=runner)
    return [eng.generate([p], GREEDY)[0] for p in prompts(VOCAB)]


@pytest.mark.parametrize("chunk,prefix_cache", [(16, True), (None, True), (16, False)])
def test_tiny_moe_batch_matches_alone(runner, reference, chunk, prefix_cache):
    eng = Engine(engine_args(chunked_prefill_size=chunk, disable_prefix_cache=not prefix_cache),
                 runner=runner)
    first = eng.generate(prompts(VOCAB), GREEDY)
    check_same(first, reference)
    if prefix_cache:  # the same prompts again: prefixes now come from the cache
        again = eng.generate(prompts(VOCAB), GREEDY)
        assert sum(o.meta_info["cached_tokens"] for o in again) > 0
        check_same(again, reference)
    runner.check_no_compiles()
    assert runner.compiles_after_warmup == 0
