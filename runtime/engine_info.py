"""EngineInfo: what the server reads about an engine, fixed once the engine is built (the
model, the context and sampling limits, the tokenizer, the compiled program, the pool).
The handlers read it instead of reaching into the runner or the scheduler."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from models.config import ModelConfig
from runtime.config import CacheConfig, RunnerConfig, SchedulerConfig
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    args: ServerArgs
    architecture: str
    num_layers: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # Longest prompt + completion a request may have (the runner's largest sequence bucket).
    context_len: int
    max_top_logprobs: int
    # None: the model came without one, and only token-id prompts work.
    tokenizer: Tokenizer | None
    # The compiled program: weights, backends and shape buckets (resolved defaults).
    runner: RunnerConfig
    num_executables: int
    # The whole KV pool the scheduler(s) use (all data-parallel ranks), and its limits.
    pool: CacheConfig
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None

    @classmethod
    def build(cls, args: ServerArgs, model_cfg: ModelConfig, runner_cfg: RunnerConfig,
              max_seq_len: int, num_executables: int, scheduler: SchedulerConfig,
              tokenizer: Tokenizer | None) -> EngineInfo:
        """`scheduler`: the engine's whole scheduling config (every dp rank's together)."""
        eos = tuple(tokenizer.eos_token_ids) if tokenizer else model_cfg.eos_token_ids
        return cls(args=args, architecture=model_cfg.architecture,
                   num_layers=model_cfg.num_layers, vocab_size=model_cfg.vocab_size,
                   eos_token_ids=eos, context_len=max_seq_len,
                   max_top_logprobs=runner_cfg.max_top_logprobs, tokenizer=tokenizer,
                   runner=runner_cfg, num_executables=num_executables, pool=scheduler.cache,
                   max_running_requests=scheduler.max_running_requests,
                   max_prefill_tokens=scheduler.max_prefill_tokens,
                   chunked_prefill_size=scheduler.chunk_size)
