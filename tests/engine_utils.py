"""Shared by the MoE and mesh engine tests: a small strict runner, engine args, prompts."""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from models.config import ModelConfig
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.model_runner import ModelRunner

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
