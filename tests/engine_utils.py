"""Shared by the engine tests: a small strict runner, engine args, prompts, and the check
that two runs gave the same tokens."""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from models.config import ModelConfig
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams

PAGE = 4


def small_runner(cfg: ModelConfig, params: dict, mesh: Mesh | None = None,
                 **overrides) -> ModelRunner:
    """One decode bucket (8 rows), one extend bucket (64 tokens), strict, XLA paths;
    `overrides`: other RunnerConfig fields (split prefill, ...)."""
    rcfg = RunnerConfig(**{**dict(
        decode_buckets=(8,), extend_token_buckets=(64,), extend_seq_buckets=(1, 4),
        kv_len_buckets=(256,), max_top_logprobs=2, strict_compile=True, per_layer_weights=True,
        cpu_matmul="xla", attention_backend="xla"), **overrides})
    r = ModelRunner(cfg, params, CacheConfig(page_size=PAGE, num_pages=200), rcfg,
                    max_running_requests=8, mesh=mesh)
    r.warmup(progress=False)
    return r


def engine_args(**kw) -> ServerArgs:
    base = dict(page_size=PAGE, max_running_requests=8, max_prefill_tokens=64,
                chunked_prefill_size=64, max_extend_seqs=4, compilation_cache_dir=None)
    return ServerArgs(**{**base, **kw})


def prompts(vocab: int) -> list[list[int]]:
    """8 prompts of 3..60 tokens; every other one shares a 20-token prefix."""
    rng = np.random.default_rng(0)
    system = list(rng.integers(0, vocab, 20))
    bodies = [list(rng.integers(0, vocab, int(rng.integers(3, 40)))) for _ in range(8)]
    return [system + b if i % 2 == 0 else b for i, b in enumerate(bodies)]


def mixed_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1..113 tokens; every third shares a 24-token system prefix."""
    rng = np.random.default_rng(seed)
    system = list(rng.integers(0, vocab, 24))
    out = []
    for i in range(n):
        body = list(rng.integers(0, vocab, int(rng.integers(1, 90))))
        out.append(system + body if i % 3 == 0 else body)
    return out


NEAR_TIE = 1e-3  # greedy steps whose top-2 logprob gap is smaller may legitimately flip


def check_same(got, want) -> None:
    """Equal tokens up to the first near-tie of the reference run (DESIGN.md section 6)."""
    for g, w in zip(got, want, strict=True):
        n = len(w.output_ids)
        for step, (_, lps) in enumerate(w.meta_info["output_top_logprobs"]):
            if lps[0] - lps[1] < NEAR_TIE:
                n = step + 1
                break
        assert g.output_ids[:n] == w.output_ids[:n], (g.rid, g.output_ids, w.output_ids)


def each_alone(runner: ModelRunner, prompts: list[list[int]], sampling: SamplingParams,
               max_prefill_tokens: int, max_running_requests: int = 8) -> list:
    """The reference run: each prompt alone on the plain path (no chunking, no prefix
    cache, no overlap)."""
    eng = Engine(engine_args(max_running_requests=max_running_requests,
                             max_prefill_tokens=max_prefill_tokens, chunked_prefill_size=None,
                             disable_prefix_cache=True, disable_overlap_schedule=True),
                 runner=runner)
    assert eng.policy is None
    return [eng.generate([p], sampling)[0] for p in prompts]
