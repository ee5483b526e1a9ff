"""Sliding-window rings (models/kv_pool.py, RunnerConfig.sliding_window_rings): the sliding layers
of a model with sliding and global layers keep their K/V in a fixed ring per request slot.

On the tiny Gemma 3 and gpt-oss fixtures (window 4) with 4-token pages and 8-token extend
chunks, a ring is 4 pages, so contexts of 60+ tokens wrap it several times: the greedy
tokens and logprobs equal the shared-pool runner's, the ring pool's size does not depend
on the context while the main pool holds only the global layers."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.forward_mode import PAD_POSITION
from models.kv_pool import (
    init_kv_pool,
    kv_bytes_per_token,
    ring_addresses,
    ring_layers,
    ring_pages_for,
    ring_pool_pages,
)
from runtime import checkpoint
from runtime.config import CacheConfig, RunnerConfig
from runtime.engine import Engine
from runtime.paths import check_paths, ring_pages
from runtime.prefix_cache import DisabledPrefixCache
from runtime.request import SamplingParams
from tests.engine_utils import PAGE, engine_args, small_runner

FIXTURES = Path(__file__).parent / "fixtures" / "tiny_models"
CHUNK = 8  # extend bucket and prefill chunk: a ring of window 4 + 8 tokens -> 4 pages


def _runner(name: str, rings: bool, **kw):
    cfg, params = checkpoint.load_hf_safetensors(str(FIXTURES / name))
    return small_runner(cfg, params, extend_token_buckets=(CHUNK,),
                        sliding_window_rings=rings, **kw)


def _generate(runner, prompts: list[list[int]], n: int, **kw):
    eng = Engine(engine_args(max_prefill_tokens=CHUNK, chunked_prefill_size=CHUNK, **kw),
                 runner=runner)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n,
                                                ignore_eos=True, logprobs=True))
    runner.check_no_compiles()
    return eng, outs


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,runner_kw,engine_kw", [
    # XLA's attention, per-layer weights (the lax.switch layer body)
    ("gemma3", dict(attention_backend="xla"), {}),
    # every prefill chunk in a MIXED step with the decode rows
    pytest.param("gpt_oss", dict(attention_backend="xla", enable_mixed=True),
                 dict(enable_mixed_chunk=True), marks=SLOW),
    # the CPU kernels: packed matmuls on stacked weights, the CPU attention and KV write
    pytest.param("gemma3", dict(attention_backend="cpu", cpu_matmul="packed",
                                per_layer_weights=False), {}, marks=SLOW),
    # the Pallas kernels, interpreted
    pytest.param("gemma3", dict(attention_backend="pallas"), {}, marks=SLOW),
], ids=["gemma3-xla", "gpt_oss-mixed", "gemma3-cpu_kernels", "gemma3-pallas"])
def test_rings_give_the_shared_pools_tokens(name, runner_kw, engine_kw):
    """3 requests (prompts of 5..21 tokens, chunked by 8) decode 32 tokens each: contexts
    of 37..53 tokens against 16-token rings. Tokens equal, logprobs to f32 rounding; the prefix
    cache (the prompts share 5 tokens) is off with rings."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, 5).tolist()
    prompts = [shared, shared + rng.integers(3, 200, 16).tolist(),
               rng.integers(3, 200, 11).tolist()]
    ringed = _runner(name, True, **runner_kw)
    assert ringed.ring_pages == ring_pages_for(4, CHUNK, PAGE) == 4
    # The main pool holds the 2 global layers; the ring pool 9 rings of 4 pages (8 slots
    # and the padding rows'), while a request's context grows to 14 main-pool pages.
    assert ringed.kv.k.shape[0] == ringed.kv.sk.shape[0] == 2
    assert ringed.kv.sk.shape[2] == ring_pool_pages(4, 9) == 37
    eng, got = _generate(ringed, prompts, 32, **engine_kw)
    assert isinstance(eng.scheduler.prefix_cache, DisabledPrefixCache)
    modes = {s.mode for s in eng.trace.steps()}
    assert ("mixed" in modes) == bool(engine_kw), modes
    _, want = _generate(_runner(name, False, **runner_kw), prompts, 32, **engine_kw)
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        # Equal on Gemma 3; gpt-oss's differ by f32 rounding (1e-6: the layer's attention
        # inside lax.cond fuses differently), never by a key in or out of the window.
        np.testing.assert_allclose(g.meta_info["output_token_logprobs"],
                                   w.meta_info["output_token_logprobs"], rtol=1e-5, atol=1e-5)


def test_pool_shapes_and_bytes():
    """The main pool holds the global layers, the ring pool one ring per slot (and the
    padding slot) whatever the context. A 4k-token request of Gemma 3 4B's shape (34
    layers, 29 sliding with window 1024, 4 KV heads of 256, bf16; 16-token pages, 512-token
    chunks): 256 pages of 34 layers (544 MiB) without rings; with them 256 main pages of 5
    layers plus a 97-page ring of 29 (80 + 175.8 MiB), the ring the same at any length."""
    cfg, _ = checkpoint.load_hf_safetensors(str(FIXTURES / "gemma3"))
    kv = init_kv_pool(cfg, CacheConfig(page_size=PAGE, num_pages=50), jnp.float32,
                      ring_pages=4, ring_slots=9)
    assert kv.k.shape[:3] == (2, cfg.num_kv_heads, 50)
    assert kv.sk.shape[:4] == (2, cfg.num_kv_heads, 1 + 9 * 4, PAGE)
    assert ring_layers(cfg) == ((1, 3), (0, 2))
    gemma = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=34,
                        num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1024,
                        layer_types=tuple("full_attention" if (i + 1) % 6 == 0
                                          else "sliding_attention" for i in range(34)))
    glob, slide = ring_layers(gemma)
    assert (len(glob), len(slide)) == (5, 29)
    r = ring_pages_for(1024, 512, 16)
    assert r == 97
    per_layer = kv_bytes_per_token(gemma, jnp.bfloat16, 1)  # 4 KiB
    assert 4096 * kv_bytes_per_token(gemma, jnp.bfloat16) == 544 * 2**20
    assert 4096 * 5 * per_layer == 80 * 2**20
    assert r * 16 * 29 * per_layer == pytest.approx(175.8 * 2**20, rel=1e-3)


def test_ring_addresses_wrap_the_ring():
    """Token p of the row of slot s goes to ring page 1 + s * R + (p // S) % R; the table
    repeats the ring; padding tokens write page 0."""
    r, s = 3, 4
    # Row 0 extends positions 20..25, row 1 decodes position 41, then two padding tokens.
    positions = jnp.asarray([20, 21, 22, 23, 24, 25, PAD_POSITION, PAD_POSITION, 41],
                            jnp.int32)
    query_start = jnp.asarray([0, 8, 8, 9], jnp.int32)  # extend row, padding row, decode row
    base = jnp.asarray([1 + 2 * r, 1 + 5 * r, 1 + 0 * r], jnp.int32)
    table, loc = ring_addresses(base, positions, query_start, r, s, 12)
    table, loc = np.asarray(table), np.asarray(loc)
    assert table[0].tolist() == [7 + j % r for j in range(12)]
    assert table[2].tolist() == [1 + j % r for j in range(12)]
    want = [(7 + (p // s) % r) * s + p % s for p in range(20, 26)]
    assert loc[:6].tolist() == want and loc[6:8].tolist() == [0, 0]
    assert loc[8] == (1 + (41 // s) % r) * s + 41 % s


def test_unsupported_paths_refuse_at_start_up():
    cfg, _ = checkpoint.load_hf_safetensors(str(FIXTURES / "gemma3"))
    cache = CacheConfig(page_size=PAGE, num_pages=10)
    for bad in (dict(enable_split_prefill=True), dict(enable_two_batch_overlap=True),
                dict(multiplex_fused=True)):
        with pytest.raises(ValueError, match="sliding_window_rings"):
            check_paths(cfg, RunnerConfig(sliding_window_rings=True, **bad), cache, None)
    mistral = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=16)
    with pytest.raises(ValueError, match="every layer sliding"):
        check_paths(mistral, RunnerConfig(sliding_window_rings=True), cache, None)
    assert ring_pages(cfg, RunnerConfig(), PAGE) == 0


def test_the_pool_budget_counts_both_pools(monkeypatch):
    """--mem_fraction sizes the main pool from what the ring pool leaves, at the global
    layers' cost per token."""
    import types

    import psutil

    from runtime.config import ServerArgs
    from runtime.engine_setup import size_kv_pool

    cfg, _ = checkpoint.load_hf_safetensors(str(FIXTURES / "gemma3"))
    per_layer = kv_bytes_per_token(cfg, jnp.float32, 1)  # 2 KV heads x 16 x K, V x f32
    budget = 1000 * PAGE * per_layer  # 1000 pages of one layer
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(available=budget))
    args = ServerArgs(page_size=PAGE, max_running_requests=8, max_total_tokens=None,
                      mem_fraction=1.0)
    assert size_kv_pool(args, cfg, "float32") == 1000 * PAGE // 4 // PAGE + 1  # 4 layers
    # 9 rings of 4 pages + the padding page, 2 layers: 74 one-layer pages; 926 left for 2
    assert size_kv_pool(args, cfg, "float32", ring_pages=4) == 926 * PAGE // 2 // PAGE + 1


@SLOW
def test_rings_under_multi_step_and_verify_steps(monkeypatch):
    """The multi-step decode program (4 steps) and prompt-lookup verify steps (3 drafted
    tokens a row, always drafting) on rings give the shared pool's tokens."""
    from tests.test_spec_decode import _AlwaysDrafts

    kw = dict(num_scheduler_steps=4, speculative_num_draft_tokens=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 200, n).tolist() for n in (6, 19, 12)]
    outs = {}
    for rings in (True, False):
        runner = _runner("gemma3", rings, **kw)
        multi, launch = [], runner.paths["multi_step"].launch

        def counted(batch, launch=launch, multi=multi):
            pending = launch(batch)
            if pending is not None:
                multi.append(batch.steps)
            return pending

        monkeypatch.setattr(runner.paths["multi_step"], "launch", counted)
        _, steps = _generate(runner, prompts, 32, num_scheduler_steps=4)
        assert multi
        eng = Engine(engine_args(max_prefill_tokens=CHUNK, chunked_prefill_size=CHUNK,
                                 speculative_algorithm="ngram",
                                 speculative_num_draft_tokens=3), runner=runner)
        eng.spec.costs, eng.spec.drafter = None, _AlwaysDrafts()
        spec = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=32,
                                                    ignore_eos=True))
        assert "target_verify" in {s.mode for s in eng.trace.steps()}
        runner.check_no_compiles()
        outs[rings] = ([o.output_ids for o in steps], [o.output_ids for o in spec])
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][1]


@SLOW
def test_rings_under_tensor_parallelism():
    """tp=2 (each device: 2 query heads, 1 KV head of both pools): the shared pool's
    tokens; dp refuses at start-up."""
    from runtime.sharding import serving_mesh

    cfg, _ = checkpoint.load_hf_safetensors(str(FIXTURES / "gemma3"))
    mesh = serving_mesh(cfg, tp=2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 200, n).tolist() for n in (7, 17)]
    ringed = _runner("gemma3", True, mesh=mesh)
    assert ringed.kv.sk.sharding.spec == ringed.kv.k.sharding.spec
    _, got = _generate(ringed, prompts, 24)
    _, want = _generate(_runner("gemma3", False, mesh=mesh), prompts, 24)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    with pytest.raises(ValueError, match="dp / ep meshes"):
        check_paths(cfg, RunnerConfig(sliding_window_rings=True),
                    CacheConfig(page_size=PAGE, num_pages=10), serving_mesh(cfg, dp=2))
