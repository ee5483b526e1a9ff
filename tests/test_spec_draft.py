"""Speculative decoding with a draft model (--speculative_algorithm=standalone) through the
Engine on tiny random models of one vocabulary (xla backend): greedy and seeded sampled
rows keep the plain path's tokens; a draft identical to the target keeps nearly every
draft; the draft pool rolls back, survives retraction and aborts, and ends empty.

The compile counter is process-wide, so the order matters: the start-up rules (which
build runners) come before any warm runner is checked, the second runner's test last."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from models import llama
from models.forward_mode import ForwardMode
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.paths.draft import DraftPath, draft_cost_key
from runtime.paths.spec import verify_cost_key
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, check_same, engine_args, mixed_prompts
from tests.model_utils import TINY
from tests.test_spec_decode import copy_prompts

CFG = dataclasses.replace(TINY, max_position_embeddings=256)
DRAFT = dataclasses.replace(CFG, num_layers=1, hidden_size=32, intermediate_size=64)
K = 4
PARAMS = llama.init_params(CFG, jax.random.key(3))


def _runner(draft: tuple) -> ModelRunner:
    rcfg = RunnerConfig(decode_buckets=(4, 8), extend_token_buckets=(64,),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(256,), max_top_logprobs=2,
                        strict_compile=True, per_layer_weights=True, cpu_matmul="xla",
                        attention_backend="xla", speculative_num_draft_tokens=K)
    r = ModelRunner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=200), rcfg,
                    max_running_requests=8, draft=draft)
    r.warmup(progress=False)
    return r


@pytest.fixture(scope="module")
def small_draft() -> ModelRunner:
    return _runner((DRAFT, llama.init_params(DRAFT, jax.random.key(9))))


@pytest.fixture(scope="module")
def same_draft() -> ModelRunner:
    return _runner((CFG, PARAMS))


_args = functools.partial(engine_args, max_running_requests=8, itl_target_ms=0)


def _spec_engine(runner: ModelRunner, **kw) -> Engine:
    """A draft-model engine that speculates whatever the measured step costs say."""
    eng = Engine(_args(speculative_algorithm="standalone", speculative_num_draft_tokens=K,
                       speculative_draft_model_path="tiny-draft", **kw), runner=runner)
    assert eng.spec is not None and isinstance(eng.spec.drafter, DraftPath)
    eng.spec.costs = None
    return eng


def _draft_pages(runner: ModelRunner) -> int:
    return runner.paths["draft"].allocator.num_used


GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, top_logprobs=2)


def test_start_up_rules():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="standalone")
    with pytest.raises(ValueError, match="trained EAGLE draft head"):
        ServerArgs(speculative_algorithm="eagle")
    bad = (dataclasses.replace(CFG, vocab_size=64), llama.init_params(
        dataclasses.replace(CFG, vocab_size=64), jax.random.key(1)))
    rcfg = RunnerConfig(decode_buckets=(4,), extend_token_buckets=(64,),
                        kv_len_buckets=(256,), attention_backend="xla", cpu_matmul="xla",
                        speculative_num_draft_tokens=K)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelRunner(CFG, PARAMS, CacheConfig(page_size=PAGE, num_pages=20), rcfg,
                    max_running_requests=4, draft=bad)


def test_greedy_and_seeded_equal_plain(small_draft):
    r = small_draft
    prompts = copy_prompts(4) + mixed_prompts(CFG.vocab_size, 4, seed=2)
    sp = [GREEDY] * 6 + [SamplingParams(temperature=0.8, top_k=8, seed=s, max_new_tokens=15,
                                        ignore_eos=True) for s in (1, 2)]
    plain = Engine(_args(), runner=r).generate(prompts, sp)
    before = dict(r.step_counts)
    eng = _spec_engine(r)
    spec = eng.generate(prompts, sp)
    check_same(spec[:6], plain[:6])
    for s, p in zip(spec[6:], plain[6:], strict=True):  # a greedy draft: q is one-hot
        assert s.output_ids == p.output_ids
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                 ForwardMode.DRAFT_DECODE):
        assert r.step_counts[mode] > before[mode], mode
    assert sum(o.meta_info.get("spec_draft_tokens", 0) for o in spec) > 0
    assert _draft_pages(r) == 0  # every finished row's draft pages came back
    r.check_no_compiles()
    # The cost model charges a speculative step its draft steps too.
    r.costs.close()  # every launch so far recorded
    costed = Engine(_args(speculative_algorithm="standalone", speculative_num_draft_tokens=K,
                          speculative_draft_model_path="tiny-draft"), runner=r).spec
    assert costed is not None
    measured = [(b, costed.costs(b)) for b in (4, 8)]
    assert any(c is not None for _, c in measured), r.costs.snapshot()
    for b, c in measured:
        if c is not None:
            assert c[1] == pytest.approx(r.costs.get(verify_cost_key(b))
                                         + r.costs.get(draft_cost_key(b)))


def test_retraction_and_aborts_keep_the_draft_pool_consistent(small_draft):
    r = small_draft
    prompts = copy_prompts(8, seed=7)
    plain = Engine(_args(), runner=r).generate(prompts, GREEDY)
    eng = _spec_engine(r, max_total_tokens=40 * PAGE)
    check_same(eng.generate(prompts, GREEDY), plain)
    assert eng.scheduler.stats().num_retractions > 0
    assert _draft_pages(r) == 0
    # Aborts in flight: their draft pages are freed too.
    eng = _spec_engine(r)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(6):
        eng.step()
    for rid in rids[::2]:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    assert _draft_pages(r) == 0
    r.check_no_compiles()


def test_identical_draft_keeps_long_runs(same_draft):
    """A draft equal to the target proposes the target's own greedy tokens: nearly every
    draft is kept, so a verify step yields close to k + 1 tokens."""
    r = same_draft
    prompts = mixed_prompts(CFG.vocab_size, 6, seed=4)
    plain = Engine(_args(), runner=r).generate(prompts, GREEDY)
    spec = _spec_engine(r).generate(prompts, GREEDY)
    check_same(spec, plain)
    drafted = sum(o.meta_info["spec_draft_tokens"] for o in spec)
    accepted = sum(o.meta_info["spec_accepted_tokens"] for o in spec)
    assert accepted >= 0.9 * drafted > 0, (accepted, drafted)
    assert max(o.meta_info["spec_accept_length"] for o in spec) >= K, \
        [o.meta_info["spec_accept_length"] for o in spec]
    assert _draft_pages(r) == 0
    r.check_no_compiles()


def test_engine_builds_its_runner_with_the_draft():
    """Engine(args) with the draft's weights given (as load_draft_model would load them
    from --speculative_draft_model_path) compiles the draft programs in its warm-up."""
    draft = (DRAFT, llama.init_params(DRAFT, jax.random.key(9)))
    eng = Engine(_args(speculative_algorithm="standalone", speculative_num_draft_tokens=K,
                       speculative_draft_model_path="tiny-draft", decode_buckets=(8,),
                       attention_backend="xla", cpu_matmul="xla", strict_compile=True),
                 model=(CFG, PARAMS), draft_model=draft)
    assert isinstance(eng.spec.drafter, DraftPath)
    assert any(n.startswith("draft_decode/") for n in eng.runner.compiled)
    eng.spec.costs = None
    prompts = copy_prompts(2, seed=3)
    spec = eng.generate(prompts, GREEDY)
    plain = Engine(_args(), runner=eng.runner).generate(prompts, GREEDY)
    check_same(spec, plain)
    assert eng.runner.step_counts[ForwardMode.DRAFT_DECODE] > 0
    eng.runner.check_no_compiles()
