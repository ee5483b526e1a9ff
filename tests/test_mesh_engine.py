"""Serving on a device mesh (4 fake CPU devices): tensor-parallel dense Llama and
expert-parallel MoE give the single-device greedy tokens, in strict no-recompile mode."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from models import llama, registry
from models.config import ModelConfig
from models.forward_mode import ForwardMode
from runtime import checkpoint
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.engine_setup import runner_config
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams
from runtime.sharding import serving_mesh
from tests.engine_utils import PAGE, check_same, engine_args, prompts, small_runner
from tests.test_parity import FIXTURES, _ckpt_cache, _comparable_prefix

# 8 query / 4 KV heads: tp 2 and 4 divide both.
DENSE = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=8, num_kv_heads=4, head_dim=8, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, top_logprobs=2)
RETRACT_PAGES = 24  # the longest stream needs 15 pages: the others retract as they grow


def _runner(cfg: ModelConfig, params: dict, tp: int = 1, ep: int = 1, dp: int = 1,
            **kw) -> ModelRunner:
    if dp > 1:
        kw.setdefault("enable_mixed", True)  # one rank may prefill while another decodes
    return small_runner(cfg, params, serving_mesh(cfg, dp=dp, tp=tp, ep=ep), **kw)


def _generate(runner: ModelRunner, **kw) -> list:
    eng = Engine(engine_args(**kw), runner=runner)
    out = eng.generate(prompts(runner.model_cfg.vocab_size), GREEDY)
    runner.check_no_compiles()
    return out


@functools.cache
def _dense_reference() -> list:
    params = llama.init_params(DENSE, jax.random.key(3))
    return _generate(_runner(DENSE, params), disable_prefix_cache=True,
                     chunked_prefill_size=None)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_dense_matches_one_device(tp):
    want = _dense_reference()  # first: a warm-up later would count as our compilation
    runner = _runner(DENSE, llama.init_params(DENSE, jax.random.key(3)), tp=tp)
    assert runner.kv.k.sharding.spec[1] == "tp"  # the pool is split over KV heads
    assert runner.params["layer_list"][0]["wq"].sharding.spec[-1] == "tp"
    # Attention runs on each device's own heads and pages: no step gathers the pool.
    pool = "f32[" + ",".join(map(str, runner.kv.k.shape)) + "]"
    for exe in runner.paths["plain"]._exe.values():
        assert not re.search(re.escape(pool) + r"\S* all-gather", exe.as_text())
    check_same(_generate(runner, disable_prefix_cache=True, chunked_prefill_size=None), want)
    # The invariance matrix on the mesh: chunked prefill and the prefix cache, and
    # retraction under a pool too small for every stream at once.
    check_same(_generate(runner, chunked_prefill_size=16), want)
    eng = Engine(engine_args(max_total_tokens=RETRACT_PAGES * PAGE), runner=runner)
    check_same(eng.generate(prompts(DENSE.vocab_size), GREEDY), want)
    assert eng.scheduler.stats().num_retractions > 0
    runner.check_no_compiles()
    assert runner.compiles_after_warmup == 0


@pytest.mark.parametrize("dp,tp", [(2, 1), (2, 2)])
def test_data_parallel_attention_matches_one_device(dp, tp):
    """DP attention: each rank its own requests, KV pages and prefix cache; the greedy
    tokens equal one device's, through chunked prefill, the prefix cache and retraction;
    a rank with no rows runs IDLE."""
    want = _dense_reference()  # first: a warm-up later would count as our compilation
    runner = _runner(DENSE, llama.init_params(DENSE, jax.random.key(3)), tp=tp, dp=dp)
    assert runner.kv.k.sharding.spec[2] == "dp"  # each rank holds its own pages
    assert runner.kv.k.addressable_shards[0].data.shape[2] == runner.cache_cfg.num_pages // dp
    check_same(_generate(runner, dp=dp, disable_prefix_cache=True,
                         chunked_prefill_size=None), want)
    check_same(_generate(runner, dp=dp, chunked_prefill_size=16), want)
    # Each rank has half the streams: a smaller pool of its own (the longest fits alone).
    eng = Engine(engine_args(dp=dp, max_total_tokens=dp * 16 * PAGE), runner=runner)
    check_same(eng.generate(prompts(DENSE.vocab_size), GREEDY), want)
    assert eng.scheduler.stats().num_retractions > 0
    assert [len(s.running) + len(s.waiting) for s in eng.scheduler.ranks] == [0] * dp
    idle = runner.step_counts[ForwardMode.IDLE]
    one = _generate(runner, dp=dp)  # a lone request: the other rank idles
    eng = Engine(engine_args(dp=dp), runner=runner)
    lone = eng.generate(prompts(DENSE.vocab_size)[:1], GREEDY)
    assert runner.step_counts[ForwardMode.IDLE] >= idle + len(lone[0].output_ids)
    check_same(lone, want[:1])
    check_same(one, want)
    runner.check_no_compiles()


# Split prefill (every extend bucket split) with the fused decode + interval programs.
SPLIT = dict(enable_split_prefill=True, split_min_tokens=0, multiplex_fused=True)


@pytest.mark.parametrize("tp", [4])
def test_multiplexing_on_the_mesh_matches_plain(tp):
    """Split prefill and multiplexing (two calls and fused) on a tp mesh give the tokens of
    the plain path on the same mesh, in strict no-recompile mode; the interval programs
    run attention on each device's own heads too."""
    reference = _dense_reference()  # first: a warm-up later would count as our compilation
    # One extend bucket of 4 sequences: half the split and fused programs to compile.
    runner = _runner(DENSE, llama.init_params(DENSE, jax.random.key(3)), tp=tp,
                     extend_seq_buckets=(4,), **SPLIT)
    pool = "f32[" + ",".join(map(str, runner.kv.k.shape)) + "]"
    for name in runner.paths["split_prefill"].names + runner.paths["fused"].names:
        assert not re.search(re.escape(pool) + r"\S* all-gather",
                             runner.compiled[name].as_text()), name
    want = _generate(runner, disable_prefix_cache=True, chunked_prefill_size=None)
    check_same(want, reference)
    for kw in (dict(enable_split_prefill=True, split_prefill_layers=1),
               dict(enable_multiplexing=True),
               dict(enable_multiplexing=True, multiplex_fused=True, chunked_prefill_size=16)):
        check_same(_generate(runner, **kw), want)
    assert runner.step_counts[ForwardMode.SPLIT_PREFILL] > 0
    assert runner.compiles_after_warmup == 0


@pytest.mark.slow  # ~3 min: two tiny-moe runners (49152-token vocabulary) compile
def test_expert_parallel_moe_matches_one_device():
    cfg, params = registry.load_preset("tiny-moe")
    want = _generate(_runner(cfg, params), disable_prefix_cache=True)
    runner = _runner(cfg, params, tp=1, ep=4)
    assert runner.params["layer_list"][0]["we_gate"].sharding.spec[0] == "ep"
    check_same(_generate(runner, disable_prefix_cache=True), want)
    check_same(_generate(runner, chunked_prefill_size=16), want)


@pytest.mark.slow  # ~2 min: a MoE runner with the MIXED buckets compiles twice
def test_data_parallel_attention_with_expert_parallel_moe():
    """dp=2 x ep=2: attention per rank over its own pages, the experts over `ep`; a small
    MoE (the tiny-moe layout, 2 layers, 4 experts, vocabulary 256) gives one device's
    greedy tokens."""
    cfg = dataclasses.replace(registry.PRESETS["tiny-moe"], vocab_size=256, num_layers=2,
                              num_experts=4, max_position_embeddings=256)
    params = registry.model_module(cfg).init_params(cfg, jax.random.key(5))
    want = _generate(_runner(cfg, params), disable_prefix_cache=True)
    runner = _runner(cfg, params, dp=2, ep=2)
    assert runner.params["layer_list"][0]["we_gate"].sharding.spec[0] == "ep"
    check_same(_generate(runner, dp=2), want)


def test_uneven_tp_is_a_clear_error():
    with pytest.raises(ValueError, match="tp=3 does not divide the model's num_heads=8 and "
                                         "num_kv_heads=4"):
        serving_mesh(DENSE, tp=3)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        serving_mesh(dataclasses.replace(DENSE, num_kv_heads=2), tp=4)
    with pytest.raises(ValueError, match="ep=3"):
        serving_mesh(registry.PRESETS["tiny-moe"], ep=3)
    with pytest.raises(ValueError, match="single-device"):
        ModelRunner(DENSE, llama.init_params(DENSE, jax.random.key(0)), CacheConfig(),
                    RunnerConfig(attention_backend="cpu"), 4, mesh=serving_mesh(DENSE, tp=2))


def _smollm2_engine(**mesh) -> Engine:
    path = checkpoint.ensure_default_checkpoint(_ckpt_cache(), "float32")
    cfg, params = checkpoint.restore_checkpoint(path)
    # A 256-token extend bucket: two query blocks, so the jnp attention's key-block loop
    # runs under the mesh's shard_map.
    args = ServerArgs(max_running_requests=2, decode_buckets=(1,) if mesh.get("dp") else (2,),
                      extend_token_buckets=(256,), kv_len_buckets=(256,), max_prefill_tokens=256,
                      chunked_prefill_size=256, max_extend_seqs=2, max_total_tokens=1024,
                      compilation_cache_dir=None, strict_compile=True, max_top_logprobs=2,
                      attention_backend="xla", cpu_matmul="xla", **mesh)
    return Engine(args, model=(cfg, params))


@pytest.mark.slow  # ~4 min: SmolLM2 compiles on one device and on the mesh
@pytest.mark.parametrize("mesh", [dict(tp=3), dict(dp=2)], ids=["tp3", "dp2"])
def test_smollm2_on_a_mesh_matches_one_device_and_transformers(mesh):
    """SmolLM2 (9 query / 3 KV heads) at tp=3 and at dp=2 through ServerArgs: the two
    fixture prompts' 32 greedy tokens equal one device's (XLA paths, same buckets) and
    transformers' up to the first near-tie."""
    ref = np.load(FIXTURES / "smollm2_reference.npz")
    prompts_ = [ref[f"p{i}_prompt_ids"].tolist() for i in range(2)]
    sp = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, top_logprobs=2)
    one = _smollm2_engine().generate(prompts_, sp)
    eng = _smollm2_engine(**mesh)
    assert (eng.runner.cfg.cpu_matmul, eng.runner.cfg.attention_backend) == ("xla", "xla")
    assert dict(eng.runner.mesh.shape) == {"dp": 1, "tp": 1, "ep": 1, **mesh}
    outs = eng.generate(prompts_, sp)
    check_same(outs, one)
    for i, out in enumerate(outs):
        n = _comparable_prefix(ref[f"p{i}_greedy_margins"])
        assert out.output_ids[:n] == ref[f"p{i}_greedy_ids"].tolist()[:n], (i, n)
    eng.runner.check_no_compiles()


def test_dp_start_up_errors():
    params = llama.init_params(DENSE, jax.random.key(0))
    mesh = serving_mesh(DENSE, dp=2)
    xla = dict(attention_backend="xla", cpu_matmul="xla", enable_mixed=True)

    def runner(num_pages: int = 200, **kw) -> ModelRunner:
        return ModelRunner(DENSE, params, CacheConfig(num_pages=num_pages),
                           RunnerConfig(**{**xla, **kw}), 4, mesh=mesh)

    with pytest.raises(ValueError, match="201 pages must split evenly"):
        runner(201)
    with pytest.raises(ValueError, match="does not run with enable_split_prefill"):
        runner(enable_split_prefill=True)
    with pytest.raises(ValueError, match="needs the MIXED buckets"):
        runner(enable_mixed=False)
    with pytest.raises(ValueError, match="--dp=3 must divide --max_running_requests=8"):
        runner_config(ServerArgs(dp=3, max_running_requests=8), DENSE)
    assert runner_config(ServerArgs(dp=2, max_running_requests=8), DENSE).decode_buckets == (
        1, 2, 4)  # per rank
