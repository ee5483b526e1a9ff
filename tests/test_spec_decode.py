"""Speculative decoding (prompt lookup) through the Engine on a tiny random model: greedy
rows keep the plain path's tokens, seeded sampled rows the plain path's draws, on both CPU
attention backends, with overlap, stops, logprobs, penalties, retraction and aborts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.forward_mode import ForwardMode
from models.kv_pool import init_kv_pool
from runtime.batch_builder import BucketShape
from runtime.config import CacheConfig, RunnerConfig
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.ngram import NgramDrafter
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, check_same, engine_args, mixed_prompts
from tests.model_utils import TINY, SimpleRow, all_position_logits, make_batch

CFG = dataclasses.replace(TINY, max_position_embeddings=256)
K = 4


@pytest.fixture(scope="module", params=[("packed", "cpu"), ("xla", "xla"), ("xla", "pallas")],
                ids=["cpu", "xla", "pallas"])  # pallas: the GPU kernels in interpret mode
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


class _AlwaysDrafts:
    """Prompt lookup, else the last k tokens again: sampled rows of a random model leave
    the prompt's spans at once and rarely repeat, so this keeps them drafting (and
    mostly missing). Deterministic in the sequence, as the rejection rule needs."""

    def __init__(self) -> None:
        self.lookup = NgramDrafter(max_ngram=3, min_ngram=1)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return self.lookup.draft(tokens, k) or list(tokens[-k:]) if k > 0 else []


def _spec_engine(runner: ModelRunner, always: bool = False, **kw) -> Engine:
    """A prompt-lookup engine that speculates whatever the measured step costs say: on
    this tiny model a verify step is never cheaper than the decode steps it saves."""
    eng = Engine(_args(speculative_algorithm="ngram", speculative_num_draft_tokens=K, **kw),
                 runner=runner)
    assert eng.spec is not None
    eng.spec.costs = None
    if always:
        eng.spec.drafter = _AlwaysDrafts()
    return eng


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
    eng = _spec_engine(runner, disable_overlap_schedule=not overlap)
    spec = eng.generate(prompts, GREEDY)
    check_same(spec, plain)
    assert _verify_steps(runner) > before
    accepted = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in spec)
    assert accepted > 0, [o.meta_info for o in spec]
    # The execution trace names the verify steps, overall and per request.
    assert eng.trace.step_counts().get("target_verify", 0) > 0
    assert any(o.meta_info["steps_by_mode"].get("target_verify") for o in spec)
    assert all(o.meta_info["spec_accept_length"] >= 1 for o in spec
               if o.meta_info.get("spec_verify_steps"))
    runner.check_no_compiles()


def test_sampling_stops_logprobs_penalties_equal_plain(runner):
    """Seeded sampled rows draw what the plain path draws (each position is seeded by its
    place in the sequence); stop tokens and lengths ending inside a verify step, logprobs,
    and penalised rows (which decode plainly beside the verify rows)."""
    prompts = copy_prompts(6, seed=5)
    sp = [SamplingParams(temperature=0.7, top_p=0.9, top_k=8, seed=s, max_new_tokens=9 + 3 * s,
                         ignore_eos=True, logprobs=True, top_logprobs=2,
                         repetition_penalty=1.3 if s == 4 else 1.0)
          for s in range(6)]
    free = Engine(_args(), runner=runner).generate(prompts, sp)
    sp = [dataclasses.replace(p, stop_token_ids=(f.output_ids[5],)) if i % 2 else p
          for i, (p, f) in enumerate(zip(sp, free, strict=True))]
    plain = Engine(_args(), runner=runner).generate(prompts, sp)
    before = _verify_steps(runner)
    spec = _spec_engine(runner, always=True).generate(prompts, sp)
    assert _verify_steps(runner) > before
    for s, p in zip(spec, plain, strict=True):
        assert s.output_ids == p.output_ids
        assert s.meta_info["finish_reason"] == p.meta_info["finish_reason"]
        np.testing.assert_allclose(s.meta_info["output_token_logprobs"],
                                   p.meta_info["output_token_logprobs"], atol=1e-4)
    assert any(o.meta_info["finish_reason"]["type"] == "stop" for o in plain)
    assert spec[4].meta_info.get("spec_draft_tokens", 0) == 0  # penalised: never drafts
    runner.check_no_compiles()


def test_small_pool_retracts_and_matches(runner):
    prompts = copy_prompts(8, seed=7)
    plain = Engine(_args(), runner=runner).generate(prompts, GREEDY)
    eng = _spec_engine(runner, max_total_tokens=40 * PAGE)
    spec = eng.generate(prompts, GREEDY)
    check_same(spec, plain)
    assert eng.scheduler.stats().num_retractions > 0
    st = eng.scheduler.stats()
    assert st.num_used_pages == st.num_cached_pages  # rolled-back pages all came back


def test_sampled_distribution_is_the_targets(runner):
    """Seeds disjoint between the two runs: the spec run's tokens at each of the first
    positions follow the plain run's distribution (two-sample chi-square)."""
    from scipy.stats import chi2_contingency

    prompt = copy_prompts(1, seed=11)[0]
    n = 160
    plain = Engine(_args(), runner=runner).generate(
        [prompt] * n, [SamplingParams(temperature=1.0, top_k=3, seed=s, max_new_tokens=4,
                                      ignore_eos=True) for s in range(n)])
    # Draft each position's most frequent plain token: kept about as often as not.
    columns = zip(*(o.output_ids for o in plain), strict=True)
    modes = [max(set(col), key=col.count) for col in columns]
    spec_eng = _spec_engine(runner)
    spec_eng.spec.drafter = _ByPosition(len(prompt), modes)
    spec = spec_eng.generate(
        [prompt] * n, [SamplingParams(temperature=1.0, top_k=3, seed=s, max_new_tokens=4,
                                      ignore_eos=True) for s in range(n, 2 * n)])
    drafted = sum(o.meta_info.get("spec_draft_tokens", 0) for o in spec)
    accepted = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in spec)
    assert 0 < accepted < drafted  # drafts both kept and rejected
    for pos in range(1, 4):
        a = [o.output_ids[pos] for o in plain]
        b = [o.output_ids[pos] for o in spec]
        vocab = sorted(set(a) | set(b))
        table = [[a.count(t) for t in vocab], [b.count(t) for t in vocab]]
        assert chi2_contingency(table).pvalue > 0.001, (pos, table)


class _ByPosition:
    """Drafts fixed tokens for the positions after a prompt of `start` tokens (a function
    of the sequence, as the rejection rule needs)."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def draft(self, seq: list[int], k: int) -> list[int]:
        i = len(seq) - self.start
        return self.tokens[i:i + k]


@pytest.mark.parametrize("attention", ["xla", "cpu"])
def test_verify_forward_logits_equal_extend(attention):
    """A TARGET_VERIFY forward (rows of at most 1 + K tokens on cached prefixes, the
    bucket's padding after them; on "xla" its attention is the decode walk,
    attention_ref._verify) gives at every real token the logits a single EXTEND over the
    row's whole sequence gives there."""
    params = llama.init_params(CFG, jax.random.key(5))
    rng = np.random.default_rng(7)
    width, page = K + 1, PAGE
    rows = [(37, 5), (3, 1), (150, 4), (20, 2)]  # (cached prefix, new tokens) per row
    seqs = [list(rng.integers(0, CFG.vocab_size, pre + n)) for pre, n in rows]
    pages, next_page = [], 1
    for pre, n in rows:
        count = -(-(pre + n) // page)
        pages.append(list(range(next_page, next_page + count)))
        next_page += count
    kv = init_kv_pool(CFG, CacheConfig(page_size=page, num_pages=next_page), jnp.float32)
    ctx = max(len(p) for p in pages)

    @functools.partial(jax.jit, static_argnames="mode")
    def run(kv, batch, mode):
        batch = batch.replace(mode=mode)
        h, kv = llama.run_layers(params, kv, llama.embed(params, batch.input_ids), batch, CFG,
                                 attention_backend=attention)
        return llama.compute_logits(params, h, jnp.arange(batch.num_tokens), CFG), kv

    # The prefixes into the pool, one EXTEND row each.
    cached = [SimpleRow(s[:pre], 0, p) for s, (pre, _), p in zip(seqs, rows, pages, strict=True)]
    n_cached = sum(pre for pre, _ in rows)
    _, kv = run(kv, make_batch(ForwardMode.EXTEND, cached, [],
                               BucketShape(n_cached, len(rows), 0, 0), page),
                ForwardMode.EXTEND)
    # The verify step: 5 row slots (one padding row), 3 padding tokens at the end.
    new = [SimpleRow(s[pre:], pre, p) for s, (pre, _), p in zip(seqs, rows, pages, strict=True)]
    shape = BucketShape(5 * width, 5, 0, ctx)
    got, _ = run(kv, make_batch(ForwardMode.TARGET_VERIFY, new, [], shape, page),
                 ForwardMode.TARGET_VERIFY)
    t = 0
    for s, (pre, n) in zip(seqs, rows, strict=True):
        want = all_position_logits(params, CFG, s, page_size=page)[pre:]
        np.testing.assert_allclose(np.asarray(got[t:t + n]), want, atol=2e-4, rtol=2e-4)
        t += n
