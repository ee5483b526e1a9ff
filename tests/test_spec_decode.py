"""Speculative decoding (prompt lookup) through the Engine on a tiny random model: greedy
rows keep the plain path's tokens, seeded sampled rows the plain path's draws, on both CPU
attention backends, with overlap, stops, logprobs, penalties, retraction and aborts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from models import llama
from models.forward_mode import ForwardMode
from runtime.config import CacheConfig, RunnerConfig
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, check_same, engine_args, mixed_prompts
from tests.model_utils import TINY

CFG = dataclasses.replace(TINY, max_position_embeddings=256)
K = 4


@pytest.fixture(scope="module", params=[("packed", "cpu"), ("xla", "xla")],
            ids=["cpu", "xla"])
def runner(request) -> ModelRunner:
    matmul, attention = request.param
    params = llama.init_params(CFG, jax.random.key(3))
    rcfg = RunnerConfig(decode_buckets=(4, 16), extend_token_buckets=(64, 256),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(256,), max_top_logprobs=2,
                        strict_compile=True, per_layer_weights=matmul == "xla",
                        cpu_matmul=matmul, attention_backend=attention,
                        num_scheduler_steps=4, speculative_num_draft_tokens=K)
    r = ModelRunner(CFG, params, CacheConfig(page_size=PAGE, num_pages=400), rcfg,
                    max_running_requests=16)
    r.warmup(progress=False)
    return r


_args = functools.partial(engine_args, max_running_requests=16, itl_target_ms=0)
_spec = functools.partial(_args, speculative_algorithm="ngram", speculative_num_draft_tokens=K)


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (code to rewrite, text to quote) and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        span = list(rng.integers(0, CFG.vocab_size, int(rng.integers(6, 16))))
        out.append(span * 3 + span[:3] if i % 2 == 0 else
                   list(rng.integers(0, CFG.vocab_size, int(rng.integers(3, 40)))))
    return out


GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, top_logprobs=2)


def _verify_steps(runner: ModelRunner) -> int:
    return runner.step_counts[ForwardMode.TARGET_VERIFY]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_equals_plain(runner, overlap):
    prompts = copy_prompts(6) + mixed_prompts(CFG.vocab_size, 4, seed=2)
    plain = Engine(_args(disable_overlap_schedule=not overlap), runner=runner).generate(
        prompts, GREEDY)
    before = _verify_steps(runner)
    eng = Engine(_spec(disable_overlap_schedule=not overlap), runner=runner)
    spec = eng.generate(prompts, GREEDY)
    check_same(spec, plain)
    assert _verify_steps(runner) > before
    accepted = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in spec)
    assert accepted > 0, [o.meta_info for o in spec]
    runner.check_no_compiles()
