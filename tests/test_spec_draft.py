"""Speculative decoding with a draft model (--speculative_algorithm=standalone) through the
Engine on tiny random models of one vocabulary (xla backend): greedy rows keep the plain
path's tokens; sampled rows, whose drafts are drawn from the draft's q and verified by the
standard rejection rule, keep the target's distribution (checked against the exact one);
draft steps show in the execution trace and /metrics; a draft identical to the target
keeps nearly every draft; the draft pool rolls back, survives retraction and aborts, and
ends empty.

The compile counter is process-wide, so the order matters: the start-up rules (which
build runners) come before any warm runner is checked, the second runner's test last."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import jax
import numpy as np
import pytest
from scipy import stats

from models import llama
from models.forward_mode import ForwardMode
from models.kv_pool import kv_bytes_per_token
from runtime import engine_setup
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.metrics import ServerMetrics
from runtime.model_runner import ModelRunner
from runtime.paths.draft import DraftPath, draft_cost_key
from runtime.paths.spec import verify_cost_key
from runtime.perfetto import DEVICE, chrome_trace
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, check_same, engine_args, mixed_prompts
from tests.model_utils import TINY, dense_llama_logits
from tests.test_spec_decode import copy_prompts

CFG = dataclasses.replace(TINY, max_position_embeddings=256)
DRAFT = dataclasses.replace(CFG, num_layers=1, hidden_size=32, intermediate_size=64)
K = 4
PARAMS = llama.init_params(CFG, jax.random.key(3))
DRAFT_PARAMS = llama.init_params(DRAFT, jax.random.key(9))


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
    return _runner((DRAFT, DRAFT_PARAMS))


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


def test_draft_pool_shares_the_memory_budget(monkeypatch, caplog):
    """Sized from --mem_fraction, the target's pool gives up the draft pool's bytes (as
    many pages of the draft's K/V) and the draft's q rows; the log names each."""
    monkeypatch.setattr(engine_setup, "on_gpu", lambda: True)
    monkeypatch.setattr(engine_setup, "free_device_bytes", lambda: 64 << 20)
    args = ServerArgs(page_size=PAGE, max_total_tokens=None, mem_fraction=0.5,
                      max_running_requests=8, speculative_algorithm="standalone",
                      speculative_draft_model_path="tiny-draft",
                      speculative_num_draft_tokens=K)
    budget = (64 << 20) // 2
    per_token, per_draft = (kv_bytes_per_token(c, np.dtype(np.float32)) for c in (CFG, DRAFT))
    alone = engine_setup.size_kv_pool(args, CFG, "float32")
    assert alone == budget // per_token // PAGE + 1
    with caplog.at_level(logging.INFO, logger=engine_setup.__name__):
        pages = engine_setup.size_kv_pool(args, CFG, "float32", DRAFT)
    q_bytes = 4 * 9 * K * CFG.vocab_size
    assert pages == (budget - q_bytes) // (per_token + per_draft) // PAGE + 1 < alone
    assert (pages - 1) * PAGE * (per_token + per_draft) + q_bytes <= budget
    gib = pages * PAGE / 2**30
    assert f"({gib * per_token:.2f} GiB); the draft model's pool as many pages " \
           f"({gib * per_draft:.2f} GiB) and its q rows" in caplog.text


def test_greedy_equal_plain_and_draft_steps_traced(small_draft):
    r = small_draft
    prompts = copy_prompts(4) + mixed_prompts(CFG.vocab_size, 4, seed=2)
    sp = [GREEDY] * 6 + [SamplingParams(temperature=0.8, top_k=8, seed=s, max_new_tokens=15,
                                        ignore_eos=True) for s in (1, 2)]
    plain = Engine(_args(), runner=r).generate(prompts, sp)
    before = dict(r.step_counts)
    eng = _spec_engine(r)
    spec = eng.generate(prompts, sp)
    check_same(spec[:6], plain[:6])
    # Sampled rows: the prefill's token is the plain path's; later ones follow the
    # target's distribution (the next test), not the plain path's seeded draws.
    for s, p in zip(spec[6:], plain[6:], strict=True):
        assert s.output_ids[0] == p.output_ids[0] and len(s.output_ids) == len(p.output_ids)
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND,
                 ForwardMode.DRAFT_DECODE):
        assert r.step_counts[mode] > before[mode], mode
    # Every draft launch is a step of the engine's trace, counted by mode: the draft's
    # catch-up and k-step decode come before the verify step that checks them.
    counts = eng.trace.step_counts()
    for mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE):
        assert counts[mode.value] == r.step_counts[mode] - before[mode], mode
    recs = eng.trace.steps()
    modes = [rec.mode for rec in recs]
    first_verify = modes.index("target_verify")
    assert modes[first_verify - 1] == "draft_decode"
    decode = recs[first_verify - 1]
    assert decode.decode_steps == K and decode.waited and decode.ready is not None
    assert set(decode.rids) <= set(recs[first_verify].rids)
    assert all(rec.ready is not None for rec in recs)  # draft_extend completed by readback
    assert eng.trace.bubbles()["draft_decode"]["busy_s"] > 0
    # The Perfetto file draws each of the three modes in a lane of its own.
    lanes = {e["args"]["name"]: e["tid"] for e in chrome_trace(
        recs, [], eng.trace.t0)["traceEvents"] if e["name"] == "thread_name" and e["pid"] == DEVICE}
    assert len({lanes[m] for m in ("draft_extend", "draft_decode", "target_verify")}) == 3
    m = ServerMetrics()
    m.trace, m.spec = eng.trace, eng.spec
    text = m.render().decode()
    assert f'xlaserve_forward_steps_total{{mode="draft_decode"}} ' \
           f'{float(counts["draft_decode"])}' in text
    seconds = next(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("xlaserve_spec_draft_seconds_total"))
    assert seconds == pytest.approx(eng.spec.total_draft_s) and seconds > 0
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


def _kept(params: dict, cfg, ids: list[int], temperature: float, top_k: int) -> np.ndarray:
    """The f64 distribution a row with these ids samples its next token from."""
    z = dense_llama_logits(params, cfg, ids)[-1] / temperature  # [V]
    w = np.where(z >= np.sort(z)[-top_k], np.exp(z - z.max()), 0.0)
    return w / w.sum()


def _chi2_pvalue(observed: dict, expected: dict, n: int) -> float:
    """Chi-square p-value of observed counts against expected probabilities (cells
    expecting fewer than 5 pooled into one)."""
    big = [c for c, pr in expected.items() if pr * n >= 5]
    obs = [observed.get(c, 0) for c in big]
    exp = [expected[c] * n for c in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    assert set(observed) <= set(expected), set(observed) - set(expected)  # impossible cells
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return float(stats.chi2.sf(stat, len(obs) - 1))


def test_sampled_rows_follow_the_target_distribution(small_draft):
    """800 seeds of one prompt, 3 tokens each: the first from the prefill, the second
    (mostly) from a verify step's standard rule over one draft drawn from the draft
    model's own, different q, the third the bonus token or a later step's. Against the
    exact (f64) target and draft distributions: where the draft was verified, (first,
    second, kept) follows p1 * min(p2, q2) for kept drafts and p1 * max(0, p2 - q2) for
    the residual draws (a rejected second token never lies where p2 <= q2: resampling
    from p, or the one-hot rule, would put some there); over all requests, (first,
    second) follows p1 * p2 and the third token its marginal."""
    r = small_draft
    temp, top_k, n = 1.0, 16, 800
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, CFG.vocab_size, 12)]
    sp = [SamplingParams(temperature=temp, top_k=top_k, seed=s, max_new_tokens=3,
                         ignore_eos=True) for s in range(n)]
    out = _spec_engine(r).generate([prompt] * n, sp)
    verified: dict[tuple[int, int, int], float] = {}  # (t1, t2, kept) -> probability
    joint: dict[tuple[int, int], float] = {}
    third = np.zeros(CFG.vocab_size)
    p1 = _kept(PARAMS, CFG, prompt, temp, top_k)
    for t1 in np.flatnonzero(p1):
        ctx = [*prompt, int(t1)]
        p2 = _kept(PARAMS, CFG, ctx, temp, top_k)
        q2 = _kept(DRAFT_PARAMS, DRAFT, ctx, temp, top_k)
        for t2 in np.flatnonzero(np.maximum(p2, q2)):
            for kept, pr in ((1, min(p2[t2], q2[t2])), (0, max(0.0, p2[t2] - q2[t2]))):
                if pr > 0:
                    verified[int(t1), int(t2), kept] = p1[t1] * pr
        for t2 in np.flatnonzero(p2):
            joint[int(t1), int(t2)] = p1[t1] * p2[t2]
            third += p1[t1] * p2[t2] * _kept(PARAMS, CFG, [*ctx, int(t2)], temp, top_k)
    drafted = [o for o in out if o.meta_info.get("spec_draft_tokens", 0) == 1]
    assert len(drafted) >= n // 2, len(drafted)  # most second tokens came from a verify
    assert _chi2_pvalue(collections.Counter(
        (*o.output_ids[:2], o.meta_info["spec_accepted_tokens"]) for o in drafted),
        verified, len(drafted)) > 1e-3
    assert _chi2_pvalue(collections.Counter(tuple(o.output_ids[:2]) for o in out), joint,
                        n) > 1e-3
    assert _chi2_pvalue(collections.Counter(o.output_ids[2] for o in out),
                        {t: float(third[t]) for t in np.flatnonzero(third)}, n) > 1e-3
    assert _draft_pages(r) == 0
    r.check_no_compiles()


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
    draft = (DRAFT, DRAFT_PARAMS)
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
