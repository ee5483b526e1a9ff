"""Frozen configuration dataclasses.

Everything that decides a trace's shape or behaviour is here and is hashable, so a
config can be a static argument of `jax.jit`. Nothing in this module imports jax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from runtime.server_args import ServerArgs

__all__ = ["CacheConfig", "ModelConfig", "RopeScaling", "RunnerConfig", "SchedulerConfig",
           "ServerArgs"]

# The defaults that SchedulerConfig and CacheConfig share with the server's options.
_ARGS = ServerArgs()


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: the Llama family (Llama 2/3, SmolLM2, Qwen2 dense) or,
    with num_experts > 0, a mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over each q / k head before rope (Qwen3)
    # Mixture of experts (0 experts: a dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "")]
        arch = archs[0]
        known = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "llama": "llama",
                 "qwen2": "qwen2", "MistralForCausalLM": "llama",
                 **{a: m for m, a in _MOE_ARCHS.items()}, **{m: m for m in _MOE_ARCHS}}
        if arch not in known:
            supported = sorted(a for a in known if a[0].isupper())
            raise ValueError(f"unknown architecture {arch!r}; supported: {supported}")
        family = known[arch]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes the scaling into rope_parameters
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rs.get("rope_type", rs.get("type", "default"))
        rope_scaling = None
        if kind != "default":
            if kind != "llama3":
                raise ValueError(f"unsupported rope_scaling type {kind!r} (only 'llama3')")
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2-MoE names its q/k/v bias qkv_bias (default on)
            attention_bias=bool(cfg.get("attention_bias", cfg.get(
                "qkv_bias", family in ("qwen2", "qwen2_moe")))),
            rope_scaling=rope_scaling,
            architecture=family,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(cfg, family),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


_MOE_ARCHS = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields of an HF MoE config (none for a dense family)."""
    if family not in _MOE_ARCHS:
        return {}
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense layers inside a MoE model (mlp_only_layers / "
                         "decoder_sparse_step != 1) are not supported")
    if cfg.get("use_sliding_window") or (family == "mixtral" and cfg.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported")
    if family == "mixtral":  # top-k renormalized; experts are intermediate_size wide
        return dict(num_experts=cfg["num_local_experts"],
                    num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                qk_norm=family == "qwen3_moe")


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

    @classmethod
    def from_server_args(cls, args: ServerArgs, cache: CacheConfig, max_context_len: int,
                         dp: int = 1) -> SchedulerConfig:
        """One scheduler's config: `cache` is its pool (one dp rank's share under
        data-parallel attention, which also splits max_running_requests over the ranks);
        max_context_len is the runner's longest sequence."""
        return cls(cache=cache, max_running_requests=args.max_running_requests // dp,
                   max_prefill_tokens=args.max_prefill_tokens,
                   chunked_prefill_size=args.chunked_prefill_size,
                   max_extend_seqs=args.max_extend_seqs,
                   enable_mixed_chunk=args.enable_mixed_chunk,
                   schedule_policy=args.schedule_policy,
                   disable_prefix_cache=args.disable_prefix_cache,
                   overlap=not args.disable_overlap_schedule, max_context_len=max_context_len,
                   num_scheduler_steps=args.num_scheduler_steps)

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

    def __post_init__(self) -> None:
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
