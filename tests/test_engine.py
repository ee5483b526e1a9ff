"""Engine on a tiny random model: every execution path gives the same tokens.

One ModelRunner (compiled once, strict no-recompile mode) serves every engine here;
engines differ only in host scheduling, so any difference in tokens is a bug in
chunking, prefix caching, mixed batches, retraction, overlap or bucket padding.
"""

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
from tests.cpu_isa import needs_x12
from tests.engine_utils import PAGE, check_same, each_alone, engine_args, mixed_prompts
from tests.model_utils import TINY

CFG = dataclasses.replace(TINY, max_position_embeddings=256)


@pytest.fixture(scope="module", params=[("packed", "cpu", "float32", None),
                                        ("xla", "xla", "float32", None),
                                        ("packed", "cpu", "bfloat16", None),
                                        ("packed", "cpu", "float32", "int8"),
                                        pytest.param(("packed", "cpu", "bfloat16", "x12"),
                                                     marks=needs_x12)],
                ids=["cpu_kernels", "xla", "cpu_kernels_bf16", "cpu_kernels_int8",
                     "cpu_kernels_bf16_x12"])
def runner(request) -> ModelRunner:
    """Both CPU paths: our kernels for matmuls and attention (the CPU default), and
    XLA's dot with jnp attention (CPUs without AVX-512; the GPU's matmul path); and our
    kernels on bf16 weights and a bf16 KV pool (--dtype=bfloat16), and on weight-only
    int8 matrices (--quantization=int8), and on bf16 matrices in 12 bits
    (--compress_weights, "x12"). Each with its serving layer loop: the packed
    kernels read the stacked weights in place, XLA's dot gets per-layer buffers
    (engine_setup.default_per_layer_weights) with fused wq|wk|wv and w_gate|w_up, as on a
    GPU (engine_setup.default_fuse_projections)."""
    matmul, attention, dtype, weights = request.param
    params = llama.init_params(CFG, jax.random.key(7))
    # Few buckets keep warm-up short; padding to them is itself under test. The CPU
    # default (our kernels, f32) has two of each, so batches move between buckets mid-run
    # (host scheduling, the same on every path); the other paths and formats change only
    # what the device computes, so one bucket of each (every program kind still
    # compiled: 18 executables, not 65) tests them on every path.
    one_bucket = matmul == "xla" or dtype != "float32" or weights is not None
    buckets = (dict(decode_buckets=(16,), extend_token_buckets=(256,), extend_seq_buckets=(4,))
               if one_bucket else
               dict(decode_buckets=(4, 16), extend_token_buckets=(64, 256),
                    extend_seq_buckets=(1, 4)))
    rcfg = RunnerConfig(**buckets, kv_len_buckets=(256,), enable_mixed=True,
                        max_top_logprobs=2, strict_compile=True, per_layer_weights=matmul == "xla",
                        fuse_projections=matmul == "xla", cpu_matmul=matmul,
                        attention_backend=attention, dtype=dtype,
                        quantization=weights if weights == "int8" else None,
                        compress_weights=weights == "x12", enable_split_prefill=True,
                        multiplex_fused=True, num_scheduler_steps=4)
    r = ModelRunner(CFG, params, CacheConfig(page_size=PAGE, num_pages=400), rcfg,
                    max_running_requests=16)
    _POOL_AT_START[id(r)] = _pool_pointers(r)
    r.warmup(progress=False)
    return r


# Each runner's KV pool addresses when it was built (test_the_kv_pool_never_moves).
_POOL_AT_START: dict[int, list[int]] = {}


def _pool_pointers(r: ModelRunner) -> list[int]:
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(r.kv)]


_args = functools.partial(engine_args, max_running_requests=16)
_prompts = functools.partial(mixed_prompts, CFG.vocab_size)
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, top_logprobs=2)


@pytest.fixture(scope="module")
def reference(runner):
    return each_alone(runner, _prompts(16), GREEDY, max_prefill_tokens=256,
                      max_running_requests=16)


@pytest.mark.parametrize("chunk", [16, 64, None])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("mixed", [False, True])
def test_batch_of_16_matches_alone(runner, reference, chunk, prefix_cache, mixed):
    eng = Engine(_args(chunked_prefill_size=chunk, max_prefill_tokens=chunk or 256,
                       disable_prefix_cache=not prefix_cache, enable_mixed_chunk=mixed),
                 runner=runner)
    check_same(eng.generate(_prompts(16), GREEDY), reference)
    assert eng.scheduler.stats().num_running == 0
    runner.check_no_compiles()


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_under_a_small_pool(runner, reference, overlap):
    eng = Engine(_args(max_total_tokens=48 * PAGE, disable_overlap_schedule=not overlap),
                 runner=runner)
    check_same(eng.generate(_prompts(16), GREEDY), reference)
    assert eng.scheduler.stats().num_retractions > 0


def test_prefix_cache_skips_prefill(runner):
    eng = Engine(_args(), runner=runner)
    shared = _prompts(1, seed=3)[0][:40] * 2  # 80 tokens
    first = eng.generate([shared + [1, 2]], GREEDY)[0]
    second = eng.generate([shared + [3, 4]], GREEDY)[0]
    assert first.meta_info["cached_tokens"] == 0
    assert second.meta_info["cached_tokens"] >= 76  # page-aligned share of 80 tokens


def test_seeded_sampling_is_reproducible_and_batch_invariant(runner):
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=s, max_new_tokens=10,
                         ignore_eos=True) for s in range(6)]
    eng = Engine(_args(), runner=runner)
    prompts = _prompts(6, seed=5)
    batched = eng.generate(prompts, sp)
    alone = [eng.generate([p], s)[0] for p, s in zip(prompts, sp, strict=True)]
    assert [b.output_ids for b in batched] == [a.output_ids for a in alone]
    assert len({tuple(b.output_ids) for b in batched}) > 1


def test_penalties_change_tokens_and_respect_repeats(runner):
    eng = Engine(_args(), runner=runner)
    p = _prompts(1, seed=9)[0]
    plain = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    pen = eng.generate([p], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True,
                                           repetition_penalty=10.0, presence_penalty=2.0))
    out = pen[0].output_ids
    assert len(set(out)) == len(out), "presence+repetition penalties should forbid repeats here"
    assert plain[0].output_ids != out


def test_abort_frees_everything(runner):
    eng = Engine(_args(), runner=runner)
    rids = [eng.add_request(p, GREEDY) for p in _prompts(8, seed=11)]
    for _ in range(3):
        eng.step()
    for rid in rids[::2]:
        eng.abort(rid)
    eng.run_until_idle()
    stats = eng.scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_used_pages == stats.num_cached_pages


def test_stream_yields_deltas(runner):
    eng = Engine(_args(), runner=runner)
    outs = list(eng.stream(_prompts(1, seed=4)[0], GREEDY))
    assert outs[-1].finished and len(outs[-1].output_ids) == 12
    assert [len(o.output_ids) for o in outs] == sorted(len(o.output_ids) for o in outs)


def test_bad_input_is_rejected(runner):
    eng = Engine(_args(), runner=runner)
    with pytest.raises(ValueError, match="input_ids"):
        eng.add_request([CFG.vocab_size + 5])
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([])
    assert eng.scheduler.is_idle()


def _generate_in_waves(eng: Engine, prompts: list[list[int]], sp: SamplingParams,
                       every: int = 3, abort: dict[int, int] | None = None) -> list:
    """Add prompts four at a time, `every` steps apart, so prefills arrive while earlier
    requests decode; `abort` maps a step to the index of a request to abort then."""
    rids, done, step = [], {}, 0
    while len(done) < len(prompts) - len(abort or {}):
        assert step < 10_000, "engine stuck"
        if step % every == 0 and len(rids) < len(prompts):
            rids += [eng.add_request(p, sp) for p in prompts[len(rids):len(rids) + 4]]
        if abort and step in abort:
            eng.abort(rids[abort[step]])
        done.update({o.rid: o for o in eng.step() if o.finished})
        step += 1
    return [done.get(r) for r in rids]


@pytest.mark.parametrize("layers", [None, 1, 2])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_multiplexing_matches_alone(runner, reference, layers, overlap, prefix_cache):
    eng = Engine(_args(enable_multiplexing=True, split_prefill_layers=layers,
                       disable_overlap_schedule=not overlap,
                       disable_prefix_cache=not prefix_cache), runner=runner)
    before = runner.step_counts[ForwardMode.SPLIT_PREFILL]
    outs = _generate_in_waves(eng, _prompts(16), GREEDY)
    check_same(outs, reference)
    assert runner.step_counts[ForwardMode.SPLIT_PREFILL] > before
    intervals = [o.meta_info["prefill_intervals"] for o in outs]
    assert min(intervals) >= (CFG.num_layers if layers == 1 else 1)
    runner.check_no_compiles()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_fused_multiplexing_matches_alone(runner, reference, prefix_cache):
    eng = Engine(_args(enable_multiplexing=True, multiplex_fused=True, split_prefill_layers=1,
                       disable_prefix_cache=not prefix_cache), runner=runner)
    outs = _generate_in_waves(eng, _prompts(16), GREEDY)
    check_same(outs, reference)
    assert min(o.meta_info["prefill_intervals"] for o in outs) >= CFG.num_layers
    runner.check_no_compiles()


@pytest.mark.parametrize("chunk", [16, None])
def test_split_prefill_alone_matches(runner, reference, chunk):
    eng = Engine(_args(enable_split_prefill=True, split_prefill_layers=1,
                       chunked_prefill_size=chunk, max_prefill_tokens=chunk or 256),
                 runner=runner)
    outs = eng.generate(_prompts(16), GREEDY)
    check_same(outs, reference)
    # Every chunk of every prompt ran one interval per layer.
    assert all(o.meta_info["prefill_intervals"] >= CFG.num_layers for o in outs)


def test_multiplexing_under_a_small_pool_and_aborts(runner, reference):
    eng = Engine(_args(enable_multiplexing=True, split_prefill_layers=1,
                       max_total_tokens=48 * PAGE), runner=runner)
    outs = _generate_in_waves(eng, _prompts(16), GREEDY, abort={4: 5, 7: 9})
    assert eng.scheduler.stats().num_retractions > 0
    kept = [(o, w) for o, w in zip(outs, reference, strict=True) if o is not None]
    assert len(kept) == 14
    check_same(*zip(*kept, strict=True))
    stats = eng.scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_used_pages == stats.num_cached_pages


def test_abort_mid_split_frees_its_pages_at_once(runner):
    # Fill fraction 0: the prompt joining one stream is multiplexed, not prefilled first.
    eng = Engine(_args(enable_multiplexing=True, split_prefill_layers=1,
                       multiplex_fill_fraction=0), runner=runner)
    eng.add_request(_prompts(1, seed=2)[0], GREEDY)
    for _ in range(2):
        eng.step()
    rid = eng.add_request(list(range(1, 60)), GREEDY)
    eng.step()
    assert eng.loop.split is not None  # mid-split: one of its layers has run
    used = eng.scheduler.stats().num_used_pages
    eng.abort(rid)
    assert eng.scheduler.stats().num_used_pages < used
    eng.run_until_idle()
    stats = eng.scheduler.stats()
    assert stats.num_used_pages == stats.num_cached_pages


def test_seeded_sampling_is_the_same_multiplexed(runner):
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_new_tokens=10, ignore_eos=True)
    prompts = _prompts(6, seed=5)
    plain = Engine(_args(), runner=runner).generate(prompts, sp)
    mux = Engine(_args(enable_multiplexing=True, multiplex_fill_fraction=0.75), runner=runner)
    assert [o.output_ids for o in _generate_in_waves(mux, prompts, sp)] == \
        [o.output_ids for o in plain]


def test_the_kv_pool_never_moves(runner):
    """Every executable donates the KV pool, so after warm-up, mixed and chunked prefill,
    retraction, split prefill and (fused) multiplexing it is still at the addresses it had
    when the runner was built: never copied, and still in the memory ModelRunner marked for
    2 MiB pages."""
    for kw in (dict(enable_mixed_chunk=True, chunked_prefill_size=16, max_prefill_tokens=16),
               dict(enable_multiplexing=True, multiplex_fused=True, split_prefill_layers=1),
               dict(enable_multiplexing=True, split_prefill_layers=2,
                    max_total_tokens=48 * PAGE),
               dict(num_scheduler_steps=4, max_total_tokens=48 * PAGE)):
        _generate_in_waves(Engine(_args(**kw), runner=runner), _prompts(8, seed=11), GREEDY)
    assert runner.step_counts[ForwardMode.MIXED] > 0
    assert runner.step_counts[ForwardMode.SPLIT_PREFILL] > 0
    assert len(_POOL_AT_START[id(runner)]) == 2  # K and V
    assert _pool_pointers(runner) == _POOL_AT_START[id(runner)]


# ---- multi-step decode (runtime/multi_step.py) ----


def _count_multi_steps(runner: ModelRunner, monkeypatch) -> list[int]:
    """Record the steps of each multi-step launch."""
    path = runner.paths["multi_step"]
    calls, launch = [], path.launch

    def counted(batch):
        pending = launch(batch)
        if pending is not None:  # the path claimed it
            calls.append(batch.steps)
        return pending

    monkeypatch.setattr(path, "launch", counted)
    return calls


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("pool", [None, 48 * PAGE], ids=["pool", "small_pool"])
def test_multi_step_decode_matches_alone(runner, reference, overlap, pool, monkeypatch):
    """Requests arriving in waves: decode runs 4 steps a program between admissions (12
    tokens: partial last programs too), single steps beside prefills; retraction on the
    small pool."""
    calls = _count_multi_steps(runner, monkeypatch)
    eng = Engine(_args(num_scheduler_steps=4, disable_overlap_schedule=not overlap,
                       max_total_tokens=pool), runner=runner)
    outs = _generate_in_waves(eng, _prompts(16), GREEDY)
    check_same(outs, reference)
    assert len(calls) >= 3 and set(calls) == {4}
    if pool:
        assert eng.scheduler.stats().num_retractions > 0
    runner.check_no_compiles()


def test_multi_step_sampling_penalties_and_stops_match_single_steps(runner, monkeypatch):
    """Seeded sampling, penalties, logprobs, stop tokens and lengths that end inside a
    program: the same tokens as one step at a time."""
    prompts = _prompts(6, seed=5)
    sp = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=s, max_new_tokens=5 + 2 * s,
                         ignore_eos=True, logprobs=True, top_logprobs=2,
                         frequency_penalty=0.5 * (s % 2), repetition_penalty=1 + 0.3 * (s % 3))
          for s in range(6)]
    # Stop tokens that the odd requests' own samples hit after 4-6 tokens.
    free = Engine(_args(), runner=runner).generate(prompts, sp)
    sp = [dataclasses.replace(p, stop_token_ids=(f.output_ids[3 + i % 3],)) if i % 2 else p
          for i, (p, f) in enumerate(zip(sp, free, strict=True))]
    single = Engine(_args(), runner=runner).generate(prompts, sp)
    calls = _count_multi_steps(runner, monkeypatch)
    multi = Engine(_args(num_scheduler_steps=4), runner=runner).generate(prompts, sp)
    assert calls
    for m, o in zip(multi, single, strict=True):
        assert m.output_ids == o.output_ids
        assert m.meta_info["finish_reason"] == o.meta_info["finish_reason"]
        np.testing.assert_allclose(m.meta_info["output_token_logprobs"],
                                   o.meta_info["output_token_logprobs"], atol=1e-5)
    assert any(o.meta_info["finish_reason"]["type"] == "stop" for o in single)
    runner.check_no_compiles()


def test_multi_step_flags_are_checked(runner):
    with pytest.raises(ValueError, match="compiled with RunnerConfig.num_scheduler_steps=3"):
        Engine(_args(num_scheduler_steps=3), runner=runner)
    with pytest.raises(ValueError, match="plain step loop"):
        Engine(_args(num_scheduler_steps=4, enable_multiplexing=True), runner=runner)
