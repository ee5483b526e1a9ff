"""The decode-first prefill policy through the engine on a tiny random model: the same
tokens as each prompt alone on the plain path, whatever the target, with the prefix
cache, overlap, a small pool and multi-step decode; its MIXED programs are all it adds,
and nothing compiles after warm-up."""

from __future__ import annotations

import dataclasses
import functools

import jax
import pytest

from models import llama
from models.forward_mode import ForwardMode
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.engine_setup import runner_config
from runtime.model_runner import ModelRunner
from runtime.prefill_policy import YOUNG_STREAM_TOKENS, policy_shapes
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, check_same, each_alone, engine_args, mixed_prompts
from tests.model_utils import TINY

CFG = dataclasses.replace(TINY, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, top_logprobs=2)


@pytest.fixture(scope="module", params=[("packed", "cpu"), ("xla", "xla")],
                ids=["cpu_kernels", "xla"])
def runner(request) -> ModelRunner:
    matmul, attention = request.param
    params = llama.init_params(CFG, jax.random.key(7))
    rcfg = RunnerConfig(decode_buckets=(4, 16), extend_token_buckets=(16, 64, 128),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(256,),
                        mixed_shapes=policy_shapes((16, 64), 4, 16), max_top_logprobs=2,
                        strict_compile=True, per_layer_weights=matmul == "xla",
                        cpu_matmul=matmul, attention_backend=attention,
                        num_scheduler_steps=4)
    r = ModelRunner(CFG, params, CacheConfig(page_size=PAGE, num_pages=400), rcfg,
                    max_running_requests=16)
    r.warmup(progress=False)
    return r


_args = functools.partial(engine_args, max_running_requests=16)
_prompts = functools.partial(mixed_prompts, CFG.vocab_size)


@pytest.fixture(scope="module")
def reference(runner):
    """Each prompt alone, prefill first."""
    return each_alone(runner, _prompts(16), GREEDY, max_prefill_tokens=128,
                      max_running_requests=16)


def _staggered(eng: Engine, prompts: list[list[int]]) -> list:
    """Four prompts first, then one more every other step, so prompts prefill while
    others decode."""
    rids, done, queue, steps = [], {}, list(prompts), 0
    while queue or len(done) < len(prompts):
        if queue and (len(rids) < 4 or steps % 2 == 0):
            rids.append(eng.add_request(queue.pop(0), GREEDY))
        for out in eng.step():
            if out.finished:
                done[out.rid] = out
        steps += 1
    return [done[r] for r in rids]


@pytest.mark.parametrize("target_ms", [None, 1e-3, 1e4], ids=["measured", "tiny", "huge"])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_policy_matches_alone(runner, reference, target_ms, prefix_cache, overlap):
    eng = Engine(_args(itl_target_ms=target_ms, disable_prefix_cache=not prefix_cache,
                       disable_overlap_schedule=not overlap), runner=runner)
    assert eng.policy is not None
    assert eng.trace.policy["itl_target_ms"] > 0
    outs = _staggered(eng, _prompts(16))
    check_same(outs, reference)
    paths = eng.trace.prefill_paths()
    assert paths.get("mixed", 0) + paths.get("mixed_young", 0) > 0 and paths["extend"] > 0
    assert all("prefill_paths" in o.meta_info for o in outs)
    if target_ms == 1e-3:  # nothing fits: every chunk beside decode rows is the smallest
        big = [(r.step, r.extend_tokens, r.extend_rows, r.decode_rows, r.decision)
               for r in eng.trace.steps() if r.decision is not None
               and r.decision.path == "mixed" and r.extend_tokens > 16]
        assert not big, big[:3]
    assert eng.scheduler.stats().num_running == 0
    runner.check_no_compiles()
    assert runner.compiles_after_warmup == 0


def test_target_zero_is_prefill_first_with_the_same_tokens(runner, reference):
    eng = Engine(_args(itl_target_ms=0), runner=runner)
    assert eng.policy is None
    check_same(_staggered(eng, _prompts(16)), reference)
    assert "mixed" not in eng.trace.step_counts()
    assert set(eng.trace.prefill_paths()) == {"extend (no policy)"}


def test_policy_under_a_small_pool_and_multi_step(runner, reference):
    eng = Engine(_args(max_total_tokens=48 * PAGE, num_scheduler_steps=4), runner=runner)
    check_same(_staggered(eng, _prompts(16)), reference)
    assert eng.scheduler.stats().num_retractions > 0
    modes = eng.trace.step_counts()
    assert modes.get("multi_decode", 0) > 0 and modes.get("mixed", 0) > 0
    runner.check_no_compiles()


def test_the_policy_adds_only_its_mixed_programs():
    """At the default flags the policy compiles one MIXED program per chunk bucket and one
    of max_extend_seqs rows, and no sampler beyond the DECODE buckets' ones."""
    on = runner_config(ServerArgs(attention_backend="xla", cpu_matmul="xla"), CFG)
    off = runner_config(ServerArgs(attention_backend="xla", cpu_matmul="xla",
                                   itl_target_ms=0), CFG)
    assert off.mixed_shapes == () and len(on.mixed_shapes) == 5  # 64, 96, 128, 256, 512
    from runtime.bucket_plan import BucketPlan

    keys_on, keys_off = BucketPlan(on, 16).step_keys(), BucketPlan(off, 16).step_keys()
    mixed = [k for k in keys_on if k.mode is ForwardMode.MIXED]
    assert len(keys_on) - len(keys_off) == len(mixed) == 5 * len(on.kv_len_buckets)

    def rows(keys):
        return {k.shape.num_extend_seqs + k.shape.num_decode_seqs for k in keys}

    assert rows(keys_on) == rows(keys_off)


DEEP = dataclasses.replace(CFG, num_layers=8)


@pytest.fixture(scope="module")
def deep_runner() -> ModelRunner:
    """Eight layers with one-layer intervals compiled for the policy (64-token rows): an
    interval of 8 token-equivalents is a finer step than the 16-token chunk."""
    params = llama.init_params(DEEP, jax.random.key(8))
    rcfg = RunnerConfig(decode_buckets=(4, 16), extend_token_buckets=(16, 64, 128),
                        extend_seq_buckets=(1, 4), kv_len_buckets=(256,),
                        mixed_shapes=policy_shapes((16, 64), 4, 16), max_top_logprobs=2,
                        strict_compile=True, cpu_matmul="packed", attention_backend="cpu",
                        split_prefill_layers=1, policy_split_tokens=64)
    r = ModelRunner(DEEP, params, CacheConfig(page_size=PAGE, num_pages=400), rcfg,
                    max_running_requests=16)
    r.warmup(progress=False)
    return r


@pytest.mark.parametrize("overlap", [True, False])
def test_layer_intervals_match_alone(deep_runner, overlap):
    """A target no chunk fits: prompts advance by layer intervals beside DECODE steps,
    with the tokens of each prompt alone and nothing compiled after warm-up."""
    sampling = dataclasses.replace(GREEDY, max_new_tokens=32)
    prompts = _prompts(8)
    want = each_alone(deep_runner, prompts, sampling, max_prefill_tokens=64,
                      max_running_requests=16)
    eng = Engine(_args(itl_target_ms=1e-3, max_prefill_tokens=64,
                       disable_overlap_schedule=not overlap), runner=deep_runner)
    assert eng.policy.split is not None and eng.policy.split.sizes == (1, 2, 4, 6, 8)
    # Two streams past their first tokens (young streams take the largest chunk), then
    # the other prompts while they decode.
    rids = [eng.add_request(p, sampling) for p in prompts[:2]]
    done = {}
    while len(eng.scheduler.running) < 2 or any(
            r.num_generated <= YOUNG_STREAM_TOKENS for r in eng.scheduler.running):
        done.update((o.rid, o) for o in eng.step() if o.finished)
    rids += [eng.add_request(p, sampling) for p in prompts[2:]]
    while eng.has_work():
        done.update((o.rid, o) for o in eng.step() if o.finished)
    outs = [done[r] for r in rids]
    check_same(outs, want)
    paths = eng.trace.prefill_paths()
    metas = [o.meta_info for o in outs if "interval" in o.meta_info["prefill_paths"]]
    assert len(metas) >= 3, paths
    assert all(m["prefill_intervals"] > 0 for m in metas)
    assert any(m["prefill_reason"].startswith("no chunk fits") for m in metas)
    # Each interval shares its iteration with a DECODE step, one layer at this target.
    splits = [r.split for r in eng.trace.steps() if r.split is not None]
    assert splits and all(s.num_layers == 1 for s in splits if s.decode_step is not None)
    assert eng.scheduler.stats().num_running == 0
    deep_runner.check_no_compiles()


def test_layer_intervals_are_compiled_where_they_pay():
    """The policy's split programs (one 512-token row) on a 30-layer model only, and not
    with --nopolicy_layer_intervals or --itl_target_ms=0."""
    deep = dataclasses.replace(CFG, num_layers=30, max_position_embeddings=2048)
    xla = dict(attention_backend="xla", cpu_matmul="xla")
    assert runner_config(ServerArgs(**xla), deep).policy_split_tokens == 512
    assert runner_config(ServerArgs(**xla), CFG).policy_split_tokens == 0  # 3 layers
    for off in (dict(policy_layer_intervals=False), dict(itl_target_ms=0)):
        assert runner_config(ServerArgs(**xla, **off), deep).policy_split_tokens == 0


def test_aborting_a_prompt_mid_interval(deep_runner):
    """A prompt aborted while its layer intervals run: its pages are free at once (the
    rest of its K/V writes go to the padding page), the others keep the tokens of each
    alone, and the pool ends empty."""
    sampling = dataclasses.replace(GREEDY, max_new_tokens=24)
    prompts = _prompts(6, seed=3)
    eng = Engine(_args(itl_target_ms=1e-3, max_prefill_tokens=64, disable_prefix_cache=True),
                 runner=deep_runner)
    rids = [eng.add_request(p, sampling) for p in prompts[:2]]
    done, aborted = {}, None
    while len(eng.scheduler.running) < 2 or any(
            r.num_generated <= YOUNG_STREAM_TOKENS for r in eng.scheduler.running):
        done.update((o.rid, o) for o in eng.step() if o.finished)
    rids += [eng.add_request(p, sampling) for p in prompts[2:]]
    while eng.has_work():
        split = eng.loop.split
        if aborted is None and split is not None and split.next_layer > 0:
            aborted = split.batch.extend_rows[0].req.rid
            eng.abort(aborted)
        done.update((o.rid, o) for o in eng.step() if o.finished)
    assert aborted is not None and aborted not in done
    kept = [i for i, r in enumerate(rids) if r != aborted]
    want = each_alone(deep_runner, [prompts[i] for i in kept], sampling,
                      max_prefill_tokens=64, max_running_requests=16)
    check_same([done[rids[i]] for i in kept], want)
    stats = eng.scheduler.stats()
    assert stats.num_running == 0 and stats.num_used_pages == 0
    deep_runner.check_no_compiles()
