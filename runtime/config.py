"""Frozen configuration dataclasses.

Everything that decides a trace's shape or behaviour is here and is hashable, so a
config can be a static argument of `jax.jit`. Nothing in this module imports jax.
"""

from __future__ import annotations

import dataclasses

from runtime.server_args import ServerArgs

__all__ = ["CacheConfig", "RunnerConfig", "SchedulerConfig", "ServerArgs"]

# The defaults that SchedulerConfig and CacheConfig share with the server's options.
_ARGS = ServerArgs()


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry. Page 0 is reserved as the write target of padding tokens."""

    page_size: int = _ARGS.page_size
    num_pages: int = 1024

    @property
    def num_slots(self) -> int:
        return self.page_size * self.num_pages


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Host scheduler knobs (SGLang names). `cache` is the geometry of the paged KV pool.

    max_prefill_tokens: token budget of one extend batch (a longer lone prompt still runs
      when chunking is off, else it could never be scheduled).
    chunked_prefill_size: token-axis chunk size, None or 0 = off; also caps a batch's extend
      tokens. At most one request is mid-chunk at a time.
    max_extend_seqs: most rows in one extend batch.
    enable_mixed_chunk: run the prefill rows and the running decode rows in one MIXED batch.
    overlap: the engine launches batch N+1 before it calls process_results for batch N.
    num_scheduler_steps: decode steps one DECODE batch runs on the device (runtime/
      multi_step.py) when no request can be admitted and no row is grammar-constrained;
      1 = one step a batch.
    max_context_len: longest prompt + max_new_tokens accepted (e.g. the runner's largest
      sequence bucket); None = only the pool size limits it.
    sliding_window: the model's window when every layer slides (ModelConfig.uniform_window;
      0 = none): a running request's pages wholly before its next query's window are freed.
    """

    cache: CacheConfig = CacheConfig()
    max_running_requests: int = _ARGS.max_running_requests
    max_prefill_tokens: int = _ARGS.max_prefill_tokens
    chunked_prefill_size: int | None = _ARGS.chunked_prefill_size
    max_extend_seqs: int = _ARGS.max_extend_seqs
    enable_mixed_chunk: bool = _ARGS.enable_mixed_chunk
    schedule_policy: str = _ARGS.schedule_policy
    disable_prefix_cache: bool = _ARGS.disable_prefix_cache
    overlap: bool = not _ARGS.disable_overlap_schedule
    max_context_len: int | None = None
    num_scheduler_steps: int = _ARGS.num_scheduler_steps
    sliding_window: int = 0

    @classmethod
    def from_server_args(cls, args: ServerArgs, cache: CacheConfig, max_context_len: int,
                         dp: int = 1) -> SchedulerConfig:
        """One scheduler's config: `cache` is its pool (one dp rank's share under
        data-parallel attention, which also splits max_running_requests over the ranks);
        max_context_len is the runner's longest sequence."""
        # Every field the options name alike is the option's value.
        same = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                if hasattr(args, f.name)}
        return cls(**{**same, "cache": cache,
                      "max_running_requests": args.max_running_requests // dp,
                      "overlap": not args.disable_overlap_schedule,
                      "max_context_len": max_context_len})

    def __post_init__(self) -> None:
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy={self.schedule_policy!r}: expected 'fcfs' or 'lpm'")
        for name in ("max_running_requests", "max_prefill_tokens", "max_extend_seqs",
                     "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size} must be >= 0")
        if self.cache.num_pages < 2:
            raise ValueError(f"num_pages={self.cache.num_pages}: page 0 is reserved, need >= 2")

    @property
    def chunk_size(self) -> int | None:
        """Chunked-prefill size, None when chunking is off."""
        return self.chunked_prefill_size or None


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Device-side knobs: dtype, attention backend and the static shape buckets.

    Every (mode, bucket) pair is one trace, compiled at start-up:
      DECODE: decode_buckets x kv_len_buckets
      EXTEND: extend_token_buckets x extend_seq_buckets x kv_len_buckets
      MIXED (enable_mixed): extend_token_buckets x extend_seq_buckets x decode_buckets
        x kv_len_buckets
    kv_len_buckets bound the page-table width, so a short batch never gathers the
    pages a long context would need.

    The server derives every field from ServerArgs (engine_setup.runner_config). Fields
    that ServerArgs resolves at start-up (dtype, backends, buckets, per_layer_weights,
    max_top_logprobs, split_min_tokens, tbo_min_tokens) default here to the smallest
    program, for runners that tests build directly; the others share ServerArgs' default.
    """

    dtype: str = "float32"
    # The KV pool's dtype; "auto": the weights' dtype (SGLang's --kv_cache_dtype).
    kv_cache_dtype: str = _ARGS.kv_cache_dtype
    attention_backend: str = "xla"
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    extend_token_buckets: tuple[int, ...] = (64, 256, 512)
    extend_seq_buckets: tuple[int, ...] = (1, 4)
    kv_len_buckets: tuple[int, ...] = (256, 1024, 8192)
    enable_mixed: bool = _ARGS.enable_mixed_chunk
    # The decode-first policy's MIXED programs (runtime/prefill_policy.policy_shapes), as
    # (extend tokens, extend rows, decode rows); only without enable_mixed, which compiles
    # every MIXED bucket.
    mixed_shapes: tuple[tuple[int, int, int], ...] = ()
    max_top_logprobs: int = 0
    strict_compile: bool = _ARGS.strict_compile
    # Keep layer weights as separate per-layer buffers picked by lax.switch instead of
    # slicing the stacked arrays (models.llama.run_layers): XLA CPU copies every slice
    # for its dot (the packed kernel reads the stack in place: default_per_layer_weights).
    per_layer_weights: bool = False
    # One matrix for wq|wk|wv and one for w_gate|w_up (models.layers.fuse_projections):
    # XLA GPU keeps the one-row products gemms (default_fuse_projections).
    fuse_projections: bool = False
    # "packed": matmuls through cpu_kernels (weights packed at load, float32, bfloat16 or
    # int8 (`quantization`), activations float32 between ops; CPU only); "xla": XLA's dot.
    cpu_matmul: str = "xla"
    # Compile SPLIT_PREFILL executables (runtime/split_prefill.py) for every extend bucket.
    enable_split_prefill: bool = _ARGS.enable_split_prefill
    # An interval size compiled besides the even sizes to 8 and the depth (fixed k).
    split_prefill_layers: int | None = _ARGS.split_prefill_layers
    # Compile the fused decode + interval programs (runtime/fused_step.py).
    multiplex_fused: bool = _ARGS.multiplex_fused
    # Extend buckets with fewer tokens get no split programs (they prefill whole).
    split_min_tokens: int = 0
    # The decode-first policy's layer intervals (runtime/prefill_policy.py): split-prefill
    # programs for one row of this extend bucket only (0: none; enable_split_prefill
    # compiles every bucket's).
    policy_split_tokens: int = 0
    # "int8": weight-only int8 matrices on the packed CPU matmul (cpu_kernels.pack_int8),
    # the rest in `dtype`; None: the matrices in `dtype` too.
    quantization: str | None = _ARGS.quantization
    # bf16 matrices on the packed CPU matmul stored in 12 bits each, losslessly
    # (cpu_kernels.pack_x12): 3/4 of bf16's bytes for a memory-bound decode step, the same
    # weights and products (the exceptions summed after them).
    compress_weights: bool = _ARGS.compress_weights
    # Two-batch overlap (runtime/two_batch_overlap.py, runtime/tbo_step.py): MoE batches
    # of at least tbo_min_tokens tokens run as two overlapped micro-batches.
    enable_two_batch_overlap: bool = _ARGS.enable_two_batch_overlap
    tbo_token_distribution_threshold: float = _ARGS.tbo_token_distribution_threshold
    tbo_min_tokens: int = 128
    # Decode steps of one multi-step program (runtime/multi_step.py), compiled for every
    # DECODE bucket when > 1 (vLLM's --num-scheduler-steps).
    num_scheduler_steps: int = _ARGS.num_scheduler_steps
    # Drafted tokens a TARGET_VERIFY program scores per row (runtime/paths/spec.py),
    # compiled for every decode bucket when > 0; 0: no speculative decoding.
    speculative_num_draft_tokens: int = 0
    # A model with sliding and global layers keeps its sliding layers' K/V in per-slot
    # rings of window + the longest extend (models/kv_pool.py); plain steps only.
    sliding_window_rings: bool = _ARGS.sliding_window_rings

    def __post_init__(self) -> None:
        if self.speculative_num_draft_tokens < 0:
            raise ValueError(f"speculative_num_draft_tokens={self.speculative_num_draft_tokens}"
                             " must be >= 0")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} must be >= 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: expected 'float32' or 'bfloat16'")
        if self.cpu_matmul not in ("xla", "packed"):
            raise ValueError(f"cpu_matmul={self.cpu_matmul!r}: expected 'xla' or 'packed'")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization={self.quantization!r}: expected None or 'int8'")
        if self.quantization and self.cpu_matmul != "packed":
            raise ValueError(f"quantization={self.quantization!r} runs on the packed CPU "
                             "matmul (cpu_kernels: a CPU backend, x86-64 with AVX-512 or "
                             "AVX2 + FMA, a dense Llama-family model), not on "
                             f"cpu_matmul={self.cpu_matmul!r}")
        if self.compress_weights and (self.dtype != "bfloat16" or self.cpu_matmul != "packed"
                                      or self.quantization):
            raise ValueError("compress_weights stores bfloat16 weights of the packed CPU "
                             f"matmul; this is dtype={self.dtype!r}, cpu_matmul="
                             f"{self.cpu_matmul!r}, quantization={self.quantization!r}")
        if self.attention_backend not in ("xla", "cpu", "pallas"):
            raise ValueError(f"attention_backend={self.attention_backend!r}: "
                             "expected 'xla', 'cpu' or 'pallas'")
        if not 0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise ValueError(f"tbo_token_distribution_threshold="
                             f"{self.tbo_token_distribution_threshold} must be in [0, 0.5]")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: expected 'auto', "
                             "'float32' or 'bfloat16'")
        for name in ("decode_buckets", "extend_token_buckets", "extend_seq_buckets",
                     "kv_len_buckets"):
            b = getattr(self, name)
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(f"{name}={b}: need a non-empty increasing tuple of ints >= 1")

    @property
    def kv_dtype(self) -> str:
        """The KV pool's dtype, "auto" resolved."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def activation_dtype(self) -> str:
        """Hidden states' dtype between ops: float32 on the packed CPU path whatever the
        weights (its matmuls accumulate and return f32), else the weights' dtype."""
        return "float32" if self.cpu_matmul == "packed" else self.dtype
