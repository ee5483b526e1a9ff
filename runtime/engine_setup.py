"""Turning ServerArgs into a loaded model, shape buckets and a sized KV pool."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import cpu_kernels
from models import registry
from models.config import ModelConfig
from models.kv_pool import kv_bytes_per_token, ring_layers, ring_pool_pages
from runtime import prefill_policy, sharding
from runtime.config import CacheConfig, RunnerConfig, ServerArgs
from runtime.model_runner import ModelRunner
from runtime.paths import ring_pages
from runtime.server_args import Platform
from runtime.split_prefill import interval_sizes

if TYPE_CHECKING:
    from runtime.tokenizer import Tokenizer

# Checkpoints (orbax, gguf), the tokenizer (tokenizers, jinja2) and psutil are imported
# where they are used: a caller that brings its own model and pool size (scripts/
# gpu_suite.py on a bare GPU machine) needs none of them.

logger = logging.getLogger(__name__)

# A CPU pool sized from mem_fraction would be most of the machine's RAM; this many
# tokens is plenty for a CPU server and keeps start-up allocation cheap.
_CPU_DEFAULT_KV_TOKENS = 32768
# Two-batch overlap pays off from about this many tokens per expert-parallel rank
# (docs/tbo.md: SGLang's -27% at 32 and +25% at 256 tokens per device, and the cost model).
TBO_MIN_TOKENS_PER_RANK = 128


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def default_dtype(args: ServerArgs) -> str:
    return args.dtype or ("bfloat16" if on_gpu() else "float32")


def on_mesh(args: ServerArgs) -> bool:
    return args.on_mesh


def _cpu_kernels_off(args: ServerArgs) -> str | None:
    """Why cpu_kernels can't serve these args (None: they can)."""
    if on_gpu():
        return "the backend is a GPU"
    if on_mesh(args):
        return (f"a device mesh (dp={args.dp}, tp={args.tp}, ep={args.ep}: the CPU kernels are "
                "single-device)")
    return cpu_kernels.unavailable_reason()


def platform(args: ServerArgs) -> Platform:
    """This machine's facts that `args` depend on (ServerArgs.validate's platform); the
    CPU kernels are asked only where they matter (on a CPU, without a mesh)."""
    gpu = on_gpu()
    return Platform(
        on_gpu=gpu,
        cpu_kernels_unavailable=None if gpu or on_mesh(args) else cpu_kernels.unavailable_reason(),
        x12_unavailable=cpu_kernels.x12_unavailable_reason() if args.compress_weights else None)


def _default_cpu_kernel_choice(args: ServerArgs, flag: str, value: str | None, ours: str,
                               fallback: str) -> str:
    """An explicit value, checked against this machine; else ours wherever it can run."""
    if value is not None:
        args.validate(platform(args))
        return value
    reason = _cpu_kernels_off(args)
    if reason is not None and not on_gpu():
        logger.warning("%s: CPU kernels off (%s), using %s (slower)", flag, reason, fallback)
    return fallback if reason is not None else ours


def default_cpu_matmul(args: ServerArgs, model_cfg: ModelConfig | None = None) -> str:
    """`packed` (cpu_kernels) wherever it runs: CPU backend, x86-64 with AVX-512
    or AVX2 + FMA and a C++ compiler, a dense Llama-family model; else XLA's dot."""
    if args.cpu_matmul is None and model_cfg and not registry.has_packed_matmul(model_cfg):
        logger.info("cpu_matmul: xla (the packed CPU matmul covers dense Llama weights, not "
                    "%s)", model_cfg.architecture)
        return "xla"
    return _default_cpu_kernel_choice(args, "cpu_matmul", args.cpu_matmul, "packed", "xla")


def default_per_layer_weights(args: ServerArgs, cpu_matmul: str) -> bool:
    """Per-layer weight buffers behind a lax.switch wherever XLA's dot runs, CPU or GPU:
    both copy a dynamic slice of the stacked weights before every dot (on an H100 / H200
    the scanned 8B decode step moves 2.5-2.9x the bytes of the per-layer one, and an
    unrolled scan no fewer, with 12 GiB of temporaries: docs/gpu.md). The stacked tree
    under two-batch overlap (models/moe_overlap.py) and for the packed CPU matmul, which
    reads the traced layer's panels in place (1.05x a one-row decode step and 1.02-1.05x
    an 8- or 32-row one over the switch, interleaved A/B in docs/benchmarks.md)."""
    return not (args.enable_two_batch_overlap or cpu_matmul == "packed")


def default_fuse_projections(args: ServerArgs, cpu_matmul: str,
                             gpu: bool | None = None) -> bool:
    """Fused wq|wk|wv and w_gate|w_up on a GPU (models.layers.fuse_projections: XLA GPU
    turns a one-row product with an 8B model's wk or wv into a multiply + reduce that
    writes a weight-sized temporary; the fused product stays a gemm), except under tensor
    parallelism, whose column shards must be each device's own heads. `gpu`: the answer
    for a GPU backend (None: this process's)."""
    gpu = on_gpu() if gpu is None else gpu
    return gpu and cpu_matmul == "xla" and args.tp == 1


def default_attention_backend(args: ServerArgs) -> str:
    """`pallas` on a GPU; on a CPU `cpu` (decode and prefill attention through
    cpu_kernels) wherever the kernels run, else `xla` (the jnp path)."""
    if args.attention_backend is None and on_gpu():
        if on_mesh(args):  # Pallas on a mesh has not run on a multi-GPU machine yet
            logger.info("attention_backend: xla on the device mesh (tp=%d, ep=%d)", args.tp,
                        args.ep)
            return "xla"
        return "pallas"
    return _default_cpu_kernel_choice(args, "attention_backend", args.attention_backend,
                                      "cpu", "xla")


def _tokenizer_for(path: str) -> Tokenizer | None:
    from runtime.tokenizer import Tokenizer

    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    return None


def load_model(args: ServerArgs) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Load weights and tokenizer for `args.model` (see ServerArgs.model)."""
    from runtime import checkpoint
    from runtime.tokenizer import Tokenizer

    dtype = default_dtype(args)
    path = args.model
    if path in registry.PRESETS:
        cfg, params = registry.load_preset(path, dtype)
        return cfg, params, Tokenizer.from_gguf(checkpoint.default_gguf_path())
    if path == "default":
        path = checkpoint.ensure_default_checkpoint(
            os.path.expanduser(args.checkpoint_cache_dir), dtype)
    path = os.path.abspath(os.path.expanduser(path))
    if checkpoint.is_complete_checkpoint(path):
        cfg, params = checkpoint.restore_checkpoint(path, dtype=dtype)
        source = checkpoint.read_tokenizer_source(path)
        tokenizer = _tokenizer_for(source) if source else None
    elif os.path.isdir(path):
        cfg, params = _restore_hf_folder(args, path, dtype)
        tokenizer = _tokenizer_for(path)
    else:
        cfg, params = checkpoint.load_any(path)
        tokenizer = _tokenizer_for(path)
    if tokenizer is None:
        logger.warning("no tokenizer found for %s: only input_ids prompts work", path)
    return cfg, params, tokenizer


def load_draft_model(args: ServerArgs) -> tuple[ModelConfig, dict] | None:
    """The draft model of --speculative_algorithm=standalone (any path --model takes)."""
    if args.speculative_algorithm != "standalone":
        return None
    assert args.speculative_draft_model_path  # validate() asks for it
    path = args.speculative_draft_model_path
    try:
        cfg, params, _ = load_model(dataclasses.replace(args, model=path))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--speculative_draft_model_path={path}: cannot load the draft model "
                         f"of --speculative_algorithm=standalone: {e}") from e
    return cfg, params


def _restore_hf_folder(args: ServerArgs, path: str, dtype: str) -> tuple[ModelConfig, dict]:
    """A Hugging Face folder straight onto the device or the serving mesh (runtime/
    hf_loader.py): FP8 weights stay FP8 on GPUs (a mesh splits their scales with them),
    dequantized on the CPU."""
    from runtime import checkpoint, hf_loader

    # Several processes: each loads to its own device and the runner places its shards.
    mesh = (serving_mesh(args, checkpoint.load_hf_config(path)) if jax.process_count() == 1
            else None)
    cfg, params, stats = hf_loader.restore_hf(path, dtype, mesh=mesh,
                                              keep_fp8=on_gpu())
    shard, over = stats.largest_shard_bytes, stats.host_overhead_bytes(not on_gpu())
    memory = ("" if over is None else
              f"; peak RSS {stats.peak_rss_bytes / 2**30:.2f} GiB, the loader's host memory "
              f"beyond the weights {over / 2**30:.2f} GiB = {over / shard:.2f}x the largest shard")
    logger.info("loaded %s in %.1f s: %d shard(s), largest %.2f GiB, params %.2f GiB%s", path,
                stats.seconds, stats.num_shards, shard / 2**30, stats.params_bytes / 2**30,
                memory)
    return cfg, params


def _powers(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo * factor, ... capped with hi itself as the last bucket."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out + [hi])


def serving_mesh(args: ServerArgs, model_cfg: ModelConfig) -> Mesh | None:
    """The runner's device mesh for --dp/--tp/--ep (None: one device)."""
    return _mesh(model_cfg, args.dp, args.tp, args.ep)


def _mesh(model_cfg: ModelConfig, dp: int, tp: int, ep: int) -> Mesh | None:
    """serving_mesh; with several processes (jax.distributed) it must hold every device of
    every process, or a process would own none of the mesh and run nothing."""
    mesh = sharding.serving_mesh(model_cfg, dp=dp, tp=tp, ep=ep)
    if jax.process_count() > 1:
        n = 1 if mesh is None else mesh.devices.size
        if n != jax.device_count():
            raise ValueError(
                f"a {jax.process_count()}-process mesh must use all {jax.device_count()} "
                f"devices ({jax.local_device_count()} per process): dp x tp x ep = "
                f"{dp} x {tp} x {ep} = {n}")
    if mesh is not None:
        logger.info("device mesh %s on %d devices (%d processes): XLA's dot and the jnp "
                    "attention", dict(mesh.shape), mesh.devices.size, jax.process_count())
    return mesh


@dataclasses.dataclass(frozen=True)
class RunnerSetup:
    """Everything that decides a ModelRunner but its weights. One process derives it from
    ServerArgs (runner_config, size_kv_pool); on a multi-process mesh rank 0's is sent to
    the other ranks, which build theirs from it, so every process compiles the same
    executables over the same pool whatever its own free memory or defaults."""

    model_cfg: ModelConfig
    cache: CacheConfig
    runner_cfg: RunnerConfig
    max_running_requests: int
    dp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def from_args(cls, args: ServerArgs, model_cfg: ModelConfig,
                  draft_cfg: ModelConfig | None = None) -> RunnerSetup:
        """`draft_cfg`: the draft model's (--speculative_algorithm=standalone), whose pool
        shares the memory budget."""
        rcfg = runner_config(args, model_cfg)
        pages = size_kv_pool(args, model_cfg, rcfg.kv_dtype, draft_cfg,
                             ring_pages(model_cfg, rcfg, args.page_size))
        if args.dp > 1:  # each data-parallel rank: its share and a padding page of its own
            pages = args.dp * ((pages - 1) // args.dp + 1)
        cache = CacheConfig(page_size=args.page_size, num_pages=pages)
        return cls(model_cfg, cache, rcfg, args.max_running_requests, args.dp, args.tp, args.ep)

    def build(self, params: dict, draft: tuple[ModelConfig, dict] | None = None
              ) -> ModelRunner:
        """The runner, warmed up (every executable compiled); `draft`: the draft model of
        --speculative_algorithm=standalone."""
        mesh = _mesh(self.model_cfg, self.dp, self.tp, self.ep)
        runner = ModelRunner(self.model_cfg, params, self.cache, self.runner_cfg,
                             self.max_running_requests, mesh=mesh, draft=draft)
        runner.warmup()
        return runner


def runner_config(args: ServerArgs, model_cfg: ModelConfig) -> RunnerConfig:
    """Buckets: decode batch sizes in powers of two up to max_running_requests; extend
    token counts in powers of four up to the largest extend batch; KV lengths in powers
    of four up to the model's context."""
    args.validate(platform(args))
    chunk = args.chunked_prefill_size or 0
    max_extend = min(args.max_prefill_tokens, chunk) if chunk else model_cfg.max_position_embeddings
    context = model_cfg.max_position_embeddings
    page = args.page_size
    kv = args.kv_len_buckets or _powers(min(256, context), context, 4)
    if any(b % page for b in kv):  # validate() checked given ones: these are derived
        raise ValueError(f"kv_len_buckets {kv} (from the model's context {context}) are not "
                         f"multiples of --page_size={page}: pass --kv_len_buckets")
    if args.dp > 1:
        if not args.enable_mixed_chunk:
            logger.info("dp=%d: MIXED buckets compiled (one rank may prefill while another "
                        "decodes in the same step)", args.dp)
    # Under dp every bucket is one rank's: decode rows up to its share of the requests.
    per_rank_running = args.max_running_requests // args.dp
    cpu_matmul = default_cpu_matmul(args, model_cfg)
    chunks = prefill_policy.chunk_buckets(max_extend)
    # The policy's layer intervals where one can be a finer step than the smallest chunk
    # (deep models); not on the sliding-window rings, whose pools the split programs
    # would not address.
    policy_split = (max_extend if args.decode_first and args.policy_layer_intervals
                    and not args.sliding_window_rings
                    and prefill_policy.split_pays(model_cfg.num_layers,
                                                  min(interval_sizes(model_cfg.num_layers,
                                                                     args.split_prefill_layers)),
                                                  max_extend, chunks[0]) else 0)
    return RunnerConfig(
        dtype=default_dtype(args),
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=default_attention_backend(args),
        decode_buckets=args.decode_buckets or _powers(1, per_rank_running, 2),
        extend_token_buckets=args.extend_token_buckets or _powers(min(64, max_extend),
                                                                  max_extend, 4),
        extend_seq_buckets=tuple(sorted({1, args.max_extend_seqs})),
        kv_len_buckets=kv,
        enable_mixed=args.enable_mixed_chunk or args.dp > 1,
        mixed_shapes=(prefill_policy.policy_shapes(
            chunks, args.max_extend_seqs,
            args.max_running_requests) if args.decode_first else ()),
        max_top_logprobs=args.max_top_logprobs,
        strict_compile=args.strict_compile,
        per_layer_weights=(default_per_layer_weights(args, cpu_matmul)
                           if args.per_layer_weights is None else args.per_layer_weights),
        fuse_projections=(default_fuse_projections(args, cpu_matmul)
                          if args.fuse_projections is None else args.fuse_projections),
        cpu_matmul=cpu_matmul,
        quantization=args.quantization,
        compress_weights=args.compress_weights,
        enable_split_prefill=args.enable_split_prefill or args.enable_multiplexing,
        split_prefill_layers=args.split_prefill_layers,
        multiplex_fused=args.multiplex_fused,
        split_min_tokens=args.split_prefill_min_tokens,
        policy_split_tokens=policy_split,
        enable_two_batch_overlap=args.enable_two_batch_overlap,
        num_scheduler_steps=args.num_scheduler_steps,
        sliding_window_rings=args.sliding_window_rings,
        speculative_num_draft_tokens=(args.speculative_num_draft_tokens
                                      if args.speculative_algorithm else 0),
        tbo_token_distribution_threshold=args.tbo_token_distribution_threshold,
        tbo_min_tokens=(TBO_MIN_TOKENS_PER_RANK * args.ep if args.tbo_min_tokens is None
                        else args.tbo_min_tokens),
    )


def free_device_bytes() -> int:
    """Device memory not in use (the first device's), as XLA reports it."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)


def size_kv_pool(args: ServerArgs, model_cfg: ModelConfig, dtype: str,
                 draft_cfg: ModelConfig | None = None, ring_pages: int = 0) -> int:
    """Number of pages (page 0 included) from max_total_tokens, else from mem_fraction of
    the free device memory (GPU) or a fixed CPU default. What else lives in the budget
    comes out of it first:
    - a draft model (`draft_cfg`) keeps a pool of as many pages (runtime/paths/draft.py)
      and its q rows, so a token costs the target's and the draft's K/V;
    - with sliding-window rings of `ring_pages` pages (models/kv_pool.py) a main-pool
      token costs the global layers only, and the ring pool (one ring per request slot)
      is reserved."""
    kv = jnp.dtype(dtype)
    glob, slide = ring_layers(model_cfg) if ring_pages else (range(model_cfg.num_layers), ())
    per_token = kv_bytes_per_token(model_cfg, kv, len(glob))
    draft_per_token = 0 if draft_cfg is None else kv_bytes_per_token(draft_cfg, kv)
    q_bytes = 0 if draft_cfg is None else (4 * (args.max_running_requests + 1)
                                           * args.speculative_num_draft_tokens
                                           * draft_cfg.vocab_size)
    ring_bytes = (ring_pool_pages(ring_pages, args.max_running_requests + 1) * args.page_size
                  * kv_bytes_per_token(model_cfg, kv, len(slide))) if ring_pages else 0
    reserved = q_bytes + ring_bytes
    tokens = args.max_total_tokens
    if tokens is None and on_gpu():
        budget = int(free_device_bytes() * args.mem_fraction) - reserved
        tokens = max(0, budget) // (per_token + draft_per_token)
    elif tokens is None:
        import psutil

        budget = int(psutil.virtual_memory().available * args.mem_fraction) - reserved
        tokens = min(_CPU_DEFAULT_KV_TOKENS, max(0, budget) // (per_token + draft_per_token))
    pages = tokens // args.page_size + 1
    gib = pages * args.page_size / 2**30
    logger.info("KV pool: %d pages x %d tokens (%.2f GiB)%s", pages, args.page_size,
                gib * per_token, "" if draft_cfg is None else
                f"; the draft model's pool as many pages ({gib * draft_per_token:.2f} GiB) "
                f"and its q rows ({q_bytes / 2**30:.2f} GiB)")
    if ring_pages:
        logger.info("sliding-window ring pool: %d slots x %d pages x %d tokens (%.2f GiB)",
                    args.max_running_requests + 1, ring_pages, args.page_size,
                    ring_bytes / 2**30)
    return pages
